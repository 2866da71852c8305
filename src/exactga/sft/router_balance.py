"""A mixture-of-experts router's load-balancing loss, as a term of the exact step.

A fine-tuning recipe with ``router_aux_loss_coef > 0`` adds, to each micro-batch's token loss,
the router's balance term over the micro-batch's routed tokens; the normaliser weighs it by its
own units (micro-batches) while the token loss stays a mean over the window's loss tokens, as
without it. :class:`RouterBalance` holds the settings, the units, the term and the expert-load
metrics; ``exactga.sft.loss.causal_lm_loss`` calls it around the forward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from exactga.accumulation.loss_units import Batch, ShiftedTokens, loss_ignore_index
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.accumulation.normalization import Window
from exactga.config.options import RouterBalanceObjective, as_option
from exactga.config.schemas import SingleDeviceRecipeConfig
from exactga.models.moe.block import MoEBlock, moe_blocks, recording_router_stats
from exactga.models.moe.router import RouterStats, sum_router_stats
from exactga.models.moe.router_losses import expert_load_ratio, router_entropy_mean

# Note [router balance as a loss term]
# The term is Switch Transformer's load-balancing loss as Hugging Face computes it for Qwen3
# MoE (``load_balancing_loss_func``), so ``router_aux_loss_coef`` means what it means there:
#     LB = E * sum_i (c_i / T) * (s_i / T)
# with E experts, and over the tokens balanced, pooled over every MoE layer: c_i the top-k
# assignments to expert i, s_i the sum of its router probabilities, T the tokens (counted once
# per layer). The counts carry no gradient; the probabilities do. Padding is not a token here
# (see ``routed_tokens``); prompt tokens are: they go through the experts.
#
# Which tokens: Hugging Face balances over each forward's tokens. f_i = c_i / T over the whole
# accumulation window on every rank would make the step independent of the split, but it is
# known only after the window's last forward, and each micro-batch's backward needs it before;
# exactness would cost a second, no-grad forward of every micro-batch. So the term balances
# over one micro-batch at a time, in one of two ways (``router_balance``):
# - ``micro_batch``: over the micro-batch's tokens on its rank (Hugging Face's);
# - ``global_batch`` (default): over the micro-batch's tokens on every data-parallel rank, the
#   "global-batch" balancing of Qiu et al. (2025): one all-reduce of each micro-batch's counts,
#   token counts (and nothing with a gradient) in the forward. Each rank's term is its share,
#   dp_size * E * sum_i (C_i / T_all) * (s_i / T_all) with C and T_all over the ranks, so that the
#   shares' mean over the ranks (what FSDP's gradient average makes of them) is the LB of the
#   micro-batch over every rank.
# Either way the term's unit is a micro-batch: the step's term is the mean of the micro-batches'
# LB over the window on every rank (fillers, which carry no loss token, count 0), scaled by the
# normaliser like any term ([loss terms over their own units]). So global_batch gives the same
# step on N ranks x micro-batches of b samples as on one rank x micro-batches of N*b samples
# (same accumulation steps), and micro_batch only where the micro-batches are the same; neither
# is invariant to the number of micro-batches. The token loss is exact in every case.


def routed_tokens(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[batch, seq]`` true for the tokens that are not padding: those up to each row's last
    label (its prompt included). The token ids cannot say it: a padding id is often also the
    end-of-text token. Rows are padded on the right (packed rows: their tail)."""
    live = labels != ignore_index
    positions = torch.arange(labels.size(1), device=labels.device)
    last = torch.where(live, positions, -1).amax(dim=1, keepdim=True)
    return positions <= last


class RouterMicroBatches(ShiftedTokens):
    """Loss tokens after the shift for the token loss, and the micro-batch for the router's
    balance term: 1 for a micro-batch with a loss token (one that trains), 0 for a filler."""

    term_names = ("router_micro_batches",)

    def count(self, batch: Batch) -> int:
        self._last_count = super().count(batch)  # read by count_terms, called right after
        return self._last_count

    def count_terms(self, batch: Batch) -> tuple[int, ...]:
        return (1 if self._last_count > 0 else 0,)  # no second pass over the labels


