"""Validation during GRPO training: the reward mean and success rate of completions generated
for held-out prompts (``dataset_val``), over every completion of every rank. See [GRPO
validation] and docs/validation.md.

Note [GRPO validation]
Every validation generates ``grpo_samples`` completions of each held-out prompt with the
training sampler (``temperature``, ``top_k``, ``stop_token_ids``, ``max_generated_tokens``),
scores them with the run's ``rewards`` (and ``overlong_buffer``'s penalty, as training's
``rewards/mean`` does; ``kl_in_reward`` needs the reference and is left out), and reports
``val/reward_mean``, the reward summed over every completion of every prompt on every rank
divided by the number of completions (sums and counts all-reduced once, not a mean of batch
means), and ``val/success_rate``, the completions every ``defines_success`` reward passed over
the same count (only where a reward defines success, as in training's logs).

A completion depends on the weights and on (the run's seed, the prompt's row in the set, the
completion's place in its group) only: each group's generator is seeded by
``rollout_seed(seed, VALIDATION_STEP, row)`` (exactga.generation.sampling), and no training step
is negative, so no validation draw is a training draw, and every validation of a run draws the
same numbers (successive figures differ by the weights alone). One prompt per ``generate`` call
as in training ([rollouts independent of the rank layout]), so the number of ranks and
``batch_size_val`` change nothing. Rank ``r`` of ``n`` takes rows ``r, r + n, ...`` of the set
(its first ``max_val_batches x batch_size_val`` rows under ``max_val_batches``); under FSDP a
rank with fewer rows generates a filler group that is not scored, since every rank must run as
many forwards. The model is in eval mode without gradients, and the CPU and device RNG states
are restored afterwards, so a run trains bit-identically with and without validation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset
from torchtune import config

from exactga.generation.sampling import VALIDATION_STEP, check_prompt
from exactga.grpo.rewards import score_completions, successes
from exactga.grpo.rollout_step import RolloutRuntime, StepSettings
from exactga.grpo.rollouts import completion_text, generate_rollouts
from exactga.grpo.schema import GrpoDistributedConfig
from exactga.runtime.runtime import Runtime
from exactga.validation.held_out import HIGHEST_REWARD_MEAN, Validation, training_rng_kept


class HeldOutPrompts:
    """This rank's rows of the held-out prompts, in batches of ``batch_size``; see [GRPO
    validation].

    Args:
        dataset: prompt items (``exactga.grpo.prompts.PromptDataset``'s).
        batch_size: prompts scored per batch (``batch_size_val``); the figure does not
            depend on it.
        max_batches: only the first ``max_batches x batch_size`` rows (``max_val_batches``);
            ``None``: all.
        num_replicas: data-parallel ranks.
        rank: this process's data-parallel rank.

    Raises:
        ValueError: the set has no prompt.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        max_batches: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        num_prompts = len(dataset)  # type: ignore[arg-type]
        if num_prompts == 0:
            raise ValueError("config key 'dataset_val': the held-out set has no prompt.")
        if max_batches is not None:
            num_prompts = min(num_prompts, max_batches * batch_size)
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_prompts = num_prompts  # over every rank
        self.indices = list(range(rank, num_prompts, num_replicas))
        # Rank 0 holds the most rows; every rank generates as many groups as it does.
        self.num_groups = math.ceil(num_prompts / num_replicas)

    def batches(self) -> Iterator[list[Mapping[str, Any]]]:
        """This rank's prompt items, ``batch_size`` at a time."""
        for start in range(0, len(self.indices), self.batch_size):
            yield [self.dataset[i] for i in self.indices[start : start + self.batch_size]]

    def num_fillers(self) -> int:
        """The unscored groups this rank generates so that it runs rank 0's forwards."""
        return self.num_groups - len(self.indices)


@dataclass(frozen=True)
class HeldOutRewards:
    """A validation's sums over every completion of every rank, and its figures."""

    reward_sum: float
    num_succeeded: float
    num_completions: int
    defines_success: bool  # some reward defines success: there is a success rate

    def metrics(self) -> dict[str, float]:
        """``val/reward_mean`` and, where a reward defines success, ``val/success_rate``."""
        metrics = {HIGHEST_REWARD_MEAN.name: self.reward_sum / self.num_completions}
        if self.defines_success:
            metrics["val/success_rate"] = self.num_succeeded / self.num_completions
        return metrics

    def line(self, step: int) -> str:
        figures = " ".join(f"{name}={value:.4f}" for name, value in self.metrics().items())
        return f"step {step} validation over {self.num_completions} completions: {figures}"


def held_out_rewards(
    model: nn.Module,
    held_out: HeldOutPrompts,
    *,
    settings: StepSettings,
    reward_components: Sequence[Callable[..., torch.Tensor]],
    tokenizer: Any,
    seed: int,
    runtime: RolloutRuntime,
) -> HeldOutRewards:
    """The figures of [GRPO validation]: call on every rank of ``runtime.dp_group``. One
    all-reduce of three numbers under data parallelism."""
    sharded = runtime.dp_size > 1
    sums = torch.zeros(3, dtype=torch.float64)  # reward sum, successes, completions
    with training_rng_kept(runtime.device):
        for prompts in held_out.batches():
            rewards, succeeded = _score_batch(
                model,
                prompts,
                settings=settings,
                reward_components=reward_components,
                tokenizer=tokenizer,
                seed=seed,
                runtime=runtime,
            )
            sums += torch.stack(
                [
                    rewards.sum(),
                    succeeded.double().sum() if succeeded is not None else rewards.new_zeros(()),
                    torch.tensor(float(len(rewards)), dtype=torch.float64),
                ]
            )
        for _ in range(held_out.num_fillers() if sharded else 0):
            _generate(model, [held_out.dataset[0]], settings, seed, runtime)  # not scored
    if sharded:
        reduced = sums.to(runtime.device)
        dist.all_reduce(reduced, group=runtime.dp_group)
        sums = reduced.cpu()
    reward_sum, num_succeeded, num_completions = sums.tolist()
    return HeldOutRewards(
        reward_sum=reward_sum,
        num_succeeded=num_succeeded,
        num_completions=int(num_completions),
        defines_success=any(getattr(c, "defines_success", False) for c in reward_components),
    )


def _score_batch(
    model: nn.Module,
    prompts: Sequence[Mapping[str, Any]],
    *,
    settings: StepSettings,
    reward_components: Sequence[Callable[..., torch.Tensor]],
    tokenizer: Any,
    seed: int,
    runtime: RolloutRuntime,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each completion's reward (fp64, with the overlong penalty) and success, for a batch of
    prompts, in group order."""
    rollouts = _generate(model, prompts, settings, seed, runtime)
    stops = settings.sampling.stop_tokens
    texts = [completion_text(tokenizer, r["completion"], stops) for r in rollouts]
    repeats = settings.grpo_samples
    prompt_texts = [str(p["prompt"]) for p in prompts for _ in range(repeats)]
    answers = [str(p["answer"]) for p in prompts for _ in range(repeats)]
    total, per_component = score_completions(reward_components, prompt_texts, texts, answers)
    rewards = total.double()
    if settings.overlong is not None:
        rewards = rewards + settings.overlong.penalties([len(r["completion"]) for r in rollouts])
    return rewards, successes(reward_components, per_component)


def _generate(
    model: nn.Module,
    prompts: Sequence[Mapping[str, Any]],
    settings: StepSettings,
    seed: int,
    runtime: RolloutRuntime,
) -> list[dict[str, Any]]:
    """``grpo_samples`` completions of each prompt, seeded by (seed, VALIDATION_STEP, row)."""
    rollouts, _ = generate_rollouts(
        model,
        prompts,
        grpo_samples=settings.grpo_samples,
        sampling=settings.sampling,
        seed=seed,
        step=VALIDATION_STEP,
        device=runtime.device,
        run_full_length=runtime.dp_size > 1,  # every rank runs as many forwards
        precision=runtime.precision,
    )
    return rollouts


def grpo_validation_from_settings(
    settings: GrpoDistributedConfig,
    *,
    tokenizer: Any,
    model: nn.Module,
    runtime: Runtime,
    metric_logger: Any | None,
) -> Validation | None:
    """The recipe's validation on the held-out prompts of ``dataset_val`` (any prompt dataset
    section the recipe trains on), each checked against ``model`` at start-up as training's
    are, this rank's rows of them; ``keep_best_checkpoint`` keeps the weights of the highest
    ``val/reward_mean``. ``None`` without ``dataset_val``."""
    if settings.dataset_val is None:
        return None
    dataset = config.instantiate(settings.dataset_val, tokenizer)
    for prompt in dataset:
        check_prompt(
            model,
            prompt["prompt_tokens"],
            prompt_index=prompt["index"],
            max_generated_tokens=settings.max_generated_tokens,
        )
    held_out = HeldOutPrompts(
        dataset,
        batch_size=settings.batch_size_val or settings.batch_size,
        max_batches=settings.max_val_batches,
        num_replicas=runtime.dp_size,
        rank=runtime.dp_rank,
    )
    return Validation(
        held_out,
        every_n_steps=settings.run_val_every_n_steps,
        metric_logger=metric_logger,
        keep_best=settings.keep_best_checkpoint,
        best=HIGHEST_REWARD_MEAN,
    )
