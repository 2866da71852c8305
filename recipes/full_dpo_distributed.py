"""Full DPO with FSDP2 on one node or many, GPUs or CPUs, each step the full-batch step.

A drop-in for torchtune 0.6.1's ``full_dpo_distributed``: its configs run unchanged and it
writes the same artefacts through torchtune's checkpoint client (rank 0). The reference is a
frozen copy of the model read from ``ref_checkpointer``, sharded like the policy and run under
no_grad. What differs: each step's loss is the mean per-pair DPO loss over every pair of the
window on every rank, whatever the split into ranks and micro-batches (stock divides each
micro-batch's mean by the accumulation count and lets FSDP average ranks); ``device: cpu``
runs (gloo), which stock 0.6.1 does not. See [pairs as loss units] in ``exactga.dpo.preference``
and docs/dpo.md.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/full_dpo_distributed.py \\
        --config configs/tiny/full_dpo_distributed.yaml
    tune run --nproc_per_node 8 recipes/full_dpo_distributed.py --config llama3_1/8B_full_dpo

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
from exactga.dpo.log_probs import frozen_model_reference
from exactga.dpo.loss import dpo_micro_batch_loss
from exactga.dpo.schema import FULL_DPO_FINGERPRINT_KEYS, FullDpoDistributedConfig
from exactga.dpo.terms import DpoTerms
from exactga.dpo.validation import preference_validation_from_settings, preference_validation_loss
from exactga.dpo.wiring import preference_run
from exactga.launch.cli import run_recipe
from exactga.runtime.runtime import Runtime
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

RECIPE_NAME = "full_dpo_distributed"


class FullDPORecipeDistributed(FTRecipeInterface):
    """Direct preference optimisation of every weight of a dense decoder with FSDP2.

    Policy and reference are sharded over the data-parallel ranks; the reference (weights from
    ``ref_checkpointer``, frozen at setup) runs under no_grad before the policy's forward.

    Features (each a config key; defaults in ``exactga.config.schemas`` and
    ``exactga.dpo.schema``):
        - Exact accumulation over pairs, micro-batches and data-parallel ranks: one all-reduce
          of the window's pair count per step, each micro-batch's mean loss over its pairs
          scaled by ``dp_size * batch_pairs / window_pairs`` before backward, which undoes
          FSDP's averaging; ``token_budget`` fillers as in the LoRA DPO recipe.
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
          ``loss_normalization`` (``exact`` or stock's ``naive``), precision and
          ``master_weights``, activation checkpointing (also selective with ``ac_mode``) and
          offloading, ``compile``, ``optimizer_in_bwd`` (ga = 1), ``clip_grad_norm``,
          ``gradient_sync``, FSDP2 keys: as in the full fine-tuning recipe.
        - Checkpoints of the policy at each epoch's end through torchtune's checkpoint client;
          with ``save_every_n_steps`` atomic step checkpoints that ``resume_from_checkpoint``
          goes on from with the next window, also on another number of data-parallel ranks with
          the same global batch (docs/reliability.md). The reference is never
          saved: it is read from ``ref_checkpointer`` again on resume.
        - ``nonfinite_loss``: a NaN/inf loss on any rank skips the step everywhere or stops.
        - Validation (``dataset_val``, ``run_val_every_n_steps``, ``batch_size_val``,
          ``max_val_batches``): ``val/loss`` (the per-pair loss over every validation pair of
          every rank / their number), ``val/rewards/accuracy`` (a count of pairs over pairs),
          ``val/rewards/margins``, ``val/rewards/chosen``, ``val/rewards/rejected``, with the
          reference as training computes it (the frozen reference model, which validation
          keeps even with ``precompute_reference_logprobs``); KTO: ``val/loss`` over every
          example against the set's reference point ``val/kl`` (docs/validation.md).
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

    def __init__(self, cfg: FullDpoDistributedConfig) -> None:
        # Device, process group, data-parallel mesh (stock's DPO has no tensor parallelism),
        # precision policy, kernels, threads and the seed; see [setup order].
        self._runtime = Runtime.distributed(cfg)
        self._clip_grad_norm = cfg.clip_grad_norm

    def setup(self, cfg: FullDpoDistributedConfig) -> None:
        # Resume point, metric logger, torchtune's checkpoint client and the weights it read.
        start = RunStart(cfg, self._runtime, FULL_DPO_FINGERPRINT_KEYS)
        self._model = start.build_model(cfg.model, start.full_weights())
        self._activations_ctx = start.activations_ctx  # activation offloading, or nothing
        # One loss per pair (with rpo_alpha or ORPO also an NLL over the chosen tokens), and
        # what it needs of the step: see exactga.dpo.terms.DpoTerms.
        self._loss_fn = config.instantiate(cfg.loss)
        self._dpo_terms = DpoTerms.for_loss(
            self._loss_fn, rpo_alpha=cfg.rpo_alpha, sequence_log_prob=cfg.sequence_log_prob
        )
        # The frozen reference: ``model`` with ref_checkpointer's weights (also on resume, as
        # stock), sharded like the policy; held only by the reference below. A reference-free
        # loss (SimPO, ORPO) builds and runs none.
        ref_model = None
        if not self._dpo_terms.reference_free:
            ref_model = start.frozen_model(cfg.model, cfg.ref_checkpointer, "Reference")
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = start.build_optimizer(
            cfg.optimizer, self._model, in_backward=cfg.optimizer_in_bwd
        )
        # Row checks, data order and loader position: see [data order] in exactga.data.loader.
        dataset = load_dataset(cfg.dataset, self._tokenizer, model_vocab_size(self._model))
        # The reference (the frozen model above; none for SimPO and ORPO; or its log-probs
        # computed once), KTO's reference point over each whole window, the normaliser weighing
        # each term by its own units over every rank, and the metrics: one call, so that a copy
        # cannot wire them apart.
        precision = self._runtime.precision
        reference = None if ref_model is None else frozen_model_reference(ref_model, precision)
        prefs = preference_run(
            cfg,
            self._loss_fn,
            self._dpo_terms,
            dataset,
            model=self._model,
            reference=reference,
            pad_id=self._tokenizer.pad_id,
            runtime=self._runtime,
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
        # Validation runs the reference model itself (a precomputed table holds the training
        # pairs' log-probs only), so with dataset_val the model stays; otherwise it is held by
        # the training reference, or by nothing once the table has its log-probs.
        self._validation_reference = reference if self._validation is not None else None
        del ref_model, reference
        self._reference, self._reference_point = prefs.reference, prefs.reference_point
        self._metrics = prefs.metrics
        dataloader = start.dataloader(
            prefs.dataset, padding_idx=self._tokenizer.pad_id, ignore_idx=IGNORE_INDEX
        )
        # Checkpoints, scheduler, profiler, logs: the bookkeeping of every step, set up last.
        self._run = start.training_run(
            self._model,
            self._optimizer,
            dataloader,
            prefs.normalizer,
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
    cfg = validated_config(cfg, FullDpoDistributedConfig, RECIPE_NAME)
    recipe = FullDPORecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
