"""One optimizer step over an accumulation window, shared by every recipe and the parity report.

The recipes keep their own loop skeleton (epochs, logging, checkpoints); what happens inside a
step, where a silent divergence would change the numbers, lives here once: the skipped-window
rule, the loss step with its label shift, scaling before backward, and the optimizer step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torchtune import utils
from torchtune.modules import TransformerDecoder
from torchtune.training.lr_schedulers import get_lr

from exactga.distributed import memory_stats
from exactga.loss_units import LOSS_POSITIONS, shift_labels
from exactga.normalization import Window, warn_skipped_step
from exactga.optimizers import steps_in_backward
from exactga.options import NonFinitePolicy
from exactga.precision import Precision
from exactga.profiling import TrainingProfiler
from exactga.progress import TrainingProgress

T = TypeVar("T")
LossStep = Callable[[dict[str, torch.Tensor]], torch.Tensor]
MicroBatchContext = Callable[[bool], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class StepOutcome:
    """What one window did: skipped (no loss token anywhere, or a non-finite loss), and the
    grad norm if clipped. ``nonfinite`` says a micro-batch loss on some rank was NaN or inf."""

    skipped: bool
    grad_norm: torch.Tensor | None = None
    nonfinite: bool = False


class NonFiniteLossError(RuntimeError):
    """Training stopped on a non-finite loss (``nonfinite_loss: stop``)."""


# Note [non-finite loss]
# Each micro-batch's loss is tested with ``isfinite`` on the device and the flags are and-ed
# there, so no micro-batch waits for the host. Once per step, before the optimizer runs, the flag
# is reduced over the data-parallel group (one 1-byte all-reduce; every rank must take the same
# decision or their weights would part) and read on the host: one sync per step, where the
# optimizer step would have to wait for backward anyway. A non-finite step never reaches the
# optimizer: its gradients are dropped, so the weights stay finite. With ``clip_grad_norm``
# set, a non-finite gradient norm (a finite loss whose backward overflowed) counts as well; it
# is read in the same host read (without clipping there is no norm to test short of a pass over
# the gradients, which is what we avoid). ``skip`` warns, counts it in ``nonfinite_steps`` and
# goes on with the next window; ``stop`` saves a step checkpoint of the
# weights before that step (its data-loader position is after the bad window, so resuming goes
# on with the next one) and raises. With ``optimizer_in_bwd`` the optimizer has already stepped
# inside backward, so the run always stops, pointing to the last step checkpoint (see
# [optimizer in backward] in exactga.optimizers).


def handle_nonfinite_loss(
    policy: NonFinitePolicy,
    step: int,
    *,
    weights_updated: bool,
    save_checkpoint: Callable[[], Path],
) -> None:
    """Apply ``policy`` to optimizer step ``step``, whose loss was not finite on some rank.

    Every rank calls this (``save_checkpoint`` is collective under data parallelism).

    Raises:
        NonFiniteLossError: under ``stop``, or whenever the weights were already updated.
    """
    if weights_updated:
        raise NonFiniteLossError(
            f"non-finite loss at step {step}; with optimizer_in_bwd the weights were already "
            "updated, so the run stops without saving. Resume from the last step checkpoint "
            "(resume_from_checkpoint=True), e.g. with a lower learning rate."
        )
    if policy is NonFinitePolicy.SKIP:
        warnings.warn(
            f"non-finite loss at step {step}: the step is skipped (nonfinite_loss: skip); "
            "the weights are unchanged.",
            stacklevel=2,
        )
        return
    path = save_checkpoint()
    raise NonFiniteLossError(
        f"non-finite loss at step {step} (nonfinite_loss: stop). The weights before it are "
        f"saved in {path}; resume_from_checkpoint=True goes on with the next window."
    )


# Note [logits only at loss positions]
# The output projection and the cross-entropy are worth computing only where a label is scored:
# a padded or prompt position (label ignored) costs a row of logits, vocab-size wide, for a loss
# term of exactly 0. So the decoder's last hidden state is cut to the scored positions before the
# final norm and the projection, and the labels are cut to match: the same loss terms, summed
# over the same tokens and divided by the same count, so the loss and every gradient are those of
# the full projection up to float rounding (the projection's rows are independent). It saves
# the projection's work, forward and backward, and the logits' memory on every unscored
# position: on instruction data that is the padding plus the prompts. The positions are indexed
# on the host when the window is counted (``LOSS_POSITIONS``), so cutting on the device waits
# for nothing. Models that are not a torchtune ``TransformerDecoder``, or that return hidden
# states, and batches without the index take the full projection.


def causal_lm_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: dict[str, torch.Tensor],
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
    precision: Precision | None = None,
) -> torch.Tensor:
    """Forward and mean loss of one micro-batch already on the device.

    See [shifted token count] in ``exactga.loss_units``: the count that weights this loss
    was taken on exactly these shifted labels. ``precision`` runs the forward under its
    autocast (bf16 compute over fp32 master weights; see [fp32 master weights] in
    ``exactga.precision``), the loss outside it. Logits are computed only at the positions
    the loss scores when the batch carries their index; see [logits only at loss positions].
    """
    labels = batch.pop("labels")
    positions = batch.pop(LOSS_POSITIONS, None)
    autocast = precision.autocast() if precision is not None else contextlib.nullcontext()
    activations = activations_ctx or contextlib.nullcontext()
    with activations, autocast, projecting_only(model, positions) as cut:
        logits = model(**batch)
    labels = shift_labels(labels, loss_fn.ignore_index)
    if cut:
        labels = labels.reshape(-1).index_select(0, positions).unsqueeze(0)
    if not isinstance(logits, list):  # chunked losses take the list as it is
        labels = labels.reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
    loss = loss_fn(logits, labels)
    del logits  # frees the largest activation before backward
    return loss


@contextlib.contextmanager
def projecting_only(model: nn.Module, positions: torch.Tensor | None) -> Iterator[bool]:
    """Within it, ``model``'s output projection sees only the hidden states at ``positions``
    (flat indices over batch and sequence), as one row; yields whether it does.

    See [logits only at loss positions]. The decoder's ``unembed`` (final norm, then the
    projection, chunked or not) is shadowed on the instance for one forward and restored.
    """
    if positions is None or not _can_cut_output(model):
        yield False
        return
    unembed = model.unembed

    def unembed_at_positions(hidden: torch.Tensor) -> Any:
        flat = hidden.reshape(-1, hidden.size(-1))
        return unembed(flat.index_select(0, positions).unsqueeze(0))

    model.unembed = unembed_at_positions
    try:
        yield True
    finally:
        del model.unembed  # the class's method again


def token_log_probs(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    positions: torch.Tensor,
    targets: torch.Tensor,
    precision: Precision | None = None,
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
) -> torch.Tensor:
    """``log p(target)`` at each of ``positions`` (flat indices into the ``(B, L)`` batch after
    the shift), in fp32 at least: the per-token log-probs of the preference and policy losses
    (``exactga.preference.sequence_log_probs`` sums them per row). The projection runs only at
    ``positions`` where the model allows it; see [logits only at loss positions]."""
    autocast = precision.autocast() if precision is not None else contextlib.nullcontext()
    activations = activations_ctx or contextlib.nullcontext()
    with activations, autocast, projecting_only(model, positions) as cut:
        logits = model(**inputs)
    if isinstance(logits, list):  # a chunked output, chunked along the sequence
        logits = torch.cat(logits, dim=1)
    logits = logits.reshape(-1, logits.size(-1))
    if not cut:
        logits = logits.index_select(0, positions)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return -F.cross_entropy(logits, targets, reduction="none")


def _can_cut_output(model: nn.Module) -> bool:
    """A torchtune decoder returning logits alone, whose ``unembed`` is its class's."""
    return (
        isinstance(model, TransformerDecoder)
        and not model.output_hidden_states
        and "unembed" not in vars(model)
    )


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
        optimizer: the recipe's optimizer. An ``OptimizerInBackward`` (``optimizer_in_bwd``)
            has stepped inside backward, so nothing touches the gradients after it; ``None``
            leaves them to the caller. See [optimizer in backward] in ``exactga.optimizers``.
        profiler: the recipe's profiler hook (phases, the saved-latency sample).
        device: where micro-batches go.
        step: the number of this optimizer step, for the skipped-window warning.
        clip_grad_norm: max gradient norm, or ``None`` for no clipping.
        micro_batch_context: called with "is this the window's last micro-batch" around each
            micro-batch's forward and backward (the distributed recipes' gradient-sync policy).
        announce_skip: warn about a skipped window here (rank 0 only, under data parallelism).
    """
    if window.should_skip_step():  # the same answer on every rank; see [empty windows]
        if announce_skip:
            warn_skipped_step(step)
        return StepOutcome(skipped=True)
    # On several ranks this includes empty micro-batches; see [empty micro-batches under FSDP].
    finite = None
    for micro_batch, is_last in _with_last_flag(window.micro_batches_to_run()):
        with micro_batch_context(is_last) if micro_batch_context else contextlib.nullcontext():
            with profiler.phase("forward"):
                utils.batch_to_device(micro_batch.batch, device)
                loss = loss_step(micro_batch.batch)
                finite = _and_finite(finite, loss)
            with profiler.phase("backward"):
                # See [loss scaled before backward]: no gradient pass follows.
                window.scale(loss, micro_batch).backward()
    if optimizer is None or steps_in_backward(optimizer):  # see [non-finite loss]
        if optimizer is not None:
            optimizer.step()  # a no-op that tells a learning-rate scheduler the step happened
        return StepOutcome(skipped=False, nonfinite=not _all_finite(finite, None, window))
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
        if not _all_finite(finite, grad_norm, window):  # see [non-finite loss]
            optimizer.zero_grad(set_to_none=True)
            return StepOutcome(skipped=True, nonfinite=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepOutcome(skipped=False, grad_norm=grad_norm)


def _with_last_flag(items: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """Each item with "is it the last one", looking one item ahead (so a lazy iterator is read
    no earlier than needed)."""
    current = next(items, _NONE)
    while current is not _NONE:
        following = next(items, _NONE)
        yield current, following is _NONE  # type: ignore[misc]
        current = following


_NONE: Any = object()


def _and_finite(finite: torch.Tensor | None, loss: torch.Tensor) -> torch.Tensor:
    """``finite and isfinite(loss)``, on the device: no host sync per micro-batch."""
    loss_finite = torch.isfinite(loss.detach()).all()
    return loss_finite if finite is None else finite & loss_finite


def _all_finite(
    finite: torch.Tensor | None, grad_norm: torch.Tensor | None, window: Window
) -> bool:
    """Whether every rank's losses, and the gradient norm if clipping computed one, were
    finite: the step's one flag reduction and one host read."""
    if finite is None:
        return True
    if grad_norm is not None:  # already global under FSDP, so and-ing it in is enough
        finite = finite & torch.isfinite(grad_norm).to(finite.device)
    if window.dp_size > 1:
        flag = finite.to(torch.uint8)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=window.dp_group)
        return bool(flag.item())
    return bool(finite.item())


def step_metrics(
    window: Window,
    *,
    optimizer: Any,
    grad_norm: torch.Tensor | None,
    progress: TrainingProgress,
    tokens_per_second_per_gpu: float,
    memory_device: torch.device | None = None,
) -> dict[str, float]:
    """The scalars every recipe logs on a logged step: stock torchtune's names and ours.

    ``loss`` is the exact window loss over every data-parallel rank (one all-reduce of one
    number, so every rank calls this); a skipped window logs no loss rather than a NaN one.
    These are the only host read-backs of the step. ``memory_device`` adds peak-memory
    statistics (``log_peak_memory_stats``; nothing on CPU). The window's loss units over every
    rank are logged under their name (``loss_tokens``; ``pairs`` for a preference loss).
    """
    metrics = {
        "lr": get_lr(optimizer),
        "tokens_per_second_per_gpu": tokens_per_second_per_gpu,
        window.units_name: float(window.num_global_units),
        **progress.metrics(),
    }
    if not window.should_skip_step():
        metrics["loss"] = window.global_mean_loss()
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    if memory_device is not None:
        metrics.update(memory_stats(memory_device))
    return metrics
