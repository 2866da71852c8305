"""One GRPO step on this rank: prompts in, rollouts out, then windows for the one normaliser.

``recipes/grpo_full_finetune_distributed.py`` keeps its loop in sight and calls this module for
what decides numbers: which completions are generated (``exactga.generation.sampling``), how
they are scored (``exactga.grpo.rewards``), their advantages and recorded log-probs, how the
step's rollouts are cut into micro-batches, and what is logged about them. See [a GRPO step].

Note [a GRPO step]
A step takes ``batch_size`` prompts on each data-parallel rank (the global batch is the same
prompts whatever the layout: the sampler deals the shuffled indices out to the ranks) and
generates ``grpo_samples`` completions of each, with randomness that depends only on (seed,
step, prompt index, sample index) (see exactga.generation.sampling), so 1 rank and 4 ranks hold
the same completions. Rewards and group-relative advantages are per prompt, and a prompt's group
never leaves its rank, so no collective is needed for them. The reference's per-token log-probs, and
with ``ppo_epochs > 1`` the generating policy's, are recorded once, under no_grad, in chunks of
``forward_batch_size`` rollouts (as many chunks on every rank, so FSDP's collectives pair up).
Then each of the ``ppo_epochs`` passes over the rollouts is one optimizer step: a window of
``gradient_accumulation_steps`` micro-batches, cut by ``micro_batching`` like any window, whose
units (completion tokens or completions, by ``loss_aggregation``) the one normaliser counts
over every rank (see [policy aggregations] in exactga.grpo.policy). With ``ppo_epochs: 1`` the
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
from exactga.config.options import KLEstimator, MicroBatching
from exactga.data.micro_batching import (
    MicroBatchingSettings,
    WindowCollator,
    plan_micro_batches,
    sample_length,
)
from exactga.generation.sampling import SamplingSettings, generate_group
from exactga.grpo.losses import PolicyLoss
from exactga.grpo.policy import OLD_LOG_PROBS, REF_LOG_PROBS, collate_rollouts, group_advantages
from exactga.grpo.rewards import score_completions, successes
from exactga.grpo.shaping import (
    OverlongShaping,
    global_slots,
    groups_with_spread,
    kept_groups,
    kl_reward_penalties,
    round_is_enough,
)
from exactga.runtime.precision import Precision

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
    # The reward each advantage was taken from, where it differs from ``rewards`` (with the KL
    # penalty of ``kl_in_reward`` taken off); see exactga.grpo.shaping.
    kl_penalties: torch.Tensor | None = None  # (n,) what kl_in_reward took off each reward
    num_sampling_rounds: int | None = None  # dynamic sampling: rounds of prompts this step


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
class RewardKL:
    """``kl_in_reward``: ``kl_coeff`` times each completion's summed KL estimate is taken off
    its reward before the advantages (exactga.grpo.shaping.kl_reward_penalties)."""

    kl_coeff: float
    estimator: KLEstimator


@dataclass(frozen=True)
class StepSettings:
    """What one rank's GRPO step needs beyond the models and prompts; see [a GRPO step]. The
    last three are the reward and group shaping of exactga.grpo.shaping (off by default)."""

    grpo_samples: int
    sampling: SamplingSettings
    ppo_epochs: int
    forward_batch_size: int
    micro_batching: MicroBatchingSettings
    pad_id: int
    overlong: OverlongShaping | None = None
    reward_kl: RewardKL | None = None
    # Dynamic sampling: the most rounds of prompts a step generates (None: off).
    max_sampling_rounds: int | None = None

    @classmethod
    def from_config(
        cls, cfg: Any, *, pad_id: int, eos_id: int, loss: PolicyLoss | None = None
    ) -> StepSettings:
        """A GRPO config's step: ``batch_size`` prompts on this rank, each sampled
        ``grpo_samples`` times until a stop token (``stop_token_ids``, or the tokenizer's
        ``eos_id``) or ``max_generated_tokens``; ``loss`` says whether its KL is in the
        reward."""
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
            shaping=ShapingKeys.from_config(cfg, loss),
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
        shaping: ShapingKeys | None = None,
    ) -> StepSettings:
        """From the config's keys, for ``num_prompts`` prompts a step on this rank:
        ``forward_batch_size`` defaults to the training micro-batch's completions."""
        num_completions = num_prompts * grpo_samples
        shaping = shaping or ShapingKeys()
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
            overlong=shaping.overlong(sampling.max_generated_tokens),
            reward_kl=shaping.reward_kl,
            max_sampling_rounds=shaping.max_sampling_rounds,
        )


