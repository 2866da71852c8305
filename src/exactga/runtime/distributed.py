"""Distributed plumbing shared by the distributed recipes: process group, mesh, rank 0, sync.

Nothing here changes a number: the loss scaling and the token-count reduction live in
:mod:`exactga.accumulation.normalization`. What is here would otherwise be copied into every
distributed recipe and could drift: how the backend is chosen (gloo on CPU, NCCL on CUDA), the
``("dp_replicate", "dp_shard", "cp", "tp")`` device mesh and the group the loss is counted over
(see [mesh axes and the loss count]), rank-0-only helpers, CPU-safe memory statistics, and the
gradient-synchronisation policy under accumulation.

Note [gradient sync policy]
FSDP2 reduce-scatters a module's gradients at the end of each of its backwards. Under
accumulation that is ``ga`` reduce-scatters per parameter group per step
(``every_micro_batch``, what stock torchtune does); each micro-batch's gradients are then
summed into the *sharded* gradient, so a rank holds only ``1/dp`` of the gradients between
micro-batches. ``once_per_window`` calls ``set_requires_gradient_sync(False)`` for all but the
window's last micro-batch: FSDP2 then accumulates *unsharded* gradients locally and reduce-
scatters their sum once, so communication drops by ``ga`` at the cost of one full unsharded
copy of the gradients on every rank. Both give the same gradient up to summation order, so
the choice is about time and memory only (numbers in docs/full_finetune_distributed.md).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torchtune import training, utils

from exactga.config.mesh import MESH_AXES, MeshShape
from exactga.config.options import GradientSync

log = utils.get_logger("INFO")


def init_distributed(device: torch.device, offload_ops_to_cpu: bool = False) -> str:
    """Start the default process group for ``device``'s type: gloo on CPU, NCCL on CUDA.

    ``offload_ops_to_cpu`` (FSDP CPU offload, async checkpoints) adds gloo for CPU tensors
    next to NCCL. On CUDA each process takes the GPU of its ``LOCAL_RANK`` first, so NCCL and
    the token-count tensor land on the right device. Returns the backend string.
    """
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # On CPU the default backend is gloo already; torchtune would add a second "cpu:gloo",
    # which init_process_group refuses (stock 70B configs set fsdp_cpu_offload).
    backend = training.get_distributed_backend(
        device.type, offload_ops_to_cpu=offload_ops_to_cpu and device.type != "cpu"
    )
    if not dist.is_initialized():
        if "RANK" in os.environ:  # started by torchrun (tune run --nproc_per_node N)
            dist.init_process_group(backend)
        else:
            _init_single_rank(backend)
    return backend


def _init_single_rank(backend: str) -> None:
    """A process group of this process alone, for a distributed run started without torchrun
    (``tune run exactga/<name>_distributed``, or a recipe file with a distributed config, with
    no ``--nproc_per_node``: [one recipe, two launches] in exactga.launch.twins): it then trains
    as one rank instead of failing with torch's "environment variable RANK expected"."""
    log.warning(
        "No torchrun environment (RANK is not set): training as one rank. For N processes "
        "launch with: tune run --nproc_per_node N <recipe> --config <config>."
    )
    with socket.socket() as probe:  # a free port for the group's one-process rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


# Note [mesh axes and the loss count]
# The mesh has four dimensions, outermost first, as torchtitan's ParallelDims names them:
# ("dp_replicate", "dp_shard", "cp", "tp") (the config keys: exactga.config.mesh). Three flattened
# submeshes are built with it, one per use:
# - "dp" = dp_replicate x dp_shard: the ranks that load different samples (the sampler's
#   replicas). Ranks of one cp or tp group load the same samples.
# - "dp_shard_cp" = dp_shard x cp: FSDP2 shards parameters over it; with dp_replicate > 1 the
#   model is sharded over the 2-D ("dp_replicate", "dp_shard_cp") mesh, which fully_shard takes
#   as HSDP (replicas of shards).
# - "dp_cp" = dp_replicate x dp_shard x cp: the loss count's group.
# The exact loss is a sum over the window's units divided by the window's count U. Every axis
# that splits the tokens (dp_replicate and dp_shard split the samples, cp splits each sequence)
# holds a different part of U, so U is summed over all three; tp does not split tokens (its ranks
# see the same ones), so summing over it would count each unit tp times. FSDP means the gradients
# over the ranks it reduces over: reduce-scatter over dp_shard x cp, all-reduce over dp_replicate,
# so dp_cp's size is the factor that undoes the mean (normalisation's ``dp_size * u / U``, with
# u this rank's units: its slice's under cp). TP's gradients are DTensors whose reductions over
# tp are sums, and need no factor. Counting over dp_shard alone under HSDP, or over dp alone under
# cp, moves the gradient far off the full-batch one; counting over tp too counts every unit tp
# times (the logged count, any sum over the window), its factor cancelling in the gradient only
# by chance (tests/test_mesh_axes.py measures all three; docs/meshes.md).


