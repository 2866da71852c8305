"""The router of a mixture-of-experts layer and the statistics it records for the router losses.

:class:`TopKRouter` is Hugging Face Qwen3 MoE's (``Qwen3MoeTopKRouter``): a bias-free linear
to one logit per expert, a softmax over the experts in fp32, the ``top_k`` most probable
experts, and with ``norm_topk_prob`` their probabilities renormalised to sum to one.

:class:`RouterStats` is what one layer's router did to the tokens of one forward: sums over the
tokens the loss terms and metrics need (see [router statistics are sums]), never means.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import nn


class Routing(NamedTuple):
    """One forward's routing of ``num_tokens`` tokens."""

    logits: torch.Tensor  # [num_tokens, num_experts], the gate's dtype
    probs: torch.Tensor  # [num_tokens, num_experts], fp32 softmax of the logits
    expert_indices: torch.Tensor  # [num_tokens, top_k], most probable first
    expert_weights: torch.Tensor  # [num_tokens, top_k], the logits' dtype


class TopKRouter(nn.Module):
    """Top-``top_k`` softmax routing over ``num_experts`` experts.

    Args:
        dim: the tokens' width.
        num_experts: number of experts.
        top_k: experts per token.
        norm_topk_prob: renormalise the chosen experts' probabilities to sum to one (Qwen3 MoE's
            released models); else they are the softmax's as they are.
        gate: the linear to the logits (a LoRA linear, say); a bias-free ``nn.Linear`` if
            ``None``.

    Raises:
        ValueError: ``top_k`` is not in ``1..num_experts``.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k}: give 1 to num_experts ({num_experts})")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = gate if gate is not None else nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """The routing of ``x`` (``[num_tokens, dim]``)."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # fp32 as HF's, for bf16
        top_probs, expert_indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, expert_indices, top_probs.to(logits.dtype))


@dataclass
class RouterStats:
    """One MoE layer's routing of the included tokens of one forward, as sums over those tokens.

    Fields that feed a loss keep their autograd graph (``prob_sums``, ``logsumexp_sq_sum``);
    counts and metrics are detached. All are fp32 tensors on the router's device, so a sum over
    micro-batches, layers or ranks (``+``, :func:`sum_router_stats`, an all-reduce of each
    field) is again a ``RouterStats``. See [router statistics are sums].

    Attributes:
        expert_counts: ``[E]`` top-k assignments of included tokens to each expert (sums to
            ``num_tokens * top_k``).
        prob_sums: ``[E]`` each expert's router probability summed over included tokens.
        num_tokens: ``[]`` included tokens.
        logsumexp_sq_sum: ``[]`` the sum of ``logsumexp(logits)^2`` (the z-loss's numerator).
        entropy_sum: ``[]`` the sum of each token's router entropy (nats), detached.
        logits: ``[num_tokens, E]`` the included tokens' logits, detached, only when recorded
            with ``keep_logits=True`` (else ``None``; a sum drops them).
    """

    expert_counts: torch.Tensor
    prob_sums: torch.Tensor
    num_tokens: torch.Tensor
    logsumexp_sq_sum: torch.Tensor
    entropy_sum: torch.Tensor
    logits: torch.Tensor | None = None

    def __add__(self, other: RouterStats) -> RouterStats:
        summed = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name != "logits"
        }
        return RouterStats(**summed)


def sum_router_stats(stats: list[RouterStats]) -> RouterStats:
    """The sum of several layers' or micro-batches' statistics (what a global-batch load
    balancing loss is computed from); ``ValueError`` for an empty list or a ``None``."""
    if not stats:
        raise ValueError("sum_router_stats needs at least one RouterStats")
    if any(entry is None for entry in stats):
        raise ValueError(
            "sum_router_stats was handed None: a block's last_router_stats is None until a "
            "forward runs inside recording_router_stats"
        )
    total = stats[0]
    for more in stats[1:]:
        total = total + more
    return total


def router_stats(
    routing: Routing, token_mask: torch.Tensor | None, *, keep_logits: bool = False
) -> RouterStats:
    """The :class:`RouterStats` of ``routing`` over the tokens ``token_mask`` includes.

    Args:
        routing: a router's output for ``num_tokens`` tokens.
        token_mask: ``[num_tokens]`` bool, ``True`` for a token to count; ``None`` counts all.
        keep_logits: also keep the included tokens' logits (for checks against a reference).
    """
    probs = routing.probs
    num_experts = probs.shape[-1]
    if token_mask is None:
        token_mask = torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    included = token_mask.to(torch.float32)
    top_k = routing.expert_indices.shape[-1]
    # A scatter of the mask rather than bincount of the kept rows: no host sync, no dynamic
    # shape (as HF's masked load_balancing_loss_func).
    expert_counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
    expert_counts.scatter_add_(
        0, routing.expert_indices.reshape(-1), included.repeat_interleave(top_k)
    )
    log_probs = torch.log_softmax(routing.logits.float(), dim=-1)
    entropy = -(probs * log_probs).sum(dim=-1)
    logsumexp = torch.logsumexp(routing.logits.float(), dim=-1)
    return RouterStats(
        expert_counts=expert_counts,
        prob_sums=(probs * included.unsqueeze(-1)).sum(dim=0),
        num_tokens=included.sum(),
        logsumexp_sq_sum=(logsumexp.square() * included).sum(),
        entropy_sum=(entropy * included).sum().detach(),
        logits=routing.logits[token_mask].detach() if keep_logits else None,
    )


# Note [router statistics are sums]
# The load-balancing loss E * sum_i f_i * P_i has f_i = counts_i / (num_tokens * top_k) and
# P_i = prob_sums_i / num_tokens: ratios of sums over tokens. A layer records the numerators and
# the denominator, not the ratios, so the statistics of any set of tokens (several
# micro-batches, several layers, all ranks) are the field-wise sums of its parts, and the loss
# over that set is the same formula applied to the sums. A mean of per-micro-batch losses is
# another quantity: micro-batches of different sizes would weigh their tokens differently, and
# f_i * P_i is a product, so the mean of products is not the product of the pooled ratios.
# The z-loss (mean of logsumexp^2) and the router entropy are means over tokens: a sum and a
# count likewise. Padding must not count: the mask that says which tokens are included is the
# input's non-padding mask, not labels != ignore_index, which also leaves out prompt tokens
# that do go through the experts.
