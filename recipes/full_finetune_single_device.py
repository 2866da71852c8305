"""Full fine-tuning on one device, with exact gradient accumulation.

A drop-in for torchtune 0.6.1's ``full_finetune_single_device``: its configs run unchanged,
with the same checkpointer outputs and metric names. What differs is the loss of each optimizer
step, which here is exactly the full-batch loss of the accumulation window (sum of token losses
over the window's loss tokens) whatever the split into micro-batches, with no pass over the
gradients; see ``exactga.normalization`` and docs/math.md.

Launch from the repository root (or any folder holding your copy of this file)::

    tune run recipes/full_finetune_single_device.py --config configs/tiny/full_single_device.yaml
    tune run recipes/full_finetune_single_device.py \\
        --config configs/llama3_2/1B_full_single_device.yaml gradient_accumulation_steps=8

Copy this file to change the loop; the numerics stay in ``exactga``. docs/ has a page per recipe.
"""

import sys
import time
from functools import partial
from pathlib import Path
from typing import Any
from warnings import warn

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.optim import Optimizer
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training.lr_schedulers import get_lr
from tqdm import tqdm

from exactga.checkpointing import (
    MODEL_FILE,
    StepCheckpoint,
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
from exactga.schemas import FullFinetuneSingleDeviceConfig
from exactga.training import (
    causal_lm_loss,
    handle_nonfinite_loss,
    parse_nonfinite_policy,
    train_window,
)

log = utils.get_logger("INFO")

RECIPE_NAME = "full_finetune_single_device"


class FullFinetuneRecipeSingleDevice(FTRecipeInterface):
    """Full fine-tuning of a dense decoder (Llama, Qwen, ...) on one device (GPU or CPU).

    Features (each a config key; defaults in ``exactga.schemas``):
        - Exact gradient accumulation (``gradient_accumulation_steps``): each window of micro-
          batches is prefetched, its loss tokens counted on the host after the label shift, and
          each micro-batch loss scaled by ``batch_tokens / window_tokens`` before backward. With
          one micro-batch no scaling op runs at all. An epoch's last, short window is a step of
          its own (``drop_partial_window: True`` drops it); a window without a loss token skips
          the optimizer step and is counted in the ``skipped_steps`` metric.
        - ``loss_normalization``: ``exact`` (default); ``post_scale`` (stock torchtune) and
          ``naive`` (mean of micro-batch means) exist for benchmarks and parity reports.
        - Precision (``dtype``: fp32 or bf16), activation checkpointing and offloading,
          ``compile``, ``optimizer_in_bwd`` (needs ``gradient_accumulation_steps: 1``),
          ``clip_grad_norm``, learning-rate schedulers: as in torchtune.
        - Checkpointing through torchtune's checkpointers at each epoch's end, and with
          ``save_every_n_steps`` atomic step checkpoints (``keep_last_n_checkpoints``) holding
          weights, optimizer, counters, RNG and data-loader position: ``resume_from_checkpoint``
          then goes on with the very next window and ends where an uninterrupted run would
          (see docs/reliability.md). Without step checkpoints it resumes at an epoch boundary.
        - ``nonfinite_loss``: a step with a NaN/inf loss is skipped (``skip``) or stops the run
          with a checkpoint (``stop``); one host read per step, none per micro-batch.
        - Logging through torchtune's metric loggers: ``loss`` (exact window loss), ``lr``,
          ``tokens_per_second_per_gpu``, ``loss_tokens``, ``skipped_steps``, ``grad_norm`` when
          clipping, and peak memory on GPU.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: fp16 ``dtype``; ``optimizer_in_bwd`` with accumulation or clipping;
            ``enable_activation_offloading`` off CUDA or without activation checkpointing.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        if self._dtype == torch.float16:
            raise ValueError("config key 'dtype': fp16 is not supported; use bf16 or fp32.")

        self._output_dir = cfg.output_dir
        self._log_every_n_steps = cfg.log_every_n_steps
        self._log_peak_memory_stats = cfg.log_peak_memory_stats and self._device.type != "cpu"

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
        _check_flag_combinations(cfg, self._device)

        # Public state, updated by the checkpoint loader when resuming.
        self.seed = training.set_seed(seed=cfg.seed, debug_mode=cfg.cudnn_deterministic_mode)
        self.epochs_run = 0
        self.total_epochs = cfg.epochs
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.global_step = 0
        self.num_skipped_steps = 0
        self.num_nonfinite_steps = 0

    def setup(self, cfg: DictConfig) -> None:
        self._metric_logger = config.instantiate(cfg.metric_logger)
        self._metric_logger.log_config(cfg)

        self._step_checkpointer = step_checkpointer_for(cfg.output_dir, cfg.keep_last_n_checkpoints)
        self._fingerprint = run_fingerprint(cfg, world_size=1)
        resume = find_resume_checkpoint(self._step_checkpointer, cfg, self._fingerprint)
        ckpt_dict = self.load_checkpoint(cfg.checkpointer, from_step_checkpoint=resume)
        self._model = self._setup_model(
            cfg.model, ckpt_dict[training.MODEL_KEY], ckpt_dict["source"]
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(
            cfg.optimizer,
            ckpt_dict.get(training.OPT_KEY) if self._resume_from_checkpoint else None,
        )

        self._loss_fn = config.instantiate(cfg.loss)
        if self._compile:
            training.compile_loss(self._loss_fn)
        if hasattr(self._loss_fn, "num_output_chunks"):
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        self._normalizer = LossNormalizer(
            self._loss_fn,
            self._gradient_accumulation_steps,
            mode=self._loss_normalization,
            drop_partial_window=self._drop_partial_window,
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
        self._profiler = setup_profiler(cfg, self._device, self._model)
        self._checkpoint_dir = cfg.checkpointer.output_dir
        self._log_dir = getattr(self._metric_logger, "log_dir", None)
        if resume is not None:  # last: model and data setup above draw from the RNGs
            restore_rng_state(resume.rank_state["rng"], self._device)

    def load_checkpoint(
        self, cfg_checkpointer: DictConfig, from_step_checkpoint: StepCheckpoint | None
    ) -> dict[str, Any]:
        """Weights and state to start from: a step checkpoint when resuming from one, else
        torchtune's checkpointer (the base model, or an epoch checkpoint when resuming)."""
        self._checkpointer = config.instantiate(
            cfg_checkpointer,
            should_load_recipe_state=self._resume_from_checkpoint and from_step_checkpoint is None,
        )
        # Read even when a step checkpoint replaces its weights: the HF checkpointer learns
        # there the layout it writes the epoch checkpoints in.
        ckpt_dict = self._checkpointer.load_checkpoint()
        if from_step_checkpoint is not None:
            log.info(f"Resuming from step checkpoint {from_step_checkpoint.path}")
            restore_progress(self, from_step_checkpoint.trainer_state)
            return {
                training.MODEL_KEY: from_step_checkpoint.model_state,
                training.OPT_KEY: from_step_checkpoint.optimizer_state,
                training.DATALOADER_KEY: from_step_checkpoint.rank_state["dataloader"],
                "source": str(from_step_checkpoint.path / MODEL_FILE),
            }
        if self._resume_from_checkpoint:
            self._update_recipe_state(ckpt_dict)
        ckpt_dict["source"] = f"checkpointer.checkpoint_dir ({cfg_checkpointer.checkpoint_dir})"
        return ckpt_dict

    def _update_recipe_state(self, ckpt_dict: dict[str, Any]) -> None:
        try:
            self.epochs_run = ckpt_dict[training.EPOCHS_KEY]
            if self.seed != ckpt_dict[training.SEED_KEY]:
                warn(
                    f"config seed differs from the checkpoint's; using {ckpt_dict['seed']}.",
                    stacklevel=2,
                )
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
        self, cfg_model: DictConfig, model_state_dict: dict[str, Any], source: str
    ) -> nn.Module:
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        if self._compile:
            training.compile_model(model)
        if self._enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )
        load_model_state(model, model_state_dict, source)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._enable_activation_offloading
        )
        log.info(f"Model is initialized with precision {self._dtype}.")
        if self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))
        return model

    def _setup_optimizer(
        self, cfg_optimizer: DictConfig, opt_state_dict: dict[str, Any] | None
    ) -> Optimizer | None:
        if not self._optimizer_in_bwd:
            optimizer = config.instantiate(cfg_optimizer, self._model.parameters())
            if opt_state_dict:
                optimizer.load_state_dict(opt_state_dict)
            return optimizer
        # One optimizer per parameter, stepped by hooks as its gradient is ready.
        optim_dict = {p: config.instantiate(cfg_optimizer, [p]) for p in self._model.parameters()}
        training.register_optim_in_bwd_hooks(model=self._model, optim_dict=optim_dict)
        self._optim_ckpt_wrapper = training.create_optim_in_bwd_wrapper(
            model=self._model, optim_dict=optim_dict
        )
        if opt_state_dict is not None:
            self._optim_ckpt_wrapper.load_state_dict(opt_state_dict)
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
        sampler = StatefulDistributedSampler(ds, num_replicas=1, rank=0, shuffle=shuffle, seed=0)
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
        ckpt_dict: dict[str, Any] = {training.MODEL_KEY: self._model.state_dict()}
        intermediate = epoch + 1 < self.total_epochs
        if intermediate:
            ckpt_dict.update(
                {
                    training.SEED_KEY: self.seed,
                    training.EPOCHS_KEY: self.epochs_run,
                    training.TOTAL_EPOCHS_KEY: self.total_epochs,
                    training.MAX_STEPS_KEY: self.max_steps_per_epoch,
                    # See [loader position at epoch ends] in exactga.checkpointing.
                    training.DATALOADER_KEY: None,
                    training.OPT_KEY: (
                        self._optim_ckpt_wrapper.state_dict()
                        if self._optimizer_in_bwd
                        else self._optimizer.state_dict()
                    ),
                }
            )
        self._checkpointer.save_checkpoint(
            ckpt_dict, epoch=epoch, intermediate_checkpoint=intermediate
        )

    def save_step_checkpoint(self) -> Path:
        """Everything a resumed run needs to go on with the next window; atomic."""
        return self._step_checkpointer.save(
            self.global_step,
            model_state=self._model.state_dict(),
            optimizer_state=(
                self._optim_ckpt_wrapper.state_dict()
                if self._optimizer_in_bwd
                else self._optimizer.state_dict()
            ),
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
        if self._compile:
            log.info("torch.compile is on: expect a slow first step while it compiles.")
        if not self._optimizer_in_bwd:
            self._optimizer.zero_grad()
        num_tokens_since_log, t_last_log = 0, time.perf_counter()

        with self._profiler:
            for curr_epoch in range(self.epochs_run, self.total_epochs):
                self._dataloader.sampler.set_epoch(curr_epoch)
                # Non-zero only when resuming from a step checkpoint taken mid-epoch.
                steps_done = self.global_step - curr_epoch * self._steps_per_epoch
                pbar = tqdm(
                    total=self._steps_per_epoch, initial=steps_done, desc=f"epoch {curr_epoch + 1}"
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
                    )
                    self.num_skipped_steps += outcome.skipped
                    self.num_nonfinite_steps += outcome.nonfinite
                    if self._lr_scheduler is not None:
                        self._lr_scheduler.step()
                    self.global_step += 1
                    if outcome.nonfinite:
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
                        elapsed = time.perf_counter() - t_last_log
                        metrics = self._step_metrics(window, outcome.grad_norm)
                        metrics["tokens_per_second_per_gpu"] = num_tokens_since_log / elapsed
                        metrics.update(self._profiler.metrics())
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
            metrics["loss"] = window.mean_loss()
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        if self._log_peak_memory_stats:
            metrics.update(training.get_memory_stats(device=self._device))
        return metrics

    def _report_outputs(self) -> None:
        log.info(self._profiler.summary())
        log.info(f"Checkpoints are in {self._checkpoint_dir}")
        if self._log_dir is not None:
            log.info(f"TensorBoard logs are in {self._log_dir} (tensorboard --logdir <that>)")

    def cleanup(self) -> None:
        self._metric_logger.close()


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
    cfg = validate_config(cfg, FullFinetuneSingleDeviceConfig, RECIPE_NAME)
    config.log_config(recipe_name="FullFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
