"""LoRA DPO on one device or with FSDP2 on every rank of one node or many, GPUs or CPUs, whose
every step is the full-batch step of its window.

A drop-in for torchtune 0.6.1's ``lora_dpo_single_device`` and ``lora_dpo_distributed``: this one
file runs under both names (``tune ls``: ``exactga/<name>``), and their configs run unchanged,
with the same artefacts, written by rank 0 (adapter weights in torchtune's and PEFT's format with
``adapter_config.json``; merged full weights unless ``save_adapter_weights_only``). The reference
is the policy with its adapters off. Under torchrun it trains on every rank, else on one device
(or as one rank, launched as the distributed name or with a distributed config): see [one recipe,
two launches] in exactga.launch.twins. What differs from stock is each optimizer step: the loss
is the mean of torchtune's per-pair ``DPOLoss`` (or ``RSOLoss``) over every pair of the window on
every rank, whatever the split into ranks and micro-batches, where stock divides each
micro-batch's mean by the accumulation count and lets FSDP average ranks; ranks may hold
different numbers of pairs; ``device: cpu`` runs distributed (gloo), which stock 0.6.1 does not.
See [pairs as loss units] in ``exactga.dpo.preference`` and docs/dpo.md.

Launch from the repository root (or any folder holding your copy of this file)::

    tune run recipes/lora_dpo.py --config configs/tiny/lora_dpo_single_device.yaml
    tune run recipes/lora_dpo.py --config llama3_1/8B_lora_dpo_single_device
    tune run --nproc_per_node 2 recipes/lora_dpo.py --config configs/tiny/lora_dpo_distributed.yaml
    tune run --nproc_per_node 8 recipes/lora_dpo.py --config llama3_1/8B_lora_dpo

Copy this file to change the loop (``tune cp exactga/lora_dpo_single_device my.py``; the
distributed name copies the same file); the numerics stay in ``exactga``.
"""

import sys

import torch
from omegaconf import DictConfig
from torchtune import config, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.data.loader import load_dataset, model_vocab_size
from exactga.dpo.log_probs import lora_reference
from exactga.dpo.loss import dpo_micro_batch_loss
from exactga.dpo.schema import DPO_FINGERPRINT_KEYS, LORA_DPO, LoraDpoConfig
from exactga.dpo.terms import DpoTerms
from exactga.dpo.validation import preference_validation_from_settings, preference_validation_loss
from exactga.dpo.wiring import preference_run
from exactga.launch.cli import run_recipe
from exactga.lora.adapters import LoraSettings
from exactga.runtime.runtime import Runtime
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

# The family of torchtune's two names for this file: lora_dpo_single_device and
# lora_dpo_distributed (see [one recipe, two launches] in exactga.launch.twins).
RECIPE_NAME = "lora_dpo"


