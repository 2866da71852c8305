"""A recipe's setup, in the order that decides its numbers, written once for every recipe.

A training recipe reads, top to bottom::

    self._runtime = Runtime.for_settings(cfg)          # one device, or every rank
    ...
    start = RunStart(cfg, self._runtime, fingerprint_keys)  # resume point, logger, weights
    self._model = start.build_model(cfg.model, start.full_weights())
    self._optimizer = start.build_optimizer(cfg.optimizer, self._model)
    ...                                                 # its loss and data, its own way
    normalizer = start.normalizer(loss_fn)              # over the runtime's ranks
    self._run = start.training_run(self._model, self._optimizer, dataloader, normalizer)

and trains inside ``with self._run as steps:``. Each call here is one thing that changes a
number or an artefact when two recipes do it differently (see [setup order]), so a recipe (or a
user's copy) can neither skip it nor do it in another order.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from functools import partial
from types import TracebackType
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config, training, utils
from torchtune.training.checkpointing._checkpoint_client import CheckpointClient

from exactga.accumulation.loss_units import LossUnits, ShiftedTokens, context_parallel_units
from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.optimizers import build_optimizer
from exactga.accumulation.step import StepContext
from exactga.accumulation.window_statistics import WindowStatistic
from exactga.checkpoints.contents import RunCheckpoints, load_sharded_train_state
from exactga.config.schemas import SingleDeviceRecipeConfig, TwinSchemas
from exactga.config.validation import Settings, torchtune_config, typed_settings
from exactga.data.loader import dataloader_from_settings
from exactga.data.micro_batching import MicroBatchingSettings
from exactga.launch.twins import DISTRIBUTED, launched_as
from exactga.lora.adapters import LoraSettings
from exactga.model_build.compiling import compile_layers
from exactga.model_build.frozen import build_frozen_model, freeze_model
from exactga.model_build.trained import (
    AdapterWeights,
    FullWeights,
    ModelSettings,
    Parallelism,
    build_model,
    models_from_folders,
)
from exactga.profiling import profiler_from_settings
from exactga.qat.fake_quant import quantizer_from_config
from exactga.run.metric_logging import (
    close_metric_logger,
    log_config_summary,
    open_run_logger,
    report_outputs,
)
from exactga.run.progress import TrainingProgress, build_lr_scheduler
from exactga.run.resume import checkpointer_source, start_run, validate_run_config
from exactga.run.steps import StepBook, StepBookSettings
from exactga.runtime import distributed
from exactga.runtime.document_attention import instantiate_model
from exactga.runtime.runtime import Runtime

log = utils.get_logger("INFO")


def validated_config(
    cfg: DictConfig, schema: type[Settings] | TwinSchemas, recipe_name: str
) -> Settings:
    """The recipe's config checked strictly against ``schema`` before anything is built (see
    ``exactga.run.resume.validate_run_config``), then summed up in three lines on rank 0, the
    whole resolved config written to the output folder; returned as ``schema``'s typed
    settings, which the recipe reads as it read the config (``cfg.batch_size``) and hands down
    (see [typed settings] in exactga.config.validation).

    A recipe file that serves both of torchtune's names gives its ``TwinSchemas`` and its
    family as ``recipe_name`` (``full_finetune``): the launch picks the schema and the name
    (``full_finetune_distributed``), see [one recipe, two launches] in exactga.launch.twins.

    Raises:
        ValueError: naming the key or file at fault.
    """
    if isinstance(schema, TwinSchemas):
        recipe_name = launched_as(recipe_name, cfg.keys())
        distributed = recipe_name.endswith(DISTRIBUTED)
        schema = schema.distributed if distributed else schema.single_device
    cfg = validate_run_config(cfg, schema, recipe_name)
    cfg = models_from_folders(cfg)  # config.json is the truth of a Hugging Face folder
    log_config_summary(recipe_name, cfg)  # the whole config: <output_dir>/resolved_config.yaml
    return typed_settings(cfg, schema)


# Note [setup order]
# What a recipe's setup does, in this order, on every rank:
# 1. ``Runtime`` (``exactga.runtime.runtime``): the device, the precision policy, the attention
#    kernels, the CPU threads, and under torchrun the process group and the device mesh;
#    then the seed (the config's on every rank), before anything draws a random number.
# 2. ``RunStart``: the counters from the runtime's seed, where the run goes on from (nothing,
#    an epoch or a step checkpoint), the metric logger (a resumed run continues its own
#    TensorBoard run), torchtune's checkpointer (wrapped so that weights for users are written
#    in ``dtype``) and the weights it reads.
# 3. the model: built, adapters made trainable, cast, compiled, sharded, loaded
#    (``exactga.model_build.trained.build_model``); frozen reference and teacher models next.
# 4. the optimizer, with the checkpoint's state; then the counters are restored.
# 5. the recipe's own loss and data; the loader gets the checkpoint's position.
# 6. ``training_run``: the counters learn the epoch length, then the checkpoints, the learning-
#    rate scheduler, the profiler and the step bookkeeping; last the RNG states of a resumed
#    run, because steps 3-5 draw from the RNGs (adapter init, dropout-free init, samplers).
# A recipe that changes this order changes its numbers, which is why it is written once here.


class RunStart:
    """Where a run starts from, and what it builds against it (see [setup order], 2-6).

    Opening it decides the resume point, opens the metric logger and torchtune's checkpointer
    and reads its weights. Sharded full-weight recipes (their configs have
    ``enable_async_checkpointing``) read through torchtune's ``CheckpointClient``, the others
    through ``checkpointer`` itself, as stock does.

    Args:
        settings: the recipe's typed settings (``validated_config``).
        runtime: the recipe's :class:`Runtime`.
        fingerprint_keys: config keys of the recipe's family that a resume must match.
    """

    def __init__(
        self,
        settings: SingleDeviceRecipeConfig,
        runtime: Runtime,
        fingerprint_keys: tuple[str, ...] = (),
    ) -> None:
        self.settings = cfg = settings
        self.runtime = runtime
        # The run's counters, from the runtime's seed (an epoch checkpoint's wins on resume).
        self.progress = TrainingProgress(
            seed=runtime.seed,
            total_epochs=cfg.epochs,
            max_steps_per_epoch=cfg.max_steps_per_epoch,
        )
        self.model_settings = ModelSettings.from_settings(cfg, runtime.device)
        self.step_checkpointer, self.fingerprint, self.resume = start_run(
            cfg, fingerprint_keys, dp_size=runtime.dp_size, **runtime.fingerprint_extra
        )
        # Rank 0's; a resumed run's curves go on in its run ([resumed TensorBoard run]).
        self.metric_logger = open_run_logger(cfg, resumed=self.resume.resumed)
        self._client = runtime.sharded and runtime.checkpoint_client
        if self._client:  # torchtune's client reads the base weights, or an epoch's
            client_cfg = OmegaConf.merge(
                torchtune_config(cfg),  # torchtune's client takes the whole config
                {"resume_from_checkpoint": self.resume.from_epoch_checkpoint},
            )
            self.epoch_writer = runtime.precision.saving_in_dtype(CheckpointClient(client_cfg))
            self.ckpt_dict = self.epoch_writer.load_base_checkpoint()
        else:
            self.epoch_writer = runtime.precision.saving_in_dtype(  # for users: in dtype
                config.instantiate(
                    cfg.checkpointer, should_load_recipe_state=self.resume.from_epoch_checkpoint
                )
            )
            # Read even when a step checkpoint replaces its weights: the HF checkpointer
            # learns there the layout it writes the epoch checkpoints in.
            self.ckpt_dict = self.epoch_writer.load_checkpoint()
        self.activations_ctx: Any = None  # the model's, once built
        # Further trained models' checkpointers by part name (PPO's value model); see
        # trained_part_weights.
        self._part_writers: dict[str, Any] = {}

    # -- weights ---------------------------------------------------------------------------
    def full_weights(self, part: str | None = None) -> FullWeights:
        """Every weight: the checkpointer's, or the checkpoint's the run resumes from. A run
        that trains several models in one module (PPO) names the ``part`` this checkpointer's
        model is: a step checkpoint holds the whole module, each part under its name."""
        weights = self.resume.model_weights(self.ckpt_dict)
        if part is not None:
            self._part_writers[part] = self.epoch_writer
            if self.resume.from_step_checkpoint:
                weights = _part_state(weights, part)
        return FullWeights(weights, self.resume.weights_source(self.settings.checkpointer))

    def trained_part_weights(self, cfg_checkpointer: DictConfig, part: str) -> FullWeights:
        """The weights of a further trained model (PPO's value model): its own checkpointer's
        (stock: on resume, point it at the saved weights), or on a step-checkpoint resume the
        step checkpoint's ``part``. Its epoch checkpoints go through that checkpointer, in
        ``dtype`` (``RunCheckpoints.parts``). A classifier head's bias, if the checkpoint has
        one, is dropped: torchtune's classifiers have none (stock's
        ``update_state_dict_for_classifier``)."""
        writer = self.runtime.precision.saving_in_dtype(
            config.instantiate(cfg_checkpointer, should_load_recipe_state=False)
        )
        self._part_writers[part] = writer
        state = writer.load_checkpoint()[training.MODEL_KEY]  # also teaches it its layout
        source = checkpointer_source(cfg_checkpointer)
        if self.resume.from_step_checkpoint:
            state = _part_state(self.resume.model_weights(self.ckpt_dict), part)
            source = self.resume.weights_source(cfg_checkpointer)
        state.pop("output.bias", None)
        return FullWeights(state, source)

    def adapter_weights(self, lora: LoraSettings) -> AdapterWeights:
        """The frozen base, and the adapters to go on from (fresh ones from the seed)."""
        return AdapterWeights.at_start(
            lora, self.resume, self.ckpt_dict, self.settings.checkpointer, self.progress.seed
        )

    # -- models ----------------------------------------------------------------------------
    def build_model(
        self,
        cfg_model: DictConfig,
        weights: FullWeights | AdapterWeights,
        *,
        quantizer: DictConfig | None = None,
    ) -> nn.Module:
        """The trained model, built, cast, compiled, sharded and loaded in the one order (see
        ``exactga.model_build.trained.build_model``); its forwards run in ``activations_ctx``. A
        ``quantizer`` section (QAT) fake-quantises its linears, built in ``dtype`` as stock."""
        built = build_model(
            cfg_model,
            weights,
            precision=self.runtime.precision,
            device=self.runtime.device,
            settings=self.model_settings,
            parallelism=_parallelism(self.runtime),
            notes=self.runtime.notes,
            quantizer=None
            if quantizer is None
            else quantizer_from_config(quantizer, self.runtime.dtype),
        )
        self.activations_ctx = built.activations_ctx
        return built.model

    def frozen_model(
        self, cfg_model: DictConfig, cfg_checkpointer: DictConfig, role: str
    ) -> nn.Module:
        """A frozen model (a reference, a teacher) in ``dtype`` with the weights of its own
        checkpointer (never the run's: stock's rule, also on resume), sharded like the trained
        model when it is; never saved. ``role`` names it in the log."""
        started = time.perf_counter()
        runtime, settings = self.runtime, self.model_settings
        state = config.instantiate(cfg_checkpointer, should_load_recipe_state=False)
        state_dict = state.load_checkpoint()[training.MODEL_KEY]
        if runtime.sharded:
            model = build_frozen_model(
                cfg_model,
                state_dict,
                dtype=runtime.dtype,
                device=runtime.device,
                dp_mesh=runtime.mesh.fsdp,
                custom_sharded_layers=settings.custom_sharded_layers,
                cpu_offload=settings.fsdp_cpu_offload,
                reshard_after_forward=settings.fsdp_reshard_after_forward,
                compile_model=settings.compile,
                verbose=distributed.is_rank_zero(),
            )
        else:
            model = _frozen_on_device(cfg_model, state_dict, runtime.dtype, runtime.device)
            if settings.compile:
                compile_layers(model)
        num_params = sum(p.numel() for p in model.parameters())
        runtime.log(
            f"{role} built and loaded in {time.perf_counter() - started:.2f} s over "
            f"dp={runtime.dp_size}, precision {runtime.dtype}; {num_params:,} frozen."
        )
        if runtime.sharded:
            distributed.barrier()
        return model

    # -- optimizer -------------------------------------------------------------------------
    def build_optimizer(
        self, cfg_optimizer: DictConfig, model: nn.Module, *, in_backward: bool = False
    ) -> Any:
        """The optimizer with the checkpoint's state (see [optimizer in backward] in
        exactga.accumulation.optimizers); then the counters are restored."""
        optimizer = build_optimizer(
            cfg_optimizer,
            model,
            in_backward=in_backward,
            state=self.resume.optimizer_state(self.ckpt_dict),
            **({"sharded": True, "device": self.runtime.device} if self.runtime.sharded else {}),
        )
        if self._client and self.resume.from_epoch_checkpoint and self.runtime.async_checkpointing:
            # torchtune's distributed checkpoint loads weights and optimizer state in place.
            self.ckpt_dict = self.epoch_writer.load_distributed_checkpoint(model, optimizer)
        if self.resume.sharded_state is not None:  # a sharded step checkpoint, on any mesh
            load_sharded_train_state(model, optimizer, self.resume.sharded_state)
        self.resume.restore_progress(self.progress, self.ckpt_dict)
        return optimizer

    # -- data ------------------------------------------------------------------------------
    @functools.cached_property
    def micro_batching(self) -> MicroBatchingSettings:
        """How a window is cut into micro-batches, read once for the loader and the profiler."""
        return MicroBatchingSettings.from_settings(self.settings)

    def dataloader(self, dataset: Any, *, padding_idx: int, ignore_idx: int) -> Any:
        """The loader of windows at the checkpoint's position (on another number of ranks, its
        position over all ranks: [resharded resume] in exactga.run.resume); see [data order] in
        exactga.data.loader. Ranks of one tensor-parallel group read the same data: the
        sampler splits over the data-parallel ranks only."""
        runtime = self.runtime
        ranks = (
            {
                "num_replicas": runtime.dp_size,
                "rank": runtime.dp_rank,
                "rank_balancing": self.settings.rank_balancing,
            }
            if runtime.sharded
            else {}
        )
        resharded = self.resume.resharded
        loader = dataloader_from_settings(
            dataset,
            self.settings,
            self.micro_batching,
            padding_idx=padding_idx,
            ignore_idx=ignore_idx,
            state_dict=None if resharded else self.resume.dataloader_state(self.ckpt_dict),
            **ranks,
        )
        if resharded:
            loader.skip_samples_of_epoch(self.resume.samples_done_in_epoch)
        return loader

    def dataloader_state(self) -> dict[str, Any] | None:
        """The checkpoint's loader position, for a recipe that builds its own loader."""
        return self.resume.dataloader_state(self.ckpt_dict)

    # -- the loop's bookkeeping ------------------------------------------------------------
    def normalizer(
        self,
        loss_fn: nn.Module | None,
        *,
        units: LossUnits | None = None,
        statistics: Sequence[WindowStatistic] = (),
    ) -> LossNormalizer:
        """The loss normaliser, in the config's ``loss_normalization``, counting each window's
        units over the runtime's count group (every rank that holds other tokens: [mesh axes
        and the loss count] in exactga.runtime.distributed): a recipe never hands it a group,
        so a copy cannot count over fewer ranks than it trains on (an inexact step, and a hang under
        ``token_budget``). See ``exactga.accumulation.normalization.LossNormalizer`` for
        ``units`` and ``statistics``. Under context parallelism each rank counts the tokens of
        its shard ([loss tokens under context parallelism] in exactga.runtime.context_parallel),
        and the step cuts each micro-batch over the same ``runtime.cp_mesh`` (``_step_context``)."""
        if self.runtime.cp_mesh is not None:
            units = context_parallel_units(units or ShiftedTokens(loss_fn), self.runtime.cp_mesh)
        return LossNormalizer(
            loss_fn,
            mode=self.settings.loss_normalization,
            dp_group=self.runtime.count_group,
            units=units,
            statistics=statistics,
        )

    def training_run(
        self,
        model: nn.Module,
        optimizer: Any,
        dataloader: Any,
        normalizer: Any,
        *,
        lora: LoraSettings | None = None,
        windows_per_epoch: int | None = None,
        total_epochs: int | None = None,
        book_settings: StepBookSettings | None = None,
        **step_book_extras: Any,
    ) -> TrainingRun:
        """Everything the loop needs around the step, last in setup (see [setup order], 6).

        Args:
            lora: the adapters' settings of a LoRA model (adapter checkpoints, merged weights
                unless the config's ``save_adapter_weights_only``).
            windows_per_epoch: optimizer steps per epoch; the loader's length by default.
            total_epochs: the run's epochs where the recipe derives them (PPO: from
                ``num_steps``); the config's ``epochs`` by default.
            book_settings: the step bookkeeping's settings; the config's by default.
            step_book_extras: ``window_metrics``, ``track``, ``validation``: see ``StepBook``.
        """
        cfg, runtime, progress = self.settings, self.runtime, self.progress
        _check_normalizer_ranks(normalizer, runtime)
        if total_epochs is not None:
            progress.total_epochs = total_epochs
        progress.start(
            len(dataloader) if windows_per_epoch is None else windows_per_epoch,
            resumed_mid_run=self.resume.from_step_checkpoint,
        )
        self.resume.check_epoch_length(progress.steps_per_epoch)
        checkpoints = RunCheckpoints(
            progress,
            self.step_checkpointer,
            self.fingerprint,
            runtime.device,
            epoch_writer=self.epoch_writer,
            lora=lora,
            adapter_only=lora is not None and cfg.save_adapter_weights_only,
            sharded=runtime.sharded,
            dp_size=runtime.dp_size,
            parts=dict(self._part_writers) or None,
        )
        lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, optimizer, progress)
        # Phase timings on every rank; traces, snapshots and the report on rank 0.
        profiler = profiler_from_settings(
            cfg, self.micro_batching, runtime.device, model, self.metric_logger
        )
        steps = StepBook(
            progress,
            context=_step_context(runtime, model, profiler),
            dataloader=dataloader,
            normalizer=normalizer,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            settings=book_settings or StepBookSettings.from_settings(cfg),
            checkpoints=checkpoints,
            metric_logger=self.metric_logger,
            **step_book_extras,
        )
        self.resume.restore_rng(runtime.device)  # last: the setup above draws from the RNGs
        outputs = "Adapters and checkpoints" if lora is not None else "Checkpoints"
        return TrainingRun(steps, runtime, cfg.checkpointer.output_dir, outputs, cfg.compile)


