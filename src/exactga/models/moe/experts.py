"""The experts of a mixture-of-experts layer: ``num_experts`` SwiGLU MLPs whose weights are
stacked along a leading expert dimension, so all experts can run as one grouped matmul.

Each of the MLPs' three projections (torchtune's ``w1`` gate, ``w3`` up, ``w2`` down) is one
:class:`StackedLinear` (or its LoRA twin, :class:`LoRAStackedLinear`): a ``[num_experts,
out_dim, in_dim]`` weight whose slice ``e`` is expert ``e``'s ``nn.Linear`` weight, so one
Hugging Face per-expert weight is one slice.

Every token is computed by each of its ``top_k`` experts: no capacity factor, no token is
dropped. :class:`GroupedExperts` sorts the (token, expert) assignments by expert, runs each
expert on its own tokens only, and puts the outputs back in token order (see [expert combine]).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules.peft import AdapterModule

# "auto": torch._grouped_mm where it is fast and supported (CUDA, bf16, sm90+), else the loop;
# "grouped" / "loop": that path always (tests compare the two on CPU, where fp32 grouped runs).
ExpertPath = Literal["auto", "grouped", "loop"]
EXPERT_PATHS = ("auto", "grouped", "loop")
# cuBLAS's grouped GEMM wants 16-byte aligned rows: 8 bf16 elements.
_GROUPED_MM_ALIGNMENT = 8


def _uniform_like_linear_(weight: torch.Tensor, in_dim: int) -> None:
    """nn.Linear's default init for every expert's slice: kaiming_uniform(a=sqrt(5)) is
    U(-1/sqrt(in), 1/sqrt(in)); computed here because on a 3-d tensor kaiming would take the
    expert dimension for part of the fan-in."""
    bound = 1 / math.sqrt(in_dim)
    with torch.no_grad():
        weight.uniform_(-bound, bound)


class StackedLinear(nn.Module):
    """``num_experts`` bias-free linears in one ``weight`` of shape ``[num_experts, out_dim,
    in_dim]`` (slice ``e`` in ``nn.Linear``'s layout)."""

    def __init__(self, num_experts: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.num_experts, self.in_dim, self.out_dim = num_experts, in_dim, out_dim
        self.weight = nn.Parameter(torch.empty(num_experts, out_dim, in_dim))
        _uniform_like_linear_(self.weight, in_dim)

    def per_expert(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """One function per expert, applying it to its tokens (``[n, in_dim]``). See
        [per-expert views]."""
        return [lambda x, w=weight: F.linear(x, w) for weight in self.weight.unbind(0)]

    def grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Every expert on its rows of ``x``, the rows sorted by expert; ``offsets`` (int32) is
        the cumulative row count at the end of each expert's group."""
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offsets)


class _StackedFactor(nn.Module):
    """One stacked LoRA factor, a module so its state-dict key ends in ``lora_a.weight`` /
    ``lora_b.weight`` like torchtune's ``LoRALinear``'s (torchtune's adapter filters and
    ``get_merged_lora_ckpt`` then handle it: ``lora_b @ lora_a`` is a batched matmul)."""

    def __init__(self, num_experts: int, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, rows, cols))


class LoRAStackedLinear(nn.Module, AdapterModule):
    """:class:`StackedLinear` with one LoRA adapter per expert, the factors stacked too:
    ``lora_a.weight`` ``[num_experts, rank, in_dim]`` and ``lora_b.weight`` ``[num_experts,
    out_dim, rank]``; expert ``e`` computes ``x W_e^T + (alpha / rank) x A_e^T B_e^T``.

    ``lora_b`` starts at zero (the model starts as its base); ``lora_a`` as torchtune's
    ``LoRALinear``'s. The base ``weight`` is frozen by the recipes' ``set_trainable_params``
    like any LoRA base weight. No DoRA and no NF4 base (see docs/moe.md).
    """

    def __init__(
        self,
        num_experts: int,
        in_dim: int,
        out_dim: int,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_experts, self.in_dim, self.out_dim = num_experts, in_dim, out_dim
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.weight = nn.Parameter(torch.empty(num_experts, out_dim, in_dim))
        self.lora_a = _StackedFactor(num_experts, rank, in_dim)
        self.lora_b = _StackedFactor(num_experts, out_dim, rank)
        self.dropout = nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()
        self.disabled = False  # torchtune's disable_adapter (DPO's reference model) sets it
        _uniform_like_linear_(self.weight, in_dim)
        _uniform_like_linear_(self.lora_a.weight, in_dim)
        nn.init.zeros_(self.lora_b.weight)

    def adapter_params(self) -> list[str]:
        """The trainable parameters, as torchtune's ``get_adapter_params`` asks."""
        return ["lora_a.weight", "lora_b.weight"]

    def per_expert(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """One function per expert with its adapter, applying it to its tokens (``[n,
        in_dim]``). See [per-expert views]."""
        weights = self.weight.unbind(0)
        if self.disabled:
            return [lambda x, w=weight: F.linear(x, w) for weight in weights]
        factors = zip(
            weights, self.lora_a.weight.unbind(0), self.lora_b.weight.unbind(0), strict=True
        )
        return [partial(self._adapted, weight=w, a=a, b=b) for w, a, b in factors]

    def _adapted(
        self, x: torch.Tensor, *, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        low_rank = F.linear(self.dropout(x), a)
        return F.linear(x, weight) + self.scaling * F.linear(low_rank, b)

    def grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """:meth:`StackedLinear.grouped` with the adapters: two more grouped matmuls."""
        base = torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offsets)
        if self.disabled:
            return base
        a, b = self.lora_a.weight.transpose(-2, -1), self.lora_b.weight.transpose(-2, -1)
        low_rank = torch._grouped_mm(self.dropout(x), a, offs=offsets)
        return base + self.scaling * torch._grouped_mm(low_rank, b, offs=offsets)


def grouped_mm_supported(x: torch.Tensor, parameters: list[torch.Tensor]) -> bool:
    """Whether ``torch._grouped_mm`` is the fast path for ``x`` and these expert weights: CUDA,
    bf16, compute capability 9.0 or more (Hopper's grouped GEMM), rows aligned. Checked
    defensively: an older torch has no ``_grouped_mm``."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(
        p.shape[-1] % _GROUPED_MM_ALIGNMENT == 0 and p.shape[-2] % _GROUPED_MM_ALIGNMENT == 0
        for p in parameters
    )


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs, ``w2(silu(w1(x)) * w3(x))``, each token through the experts
    its router chose, the outputs weighted by the router and summed.

    Args:
        w1: the gate projections (``[E, hidden_dim, dim]``).
        w2: the down projections (``[E, dim, hidden_dim]``).
        w3: the up projections (``[E, hidden_dim, dim]``).
        path: how the experts run: see :data:`ExpertPath`.

    Raises:
        ValueError: ``path`` is none of :data:`EXPERT_PATHS`.
    """

    def __init__(
        self,
        w1: StackedLinear | LoRAStackedLinear,
        w2: StackedLinear | LoRAStackedLinear,
        w3: StackedLinear | LoRAStackedLinear,
        path: ExpertPath = "auto",
    ) -> None:
        super().__init__()
        if path not in EXPERT_PATHS:
            raise ValueError(f"expert_path={path!r}: give one of {list(EXPERT_PATHS)}")
        self.w1, self.w2, self.w3 = w1, w2, w3
        self.path = path

    @property
    def num_experts(self) -> int:
        return self.w1.num_experts

    def forward(
        self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """The experts' weighted sum for each token.

        Args:
            x: ``[num_tokens, dim]`` tokens.
            expert_indices: ``[num_tokens, top_k]`` experts of each token.
            expert_weights: ``[num_tokens, top_k]`` their router weights.

        Returns:
            ``[num_tokens, dim]``.
        """
        num_tokens, top_k = expert_indices.shape
        assignments = expert_indices.reshape(-1)  # token t's slot s is assignment t * top_k + s
        # Stable: within an expert, assignments stay in token order, so a run is reproducible.
        by_expert = torch.argsort(assignments, stable=True)
        # A scatter rather than bincount, whose output's shape depends on the data: under
        # torch.compile bincount breaks the graph (as the router's counts, router_stats).
        num_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        num_per_expert.scatter_add_(0, assignments, torch.ones_like(assignments))
        routed = x[by_expert // top_k]  # each assignment's token, grouped by expert
        if self._use_grouped(routed):
            outputs = self._grouped(routed, num_per_expert)
        else:
            outputs = self._loop(routed, num_per_expert)
        # See [expert combine].
        to_assignment_order = torch.empty_like(by_expert)
        to_assignment_order[by_expert] = torch.arange(by_expert.numel(), device=x.device)
        outputs = outputs[to_assignment_order].view(num_tokens, top_k, -1)
        return (outputs * expert_weights.unsqueeze(-1).to(outputs.dtype)).sum(dim=1)

    def _use_grouped(self, routed: torch.Tensor) -> bool:
        if self.path == "auto":
            return grouped_mm_supported(routed, list(self.parameters()))
        return self.path == "grouped"

    def _loop(self, routed: torch.Tensor, num_per_expert: torch.Tensor) -> torch.Tensor:
        """One matmul per expert that has tokens, each on its own contiguous rows."""
        outputs = []
        w1, w2, w3 = self.w1.per_expert(), self.w2.per_expert(), self.w3.per_expert()
        # .tolist() syncs with the device once per layer: the group sizes decide the shapes.
        for index, rows in enumerate(routed.split(num_per_expert.tolist())):
            if rows.shape[0] == 0:  # an expert without tokens: nothing to compute
                outputs.append(rows)
                continue
            outputs.append(w2[index](self._gated(w1[index](rows), w3[index](rows))))
        return torch.cat(outputs)

    def _grouped(self, routed: torch.Tensor, num_per_expert: torch.Tensor) -> torch.Tensor:
        """All experts in three grouped matmuls (more with adapters), no host sync."""
        offsets = torch.cumsum(num_per_expert, dim=0, dtype=torch.int32)
        hidden = self._gated(self.w1.grouped(routed, offsets), self.w3.grouped(routed, offsets))
        return self.w2.grouped(hidden, offsets)

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The hidden activation from the gate and up projections: SwiGLU's ``silu(gate) *
        up`` (a family with another gated unit, gpt-oss's clamped one, overrides it)."""
        return F.silu(gate) * up


# Note [expert combine]
# Each token has exactly top_k expert outputs, computed in expert-sorted order. They go back to
# (token, slot) order by a gather through the inverse permutation, then each token's top_k
# outputs are weighted and summed along a dense dimension. The usual alternative, index_add_ of
# the weighted outputs into a zero tensor, adds top_k rows into one token with atomic adds on
# CUDA, whose order (and so, in bf16, whose result) varies from run to run; exactga's parity
# checks compare runs bit for bit where the maths allows, so the combine must be deterministic.
# The inverse permutation's gather has unique indices, so its backward (a scatter) is too.


# Note [per-expert views]
# The loop path takes each expert's weights as views from one unbind(0) of the stacked
# parameter, not as weight[e] per expert. The backward of weight[e] (a select) writes expert e's
# gradient into a fresh zero tensor of the whole stack's size, so E experts cost E full-size
# allocations and additions per projection: with 128 experts that is most of a layer's backward
# time. unbind's backward stacks the E gradients into one tensor, once.
