"""The TensorBoard report: a custom-scalars layout when training starts, a summary when it ends.

Written only when the recipe's ``metric_logger`` is torchtune's ``TensorBoardLogger`` (other
loggers get no report and no error): the layout (CUSTOM SCALARS tab: the phases stacked, saved
latency versus step time, throughput, MFU and padding) and a markdown summary (TEXT tab), in an
event file of their own; see [profiling report file].
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from time import time as _wall_clock_s  # a date for events; durations use time.perf_counter
from typing import Any

from exactga.profiling.saved_latency import SavedLatency

# The report: its text's tag (TEXT tab) and its layout's category (CUSTOM SCALARS).
REPORT_TAG = "exactga/profiling_report"
REPORT_CATEGORY = "exactga profiling"
REPORT_RUN = "profiling_report"  # its folder in the logger's; see [profiling report file]


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


@dataclasses.dataclass(frozen=True)
class RunFigures:
    """What the end-of-run summary tells, as the profiler hook measured it."""

    num_steps: int
    step_ms: float  # mean per optimizer step, host wall time from the start of training
    tokens_per_second: float  # processed on this rank, padding included
    saved: SavedLatency | None
    flops_per_token: float
    peak_flops: float | None
    device_type: str
    padding: str  # the end-of-run padding line, or "" when there is none
    phase_ms: dict[str, float] | None  # mean per step; None with log_timings off
    trace_paths: list[Path]
    snapshot_paths: list[Path]


def report_markdown(run: RunFigures | None) -> str:
    """The end-of-run report for TensorBoard's TEXT tab (``None``: no step completed): the saved
    latency, throughput, MFU, padding, the phases, and where the traces and snapshots are."""
    title = "## exactga profiling report"
    if run is None:
        return f"{title}\n\nNo optimizer step completed."
    step_ms = run.step_ms
    paragraphs = [
        title,
        f"{run.num_steps} optimizer steps, {step_ms:.2f} ms per step on average "
        "(host wall time, from the start of training).",
    ]
    saved = run.saved
    if saved is None:
        paragraphs.append("**Saved latency**: no gradient-scaling pass was timed in this run.")
    else:
        steps = ", ".join(str(s.step) for s in saved.samples)
        paragraphs.append(
            f"**Saved latency** (the gradient-scaling pass exact mode skips): "
            f"**{saved.median_ms:.2f} ms** per step, {100 * saved.median_ms / step_ms:.1f}% "
            f"of the step ({saved.describe()}; sampled at steps {steps}). The samples "
            f"scaled {saved.num_full_passes:.2f} full passes' worth of elements in all; "
            f"stock torchtune scales {run.num_steps}."
        )
        warning = saved.warning()
        if warning:
            paragraphs.append(f"> **Warning**: {warning}")
    paragraphs.append(
        f"**Throughput**: {run.tokens_per_second:,.0f} tokens per second processed on this rank "
        "(padding included)."
    )
    if run.peak_flops:
        mfu = run.tokens_per_second * run.flops_per_token / run.peak_flops
        paragraphs.append(f"**MFU**: {100 * mfu:.2f}% of {run.peak_flops:.3g} FLOP/s.")
    else:
        paragraphs.append(
            f"**MFU**: not measured: no peak FLOP/s is known for {run.device_type}; "
            "set `peak_flops`."
        )
    if run.padding:
        paragraphs.append(f"**Padding**: {run.padding.removeprefix('exactga: ')}")
    paragraphs.append(_phase_table(run.phase_ms, step_ms))
    traces = _path_list(run.trace_paths, "none (`profiler.enabled: False`)")
    snapshots = _path_list(
        run.snapshot_paths, "none (CUDA with `profiler.profile_memory: True` only)"
    )
    paragraphs += [
        "\n".join(["**Traces** (open at https://ui.perfetto.dev):", *traces]),
        "\n".join(["**Memory snapshots** (open at https://pytorch.org/memory_viz):", *snapshots]),
    ]
    return "\n\n".join(paragraphs)


def _phase_table(phase_ms: dict[str, float] | None, step_ms: float) -> str:
    """The run's mean time per step in each phase, as a markdown table."""
    if phase_ms is None:
        return "Phase timings are off (`log_timings: False`)."
    other_ms = step_ms - sum(phase_ms.values())
    rows = ["| phase | ms per step | share of the step |", "|---|---|---|"]
    for name, ms in [*phase_ms.items(), ("other", other_ms), ("**step**", step_ms)]:
        rows.append(f"| {name} | {ms:.2f} | {100 * ms / step_ms:.1f}% |")
    note = "*other*: the scheduler, logging, checkpoints and the sampled gradient pass."
    return "\n".join(rows) + f"\n\n{note}"


def _path_list(paths: list[Path], none: str) -> list[str]:
    return [f"- `{path}`" for path in paths] if paths else [f"- {none}"]


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
        """The report's file for torchtune's ``TensorBoardLogger``, else ``None`` (other
        loggers, disk or stdout or W&B, get no report). Pass the logger of the one rank that
        reports (``setup_profiler`` passes rank 0's)."""
        from torchtune.training.metric_logging import TensorBoardLogger

        if not isinstance(metric_logger, TensorBoardLogger):
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
