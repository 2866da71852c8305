"""The oracle's reference: the full-batch loss of one optimizer step, written in plain PyTorch.

It knows nothing of exactga. It pads the whole global batch into one tensor, scores each
position against the next label (the one-position shift), skips ignored labels, sums the
per-token losses over the batch and divides by the number of scored tokens; with a teacher, the
same mean of ``(1 - r) CE + r KD``. Run it in fp64 and its gradient gives the step
``w - lr * g`` of SGD without momentum, which the weights a real step trains compare with.

Used by tests/test_oracle.py (the library's step path, in-process) and
tests/test_oracle_recipes.py (each recipe through ``tune run``). The preference and RL losses'
tests follow the same pattern: their loss over the whole global batch, written here, as a mean
over the units it is a mean over (pairs, completions, completion tokens).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn
from unit_utils import collate

from exactga.accumulation.loss_units import IGNORE_INDEX

Rows = list[tuple[torch.Tensor, torch.Tensor]]  # (tokens, labels) of each sample, unpadded


def all_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    output = model(tokens)
    return torch.cat(output, dim=1) if isinstance(output, list) else output


def scored(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position t predicts label t + 1: the logits and targets of the positions the loss
    scores, flattened over the batch."""
    logits, targets = logits[:, :-1], labels[:, 1:]
    keep = targets != IGNORE_INDEX
    return logits[keep], targets[keep]


def reference_loss(
    model: nn.Module, rows: Rows, teacher: nn.Module | None = None, kd_ratio: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy over every scored token of ``rows``; with a ``teacher``, mixed with the
    forward KL to it, ``(1 - kd_ratio) CE + kd_ratio KD``, both means over the same tokens."""
    batch = collate(rows)  # right-padded, padded labels ignored
    tokens, labels = batch["tokens"], batch["labels"]
    logits, targets = scored(all_logits(model, tokens), labels)
    log_probs = torch.log_softmax(logits, dim=-1)
    token_ce = -log_probs.gather(1, targets[:, None]).squeeze(1)
    if teacher is None:
        return token_ce.sum() / len(targets)
    with torch.no_grad():
        teacher_logits, _ = scored(all_logits(teacher, tokens), labels)
    vocab_size = logits.size(-1)  # a teacher with a larger padded vocabulary is cut to ours
    teacher_probs = torch.softmax(teacher_logits[:, :vocab_size], dim=-1)
    # The student's cross-entropy against the teacher's distribution: KL up to the teacher's
    # entropy, a constant, so the same gradient as the forward KL.
    token_kd = -(teacher_probs * log_probs).sum(dim=-1)
    return ((1 - kd_ratio) * token_ce + kd_ratio * token_kd).sum() / len(targets)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def reference_gradient(
    model: nn.Module, rows: Rows, teacher: nn.Module | None = None, kd_ratio: float = 0.0
) -> torch.Tensor:
    """The gradient of :func:`reference_loss` at ``model``'s weights, in fp64, over its
    trainable parameters in their order; ``model`` itself is left untouched."""
    student = copy.deepcopy(model).double()
    teacher = copy.deepcopy(teacher).double() if teacher is not None else None
    with fp64():
        reference_loss(student, rows, teacher, kd_ratio).backward()
    return flat([p.grad for p in trainable(student)])


@contextlib.contextmanager
def fp64() -> Iterator[None]:
    """Double models computed in double throughout. torchtune's llama computes three steps in
    fp32 whatever the model's dtype (``x.float()`` in RMSNorm, in the rotary embedding, and on
    the logits in ``unembed``), so a double copy of it is not an fp64 reference by itself.
    Within this context ``.float()`` leaves a double tensor as it is (fp32 tensors are
    unaffected)."""
    to_float = torch.Tensor.float

    def keep_double(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    torch.Tensor.float = keep_double
    try:
        yield
    finally:
        torch.Tensor.float = to_float


def lr_for_unit_update(initial: torch.Tensor, gradient: torch.Tensor) -> float:
    """The SGD learning rate that moves the weights by their own norm: the fp32 rounding of the
    trained weights is then 1e-7 of the update, far below what a wrong loss moves."""
    return float(initial.norm() / gradient.norm())


def step_gap(
    trained: torch.Tensor, initial: torch.Tensor, gradient: torch.Tensor, lr: float
) -> float:
    """Relative L2 distance of ``trained`` from the reference step, over that step's update."""
    expected = initial - lr * gradient
    return float((trained - expected).norm() / (expected - initial).norm())
