"""Length-balanced ranks (``rank_balancing: by_tokens``): each accumulation window's samples
dealt out to the data-parallel ranks by length, so that no rank waits at the gradient reduction
for a rank with longer samples. See [balanced ranks are exact] and [the length index].

Note [balanced ranks are exact]
The ranks of one step together train one window of the sampler's shuffled order: its
``batch_size x gradient_accumulation_steps x ranks`` consecutive samples, the window one device
trains with the same global batch (see [data order] in exactga.data.loader). Stock data parallelism
gives rank ``r`` of ``n`` every n-th of them, whatever their lengths, so one rank's share may
hold twice the tokens of another's, and every rank waits for it at each gradient reduction.
Under exact normalisation the step is the sum of every loss token's gradient over the window's
token count on all ranks together (see [loss scaled before backward] in
exactga.accumulation.normalization), so which rank holds which of the window's samples changes only
the order of floating-point sums. So the window is dealt by length instead: its samples longest
first, each to the rank with the fewest tokens so far among those that still need samples
(every rank takes the same number, as stock does, so ``fixed`` and ``by_length`` cut whole
micro-batches everywhere); within a rank its samples keep the window's order. What a rank waits
for is the positions its micro-batches process, padding included, not its tokens, so the deal
is then refined on those, as the window's ``micro_batching`` cuts each share: while a swap of
one sample between the busiest and the least busy rank lowers the larger of the two, the best
such swap is made (a few per rank at most). Under ``packed`` the tokens are the positions (but
each rank's last row), and the token deal stands. The windows, and so the steps, are the same.
An epoch's last, short window is dealt the same way. The deal depends on the window's samples
and lengths alone, so a resumed run deals its windows again identically; and after a whole
number of windows every rank has read as many samples either way, so a run may be resumed with
``rank_balancing`` changed, as with ``micro_batching``.

Note [the length index]
Every rank must know the length of every sample of a window to deal it, and each loads only its
own share. The lengths are therefore read once, at start-up, into an index over the dataset:
each process of the job tokenizes every ``world_size``-th sample (what ``__getitem__`` does
anyway when training, and the rows are checked as they are), and one ``all_gather_object``
hands every process all of them. That costs one pass of tokenization over the dataset divided
among the processes (docs/rank_balancing.md gives the measured figure), and a list of ints per
process; the windows then cost nothing more (no collective, no sample loaded twice). Carrying the
lengths in the window's own collective instead would make every rank load every sample of the
window to know them: ``ranks`` times the tokenization, every step.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from exactga.config.options import MicroBatching, RankBalancing
from exactga.data.micro_batching import (
    MicroBatchingSettings,
    is_pair,
    padded_positions,
    plan_micro_batches,
    sample_length,
    sample_positions,
    whole_micro_batches,
)
from exactga.runtime.distributed import log_rank_zero

ShareCost = Callable[[list[int]], int]  # a share's sample indices -> positions it processes


def deal_by_length(
    lengths: Sequence[int], num_ranks: int, cost: ShareCost | None = None
) -> list[list[int]]:
    """Each rank's share of a window whose samples have these ``lengths`` (tokens), as sample
    indices in the window's order: the longest first, each to the least-loaded rank that still
    takes samples (ties to the lowest rank), every rank ``len(lengths) / num_ranks`` of them;
    then, with ``cost``, refined by swaps that lower the busiest rank's cost. See [balanced
    ranks are exact]."""
    assert len(lengths) % num_ranks == 0, "a window holds the same number of samples per rank"
    per_rank = len(lengths) // num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    open_ranks = [(0, rank) for rank in range(num_ranks)]  # (load, rank): a heap, least first
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable
        load, rank = heapq.heappop(open_ranks)
        shares[rank].append(index)
        if len(shares[rank]) < per_rank:
            heapq.heappush(open_ranks, (load + lengths[index], rank))
    if cost is not None and num_ranks > 1:
        _even_out(shares, cost, max_swaps=min(_SWAPS_PER_RANK * num_ranks, _MAX_SWAPS))
    return [sorted(share) for share in shares]


# Bounds the refinement (it stops earlier once no swap helps): every rank deals every window
# itself, in the loader, so its cost is per step (docs/rank_balancing.md gives the figures).
_SWAPS_PER_RANK, _MAX_SWAPS = 2, 16


def _even_out(shares: list[list[int]], cost: ShareCost, max_swaps: int) -> None:
    """Swap one sample at a time between the busiest and the least busy share while the best
    swap lowers the larger of their costs; in place."""
    costs = [cost(share) for share in shares]
    for _ in range(max_swaps):
        busiest = max(range(len(shares)), key=costs.__getitem__)
        idlest = min(range(len(shares)), key=costs.__getitem__)
        if costs[idlest] == costs[busiest]:  # even already (and one share is not two)
            return
        best = (costs[busiest], None)
        for x, y in itertools.product(range(len(shares[busiest])), range(len(shares[idlest]))):
            busy, idle = list(shares[busiest]), list(shares[idlest])
            busy[x], idle[y] = idle[y], busy[x]
            swapped = (cost(busy), cost(idle))
            if max(swapped) < best[0]:
                best = (max(swapped), (busy, idle, swapped))
        if best[1] is None:
            return
        shares[busiest], shares[idlest], (costs[busiest], costs[idlest]) = best[1]


def planned_positions(
    lengths: Sequence[int], positions: Sequence[int], settings: MicroBatchingSettings, rows: int
) -> ShareCost | None:
    """The cost :func:`deal_by_length` evens out: the positions a share's micro-batches
    process as ``settings`` plans them, padding included, over the samples the window's
    collator keeps (whole micro-batches in the window's order; ``None`` under ``packed``, whose
    positions are the tokens). ``lengths`` and ``positions`` are every sample's padded length
    and own positions (a pair: its longer side, both sides), ``rows`` its rows per sample."""
    size = settings.batch_size
    if settings.mode is MicroBatching.PACKED:
        return None

    def plan(kept: list[int]) -> int:
        kept_lengths = [lengths[i] for i in kept]
        if settings.mode is MicroBatching.BY_LENGTH:  # groups of `size`, longest first
            return rows * size * sum(sorted(kept_lengths, reverse=True)[::size])
        if settings.mode is MicroBatching.FIXED:  # groups of `size` in the window's order
            return (
                rows
                * size
                * sum(max(kept_lengths[k : k + size]) for k in range(0, len(kept_lengths), size))
            )
        groups = plan_micro_batches(kept_lengths, settings, rows, [positions[i] for i in kept])
        return padded_positions(kept_lengths, groups, rows)

    def cost(share: list[int]) -> int:
        in_order = sorted(share)  # the window's order, in which an epoch's short last window
        kept = in_order[: whole_micro_batches(len(share), size)]  # keeps whole micro-batches
        return plan(kept) if kept else 0

    return cost


@dataclass(frozen=True)
class LengthIndex:
    """Every sample's padded length and own positions, in dataset order (for a preference
    pair: its longer side, and both sides; see exactga.data.micro_batching), and its rows."""

    lengths: list[int]
    positions: list[int]
    rows_per_sample: int = 1


def length_index(dataset: Dataset) -> LengthIndex:
    """The dataset's :class:`LengthIndex`; see [the length index]. Under ``torch.distributed``
    each process reads every ``world_size``-th sample and one ``all_gather_object`` shares
    them."""
    start = time.perf_counter()
    num_processes, process = 1, 0
    if dist.is_available() and dist.is_initialized():
        num_processes, process = dist.get_world_size(), dist.get_rank()
    mine = []
    for i in range(process, len(dataset), num_processes):  # type: ignore[arg-type]
        sample = dataset[i]
        mine.append((sample_length(sample), sample_positions(sample), 2 if is_pair(sample) else 1))
    entries = mine
    if num_processes > 1:
        parts: list[Any] = [None] * num_processes
        dist.all_gather_object(parts, mine)
        entries = [None] * len(dataset)  # type: ignore[arg-type]
        for part_process, part in enumerate(parts):
            entries[part_process::num_processes] = part
    log_rank_zero(
        f"exactga: length index of {len(entries):,} samples in "
        f"{time.perf_counter() - start:.2f} s over {num_processes} process(es) "
        "(rank_balancing: by_tokens)"
    )
    lengths, positions, rows = zip(*entries, strict=True) if entries else ((), (), (1,))
    return LengthIndex(list(lengths), list(positions), max(rows))


class LengthBalancedSampler(StatefulDistributedSampler):
    """``StatefulDistributedSampler`` whose windows are dealt by length: rank ``rank`` yields,
    window by window, its share of each ``window_size x num_replicas`` samples of the same
    shuffled order (``seed`` and the epoch, as torch's ``DistributedSampler``). Its state (the
    samples yielded) is the parent's. See [balanced ranks are exact].

    Args:
        dataset: the map-style dataset.
        index: every sample's lengths (:func:`length_index`).
        window_size: samples per window on each rank (``batch_size x ga``).
        micro_batching: how each rank cuts its share (the deal evens out what it processes).
        num_replicas, rank, shuffle, seed: as ``DistributedSampler``'s.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        index: LengthIndex,
        window_size: int,
        micro_batching: MicroBatchingSettings,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int = 0,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        assert len(index.lengths) == len(dataset), "one length per sample"  # type: ignore[arg-type]
        self.index = index
        self.window_size = window_size
        self.micro_batching = micro_batching

    def __iter__(self) -> Iterator[int]:
        self.yielded = 0
        if self.next_yielded is not None:  # a resumed loader's position (the parent's state)
            self.yielded, self.next_yielded = self.next_yielded, None
        for index in itertools.islice(self._rank_order(), self.yielded, None):
            self.yielded += 1
            yield index

    def _rank_order(self) -> Iterator[int]:
        order = self._global_order()
        global_window = self.window_size * self.num_replicas
        index = self.index
        for start in range(0, len(order), global_window):
            window = order[start : start + global_window]
            cost = planned_positions(
                [index.lengths[i] for i in window],
                [index.positions[i] for i in window],
                self.micro_batching,
                index.rows_per_sample,
            )
            tokens = [index.positions[i] for i in window]
            shares = deal_by_length(tokens, self.num_replicas, cost)
            yield from (window[i] for i in shares[self.rank])

    def _global_order(self) -> list[int]:
        """Every rank's samples in the order torch's ``DistributedSampler`` deals them from
        (rank ``r`` would take every ``num_replicas``-th from ``r``): the same permutation, the
        same padding to a multiple of the ranks."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        else:
            order = list(range(len(self.dataset)))  # type: ignore[arg-type]
        if self.drop_last:
            return order[: self.total_size]
        padding = self.total_size - len(order)
        return order + (order * math.ceil(padding / len(order)))[:padding]


def window_sampler(
    dataset: Dataset,
    rank_balancing: RankBalancing,
    *,
    window_size: int,
    micro_batching: MicroBatchingSettings,
    num_replicas: int,
    rank: int,
    shuffle: bool,
) -> StatefulDistributedSampler:
    """The sampler of exactga.data.loader's loader: torchdata's (seed 0, rank ``r`` of ``n`` reads
    every n-th sample of one shuffled order; see [data order] in exactga.data.loader), or under
    ``by_tokens`` with several ranks the same order dealt by length (a collective at start-up,
    on every process: :func:`length_index`)."""
    if rank_balancing is RankBalancing.BY_TOKENS and num_replicas > 1:
        return LengthBalancedSampler(
            dataset,
            index=length_index(dataset),
            window_size=window_size,
            micro_batching=micro_batching,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
        )
    return StatefulDistributedSampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=0
    )
