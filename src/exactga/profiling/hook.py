"""The profiler hook: the one context manager every recipe enters around training.

:class:`TrainingProfiler` is called at fixed points of the loop (``timed`` around the data,
``phase`` around forward, backward and the optimizer, ``sample_gradient_pass``, ``step`` once
per optimizer step, ``metrics`` when logging, ``summary`` at the end) and hands each call to the
piece that owns it: the phase clock, the saved-latency sampler, the FLOPs, the traces and the
report. Every feature off makes it a no-op, so the loop has no ``if profiling:`` branches.
:func:`setup_profiler` builds it from the few config values it reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from exactga.config.profiler import ProfilerSection, ProfilerSettings, parse_settings
from exactga.config.schemas import SingleDeviceRecipeConfig
from exactga.data.micro_batching import MicroBatchingSettings, PaddingMeter, WindowWork
from exactga.profiling.compilations import CompilationMeter
from exactga.profiling.flops import device_peak_flops, model_flops_per_token
from exactga.profiling.phase_clock import PHASES, PhaseClock
from exactga.profiling.report import (
    ReportCharts,
    ReportFile,
    RunFigures,
    report_layout,
    report_markdown,
)
from exactga.profiling.saved_latency import (
    SavedLatency,
    SavedLatencySampler,
    saved_latency_metrics,
    summary_line,
)
from exactga.profiling.traces import TraceRecorder


class TrainingProfiler:
    """The profiler hook; create with :func:`setup_profiler`, enter once around training."""

    def __init__(
        self,
        settings: ProfilerSettings,
        device: torch.device,
        model: nn.Module,
        micro_batching: str = "fixed",
        metric_logger: Any = None,
        compiled: bool = False,
    ) -> None:
        self.settings = settings
        self._micro_batching = micro_batching  # named in the end-of-run padding line
        self._device = device
        self._clock = PhaseClock(device)
        self._traces = TraceRecorder(settings, device)
        every_n_steps = settings.saved_latency_every_n_steps if settings.log_timings else 0
        self._sampler = SavedLatencySampler(every_n_steps, device)
        self._flops_per_token = model_flops_per_token(model)
        self._peak_flops = settings.peak_flops or device_peak_flops(device)
        # With log_timings off the hook stays silent: no scalars, no report.
        self._report = ReportFile.for_logger(metric_logger) if settings.log_timings else None
        self._charts = ReportCharts()
        self._step = 0
        self._steps_since_read = 0
        self._tokens_since_read = 0
        self._num_positions = 0  # over the run
        self._padding = PaddingMeter()
        self._t_last_read = time.perf_counter()
        self._step_ms_total = 0.0
        self._t_last_step = time.perf_counter()
        # With compile on: what torch.compile did from here on (dynamo's books, no device read).
        self._compilations = CompilationMeter() if compiled else None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> TrainingProfiler:
        self._t_last_read = self._t_last_step = time.perf_counter()
        self._traces.start()
        if self._report is not None:
            self._report.write_layout(report_layout(mfu=bool(self._peak_flops)))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._traces.stop(exc)  # first a memory snapshot, on out-of-memory
        if self._report is not None:
            try:
                if exc is None:
                    self._report.write_text(self.report_markdown(), step=self._step)
            finally:
                self._report.close()
            if exc is None:  # the bands: the run's lowest to highest; see [report charts]
                self._report.settle_bands(self._charts.run_bands())
        # never swallow the exception: returning None re-raises it

    # -- per step ----------------------------------------------------------------------------

    def timed(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from ``iterable``, timing each fetch as the ``data`` phase (host time)."""
        iterator = iter(iterable)
        while True:
            with self._traces.region("data", self._clock.time("data", on_host=True)):
                item = next(iterator, _END)
            if item is _END:
                return
            yield item

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a block as ``forward``, ``backward`` or ``optimizer`` (and label it in traces)."""
        timer = self._clock.time(name) if self.settings.log_timings else contextlib.nullcontext()
        return self._traces.region(name, timer)

    @property
    def saved_ms_samples(self) -> list[float]:
        """Every sample's estimate of the full gradient-scaling pass, in milliseconds."""
        return [sample.estimate_ms for sample in self._sampler.samples]

    @property
    def saved_latency(self) -> SavedLatency | None:
        """The samples so far, as median and range; ``None`` before the first."""
        return self._sampler.saved_latency

    def sample_gradient_pass(self, model: nn.Module) -> None:
        """On sampled steps, time the gradient pass exact mode avoids; see [saved latency]."""
        region = functools.partial(self._traces.region, "saved_latency_sample")
        self._sampler.sample(model, self._step + 1, region)

    def open_epoch(self) -> None:
        """A new epoch starts: its distinct micro-batch shapes are counted afresh."""
        self._padding.open_epoch()

    def step(self, work: WindowWork) -> None:
        """Close an optimizer step (``Window.work()``: its processed positions, padding included,
        and its loss tokens)."""
        now = time.perf_counter()
        self._step_ms_total += (now - self._t_last_step) * 1e3
        self._t_last_step = now
        self._step += 1
        self._steps_since_read += 1
        self._tokens_since_read += work.num_positions
        self._num_positions += work.num_positions
        self._padding.add(work)
        self._traces.step(self._step)
        if self._compilations is not None:
            self._compilations.step(self._step)

    def metrics(self, step: int | None = None) -> dict[str, float]:
        """Scalars for the steps since the last call; the only device read of the hook.

        With the TensorBoard report on, also writes its charts' lines at ``step``, the step the
        recipe logs these scalars at (default: the hook's count of steps, which a resumed run
        starts again from 1); see [report charts]. With compile on, ``compile/*`` too, whatever
        ``log_timings`` (counts, not timings).
        """
        compile_metrics = {} if self._compilations is None else self._compilations.metrics()
        return compile_metrics | self._timing_metrics(step)

    def _timing_metrics(self, step: int | None) -> dict[str, float]:
        if not self.settings.log_timings or self._steps_since_read == 0:
            return {}
        phase_ms = self._clock.read_ms()
        elapsed_s = time.perf_counter() - self._t_last_read
        steps = self._steps_since_read
        step_ms = elapsed_s * 1e3 / steps
        metrics = {f"time/{phase}_ms": phase_ms[phase] / steps for phase in PHASES}
        # The tops of the phases' bands, for the stacked chart of the TensorBoard report.
        stacked = 0.0
        for number, phase in enumerate(PHASES, start=1):
            stacked += metrics[f"time/{phase}_ms"]
            metrics[f"time/stacked_{number}_{phase}_ms"] = stacked
        own_phases = phase_ms.keys() - set(PHASES)  # a recipe's own phases (GRPO's generate)
        for phase in own_phases:
            metrics[f"time/{phase}_ms"] = phase_ms[phase] / steps
        if own_phases:  # the step holds other work: the training phases' own speed apart
            training_ms = sum(phase_ms[phase] for phase in ("forward", "backward", "optimizer"))
            if training_ms > 0:
                metrics["throughput/training_tokens_per_second"] = (
                    self._tokens_since_read / training_ms * 1e3
                )
        metrics["time/step_ms"] = step_ms
        tokens_per_second = self._tokens_since_read / elapsed_s
        metrics["throughput/tokens_per_second"] = tokens_per_second
        metrics.update(self._padding.read_interval(elapsed_s))
        # The end-of-run figures so far: the Overview charts draw them ([dashboard order]).
        metrics["throughput/tokens_per_second_so_far"] = self._num_positions / (
            self._step_ms_total / 1e3
        )
        run = self._padding.run
        if run.known and run.num_positions:
            metrics["throughput/padding_fraction_so_far"] = run.padding_fraction
        if self._peak_flops:
            metrics["throughput/mfu"] = tokens_per_second * self._flops_per_token / self._peak_flops
        # The end-of-run line's figure, or none; see [saved latency on a busy machine].
        metrics.update(saved_latency_metrics(self.saved_latency, step_ms))
        if self._report is not None:
            phases = [*PHASES, *sorted(own_phases)]
            lines = self._charts.lines(metrics, phases)
            self._report.write_lines(lines, self._step if step is None else step)
        self._steps_since_read = 0
        self._tokens_since_read = 0
        self._t_last_read = time.perf_counter()
        return metrics

    # -- end of run --------------------------------------------------------------------------

    def summary(self) -> str:
        """Lines for the end of the run: the saved latency, the padding, and with compile on
        what torch.compile did."""
        padding = self._padding.summary(self._micro_batching)
        saved = summary_line(self.saved_latency, self._mean_step_ms(), self._step)
        return "\n".join(line for line in (saved, padding, self._compile_summary()) if line)

    def _compile_summary(self) -> str:
        return "" if self._compilations is None else self._compilations.summary()

    def report_markdown(self) -> str:
        """The end-of-run report for TensorBoard's TEXT tab: the saved latency, throughput, MFU,
        padding, the phases, and where the traces and memory snapshots are."""
        step_ms = self._mean_step_ms()
        if step_ms is None:
            return report_markdown(None)
        phase_ms = None
        if self.settings.log_timings:
            self._clock.read_ms()  # the steps after the last logged one
            phase_ms = {phase: ms / self._step for phase, ms in self._clock.run_ms.items()}
        run = RunFigures(
            num_steps=self._step,
            step_ms=step_ms,
            tokens_per_second=self._num_positions / (self._step_ms_total / 1e3),
            saved=self.saved_latency,
            flops_per_token=self._flops_per_token,
            peak_flops=self._peak_flops,
            device_type=self._device.type,
            padding=self._padding.summary(self._micro_batching),
            compilations=self._compile_summary(),
            phase_ms=phase_ms,
            trace_paths=self._traces.trace_paths,
            snapshot_paths=self._traces.snapshot_paths,
        )
        return report_markdown(run)

    def _mean_step_ms(self) -> float | None:
        return self._step_ms_total / self._step if self._step and self._step_ms_total else None


