"""The profiler hook through ``tune run``: scalars, the TensorBoard report of every training
recipe, labelled traces, unchanged weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from many_runs import Run, launch_runs
from profiling_utils import read_reports, tensorboard_charts, tensorboard_run_colours
from recipe_utils import (
    LORA_RECIPE,
    LORA_TINY_CONFIG,
    RECIPE,
    SMALL_MODEL,
    TINY_CONFIG,
    TRAINED,
    load_weights,
    read_scalars,
)
from run_hooks import STEADY_SAVED_MS_PER_ELEMENT, STEADY_SCALING_PASS

from exactga.profiling import PHASES, REPORT_CATEGORY, REPORT_RUN
from exactga.profiling.report import CHARTS

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("recipe_profiling")]

STEPS = 6

PHASE_SCALARS = [f"time/{phase}_ms" for phase in PHASES]
HOOK_SCALARS = [
    *PHASE_SCALARS,
    "time/step_ms",
    "throughput/tokens_per_second",
    "throughput/mfu",
]
SAVED_SCALARS = ["normalization/saved_ms", "normalization/saved_fraction"]

# Traces on every launch: wait 1, warm-up 1, active 2 records steps 3 and 4.
TRACED = {
    "profiler.enabled": True,
    "profiler.wait_steps": 1,
    "profiler.warmup_steps": 1,
    "profiler.active_steps": 2,
}
SHORT = {
    **SMALL_MODEL,
    **TRACED,
    "max_steps_per_epoch": 4,
    "gradient_accumulation_steps": 2,
    "batch_size": 2,
    "saved_latency_every_n_steps": 1,
}
# The torchrun launches on the data's first 64 rows, twice the 32 samples they read (4 steps of
# 2 x 2 on 2 ranks): their length index (``rank_balancing: by_tokens``) tokenizes 64 rows, not
# 2,069; the report's claims hold of any data.
SHORT_SLICE = {**SHORT, "dataset.split": "train[:64]"}
# name: (torchrun ranks, 0 for plain tune run; recipe; config; overrides)
LAUNCHES = {
    "on": (
        0,
        RECIPE,
        TINY_CONFIG,
        {**SHORT, "max_steps_per_epoch": STEPS, "peak_flops": 1e12},
    ),
    "off": (
        0,
        RECIPE,
        TINY_CONFIG,
        {
            **SMALL_MODEL,
            "max_steps_per_epoch": STEPS,
            "gradient_accumulation_steps": 2,
            "batch_size": 2,
            "log_timings": False,
            "saved_latency_every_n_steps": 0,
        },
    ),
    "lora_single_device": (0, LORA_RECIPE, LORA_TINY_CONFIG, SHORT),
    "full_distributed": (
        2,
        "recipes/full_finetune.py",
        "configs/tiny/full_distributed.yaml",
        SHORT_SLICE,
    ),
    "lora_distributed": (
        1,
        "recipes/lora_finetune.py",
        "configs/tiny/lora_distributed.yaml",
        SHORT_SLICE,
    ),
}
RECIPE_RUNS = ["on", "lora_single_device", "full_distributed", "lora_distributed"]


def _launch_all(root: Path) -> None:
    """The runs grouped by rank count, each group's one after another, each run forked from
    the tests' server (tests/many_runs.py); every run must succeed."""
    by_ranks: dict[int, list[Run]] = {}
    for name, (nproc, recipe, config, settings) in LAUNCHES.items():
        out = root / name
        overrides = [f"{key}={value}" for key, value in {**settings, "output_dir": out}.items()]
        # The skipped pass on a steady clock: which steps carry a figure must not depend on
        # the machine's load (tests/run_hooks.py).
        env = {STEADY_SCALING_PASS: "1"}
        args = ["--config", config, *overrides]
        by_ranks.setdefault(nproc, []).append(Run(recipe, args, out, env))
    for nproc, runs in by_ranks.items():
        launch_runs(runs, nproc=nproc)
    for name in LAUNCHES:
        output = (root / name / "output.txt").read_text()
        assert (root / name / "returncode").read_text() == "0", f"{name}:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    """The runs' output folders, made once per test session for every xdist worker."""
    return run_once("profiling_runs", _launch_all)


