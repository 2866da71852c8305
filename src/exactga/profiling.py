"""The recipes' profiler hook: phase timings, the saved latency, throughput and traces.

One object, always present, used the same way by every recipe (a no-op where a feature is
off, so the training loop carries no ``if profiling:`` branches):

- phase timings (``time/data_ms``, ``time/forward_ms``, ``time/backward_ms``,
  ``time/optimizer_ms``, ``time/step_ms``), averaged per optimizer step over each logging
  interval. On CUDA they come from CUDA events that are read only when metrics are logged, so
  no micro-batch waits on the device; data loading is host work and is timed on the host.
- the saved latency (``normalization/saved_ms``, ``normalization/saved_fraction``): exact mode
  never scales gradients, so on a few sampled steps after warm-up the hook times the pass stock
  torchtune would run (``scale_grads`` by a factor of 1, which leaves every gradient
  bit-identical) on a tenth of this model's real gradients and scales the time up by element
  count; the run reports the samples' median and range. See [saved latency].
- throughput (``throughput/tokens_per_second``, ``throughput/mfu``): processed tokens,
  including padding, and model FLOPs utilisation from ``6 * params`` plus attention FLOPs per
  token over the device's peak (a small table, or the config key ``peak_flops``); what of it
  was padding (``throughput/padding_fraction``: padded positions over processed positions), the
  loss tokens trained per second (``throughput/loss_tokens_per_second``), all on this rank, and
  under data parallelism ``throughput/rank_imbalance`` (the interval's worst step's largest
  rank's processed positions over the ranks' mean). See [micro-batching modes].
- ``torch.profiler`` traces on torchtune's schedule keys, written as Chrome/Perfetto JSON
  (``trace_step_<n>.json``, open at https://ui.perfetto.dev), stepped once per *optimizer*
  step (stock torchtune steps per micro-batch) and numbered so that ``ProfilerStep#<k>`` is
  optimizer step ``k`` and ``<n>`` the last step in the file; the phases and the sampled pass
  are labelled regions (``exactga/data`` ... ``exactga/saved_latency_sample``). On CUDA with
  ``profile_memory`` also memory snapshots (``memory_snapshot_step_<n>.pickle``, open at
  https://pytorch.org/memory_viz), and a snapshot dump when training runs out of memory,
  before the error is re-raised.
- a report in TensorBoard when the recipe's ``metric_logger`` is torchtune's
  ``TensorBoardLogger``: a custom-scalars layout written when training starts (phases stacked,
  saved versus step time, throughput, MFU and padding) and a markdown summary in the TEXT tab
  when it ends. Other loggers get no report and no error.

Note [saved latency]
Stock torchtune scales every gradient element on every step; measuring what that costs must not
cost nearly as much. So the hook samples a bounded number of steps (``SAVED_LATENCY_NUM_SAMPLES``:
step 2, after the warm-up step that allocates gradients and optimizer state, then every
``saved_latency_every_n_steps``-th step after it), and never again: from then on no gradient
element is touched. Each sample scales a fixed subset of about ``SAVED_LATENCY_FRACTION`` of
the gradient elements (every tenth gradient tensor, from an offset that rotates between
samples, skipping any that would overrun the budget), times it with the device synchronised
around it, and scales the time up by total elements over sampled elements. Five samples of a
tenth make half of one full pass in the whole run: 0.5 % of what stock spends in 100 steps.
The run reports the samples' median and range, and warns when the range is wider than the
median (a busy machine; the figure then means little).
The estimator is exact when the pass costs the same per element (a memory-bound pass over large
tensors, as on a GPU). Each tensor also costs a fixed launch overhead; the estimate misses it by
``overhead share x (tensor share / element share - 1)``, where the shares are the subset's
fraction of the tensors and of the elements: positive when the subset holds smaller tensors
than average, negative for larger ones. The report prints both shares.
The pass sits between the last backward and the optimizer step. Multiplying by exactly 1
changes no bit, so trained weights are identical with the measurement on or off (a test checks
this).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from time import time as _wall_clock_s  # a date for events; durations use time.perf_counter
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import utils

from exactga.micro_batching import PaddingMeter, WindowWork
from exactga.normalization import gradient_scaling_pass

log = utils.get_logger("INFO")

PHASES = ("data", "forward", "backward", "optimizer")

# The bounded sampling of the gradient pass exact mode skips; see [saved latency].
SAVED_LATENCY_FIRST_STEP = 2  # step 1 allocates the gradients and the optimizer state
SAVED_LATENCY_NUM_SAMPLES = 5  # and after these, never again
SAVED_LATENCY_FRACTION = 0.1  # of the gradient elements, per sample
SAVED_LATENCY_MAX_SPREAD = 1.0  # a range wider than this times the median is flagged

# The TensorBoard report: its text's tag (TEXT tab) and its layout's category (CUSTOM SCALARS).
REPORT_TAG = "exactga/profiling_report"
REPORT_CATEGORY = "exactga profiling"
REPORT_RUN = "profiling_report"  # its folder in the logger's; see [profiling report file]

# Dense bf16 peak FLOP/s by device-name fragment (no sparsity). Override with profiler.peak_flops.
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "4090": 165e12,
}


@dataclasses.dataclass
class ProfilerSection:
    """The ``profiler`` config section: torchtune 0.6.1's keys, with their one default.

    It is also the section's schema (``exactga.schemas``), so a misspelt key fails at start-up.
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


