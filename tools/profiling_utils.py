"""Helpers around the profiler hook for the tests and the benchmarks: timing the whole
gradient-scaling pass, reading a run's TensorBoard report back, and what TensorBoard's
dashboard makes of it (run colours, the y range of a chart).

Neither is needed to train, so neither is in ``src/exactga/profiling``. It lies in tools/ so
that the benchmarks import it (``tools/`` on their path) and the tests too (``pythonpath`` in
pyproject.toml); it imports no test module.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exactga.accumulation.normalization import gradient_scaling_pass
from exactga.profiling import REPORT_RUN, REPORT_TAG
from exactga.profiling.saved_latency import synchronize


def time_gradient_pass(model: nn.Module, device: torch.device) -> float:
    """Milliseconds of stock torchtune's gradient-scaling pass over all of ``model``'s
    gradients (the benchmarks' reference; the recipes sample, see [saved latency]).

    The factor is 1, so no gradient changes; the device is synchronised around the pass.
    """
    synchronize(device)
    t0 = time.perf_counter()
    gradient_scaling_pass(model, 1.0)
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def read_reports(log_root: str | os.PathLike[str]) -> dict[Path, dict[str, Any]]:
    """The profiling reports under ``log_root``, by their folder: each a dict with ``layout``
    (the custom-scalars layout as written, or ``None``), ``markdown`` (the summary, or ``None``
    if the run did not end) and ``lines`` (the charts' lines: run, relative to the report's
    folder, ``""`` for its own, to tag to ``(step, value)`` pairs). See [profiling report file]
    and [report charts]."""
    from google.protobuf import json_format
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    reports = {}
    for folder in sorted(Path(log_root).rglob(REPORT_RUN)):
        report: dict[str, Any] = {"layout": None, "markdown": None, "lines": {}}
        for run_folder in sorted({path.parent for path in folder.rglob("*tfevents*")}):
            events = EventAccumulator(str(run_folder), size_guidance={"tensors": 0, "scalars": 0})
            events.Reload()
            tags = events.Tags()
            run = run_folder.relative_to(folder).as_posix().removeprefix(".")
            if tags["scalars"]:
                report["lines"][run] = {
                    tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags["scalars"]
                }
            if "custom_scalars__config__" in tags["tensors"]:
                config = events.Tensors("custom_scalars__config__")[-1]
                layout = layout_pb2.Layout()
                layout.ParseFromString(config.tensor_proto.string_val[0])
                report["layout"] = json_format.MessageToDict(layout)
            if f"{REPORT_TAG}/text_summary" in tags["tensors"]:
                text = events.Tensors(f"{REPORT_TAG}/text_summary")[-1]
                report["markdown"] = text.tensor_proto.string_val[0].decode()
        reports[folder] = report
    return reports


# TensorBoard 2.21's run colours (tensorboardColorBlindAssist in its frontend).
TENSORBOARD_PALETTE = ["#ff7043", "#0077bb", "#cc3311", "#33bbee", "#ee3377", "#009988", "#bbbbbb"]


def tensorboard_run_colours(log_root: str | os.PathLike[str]) -> dict[str, str]:
    """Each run's colour as TensorBoard's dashboards draw it: the runs ordered by start time
    (their first event's wall time), then name (its ``/data/runs``), the palette in that order
    (its frontend's ``ColorScale.setDomain``). A run is named by its folder relative to
    ``log_root``."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(log_root))
    runs = sorted(multiplexer.Runs(), key=lambda run: (multiplexer.FirstEventTimestamp(run), run))
    return {run: TENSORBOARD_PALETTE[i % len(TENSORBOARD_PALETTE)] for i, run in enumerate(runs)}


def tensorboard_charts(log_root: str | os.PathLike[str]) -> dict[str, list[Line]]:
    """The report's charts as TensorBoard's CUSTOM SCALARS tab draws them from every run under
    ``log_root`` (the logger's scalars and the report's): chart title to its lines. A
    multiline chart draws each scalar tag a tag pattern matches (``re.match``, as its server
    does) in each run; a margin chart each run that holds its value, lower and upper tags."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.util.tensor_util import make_ndarray

    multiplexer = EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    multiplexer.AddRunsFromDirectory(str(log_root))
    multiplexer.Reload()
    scalars: dict[str, dict[str, list[float]]] = {}
    for run, tags in multiplexer.Runs().items():
        scalars[run] = {
            tag: [e.value for e in multiplexer.Scalars(run, tag)] for tag in tags["scalars"]
        }
        for tag in tags["tensors"]:
            events = multiplexer.Tensors(run, tag)
            if not events[0].tensor_proto.string_val:  # a scalar, not a text or a layout
                scalars[run][tag] = [float(make_ndarray(e.tensor_proto)) for e in events]
    ((_, report),) = read_reports(log_root).items()
    charts: dict[str, list[Line]] = {}
    for chart in report["layout"]["category"][0]["chart"]:
        lines = charts[chart["title"]] = []
        for run, tags in sorted(scalars.items()):
            if "multiline" in chart:
                pattern = "|".join(f"({regex})" for regex in chart["multiline"]["tag"])
                lines += [
                    Line(run, tag, values) for tag, values in tags.items() if re.match(pattern, tag)
                ]
            for series in chart.get("margin", {}).get("series", []):
                bounds = [series["value"], series["lower"], series["upper"]]
                if all(tag in tags for tag in bounds):
                    lines.append(
                        Line(run, series["value"], [v for tag in bounds for v in tags[tag]])
                    )
    return charts


@dataclasses.dataclass
class Line:
    """A line of a TensorBoard chart: its run and tag, and every value the chart fits its y
    axis to for it (a margin chart's lower and upper bounds too)."""

    run: str
    tag: str
    values: list[float]


def tensorboard_y_range(values: list[float]) -> tuple[float, float]:
    """The part of the y axis that TensorBoard 2.21's charts always show with "Ignore outliers
    in chart scaling" on (the default): the 5 % to 95 % quantiles of all the values a chart
    draws, padded by 5 % of their distance (its ``extentOfValues`` and ``niceDomain``). It then
    rounds the range outwards to tick marks; a value outside this range may be off the chart.
    """
    ordered = sorted(values)

    def quantile(p: float) -> float:  # d3.quantile
        position = (len(ordered) - 1) * p
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    low, high = quantile(0.05), quantile(0.95)
    kept = [value for value in ordered if low <= value <= high]
    padding = (kept[-1] - kept[0]) * 0.05
    return kept[0] - padding, kept[-1] + padding
