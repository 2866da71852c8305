"""What a GRPO step does to its rewards and groups before the advantages: DAPO's overlong
shaping, a KL penalty in the reward, and DAPO's dynamic sampling, each the same on any rank
layout and any split (see [dynamic sampling on any layout]).

Overlong shaping and the KL penalty are functions of one completion (its length; its recorded
log-probs), so they cannot depend on the split. Dynamic sampling decides which prompts a step
trains on, which could: this module decides it from the global prompt order alone, and
exactga.grpo.dynamic_sampling gathers and deals the kept groups.

Note [dynamic sampling on any layout]
DAPO drops the groups whose rewards are all equal (their advantages are all 0: they teach
nothing but the KL term) and samples more prompts until the batch is full again. The step's
global batch is ``N`` prompts (``batch_size`` per rank times the ranks); one sampling round
generates the next ``N`` prompts of the data order, dealt to the ranks as the loader deals
them: rank ``r`` holds the round's global slots ``r, r + R, r + 2R, ...`` (``R`` ranks), so a
group's place in the global order is (round, slot) on any layout. Which groups have a spread is
all-reduced each round (``N`` flags), so every rank knows every group's flag and stops after the
same round: the first one after which ``N`` groups are kept, or ``max_sampling_rounds``. The step
keeps the first ``N`` groups with a spread by (round, slot) and, if fewer have one, fills up with
the first ones without (advantages 0; a step of fewer groups would change ``token-sum``'s
``C``), so one rank and several keep the same groups. They are then dealt again as the loader
deals (kept group ``i`` to rank ``i mod R``), each rank holding ``batch_size`` of them, their
rollouts gathered from the ranks that generated them (one ``all_gather_object`` of token lists
and rewards, before any log-prob is recorded). The step over them is the full-batch step by the
normaliser, whichever rank holds which group. Rounds beyond the first consume the data order: an
epoch with dynamic sampling ends when its prompts do, which can be before ``num_steps``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.config.options import KLEstimator
from exactga.grpo.losses import kl_estimate

# ---------------------------------------------------------------------------------------------
# Overlong shaping and the KL penalty: per completion.


@dataclass(frozen=True)
class OverlongShaping:
    """DAPO's soft overlong punishment: a completion of ``n`` tokens longer than
    ``max_generated_tokens - overlong_buffer`` loses ``penalty_factor * (n - (max -
    buffer)) / buffer`` of reward, rising to ``penalty_factor`` at ``max_generated_tokens``.

    Args:
        max_generated_tokens: the longest completion.
        buffer: the lengths before it over which the penalty rises (``overlong_buffer``).
        penalty_factor: the penalty at the longest (``overlong_penalty_factor``).
    """

    max_generated_tokens: int
    buffer: int
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.buffer <= self.max_generated_tokens:
            raise ValueError(
                f"config key 'overlong_buffer'={self.buffer}: must be between 1 and "
                f"max_generated_tokens ({self.max_generated_tokens})."
            )

    def penalties(self, lengths: Sequence[int]) -> torch.Tensor:
        """Each completion's reward change (0 or negative), fp64."""
        expected = self.max_generated_tokens - self.buffer
        over = torch.tensor(lengths, dtype=torch.float64) - expected
        return -self.penalty_factor * over.clamp(min=0.0, max=float(self.buffer)) / self.buffer


def kl_reward_penalties(
    rollouts: Sequence[dict[str, Any]],
    old_key: str,
    ref_key: str,
    *,
    kl_coeff: float,
    estimator: KLEstimator | str,
) -> torch.Tensor:
    """``kl_coeff`` times each completion's summed per-token KL estimate of the generating
    policy's recorded log-probs (``old_key``) to the reference's (``ref_key``), fp64: what
    ``kl_in_reward`` takes off each reward. A completion's tokens are those its labels score
    (after the shift: entries 1 on whose label is not ignored)."""
    penalties = []
    for rollout in rollouts:
        labels = torch.as_tensor(rollout["labels"])
        scored = labels != IGNORE_INDEX
        scored[0] = False  # the shift: the first label is never scored
        old = torch.as_tensor(rollout[old_key], dtype=torch.float64)[scored]
        ref = torch.as_tensor(rollout[ref_key], dtype=torch.float64)[scored]
        penalties.append(kl_estimate(old, ref, estimator).sum())
    return kl_coeff * torch.stack(penalties)


# ---------------------------------------------------------------------------------------------
# Dynamic sampling: which groups a step keeps, from the global order alone.


def groups_with_spread(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Whether each group's rewards differ (``(num_groups,)`` bool): the groups DAPO keeps."""
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)


def global_slots(num_local: int, rank: int, world_size: int) -> list[int]:
    """The global slots of a round that rank ``rank`` holds, in its order: the loader deals the
    global order out as ``rank, rank + R, ...`` (see [dynamic sampling on any layout])."""
    return [j * world_size + rank for j in range(num_local)]


def round_is_enough(spreads: Sequence[torch.Tensor], num_groups: int) -> bool:
    """Whether the rounds so far hold ``num_groups`` groups with a spread."""
    return sum(int(s.sum()) for s in spreads) >= num_groups


def kept_groups(spreads: Sequence[torch.Tensor], num_groups: int) -> list[tuple[int, int]]:
    """The step's ``num_groups`` groups as (round, slot), in global order: the first with a
    spread, then, if too few have one, the first without. ``spreads`` holds each round's
    global flags. See [dynamic sampling on any layout]."""
    order = [(k, slot) for k, flags in enumerate(spreads) for slot in range(len(flags))]
    with_spread = [(k, s) for k, s in order if bool(spreads[k][s])]
    without = [(k, s) for k, s in order if not bool(spreads[k][s])]
    return sorted((with_spread + without)[:num_groups])
