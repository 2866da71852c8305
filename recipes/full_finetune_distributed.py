"""Full fine-tuning with FSDP2 on one node or many, GPUs or CPUs, with exact accumulation.

A drop-in for torchtune 0.6.1's ``full_finetune_distributed``: its configs run unchanged, with
the same checkpointer outputs and metric names. What differs: the loss of each optimizer step
is exactly the full-batch loss of the window over every data-parallel rank (sum of token losses
over the window's loss tokens), whatever the split into ranks and micro-batches, with no pass
over the gradients; ranks may hold very different token counts, or none; ``device: cpu`` runs
(gloo), which stock 0.6.1 does not; and gradients may be reduced once per window instead of
after every micro-batch (``gradient_sync``). See ``exactga.accumulation.normalization``,
docs/math.md and docs/full_finetune_distributed.md.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/full_finetune_distributed.py \\
        --config configs/tiny/full_distributed.yaml
    # several nodes: the same command on each, through torchrun's rendezvous
    tune run --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \\
        --rdzv_endpoint HOST:29500 --rdzv_id JOB recipes/full_finetune_distributed.py \\
        --config llama3_1/8B_full

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import sys
from functools import partial

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training.checkpointing._checkpoint_client import CheckpointClient

from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.optimizers import build_optimizer
from exactga.accumulation.step import StepContext
from exactga.config.schemas import FullFinetuneDistributedConfig
from exactga.data.loader import dataloader_from_config, load_dataset, model_vocab_size
from exactga.launch.cli import run_recipe
from exactga.profiling import profiler_from_config
from exactga.run.metric_logging import close_metric_logger, open_run_logger, report_outputs
from exactga.run.progress import TrainingProgress, build_lr_scheduler
from exactga.run.resume import start_run, validate_run_config
from exactga.run.steps import StepBook, StepBookSettings
from exactga.run.threads import use_cpu_threads
from exactga.runtime import distributed
from exactga.runtime.kernels import choose_attention_kernels
from exactga.runtime.precision import Precision
from exactga.setup.checkpoints import RunCheckpoints
from exactga.setup.model import FullWeights, ModelSettings, Parallelism, build_loss, build_model
from exactga.sft.loss import causal_lm_loss

log = utils.get_logger("INFO")

RECIPE_NAME = "full_finetune_distributed"


class FullFinetuneRecipeDistributed(FTRecipeInterface):
    """Full fine-tuning of a dense decoder with FSDP2 (and optional tensor parallelism).

    Features (each a config key; defaults in ``exactga.config.schemas``):
        - Exact accumulation over micro-batches *and* data-parallel ranks: each rank prefetches
          its window, counts its loss tokens on the host after the label shift, and issues one
          all-reduce of that count over the data-parallel group, which overlaps the first
          forward; each micro-batch loss is scaled by ``dp_size * batch_tokens /
          window_tokens`` before backward, which undoes FSDP's averaging. ``dp_size`` comes
          from the device mesh, so tensor parallelism (``tensor_parallel_dim``,
          ``tensor_parallel_plan``) keeps the count right. An empty micro-batch still runs on
          every rank with weight exactly 0 (FSDP needs the same collectives everywhere); a
          window empty on every rank skips its step on every rank (``skipped_steps``).
        - ``gradient_sync``: ``every_micro_batch`` (default, as stock torchtune) reduce-scatters
          gradients after each micro-batch; ``once_per_window`` once per step, faster but with
          an unsharded copy of the gradients on every rank. Measured trade-off in
          docs/full_finetune_distributed.md.
        - FSDP2 through torchtune's ``shard_model``: ``fsdp_cpu_offload``,
          ``fsdp_reshard_after_forward``, ``custom_sharded_layers``.
        - ``micro_batching`` per rank (with ``token_budget``, ranks with fewer micro-batches run
          zero-weight fillers so FSDP's collectives pair up; ``throughput/rank_imbalance``).
        - ``loss_normalization``, precision, activation checkpointing (also selective with
          ``ac_mode``/``ac_option``) and offloading, ``compile``, ``optimizer_in_bwd`` (ga = 1),
          ``clip_grad_norm``, schedulers: as in the single-device recipe. ``master_weights:
          fp32`` shards fp32 weights under FSDP2's bf16 ``MixedPrecisionPolicy`` with fp32
          gradient reduction (docs/precision.md).
        - Checkpointing through torchtune's checkpoint client at each epoch's end, written by
          rank 0 (``enable_async_checkpointing`` for intermediate distributed checkpoints), and
          with ``save_every_n_steps`` atomic step checkpoints (full weights and optimizer state
          from rank 0, RNG and data-loader position from every rank): ``resume_from_checkpoint``
          then goes on with the next window on the same world size (docs/reliability.md).
        - ``nonfinite_loss``: a NaN/inf loss on any rank skips the step on every rank
          (``skip``) or stops the run with a checkpoint (``stop``).
        - Rank-0-only metric logging and progress bar; ``loss`` is the exact window loss over
          all ranks (one extra all-reduce of one number on logged steps only).

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up
            (``recipe_main``'s ``validate_run_config``; each schema's ``check_flags``).
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._precision = Precision.from_config(self._dtype, cfg.master_weights, self._device)
        self._attention_kernels = choose_attention_kernels(cfg.cudnn_attention, self._device)
        self._cpu_threads = use_cpu_threads(  # see [cpu threads]
            cfg.cpu_threads, optimizer_on_cpu=cfg.fsdp_cpu_offload and self._device.type != "cpu"
        )
        self._gradient_sync = cfg.gradient_sync

        self._enable_async_checkpointing = cfg.enable_async_checkpointing
        self._fsdp_cpu_offload = cfg.fsdp_cpu_offload and self._device.type != "cpu"
        distributed.init_distributed(
            self._device,
            offload_ops_to_cpu=self._fsdp_cpu_offload or self._enable_async_checkpointing,
        )
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0
        self._tensor_parallel_dim = cfg.tensor_parallel_dim
        self._tensor_parallel_plan = config.instantiate(cfg.tensor_parallel_plan)
        self._mesh = distributed.build_device_mesh(self._device, self._tensor_parallel_dim)
        self.dp_size = self._mesh["dp"].size()
        self.dp_rank = self._mesh["dp"].get_local_rank()

        self._book_settings = StepBookSettings.from_config(cfg)  # logging, saving, non-finite

        self._optimizer_in_bwd = cfg.optimizer_in_bwd
        self._clip_grad_norm = cfg.clip_grad_norm
        self._loss_normalization = cfg.loss_normalization
        self._compile = cfg.compile
        self._model_settings = ModelSettings.from_config(cfg, self._device)

        # Epochs, steps and their outcomes; a resume sets them in setup.
        self._progress = TrainingProgress(
            seed=training.set_seed(seed=cfg.seed, debug_mode=cfg.cudnn_deterministic_mode),
            total_epochs=cfg.epochs,
            max_steps_per_epoch=cfg.max_steps_per_epoch,
        )

    def setup(self, cfg: DictConfig) -> None:
        # Where to go on from: nothing, torchtune's epoch checkpoint or a step checkpoint.
        self._step_checkpointer, self._fingerprint, resume = start_run(
            cfg, tensor_parallel_dim=self._tensor_parallel_dim
        )
        # Rank 0's; a resumed run's curves go on in its run ([resumed TensorBoard run]).
        self._metric_logger = open_run_logger(cfg, resumed=resume.resumed)
        # torchtune's client reads the base weights, or with an epoch resume the epoch's.
        self._checkpoint_client = self._precision.saving_in_dtype(  # weights for users in dtype
            CheckpointClient(
                OmegaConf.merge(cfg, {"resume_from_checkpoint": resume.from_epoch_checkpoint})
            )
        )
        ckpt_dict = self._checkpoint_client.load_base_checkpoint()
        # Built, cast, compiled, checkpointed, sharded and loaded in the one order; see
        # exactga.setup.model.
        built = build_model(
            cfg.model,
            FullWeights(resume.model_weights(ckpt_dict), resume.weights_source(cfg.checkpointer)),
            precision=self._precision,
            device=self._device,
            settings=self._model_settings,
            parallelism=Parallelism(
                dp_mesh=self._mesh["dp"],
                tp_mesh=self._mesh["tp"] if self._tensor_parallel_dim > 1 else None,
                tp_plan=self._tensor_parallel_plan,  # applied only with a tp_mesh
            ),
            notes=(self._attention_kernels, self._cpu_threads),
        )
        self._model, self._activations_handling_ctx = built.model, built.activations_ctx
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer,
            self._model,
            in_backward=self._optimizer_in_bwd,
            state=resume.optimizer_state(ckpt_dict),
            sharded=True,
            device=self._device,
        )  # see [optimizer in backward]
        if resume.from_epoch_checkpoint and self._enable_async_checkpointing:
            # torchtune's distributed checkpoint loads weights and optimizer state in place.
            ckpt_dict = self._checkpoint_client.load_distributed_checkpoint(
                self._model, self._optimizer
            )
        resume.restore_progress(self._progress, ckpt_dict)

        self._loss_fn = build_loss(cfg.loss, self._model, compile_loss=self._compile)
        self._normalizer = LossNormalizer(
            self._loss_fn,
            mode=self._loss_normalization,
            dp_group=distributed.dp_group(self._mesh),
        )

        # Data order, row checks and loader position: see [data order] in exactga.data.loader. Ranks
        # of one tensor-parallel group read the same data: the sampler splits over dp only.
        dataset = load_dataset(cfg.dataset, self._tokenizer, model_vocab_size(self._model))
        self._dataloader = dataloader_from_config(
            dataset,
            cfg,
            padding_idx=self._tokenizer.pad_id,
            ignore_idx=self._loss_fn.ignore_index,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            rank_balancing=cfg.rank_balancing,
            state_dict=resume.dataloader_state(ckpt_dict),
        )
        self._progress.start(
            len(self._dataloader),  # windows per epoch
            resumed_mid_run=resume.from_step_checkpoint,
        )

        self._checkpoints = RunCheckpoints(
            self._progress,
            self._step_checkpointer,
            self._fingerprint,
            self._device,
            epoch_writer=self._checkpoint_client,
            sharded=True,
        )
        self._lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self._optimizer, self._progress)
        # Phase timings on every rank; traces, snapshots and the report on rank 0.
        self._profiler = profiler_from_config(cfg, self._device, self._model, self._metric_logger)
        self._checkpoint_dir = cfg.checkpointer.output_dir
        resume.restore_rng(self._device)  # last: model and data setup above draw from the RNGs

    def save_checkpoint(self, epoch: int) -> None:
        """The epoch's checkpoint, as stock writes it (every rank calls this)."""
        self._checkpoints.save_epoch(self._model, self._optimizer, epoch)

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and mean loss of one micro-batch already on the device."""
        return causal_lm_loss(
            self._model, self._loss_fn, batch, self._activations_handling_ctx, self._precision
        )

    def train(self) -> None:
        distributed.cleanup_before_training(self._device)
        if self._compile:
            distributed.log_rank_zero("torch.compile is on: expect a slow first step.")
        self._optimizer.zero_grad()
        progress = self._progress
        steps = self._step_book()
        with self._profiler:
            for curr_epoch in progress.epochs():
                for window in steps.windows(curr_epoch):
                    for batch in window:  # this rank's micro-batches, on the device
                        loss = self._loss_step(batch)  # forward and mean loss: edit here
                        window.backward(loss)  # weighed by its exact share, then backward
                    outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                    report = steps.end_step(window, outcome)  # .loss: on logged steps
                    log.debug("step %d: loss %s", report.step, report.loss)  # print() is bar-safe
                steps.end_epoch(curr_epoch)
        outputs = "Checkpoints"
        report_outputs(self._profiler.summary(), self._checkpoint_dir, self._metric_logger, outputs)

    def _step_book(self) -> StepBook:
        """The loop's bookkeeping: counters, scheduler, non-finite policy, logs and
        checkpoints, in the one order; see [step bookkeeping] in ``exactga.run.steps``."""
        return StepBook(
            self._progress,
            context=StepContext(
                self._model,
                self._device,
                self._profiler,
                partial(distributed.gradient_sync, self._model, self._gradient_sync),
                announce_skip=self._is_rank_zero,
            ),
            dataloader=self._dataloader,
            normalizer=self._normalizer,
            optimizer=self._optimizer,
            lr_scheduler=self._lr_scheduler,
            settings=self._book_settings,
            checkpoints=self._checkpoints,
            metric_logger=self._metric_logger,
        )

    def cleanup(self) -> None:
        close_metric_logger(self._metric_logger)
        distributed.destroy()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains."""
    cfg = validate_run_config(cfg, FullFinetuneDistributedConfig, RECIPE_NAME)
    if distributed.is_rank_zero():
        config.log_config(recipe_name="FullFinetuneRecipeDistributed", cfg=cfg)
    recipe = FullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
