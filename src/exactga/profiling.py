"""The recipes' profiler: torchtune's ``profiler`` config section, stepped per optimizer step.

Stock torchtune steps its profiler once per micro-batch, so with gradient accumulation its
schedule counts micro-batches and a trace can miss the optimizer step. Here the returned
object is stepped once per optimizer step, and it is always present (a no-op when disabled)
so the training loop carries no ``if profiling:`` branches.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from torchtune import config
from torchtune.training import DummyProfiler

_TORCHTUNE_PROFILER = "torchtune.training.setup_torch_profiler"


def setup_profiler(cfg_profiler: DictConfig | None) -> Any:
    """A started-on-enter profiler (``torch.profiler.profile``), or a no-op stand-in.

    The returned object supports ``with``, ``start()``, ``stop()`` and ``step()``.
    """
    if cfg_profiler is None or not cfg_profiler.get("enabled", False):
        return DummyProfiler()
    component = cfg_profiler.get("_component_", _TORCHTUNE_PROFILER)
    if component != _TORCHTUNE_PROFILER:
        raise ValueError(
            f"config key 'profiler._component_' must be {_TORCHTUNE_PROFILER}, got {component}."
        )
    cfg_profiler = DictConfig({**cfg_profiler, "_component_": component})
    profiler, _ = config.instantiate(cfg_profiler)
    return profiler
