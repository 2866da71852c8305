"""StepBook: what every recipe does around an optimizer step, in its one order; see
[step bookkeeping] in ``exactga.run.steps``. Real windows and counters, a recording stand-in for
the scheduler, logger, profiler and checkpoint writers, and an injected clock."""

from __future__ import annotations

import io
import logging
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from grouping import GroupingNormalizer
from unit_utils import make_loss, make_rows, split, tiny_model

from exactga.accumulation.step import StepContext, StepOutcome
from exactga.config.options import NonFinitePolicy
from exactga.run.progress import TrainingProgress
from exactga.run.steps import NonFiniteLossError, StepBook, StepBookSettings
from exactga.validation.held_out import HIGHEST_REWARD_MEAN, LOWEST_VAL_LOSS, BestFigure


class Recorder:
    """Stands in for the scheduler, the metric logger, the profiler and the checkpoint writers,
    writing down every call in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.logged: dict[int, dict[str, float]] = {}

    def step(self, work=None) -> None:  # the scheduler's and the profiler's
        self.calls.append(("scheduler.step",) if work is None else ("profiler.step",))

    def log_dict(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(("log", step))
        self.logged[step] = metrics

    def metrics(self, step: int | None = None) -> dict[str, float]:
        return {"profiler/metric": 1.0}

    def timed(self, windows):
        yield from windows

    def open_epoch(self) -> None:  # the profiler's: shapes are counted per epoch
        pass

    def save_step(self, model, optimizer, dataloader) -> Path:  # the checkpoints'
        self.calls.append(("step checkpoint",))
        return Path("step")

    def save_epoch(self, model, optimizer, epoch: int) -> None:
        self.calls.append(("epoch checkpoint", epoch))

    def save_best(self, model, step: int, name: str, figure: float) -> Path:
        self.calls.append(("best", step, figure))
        return Path("best")


class Loader(list):
    """Collated micro-batches with the sampler hook a window loader has."""

    class Sampler:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

    def __init__(self, batches) -> None:
        super().__init__(batches)
        self.sampler = Loader.Sampler()


class Clock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def _book(recorder: Recorder, **overrides) -> tuple[StepBook, Loader]:
    model = tiny_model()
    loader = Loader(split(make_rows(), 2))  # 4 micro-batches: 2 windows of ga 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    progress = TrainingProgress(seed=0, total_epochs=1, max_steps_per_epoch=None)
    progress.start(num_windows_per_epoch=2, resumed_mid_run=False)
    settings = dict(
        dataloader=loader,
        normalizer=GroupingNormalizer(make_loss("plain", model), 2),
        context=StepContext(model, torch.device("cpu"), recorder),
        optimizer=optimizer,
        lr_scheduler=recorder,
        settings=StepBookSettings(
            log_every_n_steps=2, save_every_n_steps=1, nonfinite_policy=NonFinitePolicy.STOP
        ),
        checkpoints=recorder,
        metric_logger=recorder,
        show_progress=False,
        clock=Clock(10.0, 14.0, 99.0),
    )
    settings.update(overrides)
    return StepBook(progress, **settings), loader


def _run_epoch(book: StepBook, outcomes: list[StepOutcome]):
    reports = [book.end_step(w, o) for w, o in zip(book.windows(0), outcomes, strict=True)]
    book.end_epoch(0)
    return reports


def test_each_step_then_the_epoch_end_happen_in_the_one_order() -> None:
    recorder = Recorder()
    book, loader = _book(recorder)
    reports = _run_epoch(book, [StepOutcome(skipped=False)] * 2)
    assert loader.sampler.epochs == [0]
    assert recorder.calls == [
        ("scheduler.step",),
        ("profiler.step",),
        ("step checkpoint",),
        ("scheduler.step",),
        ("profiler.step",),
        ("log", 2),  # every 2 steps
        # the epoch's last step is saved after it closes, then the epoch, then the closed epoch
        ("epoch checkpoint", 0),
        ("step checkpoint",),
    ]
    assert [r.step for r in reports] == [1, 2] and book.progress.epochs_run == 1
    assert reports[0].loss is None and reports[0].metrics == {}


def test_a_logged_step_reports_its_loss_and_tokens_per_second_since_the_last_log() -> None:
    recorder = Recorder()
    book, _ = _book(recorder, world_size=2)
    windows = list(book.windows(0))  # the clock's first reading, 10 s
    # Windows are counted as they open; the losses come from their micro-batches' runs.
    for window in windows:
        for micro_batch in window.micro_batches_to_run():
            window.scale(torch.tensor(2.0), micro_batch)
    reports = [book.end_step(w, StepOutcome(skipped=False)) for w in windows]  # logged at 14 s
    tokens = sum(w.num_global_units for w in windows)
    metrics = recorder.logged[2]
    assert metrics["tokens_per_second_per_gpu"] == tokens / 4.0 / 2  # over 4 s and 2 ranks
    assert metrics["loss"] == pytest.approx(2.0) and reports[1].loss == metrics["loss"]
    assert metrics["lr"] == 0.25 and metrics["profiler/metric"] == 1.0
    assert reports[1].metrics == metrics


def test_a_nonfinite_step_under_stop_saves_then_stops() -> None:
    recorder = Recorder()
    book, _ = _book(recorder)
    window = next(book.windows(0))
    with pytest.raises(NonFiniteLossError, match="step 1"):
        book.end_step(window, StepOutcome(skipped=True, nonfinite=True))
    assert recorder.calls == [("scheduler.step",), ("step checkpoint",)]
    assert book.progress.global_step == 1


def test_window_metrics_and_the_tracked_windows_are_the_recipes() -> None:
    recorder = Recorder()
    seen = []

    def track(windows):
        for window in windows:
            seen.append(window)
            yield window

    book, _ = _book(recorder, track=track, window_metrics=lambda w: {"kd_loss": 3.0})
    _run_epoch(book, [StepOutcome(skipped=True)] * 2)
    assert len(seen) == 2
    assert recorder.logged[2]["kd_loss"] == 3.0


def test_a_line_printed_in_the_loop_lands_on_its_own_line_not_on_the_bar(monkeypatch) -> None:
    """See [bar-safe output]: stdout and the bar share one terminal, as they do for a user."""
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)  # where tqdm draws the bar
    book, _ = _book(Recorder(), show_progress=True)
    for window in book.windows(0):
        report = book.end_step(window, StepOutcome(skipped=False))
        print(f"my step {report.step}", end="")  # a line in two writes, as print makes it
        print()
    book.end_epoch(0)
    assert sys.stdout is terminal  # given back at the epoch's end
    pieces = re.split(r"[\r\n]", terminal.getvalue())
    assert "epoch 1" in terminal.getvalue()  # the bar was drawn
    assert [p for p in pieces if "my step" in p] == ["my step 1", "my step 2"]


def test_a_line_logged_in_the_loop_is_written_once(monkeypatch) -> None:
    """torchtune's logger has a console handler and the root logger none: a line logged by the
    recipe's ``log`` (or exactga's validation line) is written once above the bar, not once more
    by a handler given to the root logger."""
    from torchtune import utils

    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    log = utils.get_logger("INFO")
    # As in a launch (under pytest the root logger has pytest's handlers instead).
    monkeypatch.setattr(log, "handlers", [logging.StreamHandler(terminal)])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    book, _ = _book(Recorder(), show_progress=True)
    for window in book.windows(0):
        report = book.end_step(window, StepOutcome(skipped=False))
        log.info(f"logged at step {report.step}")
    book.end_epoch(0)
    lines = [p for p in re.split(r"[\r\n]", terminal.getvalue()) if "logged at step" in p]
    assert lines == ["logged at step 1", "logged at step 2"]


class CountedReads:
    """A metric value that counts its host reads (as a device tensor's ``float()`` would sync)."""

    def __init__(self, value: float) -> None:
        self.value, self.reads = value, 0

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_a_recipes_own_metrics_are_read_and_logged_on_logged_steps_only() -> None:
    recorder = Recorder()
    book, _ = _book(recorder)  # logs every 2nd step
    own = CountedReads(3.5)
    for window in book.windows(0):
        book.end_step(window, StepOutcome(skipped=False), metrics={"my/metric": own})
    book.end_epoch(0)
    assert sorted(recorder.logged) == [2]
    assert recorder.logged[2]["my/metric"] == 3.5
    assert own.reads == 1  # step 1 was not logged: its value was never read


# --- stopping on a signal: see [every rank stops at one step] ---------------------------------


@pytest.fixture
def stop_request():
    """The process's stop request, cleared before and after (a signal handler sets it)."""
    from exactga.launch.stopping import stop_request

    request = stop_request()
    request.clear()
    yield request
    request.clear()


def test_a_signal_during_a_step_stops_after_it_with_a_checkpoint_and_one_line(
    stop_request, monkeypatch
) -> None:
    import signal

    from exactga.launch.stopping import RunStopped
    from exactga.run import steps as steps_module

    lines: list[str] = []
    monkeypatch.setattr(steps_module, "log_rank_zero", lines.append)
    recorder = Recorder()
    book, _ = _book(recorder, settings=StepBookSettings(1, None, NonFinitePolicy.STOP))
    windows = book.windows(0)
    book.end_step(next(windows), StepOutcome(skipped=False))
    assert stop_request.training  # a signal now waits for the step's end
    stop_request.signal = signal.SIGTERM  # as the handler records it, mid-step
    with pytest.raises(RunStopped) as stopped:
        next(windows)  # the recipe asks for the next window
    assert stopped.value.code == 143
    assert recorder.calls[-1] == ("step checkpoint",)  # with save_every_n_steps off
    assert book.progress.global_step == 1
    (line,) = lines
    assert line.startswith("exactga: stopped by SIGTERM after step 1 of 2 (epoch 1 of 1)")
    assert "step checkpoint in step." in line and line.endswith("resume_from_checkpoint=True")
    assert not stop_request.training  # a second signal stops at once


def test_a_stop_at_an_epochs_last_step_saves_after_the_epoch_closes(stop_request) -> None:
    import signal

    from exactga.launch.stopping import RunStopped

    recorder = Recorder()
    book, _ = _book(recorder)  # a step checkpoint after every step
    book.progress.total_epochs = 2
    windows = book.windows(0)
    book.end_step(next(windows), StepOutcome(skipped=False))
    book.end_step(next(windows), StepOutcome(skipped=False))
    stop_request.signal = signal.SIGINT
    assert next(windows, None) is None  # the epoch's last step: no stop inside the loop
    with pytest.raises(RunStopped) as stopped:
        book.end_epoch(0)
    assert stopped.value.code == 130
    assert recorder.calls[-2:] == [("epoch checkpoint", 0), ("step checkpoint",)]  # not twice


def test_a_stop_asked_for_at_the_runs_end_lets_it_finish(stop_request) -> None:
    import signal

    book, _ = _book(Recorder())
    windows = book.windows(0)
    book.end_step(next(windows), StepOutcome(skipped=False))
    book.end_step(next(windows), StepOutcome(skipped=False))
    stop_request.signal = signal.SIGTERM
    assert next(windows, None) is None
    book.end_epoch(0)  # complete: nothing to go on from, so no stop
    assert not stop_request.training


def test_grouped_windows_stop_only_after_their_last(stop_request) -> None:
    """GRPO's ``ppo_epochs`` windows over one batch of rollouts, through ``training``."""
    import signal

    from exactga.launch.stopping import RunStopped

    recorder = Recorder()
    book, loader = _book(recorder)
    book.progress.total_epochs = 2
    book.progress.steps_per_epoch = 4
    book.open_epoch(0)
    group = book.training(list(book.normalizer.windows(loader, 2)))
    book.end_step(next(group), StepOutcome(skipped=False))
    stop_request.signal = signal.SIGINT
    book.end_step(next(group), StepOutcome(skipped=False))  # the group goes on
    with pytest.raises(RunStopped):
        next(group)
    assert book.progress.global_step == 2


def test_print_report_as_the_docs_show_it_works_on_every_step(capsys) -> None:
    """docs/launching.md's loop snippet, run as written with a step that is not logged."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "launching.md").read_text()
    snippet = re.search(r"```python\n(report = steps\.end_step.*?)```", docs, re.S)
    assert snippet is not None, "docs/launching.md's loop snippet moved: update this test"
    book, _ = _book(Recorder())  # logs every 2nd step
    for window in book.windows(0):
        for micro_batch in window.micro_batches_to_run():  # the losses its micro-batches had
            window.scale(torch.tensor(2.0), micro_batch)
        exec(snippet.group(1), {"steps": book, "window": window, "outcome": StepOutcome(False)})
    book.end_epoch(0)
    assert capsys.readouterr().out.splitlines() == ["step 1", "step 2: loss 2.0000"]


class ScriptedValidation:
    """Stands in for a recipe's ``Validation``: due at the steps of ``losses``, whose figures
    it logs as its ``best``'s scalar (through the hook the step book sets, as
    ``Validation.log`` does)."""

    def __init__(
        self, losses: dict[int, float], keep_best: bool = True, best: BestFigure = LOWEST_VAL_LOSS
    ) -> None:
        self.losses, self.keep_best, self.best, self.after_log = losses, keep_best, best, None

    def due(self, step: int, *, epoch_end: bool = False) -> bool:
        return step in self.losses

    def validate_if_due(self, step: int, recorder: Recorder) -> None:  # the recipe's
        if self.due(step):
            recorder.calls.append(("validated", step))
            self.after_log(step, {self.best.name: self.losses[step], "val/other": -1.0})


def _validated_run(
    losses: dict[int, float],
    progress: TrainingProgress | None = None,
    best: BestFigure = LOWEST_VAL_LOSS,
):
    """Two epochs of two steps, step checkpoints every step, validating as a recipe does after
    ``end_step`` and before ``end_epoch``; the recorder's calls (a step checkpoint with the best
    step it records) and the progress."""
    recorder = Recorder()
    validation = ScriptedValidation(losses, best=best)
    book, _ = _book(recorder, validation=validation, clock=Clock(*range(10)))
    if progress is not None:  # resumed: its counters, and its best
        book.progress.load_state_dict(progress.state_dict())
    book.progress.total_epochs = 2
    recorder.save_step = lambda *args: recorder.calls.append(  # what the checkpoint records
        ("step checkpoint", book.progress.global_step, book.progress.best_val_step)
    )
    for epoch in book.epochs():
        for window in book.windows(epoch):
            book.end_step(window, StepOutcome(skipped=False))
            validation.validate_if_due(book.progress.global_step, recorder)
        book.end_epoch(epoch)
    calls = [call for call in recorder.calls if call[0] in ("validated", "best", "step checkpoint")]
    return calls, book.progress


def test_the_best_is_saved_on_improvement_before_the_steps_checkpoint() -> None:
    """See [the best checkpoint]: a new lowest val/loss only (a NaN never), and the step
    checkpoint of a validated step written after it, recording it."""
    calls, progress = _validated_run({1: 3.0, 2: 2.0, 3: 2.5, 4: math.nan})
    assert calls == [
        ("validated", 1),
        ("best", 1, 3.0),
        ("step checkpoint", 1, 1),  # after the validation: it records the best of step 1
        ("validated", 2),
        ("best", 2, 2.0),
        ("step checkpoint", 2, 2),  # the epoch's end: after its validation anyway
        ("validated", 3),
        ("step checkpoint", 3, 2),  # 2.5 is no improvement
        ("validated", 4),
        ("step checkpoint", 4, 2),
    ]
    assert (progress.best_val_figure, progress.best_val_step) == (2.0, 2)


def test_a_resumed_run_compares_with_the_checkpoints_best() -> None:
    """Resumed after step 2 (best 2.0 at step 2): step 3's 2.5 is no best, as in the
    uninterrupted run, and step 4's 1.0 is."""
    before = TrainingProgress(seed=0, total_epochs=2, max_steps_per_epoch=None)
    before.start(num_windows_per_epoch=2, resumed_mid_run=False)
    for _ in range(2):
        before.record_step(skipped=False, nonfinite=False)
    before.close_epoch()
    before.record_best(2.0, 2)
    calls, progress = _validated_run({3: 2.5, 4: 1.0}, progress=before)
    assert [call for call in calls if call[0] == "best"] == [("best", 4, 1.0)]
    assert (progress.best_val_figure, progress.best_val_step) == (1.0, 4)


