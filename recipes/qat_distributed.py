"""Quantisation-aware full fine-tuning with FSDP2, GPUs or CPUs, with exact accumulation.

A drop-in for torchtune 0.6.1's ``qat_distributed``: its configs run unchanged, with the same
checkpointer outputs and metric names. The config's ``quantizer`` (torchao's
``Int8DynActInt4WeightQATQuantizer`` or ``Int4WeightOnlyQATQuantizer``) makes every linear it
can fake-quantise round its weights (and activations) to the target grid in the forward; the
saved weights are the trained full-precision ones, in the checkpointer's format, which
``tune run quantize`` then converts, as stock (docs/qat.md). ``fake_quant_after_n_steps`` trains
without fake quantisation for that many steps first. What differs from stock, as in
recipes/full_finetune.py: the loss of each optimizer step is exactly the full-batch
loss of the window over every data-parallel rank, whatever the split into ranks and
micro-batches; ``device: cpu`` runs (gloo); ``gradient_sync``.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/qat_distributed.py \\
        --config configs/tiny/qat_distributed.yaml

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import sys

import torch
from omegaconf import DictConfig
from torchtune import config, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.config.schemas import QatDistributedConfig
from exactga.data.loader import load_dataset, model_vocab_size
from exactga.launch.cli import run_recipe
from exactga.model_build.trained import build_loss
from exactga.qat.fake_quant import FakeQuantSchedule
from exactga.runtime.runtime import Runtime
from exactga.sft.loss import causal_lm_loss
from exactga.sft.validation import validation_loss
from exactga.validation.held_out import validation_from_settings
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

RECIPE_NAME = "qat_distributed"


class QATRecipeDistributed(FTRecipeInterface):
    """Quantisation-aware full fine-tuning of a dense decoder with FSDP2.

    Features (each a config key; defaults in ``exactga.config.schemas``):
        - ``quantizer``: a torchao QAT quantizer, applied to the model built on the meta device
          after activation checkpointing and before sharding, as stock
          (``exactga.qat.fake_quant.prepare_for_qat``). ``fake_quant_after_n_steps``: fake
          quantisation off until that many optimizer steps are done, then on.
        - Exact accumulation over micro-batches *and* data-parallel ranks: each rank prefetches
          its window, counts its loss tokens on the host after the label shift, and issues one
          all-reduce of that count over the data-parallel group, which overlaps the first
          forward; each micro-batch loss is scaled by ``dp_size * batch_tokens /
          window_tokens`` before backward, which undoes FSDP's averaging. ``dp_size`` comes
          from the device mesh. An empty micro-batch still runs on
          every rank with weight exactly 0 (FSDP needs the same collectives everywhere); a
          window empty on every rank skips its step on every rank (``skipped_steps``).
        - ``gradient_sync``: ``every_micro_batch`` (default, as stock torchtune) reduce-scatters
          gradients after each micro-batch; ``once_per_window`` once per step, faster but with
          an unsharded copy of the gradients on every rank.
        - FSDP2 through torchtune's ``shard_model``: ``fsdp_cpu_offload``,
          ``fsdp_reshard_after_forward``, ``custom_sharded_layers``.
        - ``micro_batching`` per rank (with ``token_budget``, ranks with fewer micro-batches run
          zero-weight fillers so FSDP's collectives pair up; ``throughput/rank_imbalance``).
        - ``loss_normalization``, precision, activation checkpointing (also selective with
          ``ac_mode``/``ac_option``) and offloading, ``optimizer_in_bwd`` (ga = 1),
          ``clip_grad_norm``, schedulers: as in the single-device recipe. ``master_weights:
          fp32`` shards fp32 weights under FSDP2's bf16 ``MixedPrecisionPolicy`` with fp32
          gradient reduction (docs/precision.md).
        - Checkpointing through torchtune's checkpoint client at each epoch's end, written by
          rank 0: the full-precision weights under their usual names, as stock's QAT recipe
          writes them (``enable_async_checkpointing``, exactga's here, as in the full recipe),
          and
          with ``save_every_n_steps`` atomic step checkpoints (weights and optimizer state as
          every rank's shards, RNG and data-loader position from every rank):
          ``resume_from_checkpoint`` then goes on with the next window, also on another number
          of data-parallel ranks with the same global batch (docs/reliability.md).
        - ``nonfinite_loss``: a NaN/inf loss on any rank skips the step on every rank
          (``skip``) or stops the run with a checkpoint (``stop``).
        - Rank-0-only metric logging and progress bar; ``loss`` is the exact window loss over
          all ranks (one extra all-reduce of one number on logged steps only).
        - Validation during training (``dataset_val``, ``run_val_every_n_steps``,
          ``batch_size_val``, ``max_val_batches``): the loss of the whole validation set as one
          batch over every rank, the same whatever its batch size or the number of ranks,
          logged as ``val/loss`` and ``val/perplexity`` every n steps and at each epoch's end
          (docs/validation.md).
          ``keep_best_checkpoint``: the weights of each new lowest ``val/loss`` as an epoch
          folder in ``best/``, resume-safe.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up
            (``recipe_main``'s ``validate_run_config``; each schema's ``check_flags``); as
            stock, ``compile: True`` and a quantizer that is not a QAT one.
    """

    def __init__(self, cfg: QatDistributedConfig) -> None:
        # Device, process group, data-parallel mesh (stock QAT has no tensor parallelism),
        # precision policy, kernels, threads and the seed; see [setup order].
        self._runtime = Runtime.distributed(cfg)
        self._clip_grad_norm = cfg.clip_grad_norm

    def setup(self, cfg: QatDistributedConfig) -> None:
        # Resume point, metric logger, torchtune's checkpoint client and the weights it read.
        start = RunStart(cfg, self._runtime)
        # Built on meta, cast, fake-quantised by the quantizer, sharded and loaded.
        self._model = start.build_model(cfg.model, start.full_weights(), quantizer=cfg.quantizer)
        self._fake_quant = FakeQuantSchedule(self._model, cfg.fake_quant_after_n_steps)
        self._activations_ctx = start.activations_ctx  # activation offloading, or nothing
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = start.build_optimizer(
            cfg.optimizer, self._model, in_backward=cfg.optimizer_in_bwd
        )
        self._loss_fn = build_loss(cfg.loss, self._model, compile_loss=cfg.compile)
        # Loss tokens are counted over every data-parallel rank: one all-reduce per window.
        normalizer = start.normalizer(self._loss_fn)
        # Row checks, data order and loader position: see [data order] in exactga.data.loader.
        dataset = load_dataset(cfg.dataset, self._tokenizer, model_vocab_size(self._model))
        dataloader = start.dataloader(
            dataset, padding_idx=self._tokenizer.pad_id, ignore_idx=self._loss_fn.ignore_index
        )
        # Validation during training (dataset_val; none without it): docs/validation.md.
        self._validation = validation_from_settings(
            cfg,
            tokenizer=self._tokenizer,
            loss_fn=self._loss_fn,
            model=self._model,
            runtime=self._runtime,
            metric_logger=start.metric_logger,
        )
        # Checkpoints, scheduler, profiler, logs: the bookkeeping of every step, set up last.
        self._run = start.training_run(
            self._model,
            self._optimizer,
            dataloader,
            normalizer,
            validation=self._validation,  # its step checkpoints and keep_best_checkpoint
        )

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        """Forward and mean loss of one micro-batch already on the device."""
        return causal_lm_loss(
            self._model, self._loss_fn, batch, self._activations_ctx, self._runtime.precision
        )

    def train(self) -> None:
        with self._run as steps:  # the profiler, the progress bar and the closing report
            for curr_epoch in steps.epochs():
                for window in steps.windows(curr_epoch):
                    self._fake_quant.before_window(window.step_number - 1)  # on after n steps
                    for batch in window:  # this rank's micro-batches; fillers have weight 0
                        loss = self._loss_step(batch)  # forward and mean loss: edit here
                        window.backward(loss)  # weighed by its exact share, then backward
                    outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                    steps.end_step(window, outcome)  # counters, scheduler, logs, checkpoints
                    self._validate_if_due(steps.progress.global_step)  # run_val_every_n_steps
                self._validate_if_due(steps.progress.global_step, epoch_end=True)
                steps.end_epoch(curr_epoch)

    def _validate_if_due(self, step: int, *, epoch_end: bool = False) -> None:
        """The validation set's loss as one batch over every rank, when due; nothing without
        dataset_val. See [validation loss as one batch] in exactga.validation.held_out."""
        if self._validation is None or not self._validation.due(step, epoch_end=epoch_end):
            return
        figure = validation_loss(
            self._model,
            self._loss_fn,
            self._validation.validation_set,
            device=self._runtime.device,
            precision=self._runtime.precision,
        )
        self._validation.log(figure, step)  # val/loss, val/perplexity and a console line

    def cleanup(self) -> None:
        self._run.close()  # the metric logger and the process group


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    cfg = validated_config(cfg, QatDistributedConfig, RECIPE_NAME)
    recipe = QATRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
