"""The keys each recipe reads, with their one default and their checks (see
exactga.config.validation).

The stock keys are those torchtune 0.6.1's recipe of the same name reads, so its configs run
unchanged. Sections with a ``_component_`` are typed ``Any``: their keys are the keyword
arguments of the component and are checked when it is instantiated; the ``profiler`` section
has a schema of its own. A key with a fixed set of values is typed with its enum from
``exactga.config.options`` (the recipe then reads a member), or declares them next to its default
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

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Optional

import torch
from omegaconf import MISSING, DictConfig

from exactga.config.mesh import check_mesh_keys, mesh_keys
from exactga.config.options import (
    PRECISIONS,
    GradientSync,
    MasterWeights,
    MicroBatching,
    NonFinitePolicy,
    NormMode,
    RankBalancing,
    RouterBalanceObjective,
)
from exactga.config.profiler import ProfilerSection, ProfilerSettings

# One source for the defaults the profiler hook and the schemas share.
_PROFILER = ProfilerSettings()
# The model-section keys the LoRA recipes read besides instantiating it (stock reads the same).
LORA_MODEL_KEYS = ("lora_rank", "lora_alpha", "lora_attn_modules", "apply_lora_to_mlp")


# ``resume_from_checkpoint``'s values: stock's two, and "auto".
RESUME_CHOICES = (False, True, "auto")


def choice(values: tuple[str, ...], default: str) -> Any:
    """A string field whose value must be one of ``values`` (checked by ``validate_config``);
    a knob whose values are an enum of exactga.config.options is typed with the enum instead."""
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
    # [cuDNN attention and variable shapes] in exactga.runtime.kernels.
    cudnn_attention: bool = False
    compile: bool = False
    # True: go on from the newest checkpoint (none is an error); False: start; exactga's "auto":
    # go on if there is a checkpoint to go on from, else start (preemptible jobs). Validation
    # hands on True or False (exactga.run.resume.validate_run_config).
    resume_from_checkpoint: Any = field(default=False, metadata={"choices": RESUME_CHOICES})

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
    # exactga: a mixture-of-experts model's router load-balancing term, weighted by this
    # coefficient (Hugging Face's router_aux_loss_coef); 0 adds none. See docs/moe.md.
    router_aux_loss_coef: float = 0.0
    # What the term balances over: each micro-batch on its rank (Hugging Face's), or each
    # micro-batch on every data-parallel rank (global_batch).
    router_balance: RouterBalanceObjective = RouterBalanceObjective.GLOBAL_BATCH
    drop_partial_window: bool = False
    # How a window's samples are split into micro-batches; exact, so only speed and memory
    # change (see [regrouping is exact] in exactga.data.micro_batching and docs/math.md).
    micro_batching: MicroBatching = MicroBatching.BY_LENGTH
    # token_budget's padded positions per micro-batch; packed's positions per row.
    micro_batch_tokens: Optional[int] = None
    # Padded modes: each micro-batch's sequence length rounded up to a multiple of it, which
    # bounds its distinct shapes (compilations, kernel plans); packed: a row of one long sample.
    pad_to_multiple_of: Optional[int] = None
    # Trainable weights, their gradients and optimizer state in fp32 under dtype: bf16 (see
    # [fp32 master weights] in exactga.runtime.precision and docs/precision.md); none: as stock.
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
        cls.check_router_balance(cfg)

    # The recipes that add a mixture-of-experts router's balance term to their loss.
    ROUTER_BALANCE_RECIPES: ClassVar[bool] = True
    # The schemas of runs on every rank of a process group (FSDP2): ``Runtime.for_settings``
    # starts the group for them, and runs one device for the others.
    DISTRIBUTED: ClassVar[bool] = False

    @classmethod
    def check_router_balance(cls, cfg: DictConfig) -> None:
        """``router_aux_loss_coef``: finite, at least 0, and 0 where the recipe has no such term
        (distillation, DPO, GRPO)."""
        coef = cfg.router_aux_loss_coef
        if not math.isfinite(coef) or coef < 0:
            raise ValueError(f"config key 'router_aux_loss_coef' must be 0 or more, got {coef}.")
        if coef > 0 and not cls.ROUTER_BALANCE_RECIPES:
            raise ValueError(
                "config key 'router_aux_loss_coef': this recipe adds no router balance term "
                "(the fine-tuning recipes do; docs/moe.md); set it to 0."
            )


def check_master_weights(cfg: DictConfig) -> None:
    """Warn where bf16 stochastic rounding cannot act: over fp32 master weights there is no
    bf16 weight to round to (see [fp32 master weights] in exactga.runtime.precision)."""
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


def max_seq_len_of(cfg: DictConfig, section: str) -> int | None:
    """``<section>.max_seq_len`` where the config gives it (a builder's default is unknown here)."""
    values = cfg.get(section)
    return values.get("max_seq_len") if isinstance(values, DictConfig) else None


def check_micro_batching(cfg: DictConfig) -> None:
    """``micro_batching`` with ``micro_batch_tokens``, the model's ``max_seq_len`` and
    ``loss_normalization``; see [regrouping is exact]."""
    mode = cfg.micro_batching
    by_budget = mode in (MicroBatching.TOKEN_BUDGET, MicroBatching.PACKED)
    if by_budget and cfg.micro_batch_tokens is None:
        what = (
            "padded positions per micro-batch"
            if mode is MicroBatching.TOKEN_BUDGET
            else ("positions per packed row")
        )
        raise ValueError(
            f"config key 'micro_batch_tokens' is needed with micro_batching: {mode} "
            f"({what}, e.g. micro_batch_tokens=4096)."
        )
    if not by_budget and cfg.micro_batch_tokens is not None:
        raise ValueError(
            f"config keys 'micro_batch_tokens' and 'micro_batching': a token budget needs "
            f"micro_batching: token_budget or packed (got {mode}); remove micro_batch_tokens "
            "or set it."
        )
    max_seq_len = max_seq_len_of(cfg, "model")
    if mode is MicroBatching.PACKED and max_seq_len and cfg.micro_batch_tokens > max_seq_len:
        raise ValueError(
            f"config keys 'micro_batch_tokens' and 'model.max_seq_len': a packed row of "
            f"{cfg.micro_batch_tokens} positions is one sequence to the model, which takes at "
            f"most {max_seq_len}; set micro_batch_tokens={max_seq_len} or less, or raise "
            "model.max_seq_len."
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
class ValidationKeys:
    """The keys of validation during training (docs/validation.md; exactga.validation.held_out
    and each family's figure): torchtune main's three, and a bound on the cost. Without
    ``dataset_val`` none runs."""

    # Any dataset builder the recipe trains on (or a list of them); null: no validation.
    dataset_val: Any = None
    # Validate after every n-th optimizer step; at each epoch's end in any case.
    run_val_every_n_steps: Optional[int] = None
    batch_size_val: Optional[int] = None  # null: batch_size; the figure does not depend on it
    # Only the first max_val_batches x batch_size_val samples of the set; null: all of them.
    max_val_batches: Optional[int] = None
    # After each validation whose figure is the best so far (the lowest val/loss; GRPO's and
    # PPO's highest val/reward_mean), the weights as an epoch folder in
    # <checkpointer.output_dir>/best/ (docs/validation.md, "The best checkpoint").
    keep_best_checkpoint: bool = False

    @classmethod
    def check_validation(cls, cfg: DictConfig) -> None:
        """The other validation keys only with ``dataset_val``."""
        if cfg.dataset_val is None:
            given = [key for key in _VALIDATION_OPTIONS if cfg[key] is not None]
            if given:
                raise ValueError(
                    f"config key '{given[0]}' needs dataset_val (the validation set); set "
                    f"dataset_val or remove {', '.join(given)}."
                )
            if cfg.keep_best_checkpoint:
                raise ValueError(
                    "config key 'keep_best_checkpoint' needs dataset_val: the best checkpoint is "
                    "the one of the best validation figure; set dataset_val (and "
                    "run_val_every_n_steps) or keep_best_checkpoint=false."
                )


_VALIDATION_OPTIONS = ("run_val_every_n_steps", "batch_size_val", "max_val_batches")


@dataclass
class FullFinetuneSingleDeviceConfig(SingleDeviceRecipeConfig, ValidationKeys):
    """``full_finetune_single_device``."""

    optimizer_in_bwd: bool = False

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        cls.check_validation(cfg)
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
class LoraFinetuneSingleDeviceConfig(SingleDeviceRecipeConfig, ValidationKeys):
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
        cls.check_validation(cfg)


@dataclass
class MeshKeys:
    """The device mesh's keys, torchtune main's (exactga.config.mesh; docs/meshes.md). The
    defaults shard over every rank, as torchtune 0.6.1 does; ``tensor_parallel_dim`` is on the
    schemas of the recipes that take it."""

    data_parallel_shard_dim: int = -1  # -1: whatever the other dimensions leave
    data_parallel_replicate_dim: int = 1  # > 1: HSDP, replicas of a sharded model
    context_parallel_dim: int = 1  # > 1: each sequence split over that many ranks (CUDA only)

    # Whether the recipe's loss step takes a micro-batch cut along the sequence: supervised
    # fine-tuning's does (exactga.runtime.context_parallel); a family whose step reads whole
    # sequences (distillation's teacher logits, preference pairs) sets it False.
    CONTEXT_PARALLEL: ClassVar[bool] = True

    @classmethod
    def check_mesh(cls, cfg: DictConfig) -> None:
        """The mesh keys, as far as they can be checked without the number of ranks (which
        ``Runtime.distributed`` checks against the rest)."""
        if cfg.context_parallel_dim > 1 and not cls.CONTEXT_PARALLEL:
            raise ValueError(
                f"config key 'context_parallel_dim'={cfg.context_parallel_dim}: this recipe's "
                "loss step reads whole sequences, so it does not take context parallelism "
                "(supervised fine-tuning does: full, LoRA, QAT); set context_parallel_dim=1."
            )
        check_mesh_keys(mesh_keys(cfg, cfg.get("tensor_parallel_dim", 1)), _device_type(cfg))


@dataclass
class FullFinetuneDistributedConfig(FullFinetuneSingleDeviceConfig, MeshKeys):
    """``full_finetune_distributed``: the single-device keys plus the distributed ones."""

    DISTRIBUTED: ClassVar[bool] = True

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
    # exactga: how each window's samples are dealt to the ranks (docs/rank_balancing.md);
    # by_tokens evens their tokens, none deals every n-th sample as stock.
    rank_balancing: RankBalancing = RankBalancing.BY_TOKENS

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        cls.check_mesh(cfg)
        if cfg.tensor_parallel_dim > 1 and cfg.tensor_parallel_plan is None:
            raise ValueError(
                "config key 'tensor_parallel_plan' is needed when tensor_parallel_dim > 1."
            )
        if cfg.tensor_parallel_dim > 1 and cfg.optimizer.get("fused", False):
            raise ValueError("config key 'optimizer.fused' does not work with tensor parallelism.")
        _warn_cpu_offload_ignored(cfg)


@dataclass
class LoraFinetuneDistributedConfig(LoraFinetuneSingleDeviceConfig, MeshKeys):
    """``lora_finetune_distributed``: the single-device LoRA keys plus the distributed ones."""

    DISTRIBUTED: ClassVar[bool] = True

    # Sharding (torchtune 0.6.1's keys; stock LoRA has no tensor parallelism).
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    custom_sharded_layers: Optional[list[str]] = None
    # Three stock QLoRA configs carry ``fsdp: {cpu_offload: False}``, which stock never reads;
    # accepted so they run unchanged, and the recipe warns that it is ignored.
    fsdp: Any = None

    # exactga: when FSDP reduces gradients under accumulation; see FullFinetuneDistributedConfig.
    gradient_sync: GradientSync = GradientSync.EVERY_MICRO_BATCH
    rank_balancing: RankBalancing = RankBalancing.BY_TOKENS  # see FullFinetuneDistributedConfig

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        cls.check_mesh(cfg)
        _warn_cpu_offload_ignored(cfg)
        if cfg.fsdp is not None:
            _warn_once("config key 'fsdp' is ignored, as by stock torchtune; use fsdp_cpu_offload.")


class TwinSchemas(NamedTuple):
    """The two schemas of one recipe file that torchtune lists under two names: a launch's
    config is checked against one of them (see [one recipe, two launches] in
    exactga.launch.twins); the distributed one takes every key of the other. (No dataclass:
    the schemas' dataclasses are the config keys.)"""

    single_device: type[SingleDeviceRecipeConfig]
    distributed: type[SingleDeviceRecipeConfig]


FULL_FINETUNE = TwinSchemas(FullFinetuneSingleDeviceConfig, FullFinetuneDistributedConfig)
FullFinetuneConfig = FullFinetuneSingleDeviceConfig | FullFinetuneDistributedConfig
LORA_FINETUNE = TwinSchemas(LoraFinetuneSingleDeviceConfig, LoraFinetuneDistributedConfig)
LoraFinetuneConfig = LoraFinetuneSingleDeviceConfig | LoraFinetuneDistributedConfig


def check_qat(cfg: DictConfig) -> None:
    """What torchtune 0.6.1's QAT recipes refuse at start-up, and what they cannot know.

    Raises:
        ValueError: naming the key (``compile``, ``quantizer``).
    """
    if cfg.compile:
        raise ValueError("config key 'compile': QAT does not support compilation; set False.")
    if not isinstance(cfg.quantizer, DictConfig) or "_component_" not in cfg.quantizer:
        raise ValueError(
            "config key 'quantizer' is needed: a section with _component_, e.g. "
            "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer."
        )


@dataclass
class QatDistributedConfig(FullFinetuneSingleDeviceConfig, MeshKeys):
    """``qat_distributed``: full fine-tuning with torchao's fake quantisation (docs/qat.md).
    The sharding keys of ``full_finetune_distributed`` but no tensor parallelism, which stock's
    QAT recipe does not have."""

    DISTRIBUTED: ClassVar[bool] = True

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema

    quantizer: Any = MISSING  # a torchao QAT quantizer section (exactga.qat.fake_quant)
    fake_quant_after_n_steps: Optional[int] = None  # null: fake quantisation from the start

    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True
    custom_sharded_layers: Optional[list[str]] = None
    ac_mode: Optional[str] = None
    ac_option: Any = None
    # exactga: stock's QAT recipe gathers and saves synchronously, which is what torchtune's
    # checkpoint client does with this off (the same files); on, as full_finetune_distributed.
    enable_async_checkpointing: bool = False
    # exactga: see FullFinetuneDistributedConfig.
    gradient_sync: GradientSync = GradientSync.EVERY_MICRO_BATCH
    rank_balancing: RankBalancing = RankBalancing.BY_TOKENS

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        cls.check_mesh(cfg)
        check_qat(cfg)
        if cfg.fake_quant_after_n_steps is not None and cfg.fake_quant_after_n_steps < 0:
            raise ValueError("config key 'fake_quant_after_n_steps' must be 0 or more, or null.")
        _warn_cpu_offload_ignored(cfg)


@dataclass
class QatLoraFinetuneDistributedConfig(LoraFinetuneDistributedConfig):
    """``qat_lora_finetune_distributed``: LoRA over a fake-quantised frozen base (docs/qat.md).
    No ``fake_quant_after_n_steps``: stock's QAT LoRA recipe has none."""

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema

    quantizer: Any = MISSING  # a torchao QAT quantizer section (exactga.qat.fake_quant)

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        check_qat(cfg)
        if cfg.model.get("use_dora", False):
            raise ValueError(
                "config keys 'model.use_dora' and 'quantizer': QAT does not work with DoRA."
            )
