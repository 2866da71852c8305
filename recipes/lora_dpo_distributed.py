"""LoRA DPO with FSDP2 on one node or many, GPUs or CPUs, each step the full-batch step.

A drop-in for torchtune 0.6.1's ``lora_dpo_distributed``: its configs run unchanged, with the
same artefacts written by rank 0 (adapters in torchtune's and PEFT's format, merged weights
unless ``save_adapter_weights_only``). The reference is the policy with its adapters off. What
differs: each step's loss is the mean per-pair DPO loss over every pair of the window on every
rank, whatever the split into ranks and micro-batches (stock divides each micro-batch's mean by
the accumulation count and lets FSDP average ranks); ranks may hold different numbers of pairs;
``device: cpu`` runs (gloo), which stock 0.6.1 does not. See [pairs as loss units] in
``exactga.dpo.preference`` and docs/dpo.md.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/lora_dpo_distributed.py \\
        --config configs/tiny/lora_dpo_distributed.yaml
    tune run --nproc_per_node 8 recipes/lora_dpo_distributed.py --config llama3_1/8B_lora_dpo

Copy this file to change the loop; the numerics stay in ``exactga``.
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
from exactga.dpo.schema import DPO_FINGERPRINT_KEYS, LoraDpoDistributedConfig
from exactga.dpo.terms import DpoTerms
from exactga.dpo.validation import preference_validation_from_settings, preference_validation_loss
from exactga.dpo.wiring import preference_run
from exactga.launch.cli import run_recipe
from exactga.lora.adapters import LoraSettings
from exactga.runtime.runtime import Runtime
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

RECIPE_NAME = "lora_dpo_distributed"


class LoRADPORecipeDistributed(FTRecipeInterface):
    """Direct preference optimisation of LoRA (DoRA, QLoRA) adapters with FSDP2.

    The base is frozen and sharded; only the adapters train and are reduced across ranks. The
    reference log-probs come from the same model with its adapters off, under no_grad.

    Features (each a config key; defaults in ``exactga.config.schemas`` and
    ``exactga.dpo.schema``):
        - Exact accumulation over pairs, micro-batches and data-parallel ranks: one all-reduce
          of the window's pair count per step, each micro-batch's mean loss over its pairs
          scaled by ``dp_size * batch_pairs / window_pairs`` before backward. With
          ``token_budget`` a rank with fewer micro-batches runs zero-weight fillers (one real
          pair each, so FSDP's collectives pair up and the gradient is exactly unchanged).
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
        - ``micro_batching`` on pairs per rank, log-probs only at response positions,
          ``loss_normalization`` (``exact`` or stock's ``naive``), precision, master weights,
          activation checkpointing and offloading, ``compile``, ``clip_grad_norm``,
          ``gradient_sync``, FSDP2 keys (``fsdp_cpu_offload``, ``fsdp_reshard_after_forward``,
          ``custom_sharded_layers``): as in the single-device DPO and distributed LoRA recipes.
        - Checkpoints at each epoch's end, gathered to and written by rank 0; with
          ``save_every_n_steps`` atomic step checkpoints that ``resume_from_checkpoint`` goes
          on from with the next window on the same world size.
        - ``nonfinite_loss``: a NaN/inf loss on any rank skips the step everywhere or stops.
        - Validation (``dataset_val``, ``run_val_every_n_steps``, ``batch_size_val``,
          ``max_val_batches``): ``val/loss`` (the per-pair loss over every validation pair of
          every rank / their number), ``val/rewards/accuracy`` (a count of pairs over pairs),
          ``val/rewards/margins``, ``val/rewards/chosen``, ``val/rewards/rejected``, with the
          reference as training computes it (the policy with its adapters off); KTO:
          ``val/loss`` over every example against the set's reference point ``val/kl``
          (docs/validation.md).
          ``keep_best_checkpoint``: the weights of each new lowest ``val/loss`` as an epoch
          folder in ``best/``, resume-safe.
        - Rank-0-only logging: ``loss`` (the exact window loss over all ranks), ``pairs``,
          stock's ``rewards/*`` and ``log_probs/*`` as means over the window's pairs on every
          rank, ``tokens_per_second_per_gpu`` (rank 0's own tokens, padding excluded); with
          ``rpo_alpha``, ``dpo_loss`` and ``chosen_nll``, the loss's two terms.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up.
    """

    def __init__(self, cfg: LoraDpoDistributedConfig) -> None:
        # Device, process group, data-parallel mesh, precision policy, kernels, threads and
        # the seed; see [setup order].
        self._runtime = Runtime.distributed(cfg)
        self._lora = LoraSettings.from_config(cfg.model)  # read from the model, as stock does
        self._clip_grad_norm = cfg.clip_grad_norm

    def setup(self, cfg: LoraDpoDistributedConfig) -> None:
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
        self._run.close()  # the metric logger and the process group


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    cfg = validated_config(cfg, LoraDpoDistributedConfig, RECIPE_NAME)
    recipe = LoRADPORecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
