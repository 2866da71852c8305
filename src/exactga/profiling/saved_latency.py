"""The saved latency: what the gradient-scaling pass that exact mode skips would have cost.

A few sampled steps time stock torchtune's pass on part of the gradients and scale the time up;
the run reports the samples' median and range. See [saved latency].

Note [saved latency]
Stock torchtune scales every gradient element on every step; measuring what that costs must not
cost nearly as much. So the hook samples a bounded number of steps (``SAVED_LATENCY_NUM_SAMPLES``:
step 2, after the warm-up step that allocates gradients and optimizer state, then every
``saved_latency_every_n_steps``-th step after it), and never again: from then on no gradient
element is touched. Each sample scales a fixed subset of about ``SAVED_LATENCY_FRACTION`` of
the gradient elements (every tenth gradient tensor, from an offset that rotates between
samples, skipping any that would overrun the budget), times it with the device synchronised
around it, and scales the time up by total elements over sampled elements. Five samples of a
tenth make half of one full pass in the whole run: 0.5 % of what stock spends in 100 steps.
The run reports the samples' median and range, and warns when the range is wider than the
median (a busy machine; the figure then means little).
The estimator is exact when the pass costs the same per element (a memory-bound pass over large
tensors, as on a GPU). Each tensor also costs a fixed launch overhead; the estimate misses it by
``overhead share x (tensor share / element share - 1)``, where the shares are the subset's
fraction of the tensors and of the elements: positive when the subset holds smaller tensors
than average, negative for larger ones. The report prints both shares.
The pass sits between the last backward and the optimizer step. Multiplying by exactly 1
changes no bit, so trained weights are identical with the measurement on or off (a test checks
this).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

# The bounded sampling of the gradient pass exact mode skips; see [saved latency].
SAVED_LATENCY_FIRST_STEP = 2  # step 1 allocates the gradients and the optimizer state
SAVED_LATENCY_NUM_SAMPLES = 5  # and after these, never again
SAVED_LATENCY_FRACTION = 0.1  # of the gradient elements, per sample
SAVED_LATENCY_MAX_SPREAD = 1.0  # a range wider than this times the median is flagged


@dataclasses.dataclass(frozen=True)
class SavedLatencySample:
    """One timed sample of the gradient pass, on a subset of the gradients."""

    step: int
    measured_ms: float  # the pass over the subset alone
    num_elements: int  # gradient elements the subset holds
    num_tensors: int
    total_elements: int  # what stock's full pass scales
    total_tensors: int

    @property
    def estimate_ms(self) -> float:
        """The full pass, scaled up from the subset by element count; see [saved latency]."""
        return self.measured_ms * self.total_elements / self.num_elements


@dataclasses.dataclass(frozen=True)
class SavedLatency:
    """The run's saved-latency figure: the samples' median and range."""

    samples: tuple[SavedLatencySample, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(s.estimate_ms for s in self.samples)

    @property
    def low_ms(self) -> float:
        return min(s.estimate_ms for s in self.samples)

    @property
    def high_ms(self) -> float:
        return max(s.estimate_ms for s in self.samples)

    @property
    def too_noisy(self) -> bool:
        """The range is wider than ``SAVED_LATENCY_MAX_SPREAD`` times the median."""
        return self.high_ms - self.low_ms > SAVED_LATENCY_MAX_SPREAD * self.median_ms

    @property
    def element_share(self) -> float:
        """The samples' mean share of the gradient elements."""
        return statistics.fmean(s.num_elements / s.total_elements for s in self.samples)

    @property
    def tensor_share(self) -> float:
        """The samples' mean share of the gradient tensors."""
        return statistics.fmean(s.num_tensors / s.total_tensors for s in self.samples)

    @property
    def num_full_passes(self) -> float:
        """Elements the samples scaled in all, in full passes (stock runs one per step)."""
        return sum(s.num_elements / s.total_elements for s in self.samples)

    def describe(self) -> str:
        return (
            f"median of {len(self.samples)} samples, range {self.low_ms:.2f} to "
            f"{self.high_ms:.2f} ms; each timed the pass on {self.element_share:.0%} of the "
            f"gradient elements ({self.tensor_share:.0%} of the tensors) and scaled it up"
        )

    def warning(self) -> str | None:
        if not self.too_noisy:
            return None
        return (
            f"the saved-latency samples range from {self.low_ms:.2f} to {self.high_ms:.2f} ms "
            f"around a median of {self.median_ms:.2f} ms, wider than the median itself: the "
            "machine was busy or the pass is too short to time here, so the figure means little."
        )


