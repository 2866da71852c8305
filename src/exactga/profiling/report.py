"""The TensorBoard report: a custom-scalars layout when training starts, the charts' lines at
every logged step, a summary when it ends.

Written only when the recipe's ``metric_logger`` is torchtune's ``TensorBoardLogger`` (other
loggers get no report and no error), into event files of its own (see [profiling report file]):
the layout (CUSTOM SCALARS tab: where a step's time goes, what exact mode saves, throughput,
MFU, what was processed; see [report charts]), the charts' lines, and a markdown summary (TEXT
tab).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from time import time as _wall_clock_s  # a date for events; durations use time.perf_counter
from typing import IO, Any

from exactga.profiling.saved_latency import SavedLatency, percent_of

# The report: its text's tag (TEXT tab) and its layout's category (CUSTOM SCALARS).
REPORT_TAG = "exactga/profiling_report"
REPORT_CATEGORY = "exactga profiling"
REPORT_RUN = "profiling_report"  # its folder in the logger's; see [profiling report file]
# The group of the charts' lines in the TIME SERIES and SCALARS tabs: "~" sorts after every
# letter, so the group comes last, collapsed (see [dashboard order] in
# exactga.run.metric_logging); the CUSTOM SCALARS tab is where they are read.
REPORT_LINES = "~report_lines"

# Note [report charts]
# TensorBoard colours a line by its *run*, never by its tag: the CUSTOM SCALARS cards look a
# series' colour up by the run in its name (``tag (run)``, the run parsed back out of the
# parentheses), and a run's colour is the palette's (7 colours) at the run's index in the run
# list, which is sorted by start time (the first event's wall time), then by name; TIME SERIES
# colours by run too. So the tags of one run, drawn in one chart, share a colour, and a stacked
# chart of n bands needs n runs. A margin chart also takes one series only: with several, its
# card warns about "missing tags" for every run that lacks some of them (all runs but one).
# The fewest runs that give each band its colour: band 1 of every stack is the report's own run
# (``<log_dir>/profiling_report``, which also draws the single-line charts), band n > 1 is the
# run ``profiling_report/band_<n>``, shared by the stacks (the phases' band 2, forward, and the
# positions' band 2, the samples, are two tags of one run). Every report file starts with the
# same wall time, so these runs sort by name, next to each other, and up to 7 bands get 7
# colours: 4 helper runs beside the report's for the 5 bands of the phases, 5 with a recipe's
# own phase (GRPO's generate). The charts' titles name the bands from the bottom, since the
# runs' names cannot. The hook writes the lines at each logged step; they repeat what the
# recipe logs in its own run, whose tags stay as they are.
# Each chart is a *margin* chart (a line and a band around it, filled), built so that no line
# runs off it under "Ignore outliers in chart scaling", which is on by default and which no
# layout field can turn off: TensorBoard fits the y axis to the 5 % to 95 % quantiles of all the
# chart's values (the bands' edges included), padded by 5 % of that range and rounded, and
# clips the rest. Shares that add up to the whole (the phases of a step, the kinds of position
# processed) are stacked bands from 0 to 100 %, whatever the first step took. A rate or a share
# of its own (saved latency, throughput, MFU) is the interval's value with, as its band, the
# lowest and the highest value so far: every value lies inside the band, and the band's edges
# only widen and then hold, so they fill the quantiles at both ends; a warm-up step or a traced
# one is a dip inside the band. What could still overshoot, by its excess over 5 % to 15 % of
# the axis, is a new highest (or lowest) value in about the last 5 % of the run's points (a
# machine that gets busier near the end: the demo's last throughput and saved share once). So
# when the run ends, the report's own file is rewritten with the run's lowest and highest as
# the band at every step (``ReportFile.settle_bands``): a third of the chart's values at each
# edge, every value between them, nothing off the chart. A TensorBoard already reading the file
# keeps the edges it read until it is started again; a resumed launch settles its own file.
# The CUSTOM SCALARS tab of TensorBoard 2.21 shows margin charts in the reverse of their order
# in the layout (its item list inserts each chart before the previous one's second template),
# so the layout lists them in reverse, and they show in the order of ``CHARTS``.

# key: (title, stacked). The lines of chart ``key`` carry the tags ``chart_tags(key)``.
CHARTS = {
    "phases": (
        "Where does a step's time go? The phases stacked, % of the step time, from the "
        "bottom: data, forward, backward, optimizer, a recipe's own (GRPO: generate), other "
        "(scheduler, logging, checkpoints, the sampled pass)",
        True,
    ),
    "saved": (
        "What does exact mode save? Stock's gradient-scaling pass, % of the step time "
        "(band: lowest to highest, so far while the run goes on)",
        False,
    ),
    "throughput": (
        "How fast? Tokens processed per second on this rank, padding included "
        "(band: lowest to highest, so far while the run goes on)",
        False,
    ),
    "mfu": (
        "How busy is the device? MFU, % of its peak FLOP/s "
        "(band: lowest to highest, so far while the run goes on)",
        False,
    ),
    "positions": (
        "What was processed? The positions stacked, % of them, from the bottom: loss tokens "
        "(not with DPO's pairs), the rest of the samples, padding",
        True,
    ),
}


def chart_tags(key: str) -> tuple[str, str, str]:
    """The (value, lower, upper) tags of report chart ``key``'s lines; see [report charts]."""
    if CHARTS[key][1]:  # a band of a stack: its top is the value
        return (
            f"{REPORT_LINES}/{key}_top",
            f"{REPORT_LINES}/{key}_bottom",
            f"{REPORT_LINES}/{key}_top",
        )
    return f"{REPORT_LINES}/{key}", f"{REPORT_LINES}/{key}_lowest", f"{REPORT_LINES}/{key}_highest"


