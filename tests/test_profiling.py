"""The profiler hook in one process: settings, timings, the saved latency, FLOPs.

Durations come from an injected clock (the ``clock`` fixture), never from the machine's: these
tests check what is timed and how it is averaged, which a busy CPU must not change.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from grouping import GroupingNormalizer
from omegaconf import OmegaConf
from profiling_utils import (
    read_reports,
    tensorboard_charts,
    tensorboard_run_colours,
    tensorboard_y_range,
    time_gradient_pass,
)
from recipe_utils import read_scalars
from unit_utils import REPO_ROOT, make_loss, make_rows, micro_batch_loss, split, tiny_model

from exactga import profiling
from exactga.accumulation.step import train_window
from exactga.data.micro_batching import WindowWork
from exactga.profiling import (
    PHASES,
    ProfilerSection,
    ProfilerSettings,
    model_flops_per_token,
    parse_settings,
    saved_latency,
    setup_profiler,
)
from exactga.profiling import hook as profiler_hook
from exactga.profiling import phase_clock as profiler_phase_clock
from exactga.profiling.report import (
    CHARTS,
    REPORT_RUN,
    ReportCharts,
    RunFigures,
    band_run,
    report_markdown,
)

CPU = torch.device("cpu")
# exactga's knobs, which are top-level config keys; the others are the ``profiler`` section's.
TOP_LEVEL_KEYS = {f.name for f in dataclasses.fields(ProfilerSettings)} - {
    f.name for f in dataclasses.fields(ProfilerSection)
}


def hook(model: torch.nn.Module, settings: dict, output_dir: str = "/tmp/unused"):
    """The profiler a recipe would build from these config keys (top-level or ``profiler.*``)."""
    top_level = {k: v for k, v in settings.items() if k in TOP_LEVEL_KEYS}
    section = OmegaConf.create({k: v for k, v in settings.items() if k not in TOP_LEVEL_KEYS})
    return setup_profiler(
        section, CPU, model, output_dir=output_dir, micro_batching="by_length", **top_level
    )


class FakeClock:
    """Stands in for the ``time`` module of the profiler's modules that read it: its
    ``perf_counter`` moves only when a test advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1e3


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    for module in (profiler_hook, profiler_phase_clock, saved_latency):
        monkeypatch.setattr(module, "time", fake)
    return fake


def backward_once(model: torch.nn.Module) -> None:
    loss_fn = make_loss("cross_entropy", model)
    (window,) = GroupingNormalizer(loss_fn, 2).windows(split(make_rows(), 4))
    for mb in window.nonempty_micro_batches():
        window.scale(micro_batch_loss(model, loss_fn, mb.batch), mb).backward()


def test_stock_profiler_section_is_accepted_and_unknown_keys_are_named() -> None:
    stock = OmegaConf.create(
        {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False, "cpu": True}
    )
    settings = parse_settings(stock, "/tmp/out")
    assert settings.output_dir == "/tmp/out/profiling_outputs"
    assert parse_settings(None, "/tmp/out").log_timings
    with pytest.raises(ValueError, match="'profiler.wait_stepz'"):
        parse_settings(OmegaConf.create({"wait_stepz": 1}), "/tmp/out")
    # exactga's knobs are top-level keys: stock torchtune would pass them to its profiler
    with pytest.raises(ValueError, match="'profiler.log_timings'"):
        parse_settings(OmegaConf.create({"log_timings": False}), "/tmp/out")


def test_gradient_pass_measurement_changes_no_gradient_bit() -> None:
    model = tiny_model()
    backward_once(model)
    before = [p.grad.clone() for p in model.parameters()]
    assert time_gradient_pass(model, CPU) > 0
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))


def pass_taking(
    clock: FakeClock,
    monkeypatch,
    ms_per_element: list[float],
    interruptions: dict[tuple[int, int], float] | None = None,
) -> list[int]:
    """Make the sampled gradient pass cost ``ms_per_element[i]`` per element on each repeat of
    sample ``i``, plus ``interruptions[(i, r)]`` ms on its repeat ``r`` (another process taking
    the core); the real multiply runs too. Returns the elements each sample scaled."""
    scaled: list[int] = []
    num_calls = 0
    real_scale = saved_latency.scale_gradients

    def scale_taking_time(grads: list[torch.Tensor], scaler: torch.Tensor) -> None:
        nonlocal num_calls
        assert float(scaler) == 1.0  # factor 1: the gradients are left as they are
        real_scale(grads, scaler)
        sample, repeat = divmod(num_calls, saved_latency.SAVED_LATENCY_REPEATS)
        num_calls += 1
        num_elements = sum(g.numel() for g in grads)
        clock.advance_ms(ms_per_element[sample] * num_elements)
        clock.advance_ms((interruptions or {}).get((sample, repeat), 0.0))
        if repeat == 0:
            scaled.append(num_elements)

    monkeypatch.setattr(saved_latency, "scale_gradients", scale_taking_time)
    return scaled