def _check_normalizer_ranks(normalizer: Any, runtime: Runtime) -> None:
    """Refuse a normaliser built over other ranks than the run's (a copy's own
    ``LossNormalizer(...)`` without the runtime's group counts one rank's units)."""
    dp_size = getattr(normalizer, "dp_size", runtime.count_size)
    if dp_size != runtime.count_size:
        raise ValueError(
            f"the loss normaliser counts units over {dp_size} rank(s), the run trains on "
            f"{runtime.count_size} that hold other tokens: build it with "
            "start.normalizer(loss_fn, units=...), which counts over the runtime's ranks."
        )


def _parallelism(runtime: Runtime) -> Parallelism | None:
    """How the trained model is spread over the runtime's mesh (``None``: one device)."""
    if runtime.mesh is None:
        return None
    tp = runtime.tensor_parallel_dim > 1
    return Parallelism(
        dp_mesh=runtime.mesh.fsdp,
        tp_mesh=runtime.mesh["tp"] if tp else None,
        tp_plan=runtime.tensor_parallel_plan if tp else None,
    )


def _step_context(runtime: Runtime, model: nn.Module, profiler: Any) -> StepContext:
    """How this rank runs a window's micro-batches; distributed, with the config's
    gradient-sync policy, only rank 0 announcing a skipped window, and each micro-batch's
    sequences cut over ``runtime.cp_mesh`` (as the normaliser counts them,
    ``RunStart.normalizer``)."""
    if runtime.mesh is None:
        return StepContext(model, runtime.device, profiler)
    return StepContext(
        model,
        runtime.device,
        profiler,
        partial(distributed.gradient_sync, model, runtime.gradient_sync),
        announce_skip=distributed.is_rank_zero(),
        cp_mesh=runtime.cp_mesh,
    )


