"""Knowledge distillation into a LoRA student with FSDP2, on GPUs or CPUs, with exact accumulation.

A drop-in for torchtune 0.6.1's ``knowledge_distillation_distributed``: its configs run unchanged,
with the same artefacts, written by rank 0 (student adapters in torchtune's and PEFT's format with
``adapter_config.json``; merged student weights unless ``save_adapter_weights_only``) and metrics
(``loss``, ``class_loss``, ``kd_loss``, ``lr``, ``tokens_per_second_per_gpu``), plus ours. Student
and teacher are both sharded over the data-parallel ranks; the teacher runs under no_grad
(exactga.model_build.frozen). What differs from stock: the loss of each optimizer step is exactly
``(1 - kd_ratio)`` times the full-batch class loss plus ``kd_ratio`` times the full-batch KD loss of
the window over every rank, whatever the split into ranks and micro-batches, with no pass over the
gradients; ranks may hold very different token counts, or none; ``device: cpu`` runs (gloo). See
``exactga.kd.distillation`` and docs/knowledge_distillation_distributed.md.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/knowledge_distillation_distributed.py \\
        --config configs/tiny/kd_distributed.yaml
    tune run --nproc_per_node 8 recipes/knowledge_distillation_distributed.py \\
        --config configs/llama3_2/8B_to_1B_KD_lora_distributed.yaml

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
from exactga.kd.schema import KnowledgeDistillationDistributedConfig
from exactga.kd.validation import distillation_validation_loss
from exactga.launch.cli import run_recipe
from exactga.lora.adapters import LoraSettings
from exactga.runtime.runtime import Runtime
from exactga.validation.held_out import validation_from_settings
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

RECIPE_NAME = "knowledge_distillation_distributed"


class KDRecipeDistributed(FTRecipeInterface):
    """Distils a frozen teacher into LoRA adapters on a frozen student, with FSDP2.

    Both models are sharded over the data-parallel mesh (the teacher with torchtune's
    ``shard_model``, its parameters frozen); only the student's adapters get gradients,
    optimizer state and gradient reductions.

    Features (each a config key; defaults in ``exactga.config.schemas``):
        - The loss (``kd_ratio`` = r): ``(1 - r) loss + r kd_loss``, both means over the same
          loss tokens, so each micro-batch's mix is weighted by the window's one count over
          every rank, after the label shift; the KD loss's denominator is checked on the first
          batch. See [two token-normalised losses] in ``exactga.kd.distillation``.
        - Exact accumulation over micro-batches and ranks, ``gradient_sync``,
          ``micro_batching``, skipped empty windows, ``fsdp_cpu_offload``,
          ``fsdp_reshard_after_forward``, ``custom_sharded_layers`` (student and teacher),
          precision, activation checkpointing and offloading (of the student), ``compile``,
          ``clip_grad_norm``, schedulers, ``nonfinite_loss``: as in
          recipes/lora_finetune_distributed.py, through the same library calls.
        - Checkpointing at each epoch's end, gathered to and written by rank 0: the student's
          adapters and adapter config, merged student weights unless
          ``save_adapter_weights_only``; with ``save_every_n_steps``, atomic step checkpoints
          from which ``resume_from_checkpoint`` goes on with the next window on the same world
          size, bit for bit. The teacher is never saved.
        - Rank-0-only logging: ``loss``, ``class_loss``, ``kd_loss`` (exact window means over
          all ranks), ``lr``, ``tokens_per_second_per_gpu`` as stock, and ours.
        - Validation (``dataset_val``, ``run_val_every_n_steps``, ``batch_size_val``,
          ``max_val_batches``): ``val/loss``, ``val/class_loss``, ``val/kd_loss`` and
          ``val/perplexity`` (of the class loss) of the whole validation set as one batch over
          every rank, whatever ``batch_size_val`` or the number of ranks; at each epoch's end
          and every ``run_val_every_n_steps`` steps (docs/validation.md).
          ``keep_best_checkpoint``: the weights of each new lowest ``val/loss`` as an epoch
          folder in ``best/``, resume-safe.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up
            (``recipe_main``'s ``validate_run_config``; each schema's ``check_flags``).
    """

    def __init__(self, cfg: KnowledgeDistillationDistributedConfig) -> None:
        # Device, process group, data-parallel mesh, precision policy, kernels, threads and
        # the seed; see [setup order].
        self._runtime = Runtime.distributed(cfg)
        self._lora = LoraSettings.from_config(cfg.model)  # the student's, as stock reads it
        self._clip_grad_norm = cfg.clip_grad_norm

    def setup(self, cfg: KnowledgeDistillationDistributedConfig) -> None:
        # Resume point, metric logger, torchtune's checkpointer and the student's frozen base.
        start = RunStart(cfg, self._runtime, KD_FINGERPRINT_KEYS)
        self._model = start.build_model(cfg.model, start.adapter_weights(self._lora))
        # The frozen teacher, from its own checkpointer, sharded like the student; never saved.
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
        self._run.close()  # the metric logger and the process group


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    cfg = validated_config(cfg, KnowledgeDistillationDistributedConfig, RECIPE_NAME)
    recipe = KDRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
