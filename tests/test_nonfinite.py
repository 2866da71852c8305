"""Unit tier: a step whose loss is NaN or inf never reaches the optimizer, on 1 and 2 CPU ranks.

``train_window`` runs a tiny Llama over real windows from ``LossNormalizer``; a loss step that
poisons one micro-batch stands in for a diverging run. The skipped step must leave no trace (the
weights, the optimizer state and the next step are exactly as if the window had not been there),
and under data parallelism a NaN on one rank must skip the step on every rank. See [non-finite
loss] in ``exactga.accumulation.step``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from grouping import GroupingNormalizer
from torch import nn
from unit_utils import make_rows, micro_batch_loss, split, tiny_model

from exactga.accumulation.normalization import Window
from exactga.accumulation.step import StepOutcome, train_window
from exactga.config.options import NonFinitePolicy, as_option
from exactga.profiling import ProfilerSettings, TrainingProfiler
from exactga.run.steps import NonFiniteLossError, handle_nonfinite_loss

CPU = torch.device("cpu")
GA = 2


def quiet_profiler(model: nn.Module) -> TrainingProfiler:
    """The profiler hook with nothing enabled: no trace, no phase timing, no sampled pass."""
    settings = ProfilerSettings(log_timings=False, saved_latency_every_n_steps=0)
    return TrainingProfiler(settings, CPU, model)


def make_windows(loss_fn: nn.Module, rows: list, dp_group=None) -> list[Window]:
    """Windows of GA micro-batches of two rows each."""
    return list(GroupingNormalizer(loss_fn, GA, dp_group=dp_group).windows(split(rows, 2)))


class PoisonedLossStep:
    """The recipes' loss step, with the loss of chosen calls multiplied by ``bad_value``."""

    def __init__(self, model: nn.Module, loss_fn: nn.Module) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.poisoned_calls: set[int] = set()
        self.bad_value = math.nan
        self.num_calls = 0

    def poison(self, call: int, bad_value: float = math.nan) -> None:
        self.poisoned_calls.add(call)
        self.bad_value = bad_value

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = micro_batch_loss(self.model, self.loss_fn, batch)
        if self.num_calls in self.poisoned_calls:
            loss = loss * self.bad_value
        self.num_calls += 1
        return loss


