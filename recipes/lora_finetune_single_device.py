"""LoRA and QLoRA fine-tuning on one device, with exact gradient accumulation.

A drop-in for torchtune 0.6.1's ``lora_finetune_single_device``: its configs run unchanged, and
it writes the same artefacts (adapter weights in torchtune's format and, through the checkpointer,
in PEFT's format with ``adapter_config.json``; merged full weights unless
``save_adapter_weights_only``). Only the adapters train. What differs is the loss of each
optimizer step, which here is exactly the full-batch loss of the accumulation window whatever
the split into micro-batches, with no pass over the gradients; see ``exactga.normalization`` and
docs/math.md.

Launch from the repository root (or any folder holding your copy of this file)::

    tune run recipes/lora_finetune_single_device.py --config configs/tiny/lora_single_device.yaml
    tune run recipes/lora_finetune_single_device.py --config configs/tiny/qlora_single_device.yaml
    tune run recipes/lora_finetune_single_device.py \\
        --config configs/llama3_2/1B_lora_single_device.yaml gradient_accumulation_steps=16

Copy this file to change the loop; the numerics stay in ``exactga``. See
docs/lora_finetune_single_device.md.
"""

import sys
import time
from functools import partial
from pathlib import Path
from typing import Any
from warnings import warn

import torch
import torchtune.modules.common_utils as common_utils
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.optim import Optimizer
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training.lr_schedulers import get_lr
from tqdm import tqdm

