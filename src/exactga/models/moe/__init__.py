"""Mixture-of-experts layers shared by the MoE model families: the router and the statistics
it records, the stacked experts (grouped matmul or a per-expert loop), the block that takes a
transformer layer's MLP place, and the router loss terms as pure functions (docs/moe.md)."""

from exactga.models.moe.block import (
    MoEBlock,
    moe_blocks,
    recording_router_stats,
    router_recording_context_fn,
)
from exactga.models.moe.experts import (
    EXPERT_PATHS,
    ExpertPath,
    GroupedExperts,
    LoRAStackedLinear,
    StackedLinear,
    grouped_mm_supported,
)
from exactga.models.moe.router import (
    RouterStats,
    Routing,
    TopKRouter,
    router_stats,
    sum_router_stats,
)
from exactga.models.moe.router_losses import (
    expert_load_ratio,
    load_balancing_loss,
    router_entropy_mean,
    router_z_loss,
)

__all__ = [
    "EXPERT_PATHS",
    "ExpertPath",
    "GroupedExperts",
    "LoRAStackedLinear",
    "MoEBlock",
    "RouterStats",
    "Routing",
    "StackedLinear",
    "TopKRouter",
    "expert_load_ratio",
    "grouped_mm_supported",
    "load_balancing_loss",
    "moe_blocks",
    "recording_router_stats",
    "router_entropy_mean",
    "router_recording_context_fn",
    "router_stats",
    "router_z_loss",
    "sum_router_stats",
]
