"""KTO (Ethayarajh et al. 2024): unpaired desirable and undesirable examples, against a reference
point that is a statistic of the whole batch, exact under any split.

The data are rows of a prompt, a completion and a boolean label (TRL's unpaired format; the
dataset builder :func:`kto_dataset`). Each example is laid out as a preference "pair" so that
the DPO recipes' loader, micro-batching, row checks, fillers and precomputed reference serve it
unchanged: its first side is the example (prompt and its own completion), its second the
*mismatched* sequence the KL estimate scores (the same prompt with another row's completion),
and ``desirable`` its label. The units are examples (:class:`KtoExamples`).

Note [kto reference point]
KTO's per-example loss reads ``z``, a KL estimate over the batch: with ``r = log pi(y|x) - log
ref(y|x)`` (summed log-probs), a desirable example costs ``w_d (1 - sigmoid(beta (r - z)))``, an
undesirable one ``w_u (1 - sigmoid(beta (z - r)))``, and
``z = max(0, (1/N) sum_i [log pi(y'_i|x_i) - log ref(y'_i|x_i)])`` over the batch's ``N``
mismatched pairs ``(x_i, y'_i)``, detached. TRL estimates it per device batch (mismatching
completions inside the micro-batch) and averages it over devices: each micro-batch then trains
against its own ``z`` and the step depends on the split. Here ``z`` is the window's, over every
micro-batch and rank: a :class:`KtoReferencePoint` (a window statistic; see [window statistics]
in exactga.accumulation.window_statistics) sums the mismatched log-ratios in a no-grad pass
before the first backward and divides by the window's examples, so every micro-batch reads the
full batch's ``z`` and the loss is a mean over examples (each a function of its own example
and that constant): exact, whatever the split. Each row's mismatched completion is fixed by the
dataset, not the batch (the next row, in dataset order, whose prompt differs), so ``z`` is a
function of the window's examples alone. The pass costs one no-grad policy forward of the
mismatched rows and a reference forward of the micro-batch (none with
``precompute_reference_logprobs``, whose table holds both sides).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from datasets import load_dataset
from torch import nn
from torch.utils.data import Dataset
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, Message

from exactga.accumulation.loss_units import LOSS_POSITIONS, Batch, shift_labels
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.accumulation.normalization import Window
from exactga.data.packing import PACKED_SEQUENCES
from exactga.dpo.log_probs import Reference, sequence_log_probs
from exactga.dpo.preference import DESIRABLE, EMPTY, PreferencePairs
from exactga.dpo.reference_logprobs import PAIR_INDEX, ReferenceTable
from exactga.runtime.precision import Precision

# The loss positions of the example rows and of the mismatched rows, flat indices into each
# ``(B, L)`` half of a KTO micro-batch (host-side, as ``LOSS_POSITIONS``).
EXAMPLE_POSITIONS = "example_positions"
MISMATCHED_POSITIONS = "mismatched_positions"


# ---------------------------------------------------------------------------------------------
# Data: unpaired rows of a prompt, a completion and a label.


class KtoDataset(Dataset):
    """Unpaired examples as KTO samples: ``chosen_input_ids``/``chosen_labels`` the example (its
    prompt masked), ``rejected_input_ids``/``rejected_labels`` the mismatched sequence (the same
    prompt, the completion of the next row whose prompt differs), ``desirable`` the label. See
    [kto reference point]. Prompts and completions are strings (a user and an assistant turn)
    or lists of messages."""

    def __init__(
        self,
        *,
        source: str,
        tokenizer: Any,
        column_map: Mapping[str, str] | None = None,
        split: str = "train",
        **load_dataset_kwargs: Any,
    ) -> None:
        self._tokenizer = tokenizer
        columns = {"prompt": "prompt", "completion": "completion", "label": "label"}
        columns.update(column_map or {})
        data = load_dataset(source, split=split, **load_dataset_kwargs)
        missing = [key for key, name in columns.items() if name not in data.column_names]
        if missing:
            raise ValueError(
                f"config key 'dataset': a KTO dataset's rows hold a prompt, a completion and a "
                f"boolean label; no column {', '.join(repr(columns[k]) for k in missing)} in "
                f"{source} (columns: {', '.join(data.column_names)}). Map yours with "
                "dataset.column_map (e.g. {completion: response})."
            )
        self._prompts = [_messages(p, "user") for p in data[columns["prompt"]]]
        self._completions = [_messages(c, "assistant") for c in data[columns["completion"]]]
        self._labels = [
            _label(value, row, columns["label"]) for row, value in enumerate(data[columns["label"]])
        ]
        self._mismatched = mismatched_rows([str(p) for p in data[columns["prompt"]]])

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        prompt = self._prompts[index]
        tokens, labels = self._tokenize(prompt + self._completions[index])
        kl_tokens, kl_labels = self._tokenize(prompt + self._completions[self._mismatched[index]])
        return {
            "chosen_input_ids": tokens,
            "chosen_labels": labels,
            "rejected_input_ids": kl_tokens,
            "rejected_labels": kl_labels,
            DESIRABLE: self._labels[index],
        }

    def _tokenize(self, messages: list[Message]) -> tuple[list[int], list[int]]:
        tokens, mask = self._tokenizer.tokenize_messages(messages)
        return tokens, list(np.where(mask, CROSS_ENTROPY_IGNORE_IDX, tokens))


def kto_dataset(tokenizer: Any, **kwargs: Any) -> KtoDataset:
    """The ``dataset`` builder of KTO data (``_component_: exactga.dpo.kto.kto_dataset``) with
    torchtune's keys: ``source``, ``data_files``, ``split``, ``column_map`` (for ``prompt``,
    ``completion``, ``label``)."""
    return KtoDataset(tokenizer=tokenizer, **kwargs)


def mismatched_rows(prompts: list[str]) -> list[int]:
    """Each row's mismatched partner: the next row, cyclically, whose prompt differs (the row
    itself where every prompt is the same)."""
    num_rows, partners = len(prompts), []
    for row in range(num_rows):
        partner = next(
            (
                (row + step) % num_rows
                for step in range(1, num_rows)
                if prompts[(row + step) % num_rows] != prompts[row]
            ),
            row,
        )
        partners.append(partner)
    return partners


def _messages(value: Any, role: str) -> list[Message]:
    if isinstance(value, str):
        return [Message(role=role, content=value, masked=role != "assistant")]
    return [
        Message(role=m["role"], content=m["content"], masked=m["role"] != "assistant")
        for m in value
    ]


def _label(value: Any, row: int, column: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise ValueError(
            f"KTO dataset row {row}: column {column!r} must be true (desirable) or false "
            f"(undesirable), got {value!r}."
        )
    return bool(value)


# ---------------------------------------------------------------------------------------------
# The loss, its units and its reference point.


class KTOLoss(nn.Module):
    """KTO's per-example loss against the window's reference point ``z`` (see [kto reference
    point]), with TRL's keys: a desirable example costs
    ``desirable_weight * (1 - sigmoid(beta * (r - z)))``, an undesirable one
    ``undesirable_weight * (1 - sigmoid(beta * (z - r)))``, ``r`` its summed log-ratio to the
    reference. Unpaired: the DPO recipes train it on KTO data (:func:`kto_dataset`).

    Args:
        beta: the reward's scale.
        desirable_weight: the weight of a desirable example's loss.
        undesirable_weight: the weight of an undesirable example's loss.
    """

    unpaired = True

    def __init__(
        self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
    ):
        super().__init__()
        self.beta = beta
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def forward(
        self,
        policy_logps: torch.Tensor,
        reference_logps: torch.Tensor,
        desirable: torch.Tensor,
        reference_point: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One loss per example, and its reward ``beta * r`` (detached)."""
        log_ratios = policy_logps - reference_logps
        desirable_losses = self.desirable_weight * (
            1 - torch.sigmoid(self.beta * (log_ratios - reference_point))
        )
        undesirable_losses = self.undesirable_weight * (
            1 - torch.sigmoid(self.beta * (reference_point - log_ratios))
        )
        losses = torch.where(desirable, desirable_losses, undesirable_losses)
        return losses, self.beta * log_ratios.detach()


