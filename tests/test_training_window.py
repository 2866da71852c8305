"""The step as a recipe's loop runs it (exactga.accumulation.step.TrainingWindow).

``for batch in window: window.backward(loss_step(batch))`` then ``window.step(optimizer)``
must give the full-batch gradient of the window whatever the split, and a copy that breaks the
protocol (no backward, a step before the window ran) must fail loudly rather than train on part
of the window: under data parallelism a rank that skips a micro-batch would hang the others.
"""

from __future__ import annotations

import pytest
import torch
from grouping import GroupingNormalizer
from torch import nn
from unit_utils import full_batch_grad, make_loss, make_rows, micro_batch_loss, rel_err, split
from unit_utils import tiny_model as make_model

from exactga.accumulation.step import StepContext, TrainingWindow
from exactga.config.profiler import ProfilerSettings
from exactga.profiling import TrainingProfiler

CPU = torch.device("cpu")


def _windows(model: nn.Module, batch_size: int, ga: int) -> list[TrainingWindow]:
    profiler = TrainingProfiler(
        ProfilerSettings(log_timings=False, saved_latency_every_n_steps=0), CPU, model
    )
    context = StepContext(model, CPU, profiler)
    loss_fn = make_loss("plain", model)
    normalizer = GroupingNormalizer(loss_fn, ga)
    return [
        TrainingWindow(window, context, step)
        for step, window in enumerate(normalizer.windows(split(make_rows(), batch_size)), 1)
    ]


def _grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("batch_size,ga", [(8, 1), (2, 4), (1, 8)])
def test_the_loop_accumulates_the_full_batch_gradient(batch_size: int, ga: int) -> None:
    torch.manual_seed(0)
    model = make_model()
    loss_fn = make_loss("plain", model)
    (window,) = _windows(model, batch_size, ga)
    for batch in window:
        window.backward(micro_batch_loss(model, loss_fn, batch))
    assert rel_err(_grad(model), full_batch_grad(make_model(), make_rows())) < 1e-6


def test_a_forward_without_its_backward_fails_before_the_next_micro_batch() -> None:
    model = make_model()
    loss_fn = make_loss("plain", model)
    (window,) = _windows(model, 2, 4)
    batches = iter(window)
    micro_batch_loss(model, loss_fn, next(batches))  # forgot window.backward(loss)
    with pytest.raises(RuntimeError, match="window.backward"):
        next(batches)


def test_a_backward_without_a_forward_fails() -> None:
    model = make_model()
    (window,) = _windows(model, 2, 4)
    with pytest.raises(RuntimeError, match="window.backward"):
        window.backward(torch.ones((), requires_grad=True))


def test_a_step_before_the_window_ran_to_its_end_fails() -> None:
    model = make_model()
    loss_fn = make_loss("plain", model)
    (window,) = _windows(model, 2, 4)
    for batch in window:
        window.backward(micro_batch_loss(model, loss_fn, batch))
        break  # a copy that leaves the loop early
    with pytest.raises(RuntimeError, match="before every micro-batch"):
        window.step(torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_clipping_of_ones_own_sees_the_final_gradients_and_its_norm_is_the_outcomes() -> None:
    model = make_model()
    loss_fn = make_loss("plain", model)
    (window,) = _windows(model, 2, 4)
    for batch in window:
        window.backward(micro_batch_loss(model, loss_fn, batch))
    full = _grad(model).clone()
    seen: list[torch.Tensor] = []

    def clip_by_value(parameters) -> torch.Tensor:
        parameters = list(parameters)
        seen.append(torch.cat([p.grad.reshape(-1) for p in parameters]).clone())
        torch.nn.utils.clip_grad_value_(parameters, 1e-3)
        return torch.tensor(7.0)

    before = [p.detach().clone() for p in model.parameters()]
    outcome = window.step(torch.optim.SGD(model.parameters(), lr=1.0), clip=clip_by_value)
    assert torch.equal(seen[0], full)
    assert outcome.grad_norm == 7.0 and not outcome.skipped
    moved = max((p - b).abs().max().item() for p, b in zip(model.parameters(), before, strict=True))
    assert 0 < moved <= 1e-3 + 1e-6  # lr 1 times the clipped value, up to fp32 rounding


def test_what_the_window_counted_reads_through() -> None:
    model = make_model()
    (window,) = _windows(model, 2, 4)
    assert window.units_name == "loss_tokens"
    assert window.num_global_units == window.window.num_global_units > 0
