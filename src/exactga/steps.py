"""What a training recipe does around each optimizer step, decided once for every recipe.

The recipes keep their loop in sight, so a user reading or editing a copy sees the step::

    with self._profiler:
        for curr_epoch in progress.epochs():
            for window in self._steps.windows(curr_epoch):
                outcome = train_window(window, ...)
                report = self._steps.end_step(window, outcome)  # .loss: on logged steps
                print(f"step {report.step}: loss {report.loss}")  # a user's line, bar-safe
            self._steps.end_epoch(curr_epoch)

and :class:`StepBook` does the rest; see [step bookkeeping] and [bar-safe output].
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from exactga.metric_logging import flush_metric_logger
from exactga.normalization import Window
from exactga.optimizers import steps_in_backward
from exactga.progress import TrainingProgress
from exactga.training import NonFinitePolicy, StepOutcome, handle_nonfinite_loss, step_metrics

# Note [step bookkeeping]
# After ``train_window`` every recipe does the same things in the same order, and each is a
# number it logs or a file it writes, so each is decided here once:
# 1. the counters move (``TrainingProgress.record_step``), then the learning-rate scheduler
#    steps, on skipped steps too (torchtune's schedule counts optimizer steps, taken or not);
# 2. a non-finite loss gets the config's policy (``nonfinite_loss``), which may save and stop;
# 3. the profiler is told the step's work, the progress bar moves;
# 4. on a logged step: the loss, the learning rate, the loss tokens per second per rank since
#    the last logged step (every rank's tokens over the world size), the profiler's and the
#    recipe's own metrics; every rank takes part (the loss is one all-reduce), rank 0 writes;
# 5. a step checkpoint when one is due.
# At an epoch's end the epoch closes before both saves (see [epoch close] in exactga.progress),
# then the epoch checkpoint, then, when step checkpoints are on, one of the closed epoch.

# Note [bar-safe output]
# While an epoch's progress bar is drawn, a line printed to stdout, or logged, would land on the
# bar's line and leave the bar broken in two. So from ``open_epoch`` to ``end_epoch`` stdout and
# the console handlers of the root and torchtune loggers write through ``tqdm.write``, which
# clears the bar, writes the line and draws the bar again below it: a user's ``print`` in a
# copied recipe's loop (or ``log.info``) needs nothing special.


@dataclass(frozen=True)
class StepReport:
    """What one optimizer step did, for a recipe that wants to print or act on it.

    ``loss`` is the exact window loss over every rank, read only on logged steps (it costs a
    host read and, under data parallelism, an all-reduce); ``None`` otherwise and on a skipped
    window. ``metrics`` is what was logged, empty on a step not logged.
    """

    step: int
    skipped: bool
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class StepBook:
    """The bookkeeping of a recipe's loop: windows in, logs and checkpoints out.

    Args:
        progress: the run's counters.
        dataloader: the recipe's loader of windows (``exactga.data``).
        normalizer: the recipe's ``LossNormalizer``.
        profiler: the recipe's ``TrainingProfiler``.
        optimizer: the recipe's optimizer: the logged learning rate is read from it, and an
            ``OptimizerInBackward`` (``optimizer_in_bwd``) means a non-finite step has already
            changed the weights.
        lr_scheduler: stepped after every step, or ``None``.
        nonfinite_policy: the config's ``nonfinite_loss``.
        save_step_checkpoint: writes a step checkpoint and returns its folder (collective).
        save_epoch_checkpoint: writes the checkpoint of an epoch (collective).
        save_every_n_steps: the config's ``save_every_n_steps`` (``None``: no step checkpoints).
        log_every_n_steps: the config's ``log_every_n_steps``.
        metric_logger: where logged metrics go; ``None`` on ranks that do not write.
        world_size: data-parallel ranks (tokens per second are per rank).
        memory_device: logs peak-memory statistics of this device, or ``None``.
        window_metrics: the recipe's own metrics of a logged window (every rank calls it).
        track: wraps each epoch's windows (the distiller's ``track``), or ``None``.
        show_progress: draw the progress bar (rank 0).
        clock: seconds, for the tokens-per-second figure; injected by tests.
    """

    def __init__(
        self,
        progress: TrainingProgress,
        *,
        dataloader: Any,
        normalizer: Any,
        profiler: Any,
        optimizer: Any,
        lr_scheduler: Any,
        nonfinite_policy: NonFinitePolicy,
        save_step_checkpoint: Callable[[], Path],
        save_epoch_checkpoint: Callable[[int], Any],
        save_every_n_steps: int | None,
        log_every_n_steps: int,
        metric_logger: Any | None,
        world_size: int = 1,
        memory_device: torch.device | None = None,
        window_metrics: Callable[[Window], dict[str, float]] | None = None,
        track: Callable[[Iterable[Window]], Iterable[Window]] | None = None,
        show_progress: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.progress = progress
        self.dataloader = dataloader
        self.normalizer = normalizer
        self.profiler = profiler
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.nonfinite_policy = nonfinite_policy
        self.save_step_checkpoint = save_step_checkpoint
        self.save_epoch_checkpoint = save_epoch_checkpoint
        self.save_every_n_steps = save_every_n_steps
        self.log_every_n_steps = log_every_n_steps
        self.metric_logger = metric_logger
        self.world_size = world_size
        self.memory_device = memory_device
        self.window_metrics = window_metrics
        self.track = track
        self.show_progress = show_progress
        self.clock = clock
        self._epoch = 0
        self._pbar: Any = None
        self._bar_safe_output = contextlib.ExitStack()
        self._num_tokens_since_log = 0
        self._last_log_time: float | None = None

    def windows(self, epoch: int) -> Iterator[Window]:
        """The windows of ``epoch`` still to train (all of them, or what a resume left), timed
        by the profiler."""
        self.open_epoch(epoch)
        windows = self.normalizer.windows(self.dataloader, self.progress.windows_left_in(epoch))
        yield from self.profiler.timed(self.track(windows) if self.track else windows)

    def open_epoch(self, epoch: int) -> None:
        """Start ``epoch``: the loader's shuffle, the progress bar, the first logged interval.
        :meth:`windows` calls it; a recipe whose windows do not come from its loader (GRPO's
        come from generated rollouts) calls it and then :meth:`end_step` for each window."""
        if self._last_log_time is None:  # the first logged interval starts with training
            self._last_log_time = self.clock()
        self._epoch = epoch
        self.dataloader.sampler.set_epoch(epoch)
        self.profiler.open_epoch()
        self._pbar = tqdm(
            total=self.progress.steps_per_epoch,
            initial=self.progress.steps_done_in(epoch),  # > 0 after a mid-epoch resume
            desc=f"epoch {epoch + 1}",
            disable=not self.show_progress,
        )
        if self.show_progress:
            self._bar_safe_output.enter_context(_bar_safe_output())

    def end_step(self, window: Window, outcome: StepOutcome) -> StepReport:
        """Everything after ``train_window`` returned; see [step bookkeeping]."""
        progress = self.progress
        progress.record_step(outcome.skipped, outcome.nonfinite)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if outcome.nonfinite:  # the same on every rank: the flag was reduced
            handle_nonfinite_loss(
                self.nonfinite_policy,
                progress.global_step,
                weights_updated=steps_in_backward(self.optimizer),
                save_checkpoint=self.save_step_checkpoint,
            )
        self._num_tokens_since_log += self._tokens_of(window)
        self.profiler.step(window.work())
        self._pbar.update(1)
        metrics: dict[str, float] = {}
        if progress.global_step % self.log_every_n_steps == 0:
            metrics = self._log(window, outcome)
        if progress.should_save_step_checkpoint(self.save_every_n_steps, self._epoch):
            self.save_step_checkpoint()
            flush_metric_logger(self.metric_logger)  # [resumed TensorBoard run]
        return StepReport(
            step=progress.global_step,
            skipped=outcome.skipped,
            loss=metrics.get("loss"),
            metrics=metrics,
        )

    def _tokens_of(self, window: Window) -> int:
        """The tokens a step counts for ``tokens_per_second_per_gpu``: the loss tokens of every
        rank, or, when the units are not tokens (pairs), the samples' own positions on all
        ranks as this rank's times the world size (padding is not work)."""
        if window.units_name == "loss_tokens":
            return window.num_global_units
        return window.num_sample_positions * self.world_size

    def _log(self, window: Window, outcome: StepOutcome) -> dict[str, float]:
        assert self._last_log_time is not None
        elapsed = self.clock() - self._last_log_time
        metrics = step_metrics(
            window,
            optimizer=self.optimizer,
            grad_norm=outcome.grad_norm,
            progress=self.progress,
            tokens_per_second_per_gpu=self._num_tokens_since_log / elapsed / self.world_size,
            memory_device=self.memory_device,
        )
        if self.window_metrics is not None:
            metrics.update(self.window_metrics(window))
        metrics.update(self.profiler.metrics(step=self.progress.global_step))
        if self.metric_logger is not None:
            self.metric_logger.log_dict(metrics, step=self.progress.global_step)
        if "loss" in metrics:
            self._pbar.set_postfix(loss=f"{metrics['loss']:.4f}")
        self._num_tokens_since_log, self._last_log_time = 0, self.clock()
        return metrics

    def end_epoch(self, epoch: int) -> None:
        """Close ``epoch`` and write its checkpoints, in the one order; see [step bookkeeping]."""
        self._pbar.close()
        self._bar_safe_output.close()
        self.progress.close_epoch()  # before both saves: see [epoch close] in exactga.progress
        self.save_epoch_checkpoint(epoch)
        if self.save_every_n_steps:
            self.save_step_checkpoint()
            flush_metric_logger(self.metric_logger)


