"""Knowledge distillation into a LoRA student with FSDP2, on GPUs or CPUs, with exact accumulation.

A drop-in for torchtune 0.6.1's ``knowledge_distillation_distributed``: its configs run
unchanged, with the same artefacts, written by rank 0 (student adapters in torchtune's and
PEFT's format with ``adapter_config.json``; merged student weights unless
``save_adapter_weights_only``) and metrics (``loss``, ``class_loss``, ``kd_loss``, ``lr``,
``tokens_per_second_per_gpu``), plus ours. Student and teacher are both sharded over the
data-parallel ranks; the teacher runs under no_grad (exactga.setup.frozen). What differs from stock:
the loss of
each optimizer step is exactly ``(1 - kd_ratio)`` times the full-batch class loss plus
``kd_ratio`` times the full-batch KD loss of the window over every rank, whatever the split into
ranks and micro-batches, with no pass over the gradients; ranks may hold very different token
counts, or none; ``device: cpu`` runs (gloo). See ``exactga.kd.distillation`` and
docs/knowledge_distillation_distributed.md.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/knowledge_distillation_distributed.py \\
        --config configs/tiny/kd_distributed.yaml
    tune run --nproc_per_node 8 recipes/knowledge_distillation_distributed.py \\
        --config configs/llama3_2/8B_to_1B_KD_lora_distributed.yaml

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import sys
import time
from functools import partial

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.optimizers import build_optimizer
from exactga.accumulation.step import StepContext
from exactga.data.loader import dataloader_from_config, load_dataset, model_vocab_size
from exactga.kd.distillation import KD_FINGERPRINT_KEYS, Distiller, check_vocabularies
from exactga.kd.schema import KnowledgeDistillationDistributedConfig
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
from exactga.setup.frozen import freeze_model
from exactga.setup.lora import LoraSettings
from exactga.setup.model import AdapterWeights, ModelSettings, Parallelism, build_model

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

        self._fsdp_cpu_offload = cfg.fsdp_cpu_offload and self._device.type != "cpu"
        distributed.init_distributed(self._device, offload_ops_to_cpu=self._fsdp_cpu_offload)
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0
        # Pure data parallelism (stock LoRA has no tensor-parallel dimension).
        self._mesh = distributed.build_device_mesh(self._device, tensor_parallel_dim=1)
        self.dp_size = self._mesh["dp"].size()
        self.dp_rank = self._mesh["dp"].get_local_rank()

        self._book_settings = StepBookSettings.from_config(cfg)  # logging, saving, non-finite

        self._save_adapter_weights_only = cfg.save_adapter_weights_only
        self._clip_grad_norm = cfg.clip_grad_norm
        self._loss_normalization = cfg.loss_normalization
        self._compile = cfg.compile
        self._model_settings = ModelSettings.from_config(cfg, self._device)

        # LoRA settings, read from the model section as stock does.
        self._lora = LoraSettings.from_config(cfg.model)

        # Epochs, steps and their outcomes; a resume sets them in setup. The seed is the
        # config's on every rank (torchtune seeds ``seed + rank`` for the global RNG).
        self._progress = TrainingProgress(
            seed=training.set_seed(seed=cfg.seed, debug_mode=cfg.cudnn_deterministic_mode),
            total_epochs=cfg.epochs,
            max_steps_per_epoch=cfg.max_steps_per_epoch,
        )
        self._kd_ratio = cfg.kd_ratio

    def setup(self, cfg: DictConfig) -> None:
        # Where to go on from: nothing, torchtune's epoch checkpoint or a step checkpoint.
        self._step_checkpointer, self._fingerprint, resume = start_run(cfg, KD_FINGERPRINT_KEYS)
        # Rank 0's; a resumed run's curves go on in its run ([resumed TensorBoard run]).
        self._metric_logger = open_run_logger(cfg, resumed=resume.resumed)
        self._checkpointer = self._precision.saving_in_dtype(  # adapters, merged: in dtype
            config.instantiate(
                cfg.checkpointer, should_load_recipe_state=resume.from_epoch_checkpoint
            )
        )
        ckpt_dict = self._checkpointer.load_checkpoint()  # the frozen base, always
        resume.restore_progress(self._progress, ckpt_dict)

        # Built on meta, adapters trainable, cast, compiled, checkpointed, sharded and loaded in
        # the one order; see exactga.setup.model.
        built = build_model(
            cfg.model,
            AdapterWeights.at_start(
                self._lora, resume, ckpt_dict, cfg.checkpointer, self._progress.seed
            ),
            precision=self._precision,
            device=self._device,
            settings=self._model_settings,
            parallelism=Parallelism(dp_mesh=self._mesh["dp"]),
            notes=(self._attention_kernels, self._cpu_threads),
        )
        self._model, self._activations_handling_ctx = built.model, built.activations_ctx
        self._teacher_model = self._setup_teacher_model(cfg)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer,
            self._model,
            state=resume.optimizer_state(ckpt_dict),
            sharded=True,
            device=self._device,
        )

        self._loss_fn = config.instantiate(cfg.loss)
        self._kd_loss_fn = config.instantiate(cfg.kd_loss)
        if self._compile:
            self._loss_fn = training.compile_loss(self._loss_fn, verbose=self._is_rank_zero)
            self._kd_loss_fn = training.compile_loss(self._kd_loss_fn, verbose=self._is_rank_zero)
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
            dp_group=distributed.dp_group(self._mesh),
        )

        # Data order, row checks and loader position: see [data order] in exactga.data.loader.
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
            epoch_writer=self._checkpointer,
            lora=self._lora,
            adapter_only=self._save_adapter_weights_only,
            sharded=True,
        )
        self._lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self._optimizer, self._progress)
        # Phase timings on every rank; traces, snapshots and the report on rank 0.
        self._profiler = profiler_from_config(cfg, self._device, self._model, self._metric_logger)
        self._checkpoint_dir = cfg.checkpointer.output_dir
        resume.restore_rng(self._device)  # last: model and data setup above draw from the RNGs

    def _setup_teacher_model(self, cfg: DictConfig) -> nn.Module:
        """The frozen teacher, built on the meta device, sharded over the data-parallel mesh
        as the student is (torchtune's ``shard_model``: it has no trainable parameter, so no
        precision policy), then loaded shard by shard from its own checkpointer."""
        t0 = time.perf_counter()
        teacher_state = config.instantiate(cfg.teacher_checkpointer).load_checkpoint()
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            teacher = config.instantiate(cfg.teacher_model)
        freeze_model(teacher)
        if self._compile:
            training.compile_model(teacher, verbose=self._is_rank_zero)
        training.shard_model(
            model=teacher,
            shard_conditions=[
                partial(training.get_shard_conditions, names_to_match=cfg.custom_sharded_layers)
            ],
            cpu_offload=self._fsdp_cpu_offload,
            reshard_after_forward=cfg.fsdp_reshard_after_forward,
            dp_mesh=self._mesh["dp"],
        )
        with training.set_default_dtype(self._dtype), self._device:
            for m in teacher.modules():
                if hasattr(m, "rope_init"):  # RoPE buffers are not in the state dict
                    m.rope_init()
        training.load_from_full_model_state_dict(
            teacher,
            teacher_state[training.MODEL_KEY],
            self._device,
            strict=True,
            cpu_offload=self._fsdp_cpu_offload,
        )
        training.validate_no_params_on_meta_device(teacher)
        check_vocabularies(model_vocab_size(self._model), model_vocab_size(teacher))
        distributed.log_rank_zero(
            f"Teacher built, sharded over dp={self.dp_size} and loaded in "
            f"{time.perf_counter() - t0:.2f} s, precision {self._dtype}; frozen."
        )
        if self._is_rank_zero and self._device.type != "cpu":
            training.log_memory_stats(distributed.memory_stats(self._device))
        distributed.barrier()
        return teacher

    def save_checkpoint(self, epoch: int) -> None:
        """The epoch's checkpoint, as stock writes it (every rank calls this)."""
        self._checkpoints.save_epoch(self._model, self._optimizer, epoch)

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
            window_metrics=self._distiller.window_metrics,
            track=self._distiller.track,
        )

    def cleanup(self) -> None:
        close_metric_logger(self._metric_logger)
        distributed.destroy()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains."""
    cfg = validate_run_config(cfg, KnowledgeDistillationDistributedConfig, RECIPE_NAME)
    if distributed.is_rank_zero():
        config.log_config(recipe_name="KDRecipeDistributed", cfg=cfg)
    recipe = KDRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