class RouterBalance:
    """The router balance term of a recipe whose model has mixture-of-experts layers.

    Args:
        model: the trained model (its :class:`MoEBlock` layers record their statistics).
        coef: ``router_aux_loss_coef``; 0 turns everything here off.
        objective: ``router_balance``: see [router balance as a loss term].
        dp_group: the data-parallel group (``global_batch`` reduces over it), or ``None``.
        device: where the metrics' sums live.

    Raises:
        ValueError: ``router_aux_loss_coef`` is set for a model without mixture-of-experts
            layers.
    """

    def __init__(
        self,
        model: nn.Module,
        coef: float,
        objective: RouterBalanceObjective | str,
        dp_group: Any,
        device: torch.device,
    ) -> None:
        self.coef = float(coef)
        self.objective = as_option(RouterBalanceObjective, objective, "router_balance")
        self.dp_group = dp_group
        self.device = device
        self.blocks: list[MoEBlock] = moe_blocks(model) if self.on else []
        if self.on and not self.blocks:
            raise ValueError(
                "config key 'router_aux_loss_coef': the model has no mixture-of-experts layer "
                "to balance; set it to 0."
            )
        self.ignore_index = -100  # the loss's, set by ``units``
        self._window: list[RouterStats] | None = None  # per layer, summed over micro-batches
        self._terms: list[torch.Tensor] = []

    @classmethod
    def from_settings(
        cls, settings: SingleDeviceRecipeConfig, model: nn.Module, runtime: Any
    ) -> RouterBalance:
        """From a fine-tuning recipe's typed settings and its ``Runtime``."""
        return cls(
            model,
            settings.router_aux_loss_coef,
            settings.router_balance,
            runtime.count_group,  # see [mesh axes and the loss count]
            runtime.device,
        )

    @property
    def on(self) -> bool:
        return self.coef > 0

    def units(self, loss_fn: nn.Module) -> ShiftedTokens:
        """The normaliser's units: loss tokens, and with the term the micro-batches too."""
        self.ignore_index = loss_ignore_index(loss_fn)
        return RouterMicroBatches(loss_fn) if self.on else ShiftedTokens(loss_fn)

    @contextlib.contextmanager
    def recording(self, model: nn.Module, labels: torch.Tensor) -> Iterator[None]:
        """Record the router statistics of the forward inside, over the routed tokens."""
        if not self.on:
            yield
            return
        mask = routed_tokens(labels, self.ignore_index)
        with recording_router_stats(model, token_mask=mask):
            yield

    def with_term(self, token_loss: torch.Tensor) -> MicroBatchLoss:
        """The micro-batch's loss for the normaliser: the token loss, and the weighted balance
        term of the forward just recorded over its units (``router_micro_batches``);
        ``token_loss`` alone when off."""
        if not self.on:
            return MicroBatchLoss(token_loss)
        per_layer = [block.last_router_stats for block in self.blocks]
        assert all(stats is not None for stats in per_layer), "record the forward first"
        self._add_to_window(per_layer)
        term = self.coef * self._balance_term(sum_router_stats(per_layer))
        self._terms.append(term.detach())
        main = token_loss.float().reshape(())
        return MicroBatchLoss(main, {RouterMicroBatches.term_names[0]: term.float()})

    def _balance_term(self, pooled: RouterStats) -> torch.Tensor:
        """This rank's share of the micro-batch's LB; see [router balance as a loss term]."""
        counts, num_tokens = pooled.expert_counts.float(), pooled.num_tokens.float()
        share = 1.0
        if self.objective is RouterBalanceObjective.GLOBAL_BATCH and self.dp_group is not None:
            reduced = torch.cat([counts, num_tokens.reshape(1)]).detach()
            dist.all_reduce(reduced, group=self.dp_group)  # counts carry no gradient
            counts, num_tokens = reduced[:-1], reduced[-1]
            share = dist.get_world_size(self.dp_group)
        tokens = num_tokens.clamp(min=1.0)
        num_experts = counts.numel()
        return share * num_experts * ((counts / tokens) * (pooled.prob_sums.float() / tokens)).sum()

    def _add_to_window(self, per_layer: list[RouterStats | None]) -> None:
        detached = [_detached(stats) for stats in per_layer if stats is not None]
        if self._window is None:
            self._window = detached
        else:
            self._window = [a + b for a, b in zip(self._window, detached, strict=True)]

    def track(self, windows: Any) -> Iterator[Window]:
        """Each window's metrics start empty (``StepBook``'s ``track``)."""
        for window in windows:
            self._window, self._terms = None, []
            yield window

    def window_metrics(self, window: Window) -> dict[str, float]:
        """On logged steps (every rank calls it): per MoE layer the busiest expert's share of
        the assignments over the mean share (``router/load_ratio/layer_<i>``, 1 is even) and
        the mean router entropy in nats (``router/entropy/layer_<i>``), over the window's routed
        tokens on every rank, and the mean balance term (``router/balance_loss``). No token is
        ever dropped (no expert capacity), so there is no dropped-token count to log."""
        if not self.on or self._window is None:
            return {}
        layers = self._window
        packed = torch.cat(
            [
                torch.cat([s.expert_counts, s.entropy_sum.reshape(1), s.num_tokens.reshape(1)])
                for s in layers
            ]
        ).to(self.device, torch.float64)
        terms = torch.stack(self._terms).to(torch.float64) if self._terms else packed.new_zeros(0)
        sums = torch.cat([packed, terms.sum().reshape(1), packed.new_tensor([len(self._terms)])])
        if window.dp_group is not None:
            dist.all_reduce(sums, group=window.dp_group)
        metrics = {}
        width = layers[0].expert_counts.numel() + 2
        for index, _ in enumerate(layers):
            row = sums[index * width : (index + 1) * width]
            counts, entropy, tokens = row[:-2], row[-2], row[-1]
            metrics[f"router/load_ratio/layer_{index}"] = float(expert_load_ratio(counts))
            metrics[f"router/entropy/layer_{index}"] = float(router_entropy_mean(entropy, tokens))
        term_sum, num_terms = float(sums[-2]), float(sums[-1])
        metrics["router/balance_loss"] = term_sum / num_terms if num_terms else math.nan
        return metrics


def _detached(stats: RouterStats) -> RouterStats:
    return RouterStats(
        expert_counts=stats.expert_counts.detach(),
        prob_sums=stats.prob_sums.detach(),
        num_tokens=stats.num_tokens.detach(),
        logsumexp_sq_sum=stats.logsumexp_sq_sum.detach(),
        entropy_sum=stats.entropy_sum.detach(),
        logits=None,
    )