from exactga.checkpointing import (
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
from exactga.schemas import LoraFinetuneSingleDeviceConfig
from exactga.training import (
    causal_lm_loss,
    handle_nonfinite_loss,
    parse_nonfinite_policy,
    train_window,
)

log = utils.get_logger("INFO")

RECIPE_NAME = "lora_finetune_single_device"

# The model-section keys the recipe reads besides instantiating it (stock reads the same).
LORA_MODEL_KEYS = ("lora_rank", "lora_alpha", "lora_attn_modules", "apply_lora_to_mlp")


class LoRAFinetuneRecipeSingleDevice(FTRecipeInterface):
    """LoRA, DoRA and QLoRA fine-tuning of a dense decoder on one device (GPU or CPU).

    The base weights are frozen (NF4-quantised with a ``qlora_*`` builder or
    ``quantize_base: True``); only the adapter parameters get gradients and optimizer state.

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
          ``compile``, ``clip_grad_norm``, learning-rate schedulers, low-bit optimizers
          (``torchao.optim.AdamW8bit``, bitsandbytes): as in torchtune.
        - Checkpointing at each epoch's end: adapter weights and adapter config, plus merged
          full weights unless ``save_adapter_weights_only``. With ``save_every_n_steps``, atomic
          step checkpoints (adapters, optimizer, counters, RNG, data-loader position;
          ``keep_last_n_checkpoints``) from which ``resume_from_checkpoint`` goes on with the
          very next window (docs/reliability.md); without them it resumes at an epoch boundary
          from the adapter checkpoint, as stock.
        - ``nonfinite_loss``: a step with a NaN/inf loss is skipped (``skip``) or stops the run
          with a checkpoint (``stop``); one host read per step, none per micro-batch.
        - Logging through torchtune's metric loggers: ``loss`` (exact window loss), ``lr``,
          ``tokens_per_second_per_gpu``, ``loss_tokens``, ``skipped_steps``, ``grad_norm`` when
          clipping, and peak memory on GPU.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: fp16 ``dtype``; a ``model`` section without LoRA keys; ``compile`` on NPU;
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
        self._save_adapter_weights_only = cfg.save_adapter_weights_only
        self._gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self._clip_grad_norm = cfg.clip_grad_norm
        self._loss_normalization = parse_mode(cfg.loss_normalization)
        self._drop_partial_window = cfg.drop_partial_window
        self._compile = cfg.compile
        self._enable_activation_checkpointing = cfg.enable_activation_checkpointing
        self._enable_activation_offloading = cfg.enable_activation_offloading
        self._save_every_n_steps = cfg.save_every_n_steps
        self._nonfinite_policy = parse_nonfinite_policy(cfg.nonfinite_loss)
        _check_flag_combinations(cfg, self._device)

        # LoRA settings, read from the model section as stock does.
        self._lora_rank = cfg.model.lora_rank
        self._lora_alpha = cfg.model.lora_alpha
        self._lora_attn_modules = list(cfg.model.lora_attn_modules)
        self._apply_lora_to_mlp = cfg.model.apply_lora_to_mlp
        self._apply_lora_to_output = cfg.model.get("apply_lora_to_output", False)

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
        # torchtune's switch to the low-CPU-RAM version of the NF4 state-dict hook.
        common_utils._use_low_cpu_ram = cfg.low_cpu_ram
        self._model = self._setup_model(
            cfg.model,
            base_model_state_dict=ckpt_dict[training.MODEL_KEY],
            base_source=f"checkpointer.checkpoint_dir ({cfg.checkpointer.checkpoint_dir})",
            lora_weights_state_dict=(
                ckpt_dict[training.ADAPTER_KEY] if self._resume_from_checkpoint else None
            ),
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = self._setup_optimizer(
            cfg.optimizer,
            ckpt_dict.get(training.OPT_KEY) if self._resume_from_checkpoint else None,
        )

        self._loss_fn = config.instantiate(cfg.loss)
        if self._compile:
            self._loss_fn = training.compile_loss(self._loss_fn)
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
        """The base weights from torchtune's checkpointer, plus the adapters and state to go on
        from: a step checkpoint's when resuming from one, else an epoch checkpoint's."""
        self._checkpointer = config.instantiate(
            cfg_checkpointer,
            should_load_recipe_state=self._resume_from_checkpoint and from_step_checkpoint is None,
        )
        ckpt_dict = self._checkpointer.load_checkpoint()
        if from_step_checkpoint is not None:
            log.info(f"Resuming from step checkpoint {from_step_checkpoint.path}")
            restore_progress(self, from_step_checkpoint.trainer_state)
            ckpt_dict[training.ADAPTER_KEY] = from_step_checkpoint.model_state
            ckpt_dict[training.OPT_KEY] = from_step_checkpoint.optimizer_state
            ckpt_dict[training.DATALOADER_KEY] = from_step_checkpoint.rank_state["dataloader"]
        elif self._resume_from_checkpoint:
            if training.ADAPTER_KEY not in ckpt_dict:
                raise ValueError(
                    "config key 'resume_from_checkpoint': no adapter weights found in the "
                    "checkpoint; resume needs the adapter_model.pt of an earlier epoch."
                )
            self._update_recipe_state(ckpt_dict)
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
        self,
        cfg_model: DictConfig,
        base_model_state_dict: dict[str, Any],
        base_source: str,
        lora_weights_state_dict: dict[str, Any] | None,
    ) -> nn.Module:
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        self.adapter_params = get_adapter_params(model)
        self._is_dora = any("magnitude" in name for name in self.adapter_params)
        set_trainable_params(model, self.adapter_params)
        if self._compile:
            training.compile_model(model)
        if self._enable_activation_checkpointing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
            )

        base_missing, base_unexpected = load_model_state(
            model, base_model_state_dict, base_source, strict=False
        )
        # DoRA magnitudes are initialised from the loaded base weights.
        if self._is_dora:
            for module in model.modules():
                if hasattr(module, "initialize_dora_magnitude"):
                    module.initialize_dora_magnitude()
        lora_missing = lora_unexpected = None
        if lora_weights_state_dict:
            lora_missing, lora_unexpected = model.load_state_dict(
                lora_weights_state_dict, strict=False
            )
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=self._lora_attn_modules,
            apply_lora_to_mlp=self._apply_lora_to_mlp,
            apply_lora_to_output=self._apply_lora_to_output,
            base_missing=base_missing,
            base_unexpected=base_unexpected,
            lora_missing=lora_missing,
            lora_unexpected=lora_unexpected,
        )
        training.validate_expected_param_dtype(self.adapter_params.items(), dtype=self._dtype)
        self._activations_handling_ctx = training.get_act_offloading_ctx_manager(
            model, self._enable_activation_offloading
        )
        num_trainable = sum(p.numel() for p in self.adapter_params.values())
        log.info(
            f"Model is initialized with precision {self._dtype}; "
            f"{num_trainable:,} trainable adapter parameters."
        )
        if self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))
        return model

    def _setup_optimizer(
        self, cfg_optimizer: DictConfig, opt_state_dict: dict[str, Any] | None
    ) -> Optimizer:
        # All parameters, as stock passes them; the frozen ones never get a gradient.
        optimizer = config.instantiate(cfg_optimizer, self._model.parameters())
        if opt_state_dict:
            optimizer.load_state_dict(opt_state_dict)
        return optimizer

    def _setup_lr_scheduler(
        self, cfg_lr_scheduler: DictConfig | None, num_training_steps: int, last_epoch: int
    ) -> Any:
        if cfg_lr_scheduler is None:
            return None
        return config.instantiate(
            cfg_lr_scheduler,
            self._optimizer,
            num_training_steps=num_training_steps,
            last_epoch=last_epoch,
        )

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
        """Adapter weights and config, merged weights unless adapter-only, recipe state if
        training goes on: the same dictionary stock hands its checkpointer."""
        ckpt_dict: dict[str, Any] = {}
        intermediate = epoch + 1 < self.total_epochs
        if intermediate:
            ckpt_dict.update(
                {
                    training.OPT_KEY: self._optimizer.state_dict(),
                    training.SEED_KEY: self.seed,
                    training.EPOCHS_KEY: self.epochs_run,
                    training.TOTAL_EPOCHS_KEY: self.total_epochs,
                    training.MAX_STEPS_KEY: self.max_steps_per_epoch,
                    # See [loader position at epoch ends] in exactga.checkpointing.
                    training.DATALOADER_KEY: None,
                }
            )
        ckpt_dict[training.ADAPTER_KEY] = get_adapter_state_dict(self._model.state_dict())
        if not self._save_adapter_weights_only:
            # A host copy, so merging does not need a second model on the device. A copy even on
            # CPU: torchtune merges in place, and ``.cpu()`` of a CPU tensor is the tensor
            # itself, so the frozen base would silently take the adapters in (stock's bug).
            state_dict = {k: v.to("cpu", copy=True) for k, v in self._model.state_dict().items()}
            ckpt_dict[training.MODEL_KEY] = get_merged_lora_ckpt(
                state_dict, rank=self._lora_rank, alpha=self._lora_alpha
            )
        ckpt_dict[training.ADAPTER_CONFIG] = {
            "r": self._lora_rank,
            "lora_alpha": self._lora_alpha,
            "target_modules": get_lora_module_names(
                self._lora_attn_modules, self._apply_lora_to_mlp, self._apply_lora_to_output
            ),
            "peft_type": "LORA",
        }
        self._checkpointer.save_checkpoint(
            ckpt_dict,
            epoch=epoch,
            intermediate_checkpoint=intermediate,
            adapter_only=self._save_adapter_weights_only,
        )

    def save_step_checkpoint(self) -> Path:
        """Everything a resumed run needs to go on with the next window; atomic. The frozen
        base is not in it: a resumed run reads it from the checkpointer again."""
        return self._step_checkpointer.save(
            self.global_step,
            model_state={name: p.detach() for name, p in self.adapter_params.items()},
            optimizer_state=self._optimizer.state_dict(),
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
                        optimizer=self._optimizer,
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
                            weights_updated=False,
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
        metrics = {
            "lr": get_lr(self._optimizer),
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
        log.info(f"Adapters and checkpoints are in {self._checkpoint_dir}")
        if self._log_dir is not None:
            log.info(f"TensorBoard logs are in {self._log_dir} (tensorboard --logdir <that>)")

    def cleanup(self) -> None:
        self._metric_logger.close()


def _check_flag_combinations(cfg: DictConfig, device: torch.device) -> None:
    """Reject settings that cannot work together, naming the keys."""
    missing = [key for key in LORA_MODEL_KEYS if key not in cfg.model]
    if missing:
        raise ValueError(
            f"config key 'model' ({cfg.model.get('_component_')}) has no "
            f"{', '.join('model.' + key for key in missing)}: this recipe needs a LoRA or QLoRA "
            "builder (e.g. torchtune.models.llama3_2.lora_llama3_2_1b); for full fine-tuning "
            "use recipes/full_finetune_single_device.py."
        )
    if cfg.compile and device.type == "npu":
        raise ValueError("config key 'compile': NPU does not support compilation; set False.")
    if cfg.enable_activation_offloading and device.type != "cuda":
        raise ValueError("config key 'enable_activation_offloading' needs device: cuda.")
    if cfg.enable_activation_offloading and not cfg.enable_activation_checkpointing:
        raise ValueError(
            "config key 'enable_activation_offloading' needs enable_activation_checkpointing."
        )


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains."""
    cfg = validate_config(cfg, LoraFinetuneSingleDeviceConfig, RECIPE_NAME)
    config.log_config(recipe_name="LoRAFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = LoRAFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