def test_a_reward_keeps_the_highest_and_a_tie_the_earlier() -> None:
    """GRPO's and PPO's figure (``HIGHEST_REWARD_MEAN``): a higher val/reward_mean is a new
    best, a lower one or an equal one is not (the earlier weights stay), a NaN never is."""
    rewards = {1: 0.25, 2: 0.5, 3: 0.5, 4: math.nan}
    calls, progress = _validated_run(rewards, best=HIGHEST_REWARD_MEAN)
    assert [call for call in calls if call[0] == "best"] == [("best", 1, 0.25), ("best", 2, 0.5)]
    assert (progress.best_val_figure, progress.best_val_step) == (0.5, 2)
    calls, progress = _validated_run({1: 0.5, 2: 0.25, 3: 0.75}, best=HIGHEST_REWARD_MEAN)
    assert [call for call in calls if call[0] == "best"] == [("best", 1, 0.5), ("best", 3, 0.75)]
    # The same figures ranked as a loss: the lowest.
    calls, _ = _validated_run({1: 0.5, 2: 0.25, 3: 0.75})
    assert [call for call in calls if call[0] == "best"] == [("best", 1, 0.5), ("best", 2, 0.25)]


def test_without_keep_best_no_best_is_saved_and_checkpoints_still_follow_validation() -> None:
    recorder = Recorder()
    validation = ScriptedValidation({1: 1.0}, keep_best=False)
    book, _ = _book(recorder, validation=validation)
    windows = book.windows(0)
    book.end_step(next(windows), StepOutcome(skipped=False))
    assert ("step checkpoint",) not in recorder.calls  # waits for the validation
    validation.validate_if_due(1, recorder)
    assert recorder.calls[-2:] == [("validated", 1), ("step checkpoint",)]
    assert book.progress.best_val_figure is None


def test_a_step_checkpoint_waiting_for_a_validation_the_recipe_skips_is_still_written() -> None:
    """An edited copy that validates no more: the checkpoint is written at the next window."""
    recorder = Recorder()
    book, _ = _book(recorder, validation=ScriptedValidation({1: 1.0}))
    windows = book.windows(0)
    book.end_step(next(windows), StepOutcome(skipped=False))
    next(windows)
    assert recorder.calls.count(("step checkpoint",)) == 1
