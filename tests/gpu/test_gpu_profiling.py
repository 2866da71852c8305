"""The profiler hook's CUDA paths through ``tune run``: CUDA-event phase timings, the saved
latency and MFU, memory history with snapshots on the profiler schedule, and the snapshot
written when training runs out of GPU memory. See docs/profiling.md."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from cuda_runs import FULL_SINGLE, Launch, all_finite, launch_all

from exactga.profiling import device_peak_flops

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu_profiling")]

STEPS = 8
PHASES = [f"time/{phase}_ms" for phase in ("data", "forward", "backward", "optimizer")]

# Out of memory on purpose, and at once: one micro-batch of 2048 rows padded to 256 tokens (the
# tiny tokenizer's max_seq_len; some rows reach it) through one layer whose MLP is 262144 wide.
# The first MLP projection's output alone is 2048 * 256 * 262144 bf16 values, 256 GiB, more
# than any single GPU holds, so that one allocation fails without filling the card first and
# the runs beside this one keep their memory. The weights stay small (50M parameters).
OOM_BATCH = {
    "dtype": "bf16",
    "batch_size": 2048,
    "max_steps_per_epoch": 1,
    "model.num_layers": 1,
    "model.embed_dim": 64,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "model.intermediate_dim": 262144,
    "profiler.profile_memory": True,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launches = {
        "timed": Launch(
            FULL_SINGLE,
            {
                "dtype": "bf16",
                "max_steps_per_epoch": STEPS,
                "saved_latency_every_n_steps": 2,  # steps 2, 4, 6, 8: enough for a figure
                "log_peak_memory_stats": True,
            },
        ),
        "memory": Launch(
            FULL_SINGLE,
            {
                "dtype": "bf16",
                "max_steps_per_epoch": 5,
                "profiler.enabled": True,
                "profiler.profile_memory": True,
                "profiler.wait_steps": 1,
                "profiler.warmup_steps": 1,
                "profiler.active_steps": 2,
            },
        ),
        "oom": Launch(FULL_SINGLE, OOM_BATCH, expect_success=False),
    }
    return launch_all(launches, tmp_path_factory.mktemp("gpu_profiling"))


def test_phase_timings_are_logged_and_sum_to_at_most_the_step(runs, record_property):
    scalars = runs["timed"].scalars()
    for tag in [*PHASES, "time/step_ms"]:
        assert len(scalars[tag]) == STEPS, tag
        assert all(value >= 0 for value in scalars[tag]), tag
    for tag in PHASES[1:]:  # device phases, from CUDA events
        assert all(value > 0 for value in scalars[tag]), tag
    fractions = []
    for step in range(STEPS):
        phase_sum = sum(scalars[tag][step] for tag in PHASES)
        step_ms = scalars["time/step_ms"][step]
        fractions.append(phase_sum / step_ms)
        # The device phases come from CUDA events on one stream, read after a device sync, and
        # the data phase is host time; none overlaps another in a host-bound run like this.
        assert phase_sum <= step_ms, (step + 1, phase_sum, step_ms)
    record_property("phase_sum_over_step_ms", [round(f, 3) for f in fractions])
    assert all_finite(scalars["loss"])


def test_saved_latency_throughput_and_mfu_on_cuda(runs, record_property):
    scalars = runs["timed"].scalars()
    saved = scalars["normalization/saved_ms"]
    assert saved and all(value > 0 for value in saved)
    assert all(0 < value < 1 for value in scalars["normalization/saved_fraction"])
    assert all(value > 0 for value in scalars["throughput/tokens_per_second"])
    assert all(value > 0 for value in scalars["peak_memory_alloc"])
    if device_peak_flops(torch.device("cuda")) is None:
        assert "throughput/mfu" not in scalars  # an unknown GPU: no peak, no MFU
    else:
        assert all(0 < value < 1 for value in scalars["throughput/mfu"])
        record_property("mfu_last_step", scalars["throughput/mfu"][-1])
    record_property("saved_ms_last_sample", saved[-1])
    record_property("tokens_per_second_last_step", scalars["throughput/tokens_per_second"][-1])
    assert "skipping the gradient-scaling pass saved" in runs["timed"].output


def _load_snapshot(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def _trace_actions(snapshot) -> set[str]:
    return {entry["action"] for trace in snapshot["device_traces"] for entry in trace}


def test_memory_history_writes_a_snapshot_next_to_each_trace(runs):
    outputs = runs["memory"].output_dir / "profiling_outputs"
    traces = sorted(outputs.glob("trace_step_*.json"))
    snapshots = sorted(outputs.glob("memory_snapshot_step_*.pickle"))
    # One cycle (wait 1, warm-up 1, active 2) in 5 steps: one trace, its snapshot beside it.
    assert len(traces) == 1 and len(snapshots) == 1, (traces, snapshots)
    step = traces[0].name.removeprefix("trace_step_").removesuffix(".json")
    assert snapshots[0].name == f"memory_snapshot_step_{step}.pickle"
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events), "no CUDA kernel in the trace"
    snapshot = _load_snapshot(snapshots[0])
    assert snapshot["segments"], "the snapshot holds no allocator segment"
    assert "alloc" in _trace_actions(snapshot), "the allocator history was not recorded"


def test_out_of_memory_writes_a_snapshot_then_reraises(runs):
    run = runs["oom"]
    assert run.returncode != 0
    assert "OutOfMemoryError" in run.output, run.output[-4000:]
    path = run.output_dir / "profiling_outputs" / "oom_memory_snapshot.pickle"
    assert path.is_file(), run.output[-4000:]
    assert "CUDA memory snapshot written to" in run.output
    snapshot = _load_snapshot(path)
    # The history ends with the failed allocation, so the dump came after it, not before.
    assert "oom" in _trace_actions(snapshot)