@contextlib.contextmanager
def _bar_safe_output() -> Iterator[None]:
    """stdout and the console loggers through tqdm; see [bar-safe output]."""
    # torchtune's logger (utils.get_logger, the recipes' ``log``) has a handler of its own.
    loggers = [logging.getLogger(), logging.getLogger("torchtune.utils._logging")]
    with (
        logging_redirect_tqdm(loggers=loggers),
        contextlib.redirect_stdout(_LinesAboveTheBar(sys.stdout, bar_stream=sys.stderr)),
    ):
        yield


class _LinesAboveTheBar(io.TextIOBase):
    """Writes whole lines to ``stream`` with the progress bars drawn on ``bar_stream`` cleared
    first and drawn again after. (tqdm's ``DummyTqdmFile`` would not clear them: ``tqdm.write``
    clears bars on another stream only while ``sys.stdout`` is the real one.)"""

    def __init__(self, stream: Any, bar_stream: Any) -> None:
        self._stream, self._bar_stream, self._partial_line = stream, bar_stream, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines, newline, self._partial_line = (self._partial_line + text).rpartition("\n")
        if newline:
            self._write_above_the_bar(lines + newline)
        return len(text)

    def flush(self) -> None:
        if self._partial_line:
            self._write_above_the_bar(self._partial_line)
            self._partial_line = ""
        self._stream.flush()

    def _write_above_the_bar(self, text: str) -> None:
        with tqdm.external_write_mode(file=self._bar_stream):
            self._stream.write(text)
            self._stream.flush()
