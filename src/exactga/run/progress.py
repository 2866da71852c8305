"""Where training stands: epochs, optimizer steps and what each step did, in one object.

Every training recipe keeps its own loop, and calls :class:`TrainingProgress` for what that
loop decides about counters: how many windows an epoch has and how many are left after a
resume, what a step's outcome adds, when the epoch is closed, and what a step checkpoint
records. A counter changes only in a method here, so a reader finds every place
``global_step`` moves by grepping this file. See [epoch close].
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig
from torchtune import config, training

# Note [epoch close]
# ``epochs_run`` counts finished epochs, and both epoch-end saves record it: torchtune's
# epoch checkpoint (``EPOCHS_KEY``, which a resumed run starts from) and the step checkpoint
# of the epoch's last step. So the epoch is closed (``close_epoch``) *before* either save; a
# save before it would resume into the same epoch again. Likewise the epoch's last step is not
# saved from inside the loop (``should_save_step_checkpoint``): its checkpoint is written once
# the epoch is closed, so it records a finished epoch and no loader position. See [loader
# position at epoch ends] in exactga.run.resume.

# What a step checkpoint's ``trainer_state`` holds of the progress, besides the fingerprint.
PROGRESS_FIELDS = (
    "seed",
    "epochs_run",
    "global_step",
    "num_skipped_steps",
    "num_nonfinite_steps",
    "best_val_figure",
    "best_val_step",
)
# Recorded since keep_best_checkpoint: a step checkpoint written before has none (no best yet).
_BEST_FIELDS = ("best_val_figure", "best_val_step")


@dataclass
class TrainingProgress:
    """The run's counters; see the module docstring.

    Attributes:
        seed: the run's seed (an epoch checkpoint's wins over the config's).
        total_epochs: the config's ``epochs``.
        max_steps_per_epoch: the config's ``max_steps_per_epoch`` (an epoch checkpoint's wins).
        epochs_run: finished epochs.
        global_step: optimizer steps taken, skipped ones included (the scheduler's clock).
        num_skipped_steps: steps whose window held no loss token on any rank.
        num_nonfinite_steps: steps dropped because a loss or the gradient norm was not finite.
        steps_per_epoch: windows per epoch, capped by ``max_steps_per_epoch``; set by
            :meth:`start`.
        best_val_figure: the best validation figure so far (``keep_best_checkpoint``: the
            family's, e.g. the lowest ``val/loss``), ``None`` before the first; a step
            checkpoint records it, so a resumed run keeps its best.
        best_val_step: the step of ``best_val_figure``.
    """

    seed: int
    total_epochs: int
    max_steps_per_epoch: int | None
    epochs_run: int = 0
    global_step: int = 0
    num_skipped_steps: int = 0
    num_nonfinite_steps: int = 0
    steps_per_epoch: int = 0
    best_val_figure: float | None = None
    best_val_step: int | None = None

    def start(self, num_windows_per_epoch: int, resumed_mid_run: bool) -> None:
        """Fix the epoch length once the data loader exists.

        Args:
            num_windows_per_epoch: accumulation windows in one pass over this rank's loader.
            resumed_mid_run: ``global_step`` came from a step checkpoint; otherwise training
                starts at the first step of epoch ``epochs_run``.
        """
        self.steps_per_epoch = num_windows_per_epoch
        if self.max_steps_per_epoch is not None:
            self.steps_per_epoch = min(self.steps_per_epoch, self.max_steps_per_epoch)
        if not resumed_mid_run:
            self.global_step = self.epochs_run * self.steps_per_epoch

    @property
    def num_training_steps(self) -> int:
        """Optimizer steps of the whole run, for learning-rate schedules."""
        return self.total_epochs * self.steps_per_epoch

    def epochs(self) -> range:
        """The epochs still to train."""
        return range(self.epochs_run, self.total_epochs)

    def steps_done_in(self, epoch: int) -> int:
        """Steps of ``epoch`` already taken: non-zero only after a mid-epoch resume."""
        return self.global_step - epoch * self.steps_per_epoch

    def windows_left_in(self, epoch: int) -> int:
        """Windows of ``epoch`` still to train."""
        return self.steps_per_epoch - self.steps_done_in(epoch)

    def record_step(self, skipped: bool, nonfinite: bool) -> None:
        """Count one optimizer step and what it did (``exactga.accumulation.step.StepOutcome``).

        A non-finite step counts in ``num_nonfinite_steps`` only, not as a skipped step:
        ``skipped_steps`` is the metric of windows without a loss token (docs/profiling.md).
        """
        self.num_skipped_steps += skipped and not nonfinite
        self.num_nonfinite_steps += nonfinite
        self.global_step += 1

    def should_save_step_checkpoint(self, every_n_steps: int | None, epoch: int) -> bool:
        """Whether the step just taken saves a step checkpoint inside the loop.

        ``save_every_n_steps`` as a predicate (``None`` or 0: never), except on the epoch's
        last step, which is saved after :meth:`close_epoch`; see [epoch close].
        """
        return (
            bool(every_n_steps)
            and self.global_step % every_n_steps == 0
            and not self.ends_epoch(epoch)
        )

    def ends_epoch(self, epoch: int) -> bool:
        """Whether the step just taken is ``epoch``'s last (saved only once the epoch is closed;
        see [epoch close])."""
        return self.global_step >= (epoch + 1) * self.steps_per_epoch

    def record_best(self, figure: float, step: int) -> None:
        """``figure``, validated after ``step``, is the best so far (its weights are saved)."""
        self.best_val_figure, self.best_val_step = figure, step

    def close_epoch(self) -> None:
        """Mark the current epoch finished; call before the epoch-end saves. See [epoch close]."""
        self.epochs_run += 1

    @property
    def at_epoch_start(self) -> bool:
        """No step of the current epoch taken yet (so no loader position worth saving)."""
        return self.global_step == self.epochs_run * self.steps_per_epoch

    def is_last_epoch(self, epoch: int) -> bool:
        """Whether ``epoch`` is the run's last (its epoch checkpoint holds no recipe state)."""
        return epoch + 1 >= self.total_epochs

    def epoch_checkpoint_state(self) -> dict[str, Any]:
        """The recipe state torchtune's epoch checkpoints carry (read back by
        :meth:`load_epoch_checkpoint_state`). No loader position: see [loader position at
        epoch ends] in exactga.run.resume."""
        return {
            training.SEED_KEY: self.seed,
            training.EPOCHS_KEY: self.epochs_run,
            training.TOTAL_EPOCHS_KEY: self.total_epochs,
            training.MAX_STEPS_KEY: self.max_steps_per_epoch,
            training.DATALOADER_KEY: None,
            # keep_best_checkpoint's best so far (the CheckpointClient of a sharded full-weight
            # model takes none: such a run's epoch resume starts a new best).
            **{name: getattr(self, name) for name in _BEST_FIELDS},
        }

    def for_checkpoint_client(self) -> Any:
        """The same state as torchtune's own ``TrainingProgress``, which its
        ``CheckpointClient`` (full_finetune_distributed) takes."""
        from torchtune.training.checkpointing._checkpoint_client import (
            TrainingProgress as ClientProgress,
        )

        return ClientProgress(
            seed=self.seed,
            epochs_run=self.epochs_run,
            total_epochs=self.total_epochs,
            max_steps_per_epoch=self.max_steps_per_epoch,
            # See [loader position at epoch ends] in exactga.run.resume.
            dataloader_state_dict=None,
        )

    def load_epoch_checkpoint_state(self, ckpt_dict: Mapping[str, Any]) -> None:
        """Go on from torchtune's epoch checkpoint, as stock does: its epoch count, and its
        seed and ``max_steps_per_epoch`` over the config's (with a warning)."""
        try:
            self.epochs_run = ckpt_dict[training.EPOCHS_KEY]
            saved_seed, saved_max_steps = (
                ckpt_dict[training.SEED_KEY],
                ckpt_dict[training.MAX_STEPS_KEY],
            )
        except KeyError as err:
            raise ValueError(
                f"config key 'resume_from_checkpoint': the checkpoint has no recipe state ({err}); "
                "is checkpointer.recipe_checkpoint the recipe_state.pt of this recipe's run?"
            ) from None
        for name in _BEST_FIELDS:  # none in a checkpoint written without them
            setattr(self, name, ckpt_dict.get(name))
        if self.seed != saved_seed:
            warnings.warn(
                f"config seed differs from the checkpoint's; using {saved_seed}.", stacklevel=2
            )
            self.seed = saved_seed
        if self.max_steps_per_epoch != saved_max_steps:
            warnings.warn(
                "config max_steps_per_epoch differs from the checkpoint's; using "
                f"{saved_max_steps}.",
                stacklevel=2,
            )
            self.max_steps_per_epoch = saved_max_steps

    def state_dict(self) -> dict[str, Any]:
        """The counters a step checkpoint records."""
        return {name: getattr(self, name) for name in PROGRESS_FIELDS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Undo :meth:`state_dict`."""
        for name in PROGRESS_FIELDS:
            if name in state or name not in _BEST_FIELDS:
                setattr(self, name, state[name])

    def metrics(self) -> dict[str, float]:
        """The counters as logged scalars."""
        return {
            "skipped_steps": float(self.num_skipped_steps),
            "nonfinite_steps": float(self.num_nonfinite_steps),
        }


def build_lr_scheduler(
    cfg_lr_scheduler: DictConfig | None, optimizer: Any, progress: TrainingProgress
) -> Any:
    """The config's learning-rate schedule over the run's optimizer steps, at the step the
    run is at (0 on a fresh start, the resumed step otherwise); ``None`` without one."""
    if cfg_lr_scheduler is None:
        return None
    return config.instantiate(
        cfg_lr_scheduler,
        optimizer,
        num_training_steps=progress.num_training_steps,
        last_epoch=progress.global_step - 1,
    )
