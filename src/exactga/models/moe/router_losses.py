"""Router loss terms and expert-load metrics, as pure functions of summed router statistics.

Each function takes the fields of :class:`~exactga.models.moe.router.RouterStats` (sums over
tokens), so it applies unchanged to one layer's forward, to a sum over layers, micro-batches or
an all-reduce over ranks: "global-batch" load balancing is these statistics summed over the
global batch, then the formula (see [router statistics are sums] in exactga.models.moe.router).

With no included token every function returns 0 (the sums are 0 and the count is taken as
at least 1), so a rank whose micro-batch is all padding adds nothing.
"""

from __future__ import annotations

import torch


def _at_least_one(num_tokens: torch.Tensor | float) -> torch.Tensor:
    return torch.as_tensor(num_tokens, dtype=torch.float32).clamp(min=1.0)


def load_balancing_loss(
    expert_counts: torch.Tensor,
    prob_sums: torch.Tensor,
    num_tokens: torch.Tensor | float,
    num_experts: int,
    top_k: int,
) -> torch.Tensor:
    """Switch Transformer's auxiliary load-balancing loss, ``E * sum_i f_i * P_i``.

    ``f_i = expert_counts_i / (num_tokens * top_k)`` is the share of the top-k assignments that
    went to expert ``i`` and ``P_i = prob_sums_i / num_tokens`` its mean router probability; the
    loss is 1 when both are uniform (``1 / E``) and ``E`` when one expert takes everything.
    Gradients flow through ``prob_sums`` only (the counts come from a top-k).

    Hugging Face's ``load_balancing_loss_func`` divides the counts by ``num_tokens`` alone, so
    its value is ``top_k`` times this one (``top_k`` at uniform routing); it also pools all
    layers' tokens, which is this function applied to the statistics summed over the layers.

    Args:
        expert_counts: ``[E]`` top-k assignments per expert (summed over any set of tokens).
        prob_sums: ``[E]`` router probabilities per expert, summed over the same tokens.
        num_tokens: the number of those tokens (per layer, if the sums span layers: the
            layers' counts summed).
        num_experts: ``E``.
        top_k: experts per token.
    """
    count = _at_least_one(num_tokens).to(prob_sums.device)
    assignment_share = expert_counts.float() / (count * top_k)
    mean_prob = prob_sums.float() / count
    return num_experts * (assignment_share * mean_prob).sum()


def router_z_loss(logsumexp_sq_sum: torch.Tensor, num_tokens: torch.Tensor | float) -> torch.Tensor:
    """ST-MoE's router z-loss, the mean over tokens of ``logsumexp(router logits)^2``, which
    keeps the logits small (bf16 rounds large logits coarsely)."""
    return logsumexp_sq_sum.float() / _at_least_one(num_tokens).to(logsumexp_sq_sum.device)


def expert_load_ratio(expert_counts: torch.Tensor) -> torch.Tensor:
    """The busiest expert's share of the assignments over the mean share ``1 / E``:
    ``E * max_i counts_i / sum_i counts_i``; 1 is perfect balance, ``E / top_k`` the worst
    (every token sent to the same ``top_k`` experts). 0 with no assignment."""
    num_experts = expert_counts.numel()
    total = expert_counts.float().sum().clamp(min=1.0)
    return num_experts * expert_counts.float().max() / total


def router_entropy_mean(
    entropy_sum: torch.Tensor, num_tokens: torch.Tensor | float
) -> torch.Tensor:
    """The mean router entropy per token in nats (``log E`` is uniform routing, 0 one-hot)."""
    return entropy_sum.float() / _at_least_one(num_tokens).to(entropy_sum.device)
