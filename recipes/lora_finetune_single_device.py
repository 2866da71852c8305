"""LoRA and QLoRA fine-tuning on one device, with exact gradient accumulation.

A drop-in for torchtune 0.6.1's ``lora_finetune_single_device``: its configs run unchanged, and
it writes the same artefacts (adapter weights in torchtune's format and, through the checkpointer,
in PEFT's format with ``adapter_config.json``; merged full weights unless
``save_adapter_weights_only``). Only the adapters train. What differs is the loss of each
optimizer step, which here is exactly the full-batch loss of the accumulation window whatever
the split into micro-batches, with no pass over the gradients; see
``exactga.accumulation.normalization`` and docs/math.md.

Launch from the repository root (or any folder holding your copy of this file)::

    tune run recipes/lora_finetune_single_device.py --config configs/tiny/lora_single_device.yaml
    tune run recipes/lora_finetune_single_device.py --config configs/tiny/qlora_single_device.yaml
    tune run recipes/lora_finetune_single_device.py \\
        --config configs/llama3_2/1B_lora_single_device.yaml gradient_accumulation_steps=16

Copy this file to change the loop; the numerics stay in ``exactga``. See
docs/lora_finetune_single_device.md.
"""

import sys

import torch
import torchtune.modules.common_utils as common_utils
from omegaconf import DictConfig
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.optimizers import build_optimizer
from exactga.accumulation.step import StepContext
from exactga.config.schemas import LoraFinetuneSingleDeviceConfig
from exactga.data.loader import dataloader_from_config, load_dataset, model_vocab_size
from exactga.launch.cli import run_recipe
from exactga.profiling import profiler_from_config
from exactga.run.metric_logging import close_metric_logger, open_run_logger, report_outputs
from exactga.run.progress import TrainingProgress, build_lr_scheduler
from exactga.run.resume import start_run, validate_run_config
from exactga.run.steps import StepBook, StepBookSettings
from exactga.run.threads import use_cpu_threads
from exactga.runtime.kernels import choose_attention_kernels
from exactga.runtime.precision import Precision
from exactga.setup.checkpoints import RunCheckpoints
from exactga.setup.lora import LoraSettings
from exactga.setup.model import AdapterWeights, ModelSettings, build_loss, build_model
from exactga.sft.loss import causal_lm_loss

log = utils.get_logger("INFO")

RECIPE_NAME = "lora_finetune_single_device"


