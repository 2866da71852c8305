"""The keys each recipe reads, with their one default and their checks (see exactga.config).

The stock keys are those torchtune 0.6.1's recipe of the same name reads, so its configs run
unchanged. Sections with a ``_component_`` are typed ``Any``: their keys are the keyword
arguments of the component and are checked when it is instantiated; the ``profiler`` section
has a schema of its own. A key with a fixed set of values is typed with its enum from
``exactga.options`` (the recipe then reads a member), or declares them next to its default
(``choices``); each schema's ``check_flags`` rejects settings that cannot work together.
``validate_config`` runs both at start-up, before the config is printed or a model is built.
It imports no runtime module of exactga, only ones that import nothing from it (``options``,
``profiling.settings``; tests/test_architecture.py); the runtime imports the same from there.

To add a knob to a recipe you copied, subclass its schema in the recipe file::

    @dataclass
    class MyRecipeConfig(FullFinetuneSingleDeviceConfig):
        my_knob: int = 3
"""

from __future__ import annotations

import inspect
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from omegaconf import MISSING, DictConfig, OmegaConf

from exactga.options import (
    PRECISIONS,
    GradientSync,
    MasterWeights,
    MicroBatching,
    NonFinitePolicy,
    NormMode,
)
from exactga.profiling.settings import ProfilerSection, ProfilerSettings

# One source for the defaults the profiler hook and the schemas share.
_PROFILER = ProfilerSettings()
# The model-section keys the LoRA recipes read besides instantiating it (stock reads the same).
LORA_MODEL_KEYS = ("lora_rank", "lora_alpha", "lora_attn_modules", "apply_lora_to_mlp")


def choice(values: tuple[str, ...], default: str) -> Any:
    """A string field whose value must be one of ``values`` (checked by ``validate_config``);
    a knob whose values are an enum of exactga.options is typed with the enum instead."""
    assert default in values, f"default {default!r} is not one of {values}"
    return field(default=default, metadata={"choices": values})


def _device_type(cfg: DictConfig) -> str:
    return torch.device(cfg.device).type


def _warn_cpu_offload_ignored(cfg: DictConfig) -> None:
    if cfg.fsdp_cpu_offload and _device_type(cfg) == "cpu":
        _warn_once(
            "config key 'fsdp_cpu_offload' is ignored on CPU: the parameters are in host memory "
            "already (and FSDP2's offload pins memory, which needs an accelerator)."
        )


def _warn_once(message: str) -> None:
    """A warning from rank 0 only: every rank validates the config."""
    if int(os.environ.get("RANK", "0")) == 0:
        warnings.warn(message, stacklevel=3)


@dataclass
class TrainingRunConfig:
    """The keys every recipe that trains reads, the parity report included: what is trained,
    on what, with what, where."""

    # Components (``_component_`` sections).
    model: Any = MISSING
    tokenizer: Any = MISSING
    dataset: Any = MISSING  # one section, or a list of them (concatenated)
    checkpointer: Any = MISSING
    optimizer: Any = MISSING
    loss: Any = MISSING
    lr_scheduler: Any = None

    # Run.
    output_dir: str = MISSING
    device: str = "cuda"
    cpu_threads: Optional[int] = None  # exactga: null picks from the load; [cpu threads]
    dtype: str = choice(PRECISIONS, "bf16")
    seed: Optional[int] = None
    shuffle: bool = True
    collate_fn: str = "torchtune.data.padded_collate_sft"
    clip_grad_norm: Optional[float] = None


