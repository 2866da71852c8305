"""Validation of a distillation run: the student's class loss, the KD loss and their mix, each
the validation set's figure as one batch.

The KD recipes with ``dataset_val`` call :func:`distillation_validation_loss` where the
fine-tuning recipes call ``exactga.sft.validation.validation_loss``: the same set, read the same
way (``ValidationSet``, [validation set order] in exactga.validation.held_out), the same sums over
every scored token after the shift on every rank (``loss_sums``), for both losses of
[two token-normalised losses] in exactga.kd.distillation. See [distillation validation].

Note [distillation validation]
``val/class_loss`` is the student's cross-entropy summed over every scored token of the set on
every rank, over their number: the SFT figure of the student. ``val/kd_loss`` is the KD loss
over the same tokens and the same count, the teacher frozen (under no_grad, in eval mode), and
``val/loss = (1 - kd_ratio) val/class_loss + kd_ratio val/kd_loss``: the loss training
minimises, of the set as one batch. Each batch runs both models once (``Distiller.part_losses``,
training's own forward: the same cut to the scored positions, the same chunked losses, the
teacher's logits cut to the student's vocabulary), gives both means, and each mean times the
batch's host count is its sum; the two sums and the count are all-reduced once. So none of the
three moves with ``batch_size_val`` or the number of ranks beyond fp32 rounding inside a batch's
mean. ``val/perplexity`` is ``exp(val/class_loss)``: the student's perplexity on the set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from exactga.accumulation.loss_units import ShiftedTokens
from exactga.kd.distillation import Distiller
from exactga.validation.held_out import ValidationSet, loss_sums


@dataclass(frozen=True)
class DistillationValidationLoss:
    """What one distillation validation measured; see [distillation validation]."""

    class_loss: float  # the student's cross-entropy over every scored token / their number
    kd_loss: float  # the KD loss over the same tokens / the same number
    kd_ratio: float
    num_tokens: int  # scored tokens (after the shift) of every rank
    num_samples: int  # validation samples read, every rank's

    @property
    def loss(self) -> float:
        """The mix training minimises: ``(1 - kd_ratio) class_loss + kd_ratio kd_loss``."""
        return (1.0 - self.kd_ratio) * self.class_loss + self.kd_ratio * self.kd_loss

    @property
    def perplexity(self) -> float:
        """The student's: ``exp(class_loss)``; ``inf`` where it overflows a float."""
        try:
            return math.exp(self.class_loss)
        except OverflowError:
            return math.inf

    def metrics(self) -> dict[str, float]:
        """The logged scalars, on the training loss's step axis; none without a scored token."""
        if not self.num_tokens:
            return {}
        return {
            "val/loss": self.loss,
            "val/class_loss": self.class_loss,
            "val/kd_loss": self.kd_loss,
            "val/perplexity": self.perplexity,
        }

    def line(self, step: int) -> str:
        """The console line: ``Validation at step 12: loss 2.3456 (class loss 2.1000,
        perplexity 8.17; KD loss 2.5912) over 1,234 tokens of 64 samples``."""
        if self.num_tokens == 0:
            return (
                f"Validation at step {step}: no scored token in {self.num_samples:,} samples "
                "(every label is masked); no loss"
            )
        return (
            f"Validation at step {step}: loss {self.loss:.4f} (class loss {self.class_loss:.4f}, "
            f"perplexity {self.perplexity:.2f}; KD loss {self.kd_loss:.4f}) over "
            f"{self.num_tokens:,} tokens of {self.num_samples:,} samples"
        )


def distillation_validation_loss(
    distiller: Distiller,
    validation_set: ValidationSet,
) -> DistillationValidationLoss:
    """The student's class loss, the KD loss and their mix on the whole validation set as one
    batch, over every data-parallel rank; see [distillation validation]. Both models in eval
    mode, no gradient, the RNG states restored after; every rank of the set's ``dp_group``
    calls it. One host read, and under data parallelism one all-reduce of three numbers, per
    call."""
    sums = loss_sums(
        validation_set,
        lambda batch: torch.stack(distiller.part_losses(batch)),
        ShiftedTokens(distiller.loss_fn),  # checks the class loss's denominator, as training
        models=(distiller.student, distiller.teacher),
        device=distiller.device,
    )
    return DistillationValidationLoss(
        class_loss=sums.mean(0),
        kd_loss=sums.mean(1),
        kd_ratio=distiller.kd_ratio,
        num_tokens=sums.num_units,
        num_samples=validation_set.num_samples,
    )
