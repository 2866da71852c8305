"""Hooks a test switches on for one recipe run through its environment; tests/launcher.py
applies them in each rank around ``tune run``. Off (nothing patched) without their variables."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# A run whose env sets this times the skipped gradient-scaling pass with a steady clock: the
# real pass runs (its multiply by 1 must leave the weights as they are), and its time is the
# subset's element count in nanoseconds (a memory-bound pass), so every sample scales up to the
# same figure, STEADY_SAVED_MS_PER_ELEMENT per gradient element. On a busy machine the real
# samples may disagree, and the run then rightly withholds the figure ([saved latency on a busy
# machine]): a launch's test must not depend on that; tests/test_profiling.py times the real
# pass in-process and drives the figure with an injected clock.
STEADY_SCALING_PASS = "EXACTGA_TESTS_STEADY_SCALING_PASS"
STEADY_SAVED_MS_PER_ELEMENT = 1e-6

# A run whose env sets this to N gets a SIGTERM from itself once step N ends, as a scheduler's
# preemption would send it: the real handler records it and the run stops at the step boundary
# after step N with its step checkpoint and stop line (see [stop at a step boundary] in
# exactga.launch.stopping), at a step a test can name, which a signal sent from outside cannot.
STOP_AFTER_STEP = "EXACTGA_TESTS_STOP_AFTER_STEP"

# A run whose env sets this runs every ``torch.compile`` eagerly (``set_stance("force_eager")``),
# torch's switch for what ``TORCHDYNAMO_DISABLE=1`` does, which a forked run cannot use: torch
# reads that variable where a function is decorated, and torchao decorates its optimizer step when
# it is imported (tests/torchao_eager_runs.py: a 40 s compile on 2 cores, torchao's business).
FORCE_EAGER = "EXACTGA_TESTS_FORCE_EAGER"

# A GA parity run whose env sets this writes its report as without matplotlib (the report's own
# path: no parity.png, a line saying so). Drawing the figure is about half of a small report's
# CPU (constrained layout over two axes per mode); the figure does not depend on the objective
# (its inputs are the runs' losses and distances), and tests/test_recipe_ga_parity.py and
# tests/test_ga_parity_distributed.py draw it, fp32 and bf16, and check it. Runs whose tests
# read only the numbers set this.
NO_FIGURE = "EXACTGA_TESTS_NO_FIGURE"


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Every hook whose variable the run's environment sets."""
    with _steady_scaling_pass(), _stop_after_step(), _force_eager(), _no_figure():
        yield


@contextlib.contextmanager
def _no_figure() -> Iterator[None]:
    if not os.environ.get(NO_FIGURE):
        yield
        return
    from exactga.parity import report

    real = report._has_matplotlib
    report._has_matplotlib = lambda: False
    try:
        yield
    finally:
        report._has_matplotlib = real


@contextlib.contextmanager
def _force_eager() -> Iterator[None]:
    if not os.environ.get(FORCE_EAGER):
        yield
        return
    import torch

    with torch.compiler.set_stance("force_eager"):
        yield


@contextlib.contextmanager
def _steady_scaling_pass() -> Iterator[None]:
    if not os.environ.get(STEADY_SCALING_PASS):
        yield
        return
    from exactga.profiling import saved_latency

    real = saved_latency.time_scaling_pass

    def steady(grads: list, device) -> float:
        real(grads, device)  # the multiply by 1 still runs; only its duration is replaced
        return STEADY_SAVED_MS_PER_ELEMENT * sum(g.numel() for g in grads)

    saved_latency.time_scaling_pass = steady
    try:
        yield
    finally:
        saved_latency.time_scaling_pass = real


@contextlib.contextmanager
def _stop_after_step() -> Iterator[None]:
    if not os.environ.get(STOP_AFTER_STEP):
        yield
        return
    import signal

    from exactga.run.steps import StepBook

    stop_after = int(os.environ[STOP_AFTER_STEP])
    real = StepBook.end_step

    def end_step(self, *args, **kwargs):
        report = real(self, *args, **kwargs)
        if self.progress.global_step == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
        return report

    StepBook.end_step = end_step
    try:
        yield
    finally:
        StepBook.end_step = real