def run(
    window: Window,
    model: nn.Module,
    loss_step,
    optimizer: torch.optim.Optimizer | None,
    step: int = 1,
) -> StepOutcome:
    return train_window(
        window,
        model=model,
        loss_step=loss_step,
        optimizer=optimizer,
        profiler=quiet_profiler(model),
        device=CPU,
        step=step,
        clip_grad_norm=1.0,
    )


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_equal_tensors(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """Copies of the per-parameter state (step, exp_avg, exp_avg_sq)."""
    return {
        index: {key: value.clone() for key, value in state.items()}
        for index, state in optimizer.state_dict()["state"].items()
    }


def train(windows: list[Window], loss_fn: nn.Module, poison: dict[int, float]):
    """Train a fresh model over ``windows``; ``poison`` maps loss-step calls to a bad factor."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_step = PoisonedLossStep(model, loss_fn)
    for call, bad_value in poison.items():
        loss_step.poison(call, bad_value)
    outcomes = []
    for step, window in enumerate(windows, start=1):
        before = (weights(model), optimizer_state(optimizer))
        outcome = run(window, model, loss_step, optimizer, step)
        after_grads = [p.grad for p in model.parameters()]
        outcomes.append((outcome, before, after_grads))
    return model, optimizer, outcomes


# --- one rank ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_value", [math.nan, math.inf])
@pytest.mark.parametrize("bad_micro_step", [0, 1])
def test_nonfinite_window_is_dropped_and_leaves_no_trace(
    bad_value: float, bad_micro_step: int
) -> None:
    loss_fn = nn.CrossEntropyLoss()
    rows = make_rows(0) + make_rows(1)[:4]  # twelve rows: three windows of two micro-batches
    # Window 2 (loss-step calls 2 and 3) has a non-finite micro-batch.
    model, optimizer, outcomes = train(
        make_windows(loss_fn, rows), loss_fn, {2 + bad_micro_step: bad_value}
    )
    first, (bad, before_bad, bad_grads), last = outcomes

    assert not first[0].skipped and not first[0].nonfinite
    assert bad.nonfinite and bad.skipped and bad.grad_norm is None
    assert all(grad is None for grad in bad_grads)  # dropped, not left for the next window
    assert not last[0].nonfinite and not last[0].skipped
    weights_before_bad, state_before_bad = before_bad
    weights_after_bad, state_after_bad = last[1]
    assert_equal_tensors(weights_after_bad, weights_before_bad)
    assert state_after_bad.keys() == state_before_bad.keys()
    for index, state in state_before_bad.items():
        assert_equal_tensors(list(state_after_bad[index].values()), list(state.values()))

    # The run is exactly the run without the bad window: nothing of it leaked into the next step.
    reference_windows = make_windows(loss_fn, rows)
    del reference_windows[1]
    reference, _, _ = train(reference_windows, loss_fn, {})
    assert_equal_tensors(weights(model), weights(reference))


def test_nonfinite_first_step_leaves_a_fresh_optimizer_empty() -> None:
    loss_fn = nn.CrossEntropyLoss()
    model = tiny_model()
    initial = weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_step = PoisonedLossStep(model, loss_fn)
    loss_step.poison(0)
    (window, _) = make_windows(loss_fn, make_rows())

    outcome = run(window, model, loss_step, optimizer)

    assert outcome.nonfinite and outcome.skipped
    assert optimizer.state_dict()["state"] == {}
    assert_equal_tensors(weights(model), initial)
    assert all(p.grad is None for p in model.parameters())


def test_without_optimizer_nonfinite_is_reported_and_grads_are_left_alone() -> None:
    """``optimizer_in_bwd``: the recipe owns the gradients; train_window only reports."""
    loss_fn = nn.CrossEntropyLoss()
    model = tiny_model()
    loss_step = PoisonedLossStep(model, loss_fn)
    finite_window, bad_window = make_windows(loss_fn, make_rows())

    finite = run(finite_window, model, loss_step, optimizer=None)
    assert finite == StepOutcome(skipped=False)
    finite_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    loss_step.poison(loss_step.num_calls)  # the second window's first micro-batch
    outcome = run(bad_window, model, loss_step, optimizer=None)

    # Reported, but not skipped: the optimizer already stepped inside backward.
    assert outcome.nonfinite and not outcome.skipped
    grads = [p.grad for p in model.parameters()]
    assert all(grad is not None for grad in grads)
    assert not all(torch.isfinite(grad).all() for grad in grads)
    assert len(grads) == len(finite_grads)


# --- two ranks ---------------------------------------------------------------------------------


def _worker(rank: int) -> list[dict]:
    torch.set_num_threads(1)  # two ranks on a small machine
    loss_fn = nn.CrossEntropyLoss()
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_step = PoisonedLossStep(model, loss_fn)
    if rank == 1:
        loss_step.poison(1)  # the second micro-batch of the first window, on rank 1 only
    rows = make_rows(0)[4 * rank : 4 * rank + 4] + make_rows(1)[4 * rank : 4 * rank + 4]
    windows = make_windows(loss_fn, rows, dp_group=dist.group.WORLD)
    results = []
    for step, window in enumerate(windows, start=1):
        before = weights(model)
        reductions = []
        all_reduce = dist.all_reduce

        def recording(tensor, *args, _all_reduce=all_reduce, _seen=reductions, **kwargs):
            _seen.append([str(tensor.dtype), kwargs.get("op") == dist.ReduceOp.MIN])
            return _all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = recording
        try:
            outcome = run(window, model, loss_step, optimizer, step)
        finally:
            dist.all_reduce = all_reduce
        results.append(
            {
                "nonfinite": outcome.nonfinite,
                "skipped": outcome.skipped,
                "weights_changed": any(
                    not torch.equal(a, b) for a, b in zip(weights(model), before, strict=True)
                ),
                "grads_dropped": all(p.grad is None for p in model.parameters()),
                "reductions": reductions,
            }
        )
    return results


def test_nan_on_one_rank_skips_the_step_on_every_rank(two_ranks) -> None:
    # Forked, not spawned: the children inherit the imported torch and torchtune instead of
    # importing them again, which is most of a spawned test's time.
    results = two_ranks(_worker, start_method="fork")
    for rank_results in results:
        bad, good = rank_results
        assert bad["nonfinite"] and bad["skipped"]
        assert not bad["weights_changed"] and bad["grads_dropped"]
        assert not good["nonfinite"] and not good["skipped"] and good["weights_changed"]
        # one 1-byte MIN reduction per step, and nothing else inside the step
        assert bad["reductions"] == [["torch.uint8", True]]
        assert good["reductions"] == [["torch.uint8", True]]


# --- the policy ------------------------------------------------------------------------------


class SaveSpy:
    def __init__(self) -> None:
        self.num_calls = 0

    def __call__(self) -> Path:
        self.num_calls += 1
        return Path("/out/step_checkpoints/step_000017")


def test_skip_warns_with_the_step_and_saves_nothing() -> None:
    save = SaveSpy()
    with pytest.warns(UserWarning, match=r"step 17\b"):
        handle_nonfinite_loss(NonFinitePolicy.SKIP, 17, weights_updated=False, save_checkpoint=save)
    assert save.num_calls == 0


def test_stop_saves_once_and_raises_naming_the_step_and_the_checkpoint() -> None:
    save = SaveSpy()
    with pytest.raises(NonFiniteLossError) as err:
        handle_nonfinite_loss(NonFinitePolicy.STOP, 17, weights_updated=False, save_checkpoint=save)
    assert save.num_calls == 1
    assert "step 17" in str(err.value)
    assert "/out/step_checkpoints/step_000017" in str(err.value)


@pytest.mark.parametrize("policy", list(NonFinitePolicy))
def test_updated_weights_stop_the_run_without_saving(policy: NonFinitePolicy) -> None:
    save = SaveSpy()
    with pytest.raises(NonFiniteLossError, match=r"step 17\b"):
        handle_nonfinite_loss(policy, 17, weights_updated=True, save_checkpoint=save)
    assert save.num_calls == 0


def test_nonfinite_policy_from_config() -> None:
    assert as_option(NonFinitePolicy, "skip", "nonfinite_loss") is NonFinitePolicy.SKIP
    stop = NonFinitePolicy.STOP
    assert as_option(NonFinitePolicy, stop, "nonfinite_loss") is stop
    with pytest.raises(ValueError, match=r"'nonfinite_loss'='ignore': choose one of skip, stop"):
        as_option(NonFinitePolicy, "ignore", "nonfinite_loss")
