"""What a run's checkpoints hold of its model and optimizer, written the one way for each kind of
model: full weights or adapters, on one device or gathered from FSDP2 shards on rank 0.

Epoch checkpoints are torchtune's (stock's files and layout: the weights; for LoRA the adapters,
their config and merged weights unless adapter-only; recipe and optimizer state while training
goes on). Step checkpoints are exactga's atomic ones (``exactga.run.resume``: weights, optimizer,
counters, RNG and loader position). Under data parallelism every rank calls both; rank 0 writes,
except a step checkpoint's weights and optimizer state, which every rank writes as its shards
(torch.distributed.checkpoint; see [resharded resume] in exactga.run.resume).
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torchtune import training, utils

from exactga.accumulation.optimizers import OptimizerInBackward, share_initial_lr
from exactga.lora.adapters import LoraSettings, adapter_state, save_epoch_checkpoint
from exactga.run.checkpointing import (
    CorruptCheckpointError,
    StepCheckpointer,
    replace_dir,
    sync_tree,
    write_json_synced,
)
from exactga.run.progress import TrainingProgress
from exactga.run.resume import write_step_checkpoint
from exactga.runtime import distributed

log = utils.get_logger("INFO")

BEST_SUBDIR = "best"  # keep_best_checkpoint: beside the epoch folders
BEST_RECORD = "best_validation.json"  # in it: the step and the figure of its weights


@dataclass
class RunCheckpoints:
    """The checkpoints of one run.

    Args:
        progress: the run's counters (what a checkpoint records of them).
        step_checkpointer: where step checkpoints go (``step_checkpointer_for``).
        fingerprint: what a resume must match (``run_fingerprint``).
        device: the training device (RNG state, gathering).
        epoch_writer: torchtune's checkpointer, or for a sharded full-weight model its
            ``CheckpointClient`` (which gathers, and writes asynchronously when asked).
        lora: the adapters' settings for a LoRA model, ``None`` for full weights.
        adapter_only: ``save_adapter_weights_only``: no merged weights at an epoch's end.
        sharded: the model is sharded with FSDP2 over the data-parallel ranks.
        dp_size: the data-parallel ranks (a step checkpoint's data position counts over all).
        parts: for a trained module that holds several models (PPO's policy and value), the
            checkpointer of each submodule by attribute name, the first ``epoch_writer`` itself:
            an epoch checkpoint writes each model with its own checkpointer, the first with the
            recipe and optimizer state, as stock does. Step checkpoints hold the whole module.
    """

    progress: TrainingProgress
    step_checkpointer: StepCheckpointer
    fingerprint: Mapping[str, Any]
    device: torch.device
    epoch_writer: Any
    lora: LoraSettings | None = None
    adapter_only: bool = False
    sharded: bool = False
    dp_size: int = 1
    parts: Mapping[str, Any] | None = None

    def save_epoch(self, model: nn.Module, optimizer: Optimizer, epoch: int) -> None:
        """The checkpoint of ``epoch``, as stock writes it."""
        intermediate = not self.progress.is_last_epoch(epoch)
        if self.lora is not None:
            self._save_adapters(model, optimizer, epoch, intermediate)
        elif self.parts:
            self._save_parts(model, optimizer, epoch)
        elif self.sharded:  # torchtune's client gathers the full state on rank 0 and writes
            self.epoch_writer.save_checkpoint(
                model=model,
                optimizer=optimizer,
                training_progress=self.progress.for_checkpoint_client(),
                epoch=epoch,
            )
        else:
            ckpt_dict: dict[str, Any] = {training.MODEL_KEY: model.state_dict()}
            if intermediate:
                ckpt_dict.update(self.progress.epoch_checkpoint_state())
                ckpt_dict[training.OPT_KEY] = optimizer.state_dict()
            self.epoch_writer.save_checkpoint(
                ckpt_dict, epoch=epoch, intermediate_checkpoint=intermediate
            )

    def save_best(self, model: nn.Module, step: int, name: str, figure: float) -> Path:
        """The weights for users, the files of a last epoch's folder (no recipe or optimizer
        state), as ``best/`` beside the epoch folders, with ``best/best_validation.json``
        naming ``step`` and the figure (``name``: ``figure``); the previous best is replaced
        atomically. A module of several models (PPO's policy and value) writes each through its
        own checkpointer, beside its own epoch folders, the first's folder returned. Every rank
        calls this; the folder. See [the best checkpoint] in exactga.run.steps."""
        # The epoch the step trained in (as epoch_N counts): validation runs before it closes.
        record = {"step": step, "epoch": self.progress.epochs_run, name: figure}
        if self.parts:  # one device: each part's weights through its checkpointer
            folders = [
                self._replace_best(
                    writer, record, partial(_write_weights, writer, getattr(model, part))
                )
                for part, writer in self.parts.items()
            ]
            return folders[0]
        writer = self.epoch_writer._get_checkpointer() if self._client_writes else self.epoch_writer
        return self._replace_best(writer, record, partial(self._write_best_weights, model, writer))

    def _write_best_weights(self, model: nn.Module, writer: Any) -> None:
        """The trained model's weights as ``writer``'s ``epoch_0`` (every rank calls this)."""
        if self.lora is not None:
            self._save_adapters(model, None, 0, intermediate=False)
        elif self.sharded:
            state = training.gather_cpu_state_dict(
                model, distributed.is_rank_zero(), device=self.device
            )
            if distributed.is_rank_zero():
                writer.save_checkpoint({training.MODEL_KEY: state}, epoch=0)
        else:
            _write_weights(writer, model)

    def _replace_best(self, writer: Any, record: dict[str, Any], write: Callable[[], None]) -> Path:
        """``write()`` into a hidden folder beside ``writer``'s epoch folders, ``record``
        beside the weights, renamed over ``best/``; every rank calls this, rank 0 writes."""
        final = Path(writer._output_dir) / BEST_SUBDIR
        staging = final.with_name(f".{BEST_SUBDIR}.tmp")  # the writer's epoch_0/ goes in it
        if distributed.is_rank_zero():
            shutil.rmtree(staging, ignore_errors=True)
        with _writing_into(writer, staging), _torchtune_info_quiet():
            write()
        if distributed.is_rank_zero():
            written = staging / "epoch_0"
            write_json_synced(written / BEST_RECORD, record)
            sync_tree(written)
            replace_dir(written, final)
            shutil.rmtree(staging)
        distributed.barrier()
        return final

    @property
    def _client_writes(self) -> bool:
        """torchtune's ``CheckpointClient`` writes the epochs (a sharded full-weight model)."""
        return self.sharded and self.lora is None

    def _save_parts(self, model: nn.Module, optimizer: Optimizer, epoch: int) -> None:
        """Each part of ``model`` through its own checkpointer; only the first carries the
        recipe and optimizer state while training goes on (stock PPO writes its value model
        with ``intermediate_checkpoint=False`` always)."""
        assert self.parts is not None and not self.sharded, "parts are a one-device module's"
        intermediate = not self.progress.is_last_epoch(epoch)
        for index, (name, writer) in enumerate(self.parts.items()):
            ckpt_dict: dict[str, Any] = {training.MODEL_KEY: getattr(model, name).state_dict()}
            first = index == 0
            if first and intermediate:
                ckpt_dict.update(self.progress.epoch_checkpoint_state())
                ckpt_dict[training.OPT_KEY] = optimizer.state_dict()
            writer.save_checkpoint(
                ckpt_dict, epoch=epoch, intermediate_checkpoint=first and intermediate
            )

    def save_step(self, model: nn.Module, optimizer: Optimizer, dataloader: Any) -> Path:
        """Everything a resumed run needs to go on with the next window; atomic. A LoRA run's
        frozen base is not in it: a resumed run reads it from the checkpointer again. A sharded
        model's weights and optimizer state go in as every rank's shards, which any mesh reads
        back (:func:`load_sharded_train_state`)."""
        model_state = optimizer_state = sharded_state = None
        if self.sharded:
            sharded_state = sharded_train_state(model, optimizer)
        else:
            model_state = adapter_state(model) if self.lora is not None else model.state_dict()
            optimizer_state = optimizer.state_dict()
        return write_step_checkpoint(
            self.step_checkpointer,
            self.progress,
            self.fingerprint,
            device=self.device,
            dataloader=dataloader,
            model_state=model_state,
            optimizer_state=optimizer_state,
            sharded_state=sharded_state,
            dp_size=self.dp_size,
        )

    def _save_adapters(
        self, model: nn.Module, optimizer: Optimizer | None, epoch: int, intermediate: bool
    ) -> None:
        """Adapter weights and config, merged weights unless adapter-only, recipe and optimizer
        state if training goes on (``intermediate``): the same dictionary stock hands its
        checkpointer."""
        start = time.perf_counter()
        rank_zero = distributed.is_rank_zero()
        if self.sharded:
            state_dict = training.gather_cpu_state_dict(
                model, rank_zero, device=self.device, adapter_weights_only=self.adapter_only
            )
            optimizer_state = None
            if intermediate:
                optimizer_state = training.get_full_optimizer_state_dict(
                    model, optimizer, rank_zero, device=self.device
                )
        else:
            # Host tensors: merging then needs no second model on the device.
            state_dict = {k: v.cpu() for k, v in model.state_dict().items()}
            optimizer_state = optimizer.state_dict() if intermediate else None
        if rank_zero:
            training_state = None  # recipe and optimizer state, if training goes on
            if intermediate:
                training_state = self.progress.epoch_checkpoint_state()
                training_state[training.OPT_KEY] = optimizer_state
            save_epoch_checkpoint(  # the PEFT adapter in epoch_N/adapter/: docs/using_outputs.md
                self.epoch_writer,
                state_dict,
                self.lora,
                epoch=epoch,
                adapter_only=self.adapter_only,
                training_state=training_state,
            )
            if self.sharded:
                log.info(f"Checkpoint gathered and written in {time.perf_counter() - start:.2f} s")
        distributed.barrier()


# The trained weights only: a LoRA run's frozen base (and any frozen weight) is read from the
# checkpointer again, unchanged since the start.
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


def sharded_train_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's shards of the trained weights and of the optimizer state, keyed by parameter
    name (torch.distributed.checkpoint's state dicts, also of an unsharded model); every rank
    calls this. A fresh optimizer's state is created (a zero step at learning rate 0) so that
    it can be read into. See [resharded resume] in exactga.run.resume."""
    return {
        "model": get_model_state_dict(model, options=_TRAINED_ONLY),
        "optimizer": get_optimizer_state_dict(model, _optimizers(optimizer), options=_TRAINED_ONLY),
    }


def load_sharded_train_state(model: nn.Module, optimizer: Optimizer, folder: Path) -> None:
    """Read a :func:`sharded_train_state` written on any mesh (``folder``: a step
    checkpoint's ``sharded/``) into ``model`` and ``optimizer`` as this mesh shards them; every
    rank calls this.

    Raises:
        ValueError: the checkpoint lacks a trained weight of ``model``.
    """
    state = sharded_train_state(model, optimizer)  # the shards this rank reads into
    reader = dcp.FileSystemReader(folder)
    _add_saved_group_entries(state["optimizer"], reader.read_metadata())
    with warnings.catch_warnings():
        # One device (a sharded run's checkpoint resumed on one): no process group, as meant.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(
                state,
                storage_reader=reader,
                planner=_WeightsOnlyLoadPlanner(),
                no_dist=not torch.distributed.is_initialized(),
            )
        except CheckpointException as err:  # each rank's failure, with DCP's traceback
            (reason, _), *_ = err.failures.values()
            if isinstance(reason, CorruptCheckpointError):
                raise reason from err
            raise
    loose = StateDictOptions(ignore_frozen_params=True, strict=False)  # the frozen: not in it
    missing, unexpected = set_model_state_dict(model, state["model"], options=loose)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or trained & set(missing):
        raise ValueError(
            f"resume_from_checkpoint: {folder} does not fit the model: missing "
            f"{sorted(trained & set(missing))[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    set_optimizer_state_dict(
        model, _optimizers(optimizer), state["optimizer"], options=_TRAINED_ONLY
    )
    if isinstance(optimizer, OptimizerInBackward):
        share_initial_lr(optimizer)  # as its load_state_dict does


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """torch.distributed.checkpoint's planner, whose non-tensor entries (the optimizer's
    hyper-parameters and parameter names) it unpickles with ``weights_only=False``: each is
    first read with ``weights_only=True``, which refuses any pickled code, so nothing in a step
    checkpoint runs code (docs/reliability.md)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as err:  # a type weights_only refuses: not a checkpoint of ours
            raise CorruptCheckpointError(
                f"step checkpoint entry {read_item.dest_index.fqn} is not plain data: {err}"
            ) from err
        value.seek(0)
        super().load_bytes(read_item, value)


def _add_saved_group_entries(optimizer_state: dict[str, Any], metadata: Any) -> None:
    """Make room for the saved parameter groups' entries a fresh optimizer lacks (the
    learning-rate scheduler's ``initial_lr``): torch.distributed.checkpoint reads only the
    entries the state it loads into has."""
    prefix = "optimizer.param_groups."
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            index, name = key[len(prefix) :].split(".", 1)
            optimizer_state["param_groups"][int(index)].setdefault(name, None)


def _optimizers(optimizer: Optimizer) -> Optimizer | list[Optimizer]:
    """What torch's state-dict functions take: the optimizer, or each of an
    :class:`OptimizerInBackward`'s (their states merge by parameter name)."""
    if isinstance(optimizer, OptimizerInBackward):
        return list(optimizer.optim_map.values())
    return optimizer


def _write_weights(writer: Any, model: nn.Module) -> None:
    """``model``'s weights alone as ``writer``'s ``epoch_0`` (one device)."""
    writer.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=0)


@contextlib.contextmanager
def _writing_into(writer: Any, folder: Path) -> Iterator[None]:
    """``writer`` (a torchtune checkpointer, maybe wrapped to save in ``dtype``) writes its
    ``epoch_N`` folders into ``folder`` within."""
    inner = writer
    while "_wrapped" in vars(inner):  # exactga.runtime.precision's dtype wrapper
        inner = vars(inner)["_wrapped"]
    own = inner._output_dir
    inner._output_dir = folder
    try:
        yield
    finally:
        inner._output_dir = own


@contextlib.contextmanager
def _torchtune_info_quiet() -> Iterator[None]:
    """Without torchtune's lines about the epoch folder it writes (the best checkpoint is
    written as ``epoch_0`` under a hidden name, then renamed): its own line says where."""
    logger = logging.getLogger("torchtune.utils._logging")  # every torchtune module's logger

    def drop_info(record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO

    logger.addFilter(drop_info)
    try:
        yield
    finally:
        logger.removeFilter(drop_info)