def report_layout(mfu: bool = True) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout of the report (CUSTOM SCALARS tab), as
    ``torch.utils.tensorboard.summary.custom_scalars`` takes it: a margin chart a key of
    :data:`CHARTS` (the MFU chart only with ``mfu``), in reverse. See [report charts]."""
    charts = {
        title: ["Margin", list(chart_tags(key))]
        for key, (title, _) in reversed(CHARTS.items())
        if mfu or key != "mfu"
    }
    return {REPORT_CATEGORY: charts}


class ReportCharts:
    """The report charts' lines, logged interval by logged interval; see [report charts]."""

    def __init__(self) -> None:
        self._ranges: dict[str, tuple[float, float]] = {}  # lowest and highest so far

    def lines(self, metrics: dict[str, float], phases: list[str]) -> dict[str, dict[str, float]]:
        """The lines for one logged interval, from the hook's ``metrics``: run (``""`` for the
        report's own, else ``band_<n>``) to its tags' values. ``phases`` in stacking
        order: the training phases, then a recipe's own."""
        lines: dict[str, dict[str, float]] = {}
        step_ms = metrics["time/step_ms"]
        if step_ms > 0:
            shares, total = [], 0.0
            for phase in phases:
                total += 100 * metrics[f"time/{phase}_ms"] / step_ms
                shares.append((phase, total))
            # On CUDA the phases are device time and the step is host time: they may exceed it.
            _stack(lines, "phases", [*shares, ("other", max(total, 100.0))])
        if "normalization/saved_fraction" in metrics:
            self._band(lines, "saved", 100 * metrics["normalization/saved_fraction"])
        self._band(lines, "throughput", metrics["throughput/tokens_per_second"])
        if "throughput/mfu" in metrics:
            self._band(lines, "mfu", 100 * metrics["throughput/mfu"])
        if "throughput/padding_fraction" in metrics:
            kinds = []
            if "throughput/loss_tokens_per_second" in metrics:  # not with pairs as units (DPO)
                processed = metrics["throughput/tokens_per_second"]
                loss_tokens = metrics["throughput/loss_tokens_per_second"]
                kinds.append(("loss_tokens", 100 * loss_tokens / processed if processed else 0.0))
            kinds.append(("sample_tokens", 100 * (1 - metrics["throughput/padding_fraction"])))
            _stack(lines, "positions", [*kinds, ("padding", 100.0)])
        return lines

    def run_bands(self) -> dict[str, float]:
        """The single-line charts' band edges over the run so far, tag to value: each chart's
        lowest and highest value (``ReportFile.settle_bands`` writes them at the end)."""
        edges = {}
        for key, (lowest, highest) in self._ranges.items():
            _, lower, upper = chart_tags(key)
            edges[lower], edges[upper] = lowest, highest
        return edges

    def _band(self, lines: dict[str, dict[str, float]], key: str, value: float) -> None:
        lowest, highest = self._ranges.get(key, (value, value))
        self._ranges[key] = lowest, highest = min(lowest, value), max(highest, value)
        tags = chart_tags(key)
        lines.setdefault("", {}).update(zip(tags, (value, lowest, highest), strict=True))


