"""Resuming a run: one answer to "where do I go on from?", and what a step checkpoint holds.

A run with ``resume_from_checkpoint: True`` goes on from, in this order:

1. the newest usable step checkpoint under ``<output_dir>/step_checkpoints`` (written with
   ``save_every_n_steps``; see exactga.run.checkpointing): it holds the trained weights (or
   adapters), the optimizer state, the counters (:class:`~exactga.run.progress.TrainingProgress`),
   the data position over all ranks and, per rank, the RNG states and data-loader position, so
   the run goes on with the very next window and ends bit-for-bit where an uninterrupted run
   would; also on another number of data-parallel ranks (see [resharded resume]);
2. otherwise torchtune's epoch checkpoint, exactly as stock torchtune resumes
   (``checkpointer.recipe_checkpoint``, the weights in ``checkpointer.checkpoint_files``).

:func:`find_resume_point` answers that once, and the :class:`ResumePoint` it returns hands
every recipe the weights, optimizer state, loader position and RNG states to start from, so
every recipe resumes the same way. See [what a resume may change], [resharded resume] and
[loader position at epoch ends]. A launch that starts over moves an earlier launch's step
checkpoints aside first (:func:`retire_an_earlier_launch`), so the checkpoint a stop names is
the one a resume finds: see [retired step checkpoints] in exactga.run.checkpointing.
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
# different run. ``samples_per_step`` is added from them and the mesh (:func:`start_run`). See
# [what a resume may change].
FINGERPRINT_KEYS = (
    "model",
    "tokenizer",
    "dataset",
    "collate_fn",
    "shuffle",
    "loss_normalization",
    "drop_partial_window",
    "max_steps_per_epoch",
)
# The global batch: samples per optimizer step over every data-parallel rank, the one number of
# the batch split a resume must keep (see [resharded resume]).
SAMPLES_PER_STEP = "samples_per_step"
_DERIVED_KEYS = {SAMPLES_PER_STEP: "batch_size x gradient_accumulation_steps x data-parallel ranks"}


# Note [what a resume may change]
# The fingerprint is the resolved value of ``FINGERPRINT_KEYS``, the global batch
# (``samples_per_step``: batch_size x gradient_accumulation_steps x data-parallel ranks) and the
# recipe's extras (``tensor_parallel_dim``). A resumed config whose fingerprint differs is
# refused with the differing keys named, because the run it would continue is not the run that
# was checkpointed: the data order, the window boundaries or the weights' shapes change. How the
# global batch is split (ranks, ``batch_size``, ``gradient_accumulation_steps``) may change: see
# [resharded resume]. ``resume_allow_changed_keys: [key, ...]`` accepts named changes
# (say, a tokenizer moved to another path) with a warning. Everything else (learning rate,
# epochs, logging, output folders) may change freely, and so may ``micro_batching`` and
# ``micro_batch_tokens``: they regroup a window's samples without changing which samples it
# holds (see [regrouping is exact]), so a run that ran out of memory can go on with a token
# budget. It then stays exact, though no longer bit-identical to an uninterrupted run.

# Note [resharded resume]
# A step checkpoint of a sharded run holds its weights (or adapters) and optimizer state as
# torch.distributed.checkpoint's shards (``sharded/``; each rank writes its own, no gather on
# rank 0), keyed by parameter name, which DCP reads back into any mesh: FSDP2 over 4 ranks, over
# 1, or one device. A one-device checkpoint's full tensors load into any mesh as before. What
# else a resume on another number of data-parallel ranks needs:
# - the data position over all ranks. Rank r of n reads every n-th sample of one shuffled order
#   (seed 0 and the epoch; [data order] in exactga.data.loader), so after k windows of a global
#   batch G the ranks together have read the order's first k x G samples, however G is split.
#   The checkpoint records that count (``data_position.samples_in_epoch``); the resumed loader
#   of each of the new ranks skips its share of it (count / ranks) and reads on: the next step
#   trains the samples the uninterrupted run's next step trains. The per-rank loader state is
#   used only on the same world size (bit-for-bit as before). The epoch must have as many
#   windows on the new mesh (``windows_per_epoch``), else the epoch ends elsewhere: refused.
# - the RNG states. Each rank's cannot be carried to a rank count that has no such rank, so
#   every rank goes on from rank 0's states. Nothing of the data order draws from them (the
#   sampler is seeded), and with dropout off (every tiny config) nothing in a training step
#   does either: every rank's states are then rank 0's, and the resumed run is the uninterrupted
#   one. A run with dropout draws other masks on another mesh, resumed or not (each rank draws
#   for its own samples), so it is reproducible (the same launch resumes the same way) but not
#   equal to the original mesh's run; this is logged at the resume. A recipe that builds its own
#   loader (GRPO's prompts, PPO) and draws rollouts from each rank's RNG is refused.
# What stays refused: a changed global batch or model (the fingerprint), another tensor-parallel
# size. The numbers: same mesh, bit-identical; another mesh, the fp32 floor, because each
# window's gradient is then summed over other ranks in another order (docs/reliability.md).

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
    world_size: int = 1  # this launch's

    @property
    def resharded(self) -> bool:
        """Whether the step checkpoint was written by another number of ranks; see
        [resharded resume]."""
        found = self.step_checkpoint
        return found is not None and found.world_size != self.world_size

    @property
    def sharded_state(self) -> Path | None:
        """The step checkpoint's torch.distributed.checkpoint folder (weights and optimizer
        state to read into the built model and optimizer), or ``None``."""
        return None if self.step_checkpoint is None else self.step_checkpoint.sharded

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
        """The full model's weights to load: the step checkpoint's, else the checkpointer's
        (also under a sharded step checkpoint, whose state is read in afterwards)."""
        if self.step_checkpoint is not None and self.step_checkpoint.model_state is not None:
            return self.step_checkpoint.model_state
        return ckpt_dict[training.MODEL_KEY]

    def adapter_weights(self, ckpt_dict: Mapping[str, Any]) -> dict[str, Any] | None:
        """The LoRA adapters to go on from, or ``None`` for fresh ones (also under a sharded
        step checkpoint, whose adapters are read in afterwards)."""
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
        if self.step_checkpoint is not None and self.step_checkpoint.model_state is not None:
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
        """This rank's loader position, or ``None`` to start an epoch from its first sample.

        Raises:
            ValueError: the step checkpoint was written by another number of ranks: a loader
                other than exactga.data.loader's cannot be placed by the global position (see
                [resharded resume]).
        """
        if self.resharded:
            raise ValueError(
                f"resume_from_checkpoint: {self.step_checkpoint.path} was written by "
                f"{self.step_checkpoint.world_size} ranks and this launch has {self.world_size}; "
                "this recipe's loader (and its rollouts, drawn from each rank's RNG) resumes on "
                "as many ranks: launch with the same --nnodes/--nproc_per_node."
            )
        if self.step_checkpoint is not None:
            return self.step_checkpoint.rank_state["dataloader"]
        if self.from_epoch_checkpoint:
            return ckpt_dict.get(training.DATALOADER_KEY)
        return None

    @property
    def samples_done_in_epoch(self) -> int | None:
        """Samples of the current epoch's order all ranks together have trained on (``None``:
        the epoch starts); for a resharded resume (see [resharded resume]).

        Raises:
            ValueError: the checkpoint predates the global position.
        """
        assert self.step_checkpoint is not None, "a step checkpoint's position"
        position = self.step_checkpoint.trainer_state.get(DATA_POSITION)
        if position is None:
            raise ValueError(
                f"resume_from_checkpoint: {self.step_checkpoint.path} holds no data position "
                "over all ranks (written by an earlier exactga), so it resumes on the "
                f"{self.step_checkpoint.world_size} ranks that wrote it only."
            )
        return position["samples_in_epoch"]

    def check_epoch_length(self, windows_per_epoch: int) -> None:
        """On a resharded resume, refuse a mesh that cuts an epoch into another number of
        windows (its last window, and so every later step, would differ)."""
        if not self.resharded:
            return
        saved = self.step_checkpoint.trainer_state[DATA_POSITION]["windows_per_epoch"]
        if saved != windows_per_epoch:
            raise ValueError(
                f"resume_from_checkpoint: on {self.world_size} ranks an epoch has "
                f"{windows_per_epoch} optimizer steps, on the {self.step_checkpoint.world_size} "
                f"that wrote {self.step_checkpoint.path} it had {saved} (the dataset does not "
                "divide evenly over the ranks' windows); resume on ranks that cut it alike."
            )

    def restore_rng(self, device: torch.device) -> None:
        """Put back this rank's RNG states (rank 0's on a resharded resume: see [resharded
        resume]); call last in setup, since building the model and the data draws from them."""
        if self.step_checkpoint is not None:
            restore_rng_state(self.step_checkpoint.rank_state["rng"], device)


def checkpointer_source(cfg_checkpointer: DictConfig) -> str:
    """Where torchtune's checkpointer reads weights from, for messages about weights that do
    not fit the model (the base weights, or an epoch checkpoint's)."""
    return f"checkpointer.checkpoint_dir ({cfg_checkpointer.checkpoint_dir})"


def start_run(
    settings: SingleDeviceRecipeConfig,
    extra_keys: tuple[str, ...] = (),
    *,
    dp_size: int = 1,
    **extra: Any,
) -> tuple[StepCheckpointer, dict[str, Any], ResumePoint]:
    """A run's step checkpointer (this rank's, in ``output_dir``), its fingerprint (the config's
    values a resume must match, the global batch over ``dp_size`` data-parallel ranks,
    ``extra_keys`` and ``extra``: see :func:`run_fingerprint`) and where it goes on from
    (:func:`find_resume_point`)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    checkpointer = step_checkpointer_for(
        settings.output_dir, settings.keep_last_n_checkpoints, rank, world_size
    )
    fingerprint = run_fingerprint(settings, extra_keys, dp_size=dp_size, **extra)
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
    resume = ResumePoint(ResumeFrom.STEP_CHECKPOINT, found, checkpointer.world_size)
    if checkpointer.rank == 0:
        log.info(f"Resuming from step checkpoint {found.path}")
        if resume.resharded:
            log.info(resharded_note(found, checkpointer.world_size))
    return resume


def resharded_note(found: StepCheckpoint, world_size: int) -> str:
    """The line a resharded resume logs; see [resharded resume]."""
    return (
        f"exactga: {found.path} was written by {found.world_size} rank(s), this launch has "
        f"{world_size}: the weights and optimizer state are resharded, the data goes on at the "
        "same sample of the epoch's order, and every rank goes on from rank 0's RNG states "
        "(the same run unless it draws during training, e.g. dropout). Numbers match the "
        "uninterrupted run to the fp32 floor, not bit for bit (another summation order)."
    )


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
    sharded_state: Mapping[str, Any] | None = None,
    dp_size: int = 1,
) -> Path:
    """Save everything a resumed run needs to go on with the next window; every rank calls
    this. ``model_state`` and ``optimizer_state`` are read on rank 0 only (full tensors);
    ``sharded_state`` instead is every rank's shards (a sharded run). ``dp_size``: the
    data-parallel ranks, for the data position over all of them (see [resharded resume])."""
    trainer_state = {
        **progress.state_dict(),
        "fingerprint": dict(fingerprint),
        DATA_POSITION: data_position(progress, dataloader, dp_size),
    }
    return checkpointer.save(
        progress.global_step,
        model_state=model_state,
        optimizer_state=optimizer_state,
        sharded_state=sharded_state,
        trainer_state=trainer_state,
        rank_state=step_rank_state(device, dataloader, at_epoch_start=progress.at_epoch_start),
    )


DATA_POSITION = "data_position"  # a step checkpoint's trainer state: see [resharded resume]


def data_position(progress: TrainingProgress, dataloader: Any, dp_size: int) -> dict[str, Any]:
    """Where the epoch's data stands over all ranks: the samples of its order they have read
    together (``None`` at an epoch's start, or for a loader without a stateful sampler), and the
    epoch's windows. See [resharded resume]."""
    yielded = getattr(getattr(dataloader, "sampler", None), "yielded", None)
    at_start = progress.at_epoch_start or yielded is None
    return {
        "data_parallel_ranks": dp_size,
        "samples_in_epoch": None if at_start else yielded * dp_size,
        "windows_per_epoch": progress.steps_per_epoch,
    }


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
    settings: TrainingRunConfig,
    extra_keys: tuple[str, ...] = (),
    *,
    dp_size: int = 1,
    **extra: Any,
) -> dict[str, Any]:
    """The resolved values of ``FINGERPRINT_KEYS`` and of a recipe's own ``extra_keys`` (e.g.
    ``exactga.kd.distillation.KD_FINGERPRINT_KEYS``), the global batch over ``dp_size``
    data-parallel ranks (``samples_per_step``), plus ``extra`` (e.g. ``tensor_parallel_dim``).
    A key the recipe's schema lacks (``max_steps_per_epoch`` of the parity report) is null."""
    fingerprint = {}
    for key in (*FINGERPRINT_KEYS, *extra_keys):
        value = getattr(settings, key, None)
        if isinstance(value, DictConfig) or OmegaConf.is_list(value):
            value = OmegaConf.to_container(value, resolve=True)
        fingerprint[key] = value
    fingerprint[SAMPLES_PER_STEP] = samples_per_step(
        getattr(settings, "batch_size", None),
        getattr(settings, "gradient_accumulation_steps", None),
        dp_size,
    )
    fingerprint.update(extra)
    return json.loads(json.dumps(fingerprint, default=str))  # as it will read back


def samples_per_step(batch_size: int | None, accumulation: int | None, dp_size: int) -> int | None:
    """The global batch: ``batch_size x gradient_accumulation_steps x dp_size`` (``None`` for a
    schema without ``batch_size``)."""
    return None if batch_size is None else batch_size * (accumulation or 1) * dp_size


def _as_saved_now(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A fingerprint written before ``samples_per_step`` (its batch split and world size
    instead), in today's keys, so such a checkpoint resumes as before."""
    if SAMPLES_PER_STEP in saved or "world_size" not in saved:
        return dict(saved)
    old = dict(saved)
    batch, accumulation = old.pop("batch_size", None), old.pop("gradient_accumulation_steps", None)
    dp_size = old.pop("world_size") // old.get("tensor_parallel_dim", 1)
    return {**old, SAMPLES_PER_STEP: samples_per_step(batch, accumulation, dp_size)}


def _one_device_as_one_shard(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """A one-device run's fingerprint (no ``tensor_parallel_dim``) as a distributed one's with
    tensor-parallel size 1: the one computes what the other does, so either resumes the other's
    checkpoint (see [resharded resume])."""
    return {"tensor_parallel_dim": 1, **fingerprint}


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
    saved, current = (
        _one_device_as_one_shard(_as_saved_now(saved)),
        _one_device_as_one_shard(current),
    )
    changes = {
        key: _describe_change(saved.get(key), current.get(key))
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    }
    refused = {key: change for key, change in changes.items() if key not in allowed_changes}
    if refused:
        listing = "; ".join(f"{_named(key)}: {change}" for key, change in refused.items())
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


def _named(key: str) -> str:
    """A fingerprint key for a message, a derived one with what it is made of."""
    made_of = _DERIVED_KEYS.get(key)
    return f"'{key}' ({made_of})" if made_of else f"'{key}'"


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
