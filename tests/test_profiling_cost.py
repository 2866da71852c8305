"""What measuring the saved latency costs: gradient elements scaled per step, counted.

A gradient-pass counter (a ``TorchFunctionMode`` that adds up the elements of every in-place
multiply whose target is a parameter's gradient) watches whole optimizer steps of the real
``train_window``. Stock torchtune's pass (``post_scale``) shows up as every gradient element
on every step; exact mode with the profiler hook shows the few bounded samples and then zero.
"""

from __future__ import annotations

import torch
from grouping import GroupingNormalizer
from torch.overrides import TorchFunctionMode
from unit_utils import make_loss, make_rows, micro_batch_loss, split, tiny_model

from exactga import profiling
from exactga.accumulation.normalization import NormMode
from exactga.accumulation.step import train_window
from exactga.profiling import setup_profiler
from exactga.profiling.saved_latency import SAVED_LATENCY_REPEATS

CPU = torch.device("cpu")
IN_PLACE_MULTIPLIES = {torch.Tensor.__imul__, torch.Tensor.mul_, torch._foreach_mul_}


class GradientPassCounter(TorchFunctionMode):
    """Counts the gradient elements that in-place multiplies touch, per optimizer step."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self._model = model
        self.num_scaled = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in IN_PLACE_MULTIPLIES:
            grads = {id(p.grad) for p in self._model.parameters() if p.grad is not None}
            targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.num_scaled += sum(t.numel() for t in targets if id(t) in grads)
        return func(*args, **(kwargs or {}))


def scaled_elements_per_step(mode: NormMode, num_steps: int, every_n: int) -> tuple[list, int]:
    """Train ``num_steps`` steps of a tiny model in ``mode`` with the profiler hook sampling
    every ``every_n`` steps; the gradient elements scaled in each step, and one full pass's."""
    model = tiny_model(num_layers=1)
    loss_fn = make_loss("cross_entropy", model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no clipping: no other pass
    profiler = setup_profiler(
        None, CPU, model, output_dir="/tmp/unused", saved_latency_every_n_steps=every_n
    )
    normalizer = GroupingNormalizer(loss_fn, 2, mode=mode)
    rows = [row for row in make_rows() if len(row[0]) < 10]  # short rows: cheap steps
    per_step = []
    with profiler:
        for step in range(1, num_steps + 1):
            (window,) = normalizer.windows(split(rows, 2), max_windows=1)
            with GradientPassCounter(model) as counter:
                train_window(
                    window,
                    model=model,
                    loss_step=lambda batch: micro_batch_loss(model, loss_fn, batch),
                    optimizer=optimizer,
                    profiler=profiler,
                    device=CPU,
                    step=step,
                )
            per_step.append(counter.num_scaled)
            profiler.step(window.work())
    return per_step, sum(p.numel() for p in model.parameters())


def test_the_counter_sees_stocks_pass_on_every_step() -> None:
    per_step, num_elements = scaled_elements_per_step(NormMode.POST_SCALE, 3, every_n=0)
    assert per_step == [num_elements] * 3


def test_sampling_costs_at_most_one_percent_of_stock_over_100_steps() -> None:
    """Stock scales 100 x every element in 100 steps; the hook's five samples at steps 2, 12,
    ..., 42, three timings each, scale at most 1 % of that together, and no step after them
    scales anything."""
    per_step, num_elements = scaled_elements_per_step(NormMode.EXACT, 100, every_n=10)
    sampled_steps = [step for step, n in enumerate(per_step, start=1) if n]
    assert sampled_steps == [2, 12, 22, 32, 42]
    assert len(sampled_steps) == profiling.SAVED_LATENCY_NUM_SAMPLES
    assert all(n == 0 for n in per_step[42:])  # sampling over: zero elements per step
    # Each sample times its subset SAVED_LATENCY_REPEATS times; see [saved latency].
    budget = SAVED_LATENCY_REPEATS * profiling.SAVED_LATENCY_FRACTION * num_elements
    assert all(n <= budget for n in per_step)
    share = sum(per_step) / (100 * num_elements)
    print(f"sampled {sum(per_step)} of stock's {100 * num_elements} elements: {share:.3%}")
    assert share <= 0.01