def band_run(number: int) -> str:
    """The run of band ``number`` (from 1 at the bottom) of every stacked report chart, relative
    to the report's: its own for the first; see [report charts]."""
    return "" if number == 1 else f"band_{number}"


def _stack(lines: dict[str, dict[str, float]], key: str, tops: list[tuple[str, float]]) -> None:
    """Stacked bands, one run each, from 0 up: ``tops`` are their (name, upper edge) in order
    (the names are the chart title's; the runs are numbered)."""
    top_tag, bottom_tag, _ = chart_tags(key)
    bottom = 0.0
    for number, (_, top) in enumerate(tops, start=1):
        lines.setdefault(band_run(number), {}).update({top_tag: top, bottom_tag: bottom})
        bottom = top


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
    compilations: str = ""  # the end-of-run torch.compile line, or "" with compile off


def report_markdown(run: RunFigures | None) -> str:
    """The end-of-run report for TensorBoard's TEXT tab (``None``: no step completed), short
    enough for the TEXT card (500 pixels high) not to scroll much: the warning on the saved
    latency, if any; a table of the phases and the step; one of the saved latency,
    throughput, MFU, padding, traces and snapshots; the details of the saved latency and
    padding below it.

    The tables' cells are short on purpose: the card breaks words anywhere, so a long cell
    squeezes the other columns to a few letters. (TensorBoard's markdown also needs a blank
    line before a table or a list.)
    """
    title = "**exactga profiling report**"
    if run is None:
        return f"{title}: no optimizer step completed."
    step_ms = run.step_ms
    saved = run.saved
    rows = ["| run figure | value | what it is |", "|---|---|---|"]
    details = []
    if saved is None:
        rows.append("| **saved** | none | no gradient-scaling pass was timed in this run |")
    else:
        if saved.figure_ms is None:  # too few samples, or samples that disagree
            rows.append("| **saved** | not given | see the warning above |")
        else:
            rows.append(
                f"| **saved** | **{saved.figure_ms:.2f} ms** a step | "
                f"**{percent_of(saved.figure_ms, step_ms)}** of the step: stock's "
                "gradient-scaling pass, which exact mode skips |"
            )
        steps = ", ".join(str(s.step) for s in saved.samples)
        details.append(
            f"**Saved latency**: the {saved.describe()}; at steps {steps}; "
            f"{saved.num_full_passes:.2f} full passes' worth of elements in all (stock "
            f"torchtune: {run.num_steps})."
        )
    rows.append(
        f"| throughput | {run.tokens_per_second:,.0f} tokens/s | processed on this rank, "
        "padding included |"
    )
    if run.peak_flops:
        mfu = run.tokens_per_second * run.flops_per_token / run.peak_flops
        rows.append(f"| MFU | {100 * mfu:.2f}% | of {run.peak_flops:.3g} FLOP/s |")
    else:
        rows.append(
            f"| MFU | not measured | no peak FLOP/s is known for {run.device_type}: "
            "set `peak_flops` |"
        )
    if run.padding:
        share, _, what = run.padding.removeprefix("exactga: padding was ").partition(" ")
        what, _, more = what.partition("; ")
        rows.append(f"| padding | {share} | {what.removesuffix('.')} |")
        if more:
            details.append(f"**Padding**: {more}")
    if run.compilations:
        compiled = run.compilations.removeprefix("exactga: torch.compile: ")
        details.append(f"**torch.compile**: {compiled}")
    rows.append(_path_row("traces", run.trace_paths, "https://ui.perfetto.dev"))
    rows.append(
        _path_row(
            "memory snapshots",
            run.snapshot_paths,
            "https://pytorch.org/memory_viz",
            none="CUDA with `profiler.profile_memory: True` only",
        )
    )
    paragraphs = [
        f"{title}: {run.num_steps} optimizer steps (host wall time from the start of training; "
        "*other*: scheduler, logging, checkpoints, sampled pass)"
    ]
    warning = saved.warning() if saved is not None else None
    if warning:  # first, where the card shows it without scrolling
        paragraphs.append(f"> **Warning**: {warning}")
    paragraphs += [_phase_table(run.phase_ms, step_ms), "\n".join(rows)]
    if details:
        paragraphs.append(" ".join(details))
    return "\n\n".join(paragraphs)