# The top-level config keys that feed ProfilerSettings' exactga fields.
TOP_LEVEL_KEYS = ("log_timings", "saved_latency_every_n_steps", "peak_flops")


def parse_settings(
    cfg_profiler: DictConfig | None, default_output_dir: str, **top_level: Any
) -> ProfilerSettings:
    """Read the ``profiler`` section (torchtune's keys only), naming any key it does not know."""
    values = {} if cfg_profiler is None else OmegaConf.to_container(cfg_profiler, resolve=True)
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


class _PhaseClock:
    """Accumulates the time of each phase since the last read, without host syncs on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host_ms = dict.fromkeys(PHASES, 0.0)
        self._events: dict[str, list[tuple[Any, Any]]] = {phase: [] for phase in PHASES}
        self.run_ms = dict.fromkeys(PHASES, 0.0)  # every read so far, for the end-of-run report

    @contextlib.contextmanager
    def time(self, phase: str, on_host: bool = False) -> Iterator[None]:
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
        self._host_ms = dict.fromkeys(PHASES, 0.0)
        for phase, ms in totals.items():
            self.run_ms[phase] += ms
        return totals


@dataclasses.dataclass(frozen=True)
class SavedLatencySample:
    """One timed sample of the gradient pass, on a subset of the gradients."""

    step: int
    measured_ms: float  # the pass over the subset alone
    num_elements: int  # gradient elements the subset holds
    num_tensors: int
    total_elements: int  # what stock's full pass scales
    total_tensors: int

    @property
    def estimate_ms(self) -> float:
        """The full pass, scaled up from the subset by element count; see [saved latency]."""
        return self.measured_ms * self.total_elements / self.num_elements


@dataclasses.dataclass(frozen=True)
class SavedLatency:
    """The run's saved-latency figure: the samples' median and range."""

    samples: tuple[SavedLatencySample, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(s.estimate_ms for s in self.samples)

    @property
    def low_ms(self) -> float:
        return min(s.estimate_ms for s in self.samples)

    @property
    def high_ms(self) -> float:
        return max(s.estimate_ms for s in self.samples)

    @property
    def too_noisy(self) -> bool:
        """The range is wider than ``SAVED_LATENCY_MAX_SPREAD`` times the median."""
        return self.high_ms - self.low_ms > SAVED_LATENCY_MAX_SPREAD * self.median_ms

    @property
    def element_share(self) -> float:
        """The samples' mean share of the gradient elements."""
        return statistics.fmean(s.num_elements / s.total_elements for s in self.samples)

    @property
    def tensor_share(self) -> float:
        """The samples' mean share of the gradient tensors."""
        return statistics.fmean(s.num_tensors / s.total_tensors for s in self.samples)

    @property
    def num_full_passes(self) -> float:
        """Elements the samples scaled in all, in full passes (stock runs one per step)."""
        return sum(s.num_elements / s.total_elements for s in self.samples)

    def describe(self) -> str:
        return (
            f"median of {len(self.samples)} samples, range {self.low_ms:.2f} to "
            f"{self.high_ms:.2f} ms; each timed the pass on {self.element_share:.0%} of the "
            f"gradient elements ({self.tensor_share:.0%} of the tensors) and scaled it up"
        )

    def warning(self) -> str | None:
        if not self.too_noisy:
            return None
        return (
            f"the saved-latency samples range from {self.low_ms:.2f} to {self.high_ms:.2f} ms "
            f"around a median of {self.median_ms:.2f} ms, wider than the median itself: the "
            "machine was busy or the pass is too short to time here, so the figure means little."
        )