def test_hook_logs_scalars_and_leaves_weights_bit_identical(runs):
    scalars = read_scalars(runs / "on" / "logs")
    for tag in HOOK_SCALARS:
        assert len(scalars[tag]) == STEPS, tag
        assert all(value >= 0 for value in scalars[tag]), tag
    # Sampled on steps 2 to 6 (every step after the warm-up step, five samples); a figure from
    # the third sample on (see [saved latency on a busy machine]). On the steady clock every
    # sample scales up to the full pass: its element count at the clock's rate.
    for tag in SAVED_SCALARS:
        assert len(scalars[tag]) == STEPS - 3, tag
    num_gradient_elements = sum(w.numel() for w in load_weights(runs / "on" / TRAINED).values())
    full_pass_ms = STEADY_SAVED_MS_PER_ELEMENT * num_gradient_elements
    assert scalars["normalization/saved_ms"] == pytest.approx([full_pass_ms] * (STEPS - 3))
    for tag in ("time/forward_ms", "time/backward_ms"):
        assert all(value > 0 for value in scalars[tag]), tag
    assert all(0 < f < 1 for f in scalars["normalization/saved_fraction"])
    # The report's chart lines repeat them, at the steps they were logged at.
    ((_, report),) = read_reports(runs / "on" / "logs").items()
    throughput = report["lines"][""]["~report_lines/throughput"]
    assert [step for step, _ in throughput] == list(range(1, STEPS + 1))
    assert [value for _, value in throughput] == pytest.approx(
        scalars["throughput/tokens_per_second"]
    )
    saved = [value for _, value in report["lines"][""]["~report_lines/saved"]]
    assert saved == pytest.approx([100 * f for f in scalars["normalization/saved_fraction"]])
    output = (runs / "on" / "output.txt").read_text()
    assert "skipping the gradient-scaling pass saved" in output
    assert "median of 5 samples, range" in output

    off_scalars = read_scalars(runs / "off" / "logs")
    assert not any(
        tag.startswith(("time/", "throughput/", "normalization/")) for tag in off_scalars
    )
    assert read_reports(runs / "off" / "logs") == {}  # log_timings off: the hook is silent
    w_on = load_weights(runs / "on" / TRAINED)
    w_off = load_weights(runs / "off" / TRAINED)
    assert all(torch.equal(w_on[key], w_off[key]) for key in w_on)


@pytest.mark.parametrize("name", RECIPE_RUNS)
def test_every_recipe_writes_the_tensorboard_report(runs, name):
    """One report per run (rank 0's), beside the logger's scalars: the custom-scalars layout,
    whose every chart draws lines, each in a colour of its own, and the markdown summary."""
    logs = runs / name / "logs"
    reports = read_reports(logs)
    assert len(reports) == 1, reports
    ((folder, report),) = reports.items()
    assert folder.parent.parent == logs  # <log_dir>/profiling_report, log_dir = logs/run_*
    (category,) = report["layout"]["category"]
    assert category["title"] == REPORT_CATEGORY
    charts = tensorboard_charts(logs)
    assert len(charts) == len(CHARTS) - ("peak_flops" not in LAUNCHES[name][3])  # MFU
    colours = tensorboard_run_colours(logs)
    for title, lines in charts.items():
        assert lines and all(line.values for line in lines), title
        assert len({colours[line.run] for line in lines}) == len(lines), title
    # The run list: the launch's run, the report's, and a run for each further band of the
    # phases (4 and other), shared by the stacks; see [report charts].
    (phases,) = [lines for title, lines in charts.items() if "phases stacked" in title]
    assert len(phases) == len(PHASES) + 1
    run = folder.parent.name
    bands = [f"{run}/{REPORT_RUN}/band_{n}" for n in range(2, len(phases) + 1)]
    assert list(colours) == [run, f"{run}/{REPORT_RUN}", *bands]
    logged = read_scalars(logs)  # the logger's scalars keep their names
    assert {f"time/stacked_{i}_{phase}_ms" for i, phase in enumerate(PHASES, 1)} <= set(logged)

    markdown = report["markdown"]
    for phase in PHASES:
        assert f"| {phase} |" in markdown, phase
    assert "| **saved** |" in markdown and "median of" in markdown and "range" in markdown
    assert "| MFU |" in markdown
    (trace,) = (runs / name / "profiling_outputs").glob("trace_step_*.json")
    assert f"`{trace}`" in markdown
    assert "| memory snapshots |" in markdown


def test_traces_are_labelled_and_named_after_their_steps(runs):
    (trace,) = (runs / "on" / "profiling_outputs").glob("trace_step_*.json")
    assert trace.name == "trace_step_4.json"
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {name for name in names if name.startswith("ProfilerStep#")} == {
        "ProfilerStep#3",
        "ProfilerStep#4",
    }
    labels = {f"exactga/{phase}" for phase in [*PHASES, "saved_latency_sample"]}
    assert labels <= names, labels - names
