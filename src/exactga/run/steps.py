"""What a training recipe does around each optimizer step, decided once for every recipe.

The recipes keep the step in sight, so a user reading or editing a copy sees it::

    with self._run as steps:  # exactga.wiring.run_start.TrainingRun: profiler, bar, report
        for curr_epoch in steps.epochs():
            for window in steps.windows(curr_epoch):
                for batch in window:                    # this rank's micro-batches
                    loss = self._loss_step(batch)       # forward and mean loss
                    window.backward(loss)               # exact share of the window, backward
                outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                steps.end_step(window, outcome)         # its StepReport: print() is bar-safe
            steps.end_epoch(curr_epoch)

and :class:`StepBook` does the rest; see [step bookkeeping], [bar-safe output] and [every
rank stops at one step]. ``print(report)`` shows any step (its loss where it was logged).
"""

from __future__ import annotations

import contextlib
import io
import logging
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torchtune.training.lr_schedulers import get_lr
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from exactga.accumulation.normalization import Window
from exactga.accumulation.optimizers import steps_in_backward
from exactga.accumulation.step import StepContext, StepOutcome, TrainingWindow
from exactga.config.options import NonFinitePolicy
from exactga.config.schemas import SingleDeviceRecipeConfig
from exactga.launch.stopping import RunStopped, resume_command, stop_request
from exactga.run.metric_logging import flush_metric_logger
from exactga.run.progress import TrainingProgress
from exactga.runtime.distributed import host_group, is_rank_zero, log_rank_zero, memory_stats

# Note [step bookkeeping]
# After ``window.step`` every recipe does the same things in the same order, and each is a
# number it logs or a file it writes, so each is decided here once:
# 1. the counters move (``TrainingProgress.record_step``), then the learning-rate scheduler
#    steps, on skipped steps too (torchtune's schedule counts optimizer steps, taken or not);
# 2. a non-finite loss gets the config's policy (``nonfinite_loss``), which may save and stop;
# 3. the profiler is told the step's work, the progress bar moves;
# 4. on a logged step: the loss, the learning rate, the loss tokens per second per rank since
#    the last logged step (every rank's tokens over the world size), the profiler's and the
#    recipe's own metrics; every rank takes part (the loss is one all-reduce), rank 0 writes;
# 5. a step checkpoint when one is due (at a step the recipe validates after, once the
#    validation is logged: see [the best checkpoint]);
# 6. once the recipe asks for the next window, a stop that SIGINT or SIGTERM asked for (see [every
#    rank stops at one step]).
# At an epoch's end the epoch closes before both saves (see [epoch close] in exactga.run.progress),
# then the epoch checkpoint, then, when step checkpoints are on or a stop waits, one of the
# closed epoch.

# Note [the best checkpoint]
# With ``keep_best_checkpoint`` (and ``dataset_val``), each validation whose figure beats the
# best so far saves the model's weights for users (the files of an epoch folder, through the
# same checkpointer; each model of PPO's beside its own epoch folders) as ``best/`` beside the
# epoch folders, with ``best/best_validation.json`` naming the step and the figure
# (``Checkpoints.save_best``: written under a hidden name, then renamed over the previous best).
# Which figure and which way is the family's validation's (``Validation.best``: the lowest
# ``val/loss`` of the loss families, GRPO's and PPO's highest ``val/reward_mean``); a tie keeps
# the earlier best and a non-finite figure is never the best. The best figure and its step are
# counters of the run (``TrainingProgress.best_val_figure``), so a step checkpoint records them
# and a resumed run compares with the same best as an uninterrupted one. For that, a step
# checkpoint due at a step the recipe validates after is written once the validation is logged
# (the recipe validates after ``end_step``): it records that validation's best, and the step's
# metrics are flushed with it. The figure is the same on every rank (all-reduced), so every
# rank takes the same decision and joins the collective save.

