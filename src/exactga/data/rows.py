"""The per-sample checks of a tokenized row: one sequence, or both sides of a preference pair.

exactga.data.loader calls these on every sample it reads and names the row when one fails; see
[checked rows] in exactga.data.loader. An SFT sample is one sequence, ``tokens`` and ``labels``.
torchtune's ``PreferenceDataset`` gives a pair as ``chosen_input_ids``, ``chosen_labels``,
``rejected_input_ids`` and ``rejected_labels``, the labels ``-100`` on the prompt; each side is
checked as an SFT sample is, and must also keep a response. A side with no label after the
one-position shift (its prompt fills ``max_seq_len``, or its answer is empty) has a summed
log-prob that is an empty sum of 0, not the log-prob of any response. exactga.dpo.preference
refuses such a pair when it counts a micro-batch, naming its place in the micro-batch (see
[pairs as loss units] in exactga.dpo.preference); here it fails as the row is read, naming the row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX as IGNORE_INDEX

SIDES = ("chosen", "rejected")
PREFERENCE_KEYS = tuple(f"{side}_{part}" for side in SIDES for part in ("input_ids", "labels"))


def sequence_problem(tokens: Any, labels: Any, vocab_size: int, side: str = "") -> str | None:
    """What is wrong with one tokenized sequence, or None; ``side`` names a pair's side."""
    of = f"in its {side} side, " if side else ""
    if len(tokens) != len(labels):
        return (
            f"{of}{len(tokens)} tokens but {len(labels)} labels; the dataset's transform must "
            "give one label per token."
        )
    if len(tokens) == 0:
        return None
    lowest, highest = _min_max(tokens)
    if lowest < 0:
        return (
            f"{of}token id {lowest} is negative; the dataset's transform "
            "(config key 'tokenizer' or 'dataset') produced an invalid id."
        )
    if highest >= vocab_size:
        return (
            f"{of}token id {highest} (its largest) is beyond the model's vocabulary "
            f"(vocab_size {vocab_size}). The tokenizer (config key 'tokenizer') does not match "
            "the model (config key 'model.vocab_size'): use the model's own tokenizer, or a "
            f"vocab_size at least {highest + 1}."
        )
    return None


def is_preference_sample(sample: Any) -> bool:
    """Whether ``sample`` is laid out as a pair (it has ``chosen_input_ids``)."""
    return isinstance(sample, Mapping) and "chosen_input_ids" in sample


def pair_problem(sample: Mapping[str, Any], vocab_size: int, max_seq_len: int | None) -> str | None:
    """What is wrong with a preference pair, or None: a missing key, or the first bad side.

    ``max_seq_len`` is the tokenizer's (None if unknown), for the message only.
    """
    if not all(key in sample for key in PREFERENCE_KEYS):
        return (
            f"a preference sample must hold {', '.join(map(repr, PREFERENCE_KEYS))}, got "
            f"{', '.join(map(str, sample))}."
        )
    for side in SIDES:
        tokens, labels = sample[f"{side}_input_ids"], sample[f"{side}_labels"]
        problem = sequence_problem(tokens, labels, vocab_size, side)
        if problem is None:
            problem = _response_problem(side, labels, max_seq_len)
        if problem is not None:
            return problem
    return None


def tokenizer_max_seq_len(dataset: Any) -> int | None:
    """The ``max_seq_len`` a torchtune dataset's tokenizer truncates to, if it tells."""
    return getattr(getattr(dataset, "_tokenizer", None), "max_seq_len", None)


def _response_problem(side: str, labels: Any, max_seq_len: int | None) -> str | None:
    """The problem of a side with no label after the shift (in ``labels[1:]``), or None."""
    if any(int(label) != IGNORE_INDEX for label in labels[1:]):
        return None
    limit = (
        f"tokenizer.max_seq_len={max_seq_len}"
        if max_seq_len is not None
        else "the tokenizer's max_seq_len"
    )
    return (
        f"its {side} response has no label after the shift (the prompt fills {limit}, or the "
        "response is empty); shorten the prompt, raise max_seq_len, or drop the row."
    )


def _min_max(tokens: Any) -> tuple[int, int]:
    if isinstance(tokens, torch.Tensor):  # packed samples are tensors
        return int(tokens.min()), int(tokens.max())
    return int(min(tokens)), int(max(tokens))
