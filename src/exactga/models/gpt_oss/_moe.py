"""gpt-oss's mixture-of-experts pieces, on :mod:`exactga.models.moe`'s block and experts.

- :class:`GptOssRouter`: a linear *with bias* to one logit per expert; the ``top_k`` largest
  logits are chosen and their softmax (over the chosen ``top_k`` only) weighs the experts.
  For the router statistics (the load-balancing term) the probabilities are the softmax over
  all experts, as transformers' ``load_balancing_loss_func`` takes them.
- :class:`BiasedStackedLinear` / :class:`LoRABiasedStackedLinear`: the stacked expert
  projections with a bias per expert (``[num_experts, out_dim]``).
- :class:`ClampedSwiGLUExperts`: the experts' gated unit ``(clamp(up, -limit, limit) + 1) *
  g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)`` (transformers'
  ``GptOssExperts._apply_gate``; alpha 1.702 and limit 7.0 in the release).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from exactga.models.moe import GroupedExperts, LoRAStackedLinear, StackedLinear, TopKRouter
from exactga.models.moe.experts import ExpertPath
from exactga.models.moe.router import Routing


class GptOssRouter(TopKRouter):
    """Top-``top_k`` routing on biased logits, the weights a softmax over the chosen logits.

    Args:
        dim: the tokens' width.
        num_experts: number of experts.
        top_k: experts per token.
        gate: the linear to the logits; a biased ``nn.Linear`` if ``None``.
    """

    def __init__(
        self, dim: int, num_experts: int, top_k: int, gate: nn.Module | None = None
    ) -> None:
        gate = gate if gate is not None else nn.Linear(dim, num_experts, bias=True)
        super().__init__(dim, num_experts, top_k, norm_topk_prob=False, gate=gate)

    def forward(self, x: torch.Tensor) -> Routing:
        """The routing of ``x`` (``[num_tokens, dim]``)."""
        logits = self.gate(x)
        top_logits, expert_indices = torch.topk(logits, self.top_k, dim=-1)
        # In the logits' dtype, as transformers' GptOssTopKRouter.
        expert_weights = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # for the router terms
        return Routing(logits, probs, expert_indices, expert_weights)


def _with_bias(
    functions: list[Callable[[torch.Tensor], torch.Tensor]], bias: torch.Tensor
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Each expert's function with its bias row added (views from one ``unbind``: see
    [per-expert views] in exactga.models.moe.experts)."""
    return [
        lambda x, apply=apply, row=row: apply(x) + row
        for apply, row in zip(functions, bias.unbind(0), strict=True)
    ]


def _grouped_bias(bias: torch.Tensor, offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows, out_dim]``: each expert-sorted row's expert's bias; no host sync."""
    rows = torch.arange(num_rows, device=offsets.device, dtype=offsets.dtype)
    expert_of_row = torch.searchsorted(offsets, rows, right=True)
    return bias[expert_of_row]


class BiasedStackedLinear(StackedLinear):
    """:class:`~exactga.models.moe.StackedLinear` plus ``bias`` ``[num_experts, out_dim]``
    (zeros at init, as transformers')."""

    def __init__(self, num_experts: int, in_dim: int, out_dim: int) -> None:
        super().__init__(num_experts, in_dim, out_dim)
        self.bias = nn.Parameter(torch.zeros(num_experts, out_dim))

    def per_expert(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        return _with_bias(super().per_expert(), self.bias)

    def grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return super().grouped(x, offsets) + _grouped_bias(self.bias, offsets, x.shape[0])


class LoRABiasedStackedLinear(LoRAStackedLinear):
    """:class:`~exactga.models.moe.LoRAStackedLinear` plus a frozen ``bias`` per expert (the
    LoRA recipes train the adapters only, as a biased ``LoRALinear``'s bias)."""

    def __init__(self, num_experts: int, in_dim: int, out_dim: int, **lora) -> None:
        super().__init__(num_experts, in_dim, out_dim, **lora)
        self.bias = nn.Parameter(torch.zeros(num_experts, out_dim))

    def per_expert(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        return _with_bias(super().per_expert(), self.bias)

    def grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return super().grouped(x, offsets) + _grouped_bias(self.bias, offsets, x.shape[0])


class ClampedSwiGLUExperts(GroupedExperts):
    """:class:`~exactga.models.moe.GroupedExperts` with gpt-oss's clamped gated unit.

    Args:
        w1, w2, w3, path: as :class:`GroupedExperts` (the projections biased).
        alpha: the sigmoid's gain (``swiglu_alpha``).
        limit: the clamp (``swiglu_limit``): the gate above, the up projection both sides.
    """

    def __init__(
        self,
        w1: nn.Module,
        w2: nn.Module,
        w3: nn.Module,
        path: ExpertPath = "auto",
        *,
        alpha: float,
        limit: float,
    ) -> None:
        super().__init__(w1, w2, w3, path)
        self.alpha, self.limit = alpha, limit

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}, path={self.path!r}"
