"""One optimizer step over an accumulation window, shared by every recipe and the parity report.

The recipes keep their own loop skeleton (epochs, logging, checkpoints); what happens inside a
step, where a silent divergence would change the numbers, lives here once: the skipped-window
rule, the loss step with its label shift, scaling before backward, and the optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torchtune import utils

from exactga.normalization import Window, shift_labels, warn_skipped_step
from exactga.profiling import TrainingProfiler

LossStep = Callable[[dict[str, torch.Tensor]], torch.Tensor]
MicroBatchContext = Callable[[bool], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class StepOutcome:
    """What one window did: skipped (no loss token anywhere), and the grad norm if clipped."""

    skipped: bool
    grad_norm: torch.Tensor | None = None


def causal_lm_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: dict[str, torch.Tensor],
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
) -> torch.Tensor:
    """Forward and mean loss of one micro-batch already on the device.

    See [shifted token count] in ``exactga.normalization``: the count that weights this loss
    was taken on exactly these shifted labels.
    """
    labels = batch.pop("labels")
    with activations_ctx or contextlib.nullcontext():
        logits = model(**batch)
    labels = shift_labels(labels, loss_fn.ignore_index)
    if not isinstance(logits, list):  # chunked losses take the list as it is
        labels = labels.reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
    loss = loss_fn(logits, labels)
    del logits  # frees the largest activation before backward
    return loss


def train_window(
    window: Window,
    *,
    model: nn.Module,
    loss_step: LossStep,
    optimizer: Optimizer | None,
    profiler: TrainingProfiler,
    device: torch.device,
    step: int,
    clip_grad_norm: float | None = None,
    micro_batch_context: MicroBatchContext | None = None,
    announce_skip: bool = True,
) -> StepOutcome:
    """Accumulate ``window`` into the gradients and step ``optimizer``.

    Args:
        window: the step's micro-batches, from ``LossNormalizer.windows``.
        model: the model whose gradients accumulate.
        loss_step: forward and mean loss of one micro-batch on the device.
        optimizer: ``None`` when the optimizer runs inside backward (``optimizer_in_bwd``).
        profiler: the recipe's profiler hook (phases, the saved-latency sample).
        device: where micro-batches go.
        step: the number of this optimizer step, for the skipped-window warning.
        clip_grad_norm: max gradient norm, or ``None`` for no clipping.
        micro_batch_context: called with "is this the window's last micro-batch" around each
            micro-batch's forward and backward (the distributed recipes' gradient-sync policy).
        announce_skip: warn about a skipped window here (rank 0 only, under data parallelism).
    """
    if window.skip_step():  # the same answer on every rank; see [empty windows]
        if announce_skip:
            warn_skipped_step(step)
        return StepOutcome(skipped=True)
    # On several ranks this includes empty micro-batches; see [empty micro-batches under FSDP].
    micro_batches = list(window.micro_batches_to_run())
    for index, micro_batch in enumerate(micro_batches):
        is_last = index == len(micro_batches) - 1
        with micro_batch_context(is_last) if micro_batch_context else contextlib.nullcontext():
            with profiler.phase("forward"):
                utils.batch_to_device(micro_batch.batch, device)
                loss = loss_step(micro_batch.batch)
            with profiler.phase("backward"):
                # See [loss scaled before backward]: no gradient pass follows.
                window.scale(loss, micro_batch).backward()
    if optimizer is None:
        return StepOutcome(skipped=False)
    profiler.sample_gradient_pass(model)  # measures only; see [saved latency]
    with profiler.phase("optimizer"):
        window.finish_gradients(model)
        grad_norm = None
        if clip_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_norm=float(clip_grad_norm)
            )
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
                grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepOutcome(skipped=False, grad_norm=grad_norm)
