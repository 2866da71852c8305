"""Preference pairs: their micro-batch layout and what a DPO loss is a mean over.

A preference micro-batch is one tensor of ``2B`` rows: the ``B`` chosen sequences, then their
``B`` rejected ones, right-padded to the longest of all of them (:func:`collate_pairs`, a dict
where torchtune's ``padded_collate_dpo`` gives a tuple). Its loss is a mean over its pairs
(exactga.dpo.loss), so :class:`PreferencePairs` counts pairs for the one normaliser of
``exactga.accumulation.normalization``; the window, its collective and ``Window.scale`` are those
of every other recipe. See [pairs as loss units]. A loss with a token-level term, RPO's NLL on
the chosen responses (``rpo_alpha``), adds the chosen tokens as units of that term
(:class:`PairsAndChosenTokens`; see [chosen tokens as the NLL's units]); length-normalised
log-probs (``sequence_log_prob: mean``) need none (see [length-normalised log-probs are per
pair]). KTO's examples (exactga.dpo.kto) are laid out and counted as pairs too.

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

from collections.abc import Mapping
from typing import Any

import torch

from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    LOSS_POSITIONS,
    Batch,
    loss_positions,
    shift_labels,
)
from exactga.data.micro_batching import PAIR_INDEX
from exactga.data.packing import PACKED_SEQUENCES

# An emptied micro-batch carries this key (a 0-d tensor, so it moves with the batch): it holds
# no pair. See [pairs as loss units].
EMPTY = "no_pairs"
# A KTO sample's label (True: a desirable example), ``(B,)`` in a micro-batch; see exactga.dpo.kto.
DESIRABLE = "desirable"


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


def _has_rows(value: Any, num_rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == num_rows


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
