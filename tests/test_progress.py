"""TrainingProgress: the counters every recipe's loop moves, and what resumes restore."""

from __future__ import annotations

import pytest
from torchtune import training

from exactga.run.progress import TrainingProgress


def _progress(**overrides) -> TrainingProgress:
    values = {"seed": 7, "total_epochs": 3, "max_steps_per_epoch": None, **overrides}
    return TrainingProgress(**values)


def test_start_caps_the_epoch_and_places_an_epoch_resume_at_its_first_step() -> None:
    progress = _progress(max_steps_per_epoch=4, epochs_run=2)
    progress.start(num_windows_per_epoch=10, resumed_mid_run=False)
    assert progress.steps_per_epoch == 4
    assert progress.global_step == 8  # two finished epochs of four steps
    assert progress.num_training_steps == 12
    assert list(progress.epochs()) == [2]
    assert progress.at_epoch_start


def test_a_mid_epoch_resume_keeps_its_step_and_trains_only_what_is_left() -> None:
    progress = _progress()
    progress.load_state_dict({**progress.state_dict(), "epochs_run": 1, "global_step": 13})
    progress.start(num_windows_per_epoch=10, resumed_mid_run=True)
    assert progress.steps_done_in(1) == 3
    assert progress.windows_left_in(1) == 7
    assert not progress.at_epoch_start


def test_outcomes_count_separately_and_every_step_advances_the_clock() -> None:
    progress = _progress()
    progress.start(num_windows_per_epoch=10, resumed_mid_run=False)
    progress.record_step(skipped=False, nonfinite=False)
    progress.record_step(skipped=True, nonfinite=False)  # no loss token in the window
    progress.record_step(skipped=True, nonfinite=True)  # dropped for a NaN loss
    assert progress.global_step == 3
    assert progress.metrics() == {"skipped_steps": 1.0, "nonfinite_steps": 1.0}


def test_the_last_step_of_an_epoch_is_saved_after_the_epoch_closes() -> None:
    progress = _progress()
    progress.start(num_windows_per_epoch=4, resumed_mid_run=False)
    saved_in_loop = []
    for _ in range(4):
        progress.record_step(skipped=False, nonfinite=False)
        saved_in_loop.append(progress.should_save_step_checkpoint(every_n_steps=2, epoch=0))
    assert saved_in_loop == [False, True, False, False]  # step 4 ends the epoch
    assert not progress.should_save_step_checkpoint(every_n_steps=None, epoch=0)
    progress.close_epoch()
    assert progress.epochs_run == 1 and progress.at_epoch_start


def test_state_dict_round_trips_every_counter() -> None:
    progress = _progress(epochs_run=1, global_step=5, num_skipped_steps=2, num_nonfinite_steps=1)
    restored = _progress()
    restored.load_state_dict(progress.state_dict())
    assert restored.state_dict() == progress.state_dict()


def test_the_best_validation_figure_is_resumable_state() -> None:
    """keep_best_checkpoint's best (see [the best checkpoint] in exactga.run.steps): in step
    and epoch checkpoints; one written before the key existed has none."""
    progress = _progress(global_step=8)
    progress.record_best(2.5, 8)
    for saved, load in (
        (progress.state_dict(), "load_state_dict"),
        (progress.epoch_checkpoint_state(), "load_epoch_checkpoint_state"),
    ):
        restored = _progress()
        getattr(restored, load)(saved)
        assert (restored.best_val_figure, restored.best_val_step) == (2.5, 8)
    older = {k: v for k, v in progress.state_dict().items() if not k.startswith("best_")}
    restored = _progress()
    restored.load_state_dict(older)
    assert restored.best_val_figure is None and restored.global_step == 8


def test_an_epoch_checkpoint_sets_epochs_seed_and_max_steps_with_a_warning() -> None:
    saved = _progress(seed=11, epochs_run=2, max_steps_per_epoch=5).epoch_checkpoint_state()
    assert saved[training.DATALOADER_KEY] is None  # see [loader position at epoch ends]
    progress = _progress(seed=7, max_steps_per_epoch=None)
    with pytest.warns(UserWarning, match="seed differs"):
        progress.load_epoch_checkpoint_state(saved)
    assert (progress.epochs_run, progress.seed, progress.max_steps_per_epoch) == (2, 11, 5)


def test_a_checkpoint_without_recipe_state_names_the_key_to_fix() -> None:
    with pytest.raises(ValueError, match="resume_from_checkpoint.*recipe_checkpoint"):
        _progress().load_epoch_checkpoint_state({training.MODEL_KEY: {}})
