"""Where and how a run computes, decided once from the config: the device, the precision
policy, the attention kernels, the CPU threads, under torchrun the process group and the
("dp_replicate", "dp_shard", "cp", "tp") mesh, and the seed (see [setup order], 1, in
exactga.wiring.run_start).

A recipe's ``__init__`` builds it first (``Runtime.for_settings(cfg)`` in a file that serves
both of torchtune's names, else ``Runtime.single_device(cfg)`` or ``Runtime.distributed(cfg)``)
and hands it to ``RunStart``; what the run builds against it (the model, the counters, the step)
is the wiring's, above this package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torchtune.modules.common_utils as common_utils
from torch.distributed.device_mesh import DeviceMesh
from torchtune import config, training, utils

from exactga.config.mesh import MeshShape, mesh_keys, mesh_shape
from exactga.config.schemas import SingleDeviceRecipeConfig
from exactga.runtime import distributed
from exactga.runtime.kernels import choose_attention_kernels
from exactga.runtime.precision import Precision
from exactga.runtime.threads import use_cpu_threads


@dataclass
class Runtime:
    """Where and how a run computes, read from the config once (see [setup order], 1).

    Build it with :meth:`for_settings`, :meth:`single_device` or :meth:`distributed`; a recipe
    passes it to
    ``RunStart`` and reads ``device``, ``precision`` and, distributed, ``dp_size`` (the ranks
    that load different samples) and ``count_size`` (the ranks the loss is counted over; see
    [mesh axes and the loss count] in exactga.runtime.distributed).
    """

    device: torch.device
    precision: Precision
    seed: int  # the config's, set on every rank; a resumed run's counters may hold another
    notes: tuple[object, ...]  # logged with the model: what else decides the run's numbers
    mesh: distributed.ParallelMesh | None = None
    tensor_parallel_plan: Any = None
    tensor_parallel_dim: int = 1
    context_parallel_dim: int = 1
    fingerprint_extra: dict[str, Any] = field(default_factory=dict)
    gradient_sync: Any = None  # the config's GradientSync, distributed only
    async_checkpointing: bool = False
    # Sharded full-weight recipes (their schemas have enable_async_checkpointing) read their
    # weights through torchtune's CheckpointClient, as stock does.
    checkpoint_client: bool = False

    @classmethod
    def for_settings(
        cls, cfg: SingleDeviceRecipeConfig, *, tensor_parallel: bool = False
    ) -> Runtime:
        """The runtime of the schema the launch chose for a recipe file that serves both of
        torchtune's names ([one recipe, two launches] in exactga.launch.twins): every rank of
        a process group for a distributed schema (``tensor_parallel``: as in
        :meth:`distributed`), else one device."""
        if cfg.DISTRIBUTED:
            return cls.distributed(cfg, tensor_parallel=tensor_parallel)
        return cls.single_device(cfg)

    @classmethod
    def single_device(cls, cfg: SingleDeviceRecipeConfig) -> Runtime:
        """One device: no process group, no sharding."""
        # Launched as one of several processes, each would train the whole run into the same
        # folder (a copy that skips run_recipe's check: [launch mix-ups] in exactga.launch.mixups).
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                "this recipe trains on one device, but was launched as one of "
                f"{os.environ['WORLD_SIZE']} processes (--nproc_per_node, --nnodes); run it "
                "without torchrun options, or a distributed recipe (exactga/<name>_distributed)."
            )
        device = utils.get_device(device=cfg.device)
        dtype = training.get_dtype(cfg.dtype, device=device)
        notes = (
            choose_attention_kernels(cfg.cudnn_attention, device),
            use_cpu_threads(cfg.cpu_threads),  # see [cpu threads] in exactga.runtime.threads
        )
        if hasattr(cfg, "low_cpu_ram"):  # torchtune's low-CPU-RAM NF4 state-dict hook (QLoRA)
            common_utils._use_low_cpu_ram = cfg.low_cpu_ram
        return cls(
            device=device,
            precision=Precision.from_config(dtype, cfg.master_weights, device),
            seed=_set_seed(cfg),
            notes=notes,
        )

    @classmethod
    def distributed(
        cls, cfg: SingleDeviceRecipeConfig, *, tensor_parallel: bool = False
    ) -> Runtime:
        """Every rank of a torchrun launch (or one rank without torchrun): the process group,
        and the mesh of the config's mesh keys (exactga.config.mesh), without tensor parallelism
        unless ``tensor_parallel`` (then the config's ``tensor_parallel_dim`` and
        ``tensor_parallel_plan``).

        Raises:
            ValueError: the mesh keys do not fit the number of ranks (one message naming them).
        """
        device = utils.get_device(device=cfg.device)
        dtype = training.get_dtype(cfg.dtype, device=device)
        cpu_offload = parameters_offloaded_to_cpu(cfg, device)
        checkpoint_client = hasattr(cfg, "enable_async_checkpointing")
        async_checkpointing = checkpoint_client and cfg.enable_async_checkpointing
        notes = (
            choose_attention_kernels(cfg.cudnn_attention, device),
            use_cpu_threads(cfg.cpu_threads, optimizer_on_cpu=cpu_offload),  # see [cpu threads]
        )
        distributed.init_distributed(device, offload_ops_to_cpu=cpu_offload or async_checkpointing)
        tp_dim = cfg.tensor_parallel_dim if tensor_parallel else 1
        shape = mesh_shape(mesh_keys(cfg, tp_dim), dist.get_world_size(), device.type)
        return cls(
            device=device,
            precision=Precision.from_config(dtype, cfg.master_weights, device),
            seed=_set_seed(cfg),
            notes=notes,
            mesh=distributed.build_device_mesh(device, shape),
            tensor_parallel_plan=config.instantiate(cfg.tensor_parallel_plan)
            if tensor_parallel
            else None,
            tensor_parallel_dim=tp_dim,
            context_parallel_dim=shape.cp,
            fingerprint_extra=_mesh_fingerprint(shape, tensor_parallel),
            gradient_sync=cfg.gradient_sync,
            async_checkpointing=async_checkpointing,
            checkpoint_client=checkpoint_client,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.precision.compute_dtype

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size() if self.mesh is not None else 1

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def dp_group(self) -> Any:
        """The group of the ranks that load different samples, ``"dp"`` (``None``: this
        process alone): for what is dealt or gathered by sample, never for a count."""
        return self.mesh["dp"].get_group() if self.mesh is not None else None

    @property
    def count_group(self) -> Any:
        """The group loss units are counted over, ``"dp_cp"`` (``None``: this process alone);
        see [mesh axes and the loss count] in exactga.runtime.distributed."""
        return self.mesh.count_group() if self.mesh is not None else None

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The ``"cp"`` axis each micro-batch's sequences are cut over, or ``None`` without
        context parallelism; see [loss tokens under context parallelism] in
        exactga.runtime.context_parallel."""
        return self.mesh["cp"] if self.mesh is not None and self.context_parallel_dim > 1 else None

    @property
    def count_size(self) -> int:
        """The ranks of :attr:`count_group`: the factor that undoes FSDP's gradient mean."""
        return self.mesh["dp_cp"].size() if self.mesh is not None else 1

    def log(self, message: str) -> None:
        """Log on global rank 0 (every rank, on one device, is rank 0)."""
        distributed.log_rank_zero(message)


def _mesh_fingerprint(shape: MeshShape, tensor_parallel: bool) -> dict[str, int]:
    """The mesh keys a resume must match besides the world size: those that change which
    samples a rank loads (tensor and context parallelism leave fewer data-parallel ranks).
    Each only where the recipe takes it (tp) or it is on (cp), so the fingerprints of runs
    without them stay as they were."""
    extra = {"tensor_parallel_dim": shape.tp} if tensor_parallel else {}
    if shape.cp > 1:
        extra["context_parallel_dim"] = shape.cp
    return extra


def parameters_offloaded_to_cpu(settings: SingleDeviceRecipeConfig, device: torch.device) -> bool:
    """The config's ``fsdp_cpu_offload`` (a distributed schema's key): offloading parameters to
    the CPU is for a GPU's memory; on CPU, and on one device, it is off."""
    return bool(getattr(settings, "fsdp_cpu_offload", False)) and device.type != "cpu"


def _set_seed(cfg: SingleDeviceRecipeConfig) -> int:
    """The config's seed, set on every rank (torchtune would seed ``seed + rank``) before
    anything draws a random number."""
    return training.set_seed(seed=cfg.seed, debug_mode=cfg.cudnn_deterministic_mode)
