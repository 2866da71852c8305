"""The supervised fine-tuning figure of validation during training: the loss of the whole
validation set as one batch, and its perplexity.

A fine-tuning recipe with ``dataset_val`` calls :func:`validation_loss` every
``run_val_every_n_steps`` optimizer steps and at the end of each epoch, and logs what it returns
(``val/loss``, ``val/perplexity``, one console line). The set, the sums over every rank and the
schedule are exactga.validation.held_out's; see [validation loss as one batch] there and
docs/validation.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from exactga.accumulation.loss_units import ShiftedTokens
from exactga.runtime.precision import Precision
from exactga.sft.loss import mean_token_loss
from exactga.validation.held_out import ValidationSet, loss_sums


@dataclass(frozen=True)
class ValidationLoss:
    """What one validation measured: the set's loss as one batch and what it was over."""

    loss: float  # token-loss sum over the scored tokens of every rank / their number
    num_tokens: int  # scored tokens (after the shift) of every rank
    num_samples: int  # validation samples read, every rank's

    @property
    def perplexity(self) -> float:
        """``exp(loss)``; ``inf`` where it overflows a float."""
        try:
            return math.exp(self.loss)
        except OverflowError:
            return math.inf

    def metrics(self) -> dict[str, float]:
        """The logged scalars, on the training loss's step axis; none without a scored token."""
        if not self.num_tokens:
            return {}
        return {"val/loss": self.loss, "val/perplexity": self.perplexity}

    def line(self, step: int) -> str:
        """The console line: ``Validation at step 12: loss 2.3456 (perplexity 10.44) over
        1,234 tokens of 64 samples``."""
        if self.num_tokens == 0:
            return (
                f"Validation at step {step}: no scored token in {self.num_samples:,} samples "
                "(every label is masked); no loss"
            )
        return (
            f"Validation at step {step}: loss {self.loss:.4f} (perplexity "
            f"{self.perplexity:.2f}) over {self.num_tokens:,} tokens of {self.num_samples:,} "
            "samples"
        )


def validation_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    validation_set: ValidationSet,
    *,
    device: torch.device,
    precision: Precision | None = None,
) -> ValidationLoss:
    """The loss of the whole validation set as one batch, over every data-parallel rank.

    See [validation loss as one batch]: every scored token (after the shift) of every sample of
    ``validation_set`` on every rank, its loss under ``loss_fn`` (with ``precision``'s autocast,
    as in training), summed and divided by their number; the same to fp32 rounding whatever the
    batch size, the number of ranks or the split. Without gradients, in eval mode, with the RNG
    states restored after it (see [validation set order]); every rank of the set's
    ``dp_group`` calls it. One host read, and under data parallelism one all-reduce of two
    numbers, per call.
    """
    sums = loss_sums(
        validation_set,
        lambda batch: mean_token_loss(model, loss_fn, batch, precision=precision).reshape(1),
        ShiftedTokens(loss_fn),  # also checks the loss's own denominator on the first batch
        models=(model,),
        device=device,
    )
    return ValidationLoss(
        loss=sums.mean(0), num_tokens=sums.num_units, num_samples=validation_set.num_samples
    )
