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

import torch
from omegaconf import DictConfig
from torchtune import config, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.data.loader import load_dataset, model_vocab_size
from exactga.kd.distillation import (
    KD_FINGERPRINT_KEYS,
    Distiller,
    build_kd_losses,
    check_vocabularies,
)
from exactga.kd.schema import KnowledgeDistillationSingleDeviceConfig
from exactga.kd.validation import distillation_validation_loss
from exactga.launch.cli import run_recipe
from exactga.lora.adapters import LoraSettings
from exactga.runtime.runtime import Runtime
from exactga.validation.held_out import validation_from_settings
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

RECIPE_NAME = "knowledge_distillation_single_device"


class KDRecipeSingleDevice(FTRecipeInterface):
    """Distils a frozen teacher into LoRA adapters on a frozen student, on one device.

    The teacher (``teacher_model`` from ``teacher_checkpointer``) is frozen and runs under
    no_grad (exactga.model_build.frozen); the student's base is frozen too (NF4 with a ``qlora_*``
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
        - Validation (``dataset_val``, ``run_val_every_n_steps``, ``batch_size_val``,
          ``max_val_batches``): ``val/loss``, ``val/class_loss``, ``val/kd_loss`` and
          ``val/perplexity`` (of the class loss) of the whole validation set as one batch over
          every rank, whatever ``batch_size_val`` or the number of ranks; at each epoch's end
          and every ``run_val_every_n_steps`` steps (docs/validation.md).
          ``keep_best_checkpoint``: the weights of each new lowest ``val/loss`` as an epoch
          folder in ``best/``, resume-safe.
        - Logging: ``loss``, ``class_loss``, ``kd_loss`` (exact window means), ``lr``,
          ``tokens_per_second_per_gpu`` as stock; ``loss_tokens``, ``skipped_steps``,
          ``grad_norm`` when clipping, the profiler hook's scalars, peak memory on GPU.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up
            (``recipe_main``'s ``validate_run_config``; each schema's ``check_flags``).
    """

    def __init__(self, cfg: KnowledgeDistillationSingleDeviceConfig) -> None:
        # Device, precision policy, kernels, threads and the seed; see [setup order].
        self._runtime = Runtime.single_device(cfg)
        self._lora = LoraSettings.from_config(cfg.model)  # the student's, as stock reads it
        self._clip_grad_norm = cfg.clip_grad_norm

    def setup(self, cfg: KnowledgeDistillationSingleDeviceConfig) -> None:
        # Resume point, metric logger, torchtune's checkpointer and the student's frozen base.
        start = RunStart(cfg, self._runtime, KD_FINGERPRINT_KEYS)
        self._model = start.build_model(cfg.model, start.adapter_weights(self._lora))
        # The frozen teacher, from its own checkpointer; never saved.
        teacher = start.frozen_model(cfg.teacher_model, cfg.teacher_checkpointer, "Teacher")
        check_vocabularies(model_vocab_size(self._model), model_vocab_size(teacher))
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = start.build_optimizer(cfg.optimizer, self._model)  # the adapters'
        loss_fn, kd_loss_fn = build_kd_losses(
            cfg.loss, cfg.kd_loss, self._model, teacher, compile_loss=cfg.compile
        )
        # The combined loss and its checks; see [two token-normalised losses].
        self._distiller = Distiller(
            self._model,
            teacher,
            loss_fn,
            kd_loss_fn,
            cfg.kd_ratio,
            precision=self._runtime.precision,
            device=self._runtime.device,
            activations_ctx=start.activations_ctx,
        )
        normalizer = start.normalizer(loss_fn)
        # Row checks, data order and loader position: see [data order] in exactga.data.loader.
        dataset = load_dataset(cfg.dataset, self._tokenizer, model_vocab_size(self._model))
        dataloader = start.dataloader(
            dataset, padding_idx=self._tokenizer.pad_id, ignore_idx=loss_fn.ignore_index
        )
        # Validation during training (dataset_val; none without it): docs/validation.md.
        self._validation = validation_from_settings(
            cfg,
            tokenizer=self._tokenizer,
            loss_fn=loss_fn,
            model=self._model,
            runtime=self._runtime,
            metric_logger=start.metric_logger,
        )
        # Checkpoints (adapters, and merged weights), scheduler, profiler, logs: set up last.
        self._run = start.training_run(
            self._model,
            self._optimizer,
            dataloader,
            normalizer,
            lora=self._lora,
            window_metrics=self._distiller.window_metrics,  # both losses, on logged steps
            track=self._distiller.track,
            validation=self._validation,  # its step checkpoints and keep_best_checkpoint
        )

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        """The teacher's and the student's forwards on one micro-batch already on the device,
        and its mean combined loss."""
        return self._distiller.loss_step(batch)

    def train(self) -> None:
        with self._run as steps:  # the profiler, the progress bar and the closing report
            for curr_epoch in steps.epochs():
                for window in steps.windows(curr_epoch):
                    for batch in window:  # this rank's micro-batches, on the device
                        loss = self._loss_step(batch)  # forward and mean loss: edit here
                        window.backward(loss)  # weighed by its exact share, then backward
                    outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                    steps.end_step(window, outcome)  # counters, scheduler, logs, checkpoints
                    self._validate_if_due(steps.progress.global_step)  # run_val_every_n_steps
                self._validate_if_due(steps.progress.global_step, epoch_end=True)
                steps.end_epoch(curr_epoch)

    def _validate_if_due(self, step: int, *, epoch_end: bool = False) -> None:
        """The student's class loss, the KD loss and their mix on the validation set as one
        batch over every rank, when due; nothing without dataset_val. See [distillation
        validation] in exactga.kd.validation."""
        if self._validation is None or not self._validation.due(step, epoch_end=epoch_end):
            return
        figure = distillation_validation_loss(self._distiller, self._validation.validation_set)
        self._validation.log(figure, step)  # val/loss, val/class_loss, val/kd_loss, ...

    def cleanup(self) -> None:
        self._run.close()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    cfg = validated_config(cfg, KnowledgeDistillationSingleDeviceConfig, RECIPE_NAME)
    recipe = KDRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
