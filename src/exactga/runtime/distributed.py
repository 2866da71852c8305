"""Distributed plumbing shared by the distributed recipes: process group, mesh, rank 0, sync.

Nothing here changes a number: the loss scaling and the token-count reduction live in
:mod:`exactga.accumulation.normalization`. What is here would otherwise be copied into every
distributed recipe and could drift: how the backend is chosen (gloo on CPU, NCCL on CUDA), the
``("dp", "tp")`` device mesh and its data-parallel group, rank-0-only helpers, CPU-safe memory
statistics, and the gradient-synchronisation policy under accumulation.

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
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torchtune import training, utils

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


def build_device_mesh(device: torch.device, tensor_parallel_dim: int) -> DeviceMesh:
    """The 2-D ``("dp", "tp")`` mesh over every rank; dp is world size / tensor_parallel_dim.

    The data-parallel size that normalisation needs is ``mesh["dp"].size()``, never the world
    size: ranks of one tensor-parallel group see the same tokens (docs/math.md §4).
    """
    world_size = dist.get_world_size()
    if tensor_parallel_dim < 1 or world_size % tensor_parallel_dim != 0:
        raise ValueError(
            f"config key 'tensor_parallel_dim'={tensor_parallel_dim} must be at least 1 and "
            f"divide the world size {world_size}."
        )
    return init_device_mesh(
        device.type,
        mesh_shape=(world_size // tensor_parallel_dim, tensor_parallel_dim),
        mesh_dim_names=("dp", "tp"),
    )


def dp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The data-parallel process group: the one the window token count is reduced over."""
    return mesh["dp"].get_group()


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