# Note [every rank stops at one step]
# A signal asks for a stop (see [stop at a step boundary] in exactga.launch.stopping); the run
# stops between two steps, after the recipe's ``end_step`` and before the next window, with a
# step checkpoint, also when ``save_every_n_steps`` is off (none twice: a checkpoint just
# written at that step is the stop's). torchrun passes a signal on to every rank, but each sees
# it at its own moment, maybe in another step, and a rank that stopped alone would leave the
# others waiting in their next collective. So at each boundary the ranks all-reduce (MAX) the
# number of the signal each has seen, 0 for none, and stop together when it is not 0: at the end
# of the step during which the first of them saw it. That is one all-reduce of one integer per
# step on a group of the host (the default group under gloo, a gloo group beside NCCL), so no
# device synchronises for it; the ranks wait there for the slowest host, which the step's own
# collectives already made them do. One process reduces nothing. benchmarks/stop_flag_cost.py
# times it on 2 gloo ranks: 0.7 to 2.1 ms a call on our 2 shared cores at load average 10 (the
# two processes waiting for a core), beside the ~1 s steps of the tiny 2-rank run there.
# Windows that come in indivisible groups (GRPO's ``ppo_epochs`` passes over one batch of
# rollouts, handed to ``training``) stop after a group's last window only: between rollout
# steps, where their step checkpoints fall too. The epoch's last step is saved once the epoch is
# closed (see [epoch close] in exactga.run.progress), so a stop there is made by ``end_epoch``,
# after the epoch checkpoint; a stop asked for during the run's last epoch end is none, since
# the run is complete. Outside the loop (before the first epoch, after the last) a signal stops
# at once.

# Note [bar-safe output]
# While an epoch's progress bar is drawn, a line printed to stdout, or logged, would land on the
# bar's line and leave the bar broken in two. So from ``open_epoch`` to ``end_epoch`` stdout and
# the console handlers of the root and torchtune loggers write through ``tqdm.write``, which
# clears the bar, writes the line and draws the bar again below it: a user's ``print`` in a
# copied recipe's loop (or ``log.info``) needs nothing special.


@dataclass(frozen=True)
class StepBookSettings:
    """The keys of a run's step bookkeeping, read once from the recipe's typed settings."""

    log_every_n_steps: int
    save_every_n_steps: int | None  # None: no step checkpoints
    nonfinite_policy: NonFinitePolicy
    log_peak_memory_stats: bool = False  # on a GPU; there is nothing to log on CPU

    @classmethod
    def from_settings(cls, settings: SingleDeviceRecipeConfig) -> StepBookSettings:
        return cls(
            settings.log_every_n_steps,
            settings.save_every_n_steps,
            settings.nonfinite_loss,
            settings.log_peak_memory_stats,
        )


class Checkpoints(Protocol):
    """What the step book saves through (``exactga.checkpoints.contents.RunCheckpoints``)."""

    def save_step(self, model: Any, optimizer: Any, dataloader: Any) -> Path: ...

    def save_epoch(self, model: Any, optimizer: Any, epoch: int) -> None: ...

    def save_best(self, model: Any, step: int, name: str, figure: float) -> Path: ...


class RanksFigures(Protocol):
    """Which figure the best checkpoint is ranked by, and which way
    (``exactga.validation.held_out.BestFigure``)."""

    name: str

    def improves(self, value: float, best: float | None) -> bool: ...


class Validates(Protocol):
    """What the step book reads of a recipe's validation
    (``exactga.validation.held_out.Validation``)."""

    keep_best: bool
    best: RanksFigures
    after_log: Callable[[int, dict[str, float]], None] | None

    def due(self, step: int, *, epoch_end: bool = False) -> bool: ...


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

    def __str__(self) -> str:
        """A line for any step: ``step 12: loss 6.1234`` (and a family's console metrics, see
        :data:`CONSOLE_METRICS`) where it was logged, ``step 13`` or ``step 13: skipped``
        otherwise, so ``print(report)`` in the loop is right under any ``log_every_n_steps``."""
        shown = console_metrics(self.metrics)
        if not shown:
            return f"step {self.step}: skipped" if self.skipped else f"step {self.step}"
        return f"step {self.step}: " + ", ".join(f"{name} {value}" for name, value in shown.items())


