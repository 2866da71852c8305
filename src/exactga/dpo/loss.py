"""The DPO loss of one micro-batch: the mean over its pairs (and a further term over the chosen
tokens with an NLL term), for ``window.backward``. See [pairs as loss units] in
exactga.dpo.preference.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from exactga.accumulation.loss_units import LOSS_POSITIONS, Batch, loss_positions, shift_labels
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.config.options import SequenceLogProb
from exactga.dpo.kto import kto_micro_batch_loss
from exactga.dpo.log_probs import Reference, sequence_log_probs
from exactga.dpo.metrics import PreferenceMetrics
from exactga.dpo.preference import EMPTY, PairsAndChosenTokens, response_lengths, split_pairs
from exactga.dpo.reference_logprobs import PAIR_INDEX, ReferenceTable
from exactga.dpo.terms import DPO, DpoTerms
from exactga.runtime.precision import Precision


def dpo_micro_batch_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: Batch,
    reference: Reference | ReferenceTable | None,
    *,
    terms: DpoTerms | None = None,
    metrics: PreferenceMetrics | None = None,
    precision: Precision | None = None,
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
    reference_point: Any = None,
) -> MicroBatchLoss:
    """The mean loss over the pairs of one micro-batch already on the device, for
    ``window.backward`` (which weighs it by its pairs); see [pairs as loss units]. With an NLL
    term (``terms.rpo_alpha``) a further term, ``rpo_alpha * mean NLL over the chosen tokens``
    (``chosen_tokens``), which ``window.backward`` weighs by the chosen tokens (units from
    ``terms.units()``); see [chosen tokens as the NLL's units].

    ``loss_fn`` is torchtune's ``DPOLoss`` or ``RSOLoss``, or one of exactga.dpo.losses (any
    loss with their signature that returns one loss per pair). The reference runs first, so its
    activations are gone before the policy's are made; a ``ReferenceTable``
    (``precompute_reference_logprobs``) is looked up by the batch's pair indices instead. A
    reference-free loss (``terms.reference_free``: SimPO, ORPO) takes the policy's log-probs
    alone and ``reference`` is None: nothing runs for it. ``metrics`` records the pairs'
    rewards and log-probs (and the terms, with an NLL term). An unpaired loss (KTO,
    ``terms.unpaired``) trains the micro-batch's examples against ``reference_point``, the
    window's (exactga.dpo.kto.kto_micro_batch_loss).
    """
    terms = DPO if terms is None else terms
    if terms.unpaired:
        return kto_micro_batch_loss(
            model,
            loss_fn,
            batch,
            reference,
            reference_point=reference_point,
            precision=precision,
            activations_ctx=activations_ctx,
        )
    labels = batch.pop("labels")
    positions = batch.pop(LOSS_POSITIONS, None)
    is_empty = batch.pop(EMPTY, None) is not None
    pair_index = batch.pop(PAIR_INDEX, None)
    if positions is None:  # a batch that did not come through the normaliser
        positions = loss_positions(labels)
    targets = shift_labels(labels).reshape(-1).index_select(0, positions)
    if terms.reference_free:  # no reference log-probs at all; see exactga.dpo.losses
        reference_chosen = reference_rejected = None
    elif reference is None:
        raise ValueError(f"{type(loss_fn).__name__} compares against a reference; none given")
    elif isinstance(reference, ReferenceTable):
        if pair_index is None:
            raise ValueError("a precomputed reference needs the pairs' indices (IndexedPairs)")
        reference_chosen, reference_rejected = reference.lookup(pair_index)
    else:
        reference_chosen, reference_rejected = reference(batch, positions, targets)
    policy = sequence_log_probs(model, batch, positions, targets, precision, activations_ctx)
    chosen, rejected = split_pairs(policy)
    if terms.sequence_log_prob is SequenceLogProb.MEAN:
        # See [length-normalised log-probs are per pair].
        lengths = response_lengths({**batch, "labels": labels}).to(policy.dtype)
        chosen_lengths, rejected_lengths = split_pairs(lengths)
        chosen, rejected = chosen / chosen_lengths, rejected / rejected_lengths
        if not terms.reference_free:
            reference_chosen = reference_chosen / chosen_lengths
            reference_rejected = reference_rejected / rejected_lengths
    if terms.reference_free:
        losses, chosen_rewards, rejected_rewards = loss_fn(chosen, rejected)
    else:
        losses, chosen_rewards, rejected_rewards = loss_fn(
            chosen, rejected, reference_chosen, reference_rejected
        )
    if losses.shape != chosen.shape:
        raise ValueError(
            f"loss {type(loss_fn).__name__} returned losses of shape {tuple(losses.shape)} for "
            f"{chosen.numel()} pairs; exactga averages one loss per pair itself, so the loss "
            "must not reduce them (see [pairs as loss units] in exactga.dpo.preference)."
        )
    if metrics is not None and not is_empty:
        metrics.record(chosen_rewards, rejected_rewards, chosen, rejected)
    if not terms.has_nll:
        return MicroBatchLoss(losses.mean())
    # See [chosen tokens as the NLL's units]: the chosen rows' sums, before any length mean.
    chosen_nll_sum = -split_pairs(policy)[0].sum()
    num_chosen_tokens = split_pairs(response_lengths({**batch, "labels": labels}))[0].sum()
    if metrics is not None and not is_empty:
        metrics.record_terms(losses, chosen_nll_sum)
    nll = terms.rpo_alpha * (chosen_nll_sum / num_chosen_tokens)
    return MicroBatchLoss(losses.mean(), {PairsAndChosenTokens.term_names[0]: nll})
