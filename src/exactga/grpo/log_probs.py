"""The per-token log-probs a step records once for its rollouts, under no_grad: the
reference's, and the generating policy's where the loss or the reward reads them. See [a GRPO
step] in exactga.grpo.rollout_step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from exactga.accumulation.forward import token_log_probs
from exactga.accumulation.loss_units import loss_positions, shift_labels
from exactga.config.options import MicroBatching
from exactga.data.micro_batching import MicroBatchingSettings, plan_micro_batches, sample_length
from exactga.grpo.policy import OLD_LOG_PROBS, REF_LOG_PROBS, collate_rollouts
from exactga.grpo.rollouts import Rollout
from exactga.runtime.precision import Precision


def pre_pass_chunks(rollouts: Sequence[Rollout], forward_batch_size: int) -> list[list[int]]:
    """The rollouts' indices in chunks of ``forward_batch_size``, longest first (least
    padding); every rank has as many rollouts, so as many chunks."""
    lengths = [sample_length(r) for r in rollouts]
    settings = MicroBatchingSettings(MicroBatching.BY_LENGTH, batch_size=forward_batch_size)
    return plan_micro_batches(lengths, settings)


@torch.no_grad()
def record_token_log_probs(
    model: nn.Module,
    rollouts: list[Rollout],
    key: str,
    *,
    forward_batch_size: int,
    pad_id: int,
    device: torch.device,
    precision: Precision | None = None,
) -> None:
    """Store under ``key`` each rollout's per-token log-probs under ``model`` (entry ``t``:
    ``log p(token t | tokens before)`` at completion tokens, 0 elsewhere), as
    ``exactga.grpo.policy`` reads ``ref_log_probs`` and ``old_log_probs``. Log-probs are taken only
    at completion positions; see [logits only at loss positions] in exactga.accumulation.step."""
    for chunk in pre_pass_chunks(rollouts, forward_batch_size):
        rows = [rollouts[i] for i in chunk]
        batch = collate_rollouts(
            [{"tokens": r["tokens"], "labels": r["labels"], "advantage": 0.0} for r in rows],
            padding_idx=pad_id,
        )
        labels = batch["labels"]
        positions = loss_positions(labels)
        targets = shift_labels(labels).reshape(-1).index_select(0, positions)
        log_probs = token_log_probs(
            model,
            {"tokens": batch["tokens"].to(device)},
            positions.to(device),
            targets.to(device),
            precision,
        )
        # Position p = b * L + t scores token t + 1 of row b: its log-prob sits at p + 1.
        grid = torch.zeros(labels.numel(), dtype=torch.float32)
        grid.index_copy_(0, positions + 1, log_probs.float().cpu())
        grid = grid.view(labels.shape)
        for row, rollout in enumerate(rows):
            rollout[key] = grid[row, : len(rollout["tokens"])].clone()


def record_reference_and_old(
    policy: nn.Module,
    reference: nn.Module,
    rollouts: list[Rollout],
    *,
    ppo_epochs: int,
    forward_batch_size: int,
    pad_id: int,
    device: torch.device,
    precision: Precision | None = None,
    phase: Callable[[str], contextlib.AbstractContextManager[None]] | None = None,
    record_old: bool = False,
) -> None:
    """The reference's log-probs, and with several PPO epochs (or ``record_old``: a KL penalty
    in the reward reads them) the generating policy's; see [a GRPO step]. ``phase`` times each
    pass (the profiler's ``phase``)."""
    timed = phase or (lambda _name: contextlib.nullcontext())
    record = partial(
        record_token_log_probs,
        rollouts=rollouts,
        forward_batch_size=forward_batch_size,
        pad_id=pad_id,
        device=device,
        precision=precision,
    )
    with timed("reference"):
        record(reference, key=REF_LOG_PROBS)
    if ppo_epochs > 1 or record_old:
        with timed("old_policy"):
            record(policy, key=OLD_LOG_PROBS)
