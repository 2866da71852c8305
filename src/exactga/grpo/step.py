"""One GRPO step on this rank: prompts in, rollouts out, then windows for the one normaliser.

``recipes/grpo_full_finetune_distributed.py`` keeps its loop in sight and calls this module for
what decides numbers: which completions are generated (``exactga.setup.rollouts``), how they are
scored (``exactga.grpo.rewards``), their advantages and recorded log-probs, how the step's rollouts
are cut into micro-batches, and what is logged about them. See [a GRPO step].

Note [a GRPO step]
A step takes ``batch_size`` prompts on each data-parallel rank (the global batch is the same
prompts whatever the layout: the sampler deals the shuffled indices out to the ranks) and
generates ``grpo_samples`` completions of each, with randomness that depends only on (seed,
step, prompt index, sample index) (see exactga.setup.rollouts), so 1 rank and 4 ranks hold the same
completions. Rewards and group-relative advantages are per prompt, and a prompt's group never
leaves its rank, so no collective is needed for them. The reference's per-token log-probs, and
with ``ppo_epochs > 1`` the generating policy's, are recorded once, under no_grad, in chunks of
``forward_batch_size`` rollouts (as many chunks on every rank, so FSDP's collectives pair up).
Then each of the ``ppo_epochs`` passes over the rollouts is one optimizer step: a window of
``gradient_accumulation_steps`` micro-batches, cut by ``micro_batching`` like any window, whose
units (completion tokens or completions, by ``loss_aggregation``) the one normaliser counts
over every rank (see [three policy denominators] in exactga.grpo.policy). With ``ppo_epochs: 1`` the
generating policy is the one being trained, so the ratio is taken against the log-probs'
detached copy and no extra forward is run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from exactga.accumulation.forward import token_log_probs
from exactga.accumulation.loss_units import loss_positions, shift_labels
from exactga.config.options import MicroBatching
from exactga.data.micro_batching import (
    MicroBatchingSettings,
    WindowCollator,
    plan_micro_batches,
    sample_length,
)
from exactga.grpo.policy import OLD_LOG_PROBS, REF_LOG_PROBS, collate_rollouts, group_advantages
from exactga.grpo.rewards import score_completions, successes
from exactga.runtime.precision import Precision
from exactga.setup.rollouts import SamplingSettings, generate_group

if TYPE_CHECKING:
    from exactga.accumulation.normalization import LossNormalizer, Window

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


# ---------------------------------------------------------------------------------------------
# Generation and scoring.


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
) -> StepRollouts:
    """Score each completion and give it its group-relative advantage (in the rollouts'
    ``advantage``); see [a GRPO step]."""
    texts = [completion_text(tokenizer, r["completion"], stop_tokens) for r in rollouts]
    prompt_texts = [str(p["prompt"]) for p in prompts for _ in range(grpo_samples)]
    answers = [str(p["answer"]) for p in prompts for _ in range(grpo_samples)]
    total, per_component = score_completions(reward_components, prompt_texts, texts, answers)
    succeeded = successes(reward_components, per_component)
    advantages = group_advantages(total.double(), grpo_samples)
    for rollout, advantage in zip(rollouts, advantages.tolist(), strict=True):
        rollout["advantage"] = advantage
    return StepRollouts(
        samples=rollouts,
        rewards=total.double(),
        reward_components={k: v.double() for k, v in per_component.items()},
        successes=succeeded,
        num_generated_tokens=num_generated_tokens,
        group_size=grpo_samples,
    )


# ---------------------------------------------------------------------------------------------
# Recorded log-probs, and the step's windows.


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
) -> None:
    """The reference's log-probs, and with several PPO epochs the generating policy's; see
    [a GRPO step]. ``phase`` times each pass (the profiler's ``phase``)."""
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
    if ppo_epochs > 1:
        with timed("old_policy"):
            record(policy, key=OLD_LOG_PROBS)


def micro_batching_for_rollouts(
    mode: MicroBatching,
    num_rollouts: int,
    gradient_accumulation_steps: int,
    micro_batch_tokens: int | None,
) -> MicroBatchingSettings:
    """A window's split of one step's ``num_rollouts`` rollouts on this rank: micro-batches of
    ``num_rollouts / gradient_accumulation_steps`` completions (checked at start-up to
    divide), or under ``token_budget`` as many as fit the budget (no rollout is dropped)."""
    if mode is MicroBatching.TOKEN_BUDGET:  # the budget cuts; every rollout is kept
        return MicroBatchingSettings(mode, batch_size=1, micro_batch_tokens=micro_batch_tokens)
    return MicroBatchingSettings(
        mode=mode,
        batch_size=num_rollouts // gradient_accumulation_steps,
        micro_batch_tokens=micro_batch_tokens,
    )


def rollout_window(rollouts: Sequence[Rollout], settings: MicroBatchingSettings, pad_id: int):
    """One pass over the step's rollouts as a window of samples (collated afresh each pass:
    the loss step consumes its batch), for ``LossNormalizer.windows``."""
    collate = partial(collate_rollouts, padding_idx=pad_id)
    samples = [
        {k: v for k, v in r.items() if k not in ("completion", "prompt_index", "sample_index")}
        for r in rollouts
    ]
    return WindowCollator(settings, len(samples), collate)(samples)


# ---------------------------------------------------------------------------------------------
# The whole step, as the recipe and the GA parity report take it.


@dataclass(frozen=True)
class StepSettings:
    """What one rank's GRPO step needs beyond the models and prompts; see [a GRPO step]."""

    grpo_samples: int
    sampling: SamplingSettings
    ppo_epochs: int
    forward_batch_size: int
    micro_batching: MicroBatchingSettings
    pad_id: int

    @classmethod
    def from_config(cls, cfg: Any, *, pad_id: int, eos_id: int) -> StepSettings:
        """A GRPO config's step: ``batch_size`` prompts on this rank, each sampled
        ``grpo_samples`` times until a stop token (``stop_token_ids``, or the tokenizer's
        ``eos_id``) or ``max_generated_tokens``."""
        return cls.of(
            num_prompts=cfg.batch_size,
            grpo_samples=cfg.grpo_samples,
            sampling=SamplingSettings(
                max_generated_tokens=cfg.max_generated_tokens,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                stop_tokens=tuple(cfg.stop_token_ids or [eos_id]),
            ),
            ppo_epochs=cfg.ppo_epochs,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            micro_batching=cfg.micro_batching,
            micro_batch_tokens=cfg.micro_batch_tokens,
            forward_batch_size=cfg.forward_batch_size,
            pad_id=pad_id,
        )

    @classmethod
    def of(
        cls,
        *,
        num_prompts: int,
        grpo_samples: int,
        sampling: SamplingSettings,
        ppo_epochs: int,
        gradient_accumulation_steps: int,
        micro_batching: MicroBatching,
        micro_batch_tokens: int | None,
        forward_batch_size: int | None,
        pad_id: int,
    ) -> StepSettings:
        """From the config's keys, for ``num_prompts`` prompts a step on this rank:
        ``forward_batch_size`` defaults to the training micro-batch's completions."""
        num_completions = num_prompts * grpo_samples
        return cls(
            grpo_samples=grpo_samples,
            sampling=sampling,
            ppo_epochs=ppo_epochs,
            forward_batch_size=forward_batch_size
            or max(1, num_completions // gradient_accumulation_steps),
            micro_batching=micro_batching_for_rollouts(
                micro_batching, num_completions, gradient_accumulation_steps, micro_batch_tokens
            ),
            pad_id=pad_id,
        )


def make_rollouts(
    policy: nn.Module,
    reference: nn.Module,
    prompts: Sequence[Mapping[str, Any]],
    *,
    settings: StepSettings,
    reward_components: Sequence[Callable[..., torch.Tensor]],
    tokenizer: Any,
    seed: int,
    step: int,
    device: torch.device,
    run_full_length: bool,
    precision: Precision | None = None,
    phase: Callable[[str], contextlib.AbstractContextManager[None]] | None = None,
) -> StepRollouts:
    """Generate, score and record log-probs for one step's ``prompts`` on this rank; see [a
    GRPO step]. ``phase`` times generate, reward, reference and old_policy (the profiler's
    ``phase``); the generation's wall time is kept in ``generation_seconds``."""
    timed = phase or (lambda _name: contextlib.nullcontext())
    t0 = time.perf_counter()  # generation reads its tokens back: host time is its time
    with timed("generate"):
        samples, num_generated = generate_rollouts(
            policy,
            prompts,
            grpo_samples=settings.grpo_samples,
            sampling=settings.sampling,
            seed=seed,
            step=step,
            device=device,
            run_full_length=run_full_length,
            precision=precision,
        )
    generation_seconds = time.perf_counter() - t0
    with timed("reward"):
        rollouts = score_rollouts(
            samples,
            prompts,
            grpo_samples=settings.grpo_samples,
            reward_components=reward_components,
            tokenizer=tokenizer,
            stop_tokens=settings.sampling.stop_tokens,
            num_generated_tokens=num_generated,
        )
    rollouts.generation_seconds = generation_seconds
    record_reference_and_old(
        policy,
        reference,
        rollouts.samples,
        ppo_epochs=settings.ppo_epochs,
        forward_batch_size=settings.forward_batch_size,
        pad_id=settings.pad_id,
        device=device,
        precision=precision,
        phase=phase,
    )
    return rollouts


def ppo_windows(
    rollouts: StepRollouts, settings: StepSettings, normalizer: LossNormalizer
) -> Iterator[Window]:
    """``ppo_epochs`` windows over the same rollouts, each collated afresh and counted by
    ``normalizer``: one optimizer step each."""
    for _ in range(settings.ppo_epochs):
        sample_window = rollout_window(rollouts.samples, settings.micro_batching, settings.pad_id)
        yield from normalizer.windows([sample_window])


# ---------------------------------------------------------------------------------------------
# What a step logs about its rollouts.


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
    if generation_seconds:
        metrics["throughput/generated_tokens_per_second"] = (
            rollouts.num_generated_tokens / generation_seconds
        )
    return metrics
