"""Validation of a preference run (DPO and its pair siblings): the loss, reward accuracy and
margin over every validation pair.

The DPO recipes with ``dataset_val`` call :func:`preference_validation_loss` where the
fine-tuning recipes call ``exactga.sft.validation.validation_loss``: the same set, read the same
way (``ValidationSet``, [validation set order] in exactga.validation.held_out), collated as
pairs, and the same sums over every rank (``loss_sums``), over pairs instead of tokens. See
[preference validation].

Note [preference validation]
``val/loss`` is the mean over every validation pair of every rank of the per-pair loss (DPO,
IPO, RSO, SimPO, ORPO's preference term: what ``loss_fn`` returns per pair): the sum over pairs
over their number, the loss of the set as one batch. ``val/rewards/accuracy`` is the number of
pairs whose chosen reward beats the rejected one over the number of pairs, and
``val/rewards/margins``, ``val/rewards/chosen`` and ``val/rewards/rejected`` the means over
pairs: counts and sums over the whole set, never a mean of each batch's means (which weighs a
pair by one over its batch's size). Each batch runs training's own loss step
(``dpo_micro_batch_loss``: the same log-probs, length normalisation, reference) with the
reference as training computes it: the policy with its adapters off for LoRA, the frozen
reference model for full DPO, nothing for a reference-free loss; a precomputed reference table
covers the training pairs only, so validation runs the reference itself. An NLL term on the
chosen tokens (``rpo_alpha``, ORPO's) is a regulariser of the training step and not part of
``val/loss``.

KTO (an unpaired loss) validates over every example: its reference point ``z`` is the
validation set's, as training's is the window's ([kto reference point] in exactga.dpo.kto): a
first pass sums the mismatched sequences' log-ratios over every example of every rank, ``z =
max(0, sum / examples)``, and a second pass gives each example's loss against that ``z``;
``val/loss`` is their sum over the number of examples and ``val/kl`` is ``z``. A ``z`` per
validation batch (TRL's per-device estimate) would make the figure move with
``batch_size_val``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.dpo.kto import KtoExamples, KtoReferencePoint, kto_micro_batch_loss
from exactga.dpo.loss import dpo_micro_batch_loss
from exactga.dpo.metrics import PreferenceMetrics
from exactga.dpo.preference import PreferencePairs, collate_pairs
from exactga.dpo.schema import (
    FullDpoDistributedConfig,
    LoraDpoDistributedConfig,
    LoraDpoSingleDeviceConfig,
)
from exactga.dpo.terms import DPO, DpoTerms
from exactga.runtime.precision import Precision
from exactga.validation.held_out import (
    Validation,
    ValidationSet,
    loss_sums,
    validation_from_settings,
)

# The per-pair sums of PreferenceMetrics a validation reads, by their index there.
_REWARD_SUMS = [
    PreferenceMetrics.NAMES.index(name)
    for name in ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")
]


@dataclass(frozen=True)
class PreferenceValidationLoss:
    """What one preference validation measured; see [preference validation]."""

    loss: float  # per-pair loss summed over every pair of every rank / their number
    num_correct: int  # pairs whose chosen reward beats the rejected one
    margin: float  # mean over pairs of chosen reward - rejected reward
    chosen_reward: float
    rejected_reward: float
    num_pairs: int  # validation pairs of every rank
    num_samples: int  # validation samples (pairs) read, every rank's

    @property
    def accuracy(self) -> float:
        """The share of pairs whose chosen reward beats the rejected one: a count over pairs."""
        return self.num_correct / self.num_pairs if self.num_pairs else float("nan")

    def metrics(self) -> dict[str, float]:
        """The logged scalars, on the training loss's step axis; none without a pair."""
        if not self.num_pairs:
            return {}
        return {
            "val/loss": self.loss,
            "val/rewards/accuracy": self.accuracy,
            "val/rewards/margins": self.margin,
            "val/rewards/chosen": self.chosen_reward,
            "val/rewards/rejected": self.rejected_reward,
        }

    def line(self, step: int) -> str:
        """The console line: ``Validation at step 12: loss 0.6812, reward accuracy 0.6250 (10 of
        16 pairs), margin 0.0312``."""
        if not self.num_pairs:
            return f"Validation at step {step}: no pair in {self.num_samples:,} samples; no loss"
        return (
            f"Validation at step {step}: loss {self.loss:.4f}, reward accuracy "
            f"{self.accuracy:.4f} ({self.num_correct:,} of {self.num_pairs:,} pairs), margin "
            f"{self.margin:.4f}"
        )


def preference_validation_from_settings(
    settings: LoraDpoSingleDeviceConfig | LoraDpoDistributedConfig | FullDpoDistributedConfig,
    *,
    terms: DpoTerms,
    tokenizer: Any,
    loss_fn: nn.Module,
    model: nn.Module,
    runtime: Any,
    metric_logger: Any | None,
) -> Validation | None:
    """A DPO recipe's validation (``exactga.validation.held_out.validation_from_settings``) with
    the set collated as pairs (``collate_pairs``; KTO's examples with their mismatched
    sequences) and a rank's fillers emptied pairs; ``None`` without ``dataset_val``."""
    return validation_from_settings(
        settings,
        tokenizer=tokenizer,
        loss_fn=loss_fn,
        model=model,
        runtime=runtime,
        metric_logger=metric_logger,
        collate=partial(collate_pairs, padding_idx=tokenizer.pad_id, ignore_idx=IGNORE_INDEX),
        emptied=terms.units(IGNORE_INDEX).emptied,
    )