@dataclass
class SingleDeviceRecipeConfig(TrainingRunConfig):
    """The keys every single-device fine-tuning recipe reads (full and LoRA)."""

    metric_logger: Any = MISSING
    profiler: Optional[ProfilerSection] = None
    cudnn_deterministic_mode: Optional[bool] = None
    # exactga: cuDNN's fused attention re-plans for every new sequence length; see
    # [cuDNN attention and variable shapes] in exactga.kernels.
    cudnn_attention: bool = False
    compile: bool = False
    resume_from_checkpoint: bool = False

    # Data and batching.
    batch_size: int = MISSING
    epochs: int = 1
    max_steps_per_epoch: Optional[int] = None
    gradient_accumulation_steps: int = 1

    # Memory.
    enable_activation_checkpointing: bool = False
    enable_activation_offloading: bool = False

    # Logging.
    log_every_n_steps: int = 1
    log_peak_memory_stats: bool = False
    # exactga: the profiler hook's scalars (docs/profiling.md).
    log_timings: bool = _PROFILER.log_timings  # time/*, throughput/*, normalization/*
    saved_latency_every_n_steps: int = _PROFILER.saved_latency_every_n_steps  # 0: never
    peak_flops: Optional[float] = _PROFILER.peak_flops  # device peak FLOP/s for throughput/mfu

    # exactga (see docs/math.md).
    loss_normalization: NormMode = NormMode.EXACT
    drop_partial_window: bool = False
    # How a window's samples are split into micro-batches; exact, so only speed and memory
    # change (see [regrouping is exact] in exactga.micro_batching and docs/math.md).
    micro_batching: MicroBatching = MicroBatching.BY_LENGTH
    micro_batch_tokens: Optional[int] = None  # token_budget's padded positions per micro-batch
    # Trainable weights, their gradients and optimizer state in fp32 under dtype: bf16 (see
    # [fp32 master weights] in exactga.precision and docs/precision.md); none: as stock.
    master_weights: MasterWeights = MasterWeights.NONE

    # exactga: step checkpoints and failures (see docs/reliability.md).
    save_every_n_steps: Optional[int] = None  # null: epoch-end checkpoints only, as stock
    keep_last_n_checkpoints: int = 2  # step checkpoints kept; 2 or more
    resume_allow_changed_keys: list[str] = field(default_factory=list)
    nonfinite_loss: NonFinitePolicy = NonFinitePolicy.SKIP

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        """Reject settings that cannot work together, naming the keys; warn about ignored ones."""
        device_type = _device_type(cfg)
        if cfg.enable_activation_offloading and device_type != "cuda":
            raise ValueError("config key 'enable_activation_offloading' needs device: cuda.")
        if cfg.enable_activation_offloading and not cfg.enable_activation_checkpointing:
            raise ValueError(
                "config key 'enable_activation_offloading' needs enable_activation_checkpointing."
            )
        if cfg.compile and device_type == "npu":
            raise ValueError("config key 'compile': NPU does not support compilation; set False.")
        if cfg.log_peak_memory_stats and device_type == "cpu":
            _warn_once("config key 'log_peak_memory_stats' is ignored on CPU.")
        check_micro_batching(cfg)
        check_master_weights(cfg)


def check_master_weights(cfg: DictConfig) -> None:
    """Warn where bf16 stochastic rounding cannot act: over fp32 master weights there is no
    bf16 weight to round to (see [fp32 master weights] in exactga.precision)."""
    optimizer = cfg.optimizer if isinstance(cfg.optimizer, DictConfig) else {}
    if (
        optimizer.get("bf16_stochastic_round", False)
        and cfg.master_weights is MasterWeights.FP32
        and cfg.dtype == "bf16"
    ):
        _warn_once(
            "config key 'optimizer.bf16_stochastic_round' is ignored with master_weights: fp32: "
            "the trainable weights are fp32, so nothing is rounded to bf16. Set "
            "master_weights=none for pure bf16 with stochastic rounding."
        )


def check_micro_batching(cfg: DictConfig) -> None:
    """``micro_batching`` with ``micro_batch_tokens`` and ``loss_normalization``; see
    [regrouping is exact]."""
    mode = cfg.micro_batching
    if mode is MicroBatching.TOKEN_BUDGET and cfg.micro_batch_tokens is None:
        raise ValueError(
            "config key 'micro_batch_tokens' is needed with micro_batching: token_budget "
            "(padded positions per micro-batch, e.g. micro_batch_tokens=4096)."
        )
    if mode is not MicroBatching.TOKEN_BUDGET and cfg.micro_batch_tokens is not None:
        raise ValueError(
            f"config keys 'micro_batch_tokens' and 'micro_batching': a token budget needs "
            f"micro_batching: token_budget (got {mode}); remove micro_batch_tokens or set it."
        )
    if mode is not MicroBatching.FIXED and cfg.loss_normalization is not NormMode.EXACT:
        raise ValueError(
            f"config keys 'micro_batching' and 'loss_normalization': the baseline "
            f"{cfg.loss_normalization} weighs micro-batches by their split, so only "
            f"micro_batching: fixed keeps its numbers; set micro_batching=fixed."
        )


def check_lora_model(cfg_model: DictConfig) -> None:
    """The ``model`` section is a LoRA/QLoRA builder's: it has :data:`LORA_MODEL_KEYS`.

    Raises:
        ValueError: naming the keys it lacks.
    """
    missing = [key for key in LORA_MODEL_KEYS if key not in cfg_model]
    if missing:
        raise ValueError(
            f"config key 'model' ({cfg_model.get('_component_')}) has no "
            f"{', '.join('model.' + key for key in missing)}: this recipe needs a LoRA or "
            "QLoRA builder (e.g. torchtune.models.llama3_1.lora_llama3_1_8b); for full "
            "fine-tuning use the full_finetune recipe."
        )


