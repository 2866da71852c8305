"""Step checkpoints on disk: written atomically, checked on reading, pruned; never lose one.

torchtune 0.6.1's checkpointers write at epoch ends only; the recipes keep them (drop-in) and
add, with ``save_every_n_steps``, a step checkpoint that holds everything a resumed run needs to
end bit-for-bit where an uninterrupted one would: the trained weights (all of them, or the
adapters for LoRA), the optimizer state, the step and epoch counters, the data position over all
ranks, and per rank the RNG states and the ``StatefulDataLoader`` position. This module is the
storage only (see [atomic step checkpoints]); what goes in a checkpoint and when a run resumes
from one is ``exactga.run.resume``.

Layout, under ``<output_dir>/step_checkpoints/``::

    step_000120/
        model.safetensors      trained weights (one device: the full tensors)
        optimizer.pt           optimizer state (torch.save; loaded with weights_only=True)
        sharded/               instead of both under FSDP2: torch.distributed.checkpoint's files
                               (each rank writes its shards), read back on any number of ranks
        rank_0.pt, rank_1.pt   RNG states and data-loader position of each rank
        trainer_state.json     counters, the run's fingerprint, the data position over all
                               ranks, and every file's size and CRC32 (``sharded/`` files too);
                               written last, so a directory without it is not a checkpoint

Nothing here unpickles code: weights are safetensors or torch.distributed.checkpoint's files, and
the rest loads with ``torch.load(weights_only=True)``. See [resharded resume] in
exactga.run.resume for what may change between the mesh that wrote a checkpoint and the one that
reads it.

Step checkpoints that are not this run's line are moved aside, never deleted, into
``<output_dir>/retired_step_checkpoints/<date>_<time>/`` (see [retired step checkpoints]).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

MANIFEST_FILE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SHARDED_SUBDIR = "sharded"  # torch.distributed.checkpoint's files of a sharded run
STEP_CHECKPOINT_SUBDIR = "step_checkpoints"
RETIRED_SUBDIR = "retired_step_checkpoints"  # beside it; see [retired step checkpoints]
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK_BYTES = 16 << 20
_MANIFEST_KEYS = ("step", "world_size", "trainer_state", "files")


# Note [atomic step checkpoints]
# Every rank writes its files into a hidden staging folder ``.step_N.tmp``; each file is fsynced
# (a sharded run's ``sharded/`` files by torch.distributed.checkpoint's writer, each rank its
# own). After a barrier, rank 0 records the size and CRC32 of every file in the manifest, fsyncs it,
# renames the folder to ``step_N`` (atomic on POSIX) and fsyncs the parent. A crash at any point
# leaves either the previous checkpoints untouched plus a staging folder (removed on the next
# save), or a complete new one. What rename cannot protect against (a disk that truncates or
# flips bytes later, a copy cut short) is caught on load: a checkpoint whose files do not match
# the manifest is skipped with a warning naming the file, and the one before it is used. This is
# why ``keep_last_n_checkpoints`` must be at least 2.

# Note [retired step checkpoints]
# The step checkpoints of an output folder are one line of launches: the launch that started
# the run and the launches that resumed it. A launch that starts over (no
# ``resume_from_checkpoint``) into a folder holding an earlier launch's step checkpoints used to
# share the folder with them: pruning, which keeps the highest steps, deleted the new launch's
# own checkpoints (the one its stop message had just named among them), and
# ``resume_from_checkpoint=True`` went on from the earlier launch's newest step (issue #62). So
# such a launch first moves them aside, whole and never deleted: rank 0 claims the new folder
# ``retired_step_checkpoints/<date>_<time>`` (``mkdir``, atomic: a second launch in the same
# second gets ``_2``) and renames ``step_checkpoints`` over it (one rename, atomic on POSIX;
# the parents are then fsynced), while the other ranks wait at a barrier; one log line says
# where they went, why, and how to go on from them instead (put the folder back as
# ``step_checkpoints``, add the key). A crash leaves them in one place or the other, never
# split. Likewise a save first moves aside any checkpoint of a later step than its own: one
# the resumed launch skipped as damaged (or one put there by hand), which pruning would
# otherwise keep in place of an intact one, and which would stand newest. So the newest step
# in the folder is always the checkpoint its line wrote last: the one a stop message names is
# the one the printed command (``resume_from_checkpoint=True``) goes on from.


@dataclass(frozen=True)
class StepCheckpoint:
    """A step checkpoint read back from disk, validated against its manifest."""

    path: Path
    step: int
    trainer_state: dict[str, Any]
    model_state: dict[str, torch.Tensor] | None  # None: the state is in ``sharded``
    optimizer_state: dict[str, Any] | None
    rank_state: dict[str, Any]  # this rank's, or rank 0's when written by another world size
    world_size: int  # the ranks that wrote it

    @property
    def sharded(self) -> Path | None:
        """The folder of torch.distributed.checkpoint's files (weights and optimizer state of
        a sharded run), or ``None`` when ``model_state`` holds the weights."""
        folder = self.path / SHARDED_SUBDIR
        return folder if folder.is_dir() else None


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
        sharded_state: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` atomically; every rank calls this, in step.

        ``model_state`` and ``optimizer_state`` are read on rank 0 only (the full tensors);
        ``sharded_state`` instead is every rank's shards (a torch.distributed.checkpoint state
        dict), written collectively into ``sharded/``. ``rank_state`` is this rank's own (RNG,
        data-loader position). ``trainer_state`` must be JSON-serialisable.
        """
        final = self.root / _step_dir_name(step)
        staging = self.root / f".{_step_dir_name(step)}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            _remove_stale_staging(self.root)
            staging.mkdir()
        _barrier()
        if sharded_state is not None:  # collective; each rank's files fsynced by the writer
            dcp.save(dict(sharded_state), storage_writer=_synced_writer(staging / SHARDED_SUBDIR))
        elif self.rank == 0:
            save_file(_contiguous(model_state or {}), staging / MODEL_FILE)
            _fsync(staging / MODEL_FILE)
            if optimizer_state is not None:
                _torch_save_synced(dict(optimizer_state), staging / OPTIMIZER_FILE)
        _torch_save_synced(dict(rank_state), staging / _rank_file(self.rank))
        _barrier()
        if self.rank == 0:
            _write_manifest(staging, step, trainer_state, self.world_size)
            self._retire_later_steps_than(step)
            replace_dir(staging, final)
            self._prune()
        _barrier()
        return final

    def retire_all(self) -> Path | None:
        """Move every checkpoint here aside, for a launch that starts over; every rank calls
        this (rank 0 moves, the others wait). The folder they went to, on rank 0; ``None`` on
        the other ranks or when there was none. See [retired step checkpoints]."""
        retired = None
        if self.rank == 0 and self.list_steps():
            retired = _claim_retired_folder(self.root.parent / RETIRED_SUBDIR)
            os.rename(self.root, retired)  # over the claimed empty folder: atomic
            _fsync(retired.parent)
            _fsync(self.root.parent)
        _barrier()
        return retired

    def _retire_later_steps_than(self, step: int) -> None:
        """Before saving ``step``: move aside the checkpoints of later steps (rank 0); see
        [retired step checkpoints]."""
        later = [self.root / _step_dir_name(s) for s in self.list_steps() if s > step]
        if not later:
            return
        retired = _claim_retired_folder(self.root.parent / RETIRED_SUBDIR)
        for path in later:
            os.rename(path, retired / path.name)
        _fsync(retired)
        _fsync(self.root)
        warnings.warn(
            f"moved step checkpoint {', '.join(p.name for p in later)} to {retired}: of a "
            f"later step than the step {step} this run saves now, so not of its line (skipped "
            "as damaged when it resumed, or put there by hand); a resume goes on from step "
            f"{step}.",
            stacklevel=3,
        )

    def load_latest(self) -> StepCheckpoint | None:
        """The newest checkpoint whose files match its manifest, or ``None`` if there is none.

        A damaged one is skipped with a warning naming the file at fault. Raises if checkpoints
        exist but none is usable, since silently starting over would lose the run.
        """
        candidates = self.list_steps()
        problems = []
        for left, step in reversed(list(enumerate(candidates))):
            path = self.root / _step_dir_name(step)
            try:
                return self.load(path)
            except CorruptCheckpointError as err:
                problems.append(str(err))
                if left > 0:  # the last one's problem is in the error below
                    warnings.warn(
                        f"{err}; falling back to the previous step checkpoint.", stacklevel=2
                    )
        if problems:
            raise CorruptCheckpointError(
                f"no usable step checkpoint in {self.root}: {'; '.join(problems)}. Put back an "
                f"intact copy, or delete {self.root} (or pick another output_dir) and start "
                "without resume_from_checkpoint."
            )
        return None

    def load(self, path: Path) -> StepCheckpoint:
        """Validate and read one checkpoint folder: this rank's ``rank_<r>.pt``, or rank 0's
        when another world size wrote it (see [resharded resume] in exactga.run.resume). The
        ``sharded/`` files are checked here and read into the model later."""
        manifest = _read_manifest(path)
        _verify_files(path, manifest)
        saved_world_size = manifest["world_size"]
        rank = self.rank if saved_world_size == self.world_size else 0
        model_file, optimizer_file = path / MODEL_FILE, path / OPTIMIZER_FILE
        return StepCheckpoint(
            path=path,
            step=manifest["step"],
            trainer_state=manifest["trainer_state"],
            model_state=load_file(model_file) if model_file.exists() else None,
            optimizer_state=_torch_load(optimizer_file) if optimizer_file.exists() else None,
            rank_state=_torch_load(path / _rank_file(rank)),
            world_size=saved_world_size,
        )

    def latest_trainer_state(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint's folder and recorded trainer state (its manifest alone, not
        checked against the files: for a hint, not a resume), or None if there is none."""
        for step in reversed(self.list_steps()):
            path = self.root / _step_dir_name(step)
            try:
                return path, _read_manifest(path)["trainer_state"]
            except CorruptCheckpointError:
                continue
        return None

    def list_steps(self) -> list[int]:
        """Steps of the complete-looking checkpoint folders, oldest first."""
        if not self.root.is_dir():
            return []
        steps = (_STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in steps if m)

    def _prune(self) -> None:
        for step in self.list_steps()[: -self.keep_last_n]:
            shutil.rmtree(self.root / _step_dir_name(step))


def step_checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The trained weights (or adapters) a step checkpoint folder holds, as full host tensors:
    its ``model.safetensors``, or its ``sharded/`` files put together (whatever number of
    ranks wrote them). For reading a checkpoint outside a run (tests, benchmarks, a user
    comparing steps); the folder is not checked against its manifest here."""
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        return load_file(path / MODEL_FILE)
    reader = dcp.FileSystemReader(path / SHARDED_SUBDIR)
    prefix = "model."  # contents.sharded_train_state's section of the weights
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # one process reads it: no process group, as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len(prefix) :]: value for key, value in state.items()}


