"""Validation during PPO training: the reward model's mean score of responses generated for
held-out prompts (``dataset_val``), and the value model's loss against their returns. See [PPO
validation] and docs/validation.md.

Note [PPO validation]
Every validation generates one response to each held-out prompt with the training sampler,
seeded by ``rollout_seed(seed, VALIDATION_STEP, row)`` (exactga.generation.sampling: the row is
the prompt's in the held-out set, so the response does not depend on ``batch_size_val``, and no
validation draw is a training draw), runs the no-grad forwards of a training step over each
batch (the policy's and the reference's log-probs, the value model's values, the reward
model's score: ``record_forwards``), and gives each response stock's rewards and returns
(``assign_advantages``: the score with ``penalise_no_eos`` / ``min_response_length``'s penalty,
the KL to the reference, GAE) with the rewards never whitened, since whitening over a batch
would tie a response's returns to the others in its batch. Two figures over the whole set:

- ``val/reward_mean``: the scores (penalties applied: training's ``scores``) summed over the
  prompts, over their number;
- ``val/value_loss``: ``0.5 (v_t - R_t)^2`` (training's value loss without ``value_coeff``; its
  clip is inactive, as the old values are the values) summed over every value position of every
  response, over their number: not a mean of batch means.

The PPO recipe's rewards define no success (a reward model's score is not a pass or fail), so
there is no success rate. The models are in eval mode without gradients, and the CPU and device
RNG states are restored afterwards, so a run trains bit-identically with and without
validation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from exactga.data.loader import load_dataset
from exactga.generation.sampling import VALIDATION_STEP, check_prompt
from exactga.ppo.loss import OLD_VALUES, RETURNS
from exactga.ppo.schema import PpoFullFinetuneSingleDeviceConfig
from exactga.ppo.trajectory import (
    StepModels,
    TrajectorySettings,
    assign_advantages,
    generate_responses,
    record_forwards,
)
from exactga.runtime.precision import Precision
from exactga.validation.held_out import (
    HIGHEST_REWARD_MEAN,
    Validation,
    eval_mode,
    training_rng_kept,
)


class HeldOutPpoPrompts:
    """The held-out prompts in batches of ``batch_size`` (``batch_size_val``; the figures do
    not depend on it but for fp32 rounding), the first ``max_batches x batch_size`` rows under
    ``max_batches`` (``max_val_batches``).

    Raises:
        ValueError: the set has no prompt.
    """

    def __init__(self, dataset: Dataset, *, batch_size: int, max_batches: int | None) -> None:
        num_prompts = len(dataset)  # type: ignore[arg-type]
        if num_prompts == 0:
            raise ValueError("config key 'dataset_val': the held-out set has no prompt.")
        if max_batches is not None:
            num_prompts = min(num_prompts, max_batches * batch_size)
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_prompts = num_prompts

    def batches(self) -> Iterator[tuple[list[int], list[Mapping[str, Any]]]]:
        """Each batch's rows in the set and its prompt items."""
        for start in range(0, self.num_prompts, self.batch_size):
            rows = list(range(start, min(start + self.batch_size, self.num_prompts)))
            yield rows, [self.dataset[row] for row in rows]


@dataclass(frozen=True)
class HeldOutPpo:
    """A validation's sums over the held-out set, and its figures."""

    score_sum: float
    num_prompts: int
    value_loss_sum: float
    num_value_positions: int

    def metrics(self) -> dict[str, float]:
        return {
            HIGHEST_REWARD_MEAN.name: self.score_sum / self.num_prompts,
            "val/value_loss": self.value_loss_sum / self.num_value_positions,
        }

    def line(self, step: int) -> str:
        metrics = self.metrics()
        return (
            f"step {step} validation over {self.num_prompts} prompts: val/reward_mean="
            f"{metrics['val/reward_mean']:.4f} val/value_loss={metrics['val/value_loss']:.4f} "
            f"(over {self.num_value_positions} value positions)"
        )


def held_out_ppo(
    models: StepModels,
    held_out: HeldOutPpoPrompts,
    *,
    settings: TrajectorySettings,
    seed: int,
    device: torch.device,
    precision: Precision | None = None,
) -> HeldOutPpo:
    """The figures of [PPO validation]."""
    unwhitened = replace(settings, whiten_rewards=False)
    score_sum = value_loss_sum = 0.0
    num_value_positions = 0
    with training_rng_kept(device), eval_mode(models.policy), eval_mode(models.value):
        for rows, prompts in held_out.batches():
            trajectories = generate_responses(
                models.policy,
                prompts,
                sampling=settings.sampling,
                seed=seed,
                step=VALIDATION_STEP,
                device=device,
                precision=precision,
                prompt_indices=rows,
            )
            record_forwards(
                models, trajectories, settings=settings, device=device, precision=precision
            )
            scored = assign_advantages(trajectories, unwhitened)
            score_sum += float(scored.scores.sum())
            for trajectory in trajectories:
                errors = trajectory[OLD_VALUES] - trajectory[RETURNS]
                value_loss_sum += float((0.5 * errors**2).sum())
                num_value_positions += len(errors)
    return HeldOutPpo(
        score_sum=score_sum,
        num_prompts=held_out.num_prompts,
        value_loss_sum=value_loss_sum,
        num_value_positions=num_value_positions,
    )


def ppo_validation_from_settings(
    settings: PpoFullFinetuneSingleDeviceConfig,
    *,
    tokenizer: Any,
    policy: nn.Module,
    metric_logger: Any | None,
) -> Validation | None:
    """The recipe's validation on the held-out prompts of ``dataset_val`` (any dataset section
    the recipe trains on, rows checked), each checked against the policy at start-up as
    training's are; ``keep_best_checkpoint`` keeps the weights (the policy's and the value
    model's) of the highest ``val/reward_mean``. ``None`` without ``dataset_val``."""
    if settings.dataset_val is None:
        return None
    dataset = load_dataset(
        settings.dataset_val, tokenizer, policy.tok_embeddings.num_embeddings, "dataset_val"
    )
    for row in range(len(dataset)):
        check_prompt(
            policy,
            dataset[row]["tokens"],
            prompt_index=row,
            max_generated_tokens=settings.max_generated_tokens,
        )
    held_out = HeldOutPpoPrompts(
        dataset,
        batch_size=settings.batch_size_val or settings.batch_size,
        max_batches=settings.max_val_batches,
    )
    return Validation(
        held_out,
        every_n_steps=settings.run_val_every_n_steps,
        metric_logger=metric_logger,
        keep_best=settings.keep_best_checkpoint,
        best=HIGHEST_REWARD_MEAN,
    )
