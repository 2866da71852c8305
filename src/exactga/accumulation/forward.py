"""The forward of a micro-batch with logits only where a loss scores a label.

The output projection is vocab-size wide: on padded, prompt-masked or packed rows most of its
rows are never scored. Every loss family's forward goes through here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import TransformerDecoder

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
    (``exactga.dpo.preference.sequence_log_probs`` sums them per row). The projection runs only at
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
