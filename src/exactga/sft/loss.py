"""The supervised fine-tuning loss of one micro-batch: forward, label shift, mean token loss."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from exactga.accumulation.forward import can_fuse_output, projecting_into_loss, projecting_only
from exactga.accumulation.linear_cross_entropy import fusable_loss
from exactga.accumulation.loss_units import LOSS_POSITIONS, pop_scored_labels
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.runtime.precision import Precision
from exactga.sft.router_balance import RouterBalance


def causal_lm_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: dict[str, torch.Tensor],
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
    precision: Precision | None = None,
    router: RouterBalance | None = None,
) -> MicroBatchLoss:
    """Forward and mean loss of one micro-batch already on the device, as the
    :class:`MicroBatchLoss` that ``window.backward`` weighs (see [one return type for every
    loss step] in exactga.accumulation.micro_batch_loss).

    See [shifted token count] in ``exactga.accumulation.loss_units``: the count that weights this
    loss was taken on exactly these shifted labels. ``precision`` runs the forward under its
    autocast (bf16 compute over fp32 master weights; see [fp32 master weights] in
    ``exactga.runtime.precision``), the loss outside it. Logits are computed only at the positions
    the loss scores when the batch carries their index; see [logits only at loss positions].
    With a ``LinearCrossEntropyLoss`` on a decoder whose projection it can fuse, the logits are
    never made: the forward returns the loss; see [projection fused with the loss]. With a
    ``router`` that is on, the token loss and the router's balance term, as the two term means
    its units declare; see [router balance as a loss term] in exactga.sft.router_balance.
    """
    if router is not None and router.on:
        with router.recording(model, batch["labels"]):
            token_loss = mean_token_loss(model, loss_fn, batch, activations_ctx, precision)
        return router.with_term(token_loss)
    return MicroBatchLoss(mean_token_loss(model, loss_fn, batch, activations_ctx, precision))


def mean_token_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: dict[str, torch.Tensor],
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
    precision: Precision | None = None,
) -> torch.Tensor:
    """:func:`causal_lm_loss`'s token loss, the mean over the micro-batch's loss tokens, as a
    0-d tensor."""
    positions = batch.pop(LOSS_POSITIONS, None)
    autocast = precision.autocast() if precision is not None else contextlib.nullcontext()
    activations = activations_ctx or contextlib.nullcontext()
    fused = fusable_loss(loss_fn)
    if fused is not None and can_fuse_output(model):
        labels = pop_scored_labels(batch, fused.ignore_index)
        # Inside the forward: under FSDP2 the output weight is gathered only there.
        with activations, autocast, projecting_into_loss(model, fused, labels, positions):
            return model(**batch)
    labels = pop_scored_labels(batch, loss_fn.ignore_index)
    with activations, autocast, projecting_only(model, positions) as cut:
        logits = model(**batch)
    if cut:
        labels = labels.reshape(-1).index_select(0, positions).unsqueeze(0)
    if not isinstance(logits, list):  # chunked losses take the list as it is
        labels = labels.reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
    loss = loss_fn(logits, labels)
    del logits  # frees the largest activation before backward
    return loss
