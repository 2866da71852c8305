"""One step's rollouts on this rank: generated, scored, and given their group-relative
advantages (:class:`StepRollouts`). See [a GRPO step] in exactga.grpo.rollout_step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from exactga.generation.sampling import SamplingSettings, generate_group
from exactga.grpo.policy import group_advantages
from exactga.grpo.rewards import score_completions, successes
from exactga.grpo.shaping import OverlongShaping
from exactga.runtime.precision import Precision

Rollout = dict[str, Any]


@dataclass
class StepRollouts:
    """One step's rollouts on this rank, ``batch_size x grpo_samples`` of them, grouped by
    prompt, with what the logs report about them."""

    samples: list[Rollout]  # collate-ready: tokens, labels, advantage, per-token log-probs
    rewards: torch.Tensor  # (n,) the summed reward of each completion
    reward_components: dict[str, torch.Tensor]  # name -> (n,)
    successes: torch.Tensor | None  # (n,) bool; None when no reward defines success
    num_generated_tokens: int  # tokens the generator produced, past a stop token included
    group_size: int  # completions per prompt
    generation_seconds: float = 0.0  # this rank's wall time generating them
    # The reward each advantage was taken from, where it differs from ``rewards`` (with the KL
    # penalty of ``kl_in_reward`` taken off); see exactga.grpo.shaping.
    kl_penalties: torch.Tensor | None = None  # (n,) what kl_in_reward took off each reward
    num_sampling_rounds: int | None = None  # dynamic sampling: rounds of prompts this step


def generate_rollouts(
    model: nn.Module,
    prompts: Sequence[Mapping[str, Any]],
    *,
    grpo_samples: int,
    sampling: SamplingSettings,
    seed: int,
    step: int,
    device: torch.device,
    run_full_length: bool,
    precision: Precision | None = None,
) -> tuple[list[Rollout], int]:
    """``grpo_samples`` completions of each prompt (dataset items with ``prompt_tokens`` and
    ``index``), prompt by prompt; see [a GRPO step]. Returns the rollouts and the number of
    tokens generated."""
    autocast = precision.autocast() if precision is not None else contextlib.nullcontext()
    rollouts: list[Rollout] = []
    num_generated = 0
    with autocast:
        for prompt in prompts:
            group = generate_group(
                model,
                list(prompt["prompt_tokens"]),
                num_samples=grpo_samples,
                sampling=sampling,
                seed=seed,
                step=step,
                prompt_index=int(prompt["index"]),
                run_full_length=run_full_length,
                device=device,
            )
            rollouts.extend(group.rollouts)
            num_generated += group.num_generated_tokens
    return rollouts, num_generated


def completion_text(tokenizer: Any, completion: Sequence[int], stop_tokens: Sequence[int]) -> str:
    """The text a reward reads: the completion without its stop token, and without ids the
    tokenizer lacks (a model's vocabulary is often rounded up past the tokenizer's, and a
    sampler may draw those rows; they decode to nothing)."""
    vocab_size = getattr(tokenizer, "vocab_size", None)
    stops = set(stop_tokens)
    kept = [t for t in completion if t not in stops and (vocab_size is None or t < vocab_size)]
    return tokenizer.decode(kept)


def score_rollouts(
    rollouts: list[Rollout],
    prompts: Sequence[Mapping[str, Any]],
    *,
    grpo_samples: int,
    reward_components: Sequence[Callable[..., torch.Tensor]],
    tokenizer: Any,
    stop_tokens: Sequence[int],
    num_generated_tokens: int,
    overlong: OverlongShaping | None = None,
) -> StepRollouts:
    """Score each completion (with ``overlong``, DAPO's length penalty added as the reward
    component ``overlong_penalty``) and give it its group-relative advantage (in the
    rollouts' ``advantage``); see [a GRPO step]."""
    texts = [completion_text(tokenizer, r["completion"], stop_tokens) for r in rollouts]
    prompt_texts = [str(p["prompt"]) for p in prompts for _ in range(grpo_samples)]
    answers = [str(p["answer"]) for p in prompts for _ in range(grpo_samples)]
    total, per_component = score_completions(reward_components, prompt_texts, texts, answers)
    succeeded = successes(reward_components, per_component)
    total = total.double()
    if overlong is not None:
        penalties = overlong.penalties([len(r["completion"]) for r in rollouts])
        per_component = {**per_component, "overlong_penalty": penalties.float()}
        total = total + penalties
    scored = StepRollouts(
        samples=rollouts,
        rewards=total,
        reward_components={k: v.double() for k, v in per_component.items()},
        successes=succeeded,
        num_generated_tokens=num_generated_tokens,
        group_size=grpo_samples,
    )
    assign_advantages(scored)
    return scored


def assign_advantages(rollouts: StepRollouts) -> None:
    """Each rollout's group-relative ``advantage``, from its reward less any KL penalty."""
    rewards = rollouts.rewards
    if rollouts.kl_penalties is not None:
        rewards = rewards - rollouts.kl_penalties
    advantages = group_advantages(rewards, rollouts.group_size)
    for rollout, advantage in zip(rollouts.samples, advantages.tolist(), strict=True):
        rollout["advantage"] = advantage