class TrainingProfiler:
    """The profiler hook; create with :func:`setup_profiler`, enter once around training."""

    def __init__(
        self,
        settings: ProfilerSettings,
        device: torch.device,
        model: nn.Module,
        micro_batching: str = "fixed",
        metric_logger: Any = None,
    ) -> None:
        self.settings = settings
        self._micro_batching = micro_batching  # named in the end-of-run padding line
        self._device = device
        self._clock = _PhaseClock(device)
        self._flops_per_token = model_flops_per_token(model)
        self._peak_flops = settings.peak_flops or device_peak_flops(device)
        # With log_timings off the hook stays silent: no scalars, no report.
        self._report = ReportFile.for_logger(metric_logger) if settings.log_timings else None
        self._trace: torch.profiler.profile | None = None
        self._step = 0
        self._steps_since_read = 0
        self._tokens_since_read = 0
        self._num_positions = 0  # over the run
        self._padding = PaddingMeter()
        self._t_last_read = time.perf_counter()
        self._saved: list[SavedLatencySample] = []
        self._step_ms_total = 0.0
        self._t_last_step = time.perf_counter()
        self._recording_memory = False
        self._trace_paths: list[Path] = []
        self._snapshot_paths: list[Path] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> TrainingProfiler:
        self._t_last_read = self._t_last_step = time.perf_counter()
        self._start_memory_history()
        if self.settings.enabled:
            self._trace = self._start_trace()
        if self._report is not None:
            self._report.write_layout(report_layout())
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            self._dump_memory_snapshot("oom_memory_snapshot.pickle")
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
        if self._trace is not None:
            self._trace.stop()
            self._trace = None
        if exc is None and self._report is not None:
            self._report.write_text(self.report_markdown(), step=self._step)
        # never swallow the exception: returning None re-raises it

    def _start_trace(self) -> torch.profiler.profile:
        s = self.settings
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
        path = Path(self.settings.output_dir) / f"trace_step_{self._step}.json"
        prof.export_chrome_trace(str(path))
        self._trace_paths.append(path)
        log.info(f"Profiler trace written to {path} (open it at https://ui.perfetto.dev)")
        self._dump_memory_snapshot(f"memory_snapshot_step_{self._step}.pickle")

    def _start_memory_history(self) -> None:
        """With ``profile_memory`` on CUDA, record allocations from the start (for snapshots)."""
        if self.settings.profile_memory and self._device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._recording_memory = True

    def _dump_memory_snapshot(self, name: str) -> None:
        if not self._recording_memory:
            return
        path = Path(self.settings.output_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        self._snapshot_paths.append(path)
        log.info(
            f"CUDA memory snapshot written to {path} (open it at https://pytorch.org/memory_viz)"
        )

    # -- per step ----------------------------------------------------------------------------

    def timed(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from ``iterable``, timing each fetch as the ``data`` phase (host time)."""
        iterator = iter(iterable)
        while True:
            with self._labelled("data", self._clock.time("data", on_host=True)):
                item = next(iterator, _END)
            if item is _END:
                return
            yield item

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a block as ``forward``, ``backward`` or ``optimizer`` (and label it in traces)."""
        timer = self._clock.time(name) if self.settings.log_timings else contextlib.nullcontext()
        return self._labelled(name, timer)

    def _labelled(
        self, name: str, inner: contextlib.AbstractContextManager[None]
    ) -> contextlib.AbstractContextManager[None]:
        """``inner``, inside a trace region ``exactga/<name>`` while a trace is recording."""
        if self._trace is None:
            return inner
        return _within(torch.profiler.record_function(f"exactga/{name}"), inner)

    @property
    def saved_ms_samples(self) -> list[float]:
        """Every sample's estimate of the full gradient-scaling pass, in milliseconds."""
        return [sample.estimate_ms for sample in self._saved]

    @property
    def saved_latency(self) -> SavedLatency | None:
        """The samples so far, as median and range; ``None`` before the first."""
        return SavedLatency(tuple(self._saved)) if self._saved else None

    def sample_gradient_pass(self, model: nn.Module) -> None:
        """On sampled steps, time the gradient pass exact mode avoids; see [saved latency]."""
        index = self._saved_latency_sample_index(self._step + 1)
        if index is None:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return  # optimizer_in_bwd consumed the gradients: nothing to scale
        subset = sample_gradients(grads, index)
        if not subset:
            return  # no gradient tensor fits the sample's budget (a one-tensor model)
        with self._labelled("saved_latency_sample", contextlib.nullcontext()):
            measured_ms = time_scaling_pass(subset, self._device)
        self._saved.append(
            SavedLatencySample(
                step=self._step + 1,
                measured_ms=measured_ms,
                num_elements=sum(g.numel() for g in subset),
                num_tensors=len(subset),
                total_elements=sum(g.numel() for g in grads),
                total_tensors=len(grads),
            )
        )

    def _saved_latency_sample_index(self, step: int) -> int | None:
        """Which sample step ``step`` takes (0, 1, ...), or ``None``; see [saved latency]."""
        every = self.settings.saved_latency_every_n_steps
        if not self.settings.log_timings or every == 0:
            return None
        offset = step - SAVED_LATENCY_FIRST_STEP
        if offset < 0 or offset % every:
            return None
        index = offset // every
        return index if index < SAVED_LATENCY_NUM_SAMPLES else None

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
        if self._trace is not None:
            self._trace.step()

    def metrics(self) -> dict[str, float]:
        """Scalars for the steps since the last call; the only device read of the hook."""
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
        metrics["time/step_ms"] = step_ms
        tokens_per_second = self._tokens_since_read / elapsed_s
        metrics["throughput/tokens_per_second"] = tokens_per_second
        metrics.update(self._padding.read_interval(elapsed_s))
        if self._peak_flops:
            metrics["throughput/mfu"] = tokens_per_second * self._flops_per_token / self._peak_flops
        saved = self.saved_latency
        if saved is not None:
            metrics["normalization/saved_ms"] = saved.median_ms
            metrics["normalization/saved_fraction"] = saved.median_ms / step_ms
        self._steps_since_read = 0
        self._tokens_since_read = 0
        self._t_last_read = time.perf_counter()
        return metrics

    # -- end of run --------------------------------------------------------------------------

    def summary(self) -> str:
        """Lines for the end of the run: the saved latency, and the padding."""
        padding = self._padding.summary(self._micro_batching)
        return self._saved_latency_summary() + (f"\n{padding}" if padding else "")

    def _mean_step_ms(self) -> float | None:
        return self._step_ms_total / self._step if self._step and self._step_ms_total else None

    def _saved_latency_summary(self) -> str:
        saved, step_ms = self.saved_latency, self._mean_step_ms()
        if saved is None or step_ms is None:
            return "exactga: no gradient-scaling pass was timed in this run."
        median = saved.median_ms
        line = (
            f"exactga: skipping the gradient-scaling pass saved {median:.2f} ms per optimizer "
            f"step ({100 * median / step_ms:.1f}% of {step_ms:.1f} ms; {saved.describe()}), "
            f"about {median * self._step / 1e3:.1f} s over {self._step} steps."
        )
        warning = saved.warning()
        return line + (f"\nexactga: warning: {warning}" if warning else "")

    def report_markdown(self) -> str:
        """The end-of-run report for TensorBoard's TEXT tab: the saved latency, throughput, MFU,
        padding, the phases, and where the traces and memory snapshots are."""
        title = "## exactga profiling report"
        step_ms = self._mean_step_ms()
        if step_ms is None:
            return f"{title}\n\nNo optimizer step completed."
        paragraphs = [
            title,
            f"{self._step} optimizer steps, {step_ms:.2f} ms per step on average "
            "(host wall time, from the start of training).",
        ]
        saved = self.saved_latency
        if saved is None:
            paragraphs.append("**Saved latency**: no gradient-scaling pass was timed in this run.")
        else:
            steps = ", ".join(str(s.step) for s in saved.samples)
            paragraphs.append(
                f"**Saved latency** (the gradient-scaling pass exact mode skips): "
                f"**{saved.median_ms:.2f} ms** per step, {100 * saved.median_ms / step_ms:.1f}% "
                f"of the step ({saved.describe()}; sampled at steps {steps}). The samples "
                f"scaled {saved.num_full_passes:.2f} full passes' worth of elements in all; "
                f"stock torchtune scales {self._step}."
            )
            warning = saved.warning()
            if warning:
                paragraphs.append(f"> **Warning**: {warning}")
        tokens_per_second = self._num_positions / (self._step_ms_total / 1e3)
        paragraphs.append(
            f"**Throughput**: {tokens_per_second:,.0f} tokens per second processed on this rank "
            "(padding included)."
        )
        if self._peak_flops:
            mfu = tokens_per_second * self._flops_per_token / self._peak_flops
            paragraphs.append(f"**MFU**: {100 * mfu:.2f}% of {self._peak_flops:.3g} FLOP/s.")
        else:
            paragraphs.append(
                f"**MFU**: not measured: no peak FLOP/s is known for {self._device.type}; "
                "set `peak_flops`."
            )
        padding = self._padding.summary(self._micro_batching)
        if padding:
            paragraphs.append(f"**Padding**: {padding.removeprefix('exactga: ')}")
        paragraphs.append(self._phase_table(step_ms))
        traces = _path_list(self._trace_paths, "none (`profiler.enabled: False`)")
        snapshots = _path_list(
            self._snapshot_paths, "none (CUDA with `profiler.profile_memory: True` only)"
        )
        paragraphs += [
            "\n".join(["**Traces** (open at https://ui.perfetto.dev):", *traces]),
            "\n".join(
                ["**Memory snapshots** (open at https://pytorch.org/memory_viz):", *snapshots]
            ),
        ]
        return "\n\n".join(paragraphs)

    def _phase_table(self, step_ms: float) -> str:
        """The run's mean time per step in each phase, as a markdown table."""
        if not self.settings.log_timings:
            return "Phase timings are off (`log_timings: False`)."
        self._clock.read_ms()  # the steps after the last logged one
        phase_ms = {phase: ms / self._step for phase, ms in self._clock.run_ms.items()}
        other_ms = step_ms - sum(phase_ms.values())
        rows = ["| phase | ms per step | share of the step |", "|---|---|---|"]
        for name, ms in [*phase_ms.items(), ("other", other_ms), ("**step**", step_ms)]:
            rows.append(f"| {name} | {ms:.2f} | {100 * ms / step_ms:.1f}% |")
        note = "*other*: the scheduler, logging, checkpoints and the sampled gradient pass."
        return "\n".join(rows) + f"\n\n{note}"


_END = object()


@contextlib.contextmanager
def _within(
    outer: contextlib.AbstractContextManager[Any], inner: contextlib.AbstractContextManager[None]
) -> Iterator[None]:
    with outer, inner:
        yield


def _path_list(paths: list[Path], none: str) -> list[str]:
    return [f"- `{path}`" for path in paths] if paths else [f"- {none}"]


def report_layout() -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout of the report (TensorBoard's CUSTOM SCALARS tab).

    Tags are regular expressions over the logged scalar tags. tokens/s and the two fractions
    get separate charts: on one axis the fractions would lie flat along zero.
    """
    return {
        REPORT_CATEGORY: {
            "step phases, stacked: data, +forward, +backward, +optimizer; and the step (ms)": [
                "Multiline",
                [r"time/stacked_\d_\w+_ms", r"time/step_ms"],
            ],
            "saved latency vs step time (ms)": [
                "Multiline",
                [r"normalization/saved_ms", r"time/step_ms"],
            ],
            "throughput (tokens/s)": [
                "Multiline",
                [r"throughput/tokens_per_second", r"throughput/loss_tokens_per_second"],
            ],
            "MFU and padding fraction": [
                "Multiline",
                [r"throughput/mfu", r"throughput/padding_fraction"],
            ],
        }
    }


# Note [profiling report file]
# The report (the custom-scalars layout and the markdown summary) is written to an event file of
# its own, ``<log_dir>/profiling_report/exactga_report.tfevents.<time>.<host>.<pid>``, not into
# the logger's. TensorBoard loads any file whose name holds ``tfevents`` and shows the folder
# as a run of its own (layouts apply to every run). The common way of reading scalars back,
# ``rglob("events.out.tfevents.*")`` and every tensor summary read as a number, which our tests,
# tools and benchmarks use and users' scripts likely do too, would choke on a text or layout
# summary in the logger's file; this name keeps them out of it. A sub-folder rather than a second
# file beside the logger's: TensorBoard's Python loader reads a run's files in name order and
# stops reading earlier ones once it moves on, so a live dashboard would stop updating.


@dataclasses.dataclass
class ReportFile:
    """The event file of the profiling report; see [profiling report file]."""

    path: Path

    @classmethod
    def for_logger(cls, metric_logger: Any) -> ReportFile | None:
        """The report's file for torchtune's ``TensorBoardLogger`` on rank 0, else ``None``
        (other loggers, disk or stdout or W&B, and other ranks get no report)."""
        from torchtune.training.metric_logging import TensorBoardLogger

        if not isinstance(metric_logger, TensorBoardLogger) or utils.get_world_size_and_rank()[1]:
            return None
        name = f"exactga_report.tfevents.{int(_wall_clock_s())}.{socket.gethostname()}"
        return cls(Path(metric_logger.log_dir) / REPORT_RUN / f"{name}.{os.getpid()}")

    def write_layout(self, layout: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import custom_scalars

        self.write(custom_scalars(layout), step=0)

    def write_text(self, markdown: str, step: int) -> None:
        from torch.utils.tensorboard.summary import text

        self.write(text(REPORT_TAG, markdown), step=step)

    def write(self, summary: Any, step: int) -> None:
        """Append one summary as an event (the file starts with TensorBoard's version event)."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        events = [Event(wall_time=_wall_clock_s(), step=step, summary=summary)]
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            events.insert(0, Event(wall_time=_wall_clock_s(), file_version="brain.Event:2"))
        with open(self.path, "ab") as f:
            writer = RecordWriter(f)
            for event in events:
                writer.write(event.SerializeToString())


def read_reports(log_root: str | os.PathLike[str]) -> dict[Path, dict[str, Any]]:
    """The profiling reports under ``log_root``, by their folder: each a dict with ``layout``
    (the custom-scalars layout as written, or ``None``) and ``markdown`` (the summary, or
    ``None`` if the run did not end)."""
    from google.protobuf import json_format
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    reports = {}
    for folder in sorted(Path(log_root).rglob(REPORT_RUN)):
        events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
        events.Reload()
        tags = events.Tags()["tensors"]
        report: dict[str, Any] = {"layout": None, "markdown": None}
        if "custom_scalars__config__" in tags:
            layout = layout_pb2.Layout()
            layout.ParseFromString(
                events.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0]
            )
            report["layout"] = json_format.MessageToDict(layout)
        if f"{REPORT_TAG}/text_summary" in tags:
            text = events.Tensors(f"{REPORT_TAG}/text_summary")[-1].tensor_proto.string_val[0]
            report["markdown"] = text.decode()
        reports[folder] = report
    return reports


def sample_gradients(
    grads: list[torch.Tensor], sample_index: int, fraction: float = SAVED_LATENCY_FRACTION
) -> list[torch.Tensor]:
    """The gradients sample ``sample_index`` scales: every ``1/fraction``-th tensor, from an
    offset that rotates with the sample, skipping any that would take the sample past
    ``fraction`` of the elements. See [saved latency].

    If none of those fits, the smallest tensor that does; if none does at all, nothing.
    """
    budget = fraction * sum(g.numel() for g in grads)
    stride = max(1, round(1 / fraction))
    chosen: list[torch.Tensor] = []
    num_elements = 0
    for grad in grads[sample_index % stride :: stride]:
        if num_elements + grad.numel() <= budget:
            chosen.append(grad)
            num_elements += grad.numel()
    if not chosen:
        smallest = min(grads, key=lambda g: g.numel(), default=None)
        if smallest is not None and smallest.numel() <= budget:
            chosen = [smallest]
    return chosen


def scale_gradients(grads: list[torch.Tensor], scaler: torch.Tensor) -> None:
    """Stock torchtune's ``scale_grads`` over ``grads``: one in-place multiply per tensor."""
    for grad in grads:
        grad *= scaler


def time_scaling_pass(grads: list[torch.Tensor], device: torch.device) -> float:
    """Milliseconds of stock's gradient-scaling pass over ``grads``, by a factor of exactly 1
    (no gradient changes); the device is synchronised around it. Stock's one copy of the
    factor to the device is left out: a fixed cost, which scaling up would multiply."""
    scaler = torch.tensor(1.0, device=device)
    _synchronize(device)
    t0 = time.perf_counter()
    scale_gradients(grads, scaler)
    _synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def time_gradient_pass(model: nn.Module, device: torch.device) -> float:
    """Milliseconds of stock torchtune's gradient-scaling pass over all of ``model``'s
    gradients (the benchmarks' reference; the recipes sample, see [saved latency]).

    The factor is 1, so no gradient changes; the device is synchronised around the pass.
    """
    _synchronize(device)
    t0 = time.perf_counter()
    gradient_scaling_pass(model, 1.0)
    _synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token: matmul weights, plus attention scores.

    Each matmul weight costs 2 FLOPs per token forward and 2 for the input gradient; 2 more for
    its own gradient when it trains (``6 * params`` for full fine-tuning, about ``4 * params``
    for LoRA). An untied input embedding is a lookup, not a matmul, and is left out (a tied one
    is the output projection). The attention term (``12 * layers * dim * context``, PaLM
    appendix B) uses the model's ``max_seq_len`` as context, an upper bound for padded batches.
    """
    lookup_only = _untied_embedding(model)
    params = [p for p in model.parameters() if p is not lookup_only]
    num_params = sum(p.numel() for p in params)
    num_trainable = sum(p.numel() for p in params if p.requires_grad)
    layers = getattr(model, "layers", None)
    embed = getattr(model, "tok_embeddings", None)
    context = getattr(model, "max_seq_len", None)
    attention = 0.0
    if layers is not None and embed is not None and context is not None:
        attention = 12.0 * len(layers) * embed.embedding_dim * context
    return 4.0 * num_params + 2.0 * num_trainable + attention


def _untied_embedding(model: nn.Module) -> torch.Tensor | None:
    """The input embedding's weight when the output projection has weights of its own."""
    embed, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    # torchtune's TiedLinear is a plain object over the embedding, not a module with weights.
    if embed is None or not isinstance(output, nn.Module):
        return None
    if next(output.parameters(), None) is None:
        return None
    return embed.weight


def device_peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known CUDA device, else None (MFU is then not logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, flops in PEAK_FLOPS_BF16.items():
        if fragment in name:
            return flops
    return None


def setup_profiler(
    cfg: DictConfig, device: torch.device, model: nn.Module, metric_logger: Any = None
) -> TrainingProfiler:
    """The recipe's profiler hook from a validated recipe config.

    Reads the ``profiler`` section (may be absent), ``output_dir``, ``micro_batching`` and the
    top-level ``log_timings``, ``saved_latency_every_n_steps`` and ``peak_flops``. Pass the
    recipe's ``metric_logger`` (``None`` on ranks without one) for the TensorBoard report:
    its layout is written on entering the hook, its summary on leaving it.
    """
    top_level = {key: cfg[key] for key in TOP_LEVEL_KEYS if key in cfg}
    settings = parse_settings(cfg.get("profiler"), cfg.output_dir, **top_level)
    return TrainingProfiler(
        settings, device, model, micro_batching=cfg.micro_batching, metric_logger=metric_logger
    )