@dataclass(frozen=True)
class KtoValidationLoss:
    """What one KTO validation measured; see [preference validation]."""

    loss: float  # per-example loss summed over every example of every rank / their number
    kl: float  # the set's reference point z
    num_examples: int  # validation examples of every rank
    num_samples: int  # validation samples read, every rank's

    def metrics(self) -> dict[str, float]:
        """The logged scalars, on the training loss's step axis; none without an example."""
        if not self.num_examples:
            return {}
        return {"val/loss": self.loss, "val/kl": self.kl}

    def line(self, step: int) -> str:
        """The console line: ``Validation at step 12: loss 0.4921 over 64 examples (z 0.0312)``."""
        if not self.num_examples:
            return f"Validation at step {step}: no example in {self.num_samples:,} samples; no loss"
        return (
            f"Validation at step {step}: loss {self.loss:.4f} over {self.num_examples:,} "
            f"examples (z {self.kl:.4f})"
        )


def preference_validation_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    validation_set: ValidationSet,
    reference: Any,
    *,
    terms: DpoTerms = DPO,
    device: torch.device,
    precision: Precision | None = None,
) -> PreferenceValidationLoss | KtoValidationLoss:
    """The per-pair loss, reward accuracy and margins of the whole validation set as one batch,
    over every data-parallel rank; see [preference validation]. ``reference`` is what the loss
    step reads reference log-probs from (``lora_reference``, ``frozen_model_reference``; None for
    a reference-free loss), never a precomputed table. The policy in eval mode, no gradient, the
    RNG states restored after; every rank of the set's ``dp_group`` calls it. One host read,
    and under data parallelism one all-reduce of six numbers, per call. For an unpaired loss (KTO),
    :func:`kto_validation_loss`.
    """
    if terms.unpaired:
        return kto_validation_loss(
            model,
            loss_fn,
            validation_set,
            reference,
            device=device,
            precision=precision,
        )

    def batch_means(batch: dict[str, Any]) -> torch.Tensor:
        num_pairs = batch["tokens"].size(0) // 2  # a filler's one pair too (it weighs 0)
        recorded = PreferenceMetrics(device)
        loss = dpo_micro_batch_loss(
            model, loss_fn, batch, reference, terms=terms, metrics=recorded, precision=precision
        )
        sums = recorded.recorded_sums  # None for a filler: no pair recorded
        rewards = (
            sums[_REWARD_SUMS] / num_pairs
            if sums is not None
            else torch.zeros(len(_REWARD_SUMS), dtype=torch.float64, device=loss.main.device)
        )
        return torch.cat([loss.main.detach().double().reshape(1), rewards.to(loss.main.device)])

    sums = loss_sums(
        validation_set,
        batch_means,
        PreferencePairs(IGNORE_INDEX),  # checks every pair has both responses
        models=(model,),
        device=device,
    )
    return PreferenceValidationLoss(
        loss=sums.mean(0),
        num_correct=round(sums.sums[1]) if sums.num_units else 0,
        margin=sums.mean(2),
        chosen_reward=sums.mean(3),
        rejected_reward=sums.mean(4),
        num_pairs=sums.num_units,
        num_samples=validation_set.num_samples,
    )


def kto_validation_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    validation_set: ValidationSet,
    reference: Any,
    *,
    device: torch.device,
    precision: Precision | None = None,
) -> KtoValidationLoss:
    """KTO's loss over every validation example of every rank against the set's reference point;
    see [preference validation]. Two passes over the set (the reference point, then the
    losses), each one host read and, under data parallelism, one all-reduce of two numbers."""
    point = KtoReferencePoint(model, reference, precision)
    units = KtoExamples(IGNORE_INDEX)

    def mismatched_log_ratio(batch: dict[str, Any]) -> torch.Tensor:
        num_examples = batch["tokens"].size(0) // 2  # a filler's one too (it weighs 0)
        return point.contribution(batch).double() / num_examples

    common = {"models": (model,), "device": device}
    log_ratios = loss_sums(validation_set, mismatched_log_ratio, units, **common)
    z = max(0.0, log_ratios.mean(0)) if log_ratios.num_units else 0.0
    point.value = torch.tensor(z, dtype=torch.float64, device=device)

    def example_loss(batch: dict[str, Any]) -> torch.Tensor:
        loss = kto_micro_batch_loss(
            model, loss_fn, batch, reference, reference_point=point, precision=precision
        )
        return loss.main.detach().double().reshape(1)

    losses = loss_sums(validation_set, example_loss, units, **common)
    return KtoValidationLoss(
        loss=losses.mean(0),
        kl=z,
        num_examples=losses.num_units,
        num_samples=validation_set.num_samples,
    )