@dataclass
class FullFinetuneSingleDeviceConfig(SingleDeviceRecipeConfig):
    """``full_finetune_single_device``."""

    optimizer_in_bwd: bool = False

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        if not cfg.optimizer_in_bwd:
            return
        if cfg.gradient_accumulation_steps > 1:
            raise ValueError(
                "config keys 'optimizer_in_bwd' and 'gradient_accumulation_steps': the optimizer "
                "steps inside backward, so gradients cannot accumulate; set one of them off/1."
            )
        if cfg.clip_grad_norm is not None:
            raise ValueError(
                "config keys 'optimizer_in_bwd' and 'clip_grad_norm': gradients are consumed "
                "inside backward and cannot be clipped; set clip_grad_norm to null."
            )
        if cfg.loss_normalization is not NormMode.EXACT:
            raise ValueError(
                "config keys 'optimizer_in_bwd' and 'loss_normalization': the baselines scale "
                "gradients after backward; optimizer_in_bwd needs loss_normalization: exact."
            )


@dataclass
class LoraFinetuneSingleDeviceConfig(SingleDeviceRecipeConfig):
    """``lora_finetune_single_device``. ``model`` must be a LoRA/QLoRA builder: the recipe also
    reads its lora_rank, lora_alpha, lora_attn_modules, apply_lora_to_mlp and
    apply_lora_to_output. No ``optimizer_in_bwd``: stock's LoRA recipe does not read it."""

    save_adapter_weights_only: bool = False
    low_cpu_ram: bool = False  # torchtune's low-CPU-RAM NF4 state-dict hook (QLoRA)
    # fp32 adapters over the bf16 base: a few MB, and 10x closer to fp32 LoRA with SGD
    # (docs/precision.md). Full fine-tuning defaults to none: there it doubles weight memory.
    master_weights: MasterWeights = MasterWeights.FP32

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        check_lora_model(cfg.model)


@dataclass
class FullFinetuneDistributedConfig(FullFinetuneSingleDeviceConfig):
    """``full_finetune_distributed``: the single-device keys plus the distributed ones."""

    # Sharding and parallelism (torchtune 0.6.1's keys).
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    custom_sharded_layers: Optional[list[str]] = None
    tensor_parallel_dim: int = 1
    tensor_parallel_plan: Any = None
    enable_async_checkpointing: bool = False
    ac_mode: Optional[str] = None  # selective activation checkpointing, as in torchtune
    ac_option: Any = None  # an int (every n-th layer) or "op"

    # exactga: when FSDP reduces gradients under accumulation (docs/full_finetune_distributed.md).
    # every_micro_batch is stock torchtune's behaviour and never needs more memory than stock;
    # once_per_window is faster but holds an unsharded gradient copy per rank, which stock
    # configs with ga = 8 (up to the 90B vision model) could not afford.
    gradient_sync: GradientSync = GradientSync.EVERY_MICRO_BATCH

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        if cfg.tensor_parallel_dim > 1 and cfg.tensor_parallel_plan is None:
            raise ValueError(
                "config key 'tensor_parallel_plan' is needed when tensor_parallel_dim > 1."
            )
        if cfg.tensor_parallel_dim > 1 and cfg.optimizer.get("fused", False):
            raise ValueError("config key 'optimizer.fused' does not work with tensor parallelism.")
        _warn_cpu_offload_ignored(cfg)


@dataclass
class LoraFinetuneDistributedConfig(LoraFinetuneSingleDeviceConfig):
    """``lora_finetune_distributed``: the single-device LoRA keys plus the distributed ones."""

    # Sharding (torchtune 0.6.1's keys; stock LoRA has no tensor parallelism).
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    custom_sharded_layers: Optional[list[str]] = None
    # Three stock QLoRA configs carry ``fsdp: {cpu_offload: False}``, which stock never reads;
    # accepted so they run unchanged, and the recipe warns that it is ignored.
    fsdp: Any = None

    # exactga: when FSDP reduces gradients under accumulation; see FullFinetuneDistributedConfig.
    gradient_sync: GradientSync = GradientSync.EVERY_MICRO_BATCH

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        _warn_cpu_offload_ignored(cfg)
        if cfg.fsdp is not None:
            _warn_once("config key 'fsdp' is ignored, as by stock torchtune; use fsdp_cpu_offload.")


