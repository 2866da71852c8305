"""Knowledge distillation into a LoRA student on one device, with exact gradient accumulation.

A drop-in for torchtune 0.6.1's ``knowledge_distillation_single_device``: its configs
(``teacher_model``, ``teacher_checkpointer``, ``kd_loss``, ``kd_ratio`` and the LoRA student's
keys) run unchanged, and it writes the same artefacts (student adapters in torchtune's and
PEFT's format with ``adapter_config.json``; merged student weights unless
``save_adapter_weights_only``) and metrics (``loss``, ``class_loss``, ``kd_loss``, ``lr``,
``tokens_per_second_per_gpu``), plus ours. What differs is the loss of each optimizer step:
``(1 - kd_ratio)`` times the class loss plus ``kd_ratio`` times the KD loss, each exactly the
full-batch mean over the window's loss tokens whatever the split into micro-batches, with no
pass over the gradients; see ``exactga.kd.distillation`` and
docs/knowledge_distillation_single_device.md.

Launch from the repository root (or any folder holding your copy of this file)::

    tune run recipes/knowledge_distillation_single_device.py \\
        --config configs/tiny/kd_single_device.yaml
    tune run recipes/knowledge_distillation_single_device.py \\
        --config configs/llama3_2/8B_to_1B_KD_lora_single_device.yaml gradient_accumulation_steps=16

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import sys

import torchtune.modules.common_utils as common_utils
from omegaconf import DictConfig
from torch import nn
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.optimizers import build_optimizer
from exactga.accumulation.step import StepContext
from exactga.data.loader import dataloader_from_config, load_dataset, model_vocab_size
from exactga.kd.distillation import KD_FINGERPRINT_KEYS, Distiller, check_vocabularies
from exactga.kd.schema import KnowledgeDistillationSingleDeviceConfig
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
from exactga.setup.frozen import freeze_model
from exactga.setup.lora import LoraSettings
from exactga.setup.model import AdapterWeights, ModelSettings, build_model

log = utils.get_logger("INFO")

RECIPE_NAME = "knowledge_distillation_single_device"


class KDRecipeSingleDevice(FTRecipeInterface):
    """Distils a frozen teacher into LoRA adapters on a frozen student, on one device.

    The teacher (``teacher_model`` from ``teacher_checkpointer``) is frozen and runs under
    no_grad (exactga.setup.frozen); the student's base is frozen too (NF4 with a ``qlora_*``
    builder), so only its adapters get gradients and optimizer state.

    Features (each a config key; defaults in ``exactga.config.schemas``):
        - The loss (``kd_ratio`` = r): ``(1 - r) loss + r kd_loss``, the class loss and the KD
          loss (``kd_loss``: torchtune's forward, reverse or symmetric KL, chunked or not) both
          means over the same loss tokens, so each micro-batch's mix is weighted by the
          window's one count after the label shift; the KD loss's denominator is checked on the
          first batch, as the class loss's is. See [two token-normalised losses] in
          ``exactga.kd.distillation``.
        - Exact gradient accumulation (``gradient_accumulation_steps``), ``loss_normalization``,
          ``micro_batching``, ``drop_partial_window``, skipped empty windows
          (``skipped_steps``): as in recipes/lora_finetune_single_device.py, through the same
          ``exactga.accumulation.normalization`` calls.
        - Precision (``dtype``: fp32 or bf16; ``master_weights``: fp32 adapters over the bf16
          base by default), activation checkpointing and offloading (of the student),
          ``compile`` (both models and both losses), ``clip_grad_norm``, schedulers, low-bit
          optimizers: as in the LoRA recipe.
        - Checkpointing at each epoch's end: the student's adapters and adapter config, merged
          student weights unless ``save_adapter_weights_only``; with ``save_every_n_steps``,
          atomic step checkpoints from which ``resume_from_checkpoint`` goes on with the very
          next window, bit for bit (docs/reliability.md). The teacher is never saved.
        - ``nonfinite_loss``: ``skip`` or ``stop``, as in the LoRA recipe.
        - Logging: ``loss``, ``class_loss``, ``kd_loss`` (exact window means), ``lr``,
          ``tokens_per_second_per_gpu`` as stock; ``loss_tokens``, ``skipped_steps``,
          ``grad_norm`` when clipping, the profiler hook's scalars, peak memory on GPU.

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
        self._kd_ratio = cfg.kd_ratio

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
        self._step_checkpointer, self._fingerprint, resume = start_run(cfg, KD_FINGERPRINT_KEYS)
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
        self._teacher_model = self._setup_teacher_model(cfg.teacher_model, cfg.teacher_checkpointer)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer,
            self._model,
            state=resume.optimizer_state(ckpt_dict),
        )

        self._loss_fn = config.instantiate(cfg.loss)
        self._kd_loss_fn = config.instantiate(cfg.kd_loss)
        if self._compile:
            self._loss_fn = training.compile_loss(self._loss_fn)
            self._kd_loss_fn = training.compile_loss(self._kd_loss_fn)
        if hasattr(self._loss_fn, "num_output_chunks"):
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
            self._teacher_model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        # The combined loss and its checks; see [two token-normalised losses].
        self._distiller = Distiller(
            self._model,
            self._teacher_model,
            self._loss_fn,
            self._kd_loss_fn,
            self._kd_ratio,
            precision=self._precision,
            device=self._device,
            activations_ctx=self._activations_handling_ctx,
        )
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

    def _setup_teacher_model(
        self, cfg_teacher: DictConfig, cfg_teacher_checkpointer: DictConfig
    ) -> nn.Module:
        """The frozen teacher in ``dtype``, from its own checkpointer (never saved)."""
        teacher_state = config.instantiate(cfg_teacher_checkpointer).load_checkpoint()
        with training.set_default_dtype(self._dtype), self._device:
            teacher = config.instantiate(cfg_teacher)
        teacher.load_state_dict(teacher_state[training.MODEL_KEY])
        freeze_model(teacher)
        if self._compile:
            training.compile_model(teacher)
        check_vocabularies(model_vocab_size(self._model), model_vocab_size(teacher))
        training.validate_expected_param_dtype(teacher.named_parameters(), dtype=self._dtype)
        num_params = sum(p.numel() for p in teacher.parameters())
        log.info(f"Teacher is initialized with precision {self._dtype}; {num_params:,} frozen.")
        if self._device.type != "cpu":
            training.log_memory_stats(training.get_memory_stats(device=self._device))
        return teacher

    def save_checkpoint(self, epoch: int) -> None:
        """The epoch's checkpoint, as stock writes it."""
        self._checkpoints.save_epoch(self._model, self._optimizer, epoch)

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
                        loss = self._distiller.loss_step(batch)  # forward and mean loss: edit here
                        window.backward(loss)  # weighed by its exact share, then backward
                    outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                    report = steps.end_step(window, outcome)  # .loss: on logged steps
                    log.debug("step %d: loss %s", report.step, report.loss)  # print() is bar-safe
                steps.end_epoch(curr_epoch)
        outputs = "Student adapters and checkpoints"
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
            window_metrics=self._distiller.window_metrics,
            track=self._distiller.track,
        )

    def cleanup(self) -> None:
        close_metric_logger(self._metric_logger)


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains."""
    cfg = validate_run_config(cfg, KnowledgeDistillationSingleDeviceConfig, RECIPE_NAME)
    config.log_config(recipe_name="KDRecipeSingleDevice", cfg=cfg)
    recipe = KDRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