def step_checkpointer_for(
    output_dir: str, keep_last_n: int, rank: int = 0, world_size: int = 1
) -> StepCheckpointer:
    """The step checkpointer of a run writing into ``output_dir``."""
    root = Path(output_dir) / STEP_CHECKPOINT_SUBDIR
    return StepCheckpointer(root, keep_last_n, rank, world_size)


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


def _synced_writer(folder: Path) -> dcp.FileSystemWriter:
    """torch.distributed.checkpoint's writer into ``folder``, each file fsynced before the
    save returns (its default, spelled out: the rename that publishes them relies on it)."""
    return dcp.FileSystemWriter(folder, sync_files=True)


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
        p.relative_to(staging).as_posix(): {"bytes": p.stat().st_size, "crc32": _crc32(p)}
        for p in sorted(staging.rglob("*"))
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
    if (staging / SHARDED_SUBDIR).is_dir():  # its entries, written by every rank
        _fsync(staging / SHARDED_SUBDIR)
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


def sync_tree(folder: Path) -> None:
    """Every file and folder under ``folder`` (and it) flushed to disk: before a rename
    publishes files a writer did not flush (torchtune's checkpointers)."""
    for path in sorted(folder.rglob("*"), reverse=True):  # a folder's entries before it
        _fsync(path)
    _fsync(folder)