def run_steps(profiler, model: torch.nn.Module, num_steps: int, clock=None) -> list[int]:
    """``num_steps`` optimizer steps of the hook over ``model``'s gradients; the steps whose
    sample ran, as the hook saw them."""
    sampled = []
    for step in range(1, num_steps + 1):
        before = len(profiler.saved_ms_samples)
        profiler.sample_gradient_pass(model)
        if len(profiler.saved_ms_samples) > before:
            sampled.append(step)
        if clock is not None:
            clock.advance_ms(10.0)  # the rest of the step
        profiler.step(WindowWork(num_positions=100))
    return sampled


def test_saved_ms_scales_the_sampled_pass_up_by_element_count(clock, monkeypatch) -> None:
    """What is timed is the gradient-scaling pass exact mode skips, on part of the gradients:
    with a pass that costs the same per element, the estimate is the full pass exactly."""
    model = tiny_model()
    backward_once(model)
    num_elements = sum(p.numel() for p in model.parameters())
    scaled = pass_taking(clock, monkeypatch, [1e-3] * 5)  # 1 ms per 1000 elements
    profiler = hook(model, {"saved_latency_every_n_steps": 1})
    with profiler:
        run_steps(profiler, model, 4, clock)
        metrics = profiler.metrics()
    assert len(scaled) == 3  # steps 2 to 4; step 1 warms up
    assert all(0 < n <= profiling.SAVED_LATENCY_FRACTION * num_elements for n in scaled)
    full_pass_ms = num_elements * 1e-3
    assert profiler.saved_ms_samples == pytest.approx([full_pass_ms] * 3)
    assert metrics["normalization/saved_ms"] == pytest.approx(full_pass_ms)
    repeats = saved_latency.SAVED_LATENCY_REPEATS
    step_ms = (4 * 10.0 + repeats * sum(scaled) * 1e-3) / 4
    assert metrics["normalization/saved_fraction"] == pytest.approx(full_pass_ms / step_ms)


def test_saved_latency_takes_a_few_samples_after_warm_up_and_then_none() -> None:
    model = tiny_model()
    backward_once(model)
    profiler = hook(model, {"saved_latency_every_n_steps": 4})
    assert run_steps(profiler, model, 40) == [2, 6, 10, 14, 18]
    assert profiling.SAVED_LATENCY_NUM_SAMPLES == 5
    off = hook(model, {"saved_latency_every_n_steps": 0})
    assert run_steps(off, model, 5) == []
    assert off.saved_latency is None
    assert "no gradient-scaling pass was timed" in off.summary()


def test_saved_latency_reports_median_and_range(clock, monkeypatch) -> None:
    model = tiny_model()
    backward_once(model)
    pass_taking(clock, monkeypatch, [1e-3, 1.2e-3, 0.9e-3, 1.1e-3, 1e-3])
    profiler = hook(model, {"saved_latency_every_n_steps": 1})
    with profiler:
        run_steps(profiler, model, 10, clock)
    num_elements = sum(p.numel() for p in model.parameters())
    saved = profiler.saved_latency
    assert saved.median_ms == pytest.approx(num_elements * 1e-3)
    assert (saved.low_ms, saved.high_ms) == pytest.approx(
        (num_elements * 0.9e-3, num_elements * 1.2e-3)
    )
    assert not saved.too_noisy
    summary = profiler.summary()
    assert f"saved {saved.median_ms:.2f} ms per optimizer step" in summary
    assert f"median of 5 samples, range {saved.low_ms:.2f} to {saved.high_ms:.2f} ms" in summary
    assert "not given" not in summary