def _phase_table(phase_ms: dict[str, float] | None, step_ms: float) -> str:
    """The run's mean time per step in each phase, the rest and the step: a phase a column."""
    if phase_ms is None:
        return f"Phase timings are off (`log_timings: False`); the step: {step_ms:.2f} ms."
    columns = {**phase_ms, "other": step_ms - sum(phase_ms.values())}
    names = [*columns, "**step**"]
    ms = [f"{value:.2f}" for value in columns.values()] + [f"**{step_ms:.2f}**"]
    shares = [f"{100 * value / step_ms:.1f}%" for value in columns.values()] + ["100%"]
    return "\n".join(
        "| " + " | ".join(cells) + " |"
        for cells in [
            ["mean per step", *names],
            ["---"] * (len(names) + 1),
            ["ms", *ms],
            ["share of the step", *shares],
        ]
    )


def _path_row(name: str, paths: list[Path], viewer: str, none: str = "") -> str:
    if not paths:
        return f"| {name} | none | {none or '`profiler.enabled: False`'} |"
    listed = "<br>".join(f"`{path}`" for path in paths)
    return f"| {name} | {len(paths)} | {listed} (open at {viewer}) |"


# Note [profiling report file]
# The report (the custom-scalars layout, the charts' lines and the markdown summary) is written
# to event files of its own, ``<log_dir>/profiling_report/exactga_report.tfevents.<time>.<host>.
# <pid>`` and one of that name in each band's run (``profiling_report/band_<n>``, see [report
# charts]), not into the logger's. TensorBoard loads any file whose name holds ``tfevents`` and
# shows each folder as a run of its own (layouts apply to every run). The common way of reading
# scalars back, ``rglob("events.out.tfevents.*")`` and every tensor summary read as a number,
# which our tests, tools and benchmarks use and users' scripts likely do too, would choke on a
# text or layout summary in the logger's file, and would read the chart lines twice; this name
# keeps them out of it. Sub-folders rather than a second file beside the logger's: TensorBoard's
# Python loader reads a run's files in name order and stops reading earlier ones once it moves
# on, so a live
# dashboard would stop updating.


@dataclasses.dataclass
class ReportFile:
    """The event files of the profiling report; see [profiling report file]."""

    path: Path
    # Every file's first event carries this wall time, so that TensorBoard sorts the report's
    # runs by name; see [report charts].
    started_s: float = dataclasses.field(default_factory=_wall_clock_s)
    _files: dict[Path, IO[bytes]] = dataclasses.field(default_factory=dict, repr=False)

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
        self.flush()

    def write_lines(self, lines: dict[str, dict[str, float]], step: int) -> None:
        """Write the report charts' lines (``ReportCharts.lines``), each into its run."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        for run, values in lines.items():
            summary = Summary(
                value=[Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()]
            )
            self.write(summary, step=step, run=run)
        self.flush()

    def write_text(self, markdown: str, step: int) -> None:
        from torch.utils.tensorboard.summary import text

        self.write(text(REPORT_TAG, markdown), step=step)
        self.flush()

    def write(self, summary: Any, step: int, run: str = "") -> None:
        """Append one summary as an event to the report's file, or to that of its run ``run``
        (each file starts with TensorBoard's version event)."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        path = self.path.parent / run / self.path.name if run else self.path
        events = [Event(wall_time=_wall_clock_s(), step=step, summary=summary)]
        if path not in self._files:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                events.insert(0, Event(wall_time=self.started_s, file_version="brain.Event:2"))
            self._files[path] = open(path, "ab")  # noqa: SIM115 (closed by close())
        writer = RecordWriter(self._files[path])
        for event in events:
            writer.write(event.SerializeToString())

    def settle_bands(self, edges: dict[str, float]) -> None:
        """Close the files and rewrite the report's own with the band edges ``edges`` (tag to
        value, ``ReportCharts.run_bands``) at every step, atomically; see [report charts]."""
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.close()
        if not edges or not self.path.exists():
            return
        events = [Event.FromString(r) for r in RawEventFileLoader(str(self.path)).Load()]
        for event in events:
            for value in event.summary.value:
                if value.tag in edges:
                    value.simple_value = edges[value.tag]
        partial = self.path.with_name(f".{self.path.name}.partial")  # TensorBoard skips it
        with open(partial, "wb") as out:
            writer = RecordWriter(out)
            for event in events:
                writer.write(event.SerializeToString())
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.path)

    def flush(self) -> None:
        """Hand what was written to the files' readers (a live TensorBoard)."""
        for file in self._files.values():
            file.flush()

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