@dataclass
class DistillationKeys:
    """The keys torchtune 0.6.1's KD recipes add to the LoRA ones (see exactga.distillation)."""

    teacher_model: Any = MISSING  # a plain builder; frozen, run under no_grad
    teacher_checkpointer: Any = MISSING
    kd_loss: Any = MISSING  # e.g. torchtune.modules.loss.ForwardKLWithChunkedOutputLoss
    kd_ratio: float = 0.5  # loss = (1 - kd_ratio) class loss + kd_ratio KD loss

    @staticmethod
    def check_kd_ratio(cfg: DictConfig) -> None:
        if not 0.0 <= cfg.kd_ratio <= 1.0:
            raise ValueError(f"config key 'kd_ratio' must be in [0, 1], got {cfg.kd_ratio}.")


@dataclass
class KnowledgeDistillationSingleDeviceConfig(LoraFinetuneSingleDeviceConfig, DistillationKeys):
    """``knowledge_distillation_single_device``: the LoRA student's keys plus the teacher's."""

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        cls.check_kd_ratio(cfg)


@dataclass
class KnowledgeDistillationDistributedConfig(LoraFinetuneDistributedConfig, DistillationKeys):
    """``knowledge_distillation_distributed``: the distributed LoRA keys plus the teacher's."""

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        cls.check_kd_ratio(cfg)


@dataclass
class ParitySettings:
    """The ``parity`` section of ``ga_parity``: what to compare, for how long."""

    # batch_size x gradient_accumulation_steps, "BxG", or x data-parallel ranks, "BxGxN" (N = the
    # launch's process count); all with the same global batch. The full batch (global x 1) on
    # one device is always trained as the reference.
    splits: list[str] = field(default_factory=lambda: ["1x8", "2x4", "4x2"])
    modes: Optional[list[NormMode]] = None  # null: the loss's modes (GaParityConfig.modes_for)
    num_steps: int = 12
    # Relative L2 an exact split may differ by in fp32. Below fp32 (dtype: bf16) the floor is
    # the larger of this and twice the bf16 full batch's distance to an fp32 full batch, which
    # the report then also trains; see [parity floor below fp32] in exactga.parity.scoring.
    noise_floor: float = 1e-5
    # How a window's samples are split into micro-batches (see [micro-batching modes] in
    # exactga.micro_batching): exact runs every split under each of these, the baselines under
    # fixed only (see [regrouping is exact]). The full-batch reference is fixed.
    micro_batching: list[MicroBatching] = field(default_factory=lambda: list(MicroBatching))
    micro_batch_tokens: int = 1024  # token_budget's padded positions per micro-batch


