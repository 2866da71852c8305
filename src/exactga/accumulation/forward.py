"""The forward of a micro-batch with logits only where a loss scores a label.

The output projection is vocab-size wide: on padded, prompt-masked or packed rows most of its
rows are never scored. Every loss family's forward goes through here. With
``LinearCrossEntropyLoss`` the supervised loss goes further: the decoder's forward returns the
loss itself, the projection computed with it a chunk of rows at a time
(:func:`projecting_into_loss`; see [projection fused with the loss] in
``exactga.accumulation.linear_cross_entropy``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtune.modules import TiedLinear, TransformerDecoder

from exactga.accumulation.linear_cross_entropy import LinearCrossEntropyLoss
from exactga.runtime.precision import Precision

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


def can_fuse_output(model: nn.Module) -> bool:
    """Whether ``model``'s output projection can be computed together with the loss: a torchtune
    decoder returning logits alone, with torchtune's ``unembed`` (final norm, then projection),
    whose output is a plain ``nn.Linear`` without bias or a ``TiedLinear``, with a plain weight
    or one FSDP2 gathers in the forward. See [projection fused with the loss] in
    ``exactga.accumulation.linear_cross_entropy`` for what falls back."""
    if not _can_cut_output(model) or type(model).unembed is not TransformerDecoder.unembed:
        return False  # a subclass's own unembed may do more than norm, then project
    projection = _fusable_projection(model.output)
    return (
        projection is not None
        and "forward" not in vars(projection)  # nobody else's shadow to undo
        and _gathered_in_forward(_output_weight(model.output), model)
    )


@contextlib.contextmanager
def projecting_into_loss(
    model: nn.Module,
    loss_fn: LinearCrossEntropyLoss,
    labels: torch.Tensor,
    positions: torch.Tensor | None,
) -> Iterator[None]:
    """Within it, ``model``'s forward returns ``loss_fn``'s mean loss of the shifted ``labels``
    (``(B, L)``), computed from the final-normed hidden states and the output weight a chunk of
    rows at a time; with ``positions`` (flat indices of the scored positions), only those rows.

    Only for a model :func:`can_fuse_output` accepts. See [projection fused with the loss] in
    ``exactga.accumulation.linear_cross_entropy`` and [logits only at loss positions]. The
    decoder's ``unembed`` and its projection's ``forward`` are shadowed on the instances for one
    forward and restored; the projection is still called as the decoder calls it, so its hooks
    (FSDP's gather of the weight) run around the loss.
    """
    targets = labels.reshape(-1)
    if positions is not None:
        targets = targets.index_select(0, positions)
    output = model.output
    projection = _fusable_projection(output)

    def unembed_into_loss(hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.size(-1))
        if positions is not None:
            rows = rows.index_select(0, positions)  # cut before the norm: it works row by row
        return output(model.norm(rows))  # the loss, from the shadowed forward below

    def loss_instead_of_logits(rows: torch.Tensor, weight: torch.Tensor | None = None) -> Any:
        # nn.Linear.forward(x) reads its own weight, gathered by now; TiedLinear's inner
        # Linear.forward(x, weight) is handed the embedding's.
        weight = projection.weight if weight is None else weight
        return loss_fn.from_hidden(rows, weight, targets)

    model.unembed = unembed_into_loss
    projection.forward = loss_instead_of_logits
    try:
        yield
    finally:
        del model.unembed, projection.forward  # the classes' methods again


def token_log_probs(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    positions: torch.Tensor,
    targets: torch.Tensor,
    precision: Precision | None = None,
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log p(target)`` at each of ``positions`` (flat indices into the ``(B, L)`` batch after
    the shift), in fp32 at least: the per-token log-probs of the preference and policy losses
    (``exactga.dpo.log_probs.sequence_log_probs`` sums them per row). The projection runs only at
    ``positions`` where the model allows it; see [logits only at loss positions]. PPO scores
    tokens under the sampling distribution, the logits over ``temperature`` (stock's
    ``rlhf.logits_to_logprobs``); 1 leaves them as they are."""
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
    if temperature != 1.0:
        logits = logits / temperature
    return -F.cross_entropy(logits, targets, reduction="none")


def _fusable_projection(output: Any) -> nn.Module | None:
    """The module whose ``forward`` does ``output``'s matmul, if it is a plain one: an
    ``nn.Linear`` without bias (FSDP2's subclass of it too), or a ``TiedLinear``'s inner
    ``Linear``. ``None`` for anything else (LoRA, DoRA, NF4, fake-quantised, biased, ...)."""
    if type(output) is TiedLinear:
        return output.linear
    if _class_under_fsdp(output) is nn.Linear and output.bias is None:
        return output
    return None


def _class_under_fsdp(module: Any) -> type:
    """``module``'s class, or for a module FSDP2 sharded, the class FSDP2 subclassed."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def _output_weight(output: Any) -> torch.Tensor:
    return output.tied_module.weight if type(output) is TiedLinear else output.weight


def _gathered_in_forward(weight: torch.Tensor, model: nn.Module) -> bool:
    """A weight the fused loss can multiply: a plain tensor, or FSDP2's shard of one on a single
    data-parallel mesh dimension (gathered whole in the forward). A tensor-parallel weight stays
    distributed in the forward, and a quantised one (NF4) is no plain matrix."""
    if isinstance(weight, DTensor):
        return (
            isinstance(model, FSDPModule)
            and weight.device_mesh.ndim == 1
            and _is_plain(weight.to_local())
        )
    return _is_plain(weight)


def _is_plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, nn.Parameter)


def _can_cut_output(model: nn.Module) -> bool:
    """A torchtune decoder returning logits alone, whose ``unembed`` is its class's."""
    return (
        isinstance(model, TransformerDecoder)
        and not model.output_hidden_states
        and "unembed" not in vars(model)
    )
