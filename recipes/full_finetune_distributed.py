"""Full fine-tuning with FSDP2 on one node or many, GPUs or CPUs, with exact accumulation.

A drop-in for torchtune 0.6.1's ``full_finetune_distributed``: its configs run unchanged, with
the same checkpointer outputs and metric names. What differs: the loss of each optimizer step
is exactly the full-batch loss of the window over every data-parallel rank (sum of token losses
over the window's loss tokens), whatever the split into ranks and micro-batches, with no pass
over the gradients; ranks may hold very different token counts, or none; ``device: cpu`` runs
(gloo), which stock 0.6.1 does not; and gradients may be reduced once per window instead of
after every micro-batch (``gradient_sync``). See ``exactga.normalization``, docs/math.md and
docs/full_finetune_distributed.md.

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
import time
from functools import partial
from pathlib import Path
from typing import Any
from warnings import warn

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from torch.optim import Optimizer
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.modules import TiedLinear
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training import PROFILER_KEY
from torchtune.training.activations import apply_selective_activation_checkpointing
from torchtune.training.checkpointing._checkpoint_client import (
    CheckpointClient,
    TrainingProgress,
)
from torchtune.training.lr_schedulers import get_lr
from tqdm import tqdm

from exactga import distributed
from exactga.checkpointing import (
    MODEL_FILE,
    find_resume_checkpoint,
    load_model_state,
    progress_state,
    restore_progress,
    restore_rng_state,
    run_fingerprint,
    should_save_step_checkpoint,
    step_checkpointer_for,
    step_rank_state,
)
from exactga.config import validate_config
from exactga.data import checked_dataset, dataset_source, model_vocab_size
from exactga.normalization import LossNormalizer, Window, parse_mode
from exactga.profiling import setup_profiler
from exactga.schemas import FullFinetuneDistributedConfig
from exactga.training import (
    causal_lm_loss,
    handle_nonfinite_loss,
    parse_nonfinite_policy,
    train_window,
)

log = utils.get_logger("INFO")

RECIPE_NAME = "full_finetune_distributed"


class FullFinetuneRecipeDistributed(FTRecipeInterface):
    """Full fine-tuning of a dense decoder with FSDP2 (and optional tensor parallelism).

    Features (each a config key; defaults in ``exactga.schemas``):
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
        - ``loss_normalization``, precision, activation checkpointing (also selective with
          ``ac_mode``/``ac_option``) and offloading, ``compile``, ``optimizer_in_bwd`` (ga = 1),
          ``clip_grad_norm``, schedulers: as in the single-device recipe.
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
        ValueError: fp16 ``dtype``; ``optimizer_in_bwd`` with accumulation or clipping; a
            tensor-parallel dimension without a plan or not dividing the world size;
            ``enable_activation_offloading`` off CUDA or without activation checkpointing.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        if self._dtype == torch.float16:
            raise ValueError("config key 'dtype': fp16 is not supported; use bf16 or fp32.")
        _check_flag_combinations(cfg, self._device)
        self._gradient_sync = distributed.parse_gradient_sync(cfg.gradient_sync)

        self._enable_async_checkpointing = cfg.enable_async_checkpointing
        self._fsdp_cpu_offload = cfg.fsdp_cpu_offload
        distributed.init_distributed(
            self._device,
            offload_ops_to_cpu=self._fsdp_cpu_offload or self._enable_async_checkpointing,
        )
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0
        self._tensor_parallel_dim = cfg.tensor_parallel_dim
        self._tensor_parallel_plan = config.instantiate(cfg.tensor_parallel_plan)
        if self._tensor_parallel_dim > 1 and self._tensor_parallel_plan is None:
            raise ValueError(
                "config key 'tensor_parallel_plan' is needed when tensor_parallel_dim > 1."
            )
        if self._tensor_parallel_dim > 1 and cfg.optimizer.get("fused", False):
            raise ValueError("config key 'optimizer.fused' does not work with tensor parallelism.")
        self._mesh = distributed.build_device_mesh(self._device, self._tensor_parallel_dim)
        self.dp_size = self._mesh["dp"].size()
        self.dp_rank = self._mesh["dp"].get_local_rank()

        self._output_dir = cfg.output_dir
        self._log_every_n_steps = cfg.log_every_n_steps
        self._log_peak_memory_stats = cfg.log_peak_memory_stats and self._device.type != "cpu"
        if cfg.log_peak_memory_stats and not self._log_peak_memory_stats:
            distributed.log_rank_zero("log_peak_memory_stats is ignored on CPU.")

        self._resume_from_checkpoint = cfg.resume_from_checkpoint
        self._gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self._optimizer_in_bwd = cfg.optimizer_in_bwd
        self._clip_grad_norm = cfg.clip_grad_norm
        self._loss_normalization = parse_mode(cfg.loss_normalization)
        self._drop_partial_window = cfg.drop_partial_window
        self._compile = cfg.compile
        self._enable_activation_checkpointing = cfg.enable_activation_checkpointing
        self._enable_activation_offloading = cfg.enable_activation_offloading
        self._save_every_n_steps = cfg.save_every_n_steps
        self._nonfinite_policy = parse_nonfinite_policy(cfg.nonfinite_loss)

        # Public state, updated by the checkpoint loader when resuming.
        self.seed = training.set_seed(seed=cfg.seed, debug_mode=cfg.cudnn_deterministic_mode)
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0
        self.num_skipped_steps = 0
        self.num_nonfinite_steps = 0

    def setup(self, cfg: DictConfig) -> None:
        if self._fsdp_cpu_offload:
            training.set_torch_num_threads()  # fused AdamW on CPU is ~2x faster with all cores
        if self._is_rank_zero:
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)

        self._step_checkpointer = step_checkpointer_for(
            cfg.output_dir, cfg.keep_last_n_checkpoints, self.rank, self.world_size
        )
        self._fingerprint = run_fingerprint(
            cfg, world_size=self.world_size, tensor_parallel_dim=self._tensor_parallel_dim
        )
        resume = find_resume_checkpoint(self._step_checkpointer, cfg, self._fingerprint)
        # Resuming from a step checkpoint, torchtune's client loads only the base weights.
        self._checkpoint_client = CheckpointClient(
            cfg if resume is None else OmegaConf.merge(cfg, {"resume_from_checkpoint": False})
        )
        ckpt_dict = self._checkpoint_client.load_base_checkpoint()
        source = f"checkpointer.checkpoint_dir ({cfg.checkpointer.checkpoint_dir})"
        if resume is not None:
            distributed.log_rank_zero(f"Resuming from step checkpoint {resume.path}")
            restore_progress(self, resume.trainer_state)
            source = str(resume.path / MODEL_FILE)
            ckpt_dict = {
                training.MODEL_KEY: resume.model_state,
                training.OPT_KEY: resume.optimizer_state,
                training.DATALOADER_KEY: resume.rank_state["dataloader"],
            }
        self._model = self._setup_model(cfg, ckpt_dict[training.MODEL_KEY], source)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(cfg.optimizer, ckpt_dict.get(training.OPT_KEY))
        if self._resume_from_checkpoint and resume is None:
            if self._enable_async_checkpointing:
                ckpt_dict = self._checkpoint_client.load_distributed_checkpoint(
                    self._model,
                    self._optim_ckpt_wrapper if self._optimizer_in_bwd else self._optimizer,
                )
            self._update_recipe_state(ckpt_dict)

        self._loss_fn = config.instantiate(cfg.loss)
        if self._compile:
            training.compile_loss(self._loss_fn, verbose=self._is_rank_zero)
        if hasattr(self._loss_fn, "num_output_chunks"):
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        self._normalizer = LossNormalizer(
            self._loss_fn,
            self._gradient_accumulation_steps,
            mode=self._loss_normalization,
            drop_partial_window=self._drop_partial_window,
            dp_group=distributed.dp_group(self._mesh),
        )

        self._dataloader = self._setup_data(
            cfg.dataset,
            shuffle=cfg.shuffle,
            batch_size=cfg.batch_size,
            collate_fn=cfg.collate_fn,
            dataloader_state_dict=(
                ckpt_dict.get(training.DATALOADER_KEY) if self._resume_from_checkpoint else None
            ),
        )
        self._steps_per_epoch = self._normalizer.num_windows(len(self._dataloader))
        if self.max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self.max_steps_per_epoch)
        if resume is None:
            self.global_step = self.epochs_run * self._steps_per_epoch

        self._lr_scheduler = self._setup_lr_scheduler(
            cfg.lr_scheduler,
            num_training_steps=self.total_epochs * self._steps_per_epoch,
            last_epoch=self.global_step - 1,
        )
        # Traces and memory snapshots from rank 0 only; the others only time their phases.
        cfg_profiler = cfg.copy()
        if not self._is_rank_zero:
            cfg_profiler[PROFILER_KEY] = None
        self._profiler = setup_profiler(cfg_profiler, self._device, self._model)
        self._checkpoint_dir = cfg.checkpointer.output_dir
        self._log_dir = (
            getattr(self._metric_logger, "log_dir", None) if self._is_rank_zero else None
        )
        if resume is not None:  # last: model and data setup above draw from the RNGs
            restore_rng_state(resume.rank_state["rng"], self._device)

    def _update_recipe_state(self, ckpt_dict: dict[str, Any]) -> None:
        try:
            self.epochs_run = ckpt_dict[training.EPOCHS_KEY]
            if self.seed != ckpt_dict[training.SEED_KEY]:
                warn("config seed differs from the checkpoint's; using the latter.", stacklevel=2)
                self.seed = ckpt_dict[training.SEED_KEY]
            if self.max_steps_per_epoch != ckpt_dict[training.MAX_STEPS_KEY]:
                warn(
                    "config max_steps_per_epoch differs from the checkpoint's; using the latter.",
                    stacklevel=2,
                )
                self.max_steps_per_epoch = ckpt_dict[training.MAX_STEPS_KEY]
        except KeyError as err:
            raise KeyError(
                f"checkpoint has no recipe state ({err}); is it a checkpoint of this recipe?"
            ) from err

    def _setup_model(
        self, cfg: DictConfig, model_state_dict: dict[str, Any], source: str
    ) -> nn.Module:
        """Build on the meta device, apply TP, activation checkpointing and FSDP2, then load
        the full state dict shard by shard."""
        t0 = time.perf_counter()
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(cfg.model)
        if self._compile:
            training.compile_model(model, verbose=self._is_rank_zero)

        if self._tensor_parallel_dim > 1:
            if isinstance(getattr(model, "output", None), TiedLinear):
                # torchtune 0.6.1's TP plans shard the output as a Linear; a tied output then
                # multiplies a plain tensor by a DTensor deep inside the first forward.
                raise ValueError(
                    "config keys 'tensor_parallel_dim' and 'model.tie_word_embeddings': tensor "
                    "parallelism needs an untied output projection (tie_word_embeddings: False)."
                )
            model = training.prepare_mha_for_tp(model, self._mesh["tp"])
            parallelize_module(model, self._mesh["tp"], parallelize_plan=self._tensor_parallel_plan)
        # As in torchtune: ``ac_mode`` selects selective AC only when full AC is off.
        if not self._enable_activation_checkpointing and cfg.ac_mode is not None:
            apply_selective_activation_checkpointing(model, cfg.ac_mode, cfg.ac_option)
        if self._enable_activation_checkpointing and cfg.ac_mode is None:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        if self.dp_size > 1:
            training.shard_model(
                model=model,
                shard_conditions=[
                    partial(training.get_shard_conditions, names_to_match=cfg.custom_sharded_layers)
                ],
                cpu_offload=self._fsdp_cpu_offload,
                reshard_after_forward=cfg.fsdp_reshard_after_forward,
                dp_mesh=self._mesh["dp"],
            )

        with training.set_default_dtype(self._dtype), self._device:
            for m in model.modules():
                if hasattr(m, "rope_init"):  # RoPE buffers are not in the state dict
                    m.rope_init()
        load_model_state(
            model,
            model_state_dict,
            source,
            load=partial(
                training.load_from_full_model_state_dict,
                device=self._device,
                strict=True,
                cpu_offload=self._fsdp_cpu_offload,
            ),
        )
        training.validate_no_params_on_meta_device(model)
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._enable_activation_offloading
        )
        distributed.log_rank_zero(
            f"Model built, sharded over dp={self.dp_size} x tp={self._tensor_parallel_dim} and "
            f"loaded in {time.perf_counter() - t0:.2f} s, precision {self._dtype}."
        )
        if self._is_rank_zero and self._device.type != "cpu":
            training.log_memory_stats(distributed.memory_stats(self._device))
        distributed.barrier()
        return model

    def _setup_optimizer(
        self, cfg_optimizer: DictConfig, opt_state_dict: dict[str, Any] | None
    ) -> Optimizer | None:
        if not self._resume_from_checkpoint:
            opt_state_dict = None
        if not self._optimizer_in_bwd:
            optimizer = config.instantiate(cfg_optimizer, self._model.parameters())
            if opt_state_dict:
                training.load_from_full_optimizer_state_dict(
                    self._model, optimizer, opt_state_dict, self._device
                )
            return optimizer
        # One optimizer per parameter, stepped by hooks as its (reduced) gradient is ready.
        optim_dict = {p: config.instantiate(cfg_optimizer, [p]) for p in self._model.parameters()}
        training.register_optim_in_bwd_hooks(model=self._model, optim_dict=optim_dict)
        self._optim_ckpt_wrapper = training.create_optim_in_bwd_wrapper(
            model=self._model, optim_dict=optim_dict
        )
        for param, state in (opt_state_dict or {}).items():
            training.load_from_full_optimizer_state_dict(
                self._model, self._optim_ckpt_wrapper.optim_map[param], state, self._device
            )
        return None

    def _setup_lr_scheduler(
        self, cfg_lr_scheduler: DictConfig | None, num_training_steps: int, last_epoch: int
    ) -> Any:
        if cfg_lr_scheduler is None:
            return None
        optimizer = (
            next(iter(self._optim_ckpt_wrapper.optim_map.values()))
            if self._optimizer_in_bwd
            else self._optimizer
        )
        lr_scheduler = config.instantiate(
            cfg_lr_scheduler,
            optimizer,
            num_training_steps=num_training_steps,
            last_epoch=last_epoch,
        )
        if self._optimizer_in_bwd:
            self._optim_ckpt_wrapper.set_lr_scheduler(lr_scheduler)
        return lr_scheduler

    def _setup_data(
        self,
        cfg_dataset: DictConfig,
        shuffle: bool,
        batch_size: int,
        collate_fn: str,
        dataloader_state_dict: dict[str, Any] | None,
    ) -> StatefulDataLoader:
        if isinstance(cfg_dataset, ListConfig):
            datasets = [config.instantiate(c, self._tokenizer) for c in cfg_dataset]
            ds = ConcatDataset(datasets=datasets)
            packed = getattr(ds, "packed", False)
        else:
            ds = config.instantiate(cfg_dataset, self._tokenizer)
            packed = cfg_dataset.get("packed", False)
        # Bad rows and out-of-vocabulary ids fail naming the row; see exactga.data.
        ds = checked_dataset(
            ds, vocab_size=model_vocab_size(self._model), source=dataset_source(cfg_dataset)
        )
        if "left_pad_sequence" in collate_fn:
            raise ValueError("config key 'collate_fn': left_pad_sequence is for inference only.")
        collate = _get_component_from_path(collate_fn)
        # Ranks of one tensor-parallel group read the same data: the sampler splits over dp.
        sampler = StatefulDistributedSampler(
            ds, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=shuffle, seed=0
        )
        dataloader = StatefulDataLoader(
            dataset=ds,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=(
                padded_collate_packed
                if packed
                else partial(
                    collate,
                    padding_idx=self._tokenizer.pad_id,
                    ignore_idx=self._loss_fn.ignore_index,
                )
            ),
            # Dropping the last short batch avoids shape issues with compile + flex attention.
            drop_last=True,
        )
        if dataloader_state_dict is not None:
            dataloader.load_state_dict(dataloader_state_dict)
        return dataloader

    def save_checkpoint(self, epoch: int) -> None:
        """Gather the full state on rank 0 and write it there (all ranks must call this)."""
        self._checkpoint_client.save_checkpoint(
            model=self._model,
            optimizer=self._optim_ckpt_wrapper if self._optimizer_in_bwd else self._optimizer,
            training_progress=TrainingProgress(
                seed=self.seed,
                epochs_run=self.epochs_run,
                total_epochs=self.total_epochs,
                max_steps_per_epoch=self.max_steps_per_epoch,
                # See [loader position at epoch ends] in exactga.checkpointing.
                dataloader_state_dict=None,
            ),
            epoch=epoch,
        )

    def save_step_checkpoint(self) -> Path:
        """Everything a resumed run needs to go on with the next window; all ranks call this.

        Rank 0 gathers and writes the full weights and optimizer state, every rank its RNG and
        data-loader position; the folder appears atomically once all are on disk.
        """
        model_state = training.gather_cpu_state_dict(
            self._model, self._is_rank_zero, device=self._device
        )
        if self._optimizer_in_bwd:
            optimizer_state = {
                name: training.get_full_optimizer_state_dict(
                    self._model, opt, self._is_rank_zero, device=self._device
                )
                for name, opt in self._optim_ckpt_wrapper.optim_map.items()
            }
        else:
            optimizer_state = training.get_full_optimizer_state_dict(
                self._model, self._optimizer, self._is_rank_zero, device=self._device
            )
        return self._step_checkpointer.save(
            self.global_step,
            model_state=model_state if self._is_rank_zero else None,
            optimizer_state=optimizer_state if self._is_rank_zero else None,
            trainer_state=progress_state(self, self._fingerprint),
            rank_state=step_rank_state(
                self._device,
                self._dataloader,
                at_epoch_start=self.global_step == self.epochs_run * self._steps_per_epoch,
            ),
        )

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and mean loss of one micro-batch already on the device."""
        return causal_lm_loss(self._model, self._loss_fn, batch, self._activations_handling_ctx)

    def train(self) -> None:
        distributed.cleanup_before_training(self._device)
        if self._compile:
            distributed.log_rank_zero("torch.compile is on: expect a slow first step.")
        if not self._optimizer_in_bwd:
            self._optimizer.zero_grad()
        num_tokens_since_log, t_last_log = 0, time.perf_counter()

        with self._profiler:
            for curr_epoch in range(self.epochs_run, self.total_epochs):
                self._dataloader.sampler.set_epoch(curr_epoch)
                # Non-zero only when resuming from a step checkpoint taken mid-epoch.
                steps_done = self.global_step - curr_epoch * self._steps_per_epoch
                pbar = tqdm(
                    total=self._steps_per_epoch,
                    initial=steps_done,
                    desc=f"epoch {curr_epoch + 1}",
                    disable=not self._is_rank_zero,
                )
                windows = self._normalizer.windows(
                    self._dataloader, self._steps_per_epoch - steps_done
                )
                for window in self._profiler.timed(windows):
                    outcome = train_window(
                        window,
                        model=self._model,
                        loss_step=self._loss_step,
                        optimizer=None if self._optimizer_in_bwd else self._optimizer,
                        profiler=self._profiler,
                        device=self._device,
                        step=self.global_step + 1,
                        clip_grad_norm=self._clip_grad_norm,
                        micro_batch_context=partial(
                            distributed.gradient_sync, self._model, self._gradient_sync
                        ),
                        announce_skip=self._is_rank_zero,
                    )
                    self.num_skipped_steps += outcome.skipped
                    self.num_nonfinite_steps += outcome.nonfinite
                    if self._lr_scheduler is not None:
                        self._lr_scheduler.step()
                    self.global_step += 1
                    if outcome.nonfinite:  # the same on every rank: the flag was reduced
                        handle_nonfinite_loss(
                            self._nonfinite_policy,
                            self.global_step,
                            weights_updated=self._optimizer_in_bwd,
                            save_checkpoint=self.save_step_checkpoint,
                        )
                    num_tokens_since_log += window.num_global_tokens
                    self._profiler.step(window.num_input_tokens)
                    pbar.update(1)

                    if self.global_step % self._log_every_n_steps == 0:
                        # Every rank takes part in the loss reduction; rank 0 writes.
                        elapsed = time.perf_counter() - t_last_log
                        metrics = self._step_metrics(window, outcome.grad_norm)
                        metrics["tokens_per_second_per_gpu"] = (
                            num_tokens_since_log / elapsed / self.world_size
                        )
                        metrics.update(self._profiler.metrics())
                        if self._is_rank_zero:
                            self._metric_logger.log_dict(metrics, step=self.global_step)
                        if "loss" in metrics:
                            pbar.set_postfix(loss=f"{metrics['loss']:.4f}")
                        num_tokens_since_log, t_last_log = 0, time.perf_counter()
                    # The epoch's last step is saved below, once the epoch is closed.
                    if should_save_step_checkpoint(
                        self.global_step,
                        self._save_every_n_steps,
                        epoch_end_step=(curr_epoch + 1) * self._steps_per_epoch,
                    ):
                        self.save_step_checkpoint()
                pbar.close()
                self.epochs_run += 1
                self.save_checkpoint(epoch=curr_epoch)
                if self._save_every_n_steps:
                    self.save_step_checkpoint()
        self._report_outputs()

    def _step_metrics(self, window: Window, grad_norm: torch.Tensor | None) -> dict[str, float]:
        """The logged metrics; the only host read-backs of the step happen here."""
        optimizer = self._optim_ckpt_wrapper if self._optimizer_in_bwd else self._optimizer
        metrics = {
            "lr": get_lr(optimizer),
            "loss_tokens": float(window.num_global_tokens),
            "skipped_steps": float(self.num_skipped_steps),
            "nonfinite_steps": float(self.num_nonfinite_steps),
        }
        if not window.skip_step():  # a skipped window has no loss to log, not a NaN one
            metrics["loss"] = window.global_mean_loss()
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        if self._log_peak_memory_stats:
            metrics.update(distributed.memory_stats(self._device))
        return metrics

    def _report_outputs(self) -> None:
        distributed.log_rank_zero(self._profiler.summary())
        distributed.log_rank_zero(f"Checkpoints are in {self._checkpoint_dir}")
        if self._log_dir is not None:
            log.info(f"TensorBoard logs are in {self._log_dir} (tensorboard --logdir <that>)")

    def cleanup(self) -> None:
        if self._is_rank_zero:
            self._metric_logger.close()
        distributed.destroy()


def _check_flag_combinations(cfg: DictConfig, device: torch.device) -> None:
    """Reject settings that cannot work together, naming the keys."""
    if cfg.optimizer_in_bwd and cfg.gradient_accumulation_steps > 1:
        raise ValueError(
            "config keys 'optimizer_in_bwd' and 'gradient_accumulation_steps': the optimizer "
            "steps inside backward, so gradients cannot accumulate; set one of them off/1."
        )
    if cfg.optimizer_in_bwd and cfg.clip_grad_norm is not None:
        raise ValueError(
            "config keys 'optimizer_in_bwd' and 'clip_grad_norm': gradients are consumed inside "
            "backward and cannot be clipped; set clip_grad_norm to null."
        )
    if cfg.optimizer_in_bwd and cfg.loss_normalization != "exact":
        raise ValueError("config key 'loss_normalization' must be exact with optimizer_in_bwd.")
    if cfg.enable_activation_offloading and device.type != "cuda":
        raise ValueError("config key 'enable_activation_offloading' needs device: cuda.")
    if cfg.enable_activation_offloading and not cfg.enable_activation_checkpointing:
        raise ValueError(
            "config key 'enable_activation_offloading' needs enable_activation_checkpointing."
        )


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains."""
    cfg = validate_config(cfg, FullFinetuneDistributedConfig, RECIPE_NAME)
    if distributed.is_rank_zero():
        config.log_config(recipe_name="FullFinetuneRecipeDistributed", cfg=cfg)
    recipe = FullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