class LoRADPORecipe(FTRecipeInterface):
    """Direct preference optimisation of LoRA (DoRA, QLoRA) adapters on one device, or with
    FSDP2 on every rank.

    The base weights are frozen (and sharded, distributed); only the adapters train and are
    reduced across ranks. The reference log-probs come from the same model with its adapters
    off, under no_grad, before the policy's forward.

    Features (each a config key; defaults in ``exactga.config.schemas`` and
    ``exactga.dpo.schema``):
        - Exact accumulation over pairs (``gradient_accumulation_steps``), micro-batches and
          data-parallel ranks: each window's pairs are counted on the host (distributed: one
          all-reduce of the count per step) and each micro-batch's mean loss over its pairs is
          scaled by ``dp_size * batch_pairs / window_pairs`` before backward. An epoch's last,
          short window is a step of its own (``drop_partial_window: True`` drops it); stock
          leaks its leftover micro-batches' gradient into the next epoch's first step.
        - ``loss`` beyond torchtune's ``DPOLoss`` and ``RSOLoss``: ``exactga.dpo.losses``'
          ``SimPOLoss`` and ``ORPOLoss`` (reference-free: no reference model is built or run;
          ORPO's NLL over the chosen tokens), ``IPOLoss``, and ``exactga.dpo.kto.KTOLoss`` on
          unpaired examples (``exactga.dpo.kto.kto_dataset``) against a reference point over
          the whole window and every rank, computed before its backward passes (logged as
          ``kl``). See docs/dpo.md.
        - ``rpo_alpha`` (exactga): adds ``rpo_alpha`` times the chosen responses' NLL, a mean
          over the window's chosen tokens, weighted by its own units (RPO; exact where TRL
          averages per micro-batch); ``sequence_log_prob: mean`` length-normalises each
          response's log-prob (null: the loss's own). Off by default: stock's loss, by the same
          code.
        - ``micro_batching`` on pairs, per rank: ``by_length`` (default: pairs sorted by their
          longer side), ``fixed`` (stock's order), ``token_budget`` (``micro_batch_tokens``
          bounds the ``2 x pairs x longest`` positions of a micro-batch; distributed, a rank
          with fewer micro-batches runs zero-weight fillers, one real pair each, so FSDP's
          collectives pair up and the gradient is exactly unchanged). Exact in every mode.
        - Log-probs only at response positions (the output projection runs nowhere else),
          each term in fp32 at least, summed in fp64.
        - ``loss_normalization``: ``exact`` (default) or ``naive``, stock's weighting (each
          micro-batch's mean over its pairs divided by the number of micro-batches).
        - Precision, ``master_weights``, activation checkpointing and offloading, ``compile``,
          ``clip_grad_norm``, schedulers, low-bit optimizers, and distributed
          ``gradient_sync`` and the FSDP2 keys (``fsdp_cpu_offload``,
          ``fsdp_reshard_after_forward``, ``custom_sharded_layers``): as in the LoRA SFT recipe.
        - Checkpoints at each epoch's end as stock (distributed: gathered to and written by
          rank 0); with ``save_every_n_steps`` atomic step checkpoints that
          ``resume_from_checkpoint`` goes on from with the next window, also on another number
          of data-parallel ranks with the same global batch (docs/reliability.md).
        - ``nonfinite_loss``: a NaN/inf loss (on any rank) skips the step everywhere (``skip``)
          or stops (``stop``).
        - Validation (``dataset_val``, ``run_val_every_n_steps``, ``batch_size_val``,
          ``max_val_batches``): ``val/loss`` (the per-pair loss over every validation pair of
          every rank / their number), ``val/rewards/accuracy`` (a count of pairs over pairs),
          ``val/rewards/margins``, ``val/rewards/chosen``, ``val/rewards/rejected``, with the
          reference as training computes it (the policy with its adapters off); KTO:
          ``val/loss`` over every example against the set's reference point ``val/kl``
          (docs/validation.md).
          ``keep_best_checkpoint``: the weights of each new lowest ``val/loss`` as an epoch
          folder in ``best/``, resume-safe.
        - Logging, on rank 0: ``loss`` (the exact window loss over all ranks), ``lr``,
          ``pairs`` (the window's pairs), ``tokens_per_second_per_gpu`` (rank 0's pairs' own
          tokens, padding excluded), stock's ``rewards/*`` and ``log_probs/*`` as means over
          the window's pairs on every rank (stock logs the last micro-batch's), and the
          profiler's scalars. Stock's ``logits/*`` (means over every padded position's logits)
          are not logged: no logits exist off the responses. With ``rpo_alpha``: ``dpo_loss``
          and ``chosen_nll``, the loss's two terms.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up.
    """

    def __init__(self, cfg: LoraDpoConfig) -> None:
        # Device, precision policy, kernels, threads and the seed, and distributed the process
        # group and the data-parallel mesh; see [setup order].
        self._runtime = Runtime.for_settings(cfg)
        self._lora = LoraSettings.from_config(cfg.model)  # read from the model, as stock does
        self._clip_grad_norm = cfg.clip_grad_norm

    def setup(self, cfg: LoraDpoConfig) -> None:
        # Resume point, metric logger, torchtune's checkpointer and the frozen base it read.
        start = RunStart(cfg, self._runtime, DPO_FINGERPRINT_KEYS)
        self._model = start.build_model(cfg.model, start.adapter_weights(self._lora))
        self._activations_ctx = start.activations_ctx  # activation offloading, or nothing
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = start.build_optimizer(cfg.optimizer, self._model)  # the adapters'
        # One loss per pair (with rpo_alpha or ORPO also an NLL over the chosen tokens), and
        # what it needs of the step: see exactga.dpo.terms.DpoTerms.
        self._loss_fn = config.instantiate(cfg.loss)
        self._dpo_terms = DpoTerms.for_loss(
            self._loss_fn, rpo_alpha=cfg.rpo_alpha, sequence_log_prob=cfg.sequence_log_prob
        )
        # Row checks, data order and loader position: see [data order] in exactga.data.loader.
        dataset = load_dataset(cfg.dataset, self._tokenizer, model_vocab_size(self._model))
        # The reference (the policy with its adapters off; none for SimPO and ORPO; or its log-probs
        # computed once), KTO's reference point over each whole window, the normaliser weighing
        # each term by its own units over every rank, and the metrics: one call, so that a copy
        # cannot wire them apart.
        prefs = preference_run(
            cfg,
            self._loss_fn,
            self._dpo_terms,
            dataset,
            model=self._model,
            reference=None
            if self._dpo_terms.reference_free
            else lora_reference(self._model, self._runtime.precision),
            pad_id=self._tokenizer.pad_id,
            runtime=self._runtime,
        )
        self._reference, self._reference_point = prefs.reference, prefs.reference_point
        self._metrics = prefs.metrics
        dataloader = start.dataloader(
            prefs.dataset, padding_idx=self._tokenizer.pad_id, ignore_idx=IGNORE_INDEX
        )
        # Validation during training (dataset_val; none without it): docs/validation.md.
        self._validation = preference_validation_from_settings(
            cfg,
            terms=self._dpo_terms,
            tokenizer=self._tokenizer,
            loss_fn=self._loss_fn,
            model=self._model,
            runtime=self._runtime,
            metric_logger=start.metric_logger,
        )
        # Validation runs the reference itself (a precomputed table holds the training pairs'):
        # the policy with its adapters off; none for a reference-free loss.
        self._validation_reference = (
            None
            if self._dpo_terms.reference_free
            else lora_reference(self._model, self._runtime.precision)
        )
        # Checkpoints (adapters, and merged weights), scheduler, profiler, logs: set up last.
        self._run = start.training_run(
            self._model,
            self._optimizer,
            dataloader,
            prefs.normalizer,
            lora=self._lora,
            window_metrics=self._metrics.window_metrics,  # rewards, margins, accuracy
            track=self._metrics.track,
            validation=self._validation,  # its step checkpoints and keep_best_checkpoint
        )

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        """Reference and policy log-probs, and the mean DPO loss over the micro-batch's pairs."""
        return dpo_micro_batch_loss(
            self._model,
            self._loss_fn,
            batch,
            self._reference,
            terms=self._dpo_terms,
            metrics=self._metrics,
            precision=self._runtime.precision,
            activations_ctx=self._activations_ctx,
            reference_point=self._reference_point,  # KTO's, for the whole window
        )

    def train(self) -> None:
        with self._run as steps:  # the profiler, the progress bar and the closing report
            for curr_epoch in steps.epochs():
                for window in steps.windows(curr_epoch):
                    for batch in window:  # this rank's micro-batches of pairs; fillers: weight 0
                        loss = self._loss_step(batch)  # forward and mean loss: edit here
                        window.backward(loss)  # weighed by its exact share, then backward
                    outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                    steps.end_step(window, outcome)  # counters, scheduler, logs, checkpoints
                    self._validate_if_due(steps.progress.global_step)  # run_val_every_n_steps
                self._validate_if_due(steps.progress.global_step, epoch_end=True)
                steps.end_epoch(curr_epoch)

    def _validate_if_due(self, step: int, *, epoch_end: bool = False) -> None:
        """The per-pair loss, reward accuracy and margins of the validation set as one batch
        over every rank, when due; nothing without dataset_val. See [preference validation] in
        exactga.dpo.validation."""
        if self._validation is None or not self._validation.due(step, epoch_end=epoch_end):
            return
        figure = preference_validation_loss(
            self._model,
            self._loss_fn,
            self._validation.validation_set,
            self._validation_reference,
            terms=self._dpo_terms,
            device=self._runtime.device,
            precision=self._runtime.precision,
        )
        self._validation.log(figure, step)  # val/loss, val/rewards/..., a console line

    def cleanup(self) -> None:
        self._run.close()  # the metric logger, and the process group where distributed


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    # The launch's schema, one device's or the distributed one's: see [one recipe, two
    # launches] in exactga.launch.twins.
    cfg = validated_config(cfg, LORA_DPO, RECIPE_NAME)
    recipe = LoRADPORecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