class LoRAFinetuneRecipeSingleDevice(FTRecipeInterface):
    """LoRA, DoRA and QLoRA fine-tuning of a dense decoder on one device (GPU or CPU).

    The base weights are frozen (NF4-quantised with a ``qlora_*`` builder or
    ``quantize_base: True``); only the adapter parameters get gradients and optimizer state.

    Features (each a config key; defaults in ``exactga.config.schemas``):
        - Exact gradient accumulation (``gradient_accumulation_steps``): each window of micro-
          batches is prefetched, its loss tokens counted on the host after the label shift, and
          each micro-batch loss scaled by ``batch_tokens / window_tokens`` before backward. With
          one micro-batch no scaling op runs at all. An epoch's last, short window is a step of
          its own (``drop_partial_window: True`` drops it); a window without a loss token skips
          the optimizer step and is counted in the ``skipped_steps`` metric.
        - ``loss_normalization``: ``exact`` (default); ``post_scale`` (stock torchtune) and
          ``naive`` (mean of micro-batch means) exist for benchmarks and parity reports.
        - ``micro_batching``: how each window's samples are cut into micro-batches, exact in
          every mode: ``by_length`` (default: sorted by length, least padding), ``fixed`` (the
          loader's order, as stock), ``token_budget`` (``micro_batch_tokens`` padded positions
          per micro-batch). Logs ``throughput/padding_fraction``; see docs/micro_batching.md.
        - Precision (``dtype``: fp32 or bf16), activation checkpointing and offloading,
          ``compile``, ``clip_grad_norm``, learning-rate schedulers, low-bit optimizers
          (``torchao.optim.AdamW8bit``, bitsandbytes): as in torchtune. Under bf16 the
          adapters, their gradients and optimizer state are fp32 over the bf16 base
          (``master_weights: fp32``, the default; ``none`` is stock's pure bf16), and are
          written in the base's dtype (docs/precision.md).
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
        ValueError: bad values and impossible combinations of config keys, at start-up
            (``recipe_main``'s ``validate_run_config``; each schema's ``check_flags``).
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._precision = Precision.from_config(self._dtype, cfg.master_weights, self._device)
        self._attention_kernels = choose_attention_kernels(cfg.cudnn_attention, self._device)
        self._cpu_threads = use_cpu_threads(cfg.cpu_threads)  # see [cpu threads]

        self._book_settings = StepBookSettings.from_config(cfg)  # logging, saving, non-finite

        self._save_adapter_weights_only = cfg.save_adapter_weights_only
        self._clip_grad_norm = cfg.clip_grad_norm
        self._loss_normalization = cfg.loss_normalization
        self._compile = cfg.compile
        self._model_settings = ModelSettings.from_config(cfg, self._device)

        # LoRA settings, read from the model section as stock does.
        self._lora = LoraSettings.from_config(cfg.model)

        # Epochs, steps and their outcomes; a resume sets them in setup.
        self._progress = TrainingProgress(
            seed=training.set_seed(seed=cfg.seed, debug_mode=cfg.cudnn_deterministic_mode),
            total_epochs=cfg.epochs,
            max_steps_per_epoch=cfg.max_steps_per_epoch,
        )

    def setup(self, cfg: DictConfig) -> None:
        # Where to go on from: nothing, torchtune's epoch checkpoint or a step checkpoint.
        self._step_checkpointer, self._fingerprint, resume = start_run(cfg)
        # A resumed run's curves go on in its run ([resumed TensorBoard run]).
        self._metric_logger = open_run_logger(cfg, resumed=resume.resumed)
        self._checkpointer = self._precision.saving_in_dtype(  # adapters, merged: in dtype
            config.instantiate(
                cfg.checkpointer, should_load_recipe_state=resume.from_epoch_checkpoint
            )
        )
        ckpt_dict = self._checkpointer.load_checkpoint()  # the frozen base, always
        resume.restore_progress(self._progress, ckpt_dict)

        # torchtune's switch to the low-CPU-RAM version of the NF4 state-dict hook.
        common_utils._use_low_cpu_ram = cfg.low_cpu_ram
        # Built, adapters made trainable, cast, compiled, checkpointed and loaded in the one
        # order; see exactga.setup.model.
        built = build_model(
            cfg.model,
            AdapterWeights.at_start(
                self._lora, resume, ckpt_dict, cfg.checkpointer, self._progress.seed
            ),
            precision=self._precision,
            device=self._device,
            settings=self._model_settings,
            notes=(self._attention_kernels, self._cpu_threads),
        )
        self._model, self._activations_handling_ctx = built.model, built.activations_ctx
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer,
            self._model,
            state=resume.optimizer_state(ckpt_dict),
        )

        self._loss_fn = build_loss(cfg.loss, self._model, compile_loss=self._compile)
        self._normalizer = LossNormalizer(
            self._loss_fn,
            mode=self._loss_normalization,
        )

        # Data order, row checks and loader position: see [data order] in exactga.data.loader.
        dataset = load_dataset(cfg.dataset, self._tokenizer, model_vocab_size(self._model))
        self._dataloader = dataloader_from_config(
            dataset,
            cfg,
            padding_idx=self._tokenizer.pad_id,
            ignore_idx=self._loss_fn.ignore_index,
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
            epoch_writer=self._checkpointer,
            lora=self._lora,
            adapter_only=self._save_adapter_weights_only,
        )
        self._lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self._optimizer, self._progress)
        # Phase timings on every rank; traces, snapshots and the report on rank 0.
        self._profiler = profiler_from_config(cfg, self._device, self._model, self._metric_logger)
        self._checkpoint_dir = cfg.checkpointer.output_dir
        resume.restore_rng(self._device)  # last: model and data setup above draw from the RNGs

    def save_checkpoint(self, epoch: int) -> None:
        """The epoch's checkpoint, as stock writes it."""
        self._checkpoints.save_epoch(self._model, self._optimizer, epoch)

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and mean loss of one micro-batch already on the device."""
        return causal_lm_loss(
            self._model, self._loss_fn, batch, self._activations_handling_ctx, self._precision
        )

    def train(self) -> None:
        if self._compile:
            log.info("torch.compile is on: expect a slow first step while it compiles.")
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
        outputs = "Adapters and checkpoints"
        report_outputs(self._profiler.summary(), self._checkpoint_dir, self._metric_logger, outputs)

    def _step_book(self) -> StepBook:
        """The loop's bookkeeping: counters, scheduler, non-finite policy, logs and
        checkpoints, in the one order; see [step bookkeeping] in ``exactga.run.steps``."""
        return StepBook(
            self._progress,
            context=StepContext(self._model, self._device, self._profiler),
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


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains."""
    cfg = validate_run_config(cfg, LoraFinetuneSingleDeviceConfig, RECIPE_NAME)
    config.log_config(recipe_name="LoRAFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = LoRAFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