def _part_state(state: dict[str, Any], part: str) -> dict[str, Any]:
    """The entries of one part of a module's state dict, without the part's prefix."""
    prefix = f"{part}."
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _frozen_on_device(
    cfg_model: DictConfig, state_dict: dict[str, Any], dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """``cfg_model`` built on ``device`` in ``dtype``, loaded and frozen (one device)."""
    with training.set_default_dtype(dtype), device:
        model = instantiate_model(cfg_model)
    model.load_state_dict(state_dict)
    freeze_model(model)
    training.validate_expected_param_dtype(model.named_parameters(), dtype=dtype)
    return model


class TrainingRun:
    """What a recipe's ``train()`` runs in::

        with self._run as steps:      # the profiler, the progress bar, the closing report
            for curr_epoch in steps.epochs():
                for window in steps.windows(curr_epoch):
                    ...

    Entering frees what setup left behind (distributed), says when a compile will make the
    first step slow, clears the gradients and starts the profiler; leaving a finished loop
    stops it and reports where the checkpoints and logs are.
    """

    def __init__(
        self, steps: StepBook, runtime: Runtime, output_dir: str, outputs: str, compiled: bool
    ) -> None:
        self.steps = steps
        self.runtime = runtime
        self.output_dir = output_dir
        self.outputs = outputs
        self.compiled = compiled

    @property
    def profiler(self) -> Any:
        return self.steps.profiler

    @property
    def progress(self) -> TrainingProgress:
        """The run's counters; its ``seed`` (an epoch checkpoint's on resume) seeds rollouts."""
        return self.steps.progress

    def __enter__(self) -> StepBook:
        if self.runtime.sharded:
            distributed.cleanup_before_training(self.runtime.device)
        if self.compiled:
            self.runtime.log("torch.compile is on: expect a slow first step while it compiles.")
        self.steps.optimizer.zero_grad()
        self.profiler.__enter__()
        return self.steps

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.profiler.__exit__(exc_type, exc, tb)
        if exc_type is None:
            summary = self.profiler.summary()
            report_outputs(summary, self.output_dir, self.steps.metric_logger, self.outputs)

    def close(self) -> None:
        """The metric logger, and the process group when there is one."""
        close_metric_logger(self.steps.metric_logger)
        if self.runtime.sharded:
            distributed.destroy()
