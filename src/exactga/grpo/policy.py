"""Rollouts as loss units, and the GRPO policy loss of one micro-batch.

A rollout micro-batch holds ``B`` completions, each row its prompt then its completion,
right-padded (:func:`collate_rollouts`): ``tokens`` and ``labels`` of shape ``(B, L)``, the
labels ignored at prompt and padding positions, so after the one-position shift they mark the
positions that predict a completion token (see [shifted token count] in
exactga.accumulation.loss_units); per-token ``old_log_probs`` and ``ref_log_probs``, aligned with
``tokens`` (entry ``t`` is the log-prob of token ``t`` given those before it, as generation records
it; 0 elsewhere); and one ``advantages`` value per completion (:func:`group_advantages`, taken over
the whole step's rollouts). :func:`grpo_micro_batch_loss` returns the micro-batch's mean over its
units, which :class:`CompletionTokens` or :class:`Completions` count for the one normaliser of
``exactga.accumulation.normalization`` (:func:`loss_units_for` picks them). See [policy
aggregations].

Note [policy aggregations]
Each completion token ``t`` of completion ``c`` has a loss ``l_ct`` (the ``loss`` component's:
PPO-clip, GSPO or CISPO, plus a KL term; see exactga.grpo.losses). Nothing in ``l_ct`` depends
on the batch it sits in: the advantages come from the whole step's rewards before any split, a
row's log-probs do not see its padding (causal attention, right padding), and a micro-batch
holds whole completions (see [policy losses are local to a completion] there). The step's loss
is one of veRL's five aggregations (its ``loss_agg_mode`` names) over the step's ``C``
completions of ``n_c`` completion tokens each (``T = sum_c n_c``, ``G =
max_generated_tokens``):

- ``token-mean`` (DAPO; alias ``token_mean``): ``sum_ct l_ct / T``; units: completion tokens,
  each its own ``l_ct``;
- ``seq-mean-token-mean`` (the GRPO paper; alias ``sequence_mean``): ``(1/C) sum_c (sum_t l_ct
  / n_c)``; units: completions, each its own token mean. The ``1/n_c`` is local to a
  completion, so it is part of the completion's loss, not a denominator to count;
- ``seq-mean-token-sum``: ``(1/C) sum_c sum_t l_ct``; units: completions, each its token sum;
- ``seq-mean-token-sum-norm`` (Dr. GRPO; alias ``constant``): ``(1/C) sum_c sum_t l_ct / G``;
  units: completions, each its token sum over the constant ``G`` (veRL's
  ``loss_scale_factor``, by default the response length, which is ``G``). ``G`` is a setting,
  not a count: the units are still completions, and only ``C`` is counted;
- ``token-sum``: ``sum_ct l_ct``, a sum, with no denominator to count. It is ``(1/C) sum_c (C
  sum_t l_ct)``: units completions, each its token sum times ``C``, the step's completions over
  every rank (``num_completions``), which the config fixes (``batch_size x grpo_samples x`` the
  data-parallel ranks, the same on every split); the normaliser then divides by the ``C`` it
  counts, which is that same number.

Each is a mean over units of a per-unit loss that depends on that unit alone, so a micro-batch's
mean over its own units, weighed by ``dp_size * u_m / U`` before backward, gives the full-batch
loss whatever the split (see [loss units] in exactga.accumulation.loss_units), with the one
normaliser. They differ when lengths differ: ``seq-mean-token-mean`` gives a short completion's
tokens more weight than a long one's (``1 / (C n_c)`` against ``1 / T``); the three token sums
weigh every token alike, as ``token-mean`` does, but their scale does not move with the step's
lengths (``1 / C``, ``1 / (C G)``, 1 against ``1 / T``). The ``naive`` baseline (each
micro-batch's own mean divided by the micro-batch count, as TRL's ``grpo``, ``bnpo`` and
``dr_grpo`` losses weigh micro-batches) is exact only when every micro-batch holds as many
units.

A completion with no completion token after the shift (an empty generation, or a prompt that
filled the context) has ``n_c = 0``: under ``sequence_mean`` its mean is 0/0, and under every
mode it is no rollout to learn from, so counting fails naming it. An emptied micro-batch,
another rank's zero-weight filler under FSDP, keeps one real completion and carries an
``EMPTY`` marker the units count as 0, as ``exactga.dpo.preference`` does for pairs (see [pairs as
loss units] there): its loss is finite and depends on every layer, so backward runs the same
collectives as on the other ranks and the zero factor leaves an exactly zero gradient.

Log-probs come only from completion positions (``projecting_only`` of exactga.accumulation.forward;
see [logits only at loss positions] there), each in fp32 at least; the per-token losses and their
sums are fp64, which on ``B x L`` numbers costs nothing.
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
    LossUnits,
    count_loss_tokens,
    loss_positions,
    shift_labels,
)
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.config.options import KLEstimator, LossAggregation, as_option
from exactga.grpo.losses import PolicyLoss, PolicyTokens, kl_estimate, row_of
from exactga.runtime.precision import Precision

OLD_LOG_PROBS = "old_log_probs"
REF_LOG_PROBS = "ref_log_probs"
ADVANTAGES = "advantages"
# An emptied micro-batch carries this key (a 0-d tensor, so it moves with the batch): it holds
# no unit. See [policy aggregations].
EMPTY = "no_completions"


# ---------------------------------------------------------------------------------------------
# Advantages over the whole step, and the rollout micro-batch.


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """``(r - group mean) / (group std + eps)`` for each completion, its group being the
    ``group_size`` consecutive completions of one prompt (torchtune's GRPO: unbiased std).

    Take it over the whole step's rollouts, on every rank alike, before any micro-batching, so
    an advantage cannot depend on the split. Computed in fp64, returned in ``rewards``' dtype.

    Raises:
        ValueError: ``rewards`` not one value per completion in whole groups of two or more,
            or not finite.
    """
    if group_size < 2:
        raise ValueError(
            f"group_size={group_size}: a group-relative advantage needs at least two "
            "completions per prompt (grpo_samples >= 2)."
        )
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)}: expected one reward per completion, "
            f"whole groups of {group_size} completions of one prompt each."
        )
    if not torch.isfinite(rewards).all():
        bad = int((~torch.isfinite(rewards)).nonzero()[0])
        raise ValueError(f"reward of completion {bad} is {float(rewards[bad])}, not finite.")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    advantages = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1).to(rewards.dtype)


def collate_rollouts(
    rollouts: Sequence[Mapping[str, Any]], padding_idx: int = 0, ignore_idx: int = IGNORE_INDEX
) -> Batch:
    """Rollouts as one micro-batch, right-padded to the longest.

    Each rollout has ``tokens`` (prompt then completion), ``labels`` (``ignore_idx`` at the
    prompt), ``ref_log_probs`` and optionally ``old_log_probs`` (per token, aligned with
    ``tokens``) and an ``advantage``.
    """
    width = max(len(r["tokens"]) for r in rollouts)
    shape = (len(rollouts), width)
    batch = {
        "tokens": torch.full(shape, padding_idx, dtype=torch.long),
        "labels": torch.full(shape, ignore_idx, dtype=torch.long),
    }
    per_token = [key for key in (OLD_LOG_PROBS, REF_LOG_PROBS) if key in rollouts[0]]
    for key in per_token:
        batch[key] = torch.zeros(shape, dtype=torch.float32)
    for row, rollout in enumerate(rollouts):
        for key in ("tokens", "labels", *per_token):
            value = torch.as_tensor(rollout[key], dtype=batch[key].dtype)
            batch[key][row, : len(value)] = value
    batch[ADVANTAGES] = torch.tensor([float(r["advantage"]) for r in rollouts])
    return batch


# ---------------------------------------------------------------------------------------------
# The loss units.


class _Rollouts:
    """What completion tokens and completions share: the checks, the index, the filler."""

    name = ""

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def count(self, batch: Batch) -> int:
        """The micro-batch's units, after checking its rollouts.

        Raises:
            ValueError: a completion without a completion token after the shift, or per-row
                values of the wrong shape, named.
        """
        if EMPTY in batch:
            return 0
        check_rollouts(batch, self.ignore_index)
        return self._count(batch)

    def _count(self, batch: Batch) -> int:
        raise NotImplementedError

    def prepare(self, batch: Batch, num_units: int, runs_empty: bool) -> Batch:
        # An empty micro-batch is an emptied one: a real completion, so its loss is finite.
        assert not runs_empty or EMPTY in batch, "only an emptied rollout batch has no unit"
        return {**batch, LOSS_POSITIONS: loss_positions(batch["labels"], self.ignore_index)}

    def emptied(self, batch: Batch) -> Batch:
        """The last completion of ``batch``, marked as holding no unit; see [policy
        aggregations]."""
        num_rows = batch["tokens"].size(0)
        emptied = {
            key: value[-1:] if _has_rows(value, num_rows) else value
            for key, value in batch.items()
            if key != LOSS_POSITIONS
        }
        return {**emptied, EMPTY: torch.tensor(True)}


class CompletionTokens(_Rollouts):
    """Completion tokens after the shift: the units of ``token-mean`` (DAPO)."""

    name = "completion_tokens"

    def _count(self, batch: Batch) -> int:
        return count_loss_tokens(batch["labels"], self.ignore_index)


class Completions(_Rollouts):
    """Completions: the units of the four ``seq-mean-*`` and ``token-sum`` aggregations."""

    name = "completions"

    def _count(self, batch: Batch) -> int:
        return batch["tokens"].size(0)


def loss_units_for(
    aggregation: LossAggregation | str, ignore_index: int = IGNORE_INDEX
) -> LossUnits:
    """The units ``aggregation``'s loss is a mean over; see [policy aggregations]."""
    aggregation = as_option(LossAggregation, aggregation, "loss_aggregation")
    if aggregation is LossAggregation.TOKEN_MEAN:
        return CompletionTokens(ignore_index)
    return Completions(ignore_index)


def check_rollouts(batch: Batch, ignore_index: int = IGNORE_INDEX) -> None:
    """Fail naming the first problem of a host rollout micro-batch: a completion with no
    completion token after the shift, or advantages or log-probs of the wrong shape."""
    labels = batch["labels"]
    num_rows = labels.size(0)
    without_completion = ((labels[:, 1:] != ignore_index).sum(dim=1) == 0).nonzero()
    if len(without_completion):
        raise ValueError(
            f"completion {int(without_completion[0])} of a micro-batch of {num_rows}: no "
            "completion token after the shift (an empty generation, or a prompt that fills "
            "the context), so it has no token to learn from and no token mean. Drop it "
            "before the step."
        )
    advantages = batch.get(ADVANTAGES)
    if advantages is None or tuple(advantages.shape) != (num_rows,):
        shape = None if advantages is None else tuple(advantages.shape)
        raise ValueError(
            f"advantages of shape {shape} for a micro-batch of {num_rows} completions: "
            f"expected ({num_rows},), one per completion (exactga.grpo.policy.group_advantages)."
        )
    for key in (REF_LOG_PROBS, OLD_LOG_PROBS):
        if key in batch and batch[key].shape != labels.shape:
            raise ValueError(
                f"{key} of shape {tuple(batch[key].shape)} for tokens of shape "
                f"{tuple(labels.shape)}: expected one log-prob per token, aligned with tokens."
            )
    if REF_LOG_PROBS not in batch:
        raise ValueError(f"a rollout micro-batch needs {REF_LOG_PROBS} (the reference's).")


def _has_rows(value: Any, num_rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == num_rows


# ---------------------------------------------------------------------------------------------
# Per-token log-probs at the completion positions, and the loss step.


def needs_num_completions(aggregation: LossAggregation | str) -> bool:
    """Whether ``aggregation``'s per-completion loss needs the step's completion count
    (``token-sum``; see [policy aggregations])."""
    return as_option(LossAggregation, aggregation, "loss_aggregation") is LossAggregation.TOKEN_SUM


def aggregate(
    losses: torch.Tensor,
    tokens: PolicyTokens,
    aggregation: LossAggregation,
    *,
    max_generated_tokens: int | None,
    num_completions: int | None,
) -> torch.Tensor:
    """The micro-batch's mean over its units of the per-token ``losses``; see [policy
    aggregations]."""
    if aggregation is LossAggregation.TOKEN_MEAN:
        return losses.sum() / len(losses)
    row_sums = tokens.row_sums(losses)
    if aggregation is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        return (row_sums / tokens.row_counts()).mean()
    if aggregation is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        return (row_sums / max_generated_tokens).mean()
    if aggregation is LossAggregation.TOKEN_SUM:
        return (row_sums * num_completions).mean()
    return row_sums.mean()  # seq-mean-token-sum


def check_aggregation_settings(
    aggregation: LossAggregation | str,
    max_generated_tokens: int | None,
    num_completions: int | None,
) -> LossAggregation:
    """``aggregation`` as a member, with the setting it divides or multiplies by.

    Raises:
        ValueError: ``seq-mean-token-sum-norm`` without ``max_generated_tokens``, or
            ``token-sum`` without ``num_completions``.
    """
    aggregation = as_option(LossAggregation, aggregation, "loss_aggregation")
    if aggregation is LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM and not max_generated_tokens:
        raise ValueError(
            f"loss_aggregation '{aggregation}' divides by max_generated_tokens; set it."
        )
    if aggregation is LossAggregation.TOKEN_SUM and not num_completions:
        raise ValueError(
            f"loss_aggregation '{aggregation}' needs num_completions, the step's completions "
            "over every rank; see [policy aggregations] in exactga.grpo.policy."
        )
    return aggregation


def grpo_micro_batch_loss(
    model: nn.Module,
    batch: Batch,
    *,
    aggregation: LossAggregation | str,
    loss: PolicyLoss,
    max_generated_tokens: int | None = None,
    num_completions: int | None = None,
    precision: Precision | None = None,
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
    metrics: PolicyMetrics | None = None,
) -> MicroBatchLoss:
    """The mean policy loss over the units of one rollout micro-batch already on the device,
    for ``window.backward``; see [policy aggregations]. ``loss`` gives each completion token's
    loss (exactga.grpo.losses); ``metrics`` records the KL and clipping of the completion
    tokens (an emptied micro-batch records nothing).

    The units must be ``loss_units_for(aggregation)``'s. Without ``old_log_probs`` in the batch
    the old policy is the current one (``ppo_epochs: 1``): the ratio is ``exp(logp -
    logp.detach())``, 1 with the surrogate's gradient. ``seq-mean-token-sum-norm`` needs
    ``max_generated_tokens``, ``token-sum`` ``num_completions`` (the step's completions over
    every rank).
    """
    aggregation = check_aggregation_settings(aggregation, max_generated_tokens, num_completions)
    labels = batch.pop("labels")
    positions = batch.pop(LOSS_POSITIONS, None)
    is_empty = batch.pop(EMPTY, None) is not None
    old = batch.pop(OLD_LOG_PROBS, None)
    ref = batch.pop(REF_LOG_PROBS)
    advantages = batch.pop(ADVANTAGES)
    if positions is None:  # a batch that did not come through the normaliser
        positions = loss_positions(labels)
    num_rows, seq_len = labels.shape
    targets = shift_labels(labels).reshape(-1).index_select(0, positions)
    log_probs = token_log_probs(model, batch, positions, targets, precision, activations_ctx)
    log_probs = log_probs.double()
    # Position p = b * L + t scores token t + 1 of row b (t < L - 1: the shift ignores the last
    # column), whose recorded log-prob sits at flat index p + 1.
    token_ref = ref.reshape(-1).index_select(0, positions + 1).double()
    token_old = (
        log_probs.detach() if old is None else old.reshape(-1).index_select(0, positions + 1)
    )
    tokens = PolicyTokens(
        log_probs=log_probs,
        old_log_probs=token_old.double(),
        ref_log_probs=token_ref,
        advantages=advantages.double().index_select(0, row_of(positions, seq_len)),
        positions=positions,
        num_rows=num_rows,
        seq_len=seq_len,
    )
    losses, clipped = loss.token_losses(tokens)
    if metrics is not None and not is_empty:
        metrics.record(tokens, clipped, loss.kl_estimator)
    return MicroBatchLoss(
        aggregate(
            losses,
            tokens,
            aggregation,
            max_generated_tokens=max_generated_tokens,
            num_completions=num_completions,
        )
    )


# ---------------------------------------------------------------------------------------------
# What the policy step logs, as exact window values.


class PolicyMetrics:
    """The policy step's KL and clipping, each a mean over the window's completion tokens on
    every rank, whatever the split (a per-micro-batch mean would weigh short micro-batches
    more). Sums stay on the device and are read only when logged.

    - ``policy/kl``: the loss's estimator (``kl_estimator``) of the KL to the reference, per
      completion token;
    - ``policy/clip_fraction``: tokens the loss's clipping cut (PPO-clip and GSPO: the ratio
      left its range on the side the advantage pushes towards; CISPO: the weight was clipped);
    - ``policy/ratio``: the mean probability ratio to the policy that generated the rollouts
      (1 on the first pass over them).

    Args:
        device: where the metrics' all-reduce runs (the data-parallel backend's device).
    """

    NAMES = ("policy/kl", "policy/clip_fraction", "policy/ratio")

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._sums: torch.Tensor | None = None

    def clear(self) -> None:
        """Forget what was recorded; call as each window opens."""
        self._sums = None

    def record(
        self, tokens: PolicyTokens, clipped: torch.Tensor, kl_estimator: KLEstimator | str
    ) -> None:
        """Add one micro-batch's per-token values (detached; no host read)."""
        log_probs = tokens.log_probs.detach()
        ratio = torch.exp(log_probs - tokens.old_log_probs)
        kl = kl_estimate(log_probs, tokens.ref_log_probs, kl_estimator)
        sums = torch.stack(
            [kl.sum(), clipped.double().sum(), ratio.sum(), kl.new_tensor(float(kl.numel()))]
        )
        self._sums = sums if self._sums is None else self._sums + sums

    def window_metrics(self, dp_group: Any = None) -> dict[str, float]:
        """Each metric's mean over the window's completion tokens on every rank: one
        all-reduce of four numbers under data parallelism (call on every rank)."""
        sums = torch.zeros(len(self.NAMES) + 1, dtype=torch.float64, device=self.device)
        if self._sums is not None:
            sums = self._sums.to(self.device, dtype=torch.float64, copy=True)
        if dp_group is not None and torch.distributed.get_world_size(dp_group) > 1:
            torch.distributed.all_reduce(sums, group=dp_group)
        num_tokens = float(sums[-1])
        if num_tokens == 0:
            return {}
        return dict(zip(self.NAMES, (sums[:-1] / num_tokens).tolist(), strict=True))