def write_json_synced(path: Path, record: Mapping[str, Any]) -> None:
    """``record`` as JSON at ``path``, on disk before this returns."""
    with open(path, "w") as f:
        json.dump(dict(record), f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def replace_dir(staging: Path, final: Path) -> None:
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


def _claim_retired_folder(parent: Path) -> Path:
    """A new empty ``<parent>/<date>_<time>`` folder (``_2``, ``_3`` ... when taken), made
    with ``mkdir`` so two launches never claim one; see [retired step checkpoints]."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    for attempt in range(1, 1000):
        folder = parent / (stamp if attempt == 1 else f"{stamp}_{attempt}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise RuntimeError(f"no free folder name for {stamp} in {parent}")


def _remove_stale_staging(root: Path) -> None:
    """Staging folders left by a crash mid-save; never a complete checkpoint."""
    for stale in root.glob(".step_*"):
        shutil.rmtree(stale, ignore_errors=True)


# Note [adapter folder]
# torchtune writes an epoch's merged weights and, beside them, the PEFT adapter
# (``adapter_config.json``, ``adapter_model.safetensors``) into one folder. transformers 5
# (through its PEFT integration) attaches an adapter it finds in the folder it loads, on top of
# the weights it loads there: ``from_pretrained("epoch_0")`` then computes the adapter twice,
# silently (issue #23; stock 0.6.1 has the same trap). So the PEFT files go into their own
# folder, ``epoch_N/adapter/``: the epoch folder is a plain model folder (config.json,
# safetensors, tokenizer files) that every loader reads as the fine-tuned model, and
# ``PeftModel.from_pretrained(base, "epoch_N/adapter")`` applies the adapter once, to the base.
# ``adapter_config.json`` names that base (``base_model_name_or_path``): the hub repository
# torchtune recorded when it downloaded the model, else the absolute path of the checkpoint
# folder the run read; and its ``task_type`` (``CAUSAL_LM``), which PEFT's
# ``AutoPeftModelForCausalLM`` needs to load the adapter with its base in one call.
# torchtune's own ``adapter_model.pt`` stays where its epoch resume looks for it
# (``epoch_N/adapter_model.pt``); no loader of Hugging Face folders reads ``.pt``. The folder
# appears whole: it is filled under a hidden name, then renamed.
ADAPTER_SUBDIR = "adapter"
PEFT_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def move_peft_adapter_to_own_folder(epoch_dir: Path, base_model: str | None) -> Path | None:
    """Move the PEFT adapter torchtune wrote into ``epoch_dir`` to ``epoch_dir/adapter``, with
    ``base_model`` as its ``base_model_name_or_path`` unless torchtune set one; the new folder,
    or None when there was no adapter. See [adapter folder]."""
    found = [epoch_dir / name for name in PEFT_ADAPTER_FILES if (epoch_dir / name).is_file()]
    if not found:
        return None
    final = epoch_dir / ADAPTER_SUBDIR
    staging = epoch_dir / f".{ADAPTER_SUBDIR}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for path in found:
        os.replace(path, staging / path.name)
    config_path = staging / PEFT_ADAPTER_FILES[0]
    if config_path.is_file():
        adapter_config = json.loads(config_path.read_text())
        if base_model is not None:
            adapter_config.setdefault("base_model_name_or_path", base_model)
        # Every recipe here trains a causal LM; PEFT's AutoPeftModelForCausalLM needs the type.
        adapter_config.setdefault("task_type", "CAUSAL_LM")
        config_path.write_text(json.dumps(adapter_config, indent=2))
    for path in staging.iterdir():
        _fsync(path)
    replace_dir(staging, final)
    return final
