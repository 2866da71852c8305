"""Helpers around the profiler hook for the tests and the benchmarks: timing the whole
gradient-scaling pass, and reading a run's TensorBoard report back.

Neither is needed to train, so neither is in ``src/exactga/profiling``; the benchmarks import
this module by putting ``tests/`` on their path (as they do for ``recipe_utils``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exactga.normalization import gradient_scaling_pass
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
    (the custom-scalars layout as written, or ``None``) and ``markdown`` (the summary, or
    ``None`` if the run did not end). See [profiling report file]."""
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
