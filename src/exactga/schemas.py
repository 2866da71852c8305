"""The keys each recipe reads, with their one default (see :mod:`exactga.config`).

The stock keys are those torchtune 0.6.1's recipe of the same name reads, so its configs run
unchanged. Sections with a ``_component_`` are typed ``Any``: their keys are the keyword
arguments of the component and are checked when it is instantiated.

To add a knob to a recipe you copied, subclass its schema in the recipe file::

    @dataclass
    class MyRecipeConfig(FullFinetuneSingleDeviceConfig):
        my_knob: int = 3
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class SingleDeviceRecipeConfig:
    """The keys every single-device fine-tuning recipe reads (full and LoRA)."""

    # Components (``_component_`` sections).
    model: Any = MISSING
    tokenizer: Any = MISSING
    dataset: Any = MISSING  # one section, or a list of them (concatenated)
    checkpointer: Any = MISSING
    optimizer: Any = MISSING
    loss: Any = MISSING
    metric_logger: Any = MISSING
    lr_scheduler: Any = None
    profiler: Any = None

    # Run.
    output_dir: str = MISSING
    device: str = "cuda"
    dtype: str = "bf16"
    seed: Optional[int] = None
    cudnn_deterministic_mode: Optional[bool] = None
    compile: bool = False
    resume_from_checkpoint: bool = False

    # Data and batching.
    shuffle: bool = True
    batch_size: int = MISSING
    collate_fn: str = "torchtune.data.padded_collate_sft"
    epochs: int = 1
    max_steps_per_epoch: Optional[int] = None
    gradient_accumulation_steps: int = 1

    # Optimisation and memory.
    clip_grad_norm: Optional[float] = None
    enable_activation_checkpointing: bool = False
    enable_activation_offloading: bool = False

    # Logging.
    log_every_n_steps: int = 1
    log_peak_memory_stats: bool = False
    log_timings: bool = True  # exactga: time/*, throughput/*, normalization/* scalars
    saved_latency_every_n_steps: int = 10  # exactga: 0 never times the skipped gradient pass
    peak_flops: Optional[float] = None  # exactga: device peak FLOP/s for throughput/mfu

    # exactga (see docs/math.md).
    loss_normalization: str = "exact"  # exact | post_scale | naive
    drop_partial_window: bool = False

    # exactga: step checkpoints and failures (see docs/reliability.md).
    save_every_n_steps: Optional[int] = None  # null: epoch-end checkpoints only, as stock
    keep_last_n_checkpoints: int = 2  # step checkpoints kept; 2 or more
    resume_allow_changed_keys: list[str] = field(default_factory=list)
    nonfinite_loss: str = "skip"  # skip | stop


@dataclass
class FullFinetuneSingleDeviceConfig(SingleDeviceRecipeConfig):
    """``full_finetune_single_device``."""

    optimizer_in_bwd: bool = False


@dataclass
class LoraFinetuneSingleDeviceConfig(SingleDeviceRecipeConfig):
    """``lora_finetune_single_device``. ``model`` must be a LoRA/QLoRA builder: the recipe also
    reads its lora_rank, lora_alpha, lora_attn_modules, apply_lora_to_mlp and
    apply_lora_to_output. No ``optimizer_in_bwd``: stock's LoRA recipe does not read it."""

    save_adapter_weights_only: bool = False
    low_cpu_ram: bool = False  # torchtune's low-CPU-RAM NF4 state-dict hook (QLoRA)


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
    gradient_sync: str = "every_micro_batch"  # every_micro_batch | once_per_window


@dataclass
class ParitySettings:
    """The ``parity`` section of ``ga_parity``: what to compare, for how long."""

    # batch_size x gradient_accumulation_steps, "BxG", or x data-parallel ranks, "BxGxN" (N = the
    # launch's process count); all with the same global batch. The full batch (global x 1) on
    # one device is always trained as the reference.
    splits: list[str] = field(default_factory=lambda: ["1x8", "2x4", "4x2"])
    modes: list[str] = field(default_factory=lambda: ["naive", "post_scale", "exact"])
    num_steps: int = 12
    noise_floor: float = 1e-5  # relative L2 an exact split may differ by in fp32


@dataclass
class GaParityConfig(LoraFinetuneSingleDeviceConfig):
    """``ga_parity``: a full or LoRA single-device config plus a ``parity`` section."""

    optimizer_in_bwd: bool = False  # read by full configs; must stay False here
    parity: ParitySettings = field(default_factory=ParitySettings)


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
    gradient_sync: str = "every_micro_batch"  # every_micro_batch | once_per_window
