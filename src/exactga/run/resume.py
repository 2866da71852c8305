"""Resuming a run: one answer to "where do I go on from?", and what a step checkpoint holds.

A run with ``resume_from_checkpoint: True`` goes on from, in this order:

1. the newest usable step checkpoint under ``<output_dir>/step_checkpoints`` (written with
   ``save_every_n_steps``; see exactga.run.checkpointing): it holds the trained weights (or
   adapters), the optimizer state, the counters (:class:`~exactga.run.progress.TrainingProgress`)
   and, per rank, the RNG states and data-loader position, so the run goes on with the very
   next window and ends bit-for-bit where an uninterrupted run would;
2. otherwise torchtune's epoch checkpoint, exactly as stock torchtune resumes
   (``checkpointer.recipe_checkpoint``, the weights in ``checkpointer.checkpoint_files``).

:func:`find_resume_point` answers that once, and the :class:`ResumePoint` it returns hands
every recipe the weights, optimizer state, loader position and RNG states to start from, so
every recipe resumes the same way. See [what a resume may change] and [loader position at
epoch ends]. A launch that starts over moves an earlier launch's step checkpoints aside first
(:func:`retire_an_earlier_launch`), so the checkpoint a stop names is the one a resume finds:
see [retired step checkpoints] in exactga.run.checkpointing.
"""

from __future__ import annotations

import enum
import json
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torchtune import training, utils

from exactga.config.schemas import SingleDeviceRecipeConfig, TrainingRunConfig
from exactga.config.validation import validate_config
from exactga.data.files import check_data_files
from exactga.run.checkpointing import (
    MODEL_FILE,
    StepCheckpoint,
    StepCheckpointer,
    step_checkpointer_for,
)
from exactga.run.progress import TrainingProgress

log = utils.get_logger("INFO")

# The keys that decide what a run computes; a resume that changes one would silently train a
# different run. ``world_size`` is added by the recipe. See [what a resume may change].
FINGERPRINT_KEYS = (
    "model",
    "tokenizer",
    "dataset",
    "batch_size",
    "gradient_accumulation_steps",
    "collate_fn",
    "shuffle",
    "loss_normalization",
    "drop_partial_window",
    "max_steps_per_epoch",
)


# Note [what a resume may change]
# The fingerprint is the resolved value of ``FINGERPRINT_KEYS`` plus the world size. A resumed
# config whose fingerprint differs is refused with the differing keys named, because the run it
# would continue is not the run that was checkpointed: the data order, the window boundaries or
# the weights' shapes change. ``resume_allow_changed_keys: [key, ...]`` accepts named changes
# (say, a tokenizer moved to another path) with a warning. Everything else (learning rate,
# epochs, logging, output folders) may change freely, and so may ``micro_batching`` and
# ``micro_batch_tokens``: they regroup a window's samples without changing which samples it
# holds (see [regrouping is exact]), so a run that ran out of memory can go on with a token
# budget. It then stays exact, though no longer bit-identical to an uninterrupted run.

# Note [loader position at epoch ends]
# With ``max_steps_per_epoch`` an epoch ends before its data does, and the loader's position is
# then mid-way through that epoch's order. An uninterrupted run starts the next epoch with a new
# iterator from its first sample; a run resumed from that position would instead skip as many
# samples of the next epoch's order. So a checkpoint taken at an epoch boundary stores no
# position (``None``), and the resumed run starts the epoch fresh, exactly as the uninterrupted
# one did. (Stock torchtune 0.6.1 stores the position in its epoch checkpoints and skips them.)


class ResumeFrom(enum.Enum):
    """Where a run starts: fresh, torchtune's epoch checkpoint, or one of our step checkpoints."""

    START = "start"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    STEP_CHECKPOINT = "step_checkpoint"