def summary_line(saved: SavedLatency | None, step_ms: float | None, num_steps: int) -> str:
    """The end-of-run line on the saved latency (and its warning, if any)."""
    if saved is None or step_ms is None:
        return "exactga: no gradient-scaling pass was timed in this run."
    median = saved.median_ms
    line = (
        f"exactga: skipping the gradient-scaling pass saved {median:.2f} ms per optimizer "
        f"step ({100 * median / step_ms:.1f}% of {step_ms:.1f} ms; {saved.describe()}), "
        f"about {median * num_steps / 1e3:.1f} s over {num_steps} steps."
    )
    warning = saved.warning()
    return line + (f"\nexactga: warning: {warning}" if warning else "")


class SavedLatencySampler:
    """Takes the run's few samples of the gradient pass exact mode skips; see [saved latency]."""

    def __init__(self, every_n_steps: int, device: torch.device) -> None:
        self._every_n_steps = every_n_steps  # 0: no samples
        self._device = device
        self.samples: list[SavedLatencySample] = []

    def sample_index(self, step: int) -> int | None:
        """Which sample step ``step`` takes (0, 1, ...), or ``None``."""
        if self._every_n_steps == 0:
            return None
        offset = step - SAVED_LATENCY_FIRST_STEP
        if offset < 0 or offset % self._every_n_steps:
            return None
        index = offset // self._every_n_steps
        return index if index < SAVED_LATENCY_NUM_SAMPLES else None

    def sample(
        self,
        model: nn.Module,
        step: int,
        region: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        """If step ``step`` is sampled, time the pass on its subset of ``model``'s gradients
        (inside ``region()``, a trace label) and keep the sample."""
        index = self.sample_index(step)
        if index is None:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return  # optimizer_in_bwd consumed the gradients: nothing to scale
        subset = sample_gradients(grads, index)
        if not subset:
            return  # no gradient tensor fits the sample's budget (a one-tensor model)
        with region():
            measured_ms = time_scaling_pass(subset, self._device)
        self.samples.append(
            SavedLatencySample(
                step=step,
                measured_ms=measured_ms,
                num_elements=sum(g.numel() for g in subset),
                num_tensors=len(subset),
                total_elements=sum(g.numel() for g in grads),
                total_tensors=len(grads),
            )
        )

    @property
    def saved_latency(self) -> SavedLatency | None:
        """The samples so far, as median and range; ``None`` before the first."""
        return SavedLatency(tuple(self.samples)) if self.samples else None


def sample_gradients(
    grads: list[torch.Tensor], sample_index: int, fraction: float = SAVED_LATENCY_FRACTION
) -> list[torch.Tensor]:
    """The gradients sample ``sample_index`` scales: every ``1/fraction``-th tensor, from an
    offset that rotates with the sample, skipping any that would take the sample past
    ``fraction`` of the elements. See [saved latency].

    If none of those fits, the smallest tensor that does; if none does at all, nothing.
    """
    budget = fraction * sum(g.numel() for g in grads)
    stride = max(1, round(1 / fraction))
    chosen: list[torch.Tensor] = []
    num_elements = 0
    for grad in grads[sample_index % stride :: stride]:
        if num_elements + grad.numel() <= budget:
            chosen.append(grad)
            num_elements += grad.numel()
    if not chosen:
        smallest = min(grads, key=lambda g: g.numel(), default=None)
        if smallest is not None and smallest.numel() <= budget:
            chosen = [smallest]
    return chosen


def scale_gradients(grads: list[torch.Tensor], scaler: torch.Tensor) -> None:
    """Stock torchtune's ``scale_grads`` over ``grads``: one in-place multiply per tensor."""
    for grad in grads:
        grad *= scaler


def time_scaling_pass(grads: list[torch.Tensor], device: torch.device) -> float:
    """Milliseconds of stock's gradient-scaling pass over ``grads``, by a factor of exactly 1
    (no gradient changes); the device is synchronised around it. Stock's one copy of the
    factor to the device is left out: a fixed cost, which scaling up would multiply."""
    scaler = torch.tensor(1.0, device=device)
    synchronize(device)
    t0 = time.perf_counter()
    scale_gradients(grads, scaler)
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def synchronize(device: torch.device) -> None:
    """Wait for ``device`` if it is a CUDA device (on the CPU the pass runs on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
