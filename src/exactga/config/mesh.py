"""The device mesh a distributed config asks for, checked before anything is built.

The keys are torchtune's main branch's (``data_parallel_replicate_dim``,
``data_parallel_shard_dim``, ``context_parallel_dim``, ``tensor_parallel_dim``); their defaults
give the one data-parallel axis torchtune 0.6.1 shards over, so a stock config (which has none of
them) trains as before. What each axis does to the loss count is [mesh axes and the loss count]
in exactga.runtime.distributed; docs/meshes.md says it for users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The mesh's dimensions, outermost first, as torchtitan's ParallelDims names them.
MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
MESH_KEYS = {
    "dp_replicate": "data_parallel_replicate_dim",
    "dp_shard": "data_parallel_shard_dim",
    "cp": "context_parallel_dim",
    "tp": "tensor_parallel_dim",
}
INFER = -1  # data_parallel_shard_dim: whatever the other dimensions leave


@dataclass(frozen=True)
class MeshShape:
    """The size of each mesh dimension, every one resolved (no ``-1``)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """The sizes in :data:`MESH_AXES` order."""
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp(self) -> int:
        """Ranks that load different samples: replicate x shard."""
        return self.dp_replicate * self.dp_shard


def mesh_keys(cfg: Any, tensor_parallel_dim: int = 1) -> dict[str, int]:
    """The config's mesh keys by axis; ``tensor_parallel_dim`` is the config's where the recipe
    takes tensor parallelism, else 1."""
    return {
        "dp_replicate": cfg.data_parallel_replicate_dim,
        "dp_shard": cfg.data_parallel_shard_dim,
        "cp": cfg.context_parallel_dim,
        "tp": tensor_parallel_dim,
    }


def check_mesh_keys(sizes: dict[str, int], device_type: str) -> None:
    """What is wrong whatever the number of ranks: a dimension under 1 (the shard dimension may
    be -1), and context parallelism on CPU, where torch's SDPA has no sharding strategy.

    Raises:
        ValueError: one message naming the keys and their values, and the fix.
    """
    low = {axis: size for axis, size in sizes.items() if size < 1}
    if low.get("dp_shard") == INFER:
        del low["dp_shard"]
    if low:
        raise ValueError(
            f"config keys {_named(low)}: every mesh dimension must be 1 or more "
            f"({MESH_KEYS['dp_shard']} may also be -1, whatever the others leave); "
            "set them to 1 to leave that dimension out."
        )
    if sizes["cp"] > 1 and device_type == "cpu":
        raise ValueError(
            f"config key {MESH_KEYS['cp']}={sizes['cp']}: context parallelism runs on CUDA only "
            "(torch's context_parallel shards the flash, efficient and cuDNN SDPA kernels; on CPU "
            "it fails with 'Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
            f"does not have a sharding strategy registered'); set {MESH_KEYS['cp']}=1 or "
            "device=cuda."
        )


def mesh_shape(sizes: dict[str, int], world_size: int, device_type: str) -> MeshShape:
    """The mesh of ``sizes`` (by axis, as :func:`mesh_keys` gives them) over ``world_size`` ranks,
    the shard dimension resolved.

    Raises:
        ValueError: one message naming the keys, their values and the world size, and the fix.
    """
    check_mesh_keys(sizes, device_type)
    others = sizes["dp_replicate"] * sizes["cp"] * sizes["tp"]
    shard = sizes["dp_shard"]
    if shard == INFER:
        if world_size % others:
            raise ValueError(
                f"config keys {_named(sizes, skip='dp_shard')}: their product {others} must "
                f"divide the {world_size} ranks (--nproc_per_node x --nnodes), so that "
                f"{MESH_KEYS['dp_shard']} can take the rest; change them or the number of ranks."
            )
        shard = world_size // others
    elif others * shard != world_size:
        raise ValueError(
            f"config keys {_named(sizes)}: their product {others * shard} must equal the "
            f"{world_size} ranks (--nproc_per_node x --nnodes); set "
            f"{MESH_KEYS['dp_shard']}=-1 to take what the others leave, or change the number of "
            "ranks."
        )
    return MeshShape(sizes["dp_replicate"], shard, sizes["cp"], sizes["tp"])


def _named(sizes: dict[str, int], skip: str = "") -> str:
    return ", ".join(f"{MESH_KEYS[axis]}={size}" for axis, size in sizes.items() if axis != skip)
