"""Unit tier on 2 CPU ranks (gloo): the data-parallel factor and the one count reduction.

Each rank accumulates its own share of the rows, gradients are then averaged across ranks as
DDP/FSDP do, and the result must equal the full-batch gradient of all rows on one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from grouping import GroupingNormalizer
from unit_utils import (
    EXACT_TOL,
    flat_grad,
    full_batch_grad,
    make_loss,
    make_rows,
    masked,
    micro_batch_loss,
    rel_err,
    split,
    tiny_model,
)

WORLD_SIZE = 2


def rank_rows(layout: str, rank: int) -> list:
    rows = make_rows()
    if layout == "ragged":  # rank 0: six rows, most of the tokens; rank 1: two short rows
        return rows[:6] if rank == 0 else rows[6:]
    # "empty_rank": rank 1 holds only fully masked rows
    return rows[:6] if rank == 0 else masked(rows[6:])


def _worker(rank: int, layout: str) -> dict:
    model = tiny_model()
    loss_fn = make_loss("chunked", model)
    all_rows = rank_rows(layout, 0) + rank_rows(layout, 1)
    reference = full_batch_grad(model, all_rows)

    rows = rank_rows(layout, rank)
    normalizer = GroupingNormalizer(loss_fn, 2, dp_group=dist.group.WORLD)
    calls = _count_all_reduces()
    (window,) = normalizer.windows(split(rows, len(rows) // 2))
    for mb in window.nonempty_micro_batches():
        window.scale(micro_batch_loss(model, loss_fn, mb.batch), mb).backward()
    skipped = window.should_skip_step()
    num_count_reductions = calls()
    for param in model.parameters():  # what DDP/FSDP do: average over ranks
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    return {
        "rel_err": rel_err(flat_grad(model), reference),
        "global_tokens": window.num_global_units,
        "skipped": skipped,
        "count_reductions": num_count_reductions,
    }


def _count_all_reduces():
    """Count ``dist.all_reduce`` calls from now on; returns a function reading the count."""
    original = dist.all_reduce
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    return lambda: (setattr(dist, "all_reduce", original), len(calls))[1]


@pytest.mark.parametrize("layout", ["ragged", "empty_rank"])
def test_two_ranks_accumulate_the_full_batch_gradient(layout: str, two_ranks) -> None:
    results = two_ranks(_worker, layout)
    expected_tokens = sum(
        mb.num_units
        for rank in range(WORLD_SIZE)
        for window in GroupingNormalizer(make_loss("cross_entropy", tiny_model()), 2).windows(
            split(rank_rows(layout, rank), len(rank_rows(layout, rank)) // 2)
        )
        for mb in window.micro_batches
    )
    for result in results:
        assert result["rel_err"] <= EXACT_TOL
        assert result["global_tokens"] == expected_tokens
        assert result["skipped"] is False
        assert result["count_reductions"] == 1  # one token-count reduction per window