@dataclass(frozen=True)
class ResumePoint:
    """What a run goes on from; see the module docstring.

    ``ckpt_dict`` arguments are what torchtune's checkpointer returned: the base weights, or
    with an epoch resume the epoch's weights and recipe state.
    """

    source: ResumeFrom
    step_checkpoint: StepCheckpoint | None = None

    @property
    def from_epoch_checkpoint(self) -> bool:
        """Whether torchtune's checkpointer loads recipe state (``should_load_recipe_state``)."""
        return self.source is ResumeFrom.EPOCH_CHECKPOINT

    @property
    def from_step_checkpoint(self) -> bool:
        return self.source is ResumeFrom.STEP_CHECKPOINT

    @property
    def resumed(self) -> bool:
        """Whether the run goes on from a checkpoint rather than starting."""
        return self.source is not ResumeFrom.START

    def restore_progress(self, progress: TrainingProgress, ckpt_dict: Mapping[str, Any]) -> None:
        """Set the counters to go on from: the step checkpoint's, or the epoch checkpoint's."""
        if self.step_checkpoint is not None:
            progress.load_state_dict(self.step_checkpoint.trainer_state)
        elif self.from_epoch_checkpoint:
            progress.load_epoch_checkpoint_state(ckpt_dict)

    def model_weights(self, ckpt_dict: Mapping[str, Any]) -> dict[str, Any]:
        """The full model's weights to load: the step checkpoint's, else the checkpointer's."""
        if self.step_checkpoint is not None:
            return self.step_checkpoint.model_state
        return ckpt_dict[training.MODEL_KEY]

    def adapter_weights(self, ckpt_dict: Mapping[str, Any]) -> dict[str, Any] | None:
        """The LoRA adapters to go on from, or ``None`` for fresh ones."""
        if self.step_checkpoint is not None:
            return self.step_checkpoint.model_state
        if not self.from_epoch_checkpoint:
            return None
        if training.ADAPTER_KEY not in ckpt_dict:
            raise ValueError(
                "config key 'resume_from_checkpoint': no adapter weights found in the "
                "checkpoint; resume needs the adapter_model.pt of an earlier epoch."
            )
        return ckpt_dict[training.ADAPTER_KEY]

    def weights_source(self, cfg_checkpointer: DictConfig) -> str:
        """Where :meth:`model_weights` came from, for messages about a checkpoint that does
        not fit the model."""
        if self.step_checkpoint is not None:
            return str(self.step_checkpoint.path / MODEL_FILE)
        return checkpointer_source(cfg_checkpointer)

    def optimizer_state(self, ckpt_dict: Mapping[str, Any]) -> dict[str, Any] | None:
        """The optimizer state to go on from, or ``None`` for a fresh optimizer."""
        if self.step_checkpoint is not None:
            return self.step_checkpoint.optimizer_state
        if self.from_epoch_checkpoint:
            return ckpt_dict.get(training.OPT_KEY)
        return None

    def dataloader_state(self, ckpt_dict: Mapping[str, Any]) -> dict[str, Any] | None:
        """This rank's loader position, or ``None`` to start an epoch from its first sample."""
        if self.step_checkpoint is not None:
            return self.step_checkpoint.rank_state["dataloader"]
        if self.from_epoch_checkpoint:
            return ckpt_dict.get(training.DATALOADER_KEY)
        return None

    def restore_rng(self, device: torch.device) -> None:
        """Put back this rank's RNG states; call last in setup, since building the model and
        the data draws from them."""
        if self.step_checkpoint is not None:
            restore_rng_state(self.step_checkpoint.rank_state["rng"], device)


def checkpointer_source(cfg_checkpointer: DictConfig) -> str:
    """Where torchtune's checkpointer reads weights from, for messages about weights that do
    not fit the model (the base weights, or an epoch checkpoint's)."""
    return f"checkpointer.checkpoint_dir ({cfg_checkpointer.checkpoint_dir})"


