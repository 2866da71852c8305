"""Unit tier on 2 CPU ranks (gloo): empty micro-batches and windows under data parallelism.

Under FSDP every rank runs every micro-batch (see [empty micro-batches under FSDP] in
``exactga.accumulation.normalization``), so one with no loss token runs too, with a planted label
that keeps its loss finite and a weight of exactly 0. These tests run what a distributed recipe runs
(``micro_batches_to_run``, ``scale``, backward, then the ranks' gradient average) and compare
with the full-batch gradient of every rank's rows on one process.
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

from exactga.accumulation.loss_units import IGNORE_INDEX, plant_dummy_label


def rank_rows(layout: str, rank: int) -> list:
    """Four rows per rank, two micro-batches of two."""
    rows = make_rows()
    if layout == "one_empty_micro_batch":  # rank 1's first micro-batch has no loss token
        return rows[:4] if rank == 0 else masked(rows[4:6]) + rows[6:]
    if layout == "empty_rank":  # rank 1 has no loss token in the whole window
        return rows[:4] if rank == 0 else masked(rows[4:])
    assert layout == "empty_everywhere"
    return masked(rows[:4]) if rank == 0 else masked(rows[4:])


def _worker(rank: int, layout: str) -> dict:
    model = tiny_model()
    loss_fn = make_loss("chunked", model)
    normalizer = GroupingNormalizer(loss_fn, 2, dp_group=dist.group.WORLD)
    (window,) = normalizer.windows(split(rank_rows(layout, rank), 2))
    skipped = window.should_skip_step()
    num_run, losses = 0, []
    if not skipped:
        for mb in window.micro_batches_to_run():
            loss = micro_batch_loss(model, loss_fn, mb.batch)
            losses.append(float(loss))
            window.scale(loss, mb).backward()
            num_run += 1
        for param in model.parameters():  # what FSDP does: average over ranks
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    result = {
        "skipped": skipped,
        "num_run": num_run,
        "num_nonempty": len(list(window.nonempty_micro_batches())),
        "losses_finite": all(torch.isfinite(torch.tensor(losses)).tolist()),
        "global_tokens": window.num_global_units,
    }
    if not skipped:
        all_rows = rank_rows(layout, 0) + rank_rows(layout, 1)
        grad = flat_grad(model)
        result["grad_finite"] = bool(torch.isfinite(grad).all())
        result["rel_err"] = rel_err(grad, full_batch_grad(model, all_rows))
        result["global_loss_finite"] = bool(torch.isfinite(torch.tensor(window.global_mean_loss())))
    return result


@pytest.mark.parametrize("layout", ["one_empty_micro_batch", "empty_rank"])
def test_empty_micro_batches_run_with_weight_zero(layout: str, two_ranks) -> None:
    results = two_ranks(_worker, layout)
    for rank, result in enumerate(results):
        assert result["skipped"] is False  # rank 0 has tokens, so neither rank skips
        assert result["num_run"] == 2  # every rank runs both micro-batches
        assert result["losses_finite"] and result["grad_finite"]
        assert result["global_loss_finite"]
        assert result["rel_err"] <= EXACT_TOL, (rank, result)
    assert results[1]["num_nonempty"] == (1 if layout == "one_empty_micro_batch" else 0)


def test_window_empty_on_every_rank_is_skipped_everywhere(two_ranks) -> None:
    results = two_ranks(_worker, "empty_everywhere")
    assert [r["skipped"] for r in results] == [True, True]
    assert [r["global_tokens"] for r in results] == [0, 0]


def test_planted_label_leaves_the_callers_labels_and_count_alone() -> None:
    (batch,) = split(make_rows()[3:4], 1)  # the fully masked row
    planted = plant_dummy_label(batch)
    assert (batch["labels"] == IGNORE_INDEX).all()  # input untouched
    assert int((planted["labels"][:, 1:] != IGNORE_INDEX).sum()) == 1
    assert planted["tokens"] is batch["tokens"]


def test_one_rank_still_skips_empty_micro_batches() -> None:
    model = tiny_model()
    normalizer = GroupingNormalizer(make_loss("cross_entropy", model), 2)
    (window,) = normalizer.windows(split(masked(make_rows()[:2]) + make_rows()[4:6], 2))
    assert len(list(window.micro_batches_to_run())) == 1
    assert list(window.micro_batches_to_run()) == list(window.nonempty_micro_batches())
    assert (window.micro_batches[0].batch["labels"] == IGNORE_INDEX).all()  # nothing planted
