"""Dynamic sampling's rounds: prompts until the step holds as many groups with a reward spread
as it has prompts, the kept groups gathered from the ranks that generated them and dealt again.
Which groups are kept is decided in exactga.grpo.shaping; see [dynamic sampling on any layout]
there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from exactga.grpo.rollouts import StepRollouts
from exactga.grpo.shaping import global_slots, groups_with_spread, kept_groups, round_is_enough


def dynamic_sampling(
    prompts: Sequence[Mapping[str, Any]],
    generate_and_score: Callable[[Sequence[Mapping[str, Any]]], StepRollouts],
    more_prompts: Callable[[], Sequence[Mapping[str, Any]] | None],
    *,
    max_rounds: int,
    dp_group: Any = None,
) -> StepRollouts:
    """This rank's share of the step's kept groups: rounds of prompts until the step holds as
    many groups with a reward spread as it has prompts, or ``max_rounds``; see [dynamic
    sampling on any layout] in exactga.grpo.shaping."""
    world_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    rank = dist.get_rank(dp_group) if dp_group is not None else 0
    num_local = len(prompts)
    num_groups = num_local * world_size
    rounds: list[StepRollouts] = []
    spreads: list[torch.Tensor] = []  # each round's global flags, by slot
    batch: Sequence[Mapping[str, Any]] | None = prompts
    while batch is not None:
        if len(batch) != num_local:  # a last, short batch of the data order: stop before it
            break
        scored = generate_and_score(batch)
        rounds.append(scored)
        flags = torch.zeros(num_groups, dtype=torch.int64)
        local = groups_with_spread(scored.rewards, scored.group_size).long()
        flags[global_slots(num_local, rank, world_size)] = local
        if world_size > 1:
            device = _collective_device(dp_group)
            flags = flags.to(device)
            dist.all_reduce(flags, group=dp_group)
            flags = flags.cpu()
        spreads.append(flags.bool())
        if round_is_enough(spreads, num_groups) or len(rounds) >= max_rounds:
            break
        batch = more_prompts()
    kept = kept_groups(spreads, num_groups)
    slot_of = {slot: j for j, slot in enumerate(global_slots(num_local, rank, world_size))}
    held = {
        (k, slot): _group(rounds[k], slot_of[slot])
        for k, slot in kept
        if slot in slot_of  # generated on this rank
    }
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, held, group=dp_group)
        held = {key: group for part in gathered for key, group in part.items()}
    mine = [held[key] for i, key in enumerate(kept) if i % world_size == rank]
    result = _join_groups(mine, group_size=rounds[0].group_size)
    result.num_generated_tokens = sum(r.num_generated_tokens for r in rounds)
    result.num_sampling_rounds = len(rounds)
    return result


def _collective_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _group(rollouts: StepRollouts, index: int) -> dict[str, Any]:
    """Group ``index`` of ``rollouts``: its samples and per-completion values."""
    size = rollouts.group_size
    rows = slice(index * size, (index + 1) * size)
    return {
        "samples": rollouts.samples[rows],
        "rewards": rollouts.rewards[rows],
        "components": {k: v[rows] for k, v in rollouts.reward_components.items()},
        "successes": None if rollouts.successes is None else rollouts.successes[rows],
    }


def _join_groups(groups: Sequence[dict[str, Any]], group_size: int) -> StepRollouts:
    """One StepRollouts of ``groups`` in order (the work done is set by the caller)."""
    succeeded = [g["successes"] for g in groups]
    return StepRollouts(
        samples=[sample for g in groups for sample in g["samples"]],
        rewards=torch.cat([g["rewards"] for g in groups]),
        reward_components={
            name: torch.cat([g["components"][name] for g in groups])
            for name in groups[0]["components"]
        },
        successes=None if succeeded[0] is None else torch.cat(succeeded),
        num_generated_tokens=0,
        group_size=group_size,
    )