def test_an_interrupted_repeat_does_not_move_the_figure(clock, monkeypatch) -> None:
    """A busy machine: another process takes the core for 50 ms during one timing of each of
    two samples. Each sample keeps its fastest repeat, so the figure is the pass's own cost,
    in the line and in the scalars alike. See [saved latency on a busy machine]."""
    model = tiny_model()
    backward_once(model)
    pass_taking(clock, monkeypatch, [1e-3] * 5, interruptions={(0, 0): 50.0, (2, 1): 50.0})
    profiler = hook(model, {"saved_latency_every_n_steps": 1})
    with profiler:
        run_steps(profiler, model, 6, clock)
        metrics = profiler.metrics()
    full_pass_ms = sum(p.numel() for p in model.parameters()) * 1e-3
    saved = profiler.saved_latency
    assert profiler.saved_ms_samples == pytest.approx([full_pass_ms] * 5)
    assert saved.figure_ms == pytest.approx(full_pass_ms) and saved.warning() is None
    assert metrics["normalization/saved_ms"] == pytest.approx(full_pass_ms)
    summary = profiler.summary()
    assert f"saved {full_pass_ms:.2f} ms per optimizer step" in summary
    assert "each the fastest of 3 timings of the pass" in summary


def test_samples_that_disagree_give_no_figure(clock, monkeypatch) -> None:
    """Samples spread wider than SAVED_LATENCY_MAX_SPREAD: the line says so in words, no
    percentage, and no saved scalar is logged."""
    model = tiny_model()
    backward_once(model)
    pass_taking(clock, monkeypatch, [1e-3, 3e-3, 0.3e-3, 2e-3, 0.5e-3])
    profiler = hook(model, {"saved_latency_every_n_steps": 1})
    with profiler:
        run_steps(profiler, model, 6, clock)
        metrics = profiler.metrics()
    num_elements = sum(p.numel() for p in model.parameters())
    saved = profiler.saved_latency
    assert saved.median_ms == pytest.approx(num_elements * 1e-3)
    assert saved.too_noisy and saved.figure_ms is None
    assert "normalization/saved_ms" not in metrics
    assert "normalization/saved_fraction" not in metrics
    summary = profiler.summary()
    assert summary.startswith(
        "exactga: the saved latency is not given: the 5 samples of the skipped "
        f"gradient-scaling pass disagree (range {saved.low_ms:.2f} to {saved.high_ms:.2f} ms"
    )
    assert "%" not in summary.splitlines()[0].split("half of them")[0]
    assert "> **Warning**" in profiler.report_markdown()


def test_too_few_samples_give_no_figure(clock, monkeypatch) -> None:
    """The issue's 4-step run: one sample at step 2 (here slowed 25 times by a busy machine
    on every repeat) gives no percentage, and says how long a run gives one."""
    model = tiny_model()
    backward_once(model)
    pass_taking(clock, monkeypatch, [25e-3])
    profiler = hook(model, {"saved_latency_every_n_steps": 10})
    with profiler:
        run_steps(profiler, model, 4, clock)
        metrics = profiler.metrics()
    assert len(profiler.saved_ms_samples) == 1
    assert "normalization/saved_ms" not in metrics
    assert profiler.summary().splitlines()[0] == (
        "exactga: the saved latency is not given: the skipped gradient-scaling pass was timed "
        "at 1 step (step 2), and a figure needs 3 (steps 2, 12, ... with "
        "saved_latency_every_n_steps=10: run 22 steps or more, or lower it)."
    )


def test_the_logged_figure_is_the_lines_figure_at_every_step(clock, monkeypatch) -> None:
    """Logged every step: no saved scalar before the third sample, then the milliseconds the
    line would give after that step, and none while it would give none."""
    model = tiny_model()
    backward_once(model)
    pass_taking(clock, monkeypatch, [1e-3, 1.2e-3, 0.9e-3, 1.1e-3, 1e-3])
    profiler = hook(model, {"saved_latency_every_n_steps": 2})
    logged = []
    with profiler:
        for step in range(1, 13):
            profiler.sample_gradient_pass(model)
            clock.advance_ms(10.0 + step)
            profiler.step(WindowWork(num_positions=100))
            logged.append(profiler.metrics())
            line = profiler.summary().splitlines()[0]
            if "normalization/saved_ms" in logged[-1]:
                ms = logged[-1]["normalization/saved_ms"]
                assert f"saved {ms:.2f} ms per optimizer step" in line
                share = logged[-1]["normalization/saved_fraction"]
                assert share == pytest.approx(ms / logged[-1]["time/step_ms"])
            else:
                assert "is not given" in line or "no gradient-scaling pass was timed" in line
    assert [step for step, m in enumerate(logged, 1) if "normalization/saved_ms" in m] == list(
        range(6, 13)
    )  # samples at steps 2, 4, 6, 8, 10