_END = object()
_DEFAULTS = ProfilerSettings()


def setup_profiler(
    cfg_profiler: DictConfig | Mapping[str, Any] | ProfilerSection | None,
    device: torch.device,
    model: nn.Module,
    *,
    output_dir: str,
    micro_batching: str = "fixed",
    log_timings: bool = _DEFAULTS.log_timings,
    saved_latency_every_n_steps: int = _DEFAULTS.saved_latency_every_n_steps,
    peak_flops: float | None = _DEFAULTS.peak_flops,
    rank: int = 0,
    metric_logger: Any = None,
    compiled: bool = False,
) -> TrainingProfiler:
    """The recipe's profiler hook, from the few config values it reads.

    Args:
        cfg_profiler: the config's ``profiler`` section (torchtune's keys), or ``None``.
        device: the training device.
        model: the model trained (its FLOPs per token, its gradients for the sampled pass).
        output_dir: the run's ``output_dir``; traces and snapshots go to
            ``<output_dir>/profiling_outputs`` unless the section names a folder.
        micro_batching: the config's ``micro_batching``, named in the end-of-run padding line.
        log_timings: the config key: ``time/*``, ``throughput/*`` and ``normalization/*``
            scalars and the report; off, the hook is silent.
        saved_latency_every_n_steps: the config key: steps between the samples of
            [saved latency]; 0 for none.
        peak_flops: the config key: the device's peak FLOP/s for ``throughput/mfu``.
        rank: this process's rank. Only rank 0 records traces and memory snapshots and writes
            the report; every rank times its phases (its scalars say what it did).
        metric_logger: the recipe's metric logger (``None`` where a rank has none): with
            torchtune's ``TensorBoardLogger``, the report's layout is written on entering the
            hook and its summary on leaving it.
        compiled: the config's ``compile``: ``compile/*`` scalars and an end-of-run line on
            what torch.compile did (graphs, recompilations, graph breaks).
    """
    settings = parse_settings(
        cfg_profiler,
        output_dir,
        log_timings=log_timings,
        saved_latency_every_n_steps=saved_latency_every_n_steps,
        peak_flops=peak_flops,
    )
    if rank != 0:
        settings = dataclasses.replace(settings, enabled=False, profile_memory=False)
        metric_logger = None
    return TrainingProfiler(
        settings,
        device,
        model,
        micro_batching=micro_batching,
        metric_logger=metric_logger,
        compiled=compiled,
    )


def profiler_from_settings(
    settings: SingleDeviceRecipeConfig,
    micro_batching: MicroBatchingSettings,
    device: torch.device,
    model: nn.Module,
    metric_logger: Any,
) -> TrainingProfiler:
    """:func:`setup_profiler` from a recipe's typed settings (its ``profiler`` section,
    ``output_dir``, ``log_timings``, ``saved_latency_every_n_steps``, ``peak_flops``,
    ``compile``) and the run's parsed ``micro_batching`` (the loader's: read once, named in the
    padding line).
    Traces, memory snapshots and the report come from global rank 0 only; every rank times its
    phases. ``metric_logger``: rank 0's (``None`` elsewhere)."""
    return setup_profiler(
        settings.profiler,
        device,
        model,
        output_dir=settings.output_dir,
        micro_batching=micro_batching.mode,
        log_timings=settings.log_timings,
        saved_latency_every_n_steps=settings.saved_latency_every_n_steps,
        peak_flops=settings.peak_flops,
        rank=dist.get_rank() if dist.is_initialized() else 0,
        metric_logger=metric_logger,
        compiled=settings.compile,
    )
