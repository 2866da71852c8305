"""Packed micro-batches (``micro_batching: packed``): whole samples of a window in one row.

``exactga.data.micro_batching.first_fit_decreasing`` decides which of a window's samples share a
row; :func:`pack_samples` and :func:`pack_pairs` collate them as one row of ``micro_batch_tokens``
positions, with positions that restart at every sample and a block-causal document mask, so the
model computes for each sample exactly what it computes for it alone in a padded micro-batch.
See [packed rows are exact].

Note [packed rows are exact]
A packed row holds whole samples of one window, each a document: a position attends only to
earlier positions of its own document (the block-causal mask) and its rotary position counts
from the document's start (``input_pos``), so every hidden state, and so every logit, is the
one the sample gets alone, up to floating-point rounding. The labels are each sample's own,
with its first label replaced by the ignore index: the loss shifts the row's labels by one
(see [shifted token count] in exactga.accumulation.loss_units), which would otherwise score the last
position of one document against the first label of the next; a sample's first label is never
scored on its own (the shift drops it), so the row's shifted labels are exactly the
concatenation of the samples' shifted labels. The loss terms and their count are then those
of the same samples padded, and so is the window's loss token count: the normaliser weighs a
packed micro-batch as any other (see [regrouping is exact] in exactga.data.micro_batching).

The rest of the row is padding, of ignored labels and rotary position 0, which no real
position sees: under a mask one more document (so each of its positions attends to itself and
its softmax is finite), under per-document attention not attended at all (see [padding is not
attended] in exactga.runtime.document_attention). A sample longer than the row gets a row of
its own, as long as it.

Preference pairs pack both their sides as two documents of one row, and the row carries
``PACKED_SEQUENCES``, ``(2B, N)`` booleans whose row ``s`` marks the positions of sequence
``s``: the chosen side of the row's ``j``-th pair is sequence ``j``, its rejected side
``B + j``, the row order of ``collate_pairs``, so each side's log-prob is summed over its own
positions and its response counted on its own labels (see exactga.dpo.preference).

The mask, chosen here (:func:`document_mask`) for every recipe: on CUDA (where torchtune's
attention runs flex attention on a ``BlockMask``, which skips the blocks across documents) a
``BlockMask`` made by ``packed_block_causal_mask``; elsewhere the row's document lengths
(:class:`~exactga.runtime.document_attention.DocumentLengths`), on which every family's
attention attends each document alone (see [per-document attention is exact] in
exactga.runtime.document_attention) instead of computing the whole row and masking it. The
dense ``(1, N, N)`` boolean mask SDPA takes (torchtune's ``create_block_causal_mask``) is the
reference the per-document path is tested against, and what ``EXACTGA_DENSE_PACKED_MASK=1``
gives instead (benchmarks/micro_batching.py times both).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX as IGNORE_INDEX
from torchtune.modules.attention_utils import create_block_causal_mask, packed_block_causal_mask
from torchtune.utils._import_guard import _SUPPORTS_FLEX_ATTENTION

from exactga.data.micro_batching import PAIR_INDEX, is_pair
from exactga.runtime.document_attention import DocumentLengths

# Which positions of a packed row of preference pairs belong to each of its sequences; see
# [packed rows are exact].
PACKED_SEQUENCES = "packed_sequences"


def row_length(num_positions: int, capacity: int, pad_to_multiple_of: int | None = None) -> int:
    """Positions of a row holding ``num_positions``: ``capacity`` (a longer sample: its own
    length), or with ``pad_to_multiple_of`` the positions rounded up to a multiple of it, which
    trims a row's unfilled end (at most ``capacity / pad_to_multiple_of`` row lengths)."""
    if pad_to_multiple_of:
        return -(-num_positions // pad_to_multiple_of) * pad_to_multiple_of
    return max(num_positions, capacity)


def uses_flex_attention(device: str | torch.device) -> bool:
    """Whether packed rows for a model on ``device`` carry a ``BlockMask``: on CUDA GPUs that
    run flex attention (torchtune's test), where its attention calls flex attention on one."""
    return torch.device(device).type == "cuda" and _SUPPORTS_FLEX_ATTENTION


# Set to 1: packed rows off CUDA carry the dense block-causal mask, not their document lengths
# (the slower reference; benchmarks/micro_batching.py's ``packed_dense``).
DENSE_PACKED_MASK = "EXACTGA_DENSE_PACKED_MASK"


def document_mask(seq_lens: Sequence[int], flex: bool, padding: int = 0) -> Any:
    """What one row whose documents have these lengths, then ``padding`` positions, carries as
    its ``mask``: with ``flex`` torchtune's ``BlockMask`` (CUDA), else its
    :class:`DocumentLengths` (each document attended alone, the padding not at all), or under
    ``EXACTGA_DENSE_PACKED_MASK=1`` the ``(1, N, N)`` block-causal booleans. The two masks
    attend the padding within itself, as one more document."""
    if not flex and os.environ.get(DENSE_PACKED_MASK) != "1":
        return DocumentLengths.of(list(seq_lens), padding)
    lengths = [torch.tensor([*seq_lens, *([padding] if padding else [])], dtype=torch.long)]
    return packed_block_causal_mask(lengths) if flex else create_block_causal_mask(lengths)


class _Row:
    """A packed row being filled: tokens, labels, rotary positions and document lengths."""

    def __init__(self, padding_idx: int, ignore_idx: int) -> None:
        self.padding_idx, self.ignore_idx = padding_idx, ignore_idx
        self.tokens: list[int] = []
        self.labels: list[int] = []
        self.input_pos: list[int] = []
        self.seq_lens: list[int] = []
        self.sequences: list[int] = []

    def add(self, tokens: Sequence[int], labels: Sequence[int], sequence: int = 0) -> None:
        """One document; its first label is ignored, see [packed rows are exact]."""
        assert len(tokens) == len(labels) and len(tokens) > 0, "a sample of equal, >0 lengths"
        self.tokens += list(tokens)
        self.labels += [self.ignore_idx, *labels[1:]]
        self.input_pos += range(len(tokens))
        self.seq_lens.append(len(tokens))
        self.sequences += [sequence] * len(tokens)

    def collate(self, capacity: int, pad_to_multiple_of: int | None, flex: bool) -> dict:
        width = row_length(len(self.tokens), capacity, pad_to_multiple_of)
        num_pad = width - len(self.tokens)

        def row(values: list[int], fill: int) -> torch.Tensor:
            return torch.tensor([values + [fill] * num_pad], dtype=torch.long)

        return {
            "tokens": row(self.tokens, self.padding_idx),
            "labels": row(self.labels, self.ignore_idx),
            "input_pos": row(self.input_pos, 0),
            "mask": document_mask(self.seq_lens, flex, num_pad),
        }


def pack_samples(
    samples: Sequence[Mapping[str, Any]],
    *,
    capacity: int,
    padding_idx: int = 0,
    ignore_idx: int = IGNORE_INDEX,
    pad_to_multiple_of: int | None = None,
    flex: bool = False,
) -> dict[str, Any]:
    """Supervised samples (``tokens``, ``labels``) as one packed row: ``tokens``, ``labels``
    and ``input_pos`` of shape ``(1, N)`` and the document ``mask``; see [packed rows are
    exact]. ``N`` is ``capacity``, or the samples' positions if they are more."""
    row = _Row(padding_idx, ignore_idx)
    for sample in samples:
        row.add(sample["tokens"], sample["labels"])
    return row.collate(capacity, pad_to_multiple_of, flex)


def pack_pairs(
    samples: Sequence[Mapping[str, Any]],
    *,
    capacity: int,
    padding_idx: int = 0,
    ignore_idx: int = IGNORE_INDEX,
    pad_to_multiple_of: int | None = None,
    flex: bool = False,
) -> dict[str, Any]:
    """Preference pairs as one packed row: each pair's chosen then rejected side as two
    documents, with ``PACKED_SEQUENCES`` marking each side's positions (chosen ``j``, rejected
    ``B + j``) and the pairs' ``PAIR_INDEX`` when they carry one; see [packed rows are
    exact]."""
    row = _Row(padding_idx, ignore_idx)
    num_pairs = len(samples)
    for j, pair in enumerate(samples):
        row.add(pair["chosen_input_ids"], pair["chosen_labels"], sequence=j)
        row.add(pair["rejected_input_ids"], pair["rejected_labels"], sequence=num_pairs + j)
    batch = row.collate(capacity, pad_to_multiple_of, flex)
    width = batch["tokens"].size(1)
    of_position = torch.full((width,), -1, dtype=torch.long)
    of_position[: len(row.sequences)] = torch.tensor(row.sequences, dtype=torch.long)
    batch[PACKED_SEQUENCES] = of_position.unsqueeze(0) == torch.arange(2 * num_pairs).unsqueeze(1)
    if samples and PAIR_INDEX in samples[0]:
        batch[PAIR_INDEX] = torch.tensor([s[PAIR_INDEX] for s in samples], dtype=torch.long)
    return batch


def pack_window_samples(samples: Sequence[Mapping[str, Any]], **settings: Any) -> dict[str, Any]:
    """:func:`pack_pairs` for preference pairs, :func:`pack_samples` for any other sample."""
    if samples and is_pair(samples[0]):
        return pack_pairs(samples, **settings)
    return pack_samples(samples, **settings)
