"""Preference pairs as loss units, and the DPO loss step of one micro-batch.

A preference micro-batch is one tensor of ``2B`` rows: the ``B`` chosen sequences, then their
``B`` rejected ones, right-padded to the longest of all of them (:func:`collate_pairs`, a dict
where torchtune's ``padded_collate_dpo`` gives a tuple). Its loss is a mean over its pairs
(:func:`dpo_loss_step`), so :class:`PreferencePairs` counts pairs for the one normaliser of
``exactga.accumulation.normalization``; the window, its collective and ``Window.scale`` are those
of every other recipe. :class:`PreferenceMetrics` keeps stock's reward and log-prob metrics as exact
window values. See [pairs as loss units]. A loss with a token-level term, RPO's NLL on the chosen
responses (``rpo_alpha``), adds the chosen tokens as units of that term
(:class:`PairsAndChosenTokens`; see [chosen tokens as the NLL's units]); length-normalised
log-probs (``sequence_log_prob: mean``) need none (see [length-normalised log-probs are per
pair]). :class:`DpoTerms` holds both settings for the units, the loss step and the metrics.

Note [pairs as loss units]
torchtune's ``DPOLoss`` and ``RSOLoss`` give one loss per pair, ``l_p``, a function of that pair's
four summed log-probs alone: no batch statistic enters it. So the mean over a micro-batch's
``B_m`` pairs is a mean over units, and scaled by ``dp_size * B_m / P`` before backward (``P``
the window's pairs on every rank) it leaves the gradient of ``sum_p l_p / P``: the full-batch
mean, whatever the split (see [loss units] in exactga.accumulation.loss_units). Stock divides each
micro-batch's mean by ``gradient_accumulation_steps`` instead, which is that only when every
micro-batch holds as many pairs. A pair's summed log-probs do not depend on the micro-batch
either: rows are right-padded and attention is causal, so a sequence's positions never see the
padding after it, however long the longest row is (a chosen row padded to its rejected one
included); only float rounding moves. A pair with no response label after the shift (its
response all prompt, or cut off) would make its log-prob an empty sum of 0: it is bad input,
not a unit, and counting fails naming it.

An emptied micro-batch, another rank's zero-weight filler under FSDP (see [empty micro-batches
under FSDP] in exactga.accumulation.loss_units), keeps one real pair, responses and all, and
carries an ``EMPTY`` marker that :meth:`PreferencePairs.count` reads as 0 pairs. Its loss is an
ordinary finite DPO loss, so the zero factor gives an exactly zero gradient; and because that loss
depends on every layer, backward runs the same FSDP collectives as on the other ranks (masking
its labels would give a loss of log 2 that depends on no weight at all). The metrics skip it.

Log-probs come only from response positions: the decoder's output projection runs only there
(``projecting_only`` of exactga.accumulation.forward, the same ``LOSS_POSITIONS`` index the SFT step
uses; see [logits only at loss positions]); stock projects all ``2B x L`` positions. Each position's
``log p(label)`` is taken in fp32 at least (bf16 logits are upcast) and summed into its row in
fp64. A response's sum reaches hundreds of nats, where fp32's spacing is ~6e-5, and DPO takes
differences of four such sums, so fp32 sums cost more than the rest of the step's rounding put
together: on tests/test_preference.py's data an fp32 step lands 2.3-2.6e-6 from the fp64 oracle
with fp32 sums, 0.5-1.0e-6 with fp64 ones. fp64 on ``2B x L`` numbers costs nothing; the loss
over the ``B`` pairs is then fp64 as well.

Note [chosen tokens as the NLL's units]
RPO (Pang et al. 2024; TRL's ``rpo_alpha``) adds to the DPO loss ``alpha`` times the negative
log-likelihood of the chosen responses, a mean over their tokens (after the one-position shift,
the positions ``sequence_log_probs`` scores), not over pairs. The window loss is then
``(1/P) sum_p l_p + alpha * (1/T) sum_t -log p(t)``, ``T`` the window's chosen tokens on every
rank: two denominators, so the micro-batch returns two term means and each is weighted by its
own units (see [loss terms over their own units] in exactga.accumulation.loss_units). A mean over
pairs of each pair's own token mean would be yet another loss (a short chosen response's tokens
would weigh more); the chosen tokens are the units because that is what TRL's NLL, a cross-entropy
over the chosen rows, averages over. TRL takes that mean per micro-batch and divides it by the
accumulation count, so a token of a micro-batch with few chosen tokens weighs more than one of
a micro-batch with many: wrong whenever micro-batches (or ranks) hold different numbers of
chosen tokens, which regrouping pairs by length (``by_length``, ``token_budget``) makes the
rule. The NLL reuses the chosen rows' summed log-probs the DPO term computed already: no second
forward, and the count on the device is the host's (both count the labels after the shift).
A micro-batch with a pair has a chosen token (:meth:`PreferencePairs.count` checks it), so the
NLL term is never 0/0; an emptied filler's pair is real, its term finite, its weight 0.

Note [length-normalised log-probs are per pair]
With ``sequence_log_prob: mean`` each response's log-prob is the mean over its own response
tokens (as IPO and SimPO take it), for the policy and the reference alike. That mean is a
function of the response alone, so ``l_p`` still depends on its own pair only and the pairs
stay the units: no count is added, and the split cannot change it (tests/test_dpo_token_terms.py
checks it against the full-batch oracle). The lengths are counted on the device from the same
shifted labels as the positions; a precomputed reference's summed log-probs are divided by them
at each step. The metrics ``log_probs/*`` are then these means, what the loss sees.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torchtune.modules.peft import disable_adapter

from exactga.accumulation.forward import token_log_probs
from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    LOSS_POSITIONS,
    Batch,
    loss_positions,
    shift_labels,
)
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.accumulation.normalization import LossNormalizer, Window
from exactga.config.options import SequenceLogProb, as_option
from exactga.data.packing import PACKED_SEQUENCES
from exactga.dpo.losses import is_reference_free
from exactga.dpo.reference_logprobs import PAIR_INDEX, ReferenceTable, with_precomputed_reference
from exactga.runtime.precision import Precision
from exactga.setup.frozen import frozen_forward

if TYPE_CHECKING:
    from exactga.setup.run_start import Runtime  # the recipe's; run_start does not import dpo

# An emptied micro-batch carries this key (a 0-d tensor, so it moves with the batch): it holds
# no pair. See [pairs as loss units].
EMPTY = "no_pairs"
# A KTO sample's label (True: a desirable example), ``(B,)`` in a micro-batch; see exactga.dpo.kto.
DESIRABLE = "desirable"

# (inputs on the device, response positions, their labels) -> (chosen, rejected) log-probs.
Reference = Callable[[Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def collate_pairs(
    samples: list[Mapping[str, Any]], padding_idx: int = 0, ignore_idx: int = IGNORE_INDEX
) -> Batch:
    """torchtune ``PreferenceDataset`` items as one micro-batch: ``tokens`` and ``labels`` of
    shape ``(2B, L)``, the chosen rows first, then the rejected ones in the same order, all
    right-padded to the longest (``padded_collate_dpo``'s layout, as a dict); and the pairs'
    dataset indices (``(B,)``) when they carry them (``precompute_reference_logprobs``)."""
    rows = [(s["chosen_input_ids"], s["chosen_labels"]) for s in samples]
    rows += [(s["rejected_input_ids"], s["rejected_labels"]) for s in samples]
    width = max(len(tokens) for tokens, _ in rows)
    tokens = torch.full((len(rows), width), padding_idx, dtype=torch.long)
    labels = torch.full((len(rows), width), ignore_idx, dtype=torch.long)
    for row, (row_tokens, row_labels) in enumerate(rows):
        tokens[row, : len(row_tokens)] = torch.as_tensor(row_tokens, dtype=torch.long)
        labels[row, : len(row_labels)] = torch.as_tensor(row_labels, dtype=torch.long)
    batch = {"tokens": tokens, "labels": labels}
    if samples and PAIR_INDEX in samples[0]:
        batch[PAIR_INDEX] = torch.tensor([s[PAIR_INDEX] for s in samples], dtype=torch.long)
    if samples and DESIRABLE in samples[0]:  # KTO's unpaired examples
        batch[DESIRABLE] = torch.tensor([bool(s[DESIRABLE]) for s in samples])
    return batch


def split_pairs(per_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row values of a pair micro-batch as (chosen, rejected), ``B`` each."""
    num_pairs = per_row.size(0) // 2
    return per_row[:num_pairs], per_row[num_pairs:]


class PreferencePairs:
    """Preference pairs as the loss units (DPO, RSO); see [pairs as loss units].

    Args:
        ignore_index: the label value of prompt and padding positions (the dataset's and
            :func:`collate_pairs`'s ``ignore_idx``).
    """

    name = "pairs"

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def count(self, batch: Batch) -> int:
        """The micro-batch's pairs, after checking that each has a chosen and a rejected
        response label after the shift.

        Raises:
            ValueError: an odd number of rows, or a pair without a response, named by its index
                in the micro-batch.
        """
        if EMPTY in batch:
            return 0
        num_rows = _num_sequences(batch)
        if num_rows % 2:
            raise ValueError(
                f"a preference micro-batch stacks its chosen rows, then its rejected rows, so "
                f"it has an even number of rows; this one has {num_rows}. Collate preference "
                "data with exactga.dpo.preference.collate_pairs."
            )
        num_pairs = num_rows // 2
        without_response = (response_lengths(batch, self.ignore_index) == 0).nonzero()
        if len(without_response):
            row = int(without_response[0])
            side, pair = ("chosen", row) if row < num_pairs else ("rejected", row - num_pairs)
            raise ValueError(
                f"preference pair {pair} of a micro-batch of {num_pairs}: its {side} response "
                "has no label after the shift (every label is prompt or padding, e.g. a prompt "
                "that fills max_seq_len), so there is no log-prob to compare. Drop the pair or "
                "shorten its prompt."
            )
        return num_pairs

    def prepare(self, batch: Batch, num_units: int, runs_empty: bool) -> Batch:
        # An empty micro-batch is an emptied one: real pairs, so its loss is already finite.
        assert not runs_empty or EMPTY in batch, "only an emptied pair batch has no pair"
        return {**batch, LOSS_POSITIONS: loss_positions(batch["labels"], self.ignore_index)}

    def emptied(self, batch: Batch) -> Batch:
        """One pair of ``batch`` (its last) marked as carrying none; see [pairs as loss units].

        ``batch`` may be cut to its last row already (``filler_micro_batch`` cuts a batch whose
        every entry has a row per sample): that row then serves as chosen and rejected alike. A
        packed row is kept whole (a row of its pairs costs what the row costs).
        """
        if PACKED_SEQUENCES in batch:
            kept = {key: value for key, value in batch.items() if key != LOSS_POSITIONS}
            return {**kept, EMPTY: torch.tensor(True)}
        num_rows = batch["tokens"].size(0)
        last_chosen = num_rows // 2 - 1 if num_rows % 2 == 0 else num_rows - 1
        keep = torch.tensor([last_chosen, num_rows - 1])
        emptied = {
            key: value.index_select(0, keep) if _has_rows(value, num_rows) else value
            for key, value in batch.items()
            if key != LOSS_POSITIONS
        }
        for key in (PAIR_INDEX, DESIRABLE):  # one entry per pair: the last pair's
            if key in batch:
                emptied[key] = batch[key][-1:]
        return {**emptied, EMPTY: torch.tensor(True)}


class PairsAndChosenTokens(PreferencePairs):
    """Pairs for the per-pair loss and the chosen responses' tokens after the shift for an NLL
    term on them (RPO); see [chosen tokens as the NLL's units]."""

    term_names = ("chosen_tokens",)

    def count_terms(self, batch: Batch) -> tuple[int, ...]:
        if EMPTY in batch:
            return (0,)
        chosen, _ = split_pairs(response_lengths(batch, self.ignore_index))
        return (int(chosen.sum()),)


@dataclass(frozen=True)
class DpoTerms:
    """What a DPO step's loss is made of beyond the per-pair loss (``loss``): the settings the
    units, the loss step and the metrics read, in one object so they cannot disagree. The
    recipes pass the config's keys (their defaults are in exactga.dpo.schema).

    Args:
        rpo_alpha: the weight of the chosen responses' NLL, a mean over their tokens; 0 adds
            no term (stock DPO). See [chosen tokens as the NLL's units].
        sequence_log_prob: each response's log-prob as the ``sum`` of its tokens' (stock) or
            their ``mean``. See [length-normalised log-probs are per pair].

    Raises:
        ValueError: naming the key, for a negative or non-finite ``rpo_alpha`` or another
            ``sequence_log_prob``.
    """

    rpo_alpha: float
    sequence_log_prob: SequenceLogProb
    # The loss takes the policy's log-probs alone: no reference is built or run (SimPO, ORPO).
    reference_free: bool = False
    # The loss trains unpaired examples against the window's reference point (KTO).
    unpaired: bool = False

    @classmethod
    def for_loss(
        cls,
        loss_fn: nn.Module,
        *,
        rpo_alpha: float = 0.0,
        sequence_log_prob: SequenceLogProb | str | None = None,
    ) -> DpoTerms:
        """The terms of ``loss_fn``'s step from the config's keys and what the loss declares
        (``reference_free``, ``sequence_log_prob``, ``nll_weight``; see exactga.dpo.losses): a
        null ``sequence_log_prob`` is the loss's own (the sum for torchtune's losses), and ORPO's
        NLL term is its ``nll_weight``.

        Raises:
            ValueError: naming ``rpo_alpha``, for a loss that holds an NLL term of its own.
        """
        own_nll = float(getattr(loss_fn, "nll_weight", 0.0))
        if own_nll and rpo_alpha:
            raise ValueError(
                f"config key 'rpo_alpha'={rpo_alpha}: {type(loss_fn).__name__} holds its own NLL "
                f"term on the chosen responses (weight {own_nll}); set rpo_alpha: 0."
            )
        if sequence_log_prob is None:
            sequence_log_prob = getattr(loss_fn, "sequence_log_prob", SequenceLogProb.SUM)
        unpaired = bool(getattr(loss_fn, "unpaired", False))
        if unpaired and (rpo_alpha or sequence_log_prob == SequenceLogProb.MEAN):
            raise ValueError(
                f"config keys 'rpo_alpha' and 'sequence_log_prob': {type(loss_fn).__name__} "
                "trains unpaired examples on summed log-probs; leave both out."
            )
        return cls(
            rpo_alpha=own_nll or rpo_alpha,
            sequence_log_prob=sequence_log_prob,
            reference_free=is_reference_free(loss_fn),
            unpaired=unpaired,
        )

    def __post_init__(self) -> None:
        if not math.isfinite(self.rpo_alpha) or self.rpo_alpha < 0:
            raise ValueError(
                f"rpo_alpha must be at least 0 (0: no NLL term), got {self.rpo_alpha}."
            )
        value = as_option(SequenceLogProb, self.sequence_log_prob, "sequence_log_prob")
        object.__setattr__(self, "sequence_log_prob", value)

    @property
    def has_nll(self) -> bool:
        return self.rpo_alpha > 0

    def units(self, ignore_index: int = IGNORE_INDEX) -> PreferencePairs:
        """What the step's loss is a mean over: pairs, and with an NLL term its chosen tokens
        too. Without one, exactly the units of stock-weighted DPO (:class:`PreferencePairs`);
        KTO's examples for an unpaired loss."""
        if self.unpaired:
            from exactga.dpo.kto import KtoExamples  # kto builds on this module

            return KtoExamples(ignore_index)
        if self.has_nll:
            return PairsAndChosenTokens(ignore_index)
        return PreferencePairs(ignore_index)


# Stock DPO: the per-pair loss on summed log-probs, nothing added.
DPO = DpoTerms(rpo_alpha=0.0, sequence_log_prob=SequenceLogProb.SUM)


def _has_rows(value: Any, num_rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == num_rows


# ---------------------------------------------------------------------------------------------
# Log-probs at the response positions, the reference's, and the loss step.


def sequence_log_probs(
    model: nn.Module,
    inputs: Batch,
    positions: torch.Tensor,
    targets: torch.Tensor,
    precision: Precision | None = None,
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
) -> torch.Tensor:
    """Each row's summed ``log p(label)`` over its response positions, shape ``(2B,)``: each
    term in fp32 at least, the sums in fp64.

    ``positions`` are flat indices into the ``(2B, L)`` batch (``LOSS_POSITIONS``), ``targets``
    the shifted labels there. The projection runs only at ``positions`` where the model allows
    it; otherwise the full logits are cut after the forward. See [pairs as loss units].
    """
    inputs = dict(inputs)
    sequences = inputs.pop(PACKED_SEQUENCES, None)
    num_rows, seq_len = inputs["tokens"].shape
    token_log_probs_ = token_log_probs(
        model, inputs, positions, targets, precision, activations_ctx
    ).double()
    # Scattered to a dense (2B, L) grid and summed per row: index_copy with distinct indices is
    # deterministic on every device, where an index_add into rows would use atomics on CUDA.
    grid = token_log_probs_.new_zeros(num_rows * seq_len).index_copy(0, positions, token_log_probs_)
    if sequences is not None:  # one packed row: each sequence sums its own positions
        return torch.where(sequences, grid.view(1, -1), 0.0).sum(dim=1)
    return grid.view(num_rows, seq_len).sum(dim=1)


def lora_reference(model: nn.Module, precision: Precision | None = None) -> Reference:
    """The reference of LoRA DPO: the policy with its adapters off, without a graph."""

    def reference(inputs: Batch, positions: torch.Tensor, targets: torch.Tensor):
        with frozen_forward(), disable_adapter(model):
            return split_pairs(sequence_log_probs(model, inputs, positions, targets, precision))

    return reference


def frozen_model_reference(ref_model: nn.Module, precision: Precision | None = None) -> Reference:
    """The reference of full DPO: a separate model, frozen at setup with
    ``exactga.setup.frozen.freeze_model`` (and sharded like the policy under FSDP)."""

    def reference(inputs: Batch, positions: torch.Tensor, targets: torch.Tensor):
        with frozen_forward():
            return split_pairs(sequence_log_probs(ref_model, inputs, positions, targets, precision))

    return reference


def dpo_loss_step(
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
    window's (exactga.dpo.kto.kto_loss_step).
    """
    terms = DPO if terms is None else terms
    if terms.unpaired:
        from exactga.dpo.kto import kto_loss_step  # kto builds on this module

        return kto_loss_step(
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


def response_lengths(batch: Batch, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Each sequence's scored labels after the shift, ``(2B,)``: the tokens its log-prob sums
    (a row's, or in a packed row a sequence's; see [packed rows are exact] in
    exactga.data.packing)."""
    scored = shift_labels(batch["labels"], ignore_index) != ignore_index
    sequences = batch.get(PACKED_SEQUENCES)
    if sequences is None:
        return scored.sum(dim=1)
    return (sequences & scored).sum(dim=1)


def _num_sequences(batch: Batch) -> int:
    """The chosen and rejected sequences of a pair micro-batch: its rows, or a packed row's."""
    sequences = batch.get(PACKED_SEQUENCES)
    return batch["labels"].size(0) if sequences is None else sequences.size(0)


# ---------------------------------------------------------------------------------------------
# Stock's metrics, as exact window values.


class PreferenceMetrics:
    """Stock's DPO metrics, each the mean over the window's pairs on every rank (stock logs the
    last micro-batch's means). Sums per pair are kept on the device, read only when logged.

    With an NLL term (``terms.rpo_alpha``) also the two terms of the loss: ``dpo_loss``, the
    mean per-pair loss, and ``chosen_nll``, the mean NLL over the window's chosen tokens (not
    weighted by ``rpo_alpha``), so ``loss = dpo_loss + rpo_alpha * chosen_nll``. For KTO
    (``terms.unpaired``) ``kl`` alone, the window's reference point (``reference_point``).

    Args:
        device: where the metrics' all-reduce runs (the data-parallel backend's device).
        terms: the step's loss terms (:class:`DpoTerms`); stock DPO's by default.
        reference_point: KTO's (exactga.dpo.kto.KtoReferencePoint), for ``kl``.
    """

    NAMES = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "log_probs/chosen",
        "log_probs/rejected",
    )
    TERM_NAMES = ("dpo_loss", "chosen_nll")

    def __init__(
        self,
        device: torch.device | str = "cpu",
        terms: DpoTerms | None = None,
        reference_point: Any = None,
    ) -> None:
        self.device = torch.device(device)
        self.has_terms = terms is not None and terms.has_nll
        self.names = self.NAMES + (self.TERM_NAMES if self.has_terms else ())
        self.reference_point = reference_point  # KTO's: its one metric, already global
        self._sums: torch.Tensor | None = None
        self._term_sums: torch.Tensor | None = None

    def record(
        self,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
        chosen_log_probs: torch.Tensor,
        rejected_log_probs: torch.Tensor,
    ) -> None:
        """Add one micro-batch's per-pair values (detached, no host read)."""
        per_pair = torch.stack(
            [
                chosen_rewards,
                rejected_rewards,
                (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
                chosen_rewards - rejected_rewards,
                chosen_log_probs,
                rejected_log_probs,
            ]
        ).detach()
        sums = per_pair.double().sum(dim=1)
        self._sums = sums if self._sums is None else self._sums + sums

    def record_terms(self, pair_losses: torch.Tensor, chosen_nll_sum: torch.Tensor) -> None:
        """Add one micro-batch's per-pair losses and its chosen tokens' summed NLL."""
        sums = torch.stack([pair_losses.double().sum(), chosen_nll_sum.double()]).detach()
        self._term_sums = sums if self._term_sums is None else self._term_sums + sums

    def track(self, windows: Iterable[Window]) -> Iterator[Window]:
        """The windows, with the record cleared as each one opens."""
        for window in windows:
            self._sums = None
            self._term_sums = None
            yield window

    def window_metrics(self, window: Window) -> dict[str, float]:
        """Each metric's mean over the window's pairs on every rank (``chosen_nll``: over its
        chosen tokens): one all-reduce of six numbers, eight with the terms, under data
        parallelism (call on every rank, on logged steps only); nothing for a skipped window."""
        if window.should_skip_step():
            return {}
        if self.reference_point is not None:  # computed over every rank before the backward
            return {"kl": float(self.reference_point.value)}
        sums = torch.zeros(len(self.NAMES), dtype=torch.float64, device=self.device)
        if self._sums is not None:
            sums = self._sums.to(self.device, copy=True)  # reduced in place below
        if self.has_terms:
            term_sums = torch.zeros(2, dtype=torch.float64, device=self.device)
            if self._term_sums is not None:
                term_sums = self._term_sums.to(self.device)
            sums = torch.cat([sums, term_sums])
        if window.dp_group is not None and window.dp_size > 1:
            dist.all_reduce(sums, group=window.dp_group)
        means = (sums / window.num_global_units).tolist()
        if self.has_terms:  # chosen_nll: over the chosen tokens
            means[-1] = float(sums[-1]) / window.num_global_term_units[1]
        return dict(zip(self.names, means, strict=True))


def reference_point_for(
    terms: DpoTerms, model: nn.Module, reference: Any, precision: Precision | None = None
) -> Any:
    """KTO's reference point of each window (exactga.dpo.kto.KtoReferencePoint), a window
    statistic the normaliser computes before the window's backward passes; None for a loss
    over pairs."""
    if not terms.unpaired:
        return None
    from exactga.dpo.kto import KtoReferencePoint  # kto builds on this module

    return KtoReferencePoint(model, reference, precision)


def reference_for_run(
    reference: Any,
    dataset: Any,
    cfg: Any,
    *,
    pad_id: int,
    device: torch.device,
    dp_group: dist.ProcessGroup | None = None,
) -> tuple[Any, Any]:
    """What the loss step reads the reference from, and the dataset to load: ``reference``
    and ``dataset`` as they are, or with the config's ``precompute_reference_logprobs`` a
    table of every pair's reference log-probs, computed once over ``cfg.batch_size`` pairs at
    a time, and the dataset its pairs are looked up from (see [precomputed reference] in
    exactga.dpo.reference_logprobs). The caller drops its other handles on the reference
    model, so that the table frees it."""
    if reference is None or not cfg.precompute_reference_logprobs:
        return reference, dataset  # a reference-free loss has nothing to precompute
    return with_precomputed_reference(
        reference,
        dataset,
        collate=partial(collate_pairs, padding_idx=pad_id),
        batch_size=cfg.batch_size,
        device=device,
        dp_group=dp_group,
    )


@dataclass
class PreferenceRun:
    """What a preference recipe's step reads, wired in one place (:func:`preference_run`):
    a recipe copy that rewires one of these by hand would train a different loss silently."""

    reference: Any  # what dpo_loss_step reads reference log-probs from; None when reference-free
    reference_point: Any  # KTO's window statistic (exactga.dpo.kto), None for a loss over pairs
    normalizer: LossNormalizer  # each term weighed by its own units over the window and ranks
    metrics: PreferenceMetrics
    dataset: Any  # the dataset to load: with a precomputed reference, the table's lookup rows


def preference_run(
    cfg: Any,
    loss_fn: nn.Module,
    terms: DpoTerms,
    dataset: Any,
    *,
    model: nn.Module,
    reference: Reference | None,
    pad_id: int,
    runtime: Runtime,
) -> PreferenceRun:
    """The reference (``reference`` as given, or its log-probs computed once with
    ``precompute_reference_logprobs``), KTO's reference point over each whole window, the
    normaliser over ``terms``' units (counted over ``runtime``'s data-parallel ranks) and the
    metrics, for ``loss_fn`` on ``dataset``.

    ``reference`` is None for a reference-free loss (``terms.reference_free``): the recipe
    then builds no reference model at all. The caller drops its own handles on the reference
    model, so that a precomputed table frees it.
    """
    reference, dataset = reference_for_run(
        reference, dataset, cfg, pad_id=pad_id, device=runtime.device, dp_group=runtime.dp_group
    )
    reference_point = reference_point_for(terms, model, reference, runtime.precision)
    normalizer = LossNormalizer(
        loss_fn,
        mode=cfg.loss_normalization,
        dp_group=runtime.dp_group,
        units=terms.units(),
        statistics=[reference_point] if reference_point else [],  # computed before backward
    )
    metrics = PreferenceMetrics(runtime.device, terms, reference_point)
    return PreferenceRun(reference, reference_point, normalizer, metrics, dataset)