@dataclass(frozen=True)
class ShapingKeys:
    """The config's shaping keys (``overlong_buffer``, ``overlong_penalty_factor``,
    ``dynamic_sampling``, ``max_sampling_rounds``) and the loss's ``kl_in_reward``."""

    overlong_buffer: int | None = None
    overlong_penalty_factor: float = 1.0
    max_sampling_rounds: int | None = None
    reward_kl: RewardKL | None = None

    @classmethod
    def from_config(cls, cfg: Any, loss: PolicyLoss | None) -> ShapingKeys:
        reward_kl = None
        if loss is not None and loss.kl_in_reward and loss.kl_coeff:
            reward_kl = RewardKL(loss.kl_coeff, loss.kl_estimator)
        return cls(
            overlong_buffer=cfg.get("overlong_buffer"),
            overlong_penalty_factor=float(cfg.get("overlong_penalty_factor", 1.0)),
            max_sampling_rounds=cfg.get("max_sampling_rounds")
            if cfg.get("dynamic_sampling", False)
            else None,
            reward_kl=reward_kl,
        )

    def overlong(self, max_generated_tokens: int) -> OverlongShaping | None:
        if self.overlong_buffer is None:
            return None
        return OverlongShaping(
            max_generated_tokens, self.overlong_buffer, self.overlong_penalty_factor
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
    more_prompts: Callable[[], Sequence[Mapping[str, Any]] | None] | None = None,
    dp_group: Any = None,
) -> StepRollouts:
    """Generate, score and record log-probs for one step's ``prompts`` on this rank; see [a
    GRPO step]. ``phase`` times generate, reward, reference and old_policy (the profiler's
    ``phase``); the generation's wall time is kept in ``generation_seconds``.

    With dynamic sampling (``settings.max_sampling_rounds``) ``more_prompts`` gives this rank's
    next batch of prompts of the data order (None at its end), called alike on every rank of
    ``dp_group``; see [dynamic sampling on any layout] in exactga.grpo.shaping."""
    timed = phase or (lambda _name: contextlib.nullcontext())
    t0 = time.perf_counter()  # generation reads its tokens back: host time is its time

    def generate_and_score(batch: Sequence[Mapping[str, Any]]) -> StepRollouts:
        with timed("generate"):
            samples, num_generated = generate_rollouts(
                policy,
                batch,
                grpo_samples=settings.grpo_samples,
                sampling=settings.sampling,
                seed=seed,
                step=step,
                device=device,
                run_full_length=run_full_length,
                precision=precision,
            )
        with timed("reward"):
            return score_rollouts(
                samples,
                batch,
                grpo_samples=settings.grpo_samples,
                reward_components=reward_components,
                tokenizer=tokenizer,
                stop_tokens=settings.sampling.stop_tokens,
                num_generated_tokens=num_generated,
                overlong=settings.overlong,
            )

    if settings.max_sampling_rounds is None:
        rollouts = generate_and_score(prompts)
    else:
        rollouts = dynamic_sampling(
            prompts,
            generate_and_score,
            more_prompts or (lambda: None),
            max_rounds=settings.max_sampling_rounds,
            dp_group=dp_group,
        )
    rollouts.generation_seconds = time.perf_counter() - t0
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
        record_old=settings.reward_kl is not None,
    )
    if settings.reward_kl is not None:
        rollouts.kl_penalties = kl_reward_penalties(
            rollouts.samples,
            OLD_LOG_PROBS,
            REF_LOG_PROBS,
            kl_coeff=settings.reward_kl.kl_coeff,
            estimator=settings.reward_kl.estimator,
        )
        assign_advantages(rollouts)
        if settings.ppo_epochs == 1:  # the loss takes the current policy's own, detached
            for sample in rollouts.samples:
                sample.pop(OLD_LOG_PROBS)
    return rollouts


# ---------------------------------------------------------------------------------------------
# Dynamic sampling.


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