# What the progress bar and ``print(report)`` show of a logged step, by metric name: the loss,
# and what tells each loss family's progress (a DPO or GRPO loss alone does not: GRPO's may
# rise while its reward climbs). The other metrics go to the metric logger only.
CONSOLE_METRICS = {
    "loss": "loss",
    "class_loss": "class_loss",  # KD: the student's own loss and the distillation loss
    "kd_loss": "kd_loss",
    "rewards/accuracies": "reward_acc",  # DPO
    "rewards/margins": "reward_margin",
    "rewards/mean": "reward",  # GRPO
    "rewards/success_rate": "success",
}


def console_metrics(metrics: dict[str, float]) -> dict[str, str]:
    """The :data:`CONSOLE_METRICS` among ``metrics``, by their short names, formatted."""
    return {
        short: f"{metrics[name]:.4f}" for name, short in CONSOLE_METRICS.items() if name in metrics
    }


class StepBook:
    """The bookkeeping of a recipe's loop: windows in, logs and checkpoints out.

    Args:
        progress: the run's counters.
        context: how this rank runs a window's micro-batches (model, device, the recipe's
            ``TrainingProfiler``, the gradient-sync policy); every window carries it.
        dataloader: the recipe's loader of windows (``exactga.data.loader``).
        normalizer: the recipe's ``LossNormalizer``.
        optimizer: the recipe's optimizer: the logged learning rate is read from it, and an
            ``OptimizerInBackward`` (``optimizer_in_bwd``) means a non-finite step has already
            changed the weights.
        lr_scheduler: stepped after every step, or ``None``.
        settings: the config's ``log_every_n_steps``, ``save_every_n_steps``,
            ``nonfinite_loss`` and ``log_peak_memory_stats``.
        checkpoints: writes step and epoch checkpoints of the context's model and the
            optimizer (collective under data parallelism).
        metric_logger: where logged metrics go; ``None`` on ranks that do not write.
        window_metrics: the recipe's own metrics of a logged window (every rank calls it).
        track: wraps each epoch's windows (the distiller's ``track``), or ``None``.
        validation: the recipe's validation (``dataset_val``), or ``None``: a step checkpoint
            due at a validated step waits for its figure, and ``keep_best_checkpoint`` keeps
            the best weights; see [the best checkpoint].
        world_size: ranks, for tokens per second per rank; the process group's by default.
        show_progress: draw the progress bar; on global rank 0 by default.
        clock: seconds, for the tokens-per-second figure; injected by tests.
    """

    def __init__(
        self,
        progress: TrainingProgress,
        *,
        context: StepContext,
        dataloader: Any,
        normalizer: Any,
        optimizer: Any,
        lr_scheduler: Any,
        settings: StepBookSettings,
        checkpoints: Checkpoints,
        metric_logger: Any | None,
        window_metrics: Callable[[Window], dict[str, float]] | None = None,
        track: Callable[[Iterable[Window]], Iterable[Window]] | None = None,
        validation: Validates | None = None,
        world_size: int | None = None,
        show_progress: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.progress = progress
        self.context = context
        self.profiler = context.profiler
        self.dataloader = dataloader
        self.normalizer = normalizer
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.nonfinite_policy = settings.nonfinite_policy
        self.checkpoints = checkpoints
        self.save_every_n_steps = settings.save_every_n_steps
        self.log_every_n_steps = settings.log_every_n_steps
        self.metric_logger = metric_logger
        self.world_size = world_size if world_size is not None else _world_size()
        on_gpu = context.device.type != "cpu"
        self.memory_device = context.device if settings.log_peak_memory_stats and on_gpu else None
        self.window_metrics = window_metrics
        self.track = track
        self.show_progress = show_progress if show_progress is not None else is_rank_zero()
        self.clock = clock
        self._epoch = 0
        self._pbar: Any = None
        self._bar_safe_output = contextlib.ExitStack()
        self._num_tokens_since_log = 0
        self._last_log_time: float | None = None
        self._last_save: tuple[int, int, Path] | None = None  # (step, epochs run, folder)
        self._stop_at_epoch_end: signal.Signals | None = None
        self._stop_group: Any = None  # made at the first stop check (a collective)
        self._stop_group_made = False
        self.validation = validation
        self._save_after_validation = False  # see [the best checkpoint]
        if validation is not None:
            validation.after_log = self._validated

    def epochs(self) -> range:
        """The epochs still to train (all of them, or what a resume left)."""
        return self.progress.epochs()

    def windows(self, epoch: int) -> Iterator[TrainingWindow]:
        """The windows of ``epoch`` still to train (all of them, or what a resume left), timed
        by the profiler, each ready to run (``exactga.accumulation.step.TrainingWindow``)."""
        self.open_epoch(epoch)
        windows = self.normalizer.windows(self.dataloader, self.progress.windows_left_in(epoch))
        timed = self.profiler.timed(self.track(windows) if self.track else windows)
        for window in timed:
            yield TrainingWindow(window, self.context, self.progress.global_step + 1)
            self._save_if_still_due()  # a validation the recipe did not run
            self._stop_if_asked()  # every step ends at a boundary

    def training(self, windows: Iterable[Window]) -> Iterator[TrainingWindow]:
        """``windows`` ready to run, numbered from the next optimizer step: for a recipe whose
        windows do not come from its loader (GRPO's come from rollouts). A stop waits for the
        last of them; see [every rank stops at one step]."""
        for window in windows:
            yield TrainingWindow(window, self.context, self.progress.global_step + 1)
            self._save_if_still_due()  # a validation the recipe did not run
        self._stop_if_asked()

    def open_epoch(self, epoch: int) -> None:
        """Start ``epoch``: the loader's shuffle, the progress bar, the first logged interval.
        :meth:`windows` calls it; a recipe whose windows do not come from its loader (GRPO's
        come from generated rollouts) calls it and then :meth:`end_step` for each window."""
        if self._last_log_time is None:  # the first logged interval starts with training
            self._last_log_time = self.clock()
        self._epoch = epoch
        stop_request().training = True  # a signal now waits for the step's end
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

    def end_step(
        self,
        window: Window | TrainingWindow,
        outcome: StepOutcome,
        metrics: dict[str, Any] | None = None,
    ) -> StepReport:
        """Everything after ``window.step`` returned; see [step bookkeeping]. ``metrics``: a
        recipe's own scalars (floats or 0-d tensors), read and logged on logged steps only, so
        a tensor costs no host read on the others."""
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
        logged: dict[str, float] = {}
        if progress.global_step % self.log_every_n_steps == 0:
            logged = self._log(window, outcome, metrics or {})
        self._pbar.update(1)  # after the log's figures, so the bar is drawn once a step
        if progress.should_save_step_checkpoint(self.save_every_n_steps, self._epoch):
            if self.validation is not None and self.validation.due(progress.global_step):
                self._save_after_validation = True  # see [the best checkpoint]
            else:
                self._save_step_checkpoint_and_flush()
        return StepReport(
            step=progress.global_step,
            skipped=outcome.skipped,
            loss=logged.get("loss"),
            metrics=logged,
        )

    def _save_step_checkpoint_and_flush(self) -> None:
        self.save_step_checkpoint()
        flush_metric_logger(self.metric_logger)  # [resumed TensorBoard run]

    def _validated(self, step: int, metrics: dict[str, float]) -> None:
        """After the recipe's validation at ``step`` is logged (every rank): a new best's
        weights, then the step checkpoint that waited for it; see [the best checkpoint]."""
        assert self.validation is not None
        figure = metrics.get(self.validation.best.name)
        if self.validation.keep_best and figure is not None:
            self._keep_if_best(step, figure)
        self._save_if_still_due()

    def _keep_if_best(self, step: int, figure: float) -> None:
        assert self.validation is not None
        progress, name = self.progress, self.validation.best.name
        before = progress.best_val_figure
        if not self.validation.best.improves(figure, before):
            return
        path = self.checkpoints.save_best(self.context.model, step, name, figure)
        progress.record_best(figure, step)
        was = f" (the best was {before:.4f})" if before is not None else ""
        log_rank_zero(f"exactga: best {name} {figure:.4f} at step {step}{was}: saved {path}")

    def _save_if_still_due(self) -> None:
        """The step checkpoint that waited for the step's validation, if it is still due."""
        if self._save_after_validation:
            self._save_after_validation = False
            self._save_step_checkpoint_and_flush()

    def save_step_checkpoint(self) -> Path:
        """A step checkpoint of the run as it stands (every rank calls this); its folder."""
        path = self.checkpoints.save_step(self.context.model, self.optimizer, self.dataloader)
        self._last_save = (self.progress.global_step, self.progress.epochs_run, path)
        return path

    def _stop_if_asked(self) -> None:
        """Stop here if a signal asked for it on any rank; see [every rank stops at one step]."""
        signum = self._agreed_stop_signal()
        if signum is None:
            return
        if self.progress.ends_epoch(self._epoch):  # saved once the epoch closes: end_epoch
            self._stop_at_epoch_end = signum
            return
        self._stop(signum)

    def _agreed_stop_signal(self) -> signal.Signals | None:
        """The signal some rank has seen (the highest number), or None; every rank calls it."""
        seen = stop_request().signal
        if not self._stop_group_made:
            self._stop_group, self._stop_group_made = host_group(), True
        if self._stop_group is None:  # one process
            return seen
        flag = torch.tensor([int(seen or 0)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._stop_group)
        agreed = int(flag.item())
        return signal.Signals(agreed) if agreed else None

    def _stop(self, signum: signal.Signals) -> None:
        """Save (unless this step just was), say so in one line, end the run; every rank."""
        progress = self.progress
        here = (progress.global_step, progress.epochs_run)
        saved = self._last_save
        path = saved[2] if saved is not None and saved[:2] == here else self.save_step_checkpoint()
        flush_metric_logger(self.metric_logger)
        self._close_bar()
        log_rank_zero(
            f"exactga: stopped by {signum.name} after step {progress.global_step} of "
            f"{progress.num_training_steps} (epoch {self._epoch + 1} of "
            f"{progress.total_epochs}); step checkpoint in {path}. To go on: {resume_command()}"
        )
        stop_request().training = False
        raise RunStopped(signum)

    def _close_bar(self) -> None:
        self._pbar.close()
        self._bar_safe_output.close()

    def _tokens_of(self, window: Window) -> int:
        """The tokens a step counts for ``tokens_per_second_per_gpu``: the loss tokens of every
        rank, or, when the units are not tokens (pairs), the samples' own positions on all
        ranks as this rank's times the world size (padding is not work)."""
        if window.units_name == "loss_tokens":
            return window.num_global_units
        return window.num_sample_positions * self.world_size

    def _log(
        self, window: Window | TrainingWindow, outcome: StepOutcome, own: dict[str, Any]
    ) -> dict[str, float]:
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
        metrics.update({name: float(value) for name, value in own.items()})  # host reads here
        if self.metric_logger is not None:
            self.metric_logger.log_dict(metrics, step=self.progress.global_step)
        shown = console_metrics(metrics)
        if shown:  # drawn by the bar's update that follows
            self._pbar.set_postfix(shown, refresh=False)
        self._num_tokens_since_log, self._last_log_time = 0, self.clock()
        return metrics

    def end_epoch(self, epoch: int) -> None:
        """Close ``epoch`` and write its checkpoints, in the one order; see [step bookkeeping].
        A stop asked for at the epoch's last step stops here, unless the run is complete."""
        self._close_bar()
        self.progress.close_epoch()  # before both saves: see [epoch close] in exactga.run.progress
        self.checkpoints.save_epoch(self.context.model, self.optimizer, epoch)
        if self.save_every_n_steps:
            self._save_step_checkpoint_and_flush()
        signum, self._stop_at_epoch_end = self._stop_at_epoch_end, None
        if self.progress.epochs_run >= self.progress.total_epochs:
            stop_request().training = False  # complete: a signal from now on stops at once
        elif signum is not None:
            self._stop(signum)


@contextlib.contextmanager
def _bar_safe_output() -> Iterator[None]:
    """stdout and the console loggers through tqdm; see [bar-safe output]."""
    # torchtune's logger (utils.get_logger, the recipes' ``log``) has a handler of its own. Only
    # loggers that write to the console are redirected: tqdm gives each logger it is handed a
    # handler, and a root logger without one would then print every line torchtune's logger
    # passes up to it a second time.
    loggers = [logging.getLogger(), logging.getLogger("torchtune.utils._logging")]
    with (
        logging_redirect_tqdm(loggers=[lg for lg in loggers if _writes_to_console(lg)]),
        contextlib.redirect_stdout(_LinesAboveTheBar(sys.stdout, bar_stream=sys.stderr)),
    ):
        yield


def _writes_to_console(logger: logging.Logger) -> bool:
    """Whether ``logger`` has a handler of its own writing to stdout or stderr."""
    return any(
        isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)
        for handler in logger.handlers
    )


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


class NonFiniteLossError(RuntimeError):
    """Training stopped on a non-finite loss (``nonfinite_loss: stop``)."""


def handle_nonfinite_loss(
    policy: NonFinitePolicy,
    step: int,
    *,
    weights_updated: bool,
    save_checkpoint: Callable[[], Path],
) -> None:
    """Apply ``policy`` to optimizer step ``step``, whose loss was not finite on some rank.

    Every rank calls this (``save_checkpoint`` is collective under data parallelism).

    Raises:
        NonFiniteLossError: under ``stop``, or whenever the weights were already updated.
    """
    if weights_updated:
        raise NonFiniteLossError(
            f"non-finite loss at step {step}; with optimizer_in_bwd the weights were already "
            "updated, so the run stops without saving. Resume from the last step checkpoint "
            "(resume_from_checkpoint=True), e.g. with a lower learning rate."
        )
    if policy is NonFinitePolicy.SKIP:
        warnings.warn(
            f"non-finite loss at step {step}: the step is skipped (nonfinite_loss: skip); "
            "the weights are unchanged.",
            stacklevel=2,
        )
        return
    path = save_checkpoint()
    raise NonFiniteLossError(
        f"non-finite loss at step {step} (nonfinite_loss: stop). The weights before it are "
        f"saved in {path}; resume_from_checkpoint=True goes on with the next window."
    )


def step_metrics(
    window: Window,
    *,
    optimizer: Any,
    grad_norm: torch.Tensor | None,
    progress: TrainingProgress,
    tokens_per_second_per_gpu: float,
    memory_device: torch.device | None = None,
) -> dict[str, float]:
    """The scalars every recipe logs on a logged step: stock torchtune's names and ours.

    ``loss`` is the exact window loss over every data-parallel rank (one all-reduce of one
    number, so every rank calls this); a skipped window logs no loss rather than a NaN one.
    These are the only host read-backs of the step. ``memory_device`` adds peak-memory
    statistics (``log_peak_memory_stats``; nothing on CPU). The window's loss units over every
    rank are logged under their name (``loss_tokens``; ``pairs`` for a preference loss).
    """
    metrics = {
        "lr": get_lr(optimizer),
        "tokens_per_second_per_gpu": tokens_per_second_per_gpu,
        window.units_name: float(window.num_global_units),
        **progress.metrics(),
    }
    if not window.should_skip_step():
        metrics["loss"] = window.global_mean_loss()
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    if memory_device is not None:
        metrics.update(memory_stats(memory_device))
    return metrics


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