def test_gradient_samples_stay_within_their_share_of_the_elements() -> None:
    grads = [torch.zeros(n) for n in [5000, 10, 300, 300, 40, 2000, 300, 300, 40, 1] * 3]
    total = sum(g.numel() for g in grads)
    for index in range(profiling.SAVED_LATENCY_NUM_SAMPLES):
        subset = profiling.sample_gradients(grads, index)
        assert subset and sum(g.numel() for g in subset) <= 0.1 * total
    # A lone tensor larger than the budget is never scaled: nothing to sample.
    assert profiling.sample_gradients([torch.zeros(100)], 0) == []


def test_metrics_average_phases_per_step_and_reset(clock) -> None:
    model = tiny_model()
    profiler = hook(model, {"peak_flops": 1e12})
    with profiler:
        for item in profiler.timed([1, 2]):
            with profiler.phase("forward"):
                clock.advance_ms(10.0 * item)
            clock.advance_ms(1.0)  # outside any phase
            profiler.step(WindowWork(num_positions=50))
        metrics = profiler.metrics()
    assert set(metrics) >= {f"time/{p}_ms" for p in PHASES} | {
        "time/step_ms",
        "throughput/tokens_per_second",
        "throughput/mfu",
    }
    assert metrics["time/forward_ms"] == pytest.approx(15.0)  # (10 + 20) / 2 steps
    assert metrics["time/data_ms"] == 0.0
    assert metrics["time/step_ms"] == pytest.approx(16.0)  # (11 + 21) / 2
    assert metrics["throughput/tokens_per_second"] == pytest.approx(100 / 0.032)
    flops = model_flops_per_token(model)
    assert metrics["throughput/mfu"] == pytest.approx(100 / 0.032 * flops / 1e12)
    assert profiler.metrics() == {}  # nothing new since the last read