@dataclass
class GaParityConfig(TrainingRunConfig):
    """``ga_parity``: the keys of a full, LoRA, KD or DPO config it reads, plus ``parity``.

    The other keys of those recipes (single-device or distributed) are accepted, so a training
    config runs with a ``parity`` section added, and named in one warning: the report trains
    ``parity.num_steps`` steps of each split in memory from the initial weights, so batching,
    epochs, checkpoints, logging, compile and memory settings change nothing in it. A KD config
    (``teacher_model``) or a DPO one (:meth:`is_preference`) trains its recipes' loss step.
    """

    optimizer_in_bwd: bool = False  # read by full configs; must stay False here
    collate_fn: Optional[str] = None  # null: padded_collate_sft, or collate_pairs for DPO
    # As the training recipes read it (see [fp32 master weights] in exactga.precision); null:
    # the default of the recipe the config is for, fp32 for LoRA and none for full
    # (master_weights_for). One schema covers both kinds, so its default cannot be either.
    master_weights: Optional[MasterWeights] = None
    parity: ParitySettings = field(default_factory=ParitySettings)
    # Knowledge distillation: DistillationKeys, optional here. Null teacher_model: no teacher,
    # the causal-LM loss alone.
    teacher_model: Any = None
    teacher_checkpointer: Any = None
    kd_loss: Any = None
    kd_ratio: float = 0.5
    ref_checkpointer: Any = None  # full DPO's reference weights; LoRA DPO's is the base

    # Keys of these (and so of the single-device) recipes are accepted, named in a warning.
    accepts_unread_keys_of: ClassVar[tuple[type, ...]] = (
        FullFinetuneDistributedConfig,
        LoraFinetuneDistributedConfig,
    )

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        if cfg.optimizer_in_bwd:
            raise ValueError("config key 'optimizer_in_bwd' must be False for the parity report.")
        dataset_sections = cfg.dataset if OmegaConf.is_list(cfg.dataset) else [cfg.dataset]
        if any(section.get("packed", False) for section in dataset_sections):
            raise ValueError("config key 'dataset.packed' is not supported by the parity report.")
        cls._check_micro_batching(cfg)  # and the modes (modes_for)
        cls._check_distillation(cfg)

    @staticmethod
    def _check_distillation(cfg: DictConfig) -> None:
        """The KD keys come together: a teacher needs its checkpointer and a KD loss."""
        if cfg.teacher_model is None:
            unread = [key for key in ("teacher_checkpointer", "kd_loss") if cfg[key] is not None]
            if unread:
                names = ", ".join(f"'{key}'" for key in unread)
                _warn_once(
                    f"config key {names} ignored: without teacher_model the report trains "
                    "the causal-LM loss alone."
                )
            return
        for key in ("teacher_checkpointer", "kd_loss"):
            if cfg[key] is None:
                raise ValueError(f"config key '{key}' is needed with teacher_model.")
        DistillationKeys.check_kd_ratio(cfg)

    @staticmethod
    def master_weights_for(cfg: DictConfig, *, is_lora: bool) -> MasterWeights:
        """``master_weights``, or where it is null the default of the training recipe the
        config is for: the LoRA recipes' (fp32) or the full recipes' (none)."""
        if cfg.master_weights is not None:
            return cfg.master_weights
        recipe = LoraFinetuneSingleDeviceConfig if is_lora else FullFinetuneSingleDeviceConfig
        return recipe.master_weights

    @staticmethod
    def is_preference(cfg: DictConfig) -> bool:
        """Whether ``loss`` weighs pairs (DPO): its forward takes summed log-probs, as torchtune's
        DPOLoss and RSOLoss do. A path that does not resolve is left to instantiation to name."""
        from torchtune.config._utils import _get_component_from_path

        try:
            forward = _get_component_from_path(str(cfg.loss["_component_"])).forward
        except Exception:  # instantiating the loss names what is wrong
            return False
        return "policy_chosen_logps" in inspect.signature(forward).parameters

    @classmethod
    def modes_for(cls, cfg: DictConfig) -> list[NormMode]:
        """``parity.modes``; where null, naive, post_scale and exact, without post_scale for a
        preference loss: a token weighting, which raises ValueError naming the key there."""
        preference = cls.is_preference(cfg)
        default = [NormMode.NAIVE, *([] if preference else [NormMode.POST_SCALE]), NormMode.EXACT]
        modes = default if cfg.parity.modes is None else list(cfg.parity.modes)
        if preference and NormMode.POST_SCALE in modes:
            raise ValueError(
                "config key 'parity.modes': post_scale is a token weighting and a preference "
                "loss weighs pairs (stock DPO's weighting is naive); list naive and exact."
            )
        return modes

    @classmethod
    def baseline_micro_batchings(cls, cfg: DictConfig) -> list[MicroBatching]:
        """``fixed``; for a preference loss also ``token_budget``, see [stock dpo weighting]."""
        budget = [MicroBatching.TOKEN_BUDGET] if cls.is_preference(cfg) else []
        return [MicroBatching.FIXED, *budget]

    @classmethod
    def _check_micro_batching(cls, cfg: DictConfig) -> None:
        listed = list(cfg.parity.micro_batching)
        if not listed:
            raise ValueError(
                "config key 'parity.micro_batching' is empty; list at least one of "
                f"{', '.join(m.value for m in MicroBatching)}."
            )
        duplicates = sorted({m for m in listed if listed.count(m) > 1})
        if duplicates:
            raise ValueError(
                f"config key 'parity.micro_batching' lists {', '.join(duplicates)} twice."
            )
        if cfg.parity.micro_batch_tokens < 1:
            raise ValueError(
                "config key 'parity.micro_batch_tokens' must be at least 1, got "
                f"{cfg.parity.micro_batch_tokens}."
            )
        modes = cls.modes_for(cfg)
        regrouping = cls.baseline_micro_batchings(cfg) if NormMode.NAIVE in modes else ()
        regrouped = [m for m in listed if m is not MicroBatching.FIXED and m not in regrouping]
        if regrouped and NormMode.EXACT not in modes:
            _warn_once(
                f"config key 'parity.micro_batching': {', '.join(regrouped)} is ignored: only "
                "exact runs regroup (and naive under token_budget, for a preference loss), and "
                "'parity.modes' lists no exact."
            )