@dataclass(frozen=True)
class ParallelMesh:
    """The run's device mesh and its flattened submeshes, by name: ``mesh["dp"]``,
    ``mesh["tp"]``... (torch deprecates slicing a flattened name from the root, so they are
    kept here); see [mesh axes and the loss count]."""

    root: DeviceMesh
    flattened: dict[str, DeviceMesh]
    fsdp: DeviceMesh  # what FSDP2 shards over: 1-D, or 2-D (HSDP) with replicas

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.flattened[name] if name in self.flattened else self.root[name]

    def count_group(self) -> dist.ProcessGroup:
        """The group loss units are counted over, ``"dp_cp"``."""
        return self.flattened["dp_cp"].get_group()


def build_device_mesh(device: torch.device, shape: MeshShape | None = None) -> ParallelMesh:
    """The ``("dp_replicate", "dp_shard", "cp", "tp")`` mesh of ``shape`` over every rank (by
    default every rank on dp_shard), with its flattened ``"dp"``, ``"dp_shard_cp"`` and
    ``"dp_cp"`` submeshes; see [mesh axes and the loss count]. Dimensions of size 1 are kept, so
    every name exists on every mesh."""
    shape = shape or MeshShape(dp_shard=dist.get_world_size())
    root = init_device_mesh(device.type, mesh_shape=shape.sizes, mesh_dim_names=MESH_AXES)
    flattened = {
        "dp": root["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp"),
        "dp_shard_cp": root["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp"),
        "dp_cp": root["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp"),
    }
    fsdp = flattened["dp_shard_cp"]
    if shape.dp_replicate > 1:
        with warnings.catch_warnings():  # torchtitan slices it so; torch has no other way yet
            warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
            fsdp = root["dp_replicate", "dp_shard_cp"]
    return ParallelMesh(root, flattened, fsdp)


def host_group() -> dist.ProcessGroup | None:
    """A group of every rank for small host tensors, or None for one process: the default
    group when its backend takes CPU tensors (gloo), else a gloo group made here, so a host
    flag's all-reduce never waits for a device. Every rank calls it, at the same point."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if "gloo" in str(dist.get_backend()):  # "gloo", or "cuda:nccl,cpu:gloo"
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_rank_zero(message: str) -> None:
    """Log on global rank 0 only."""
    if is_rank_zero():
        log.info(message)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak device-memory statistics, or an empty dict on CPU (torchtune's raise there)."""
    if device.type == "cpu":
        return {}
    return training.get_memory_stats(device=device)


def cleanup_before_training(device: torch.device) -> None:
    """torchtune's pre-training cleanup, which on CPU calls a ``torch.cpu.empty_cache`` that
    does not exist; only the garbage collection applies there."""
    if device.type == "cpu":
        gc.collect()
        return
    training.cleanup_before_training()


@contextlib.contextmanager
def gradient_sync(
    model: nn.Module, policy: GradientSync, is_last_micro_batch: bool
) -> Iterator[None]:
    """Run one micro-batch's backward under ``policy``; see [gradient sync policy].

    A no-op for ``every_micro_batch``, for the last micro-batch of a window, and for a model
    that FSDP does not wrap (one data-parallel rank). Sync is switched back on afterwards, so
    anything outside a window (checkpointing, optimizer-in-backward) sees FSDP's default.
    """
    defer = (
        policy is GradientSync.ONCE_PER_WINDOW
        and not is_last_micro_batch
        and isinstance(model, FSDPModule)
    )
    if not defer:
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_tensor(value: Any) -> Any:
    """A DTensor's full value (a clipped gradient norm under FSDP), anything else as is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def destroy() -> None:
    """End the process group once every rank is done with it.

    The barrier first: without it a rank that finished early tore down its gloo transport
    while its peer was still on the pair, and a rank occasionally aborted at exit with
    "terminate called without an active exception" (seen twice in a few hundred CPU launches,
    always after training and checkpoints had finished).
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
