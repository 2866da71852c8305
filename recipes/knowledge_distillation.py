"""Knowledge distillation into a LoRA student with exact gradient accumulation, on one device or
with FSDP2 on every rank, GPUs or CPUs.

A drop-in for torchtune 0.6.1's ``knowledge_distillation_single_device`` and
``knowledge_distillation_distributed``: this one file runs under both names (``tune ls``:
``exactga/<name>``), and their configs (``teacher_model``, ``teacher_checkpointer``,
``kd_loss``, ``kd_ratio`` and the LoRA student's keys) run unchanged, with the same artefacts,
written by rank 0 (student adapters in torchtune's and PEFT's format with
``adapter_config.json``; merged student weights unless ``save_adapter_weights_only``) and metrics
(``loss``, ``class_loss``, ``kd_loss``, ``lr``, ``tokens_per_second_per_gpu``), plus ours. Under
torchrun it trains on every rank, student and teacher both sharded over the data-parallel ranks,
else on one device (or as one rank, launched as the distributed name or with a distributed
config): see [one recipe, two launches] in exactga.launch.twins. What differs from stock: the
loss of each optimizer step is exactly ``(1 - kd_ratio)`` times the full-batch class loss plus
``kd_ratio`` times the full-batch KD loss of the window over every rank, whatever the split into
ranks and micro-batches, with no pass over the gradients; ranks may hold very different token
counts, or none; ``device: cpu`` runs distributed (gloo). See ``exactga.kd.distillation``,
docs/knowledge_distillation_single_device.md and docs/knowledge_distillation_distributed.md.

Launch from the repository root (or any folder holding your copy of this file)::

    tune run recipes/knowledge_distillation.py --config configs/tiny/kd_single_device.yaml
    tune run recipes/knowledge_distillation.py \\
        --config configs/llama3_2/8B_to_1B_KD_lora_single_device.yaml gradient_accumulation_steps=16
    tune run --nproc_per_node 2 recipes/knowledge_distillation.py \\
        --config configs/tiny/kd_distributed.yaml
    tune run --nproc_per_node 8 recipes/knowledge_distillation.py \\
        --config configs/llama3_2/8B_to_1B_KD_lora_distributed.yaml

Copy this file to change the loop (``tune cp exactga/knowledge_distillation_single_device
my.py``; the distributed name copies the same file); the numerics stay in ``exactga``.
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
from exactga.kd.schema import KNOWLEDGE_DISTILLATION, KnowledgeDistillationConfig
from exactga.kd.validation import distillation_validation_loss
from exactga.launch.cli import run_recipe
from exactga.lora.adapters import LoraSettings
from exactga.runtime.runtime import Runtime
from exactga.validation.held_out import validation_from_settings
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

# The family of torchtune's two names for this file: knowledge_distillation_single_device and
# knowledge_distillation_distributed (see [one recipe, two launches] in exactga.launch.twins).
RECIPE_NAME = "knowledge_distillation"


class KDRecipe(FTRecipeInterface):
    """Distils a frozen teacher into LoRA adapters on a frozen student, on one device or with
    FSDP2 on every rank.

    The teacher (``teacher_model`` from ``teacher_checkpointer``) is frozen and runs under
    no_grad (exactga.model_build.frozen); the student's base is frozen too (NF4 with a ``qlora_*``
    builder), so only its adapters get gradients, optimizer state and gradient reductions.
    Distributed, both models are sharded over the data-parallel mesh (the teacher with
    torchtune's ``shard_model``, its parameters frozen).

    Features (each a config key; defaults in ``exactga.config.schemas``):
        - The loss (``kd_ratio`` = r): ``(1 - r) loss + r kd_loss``, the class loss and the KD
          loss (``kd_loss``: torchtune's forward, reverse or symmetric KL, chunked or not) both
          means over the same loss tokens, so each micro-batch's mix is weighted by the
          window's one count (over every rank) after the label shift; the KD loss's
          denominator is checked on the first batch, as the class loss's is. See [two
          token-normalised losses] in ``exactga.kd.distillation``.
        - Exact accumulation over micro-batches and ranks (``gradient_accumulation_steps``),
          ``loss_normalization``, ``micro_batching``, ``drop_partial_window``, skipped empty
          windows (``skipped_steps``), and distributed ``gradient_sync``,
          ``fsdp_cpu_offload``, ``fsdp_reshard_after_forward``, ``custom_sharded_layers``
          (student and teacher): as in recipes/lora_finetune.py, through the same library
          calls.
        - Precision (``dtype``: fp32 or bf16; ``master_weights``: fp32 adapters over the bf16
          base by default), activation checkpointing and offloading (of the student),
          ``compile`` (both models and both losses), ``clip_grad_norm``, schedulers, low-bit
          optimizers: as in the LoRA recipe.
        - Checkpointing at each epoch's end (distributed: gathered to and written by rank 0):
          the student's adapters and adapter config, merged student weights unless
          ``save_adapter_weights_only``; with ``save_every_n_steps``, atomic step checkpoints
          from which ``resume_from_checkpoint`` goes on with the very next window, bit for bit
          on the same mesh, also on another number of data-parallel ranks with the same global
          batch (docs/reliability.md). The teacher is never saved.
        - ``nonfinite_loss``: ``skip`` or ``stop``, as in the LoRA recipe.
        - Validation (``dataset_val``, ``run_val_every_n_steps``, ``batch_size_val``,
          ``max_val_batches``): ``val/loss``, ``val/class_loss``, ``val/kd_loss`` and
          ``val/perplexity`` (of the class loss) of the whole validation set as one batch over
          every rank, whatever ``batch_size_val`` or the number of ranks; at each epoch's end
          and every ``run_val_every_n_steps`` steps (docs/validation.md).
          ``keep_best_checkpoint``: the weights of each new lowest ``val/loss`` as an epoch
          folder in ``best/``, resume-safe.
        - Logging, on rank 0: ``loss``, ``class_loss``, ``kd_loss`` (exact window means over
          all ranks), ``lr``, ``tokens_per_second_per_gpu`` as stock; ``loss_tokens``,
          ``skipped_steps``, ``grad_norm`` when clipping, the profiler hook's scalars, peak
          memory on GPU.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up
            (``recipe_main``'s ``validate_run_config``; each schema's ``check_flags``).
    """

    def __init__(self, cfg: KnowledgeDistillationConfig) -> None:
        # Device, precision policy, kernels, threads and the seed, and distributed the process
        # group and the data-parallel mesh; see [setup order].
        self._runtime = Runtime.for_settings(cfg)
        self._lora = LoraSettings.from_config(cfg.model)  # the student's, as stock reads it
        self._clip_grad_norm = cfg.clip_grad_norm

    def setup(self, cfg: KnowledgeDistillationConfig) -> None:
        # Resume point, metric logger, torchtune's checkpointer and the student's frozen base.
        start = RunStart(cfg, self._runtime, KD_FINGERPRINT_KEYS)
        self._model = start.build_model(cfg.model, start.adapter_weights(self._lora))
        # The frozen teacher, from its own checkpointer (sharded like the student where
        # distributed); never saved.
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
        # Loss tokens are counted over every data-parallel rank: one all-reduce per window.
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
                    for batch in window:  # this rank's micro-batches; fillers: weight 0
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
        self._run.close()  # the metric logger, and the process group where distributed


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    # The launch's schema, one device's or the distributed one's: see [one recipe, two
    # launches] in exactga.launch.twins.
    cfg = validated_config(cfg, KNOWLEDGE_DISTILLATION, RECIPE_NAME)
    recipe = KDRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
