"""One GRPO step on this rank: its settings, and prompts in, rollouts out.

``recipes/grpo_full_finetune_distributed.py`` keeps its loop in sight and calls the package for
what decides numbers: which completions are generated (``exactga.generation.sampling``), how
they are scored and given their advantages (``exactga.grpo.rollouts``, ``exactga.grpo.rewards``),
the recorded log-probs (``exactga.grpo.log_probs``), dynamic sampling
(``exactga.grpo.dynamic_sampling``), how the step's rollouts are cut into windows
(``exactga.grpo.windows``), and what is logged about them (``exactga.grpo.rollout_metrics``).
This module holds the step's settings and :func:`make_rollouts`, which runs them in order. See
[a GRPO step].

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from exactga.config.options import KLEstimator, MicroBatching
from exactga.data.micro_batching import MicroBatchingSettings
from exactga.generation.sampling import SamplingSettings
from exactga.grpo.dynamic_sampling import dynamic_sampling
from exactga.grpo.log_probs import record_reference_and_old
from exactga.grpo.losses import PolicyLoss
from exactga.grpo.policy import OLD_LOG_PROBS, REF_LOG_PROBS
from exactga.grpo.rollouts import (
    StepRollouts,
    assign_advantages,
    generate_rollouts,
    score_rollouts,
)
from exactga.grpo.schema import GrpoDistributedConfig, RolloutKeys
from exactga.grpo.shaping import OverlongShaping, kl_reward_penalties
from exactga.runtime.precision import Precision


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
    def from_settings(
        cls,
        settings: GrpoDistributedConfig,
        *,
        pad_id: int,
        eos_id: int,
        loss: PolicyLoss | None = None,
    ) -> StepSettings:
        """A GRPO recipe's typed settings' step: ``batch_size`` prompts on this rank, each sampled
        ``grpo_samples`` times until a stop token (``stop_token_ids``, or the tokenizer's
        ``eos_id``) or ``max_generated_tokens``; ``loss`` says whether its KL is in the
        reward."""
        return cls.of(
            num_prompts=settings.batch_size,
            grpo_samples=settings.grpo_samples,
            sampling=SamplingSettings(
                max_generated_tokens=settings.max_generated_tokens,
                temperature=settings.temperature,
                top_k=settings.top_k,
                stop_tokens=tuple(settings.stop_token_ids or [eos_id]),
            ),
            ppo_epochs=settings.ppo_epochs,
            gradient_accumulation_steps=settings.gradient_accumulation_steps,
            micro_batching=settings.micro_batching,
            micro_batch_tokens=settings.micro_batch_tokens,
            forward_batch_size=settings.forward_batch_size,
            pad_id=pad_id,
            shaping=ShapingKeys.from_settings(settings, loss),
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
    def from_settings(cls, settings: RolloutKeys, loss: PolicyLoss | None) -> ShapingKeys:
        """From the typed settings of the GRPO recipe or its GA parity report (both
        :class:`RolloutKeys`, which holds each key's one default)."""
        reward_kl = None
        if loss is not None and loss.kl_in_reward and loss.kl_coeff:
            reward_kl = RewardKL(loss.kl_coeff, loss.kl_estimator)
        return cls(
            overlong_buffer=settings.overlong_buffer,
            overlong_penalty_factor=float(settings.overlong_penalty_factor),
            max_sampling_rounds=settings.max_sampling_rounds if settings.dynamic_sampling else None,
            reward_kl=reward_kl,
        )

    def overlong(self, max_generated_tokens: int) -> OverlongShaping | None:
        if self.overlong_buffer is None:
            return None
        return OverlongShaping(
            max_generated_tokens, self.overlong_buffer, self.overlong_penalty_factor
        )


class RolloutRuntime(Protocol):
    """What a step's rollouts read of the run: the recipe's ``exactga.runtime.runtime.Runtime``,
    handed over whole so that the device, precision and ranks cannot disagree."""

    device: torch.device
    precision: Precision

    @property
    def dp_size(self) -> int: ...

    @property
    def dp_group(self) -> Any: ...


def make_rollouts(
    policy: nn.Module,
    reference: nn.Module,
    prompts: Sequence[Mapping[str, Any]],
    *,
    settings: StepSettings,
    reward_components: Sequence[Callable[..., torch.Tensor]],
    tokenizer: Any,
    step: int,
    seed: int,
    runtime: RolloutRuntime,
    phase: Callable[[str], contextlib.AbstractContextManager[None]] | None = None,
    more_prompts: Callable[[], Sequence[Mapping[str, Any]] | None] | None = None,
) -> StepRollouts:
    """Generate, score and record log-probs for one step's ``prompts`` on this rank; see [a
    GRPO step]. ``seed`` is the run's (its counters', an epoch checkpoint's on resume);
    ``runtime`` is the run's (its device, precision and data-parallel ranks); under data
    parallelism every group runs the full ``max_generated_tokens`` forwards, so that every rank
    runs as many (see [rollouts independent of the rank layout] in
    exactga.generation.sampling). ``phase`` times generate, reward, reference and old_policy
    (the profiler's ``phase``); the generation's wall time is kept in ``generation_seconds``.

    With dynamic sampling (``settings.max_sampling_rounds``) ``more_prompts`` gives this rank's
    next batch of prompts of the data order (None at its end), called alike on every rank of
    ``runtime``'s data-parallel group; see [dynamic sampling on any layout] in
    exactga.grpo.shaping."""
    device, precision = runtime.device, runtime.precision
    run_full_length = runtime.dp_size > 1  # every rank runs as many forwards
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
            dp_group=runtime.dp_group,
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
