"""The profiler hook through ``tune run``: scalars in TensorBoard, traces, unchanged weights."""

from __future__ import annotations

import json

import pytest
import torch
from recipe_utils import TRAINED, load_weights, output_of, read_scalars, run_tune, tiny_args

STEPS = 6

PHASE_SCALARS = [f"time/{phase}_ms" for phase in ("data", "forward", "backward", "optimizer")]
HOOK_SCALARS = [
    *PHASE_SCALARS,
    "time/step_ms",
    "throughput/tokens_per_second",
    "throughput/mfu",
    "normalization/saved_ms",
    "normalization/saved_fraction",
]


TOP_LEVEL = ("log_timings", "saved_latency_every_n_steps", "peak_flops")


def train(output_dir, **settings: object):
    args = tiny_args(
        output_dir,
        max_steps_per_epoch=STEPS,
        gradient_accumulation_steps=2,
        batch_size=2,
        **{
            key if key in TOP_LEVEL else f"profiler__{key}": value
            for key, value in settings.items()
        },
    )
    proc = run_tune(args)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    return proc


@pytest.mark.slow
def test_hook_logs_scalars_writes_traces_and_leaves_weights_bit_identical(tmp_path):
    on = train(
        tmp_path / "on",
        enabled=True,
        wait_steps=1,
        warmup_steps=1,
        active_steps=2,
        saved_latency_every_n_steps=1,
        peak_flops=1e12,
    )
    train(tmp_path / "off", log_timings=False, saved_latency_every_n_steps=0)

    scalars = read_scalars(tmp_path / "on" / "logs")
    for tag in HOOK_SCALARS:
        assert len(scalars[tag]) == STEPS, tag
        assert all(value >= 0 for value in scalars[tag]), tag
    for tag in ("time/forward_ms", "time/backward_ms", "normalization/saved_ms"):
        assert all(value > 0 for value in scalars[tag]), tag
    assert all(0 < f < 1 for f in scalars["normalization/saved_fraction"])
    assert "skipping the gradient-scaling pass saved" in output_of(on)

    (trace,) = (tmp_path / "on" / "profiling_outputs").glob("trace_step_*.json")
    assert json.loads(trace.read_text())["traceEvents"]

    off_scalars = read_scalars(tmp_path / "off" / "logs")
    assert not any(
        tag.startswith(("time/", "throughput/", "normalization/")) for tag in off_scalars
    )
    w_on = load_weights(tmp_path / "on" / TRAINED)
    w_off = load_weights(tmp_path / "off" / TRAINED)
    assert all(torch.equal(w_on[key], w_off[key]) for key in w_on)
