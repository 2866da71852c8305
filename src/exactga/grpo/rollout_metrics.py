"""What a step logs about its rollouts: rewards, success, completion lengths, generation
throughput, over the step's completions on every rank (:func:`rollout_metrics`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from exactga.grpo.rollouts import StepRollouts


def rollout_metrics(
    rollouts: StepRollouts,
    dp_group: Any = None,
    device: Any = "cpu",
    generation_seconds: float | None = None,
) -> dict[str, float]:
    """Reward mean and spread, success rate, completion lengths and each reward component,
    over the step's completions on every rank (one all-reduce of a few sums; call on every
    rank), and this rank's generated tokens per second."""
    rewards = rollouts.rewards
    kl_penalties = rollouts.kl_penalties
    lengths = torch.tensor([len(r["completion"]) for r in rollouts.samples], dtype=torch.float64)
    stopped = torch.tensor([bool(r["stopped"]) for r in rollouts.samples], dtype=torch.float64)
    names = sorted(rollouts.reward_components)
    succeeded = rollouts.successes
    group_stds = rewards.view(-1, rollouts.group_size).std(dim=1)
    sums = torch.stack(
        [
            torch.tensor(float(len(rewards)), dtype=torch.float64),
            rewards.sum(),
            (rewards**2).sum(),
            succeeded.double().sum() if succeeded is not None else rewards.new_zeros(()),
            group_stds.sum(),
            lengths.sum(),
            stopped.sum(),
            torch.tensor(float(rollouts.num_generated_tokens), dtype=torch.float64),
            rewards.new_zeros(()) if kl_penalties is None else kl_penalties.sum(),
            *[rollouts.reward_components[name].sum() for name in names],
        ]
    ).to(device)
    longest = lengths.max().reshape(1).to(device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=dp_group)
    (
        n,
        total,
        squares,
        num_succeeded,
        group_std_sum,
        length_sum,
        num_stopped,
        generated,
        kl_penalty_sum,
        *components,
    ) = sums.tolist()
    mean = total / n
    variance = max(squares / n - mean * mean, 0.0) * n / max(n - 1.0, 1.0)
    metrics = {
        "rewards/mean": mean,
        "rewards/std": variance**0.5,
        # The mean within-group spread: what the group advantages learn from.
        "rewards/group_std": group_std_sum / (n / rollouts.group_size),
        "completions/mean_length": length_sum / n,
        "completions/max_length": float(longest.item()),
        "completions/stopped_fraction": num_stopped / n,
        "completions/generated_tokens": generated,
    }
    metrics.update(
        {f"rewards/{name}": value / n for name, value in zip(names, components, strict=True)}
    )
    if succeeded is not None:
        metrics["rewards/success_rate"] = num_succeeded / n
    if rollouts.kl_penalties is not None:  # the mean over the step's completions, every rank
        metrics["rewards/kl_penalty"] = kl_penalty_sum / n
    if rollouts.num_sampling_rounds is not None:  # every rank's: a decision over all ranks
        metrics["completions/sampling_rounds"] = float(rollouts.num_sampling_rounds)
    if generation_seconds:
        metrics["throughput/generated_tokens_per_second"] = (
            rollouts.num_generated_tokens / generation_seconds
        )
    return metrics