def test_padding_metrics_cover_the_interval_and_the_run(clock) -> None:
    model = tiny_model()
    profiler = hook(model, {})
    with profiler:
        for positions, own, fixed in [(100, 75, 160), (300, 225, 400)]:
            clock.advance_ms(500.0)
            profiler.step(
                WindowWork(
                    num_positions=positions,
                    num_loss_tokens=40,
                    num_sample_positions=own,
                    num_fixed_positions=fixed,
                    positions_per_rank=(positions, positions // 2),
                )
            )
        metrics = profiler.metrics()
    assert metrics["throughput/padding_fraction"] == pytest.approx(1 - 300 / 400)
    assert metrics["throughput/loss_tokens_per_second"] == pytest.approx(80 / 1.0)
    assert metrics["throughput/rank_imbalance"] == pytest.approx(300 / 225)
    summary = profiler.summary()
    assert "padding was 25.0% of the 400 positions" in summary
    assert "would have processed 560 (28.6% saved)" in summary


def test_timings_off_make_the_hook_silent() -> None:
    model = tiny_model()
    profiler = hook(model, {"log_timings": False})
    with profiler, profiler.phase("forward"):
        profiler.step(WindowWork(num_positions=1))
    assert profiler.metrics() == {}


def test_flops_per_token_counts_matmuls_and_attention() -> None:
    model = tiny_model()
    num_params = sum(p.numel() for p in model.parameters())
    attention = 12 * 2 * 32 * 64  # layers * dim * max_seq_len
    assert model_flops_per_token(model) == 6 * num_params + attention


def trace_events(path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_traces_label_the_phases_and_are_named_after_their_last_step(tmp_path) -> None:
    """wait 1, warm-up 1, active 2: steps 3 and 4 are recorded, as ``ProfilerStep#3`` and
    ``#4``, in ``trace_step_4.json``; each phase and the sampled pass is a labelled region."""
    model = tiny_model()
    loss_fn = make_loss("cross_entropy", model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = {"enabled": True, "wait_steps": 1, "warmup_steps": 1, "active_steps": 2}
    profiler = hook(model, {**cfg, "saved_latency_every_n_steps": 1}, output_dir=str(tmp_path))
    windows = [
        window
        for _ in range(5)
        for window in GroupingNormalizer(loss_fn, 2).windows(split(make_rows(), 4))
    ]
    with profiler:
        for step, window in enumerate(profiler.timed(windows), start=1):
            train_window(
                window,
                model=model,
                loss_step=lambda batch: micro_batch_loss(model, loss_fn, batch),
                optimizer=optimizer,
                profiler=profiler,
                device=CPU,
                step=step,
            )
            profiler.step(window.work())
    (trace,) = (tmp_path / "profiling_outputs").glob("trace_step_*.json")
    assert trace.name == "trace_step_4.json"
    names = {event.get("name") for event in trace_events(trace)}
    assert {name for name in names if name.startswith("ProfilerStep#")} == {
        "ProfilerStep#3",
        "ProfilerStep#4",
    }
    labels = {f"exactga/{p}" for p in [*PHASES, "saved_latency_sample"]}
    assert labels <= names, labels - names
    assert f"`{trace}`" in profiler.report_markdown()


def test_exceptions_pass_through_the_hook() -> None:
    profiler = hook(tiny_model(), {})
    with pytest.raises(RuntimeError, match="boom"), profiler:
        raise RuntimeError("boom")


def test_flops_leave_out_an_untied_embedding_and_frozen_weight_gradients() -> None:
    model = tiny_model(seed=None, tie_word_embeddings=False)
    attention = 12 * 2 * 32 * 64
    matmul_params = sum(p.numel() for p in model.parameters()) - 64 * 32  # minus the lookup
    assert model_flops_per_token(model) == 6 * matmul_params + attention
    for param in model.parameters():  # frozen: no weight-gradient matmuls, as for a LoRA base
        param.requires_grad_(False)
    assert model_flops_per_token(model) == 4 * matmul_params + attention


def test_report_goes_to_tensorboard_and_other_loggers_get_none(tmp_path, clock) -> None:
    """torchtune's TensorBoardLogger gets the layout on entry and the markdown summary on exit,
    in a report run of its own beside the scalars; its scalar events stay scalars only. Disk
    and stdout loggers get no report and raise nothing."""
    from torchtune.training.metric_logging import DiskLogger, StdoutLogger, TensorBoardLogger

    model = tiny_model()
    for logger in [DiskLogger(log_dir=str(tmp_path / "disk")), StdoutLogger()]:
        with setup_profiler(
            None, CPU, model, output_dir=str(tmp_path), metric_logger=logger
        ) as profiler:
            clock.advance_ms(20.0)
            profiler.step(WindowWork(num_positions=8))
            logger.log_dict(profiler.metrics(), step=1)
        logger.close()
    assert read_reports(tmp_path) == {}

    logger = TensorBoardLogger(log_dir=str(tmp_path / "tb"))
    with setup_profiler(
        None, CPU, model, output_dir=str(tmp_path), metric_logger=logger
    ) as profiler:
        (folder,) = read_reports(tmp_path / "tb")
        assert read_reports(tmp_path / "tb")[folder]["markdown"] is None  # not yet
        clock.advance_ms(20.0)
        profiler.step(WindowWork(num_positions=8))
        logger.log_dict(profiler.metrics(), step=1)
    logger.close()
    report = read_reports(tmp_path / "tb")[folder]
    assert folder.parent == Path(logger.log_dir)
    (category,) = report["layout"]["category"]
    titles = [chart["title"] for chart in category["chart"]]
    # No peak FLOP/s on a CPU: no MFU chart. Listed in reverse; see [report charts].
    assert titles == [title for key, (title, _) in reversed(CHARTS.items()) if key != "mfu"]
    logged = read_scalars(logger.log_dir)  # the scalars alone: the report is elsewhere
    assert not any(tag.startswith("~report_lines/") for tag in logged)
    assert "time/stacked_4_optimizer_ms" in logged  # the logged names stay as they were
    assert "| forward |" in report["markdown"] and "| MFU |" in report["markdown"]


def test_phases_are_stacked_for_the_report(clock) -> None:
    profiler = hook(tiny_model(), {})
    with profiler:
        for phase, ms in zip(["forward", "backward", "optimizer"], [3.0, 5.0, 1.0], strict=True):
            with profiler.phase(phase):
                clock.advance_ms(ms)
        profiler.step(WindowWork(num_positions=1))
        metrics = profiler.metrics()
    assert [metrics[f"time/stacked_{i}_{p}_ms"] for i, p in enumerate(PHASES, 1)] == (
        pytest.approx([0.0, 3.0, 8.0, 9.0])
    )


def test_other_ranks_time_their_phases_but_trace_and_report_nothing(tmp_path, clock) -> None:
    """The distributed recipes hand every rank the same values: rank 0 alone records traces and
    memory snapshots and writes the report; the others still log their own timings."""
    from torchtune.training.metric_logging import TensorBoardLogger

    logger = TensorBoardLogger(log_dir=str(tmp_path / "tb"))
    section = OmegaConf.create({"enabled": True, "wait_steps": 0, "warmup_steps": 0})
    profiler = setup_profiler(
        section, CPU, tiny_model(), output_dir=str(tmp_path), rank=1, metric_logger=logger
    )
    with profiler:
        for _ in range(3):
            clock.advance_ms(20.0)
            profiler.step(WindowWork(num_positions=8))
        metrics = profiler.metrics()
    logger.close()
    assert metrics["time/step_ms"] == pytest.approx(20.0)
    assert not (tmp_path / "profiling_outputs").exists()
    assert read_reports(tmp_path) == {}


def _profiler_calls(path: Path) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) in {"setup_profiler", "profiler_from_settings"}
    ]


@pytest.mark.parametrize(
    "recipe", sorted((REPO_ROOT / "recipes").glob("*.py")), ids=lambda path: path.stem
)
def test_recipes_hand_the_profiler_a_few_values_not_their_config(recipe: Path) -> None:
    """One profiler hook a run: a training recipe's comes from its run start (setup's last
    call, ``RunStart.training_run``, through ``profiler_from_settings``, which alone reads what
    the hook takes from the typed settings); the parity report builds its own, through
    ``setup_profiler`` with named values, never a config or a copy edited for its rank, which
    would decide again what the hook reads."""
    calls = _profiler_calls(recipe)
    if recipe.stem != "ga_parity":
        assert not calls, f"{recipe.name} builds a profiler hook of its own"
        assert "start.training_run(" in recipe.read_text()
        run_start = REPO_ROOT / "src" / "exactga" / "wiring" / "run_start.py"
        assert [call.func.id for call in _profiler_calls(run_start)] == ["profiler_from_settings"]
        return
    assert len(calls) == 1, f"{recipe.name} builds {len(calls)} profiler hooks"
    (call,) = calls
    if call.func.id == "profiler_from_settings":
        return
    for arg in [*call.args, *(keyword.value for keyword in call.keywords)]:
        assert not (isinstance(arg, ast.Name) and "cfg" in arg.id), (
            f"{recipe.name}:{call.lineno} hands setup_profiler a config ({arg.id})"
        )


def train_under_tensorboard(tmp_path: Path, clock: FakeClock, monkeypatch) -> Path:
    """40 steps of the hook under torchtune's TensorBoardLogger, logged every step as the
    recipes do: step 1 a warm-up 16 times slower than the others, step 8 traced (200 ms of
    writing the trace: "other"), the rest steady with a little noise but for the last two, the
    fastest and the slowest after the warm-up (new extremes where TensorBoard's scaling drops
    points); a pass sampled every 5 steps; a tenth of the positions padding. Returns the
    logger's folder."""
    from torchtune.training.metric_logging import TensorBoardLogger

    model = tiny_model()
    backward_once(model)
    num_elements = sum(p.numel() for p in model.parameters())
    pass_taking(clock, monkeypatch, [ms / num_elements for ms in [0.3, 0.2, 0.25, 0.2, 0.2]])
    logger = TensorBoardLogger(log_dir=str(tmp_path / "tb"))
    settings = {"saved_latency_every_n_steps": 5, "peak_flops": 1e9}
    top_level = {k: v for k, v in settings.items() if k in TOP_LEVEL_KEYS}
    profiler = setup_profiler(
        None, CPU, model, output_dir=str(tmp_path), metric_logger=logger, **top_level
    )

    def slowness(step: int) -> float:
        return {1: 16.0, 39: 0.5, 40: 3.0}.get(step, 1 + 0.1 * math.sin(step))

    def windows():
        for step in range(1, 41):
            clock.advance_ms(1.0 * slowness(step))  # data
            yield step

    with profiler:
        for step in profiler.timed(windows()):
            for phase, ms in [("forward", 3.0), ("backward", 5.0), ("optimizer", 1.0)]:
                with profiler.phase(phase):
                    clock.advance_ms(ms * slowness(step))
                if phase == "backward":
                    profiler.sample_gradient_pass(model)
            clock.advance_ms(200.0 if step == 8 else 0.5)
            profiler.step(
                WindowWork(
                    num_positions=1000,
                    num_loss_tokens=round(400 * (1 + 0.1 * math.sin(step))) if step > 1 else 400,
                    num_sample_positions=900,
                    num_fixed_positions=1200,
                )
            )
            logger.log_dict(profiler.metrics(step=step), step=step)
    logger.close()
    return Path(logger.log_dir)


def test_report_charts_give_each_line_its_own_colour_with_few_runs(
    tmp_path, clock, monkeypatch
) -> None:
    """TensorBoard colours a line by its run, so each band of a stacked chart is a run of its
    own, the stacks share them, and the runs sort next to each other: the logger's run, the
    report's (the bottom bands and the single-line charts) and one run for each further band,
    nothing else. See [report charts]."""
    log_dir = train_under_tensorboard(tmp_path, clock, monkeypatch)
    colours = tensorboard_run_colours(log_dir)
    bands = [f"{REPORT_RUN}/band_{n}" for n in range(2, 6)]  # the phases: 4 and other
    assert list(colours) == [".", REPORT_RUN, *bands]
    charts = tensorboard_charts(log_dir)
    assert len(charts) == len(CHARTS)
    for title, lines in charts.items():
        assert lines, title
        assert len({colours[line.run] for line in lines}) == len(lines), title
    (phases,) = [lines for title, lines in charts.items() if "phases stacked" in title]
    assert [line.run for line in phases] == [REPORT_RUN, *bands]
    (positions,) = [lines for title, lines in charts.items() if "positions stacked" in title]
    assert [line.run for line in positions] == [REPORT_RUN, *bands[:2]]


def test_report_charts_keep_every_point_on_the_chart(tmp_path, clock, monkeypatch) -> None:
    """With "Ignore outliers in chart scaling" on, TensorBoard fits a chart's y axis to the 5 %
    to 95 % quantiles of its values: a 16 times slower first step, or a traced step, must not
    leave a line off the chart. See [report charts]."""
    log_dir = train_under_tensorboard(tmp_path, clock, monkeypatch)
    for title, lines in tensorboard_charts(log_dir).items():
        values = [value for line in lines for value in line.values]
        low, high = tensorboard_y_range(values)
        outside = [value for value in values if not low <= value <= high]
        assert not outside, f"{title}: {outside} outside {low:.4g} to {high:.4g}"


def test_report_charts_show_the_logged_figures_as_shares(tmp_path, clock, monkeypatch) -> None:
    """The charts' lines are the recipe's logged scalars, the saved latency and the phases as
    shares of the step (% of ``time/step_ms``), at the steps they were logged at."""
    log_dir = train_under_tensorboard(tmp_path, clock, monkeypatch)
    logged = read_scalars(log_dir)
    (report,) = read_reports(log_dir).values()
    lines = report["lines"]
    steps = list(range(1, 41))
    step_ms = logged["time/step_ms"]

    def line(run: str, tag: str) -> list[float]:
        assert [step for step, _ in lines[run][tag]] == steps[-len(lines[run][tag]) :]
        return [value for _, value in lines[run][tag]]

    saved = line("", "~report_lines/saved")
    # From the third sample on (steps 2, 7, 12): see [saved latency on a busy machine].
    assert len(saved) == len(logged["normalization/saved_ms"]) == 40 - 11
    assert saved == pytest.approx(
        [
            100 * ms / step
            for ms, step in zip(logged["normalization/saved_ms"], step_ms[11:], strict=True)
        ],
        rel=1e-6,
    )
    assert saved == pytest.approx([100 * f for f in logged["normalization/saved_fraction"]])
    # The run ended: the band is its lowest to highest at every step (so far, while it ran).
    assert line("", "~report_lines/saved_highest") == pytest.approx([max(saved)] * len(saved))
    assert line("", "~report_lines/saved_lowest") == pytest.approx([min(saved)] * len(saved))
    tops = [line(band_run(i), "~report_lines/phases_top") for i in range(1, len(PHASES) + 1)]
    stacked = [logged[f"time/stacked_{i}_{phase}_ms"] for i, phase in enumerate(PHASES, 1)]
    for top, ms in zip(tops, stacked, strict=True):
        assert top == pytest.approx(
            [100 * a / b for a, b in zip(ms, step_ms, strict=True)], rel=1e-6
        )
    assert line(band_run(5), "~report_lines/phases_top") == [100.0] * 40  # other
    assert line(band_run(5), "~report_lines/phases_bottom") == pytest.approx(tops[-1])
    assert line("", "~report_lines/throughput") == pytest.approx(
        logged["throughput/tokens_per_second"], rel=1e-6
    )
    assert line("", "~report_lines/mfu") == pytest.approx(
        [100 * mfu for mfu in logged["throughput/mfu"]], rel=1e-6
    )
    padding = line(band_run(3), "~report_lines/positions_bottom")
    assert padding == pytest.approx([90.0] * 40)  # 900 of 1000 positions are the samples'


def saved_sample(step: int, measured_ms: float) -> saved_latency.SavedLatencySample:
    return saved_latency.SavedLatencySample(
        step=step,
        measured_ms=measured_ms,
        num_elements=10,
        num_tensors=1,
        total_elements=100,
        total_tensors=10,
        num_repeats=3,
    )


def figures(**changes) -> RunFigures:
    samples = tuple(saved_sample(step, 0.1) for step in (2, 12, 22))  # the fewest for a figure
    run = RunFigures(
        num_steps=40,
        step_ms=50.0,
        tokens_per_second=12345.0,
        saved=saved_latency.SavedLatency(samples),
        flops_per_token=1e6,
        peak_flops=1e11,
        device_type="cpu",
        padding="exactga: padding was 11.9% of the 27,160 positions processed on this rank "
        "(micro_batching: by_length); fixed micro-batches would have processed 28,552 "
        "(4.9% saved).",
        phase_ms={"data": 3.0, "forward": 15.0, "backward": 25.0, "optimizer": 3.0},
        trace_paths=[Path("/out/profiling_outputs/trace_step_8.json")],
        snapshot_paths=[],
    )
    return dataclasses.replace(run, **changes)


@pytest.mark.filterwarnings("ignore:html5lib's sanitizer is deprecated:DeprecationWarning")
def test_report_text_renders_as_two_short_tables_in_tensorboard() -> None:
    """The TEXT tab renders the summary with TensorBoard's own markdown: every figure in a
    table cell (a list after a line without a blank one rendered as inline text), and short
    enough for the 500-pixel card: the title, two tables, one paragraph of details."""
    from tensorboard.plugin_util import markdown_to_safe_html

    html = markdown_to_safe_html(report_markdown(figures()))
    assert html.count("<table>") == 2
    cells = re.findall(r"<t[hd]>(.*?)</t[hd]>", html, flags=re.S)
    for phase in [*PHASES, "other", "<strong>step</strong>"]:
        assert phase in cells, phase
    for name in ["<strong>saved</strong>", "throughput", "MFU", "padding", "traces"]:
        assert name in cells, name
    assert any("<code>/out/profiling_outputs/trace_step_8.json</code>" in c for c in cells)
    assert "- <code>" not in html  # no list item left as inline text
    outside = re.sub(r"<table>.*?</table>", "", html, flags=re.S)
    assert len(re.findall(r"<p>", outside)) == 2  # the title, the details
    assert len(re.findall(r"<tr>", html)) <= 11
    # Short cells: a long one would squeeze the other columns (the card breaks words anywhere).
    assert max(len(re.sub(r"<[^>]+>", "", cell)) for cell in cells) < 100
    # A warning on the saved latency comes first, where the card shows it without scrolling.
    disagreeing = (saved_sample(2, 0.1), saved_sample(12, 1.0), saved_sample(22, 0.02))
    html = markdown_to_safe_html(
        report_markdown(figures(saved=saved_latency.SavedLatency(disagreeing)))
    )
    assert "<strong>Warning</strong>" in html.split("<table>")[0]


def test_report_text_without_samples_traces_or_peak() -> None:
    markdown = report_markdown(figures(saved=None, trace_paths=[], peak_flops=None, padding=""))
    assert "| **saved** | none |" in markdown
    assert "| traces | none | `profiler.enabled: False` |" in markdown
    assert "| MFU | not measured |" in markdown
    assert "| padding |" not in markdown
    assert report_markdown(None) == "**exactga profiling report**: no optimizer step completed."


def test_a_tiny_saved_share_keeps_two_digits_in_the_line_and_the_text() -> None:
    """A tiny model on a busy CPU saves 0.02 % of its step, which one decimal shows as 0.0 %."""
    run = figures(step_ms=5000.0)  # the samples' figure: 1 ms
    assert "**1.00 ms** a step | **0.02%** of the step" in report_markdown(run)
    line = saved_latency.summary_line(run.saved, run.step_ms, num_steps=40)
    assert "saved 1.00 ms per optimizer step (0.02% of 5000.0 ms;" in line
    assert saved_latency.percent_of(1.0, 50.0) == "2.0%"  # one decimal from 0.1 % up
    assert saved_latency.percent_of(0.0, 50.0) == "0.0%"


def test_a_band_is_the_lowest_to_highest_so_far_until_the_run_ends() -> None:
    charts = ReportCharts()
    tags = ("~report_lines/throughput_lowest", "~report_lines/throughput_highest")
    seen = []
    for tokens_per_second in [100.0, 300.0, 50.0, 200.0]:
        metrics = {"time/step_ms": 0.0, "throughput/tokens_per_second": tokens_per_second}
        lines = charts.lines(metrics, phases=[])[""]
        seen.append(tuple(lines[tag] for tag in tags))
    assert seen == [(100.0, 100.0), (100.0, 300.0), (50.0, 300.0), (50.0, 300.0)]
    assert charts.run_bands() == dict(zip(tags, (50.0, 300.0), strict=True))
