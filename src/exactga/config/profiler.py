"""The profiler's settings: the ``profiler`` config section and exactga's top-level knobs.

One dataclass holds each key's one default; :func:`parse_settings` reads the section (torchtune
0.6.1's keys only, naming any other) and the top-level values into :class:`ProfilerSettings`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf


@dataclasses.dataclass
class ProfilerSection:
    """The ``profiler`` config section: torchtune 0.6.1's keys, with their one default.

    It is also the section's schema (``exactga.config.schemas``), so a misspelt key fails at
    start-up.
    """

    _component_: str = "torchtune.training.setup_torch_profiler"  # accepted, not used
    enabled: bool = False  # torch.profiler traces (and CUDA memory snapshots) on the schedule
    output_dir: Optional[str] = None  # default: <output_dir>/profiling_outputs
    cpu: bool = True
    cuda: bool = True
    xpu: bool = True
    profile_memory: bool = False
    with_stack: bool = False
    record_shapes: bool = True
    with_flops: bool = False
    wait_steps: int = 5
    warmup_steps: int = 3
    active_steps: int = 2
    num_cycles: int = 1


@dataclasses.dataclass
class ProfilerSettings(ProfilerSection):
    """What the profiler hook reads: the section, plus exactga's scalar knobs, which are
    top-level config keys (stock torchtune passes the section to its own profiler, which
    would reject extra keys there). Their defaults here are the schema's."""

    log_timings: bool = True  # time/*, throughput/* and normalization/* scalars
    saved_latency_every_n_steps: int = 10  # steps between the few samples; 0: none
    peak_flops: Optional[float] = None  # per-device peak FLOP/s for throughput/mfu


def parse_settings(
    cfg_profiler: DictConfig | Mapping[str, Any] | ProfilerSection | None,
    default_output_dir: str,
    **top_level: Any,
) -> ProfilerSettings:
    """Read the ``profiler`` section (torchtune's keys only), naming any key it does not know;
    ``top_level`` holds exactga's knobs (``log_timings``, ``saved_latency_every_n_steps``,
    ``peak_flops``), each defaulting to :class:`ProfilerSettings`'."""
    if cfg_profiler is None:
        values: dict[str, Any] = {}
    elif isinstance(cfg_profiler, DictConfig):
        values = OmegaConf.to_container(cfg_profiler, resolve=True)
    elif dataclasses.is_dataclass(cfg_profiler):
        values = dataclasses.asdict(cfg_profiler)
    else:
        values = dict(cfg_profiler)
    known = {f.name for f in dataclasses.fields(ProfilerSection)}
    for key in values:
        if key not in known:
            raise ValueError(f"unknown config key 'profiler.{key}'.")
    settings = ProfilerSettings(**values, **top_level)
    if settings.output_dir is None:
        settings.output_dir = os.path.join(default_output_dir, "profiling_outputs")
    if settings.saved_latency_every_n_steps < 0:
        raise ValueError("config key 'saved_latency_every_n_steps' must be >= 0.")
    return settings
