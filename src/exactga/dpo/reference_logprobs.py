"""Reference log-probs computed once per pair before training (``precompute_reference_logprobs``).

DPO's reference is frozen, so each pair's two reference log-probs are the same at every visit.
With the option on, a pre-pass before the first step computes them for every pair of the
dataset and each step looks its pairs up instead of running the reference. See [precomputed
reference].

Note [precomputed reference]
What it saves, measured on CPU with the tiny models (8 pairs per micro-batch, by length; one
thread; ``benchmarks/dpo_reference_share.py``): the reference's forward is 24% of a LoRA DPO
step and 26% of a full DPO step (docs/dpo.md, "Precomputed reference log-probs"). The pre-pass
costs one reference forward per pair, what the first epoch would spend anyway, so a run of E
epochs saves (E - 1) of those forwards and a one-epoch run (every stock config) saves nothing in
time. Full DPO also drops its reference model after the pre-pass: its weights, a second copy of
the model's, leave the device for the rest of the run. Hence off by default.

Exactness is unchanged: a pair's summed log-probs do not depend on the micro-batch it is in
(see [pairs as loss units] in exactga.dpo.preference), so the looked-up values are the in-step ones
up to float rounding. The pre-pass visits every rank's share of the dataset (pair ``i`` on rank
``i % world``) longest first in micro-batches of ``batch_size`` pairs, every rank running as
many as the busiest (FSDP pairs up the sharded reference's collectives; a rank short of pairs
repeats its last micro-batch and keeps nothing of it), then one all-gather gives every rank the
whole table: 2 doubles per pair. The order is fixed, so a resumed run computes the same table
bit for bit and goes on exactly as the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from exactga.accumulation.loss_units import IGNORE_INDEX, loss_positions, shift_labels
from exactga.data.micro_batching import PAIR_INDEX, sample_length


class IndexedPairs(Dataset):
    """``dataset`` with each pair's index in it under :data:`PAIR_INDEX`, for the lookup.

    Other attributes are forwarded, so the wrapper is a drop-in for the loader.
    """

    def __init__(self, dataset: Dataset) -> None:
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._dataset, name)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self._dataset[index], PAIR_INDEX: index}


class ReferenceTable:
    """Every pair's reference log-probs, ``(N, 2)`` fp64 (chosen, rejected), on the device.

    Stands in for a ``Reference`` of exactga.dpo.log_probs:
    :func:`exactga.dpo.loss.dpo_micro_batch_loss` looks a micro-batch's pairs up by their
    :data:`PAIR_INDEX`.
    """

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def lookup(self, pair_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.table.index_select(0, pair_index.to(self.table.device))
        return rows[:, 0], rows[:, 1]


def with_precomputed_reference(
    reference: Any,
    dataset: Dataset,
    *,
    collate: Any,
    batch_size: int,
    device: torch.device,
    dp_group: dist.ProcessGroup | None = None,
) -> tuple[ReferenceTable, IndexedPairs]:
    """The recipes' one call for ``precompute_reference_logprobs``: the table of every pair's
    reference log-probs (:func:`precompute_reference`), and the dataset its pairs are looked up
    from (:class:`IndexedPairs`). Drop every other handle on the reference model to free it."""
    table = precompute_reference(
        reference, dataset, collate=collate, batch_size=batch_size, device=device, dp_group=dp_group
    )
    return table, IndexedPairs(dataset)


def precompute_reference(
    reference: Any,
    dataset: Dataset,
    *,
    collate: Any,
    batch_size: int,
    device: torch.device,
    dp_group: dist.ProcessGroup | None = None,
) -> ReferenceTable:
    """The reference log-probs of every pair of ``dataset``; see [precomputed reference].

    Args:
        reference: a ``Reference`` of exactga.dpo.log_probs (the model with its adapters off, or
            the frozen reference model), called on micro-batches on ``device``.
        dataset: the recipe's checked dataset of pairs (each rank holds the same one).
        collate: the config's pair collate with its padding arguments bound.
        batch_size: pairs per micro-batch of the pre-pass (the config's ``batch_size``).
        device: where the micro-batches run.
        dp_group: the data-parallel group under FSDP, or ``None`` on one device.
    """
    rank, world = (0, 1) if dp_group is None else (dist.get_rank(dp_group), dp_group.size())
    mine = list(range(rank, len(dataset), world))
    samples = {i: dataset[i] for i in mine}
    order = sorted(mine, key=lambda i: -sample_length(samples[i]))
    groups = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    num_groups = -(-len(range(0, len(dataset), world)) // batch_size)  # rank 0's, the most
    rows = torch.zeros(len(mine), 3, dtype=torch.float64, device=device)
    if not groups:  # more ranks than pairs: this one only keeps the collectives paired
        groups, samples = [], {0: dataset[0]}
    for g in range(num_groups):
        group = groups[min(g, len(groups) - 1)] if groups else [0]
        values = _reference_of(reference, [samples[i] for i in group], collate, device)
        if g < len(groups):  # a repeated group only keeps the collectives paired
            start = g * batch_size
            rows[start : start + len(group), 0] = torch.tensor(group, dtype=torch.float64)
            rows[start : start + len(group), 1:] = values
    return ReferenceTable(_gather_table(rows, len(dataset), dp_group))


def _reference_of(reference: Any, group: list[Mapping], collate: Any, device: torch.device):
    """``(B, 2)`` reference log-probs of ``group``'s pairs."""
    batch = collate(group)
    labels = batch.pop("labels")
    batch.pop(PAIR_INDEX, None)
    positions = loss_positions(labels, IGNORE_INDEX)
    targets = shift_labels(labels).reshape(-1).index_select(0, positions)
    inputs = {key: value.to(device) for key, value in batch.items()}
    chosen, rejected = reference(inputs, positions.to(device), targets.to(device))
    return torch.stack([chosen, rejected], dim=1).double()


def _gather_table(
    rows: torch.Tensor, num_pairs: int, dp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Every rank's ``(index, chosen, rejected)`` rows as one ``(num_pairs, 2)`` table."""
    if dp_group is not None and dp_group.size() > 1:
        most = -(-num_pairs // dp_group.size())
        padded = rows.new_full((most, 3), -1.0)
        padded[: len(rows)] = rows
        gathered = [torch.empty_like(padded) for _ in range(dp_group.size())]
        dist.all_gather(gathered, padded, group=dp_group)
        rows = torch.cat(gathered)
        rows = rows[rows[:, 0] >= 0]
    table = rows.new_zeros(num_pairs, 2)
    table[rows[:, 0].long()] = rows[:, 1:]
    assert len(rows) == num_pairs, "every pair's reference log-probs, once"
    return table
