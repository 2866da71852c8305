"""Step checkpoints: resume mid-epoch at the very next accumulation window, and never lose one.

torchtune 0.6.1's checkpointers write at epoch ends only; the recipes keep them (drop-in) and
add, with ``save_every_n_steps``, a step checkpoint that holds everything a resumed run needs to
end bit-for-bit where an uninterrupted one would: the trained weights (all of them, or the
adapters for LoRA), the optimizer state, the step and epoch counters, and per rank the RNG states
and the ``StatefulDataLoader`` position. See [atomic step checkpoints] and [what a resume may
change].

Layout, under ``<output_dir>/step_checkpoints/``::

    step_000120/
        model.safetensors      trained weights (rank 0 writes the full tensors)
        optimizer.pt           optimizer state (torch.save; loaded with weights_only=True)
        rank_0.pt, rank_1.pt   RNG states and data-loader position of each rank
        trainer_state.json     counters, the run's fingerprint, and every file's size and CRC32;
                               written last, so a directory without it is not a checkpoint

Nothing here unpickles code: weights are safetensors and the rest loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

MANIFEST_FILE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STEP_CHECKPOINT_SUBDIR = "step_checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK_BYTES = 16 << 20
_MANIFEST_KEYS = ("step", "world_size", "trainer_state", "files")

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

# [atomic step checkpoints]
# Every rank writes its files into a hidden staging folder ``.step_N.tmp``; each file is fsynced.
# After a barrier, rank 0 records the size and CRC32 of every file in the manifest, fsyncs it,
# renames the folder to ``step_N`` (atomic on POSIX) and fsyncs the parent. A crash at any point
# leaves either the previous checkpoints untouched plus a staging folder (removed on the next
# save), or a complete new one. What rename cannot protect against (a disk that truncates or
# flips bytes later, a copy cut short) is caught on load: a checkpoint whose files do not match
# the manifest is skipped with a warning naming the file, and the one before it is used. This is
# why ``keep_last_n_checkpoints`` must be at least 2.
#
# [what a resume may change]
# The fingerprint is the resolved value of ``FINGERPRINT_KEYS`` plus the world size. A resumed
# config whose fingerprint differs is refused with the differing keys named, because the run it
# would continue is not the run that was checkpointed: the data order, the window boundaries or
# the weights' shapes change. ``resume_allow_changed_keys: [key, ...]`` accepts named changes
# (say, a tokenizer moved to another path) with a warning. Everything else (learning rate,
# epochs, logging, output folders) may change freely.


@dataclass(frozen=True)
class StepCheckpoint:
    """A step checkpoint read back from disk, validated against its manifest."""

    path: Path
    step: int
    trainer_state: dict[str, Any]
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    rank_state: dict[str, Any]


class CorruptCheckpointError(ValueError):
    """A step checkpoint whose files do not match its manifest."""


class StepCheckpointer:
    """Writes, prunes and finds step checkpoints under one folder.

    Args:
        root: the folder holding ``step_N`` sub-folders.
        keep_last_n: how many complete checkpoints to keep (at least 2, so a damaged latest one
            still leaves one to resume from).
        rank: this process's rank; rank 0 writes the shared files and the manifest.
        world_size: the number of ranks writing their own ``rank_<r>.pt``.
    """

    def __init__(self, root: Path, keep_last_n: int, rank: int = 0, world_size: int = 1) -> None:
        if keep_last_n < 2:
            raise ValueError(
                f"config key 'keep_last_n_checkpoints' must be at least 2, got {keep_last_n}: "
                "a damaged latest checkpoint needs an earlier one to fall back to."
            )
        self.root = Path(root)
        self.keep_last_n = keep_last_n
        self.rank = rank
        self.world_size = world_size

    def save(
        self,
        step: int,
        *,
        model_state: Mapping[str, torch.Tensor] | None,
        optimizer_state: Mapping[str, Any] | None,
        trainer_state: Mapping[str, Any],
        rank_state: Mapping[str, Any],
    ) -> Path:
        """Write checkpoint ``step`` atomically; every rank calls this, in step.

        ``model_state`` and ``optimizer_state`` are read on rank 0 only (the full tensors);
        ``rank_state`` is this rank's own (RNG, data-loader position). ``trainer_state`` must be
        JSON-serialisable.
        """
        final = self.root / _step_dir_name(step)
        staging = self.root / f".{_step_dir_name(step)}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            _remove_stale_staging(self.root)
            staging.mkdir()
        _barrier()
        if self.rank == 0:
            save_file(_contiguous(model_state or {}), staging / MODEL_FILE)
            _fsync(staging / MODEL_FILE)
            if optimizer_state is not None:
                _torch_save_synced(dict(optimizer_state), staging / OPTIMIZER_FILE)
        _torch_save_synced(dict(rank_state), staging / _rank_file(self.rank))
        _barrier()
        if self.rank == 0:
            _write_manifest(staging, step, trainer_state, self.world_size)
            _replace_dir(staging, final)
            self._prune()
        _barrier()
        return final

    def load_latest(self) -> StepCheckpoint | None:
        """The newest checkpoint whose files match its manifest, or ``None`` if there is none.

        A damaged one is skipped with a warning naming the file at fault. Raises if checkpoints
        exist but none is usable, since silently starting over would lose the run.
        """
        candidates = self.list_steps()
        problems = []
        for step in reversed(candidates):
            path = self.root / _step_dir_name(step)
            try:
                return self.load(path)
            except CorruptCheckpointError as err:
                problems.append(str(err))
                warnings.warn(f"{err}; falling back to the previous step checkpoint.", stacklevel=2)
        if problems:
            raise CorruptCheckpointError(
                f"no usable step checkpoint in {self.root}: " + "; ".join(problems)
            )
        return None

    def load(self, path: Path) -> StepCheckpoint:
        """Validate and read one checkpoint folder (this rank's ``rank_<r>.pt`` included)."""
        manifest = _read_manifest(path)
        _verify_files(path, manifest)
        saved_world_size = manifest["world_size"]
        if saved_world_size != self.world_size:
            raise ValueError(
                f"{path} was written by {saved_world_size} ranks and this run has "
                f"{self.world_size}: a step checkpoint resumes with the same world size "
                "(launch with the same --nnodes/--nproc_per_node)."
            )
        optimizer_file = path / OPTIMIZER_FILE
        return StepCheckpoint(
            path=path,
            step=manifest["step"],
            trainer_state=manifest["trainer_state"],
            model_state=load_file(path / MODEL_FILE),
            optimizer_state=_torch_load(optimizer_file) if optimizer_file.exists() else None,
            rank_state=_torch_load(path / _rank_file(self.rank)),
        )

    def list_steps(self) -> list[int]:
        """Steps of the complete-looking checkpoint folders, oldest first."""
        if not self.root.is_dir():
            return []
        steps = (_STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in steps if m)

    def _prune(self) -> None:
        for step in self.list_steps()[: -self.keep_last_n]:
            shutil.rmtree(self.root / _step_dir_name(step))


def step_checkpointer_for(
    output_dir: str, keep_last_n: int, rank: int = 0, world_size: int = 1
) -> StepCheckpointer:
    """The step checkpointer of a run writing into ``output_dir``."""
    root = Path(output_dir) / STEP_CHECKPOINT_SUBDIR
    return StepCheckpointer(root, keep_last_n, rank, world_size)


def should_save_step_checkpoint(step: int, every_n_steps: int | None, epoch_end_step: int) -> bool:
    """Whether optimizer step ``step`` saves a step checkpoint inside the training loop.

    ``save_every_n_steps`` as a predicate (``None`` or 0 turns step checkpoints off), except on
    the epoch's last step (``epoch_end_step``): that one is saved once the epoch is closed, so
    its checkpoint records a finished epoch; see [loader position at epoch ends].
    """
    return bool(every_n_steps) and step % every_n_steps == 0 and step < epoch_end_step


# --- RNG and fingerprints ------------------------------------------------------------------


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


def run_fingerprint(cfg: DictConfig, **extra: Any) -> dict[str, Any]:
    """The resolved values of ``FINGERPRINT_KEYS`` plus ``extra`` (e.g. ``world_size``)."""
    fingerprint = {}
    for key in FINGERPRINT_KEYS:
        value = cfg.get(key)
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


def load_model_state(
    model: torch.nn.Module,
    state_dict: Mapping[str, Any],
    source: str,
    load: Callable[[torch.nn.Module, Mapping[str, Any]], Any] | None = None,
    strict: bool = True,
) -> Any:
    """Load ``state_dict`` into ``model``, or say plainly that it is another model's checkpoint.

    Args:
        model: the model built from the ``model`` config section.
        state_dict: weights read from ``source``.
        source: the file or config key the weights came from, for the message.
        load: how to load (e.g. torchtune's ``load_from_full_model_state_dict`` under FSDP);
            ``model.load_state_dict`` by default.
        strict: require the key sets to match exactly.
    """
    _check_shapes(model, state_dict, source)
    try:
        if load is not None:
            return load(model, state_dict)
        return model.load_state_dict(state_dict, strict=strict)
    except RuntimeError as err:
        # torchtune's and torch's messages list the missing and unexpected keys on later lines.
        detail = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        if len(detail) > 1500:
            detail = detail[:1500] + " ..."
        raise ValueError(
            f"{source} does not fit config key 'model' ({type(model).__name__}): {detail} "
            "Is the checkpoint for another model or size?"
        ) from err


# Note [state-dict keys]
# ``named_modules()`` names a module by the attribute path that reaches it, wrappers
# included: activation checkpointing puts every wrapped layer behind
# ``_checkpoint_wrapped_module.`` and ``torch.compile(module)`` behind ``_orig_mod.``. Those
# wrappers strip their prefix from ``state_dict()`` keys, and torchtune's sharded loading
# looks each full tensor up by state-dict key, so a name taken from ``named_modules()``
# finds nothing there under activation checkpointing (torchtune then fails with
# "'NoneType' object has no attribute 'dtype'"). Module names are therefore turned into
# state-dict keys by dropping the wrapper prefixes, and checked against the real keys.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def state_dict_name(module_name: str) -> str:
    """The state-dict key prefix of a module named ``module_name`` by ``named_modules()``.

    See [state-dict keys].
    """
    for prefix in _WRAPPER_PREFIXES:
        module_name = module_name.replace(prefix, "")
    return module_name


def _check_shapes(model: torch.nn.Module, state_dict: Mapping[str, Any], source: str) -> None:
    """Name the first weight whose shape differs: the usual sign of another model's weights."""
    # Parameters and buffers rather than state_dict(): QLoRA's state-dict hook would dequantize
    # every NF4 weight just to be looked at. DTensor shapes are global shapes.
    expected = {
        state_dict_name(name): tuple(tensor.shape)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }
    for key, value in state_dict.items():
        if key not in expected or not hasattr(value, "shape"):
            continue
        want = expected[key]
        if tuple(value.shape) != want:
            raise ValueError(
                f"{source} does not fit config key 'model': weight '{key}' has shape "
                f"{tuple(value.shape)} in the checkpoint and {want} in the model. Is the "
                "checkpoint for another model or size?"
            )


# --- files ---------------------------------------------------------------------------------


def _step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _contiguous(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host tensors safetensors accepts: contiguous, no two sharing storage.

    Copies only what must be copied: recipes hand over host copies already (gathered under
    FSDP, or ``.cpu()`` of device tensors), and cloning those again would double the host
    memory a full model's checkpoint takes.
    """
    out, seen = {}, set()
    for key, value in tensors.items():
        value = value.detach().cpu().contiguous()
        if value.untyped_storage().data_ptr() in seen:  # tied weights: safetensors refuses
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        out[key] = value
    return out


def _torch_save_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged zip, or a type weights_only refuses
        raise CorruptCheckpointError(f"cannot read {path}: {err}") from err


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (a rename), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_manifest(
    staging: Path, step: int, trainer_state: Mapping[str, Any], world_size: int
) -> None:
    files = {
        p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)}
        for p in sorted(staging.iterdir())
        if p.is_file()
    }
    manifest = {
        "step": step,
        "world_size": world_size,
        "trainer_state": dict(trainer_state),
        "files": files,
    }
    # The manifest checks itself too: a flipped digit in a counter is still valid JSON.
    manifest["manifest_crc32"] = _manifest_crc(manifest)
    path = staging / MANIFEST_FILE
    with open(path, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    _fsync(staging)


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(
            f"step checkpoint {manifest_path} is unreadable ({err})"
        ) from err
    missing = [key for key in (*_MANIFEST_KEYS, "manifest_crc32") if key not in manifest]
    if missing:
        raise CorruptCheckpointError(f"step checkpoint {manifest_path} lacks {missing}")
    if manifest.pop("manifest_crc32") != _manifest_crc(manifest):
        raise CorruptCheckpointError(f"step checkpoint {manifest_path} fails its CRC32 check")
    if _step_dir_name(manifest["step"]) != path.name:
        raise CorruptCheckpointError(
            f"step checkpoint {manifest_path} says step {manifest['step']}, its folder another"
        )
    return manifest


def _manifest_crc(manifest: Mapping[str, Any]) -> int:
    return zlib.crc32(json.dumps(manifest, sort_keys=True).encode())


def _verify_files(path: Path, manifest: Mapping[str, Any]) -> None:
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpointError(f"step checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CorruptCheckpointError(
                f"step checkpoint file {file} has {size} bytes, its manifest says "
                f"{expected['bytes']} (truncated?)"
            )
        if _crc32(file) != expected["crc32"]:
            raise CorruptCheckpointError(f"step checkpoint file {file} fails its CRC32 check")


def _replace_dir(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``; an older ``final`` (same step, re-saved) goes first."""
    if final.exists():
        aside = final.with_name(f".{final.name}.old")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(staging, final)
        shutil.rmtree(aside)
    else:
        os.rename(staging, final)
    _fsync(final.parent)


def _remove_stale_staging(root: Path) -> None:
    """Staging folders left by a crash mid-save; never a complete checkpoint."""
    for stale in root.glob(".step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def find_resume_checkpoint(
    checkpointer: StepCheckpointer, cfg: DictConfig, fingerprint: Mapping[str, Any]
) -> StepCheckpoint | None:
    """The step checkpoint a run with ``resume_from_checkpoint: True`` continues from.

    ``None`` when resuming is off, or when no step checkpoint exists: the recipe then resumes
    from torchtune's epoch checkpoint exactly as stock does. Raises if the config changes what
    the run computes (see [what a resume may change]).
    """
    if not cfg.resume_from_checkpoint:
        return None
    found = checkpointer.load_latest()
    if found is not None:
        check_resume_fingerprint(
            found.trainer_state["fingerprint"],
            fingerprint,
            list(cfg.resume_allow_changed_keys),
            found.path,
        )
    return found


# The recipe attributes a step checkpoint restores; every training recipe declares them in its
# ``__init__`` ("Public state, updated by the checkpoint loader when resuming").
PROGRESS_FIELDS = ("seed", "epochs_run", "global_step", "num_skipped_steps", "num_nonfinite_steps")


def progress_state(recipe: Any, fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """The ``trainer_state`` of a step checkpoint: ``recipe``'s counters and the fingerprint."""
    return {**{name: getattr(recipe, name) for name in PROGRESS_FIELDS}, "fingerprint": fingerprint}


def restore_progress(recipe: Any, trainer_state: Mapping[str, Any]) -> None:
    """Set ``recipe``'s counters from a step checkpoint's ``trainer_state``."""
    for name in PROGRESS_FIELDS:
        setattr(recipe, name, trainer_state[name])


def step_rank_state(device: torch.device, dataloader: Any, at_epoch_start: bool) -> dict[str, Any]:
    """This rank's part of a step checkpoint: RNG states and data-loader position.

    At an epoch boundary there is no position to keep: see [loader position at epoch ends].
    """
    return {
        "rng": capture_rng_state(device),
        "dataloader": None if at_epoch_start else dataloader.state_dict(),
    }


# [loader position at epoch ends]
# With ``max_steps_per_epoch`` an epoch ends before its data does, and the loader's position is
# then mid-way through that epoch's order. An uninterrupted run starts the next epoch with a new
# iterator from its first sample; a run resumed from that position would instead skip as many
# samples of the next epoch's order. So a checkpoint taken at an epoch boundary stores no
# position (``None``), and the resumed run starts the epoch fresh, exactly as the uninterrupted
# one did. (Stock torchtune 0.6.1 stores the position in its epoch checkpoints and skips them.)
