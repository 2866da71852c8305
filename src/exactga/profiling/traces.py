"""Traces and memory snapshots: ``torch.profiler`` on torchtune's schedule, once per optimizer step.

Traces are written as Chrome/Perfetto JSON (``trace_step_<n>.json``, open at
https://ui.perfetto.dev), stepped once per *optimizer* step (stock torchtune steps per
micro-batch) and numbered so that ``ProfilerStep#<k>`` is optimizer step ``k`` and ``<n>`` the
last step in the file; the hook's phases are labelled regions (``exactga/<name>``). On CUDA with
``profile_memory`` also memory snapshots (``memory_snapshot_step_<n>.pickle``, open at
https://pytorch.org/memory_viz) next to each trace, and one when training runs out of memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torchtune import utils

from exactga.config.profiler import ProfilerSettings

log = utils.get_logger("INFO")


class TraceRecorder:
    """The run's traces and memory snapshots; does nothing where the settings leave them off."""

    def __init__(self, settings: ProfilerSettings, device: torch.device) -> None:
        self._settings = settings
        self._device = device
        self._trace: torch.profiler.profile | None = None
        self._recording_memory = False
        self._step = 0  # the last optimizer step closed, for the file names
        self.trace_paths: list[Path] = []
        self.snapshot_paths: list[Path] = []

    def start(self) -> None:
        """Record allocations from the start (for snapshots), then start the trace's schedule."""
        self._start_memory_history()
        if self._settings.enabled:
            self._trace = self._start_trace()

    def stop(self, exc: BaseException | None) -> None:
        """Dump a snapshot if ``exc`` is an out-of-memory error, then stop recording."""
        if isinstance(exc, torch.OutOfMemoryError):
            self._dump_memory_snapshot("oom_memory_snapshot.pickle")
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
        if self._trace is not None:
            self._trace.stop()
            self._trace = None

    def step(self, step: int) -> None:
        """Close optimizer step ``step``: the schedule moves on, and may write a trace."""
        self._step = step
        if self._trace is not None:
            self._trace.step()

    def region(
        self, name: str, inner: contextlib.AbstractContextManager[None] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """``inner``, inside a trace region ``exactga/<name>`` while a trace is recording."""
        if inner is None:
            inner = contextlib.nullcontext()
        if self._trace is None:
            return inner
        return _within(torch.profiler.record_function(f"exactga/{name}"), inner)

    def _start_trace(self) -> torch.profiler.profile:
        s = self._settings
        activities = [torch.profiler.ProfilerActivity.CPU] if s.cpu else []
        if s.cuda and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if s.xpu and hasattr(torch, "xpu") and torch.xpu.is_available():
            activities.append(torch.profiler.ProfilerActivity.XPU)
        schedule = torch.profiler.schedule(
            wait=s.wait_steps, warmup=s.warmup_steps, active=s.active_steps, repeat=s.num_cycles
        )
        Path(s.output_dir).mkdir(parents=True, exist_ok=True)
        trace = torch.profiler.profile(
            activities=activities,
            # torch numbers steps from 0; counting from 1 makes ``ProfilerStep#k`` optimizer step
            # k, as the file names and the logged steps count, on the same schedule.
            schedule=lambda step_num: schedule(max(step_num - 1, 0)),
            on_trace_ready=self._write_trace,
            profile_memory=s.profile_memory,
            with_stack=s.with_stack,
            record_shapes=s.record_shapes,
            with_flops=s.with_flops,
        )
        trace.step_num = 1
        trace.start()
        return trace

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        # Called from ``step()`` right after step ``self._step``, the trace's last step.
        path = Path(self._settings.output_dir) / f"trace_step_{self._step}.json"
        prof.export_chrome_trace(str(path))
        self.trace_paths.append(path)
        log.info(f"Profiler trace written to {path} (open it at https://ui.perfetto.dev)")
        self._dump_memory_snapshot(f"memory_snapshot_step_{self._step}.pickle")

    def _start_memory_history(self) -> None:
        """With ``profile_memory`` on CUDA, record allocations from the start (for snapshots)."""
        if self._settings.profile_memory and self._device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._recording_memory = True

    def _dump_memory_snapshot(self, name: str) -> None:
        if not self._recording_memory:
            return
        path = Path(self._settings.output_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        self.snapshot_paths.append(path)
        log.info(
            f"CUDA memory snapshot written to {path} (open it at https://pytorch.org/memory_viz)"
        )


@contextlib.contextmanager
def _within(
    outer: contextlib.AbstractContextManager[Any], inner: contextlib.AbstractContextManager[None]
) -> Iterator[None]:
    with outer, inner:
        yield
