"""The saved latency: what the gradient-scaling pass that exact mode skips would have cost.

A few sampled steps time stock torchtune's pass on part of the gradients, each the fastest of a
few repeats, and scale the time up; the run reports the samples' median and range, or says
plainly why it gives no figure. See [saved latency] and [saved latency on a busy machine].

Note [saved latency]
Stock torchtune scales every gradient element on every step; measuring what that costs must not
cost nearly as much. So the hook samples a bounded number of steps (``SAVED_LATENCY_NUM_SAMPLES``:
step 2, after the warm-up step that allocates gradients and optimizer state, then every
``saved_latency_every_n_steps``-th step after it), and never again: from then on no gradient
element is touched. Each sample scales a fixed subset of about ``SAVED_LATENCY_FRACTION`` of
the gradient elements (every tenth gradient tensor, from an offset that rotates between
samples, skipping any that would overrun the budget) ``SAVED_LATENCY_REPEATS`` times, each
timed with the device synchronised around it, keeps the fastest, and scales it up by total
elements over sampled elements. Five samples of a tenth, three times each, make one and a half
full passes in the whole run: 1.5 % of what stock spends in 100 steps.
The estimator is exact when the pass costs the same per element (a memory-bound pass over large
tensors, as on a GPU). Each tensor also costs a fixed launch overhead; the estimate misses it by
``overhead share x (tensor share / element share - 1)``, where the shares are the subset's
fraction of the tensors and of the elements: positive when the subset holds smaller tensors
than average, negative for larger ones. The report prints both shares.
The pass sits between the last backward and the optimizer step. Multiplying by exactly 1
changes no bit, however often, so trained weights are identical with the measurement on or off
(a test checks this).

Note [saved latency on a busy machine]
An interruption (another process taking the core, a page fault) only ever adds time, so each
sample keeps the fastest of its repeats: one interrupted repeat does not move it, and a
sample is inflated only if every repeat was. Across samples the median ignores a minority that
still were. A figure then needs two things, else the run says so in words instead of a
percentage: at least ``SAVED_LATENCY_MIN_SAMPLES`` samples (one sample of a 4-step run, scaled up
25 times, once read as 38.5 % of the step), and samples that agree: their median absolute
deviation at most ``SAVED_LATENCY_MAX_SPREAD`` of their median (the range alone would withhold
the figure for one stray sample, which the median already ignores). The end-of-run line and the
logged scalars (``normalization/saved_ms``, ``normalization/saved_fraction``) read the same
figure from :attr:`SavedLatency.figure_ms`: a logged step's scalars are the figure the line
would give after that step, or none while it would give none, and from the last sample on the
same milliseconds. The logged share is of that interval's step (the line's, of the run's mean
step, includes the slow first steps, which would make a chart of it climb as they wash out).
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
# When a figure is given; see [saved latency on a busy machine].
SAVED_LATENCY_REPEATS = 3  # timings of a sample's subset; the fastest counts
SAVED_LATENCY_MIN_SAMPLES = 3  # fewer give no figure
SAVED_LATENCY_MAX_SPREAD = 0.5  # median absolute deviation over median; wider gives none


@dataclasses.dataclass(frozen=True)
class SavedLatencySample:
    """One timed sample of the gradient pass, on a subset of the gradients."""

    step: int
    measured_ms: float  # the pass over the subset alone, the fastest of its repeats
    num_elements: int  # gradient elements the subset holds
    num_tensors: int
    total_elements: int  # what stock's full pass scales
    total_tensors: int
    num_repeats: int = 1  # timings of the subset the sample took

    @property
    def estimate_ms(self) -> float:
        """The full pass, scaled up from the subset by element count; see [saved latency]."""
        return self.measured_ms * self.total_elements / self.num_elements


@dataclasses.dataclass(frozen=True)
class SavedLatency:
    """The run's saved-latency figure: the samples' median and range, given when there are
    enough samples and they agree (see [saved latency on a busy machine])."""

    samples: tuple[SavedLatencySample, ...]
    every_n_steps: int | None = None  # the config key, to say when more samples come

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
    def spread(self) -> float:
        """The samples' median absolute deviation, as a share of their median."""
        median = self.median_ms
        deviation = statistics.median(abs(s.estimate_ms - median) for s in self.samples)
        return deviation / median if median > 0 else float("inf")

    @property
    def too_few(self) -> bool:
        return len(self.samples) < SAVED_LATENCY_MIN_SAMPLES

    @property
    def too_noisy(self) -> bool:
        """The samples disagree by more than ``SAVED_LATENCY_MAX_SPREAD``."""
        return self.spread > SAVED_LATENCY_MAX_SPREAD

    @property
    def figure_ms(self) -> float | None:
        """The saved milliseconds per step the run reports, or ``None`` when it gives no figure
        (too few samples, or samples that disagree); the line and the scalars read this."""
        return None if self.too_few or self.too_noisy else self.median_ms

    def fraction_of(self, step_ms: float) -> float | None:
        """The figure as a share of ``step_ms``, or ``None`` without a figure."""
        figure = self.figure_ms
        return None if figure is None or step_ms <= 0 else figure / step_ms

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
        """Elements the samples scaled in all, repeats included, in full passes (stock runs
        one per step)."""
        return sum(s.num_repeats * s.num_elements / s.total_elements for s in self.samples)

    def describe(self) -> str:
        repeats = max(s.num_repeats for s in self.samples)
        each = f"the fastest of {repeats} timings of" if repeats > 1 else "timed"
        return (
            f"median of {len(self.samples)} samples, range {self.low_ms:.2f} to "
            f"{self.high_ms:.2f} ms; each {each} the pass on {self.element_share:.0%} of the "
            f"gradient elements ({self.tensor_share:.0%} of the tensors), scaled up"
        )

    def warning(self) -> str | None:
        """Why the run gives no figure, in words; ``None`` when it gives one."""
        if self.too_few:
            return (
                f"the saved latency is not given: the skipped gradient-scaling pass was timed "
                f"at {_count(len(self.samples), 'step')} ({_steps(self.samples)}), and a figure "
                f"needs {SAVED_LATENCY_MIN_SAMPLES}{self._more_samples_hint()}."
            )
        if self.too_noisy:
            return (
                f"the saved latency is not given: the {len(self.samples)} samples of the "
                f"skipped gradient-scaling pass disagree (range {self.low_ms:.2f} to "
                f"{self.high_ms:.2f} ms around a median of {self.median_ms:.2f} ms, half of "
                f"them more than {100 * self.spread:.0f}% from it, each already the fastest of "
                "its timings): the machine was busy or the pass is too short to time here."
            )
        return None

    def _more_samples_hint(self) -> str:
        """Which steps the samples come at, so a user sees how long a run must be."""
        if not self.every_n_steps:
            return ""
        last = SAVED_LATENCY_FIRST_STEP + (SAVED_LATENCY_MIN_SAMPLES - 1) * self.every_n_steps
        return (
            f" (steps {SAVED_LATENCY_FIRST_STEP}, "
            f"{SAVED_LATENCY_FIRST_STEP + self.every_n_steps}, ... with "
            f"saved_latency_every_n_steps={self.every_n_steps}: run {last} steps or more, or "
            "lower it)"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _steps(samples: tuple[SavedLatencySample, ...]) -> str:
    return ("step " if len(samples) == 1 else "steps ") + ", ".join(str(s.step) for s in samples)


def percent_of(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``, one decimal, or two significant digits below 0.1 %
    (a tiny model on a busy CPU saves 0.02 % of its step: "0.0%" would read as nothing)."""
    percent = 100 * part / whole
    return f"{percent:.2g}%" if 0 < abs(percent) < 0.1 else f"{percent:.1f}%"


def summary_line(saved: SavedLatency | None, step_ms: float | None, num_steps: int) -> str:
    """The end-of-run line on the saved latency: the figure, or why there is none."""
    if saved is None or step_ms is None:
        return "exactga: no gradient-scaling pass was timed in this run."
    figure = saved.figure_ms
    if figure is None:
        return f"exactga: {saved.warning()}"
    return (
        f"exactga: skipping the gradient-scaling pass saved {figure:.2f} ms per optimizer "
        f"step ({percent_of(figure, step_ms)} of {step_ms:.1f} ms; {saved.describe()}), "
        f"about {figure * num_steps / 1e3:.1f} s over {num_steps} steps."
    )


def saved_latency_metrics(saved: SavedLatency | None, step_ms: float | None) -> dict[str, float]:
    """The scalars of the figure :func:`summary_line` would give now, as a share of
    ``step_ms`` (the logged interval's): none while it gives no figure. See [saved latency on
    a busy machine]."""
    if saved is None or step_ms is None:
        return {}
    fraction = saved.fraction_of(step_ms)
    if fraction is None:
        return {}
    return {"normalization/saved_ms": saved.figure_ms, "normalization/saved_fraction": fraction}


class SavedLatencySampler:
    """Takes the run's few samples of the gradient pass exact mode skips; see [saved latency]."""

    def __init__(
        self, every_n_steps: int, device: torch.device, repeats: int = SAVED_LATENCY_REPEATS
    ) -> None:
        self._every_n_steps = every_n_steps  # 0: no samples
        self._device = device
        self._repeats = repeats
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
            # See [saved latency on a busy machine]: an interruption only adds time.
            measured_ms = min(time_scaling_pass(subset, self._device) for _ in range(self._repeats))
        self.samples.append(
            SavedLatencySample(
                step=step,
                measured_ms=measured_ms,
                num_elements=sum(g.numel() for g in subset),
                num_tensors=len(subset),
                total_elements=sum(g.numel() for g in grads),
                total_tensors=len(grads),
                num_repeats=self._repeats,
            )
        )

    @property
    def saved_latency(self) -> SavedLatency | None:
        """The samples so far, as median and range; ``None`` before the first."""
        if not self.samples:
            return None
        return SavedLatency(tuple(self.samples), every_n_steps=self._every_n_steps)


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
