"""The phase clock: the time of each phase of an optimizer step, read once per logging interval.

The phases are ``data``, ``forward``, ``backward`` and ``optimizer``; a recipe may time more
(GRPO's ``generate``, ``reward``, ``reference``), which are read after them. On CUDA the clock
records CUDA events and reads them only when asked, so no micro-batch waits on the device; host work
(data loading) is timed on the host.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

PHASES = ("data", "forward", "backward", "optimizer")


class PhaseClock:
    """Accumulates the time of each phase since the last read, without host syncs on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host_ms = dict.fromkeys(PHASES, 0.0)
        self._events: dict[str, list[tuple[Any, Any]]] = {phase: [] for phase in PHASES}
        self.run_ms = dict.fromkeys(PHASES, 0.0)  # every read so far, for the end-of-run report

    @contextlib.contextmanager
    def time(self, phase: str, on_host: bool = False) -> Iterator[None]:
        if phase not in self.run_ms:  # a recipe's own phase, read after the standard ones
            self._host_ms[phase] = 0.0
            self._events[phase] = []
            self.run_ms[phase] = 0.0
        if self._cuda and not on_host:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[phase].append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self._host_ms[phase] += (time.perf_counter() - t0) * 1e3

    def read_ms(self) -> dict[str, float]:
        """Milliseconds per phase since the last read (waits for the device once, here)."""
        totals = dict(self._host_ms)
        for phase, pairs in self._events.items():
            if pairs:
                pairs[-1][1].synchronize()
                totals[phase] += sum(start.elapsed_time(end) for start, end in pairs)
                pairs.clear()
        self._host_ms = dict.fromkeys(self.run_ms, 0.0)
        for phase, ms in totals.items():
            self.run_ms[phase] += ms
        return totals
