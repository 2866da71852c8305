"""The profiler hook in one process: settings, timings, the saved latency, FLOPs.

Durations come from an injected clock (the ``clock`` fixture), never from the machine's: these
tests check what is timed and how it is averaged, which a busy CPU must not change.
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from unit_utils import make_loss, make_rows, micro_batch_loss, split, tiny_model

from exactga import profiling
from exactga.micro_batching import WindowWork
from exactga.normalization import LossNormalizer
from exactga.profiling import (
    PHASES,
    TOP_LEVEL_KEYS,
    model_flops_per_token,
    parse_settings,
    setup_profiler,
    time_gradient_pass,
)

CPU = torch.device("cpu")


def hook(model: torch.nn.Module, settings: dict, output_dir: str = "/tmp/unused"):
    """The profiler a recipe would build from these config keys (top-level or ``profiler.*``)."""
    top_level = {k: v for k, v in settings.items() if k in TOP_LEVEL_KEYS}
    section = {k: v for k, v in settings.items() if k not in TOP_LEVEL_KEYS}
    cfg = OmegaConf.create(
        {"output_dir": output_dir, "profiler": section, "micro_batching": "by_length", **top_level}
    )
    return setup_profiler(cfg, CPU, model)


class FakeClock:
    """Stands in for the ``time`` module of ``exactga.profiling``: its ``perf_counter`` moves
    only when a test advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1e3


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(profiling, "time", fake)
    return fake


def backward_once(model: torch.nn.Module) -> None:
    loss_fn = make_loss("cross_entropy", model)
    (window,) = LossNormalizer(loss_fn, 2).windows(split(make_rows(), 4))
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


def test_saved_ms_is_the_time_of_the_scaling_pass(clock, monkeypatch) -> None:
    """What is timed is the gradient-scaling pass exact mode skips, and nothing else: the
    pass moves the injected clock by 2.5 ms, and every sample is those 2.5 ms."""
    model = tiny_model()
    backward_once(model)
    calls = []
    real_pass = profiling.gradient_scaling_pass

    def scaling_pass_taking_2_5_ms(model: torch.nn.Module, factor: float) -> None:
        calls.append(factor)
        real_pass(model, factor)
        clock.advance_ms(2.5)

    monkeypatch.setattr(profiling, "gradient_scaling_pass", scaling_pass_taking_2_5_ms)
    profiler = hook(model, {"saved_latency_every_n_steps": 1})
    with profiler:
        for _ in range(3):
            profiler.sample_gradient_pass(model)
            clock.advance_ms(10.0)  # the rest of the step
            profiler.step(WindowWork(num_positions=100))
        metrics = profiler.metrics()
    assert calls == [1.0, 1.0, 1.0]  # factor 1: the gradients are left as they are
    assert profiler.saved_ms_samples == pytest.approx([2.5, 2.5, 2.5])
    assert metrics["normalization/saved_ms"] == pytest.approx(2.5)
    assert metrics["normalization/saved_fraction"] == pytest.approx(2.5 / 12.5)


def test_saved_latency_is_sampled_on_step_2_and_every_n() -> None:
    model = tiny_model()
    backward_once(model)
    cfg = OmegaConf.create({"saved_latency_every_n_steps": 4})
    profiler = hook(model, cfg)
    sampled = []
    for step in range(1, 10):
        before = len(profiler.saved_ms_samples)
        profiler.sample_gradient_pass(model)
        if len(profiler.saved_ms_samples) > before:
            sampled.append(step)
        profiler.step(WindowWork(num_positions=1))
    assert sampled == [2, 4, 8]
    off = hook(model, {"saved_latency_every_n_steps": 0})
    for _ in range(3):
        off.sample_gradient_pass(model)
        off.step(WindowWork(num_positions=1))
    assert off.saved_ms_samples == []


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


def test_trace_is_written_as_perfetto_json(tmp_path) -> None:
    model = tiny_model()
    cfg = OmegaConf.create(
        {"enabled": True, "wait_steps": 1, "warmup_steps": 1, "active_steps": 1, "num_cycles": 1}
    )
    profiler = hook(model, cfg, output_dir=str(tmp_path))
    with profiler:
        for _ in range(4):
            with profiler.phase("forward"):
                model(torch.randint(0, 64, (1, 8)))
            profiler.step(WindowWork(num_positions=8))
    (trace,) = (tmp_path / "profiling_outputs").glob("trace_step_*.json")
    assert "traceEvents" in json.loads(trace.read_text())


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
