"""PPO's two loss terms over their own units, the trajectory micro-batch, and the window metrics.

A trajectory micro-batch holds ``B`` trajectories, each row its prompt then its response,
right-padded (:func:`collate_trajectories`). Response token ``t`` of a row with a prompt of
``P`` tokens is predicted at position ``P - 1 + t``, and stock's value of the state before it
sits at that same position, so every per-token value below lives on the ``(B, L)`` grid at
those positions: the recorded log-probs and advantages at the positions that score a response
token (the labels after the shift: see [shifted token count] in exactga.accumulation.loss_units),
the recorded values and returns at the value positions (those and, for a response that stopped
short of ``max_generated_tokens - 1`` tokens, one more: the state after its last token, as stock
keeps it). See [policy and value terms].

Note [policy and value terms]
Stock's ``PPOLoss`` is the sum of two means over different units: the clipped policy loss
``max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps))``, ``r_t = exp(logp_t - old_logp_t)``, over
the response tokens (``~response_padding_masks``), and ``value_coeff`` times the clipped value
loss ``0.5 max((v_t - R_t)^2, (clip(v_t, old_v_t - c, old_v_t + c) - R_t)^2)`` over the value
positions (``~value_padding_masks``: the response tokens, and the state after the last one when
the response stopped early). Over a PPO batch of ``n_p`` response tokens and ``n_v`` value
positions the step's loss is ``sum_t l^p_t / n_p + value_coeff sum_t l^v_t / n_v``. Nothing in
``l^p_t`` or ``l^v_t`` depends on the micro-batch a trajectory sits in: the advantages, returns
and old values come from the whole step's trajectories before any split (stock's GAE and its
whitening over the batch), and a row's forward does not see its padding (causal attention,
right padding). So the two terms are loss terms over their own units ([loss terms over their own
units] in exactga.accumulation.loss_units): :class:`ResponseTokens` counts both on the host,
:func:`ppo_micro_batch_loss` returns the micro-batch's two means, and ``Window.scale`` weighs each
by its own units over the PPO batch's. Stock divides each micro-batch's two means by
``gradient_accumulation_steps`` (``naive`` here), which weighs a micro-batch of short responses
as much as one of long ones, and a micro-batch's value positions as much as its response tokens:
the step then depends on the split. Log-probs are taken in fp32 at least, only at the response
positions; the per-token losses and their sums are fp64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from exactga.accumulation.forward import token_log_probs
from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    LOSS_POSITIONS,
    Batch,
    count_loss_tokens,
    loss_positions,
    shift_labels,
)
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.runtime.precision import Precision

OLD_LOG_PROBS = "old_log_probs"  # per response token, at its position
ADVANTAGES = "advantages"  # per response token, at its position
OLD_VALUES = "old_values"  # per value position
RETURNS = "returns"  # per value position
VALUE_MASK = "value_mask"  # (B, L) bool: the value positions
VALUE_POSITIONS = "value_positions"  # their flat indices, host-side, added by prepare
PER_RESPONSE_TOKEN = (OLD_LOG_PROBS, ADVANTAGES)
PER_VALUE_POSITION = (OLD_VALUES, RETURNS)


def collate_trajectories(trajectories: Sequence[Mapping[str, Any]], padding_idx: int = 0) -> Batch:
    """Trajectories as one micro-batch, right-padded to the longest; see the module docstring.

    Each trajectory has ``tokens`` (prompt then response), ``labels`` (``IGNORE_INDEX`` at the
    prompt), ``prompt_length``, per response token ``old_log_probs`` and ``advantages``, and per
    value position ``old_values`` and ``returns`` (the response tokens' first, then possibly
    one more).
    """
    width = max(len(t["tokens"]) for t in trajectories)
    shape = (len(trajectories), width)
    batch = {
        "tokens": torch.full(shape, padding_idx, dtype=torch.long),
        "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
        VALUE_MASK: torch.zeros(shape, dtype=torch.bool),
        **{
            key: torch.zeros(shape, dtype=torch.float64)
            for key in (*PER_RESPONSE_TOKEN, *PER_VALUE_POSITION)
        },
    }
    for row, trajectory in enumerate(trajectories):
        num_tokens = len(trajectory["tokens"])
        batch["tokens"][row, :num_tokens] = torch.as_tensor(trajectory["tokens"])
        batch["labels"][row, :num_tokens] = torch.as_tensor(trajectory["labels"])
        first = trajectory["prompt_length"] - 1  # the position that predicts response token 0
        for key in PER_RESPONSE_TOKEN + PER_VALUE_POSITION:
            values = torch.as_tensor(trajectory[key], dtype=torch.float64)
            batch[key][row, first : first + len(values)] = values
        num_values = len(trajectory[OLD_VALUES])
        batch[VALUE_MASK][row, first : first + num_values] = True
    return batch


class ResponseTokens:
    """The units of PPO's two terms: response tokens (the policy term's, counted after the
    shift) and value positions (the value term's). See [policy and value terms]."""

    name = "response_tokens"
    term_names = ("value_positions",)

    def count(self, batch: Batch) -> int:
        return count_loss_tokens(batch["labels"])

    def count_terms(self, batch: Batch) -> tuple[int, ...]:
        return (int(batch[VALUE_MASK].sum()),)

    def prepare(self, batch: Batch, num_units: int, runs_empty: bool) -> Batch:
        assert not runs_empty, "every trajectory has a response token; PPO runs on one device"
        return {
            **batch,
            LOSS_POSITIONS: loss_positions(batch["labels"]),
            VALUE_POSITIONS: batch[VALUE_MASK].reshape(-1).nonzero().squeeze(1),
        }

    def emptied(self, batch: Batch) -> Batch:
        raise NotImplementedError("the PPO recipe trains on one device: no rank needs fillers")


def policy_token_losses(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each response token's clipped policy loss (stock's ``PPOLoss``), its ratio, and whether
    the clipped loss is the larger (stock's ``clipfrac``)."""
    ratios = torch.exp(log_probs - old_log_probs)
    clipped = -advantages * torch.clamp(ratios, 1.0 - epsilon, 1.0 + epsilon)
    unclipped = -advantages * ratios
    return torch.maximum(clipped, unclipped), ratios, clipped > unclipped


def value_token_losses(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_range: float
) -> torch.Tensor:
    """Each value position's clipped value loss, with stock's one half."""
    clipped = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def ppo_micro_batch_loss(
    policy: nn.Module,
    value_model: nn.Module,
    batch: Batch,
    *,
    epsilon: float,
    value_clip_range: float,
    value_coeff: float,
    temperature: float,
    precision: Precision | None = None,
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
    metrics: PpoMetrics | None = None,
) -> MicroBatchLoss:
    """The micro-batch's two term means, the policy loss's over the response tokens (the main
    term) and ``value_coeff`` x the value loss's over the value positions (``value_positions``),
    for ``window.backward``; see [policy and value terms]. ``metrics`` records the
    micro-batch's sums."""
    labels = batch.pop("labels")
    positions = batch.pop(LOSS_POSITIONS)
    value_positions = batch.pop(VALUE_POSITIONS)
    tokens = batch["tokens"]
    targets = shift_labels(labels).reshape(-1).index_select(0, positions)
    log_probs = token_log_probs(
        policy, {"tokens": tokens}, positions, targets, precision, activations_ctx, temperature
    ).double()
    autocast = precision.autocast() if precision is not None else contextlib.nullcontext()
    with activations_ctx or contextlib.nullcontext(), autocast:
        values = value_model(tokens)  # (B, L, 1): the classifier's one output per position
    values = values.reshape(-1).index_select(0, value_positions).double()

    def at(key: str, where: torch.Tensor) -> torch.Tensor:
        return batch[key].reshape(-1).index_select(0, where)

    policy_losses, ratios, clipped = policy_token_losses(
        log_probs, at(OLD_LOG_PROBS, positions), at(ADVANTAGES, positions), epsilon
    )
    value_losses = value_token_losses(
        values, at(OLD_VALUES, value_positions), at(RETURNS, value_positions), value_clip_range
    )
    if metrics is not None:
        approx_kl = 0.5 * (log_probs.detach() - at(OLD_LOG_PROBS, positions)) ** 2
        metrics.record(policy_losses, value_losses, ratios, clipped, approx_kl)
    value_term = value_coeff * value_losses.mean()
    return MicroBatchLoss(policy_losses.mean(), {ResponseTokens.term_names[0]: value_term})


class PpoMetrics:
    """Stock's PPO statistics, each an exact mean over the window's response tokens (or value
    positions), whatever the split: stock averages each micro-batch's means instead. Sums stay
    on the device and are read only when logged.

    - ``policy_loss``, ``value_loss`` (without ``value_coeff``): the two terms' means;
    - ``ratios``: the mean probability ratio to the policy that generated the trajectories;
    - ``clipfrac``: the response tokens whose clipped policy loss is the larger;
    - ``approx_policy_kl``: the mean of ``0.5 (logp - old_logp)^2``.
    """

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None

    def clear(self) -> None:
        """Forget what was recorded; call as each window opens."""
        self._sums = None

    def record(
        self,
        policy_losses: torch.Tensor,
        value_losses: torch.Tensor,
        ratios: torch.Tensor,
        clipped: torch.Tensor,
        approx_kl: torch.Tensor,
    ) -> None:
        """Add one micro-batch's per-token values (no host read)."""
        sums = torch.stack(
            [
                policy_losses.detach().sum(),
                value_losses.detach().sum(),
                ratios.detach().double().sum(),
                clipped.double().sum(),
                approx_kl.sum(),
                policy_losses.new_tensor(float(policy_losses.numel())),
                policy_losses.new_tensor(float(value_losses.numel())),
            ]
        )
        self._sums = sums if self._sums is None else self._sums + sums

    def window_metrics(self) -> dict[str, float]:
        """Each statistic's mean over the window (one host read)."""
        if self._sums is None:
            return {}
        policy, value, ratios, clipped, approx_kl, num_tokens, num_values = self._sums.tolist()
        return {
            "policy_loss": policy / num_tokens,
            "value_loss": value / num_values,
            "ratios": ratios / num_tokens,
            "clipfrac": clipped / num_tokens,
            "approx_policy_kl": approx_kl / num_tokens,
        }