def start_run(
    settings: SingleDeviceRecipeConfig, extra_keys: tuple[str, ...] = (), **extra: Any
) -> tuple[StepCheckpointer, dict[str, Any], ResumePoint]:
    """A run's step checkpointer (this rank's, in ``output_dir``), its fingerprint (the config's
    values a resume must match, the world size, ``extra_keys`` and ``extra``: see
    :func:`run_fingerprint`) and where it goes on from (:func:`find_resume_point`)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    checkpointer = step_checkpointer_for(
        settings.output_dir, settings.keep_last_n_checkpoints, rank, world_size
    )
    fingerprint = run_fingerprint(settings, extra_keys, world_size=world_size, **extra)
    return checkpointer, fingerprint, find_resume_point(settings, checkpointer, fingerprint)


def find_resume_point(
    cfg: SingleDeviceRecipeConfig, checkpointer: StepCheckpointer, fingerprint: Mapping[str, Any]
) -> ResumePoint:
    """Where this run goes on from; see the module docstring.

    Raises:
        ValueError: the config changes what the run computes since the step checkpoint
            (see [what a resume may change]), or step checkpoints exist and none is usable.
    """
    if not cfg.resume_from_checkpoint:
        retire_an_earlier_launch(checkpointer, fingerprint)
        return ResumePoint(ResumeFrom.START)
    found = checkpointer.load_latest()
    if found is None:
        check_epoch_checkpoint_exists(cfg.checkpointer, checkpointer.root)
        return ResumePoint(ResumeFrom.EPOCH_CHECKPOINT)
    check_resume_fingerprint(
        found.trainer_state["fingerprint"],
        fingerprint,
        list(cfg.resume_allow_changed_keys),
        found.path,
    )
    if checkpointer.rank == 0:
        log.info(f"Resuming from step checkpoint {found.path}")
    return ResumePoint(ResumeFrom.STEP_CHECKPOINT, found)


def retire_an_earlier_launch(
    checkpointer: StepCheckpointer, fingerprint: Mapping[str, Any]
) -> Path | None:
    """For a launch that starts over: move the step checkpoints an earlier launch left in its
    folder aside, with one line saying where and how to go on from them instead (see
    [retired step checkpoints] in exactga.run.checkpointing). Every rank calls this; rank 0
    moves and logs and gets the folder they went to."""
    newest = checkpointer.latest_trainer_state() if checkpointer.rank == 0 else None
    retired = checkpointer.retire_all()
    if retired is not None:
        log.info(retired_note(checkpointer.root, retired, newest, fingerprint))
    return retired


def retired_note(
    root: Path,
    retired: Path,
    newest: tuple[Path, Mapping[str, Any]] | None,
    fingerprint: Mapping[str, Any],
) -> str:
    """The line :func:`retire_an_earlier_launch` logs. ``newest``: the newest retired
    checkpoint and its trainer state, as it was in ``root``; the line says whether it is of this
    run (the same fingerprint: likely a stopped run launched again without its resume key)."""
    if newest is None:
        which = "none of them readable"
    else:
        path, state = newest
        same = state.get("fingerprint") == dict(fingerprint)
        whose = "this run" if same else "a run with another config"
        which = f"the newest, {path.name}, is a step checkpoint of {whose}"
    return (
        f"exactga: this launch starts over (resume_from_checkpoint is off), so it moved the "
        f"step checkpoints an earlier launch left in {root} ({which}) to {retired}, to keep "
        f"a resume of this launch from going on from them. To go on from them instead, stop "
        f"this launch, put {retired} back as {root}, and add resume_from_checkpoint=True (or "
        "resume_from_checkpoint=auto: go on where there is a checkpoint, else start)."
    )


def validate_run_config(cfg: DictConfig, schema: type, recipe_name: str) -> DictConfig:
    """A recipe's start-up check of its config, before anything is printed, built or written:
    ``validate_config`` (every component section's keys too) with the local files checked,
    the data files read as their builders will read them
    (``exactga.data.files.check_data_files``), and with ``resume_from_checkpoint`` something
    there to resume from. ``resume_from_checkpoint: auto`` comes back as True where
    there is a checkpoint to go on from (as True would find it), else as False.

    Raises:
        ValueError: naming the key at fault (see ``exactga.config.validation.validate_config``).
    """
    cfg = validate_config(cfg, schema, recipe_name, check_files=True)
    # The parity report's schema has no such key: it never resumes.
    resume = cfg.resume_from_checkpoint if "resume_from_checkpoint" in cfg else False
    if resume == "auto":
        cfg.resume_from_checkpoint = has_something_to_resume(cfg)
    elif resume:
        check_something_to_resume(cfg)
    check_data_files(cfg)  # last: it reads the files whole, into datasets' cache
    return cfg


def has_something_to_resume(cfg: DictConfig) -> bool:
    """Whether ``resume_from_checkpoint=True`` would find a step or epoch checkpoint to go on
    from (only looks, as :func:`check_something_to_resume`)."""
    try:
        check_something_to_resume(cfg)
    except ValueError:
        return False
    return True


def check_something_to_resume(cfg: DictConfig) -> None:
    """With ``resume_from_checkpoint``, fail at start-up (before the config is printed) when
    there is neither a step checkpoint folder nor torchtune's epoch checkpoint to go on from.

    Only looks: whether a step checkpoint is usable is decided when it is read
    (:func:`find_resume_point`), since checking it costs a read of every file.
    """
    step_checkpoints = step_checkpointer_for(cfg.output_dir, cfg.keep_last_n_checkpoints)
    if not step_checkpoints.list_steps():
        check_epoch_checkpoint_exists(cfg.checkpointer, step_checkpoints.root)


def check_epoch_checkpoint_exists(cfg_checkpointer: DictConfig, step_checkpoint_dir: Path) -> None:
    """Fail naming what is missing when neither a step nor an epoch checkpoint can be resumed.

    torchtune's checkpointer would fail later with ``join() argument must be str ... not
    'NoneType'`` (no epoch folder) or "recipe_checkpoint file must be provided" (no recipe
    state), neither saying where it looked or which key writes one.

    Raises:
        ValueError: naming both folders searched and the keys that create a checkpoint.
    """
    output_dir = Path(cfg_checkpointer.output_dir)
    recipe_checkpoint = cfg_checkpointer.get("recipe_checkpoint")
    recipe_state = output_dir / (recipe_checkpoint or "recipe_state/recipe_state.pt")
    if recipe_state.is_file():
        return
    epochs = sorted(
        (p for p in output_dir.glob("epoch_*") if p.is_dir() and p.name[6:].isdigit()),
        key=lambda p: int(p.name[6:]),
    )
    if epochs:  # a finished run: torchtune's last epoch checkpoint holds no recipe state
        raise ValueError(
            f"resume_from_checkpoint=True, but the run in {output_dir} has finished: "
            f"{epochs[-1]} holds no recipe state (none is written with the last epoch) and "
            f"{step_checkpoint_dir} no step checkpoint. To train on from its weights, start a "
            f"new run with checkpointer.checkpoint_dir={epochs[-1]} (and its checkpoint_files), "
            "without resume_from_checkpoint."
        )
    raise ValueError(
        f"resume_from_checkpoint=True, but there is nothing to resume: no step checkpoint in "
        f"{step_checkpoint_dir} and no epoch checkpoint's recipe state at {recipe_state}. Step "
        f"checkpoints are written with save_every_n_steps=N under output_dir; torchtune's epoch "
        f"checkpoints at the end of every epoch but the last, under checkpointer.output_dir "
        f"(recipe_checkpoint names its recipe state). Check output_dir, or start the run "
        f"without resume_from_checkpoint."
    )


def write_step_checkpoint(
    checkpointer: StepCheckpointer,
    progress: TrainingProgress,
    fingerprint: Mapping[str, Any],
    *,
    device: torch.device,
    dataloader: Any,
    model_state: Mapping[str, torch.Tensor] | None,
    optimizer_state: Mapping[str, Any] | None,
) -> Path:
    """Save everything a resumed run needs to go on with the next window; every rank calls
    this. ``model_state`` and ``optimizer_state`` are read on rank 0 only (full tensors)."""
    return checkpointer.save(
        progress.global_step,
        model_state=model_state,
        optimizer_state=optimizer_state,
        trainer_state={**progress.state_dict(), "fingerprint": dict(fingerprint)},
        rank_state=step_rank_state(device, dataloader, at_epoch_start=progress.at_epoch_start),
    )


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """The RNG states that training draws from (dropout, LoRA dropout, any Python sampling)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Undo :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def run_fingerprint(
    settings: TrainingRunConfig, extra_keys: tuple[str, ...] = (), **extra: Any
) -> dict[str, Any]:
    """The resolved values of ``FINGERPRINT_KEYS`` and of a recipe's own ``extra_keys`` (e.g.
    ``exactga.kd.distillation.KD_FINGERPRINT_KEYS``), plus ``extra`` (e.g. ``world_size``).
    A key the recipe's schema lacks (``max_steps_per_epoch`` of the parity report) is null."""
    fingerprint = {}
    for key in (*FINGERPRINT_KEYS, *extra_keys):
        value = getattr(settings, key, None)
        if isinstance(value, DictConfig) or OmegaConf.is_list(value):
            value = OmegaConf.to_container(value, resolve=True)
        fingerprint[key] = value
    fingerprint.update(extra)
    return json.loads(json.dumps(fingerprint, default=str))  # as it will read back


def check_resume_fingerprint(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    allowed_changes: list[str] | tuple[str, ...],
    checkpoint_path: Path,
) -> None:
    """Refuse a resume whose config changes what the run computes; see the named note.

    Raises:
        ValueError: naming every changed key not listed in ``resume_allow_changed_keys``.
    """
    changes = {
        key: _describe_change(saved.get(key), current.get(key))
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    }
    refused = {key: change for key, change in changes.items() if key not in allowed_changes}
    if refused:
        listing = "; ".join(f"'{key}': {change}" for key, change in refused.items())
        raise ValueError(
            f"resume_from_checkpoint: the config changes what the run computes since "
            f"{checkpoint_path}: {listing}. Restore those keys, or accept the change with "
            f"resume_allow_changed_keys=[{','.join(refused)}]."
        )
    for key, change in changes.items():
        warnings.warn(
            f"resuming with a changed '{key}' ({change}), accepted by resume_allow_changed_keys.",
            stacklevel=2,
        )


def _describe_change(saved: Any, current: Any, path: str = "") -> str:
    """The first difference, e.g. ``num_layers 2 -> 4`` inside a section."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current), key=str):
            if saved.get(key) != current.get(key):
                return _describe_change(saved.get(key), current.get(key), f"{path}{key}.")
    where = f"{path[:-1]} " if path else ""
    return f"{where}{saved!r} in the checkpoint, {current!r} now"


def step_rank_state(device: torch.device, dataloader: Any, at_epoch_start: bool) -> dict[str, Any]:
    """This rank's part of a step checkpoint: RNG states and data-loader position.

    At an epoch boundary there is no position to keep: see [loader position at epoch ends].
    """
    return {
        "rng": capture_rng_state(device),
        "dataloader": None if at_epoch_start else dataloader.state_dict(),
    }
