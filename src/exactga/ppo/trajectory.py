"""One PPO step's trajectories: generated, scored, given stock's rewards and advantages, and cut
into PPO batches for the one normaliser. See [a PPO step].

Note [a PPO step]
A step takes ``batch_size`` prompts and generates one response to each through the generation
path GRPO uses (``exactga.generation.sampling.generate_group``: one prompt per ``generate`` call, no
padding, randomness from (seed, step, prompt's place in the step) only, the response cut after
its first stop token). Then, under no_grad, in chunks of ``forward_batch_size`` trajectories,
the policy's log-probs of its response tokens (at ``temperature``, as stock scores them), the
reference's, the value model's values and the reward model's score of the last response token
are recorded. From these, on stock's ``(batch_size, max_generated_tokens)`` response grid, the
rewards, KL and advantages are stock's own functions over the whole step's batch
(``rlhf.get_reward_penalty_mask``, ``get_rewards_ppo``, ``estimate_advantages`` with its
whitening): they are fixed before any split. Each of ``ppo_epochs`` passes then shuffles the
trajectories (a permutation drawn from (seed, step, pass) only, so it does not depend on the
split or on a resume) and takes ``batch_size / ppo_batch_size`` optimizer steps, each a window
of the PPO batch's trajectories in ``gradient_accumulation_steps`` micro-batches (cut by
``micro_batching``), whose units the normaliser counts over the whole PPO batch (see [policy
and value terms] in exactga.ppo.loss).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchtune import rlhf, training

from exactga.accumulation.forward import token_log_probs
from exactga.accumulation.loss_units import IGNORE_INDEX, loss_positions, shift_labels
from exactga.config.options import MicroBatching
from exactga.data.loader import build_prompt_loader, load_dataset
from exactga.data.micro_batching import MicroBatchingSettings, WindowCollator
from exactga.generation.sampling import SamplingSettings, check_prompt, generate_group
from exactga.model_build.frozen import frozen_forward
from exactga.ppo.loss import ADVANTAGES, OLD_LOG_PROBS, OLD_VALUES, RETURNS
from exactga.runtime.precision import Precision

if TYPE_CHECKING:
    from exactga.accumulation.normalization import LossNormalizer, Window
    from exactga.ppo.schema import PpoFullFinetuneSingleDeviceConfig

Trajectory = dict[str, Any]
Phase = Callable[[str], contextlib.AbstractContextManager[None]]


@dataclass(frozen=True)
class TrajectorySettings:
    """What one PPO step needs beyond the models and prompts; see [a PPO step]."""

    sampling: SamplingSettings
    forward_batch_size: int
    pad_id: int
    kl_coeff: float
    gamma: float
    lmbda: float
    whiten_rewards: bool
    min_response_length: int | None
    penalise_no_eos: bool
    reward_penalty: float
    ppo_epochs: int
    ppo_batch_size: int
    micro_batching: MicroBatchingSettings

    @classmethod
    def from_settings(
        cls, settings: PpoFullFinetuneSingleDeviceConfig, tokenizer: Any
    ) -> TrajectorySettings:
        """The step of a PPO recipe's typed settings (or its GA parity report's). Stop tokens:
        ``stop_token_ids``, else the tokenizer's ``stop_tokens``, else its ``eos_id`` (stock
        warns and uses none; a response without one then runs to ``max_generated_tokens``)."""
        stop_tokens = settings.stop_token_ids or getattr(tokenizer, "stop_tokens", None)
        if not stop_tokens:
            stop_tokens = [tokenizer.eos_id]
        mode, ga = settings.micro_batching, settings.gradient_accumulation_steps
        budget = mode is MicroBatching.TOKEN_BUDGET  # the budget cuts; every trajectory is kept
        return cls(
            sampling=SamplingSettings(
                max_generated_tokens=settings.max_generated_tokens,
                temperature=settings.temperature,
                top_k=settings.top_k,
                stop_tokens=tuple(stop_tokens),
            ),
            forward_batch_size=settings.forward_batch_size,
            pad_id=tokenizer.pad_id,
            kl_coeff=settings.kl_coeff,
            gamma=settings.gamma,
            lmbda=settings.lmbda,
            whiten_rewards=settings.whiten_rewards,
            min_response_length=settings.min_response_length,
            penalise_no_eos=settings.penalise_no_eos,
            reward_penalty=settings.reward_penalty,
            ppo_epochs=settings.ppo_epochs,
            ppo_batch_size=settings.ppo_batch_size,
            micro_batching=MicroBatchingSettings(
                mode,
                batch_size=1 if budget else settings.ppo_batch_size // ga,
                micro_batch_tokens=settings.micro_batch_tokens,
            ),
        )


@dataclass
class StepTrajectories:
    """One step's trajectories, collate-ready, with what stock logs about them (per
    trajectory, on the response grid)."""

    samples: list[Trajectory]
    scores: torch.Tensor  # (B,) the reward model's score, penalties applied
    kl: torch.Tensor  # (B, G) logp - ref_logp, 0 past the response
    kl_rewards: torch.Tensor  # (B, G) -kl_coeff * kl
    response_lengths: torch.Tensor  # (B,) stock's seq_lens: the last response token's index
    num_stopped: int  # responses with a stop token before the last generated position
    num_tokens: int  # prompt and response positions of the step, as stock counts throughput
    generation_seconds: float = 0.0


@dataclass(frozen=True)
class StepModels:
    """The four models of a PPO step: the trained policy and value model, the frozen reference
    and reward model."""

    policy: nn.Module
    value: nn.Module
    reference: nn.Module
    reward: nn.Module


# ---------------------------------------------------------------------------------------------
# Generation, and the no-grad forwards.


def generate_responses(
    policy: nn.Module,
    prompts: Sequence[Mapping[str, Any]],
    *,
    sampling: SamplingSettings,
    seed: int,
    step: int,
    device: torch.device,
    precision: Precision | None = None,
    prompt_indices: Sequence[int] | None = None,
) -> list[Trajectory]:
    """One response to each prompt (dataset items with ``tokens``), prompt by prompt; see [a
    PPO step]. Each is seeded by its prompt's place in the step, or by ``prompt_indices``
    (validation's rows in the held-out set)."""
    autocast = precision.autocast() if precision is not None else contextlib.nullcontext()
    indices = range(len(prompts)) if prompt_indices is None else prompt_indices
    trajectories = []
    with autocast:
        for index, prompt in zip(indices, prompts, strict=True):
            group = generate_group(
                policy,
                list(prompt["tokens"]),
                num_samples=1,
                sampling=sampling,
                seed=seed,
                step=step,
                prompt_index=index,  # its place in the step: the same on any split
                run_full_length=False,
                device=device,
            )
            (rollout,) = group.rollouts
            rollout["prompt_length"] = len(prompt["tokens"])
            trajectories.append(rollout)
    return trajectories


def _padded(rows: Sequence[Trajectory], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r["tokens"]) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for row, r in enumerate(rows):
        tokens[row, : len(r["tokens"])] = torch.as_tensor(r["tokens"])
        labels[row, : len(r["labels"])] = torch.as_tensor(r["labels"])
    return tokens, labels


def _per_response_token(
    flat: torch.Tensor, positions: torch.Tensor, rows: Sequence[Trajectory]
) -> list[torch.Tensor]:
    """Values at the response positions of a padded chunk, back as one vector per row."""
    lengths = [len(r["completion"]) for r in rows]
    assert sum(lengths) == len(positions), "every response token has one scored position"
    return list(flat.double().cpu().split(lengths))


def record_forwards(
    models: StepModels,
    trajectories: list[Trajectory],
    *,
    settings: TrajectorySettings,
    device: torch.device,
    precision: Precision | None = None,
    phase: Phase | None = None,
) -> None:
    """Store in each trajectory the policy's and the reference's log-probs of its response
    tokens (``old_log_probs``, ``ref_log_probs``), the value model's values of the states before
    each response token and after the last (``values_all``), and the reward model's ``score``
    at its last token, in chunks of ``forward_batch_size``, under no_grad."""
    timed = phase or (lambda _name: contextlib.nullcontext())
    autocast = precision.autocast() if precision is not None else contextlib.nullcontext()
    size = settings.forward_batch_size
    log_probs_of = partial(
        token_log_probs, precision=precision, temperature=settings.sampling.temperature
    )
    for start in range(0, len(trajectories), size):
        rows = trajectories[start : start + size]
        tokens, labels = _padded(rows, settings.pad_id)
        positions = loss_positions(labels)
        targets = shift_labels(labels).reshape(-1).index_select(0, positions)
        on_device = {"tokens": tokens.to(device)}
        args = (on_device, positions.to(device), targets.to(device))
        with frozen_forward():
            with timed("old_policy"):
                old = _per_response_token(log_probs_of(models.policy, *args), positions, rows)
            with timed("reference"):
                ref = _per_response_token(log_probs_of(models.reference, *args), positions, rows)
            with timed("values"), autocast:
                values = models.value(on_device["tokens"]).squeeze(-1).double().cpu()
            with timed("reward"), autocast:
                scores = models.reward(on_device["tokens"]).squeeze(-1).double().cpu()
        for row, r in enumerate(rows):
            first, last = r["prompt_length"] - 1, len(r["tokens"]) - 1
            r[OLD_LOG_PROBS], r["ref_log_probs"] = old[row], ref[row]
            r["values_all"] = values[
                row, first : last + 1
            ].clone()  # states before each token, and after the last
            r["score"] = float(scores[row, last])


# ---------------------------------------------------------------------------------------------
# Stock's rewards and advantages, over the whole step's batch.


def assign_advantages(
    trajectories: list[Trajectory], settings: TrajectorySettings
) -> StepTrajectories:
    """Stock's reward penalties, per-token KL rewards, GAE advantages (whitened over the batch's
    response tokens) and returns, on stock's ``(B, max_generated_tokens)`` response grid in
    fp64; then each trajectory keeps its ``advantages`` (per response token) and its
    ``old_values`` and ``returns`` (per value position). See [a PPO step]."""
    num_rows, width = len(trajectories), settings.sampling.max_generated_tokens
    lengths = torch.tensor([len(r["completion"]) for r in trajectories])
    grid = torch.arange(width).expand(num_rows, width)
    response_padding_masks = grid >= lengths[:, None]
    seq_lens = training.get_unmasked_sequence_lengths(response_padding_masks)
    logprobs = torch.ones(num_rows, width, dtype=torch.float64)  # stock's 1.0 past the response
    ref_logprobs = logprobs.clone()
    values = torch.zeros(num_rows, width, dtype=torch.float64)
    for row, r in enumerate(trajectories):
        logprobs[row, : len(r[OLD_LOG_PROBS])] = r[OLD_LOG_PROBS]
        ref_logprobs[row, : len(r["ref_log_probs"])] = r["ref_log_probs"]
        kept = r["values_all"][:width]
        values[row, : len(kept)] = kept
    # Values are kept up to one position past the last response token (stock's rule).
    value_seq_idxs = torch.where((seq_lens > 0) & (seq_lens < width - 1), seq_lens + 1, seq_lens)
    value_padding_masks = response_padding_masks.clone().scatter_(1, value_seq_idxs[:, None], False)
    values[value_padding_masks] = 0.0
    scores = torch.tensor([r["score"] for r in trajectories], dtype=torch.float64)
    if settings.penalise_no_eos or settings.min_response_length:
        penalised = rlhf.get_reward_penalty_mask(
            response_padding_masks, seq_lens, settings.penalise_no_eos, settings.min_response_length
        )
        scores[penalised] = settings.reward_penalty
    rewards, kl, kl_rewards = rlhf.get_rewards_ppo(
        scores, logprobs, ref_logprobs, settings.kl_coeff, value_seq_idxs
    )
    if settings.whiten_rewards:
        rewards = rlhf.whiten(rewards, shift_mean=False)
    advantages, returns = rlhf.estimate_advantages(
        values, rewards, settings.gamma, settings.lmbda, masks=~response_padding_masks
    )
    for row, r in enumerate(trajectories):
        num_values = int(value_seq_idxs[row]) + 1
        r[ADVANTAGES] = advantages[row, : len(r["completion"])].clone()
        r[OLD_VALUES] = values[row, :num_values].clone()
        r[RETURNS] = returns[row, :num_values].clone()
    return StepTrajectories(
        samples=trajectories,
        scores=scores,
        kl=kl,
        kl_rewards=kl_rewards,
        response_lengths=seq_lens,
        num_stopped=int(response_padding_masks.any(-1).sum()),
        num_tokens=sum(len(r["tokens"]) for r in trajectories),
    )


def make_trajectories(
    models: StepModels,
    prompts: Sequence[Mapping[str, Any]],
    *,
    settings: TrajectorySettings,
    seed: int,
    step: int,
    device: torch.device,
    precision: Precision | None = None,
    phase: Phase | None = None,
) -> StepTrajectories:
    """Generate, record and score one step's trajectories; see [a PPO step]. ``phase`` times
    generate, old_policy, reference, values and reward (the profiler's ``phase``)."""
    timed = phase or (lambda _name: contextlib.nullcontext())
    t0 = time.perf_counter()  # generation reads its tokens back: host time is its time
    with timed("generate"):
        samples = generate_responses(
            models.policy,
            prompts,
            sampling=settings.sampling,
            seed=seed,
            step=step,
            device=device,
            precision=precision,
        )
    generation_seconds = time.perf_counter() - t0
    record_forwards(
        models, samples, settings=settings, device=device, precision=precision, phase=phase
    )
    trajectories = assign_advantages(samples, settings)
    trajectories.generation_seconds = generation_seconds
    return trajectories


# ---------------------------------------------------------------------------------------------
# The step's windows, and what a step logs about its trajectories.


def permutation_seed(seed: int, step: int, ppo_epoch: int) -> int:
    """The seed of one PPO pass's shuffle: a stable hash of (seed, step, pass)."""
    digest = hashlib.blake2b(f"ppo/{seed}/{step}/{ppo_epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


_TRAINING_KEYS = (
    "tokens",
    "labels",
    "prompt_length",
    OLD_LOG_PROBS,
    ADVANTAGES,
    OLD_VALUES,
    RETURNS,
)


def ppo_batches(
    trajectories: StepTrajectories,
    settings: TrajectorySettings,
    *,
    seed: int,
    step: int,
    collate: Callable[[Sequence[Trajectory]], dict[str, torch.Tensor]],
) -> Iterator[Any]:
    """The step's PPO batches, as windows of samples: ``ppo_epochs`` passes, each a fresh
    permutation of the trajectories (from (seed, step, pass) only) cut into batches of
    ``ppo_batch_size``; see [a PPO step]."""
    samples = [{k: r[k] for k in _TRAINING_KEYS} for r in trajectories.samples]
    for ppo_epoch in range(settings.ppo_epochs):
        generator = torch.Generator().manual_seed(permutation_seed(seed, step, ppo_epoch))
        order = torch.randperm(len(samples), generator=generator).tolist()
        for start in range(0, len(order), settings.ppo_batch_size):
            batch = [samples[i] for i in order[start : start + settings.ppo_batch_size]]
            yield WindowCollator(settings.micro_batching, len(batch), collate)(batch)


def ppo_batch_windows(
    trajectories: StepTrajectories,
    settings: TrajectorySettings,
    normalizer: LossNormalizer,
    *,
    seed: int,
    step: int,
    collate: Callable[[Sequence[Trajectory]], dict[str, torch.Tensor]],
) -> Iterator[Window]:
    """The step's optimizer steps, each a PPO batch counted by ``normalizer``."""
    batches = ppo_batches(trajectories, settings, seed=seed, step=step, collate=collate)
    for sample_window in batches:
        yield from normalizer.windows([sample_window])


def trajectory_metrics(trajectories: StepTrajectories) -> dict[str, float]:
    """Stock's trajectory statistics: mean score, responses with a stop token, the RLHF reward
    (score plus the summed KL reward), the summed KL and KL reward, the mean response length
    (stock's ``seq_lens``), each a mean over the step's trajectories."""
    kl_reward = trajectories.kl_rewards.sum(1).mean()
    return {
        "scores": float(trajectories.scores.mean()),
        "num_stop_tokens": float(trajectories.num_stopped),
        "rlhf_reward": float(trajectories.scores.mean() + kl_reward),
        "kl": float(trajectories.kl.sum(1).mean()),
        "kl_reward": float(kl_reward),
        "response_lengths": float(trajectories.response_lengths.double().mean()),
    }


def prompt_loader(
    cfg: PpoFullFinetuneSingleDeviceConfig,
    tokenizer: Any,
    policy: nn.Module,
    state_dict: Mapping[str, Any] | None,
) -> Any:
    """The config's ``dataset`` (stock: a text-completion dataset of prompts, rows checked),
    every prompt checked against the policy first so a bad one fails at start-up, then
    ``batch_size`` prompts a step out of one shuffled order (``build_prompt_loader``)."""
    dataset = load_dataset(cfg.dataset, tokenizer, policy.tok_embeddings.num_embeddings)
    for index in range(len(dataset)):
        check_prompt(
            policy,
            dataset[index]["tokens"],
            prompt_index=index,
            max_generated_tokens=cfg.max_generated_tokens,
        )
    return build_prompt_loader(
        dataset, batch_size=cfg.batch_size, shuffle=cfg.shuffle, state_dict=state_dict
    )