class KtoExamples(PreferencePairs):
    """KTO's examples as the loss units: one per "pair" of a KTO micro-batch (its example and its
    mismatched sequence). Also marks the example rows' positions, where the policy's graph runs.
    """

    name = "examples"

    def count(self, batch: Batch) -> int:
        if PACKED_SEQUENCES in batch:
            raise ValueError(
                "config key 'micro_batching': KTO reads its examples and their mismatched "
                "sequences as rows; use fixed, by_length or token_budget, not packed."
            )
        if EMPTY not in batch and DESIRABLE not in batch:
            raise ValueError(
                "KTOLoss trains unpaired examples with a desirable label; use a KTO dataset "
                "(config key 'dataset': exactga.dpo.kto.kto_dataset)."
            )
        return super().count(batch)

    def prepare(self, batch: Batch, num_units: int, runs_empty: bool) -> Batch:
        batch = super().prepare(batch, num_units, runs_empty)
        positions = batch[LOSS_POSITIONS]
        num_rows, seq_len = batch["labels"].shape
        # Positions are sorted, the example rows first: theirs are a prefix.
        half = (num_rows // 2) * seq_len
        num_example_positions = int((positions < half).sum())
        return {
            **batch,
            EXAMPLE_POSITIONS: positions[:num_example_positions],
            MISMATCHED_POSITIONS: positions[num_example_positions:] - half,
        }


class KtoReferencePoint:
    """KTO's reference point ``z`` of each window, over every micro-batch and rank: a window
    statistic (see [window statistics] in exactga.accumulation.window_statistics) summing the
    mismatched sequences' log-ratios before the window's first backward. See [kto reference
    point].

    Args:
        model: the policy.
        reference: the DPO recipes' reference (a frozen model's, the policy with its adapters
            off, or a precomputed table).
        precision: the run's precision policy, as the loss step's.
    """

    size = 1  # the sum of the mismatched log-ratios; the count is the window's examples

    def __init__(
        self, model: nn.Module, reference: Reference | ReferenceTable, precision: Precision | None
    ) -> None:
        self.model, self.reference, self.precision = model, reference, precision
        self.value: torch.Tensor | None = None  # z of the current window, fp64, detached

    def contribution(self, batch: Batch) -> torch.Tensor:
        """The micro-batch's sum of ``log pi(y'|x) - log ref(y'|x)`` over its mismatched rows."""
        rows = _KtoRows.of(batch)
        _, reference_mismatched = rows.reference_log_probs(self.reference)
        policy = sequence_log_probs(
            self.model,
            {"tokens": rows.tokens[rows.num_examples :]},
            rows.mismatched_positions,
            rows.half_targets(rows.mismatched_positions, second=True),
            self.precision,
        )
        return (policy - reference_mismatched).sum().reshape(1)

    def update(self, sums: torch.Tensor, window: Window) -> None:
        self.value = (sums[0] / window.num_global_units).clamp(min=0)


@dataclass
class _KtoRows:
    """A KTO micro-batch on the device, taken apart: its ``2B`` rows (examples, then their
    mismatched sequences), their labels and positions, its examples' labels and indices."""

    inputs: Batch
    labels: torch.Tensor
    positions: torch.Tensor
    example_positions: torch.Tensor
    mismatched_positions: torch.Tensor
    desirable: torch.Tensor | None
    pair_index: torch.Tensor | None

    @classmethod
    def of(cls, batch: Batch) -> _KtoRows:
        labels = batch.pop("labels")
        positions = batch.pop(LOSS_POSITIONS)
        example_positions = batch.pop(EXAMPLE_POSITIONS)
        mismatched_positions = batch.pop(MISMATCHED_POSITIONS)
        desirable = batch.pop(DESIRABLE, None)
        batch.pop(EMPTY, None)
        pair_index = batch.pop(PAIR_INDEX, None)
        return cls(
            batch, labels, positions, example_positions, mismatched_positions, desirable, pair_index
        )

    @property
    def tokens(self) -> torch.Tensor:
        return self.inputs["tokens"]

    @property
    def num_examples(self) -> int:
        return self.labels.size(0) // 2

    def half_targets(self, half_positions: torch.Tensor, second: bool) -> torch.Tensor:
        """The shifted labels at ``half_positions`` of the first (examples) or second half."""
        rows = self.labels[self.num_examples :] if second else self.labels[: self.num_examples]
        return shift_labels(rows).reshape(-1).index_select(0, half_positions)

    def reference_log_probs(
        self, reference: Reference | ReferenceTable
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (example, mismatched) summed log-probs."""
        if isinstance(reference, ReferenceTable):
            if self.pair_index is None:
                raise ValueError("a precomputed reference needs the examples' indices")
            return reference.lookup(self.pair_index)
        targets = shift_labels(self.labels).reshape(-1).index_select(0, self.positions)
        return reference(self.inputs, self.positions, targets)


def kto_micro_batch_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: Batch,
    reference: Reference | ReferenceTable,
    *,
    reference_point: KtoReferencePoint,
    precision: Precision | None = None,
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
) -> MicroBatchLoss:
    """The mean KTO loss over the examples of one micro-batch already on the device, against
    the window's reference point (computed before the first backward); see [kto reference
    point]. The policy's graph runs on the example rows only."""
    assert reference_point.value is not None, "the window's statistics run before its backward"
    rows = _KtoRows.of(batch)
    reference_examples, _ = rows.reference_log_probs(reference)
    policy = sequence_log_probs(
        model,
        {"tokens": rows.tokens[: rows.num_examples]},
        rows.example_positions,
        rows.half_targets(rows.example_positions, second=False),
        precision,
        activations_ctx,
    )
    losses, rewards = loss_fn(policy, reference_examples, rows.desirable, reference_point.value)
    if losses.shape != policy.shape:
        raise ValueError(
            f"loss {type(loss_fn).__name__} returned losses of shape {tuple(losses.shape)} for "
            f"{policy.numel()} examples; exactga averages one loss per example itself."
        )
    return MicroBatchLoss(losses.mean())
