"""Unit tier: how a window's samples are split into micro-batches (``exactga.data.micro_batching``),
the loader of windows (``exactga.data.loader``), and why the split changes nothing but rounding.

See [regrouping is exact] and [micro-batching modes] in ``exactga.data.micro_batching``. The
recipes' own parity through ``tune run`` is in tests/test_micro_batching_recipes.py.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from grouping import GroupingNormalizer
from unit_utils import (
    EXACT_TOL,
    collate,
    flat_grad,
    full_batch_grad,
    make_loss,
    make_rows,
    micro_batch_loss,
    rel_err,
    tiny_model,
)

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.data.loader import build_dataloader
from exactga.data.micro_batching import (
    MicroBatching,
    MicroBatchingSettings,
    SampleWindow,
    WindowCollator,
    plan_micro_batches,
)

FIXED, BY_LENGTH, TOKEN_BUDGET, PACKED = MicroBatching


def settings(mode: MicroBatching, batch_size: int = 2, tokens: int | None = None):
    return MicroBatchingSettings(mode=mode, batch_size=batch_size, micro_batch_tokens=tokens)


# --- planning ------------------------------------------------------------------------------


def test_fixed_keeps_the_loader_order() -> None:
    groups = plan_micro_batches([5, 9, 1, 7, 3, 3], settings(FIXED))
    assert groups == [[0, 1], [2, 3], [4, 5]]


def test_by_length_sorts_longest_first_and_keeps_ties_in_loader_order() -> None:
    groups = plan_micro_batches([5, 9, 1, 7, 3, 3, 7, 2], settings(BY_LENGTH, batch_size=3))
    assert groups == [[1, 3, 6], [0, 4, 5], [7, 2]]
    # Every sample once, micro-batches of batch_size, and the same plan on the same lengths.
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert plan_micro_batches([5, 9, 1, 7, 3, 3, 7, 2], settings(BY_LENGTH, 3)) == groups


def test_token_budget_fills_each_micro_batch_up_to_the_budget() -> None:
    lengths = [100, 30, 500, 60, 40, 40, 20, 10]
    groups = plan_micro_batches(lengths, settings(TOKEN_BUDGET, tokens=128))
    # 500 alone (longer than the budget); 3 x 60 = 180 and 4 x 40 = 160 would not fit.
    assert groups == [[2], [0], [3, 4], [5, 1, 6], [7]]
    for group in groups:
        width = max(lengths[i] for i in group)
        assert len(group) == 1 or len(group) * width <= 128


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_never_exceeds_the_budget_on_random_lengths(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 700) for _ in range(64)]
    groups = plan_micro_batches(lengths, settings(TOKEN_BUDGET, batch_size=8, tokens=1024))
    assert sorted(i for g in groups for i in g) == list(range(64))
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 1024


def test_a_short_last_window_keeps_whole_micro_batches_in_loader_order() -> None:
    rows = make_rows()[:7]  # 7 samples, batch_size 2: the seventh is left out, as drop_last does
    samples = [{"tokens": t.tolist(), "labels": lab.tolist()} for t, lab in rows]
    window = WindowCollator(settings(BY_LENGTH), 8, _collate_lists)(samples)
    assert window.num_samples == 6 and window.is_partial
    kept = sorted(tuple(row) for mb in window.micro_batches for row in _rows_of(mb))
    assert kept == sorted(tuple(_trim(t.tolist())) for t, _ in rows[:6])
    assert window.num_sample_positions == sum(len(t) for t, _ in rows[:6])
    lengths = [len(t) for t, _ in rows[:6]]
    assert window.num_fixed_positions == sum(2 * max(lengths[i : i + 2]) for i in (0, 2, 4))


def _collate_lists(samples: list[dict]) -> dict[str, torch.Tensor]:
    return collate([(torch.tensor(s["tokens"]), torch.tensor(s["labels"])) for s in samples])


def _rows_of(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    return [_trim(row.tolist()) for row in batch["tokens"]]


def _trim(row: list[int]) -> list[int]:
    """A row without its right padding (token id 0; make_rows draws ids from 1)."""
    while row and row[-1] == 0:
        row.pop()
    return row


# --- the split is exact ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MicroBatching))
def test_every_split_gives_the_full_batch_gradient(mode: MicroBatching) -> None:
    rows = make_rows()
    samples = [{"tokens": t.tolist(), "labels": lab.tolist()} for t, lab in rows]
    model = tiny_model()
    loss_fn = make_loss("chunked", model)
    collator = WindowCollator(settings(mode, batch_size=2, tokens=64), 8, _collate_lists)
    window_samples = collator(samples)
    if mode is not FIXED:
        assert window_samples.num_sample_positions < window_samples.num_fixed_positions
    (window,) = GroupingNormalizer(loss_fn, 4).windows([window_samples])
    for mb in window.micro_batches_to_run():
        window.scale(micro_batch_loss(model, loss_fn, mb.batch), mb).backward()
    assert rel_err(flat_grad(model), full_batch_grad(model, rows)) < EXACT_TOL


def test_skipped_empty_micro_batches_count_neither_as_processed_nor_as_padding() -> None:
    """On one rank a micro-batch without a loss token is skipped, so its samples' positions
    leave the padding figure too (it once went negative on prompt-masked data)."""
    lengths = [9, 9, 5, 5, 3, 3, 2, 2]
    samples = []
    for length in lengths:
        labels = list(range(1, length + 1))
        if length == 5:  # the by_length micro-batch of the two 5s has no loss token
            labels = [IGNORE_INDEX] * length
        samples.append({"tokens": list(range(1, length + 1)), "labels": labels})
    collator = WindowCollator(settings(BY_LENGTH, batch_size=2), 8, _collate_lists)
    (window,) = GroupingNormalizer(make_loss("plain", tiny_model()), 4).windows([collator(samples)])

    work = window.work()

    assert [mb.num_units for mb in window.micro_batches] == [16, 0, 4, 2]
    assert work.num_positions == 2 * 9 + 2 * 3 + 2 * 2  # the empty micro-batch is not run
    assert work.num_sample_positions == 9 + 9 + 3 + 3 + 2 + 2  # nor are its samples counted
    assert 1 - work.num_sample_positions / work.num_positions >= 0


# --- the loader of windows ---------------------------------------------------------------------


def windows_of(dataset_and_tokenizer, mode, batch_size=8, ga=8, tokens=None, **kwargs):
    dataset, tokenizer = dataset_and_tokenizer
    return build_dataloader(
        dataset,
        batch_size=batch_size,
        gradient_accumulation_steps=ga,
        micro_batching=settings(mode, batch_size, tokens),
        shuffle=True,
        collate_fn="torchtune.data.padded_collate_sft",
        padding_idx=tokenizer.pad_id,
        ignore_idx=IGNORE_INDEX,
        **kwargs,
    )


@pytest.mark.parametrize("budget", [1024, 300])
def test_token_budget_holds_on_every_window_of_an_epoch_of_the_bundled_data(
    bundled_dataset, budget: int
) -> None:
    loader = windows_of(bundled_dataset, TOKEN_BUDGET, batch_size=64, ga=1, tokens=budget)
    num_windows = num_alone = 0
    for window in loader:
        num_windows += 1
        assert window.num_samples == 64
        assert sum(len(mb["tokens"]) for mb in window.micro_batches) == 64
        for mb in window.micro_batches:
            if mb["tokens"].numel() > budget:
                assert len(mb["tokens"]) == 1, "only a sample longer than the budget may exceed it"
                num_alone += 1
    assert num_windows == len(loader) == len(bundled_dataset[0]) // 64
    assert (num_alone > 0) == (budget == 300)  # samples reach 512 tokens, never 1024


def test_windows_hold_the_samples_of_the_fixed_loader_in_the_same_steps(bundled_dataset) -> None:
    fixed = windows_of(bundled_dataset, FIXED, batch_size=4, ga=3)
    by_length = windows_of(bundled_dataset, BY_LENGTH, batch_size=4, ga=3)
    for step, (a, b) in enumerate(zip(fixed, by_length, strict=True)):
        assert _sample_set(a) == _sample_set(b), f"window {step} holds other samples"
        assert sum(mb["tokens"].numel() for mb in b.micro_batches) <= a.num_fixed_positions
        if step == 20:
            break


def _sample_set(window: SampleWindow) -> list[tuple[int, ...]]:
    return sorted(tuple(_trim(row.tolist())) for mb in window.micro_batches for row in mb["tokens"])


@pytest.mark.parametrize("drop_partial_window", [False, True])
def test_loader_length_counts_the_windows_it_yields(bundled_dataset, drop_partial_window) -> None:
    # 2069 samples on one rank in windows of 5 x 7 = 35: 59 full and one of 4 samples, which
    # holds no whole micro-batch of 5, so it is no window; with 2 ranks each has 1035 samples:
    # 29 full windows and one of 20 = 4 micro-batches.
    for num_replicas, expected in [(1, 59), (2, 29 if drop_partial_window else 30)]:
        loader = windows_of(
            bundled_dataset,
            FIXED,
            batch_size=5,
            ga=7,
            drop_partial_window=drop_partial_window,
            num_replicas=num_replicas,
        )
        assert len(loader) == expected
        assert sum(1 for _ in loader) == expected


def test_a_loader_resumed_mid_epoch_goes_on_with_the_same_windows(bundled_dataset) -> None:
    loader = windows_of(bundled_dataset, TOKEN_BUDGET, batch_size=8, ga=2, tokens=700)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    expected = [_sample_set(next(iterator)) for _ in range(2)]
    resumed = windows_of(bundled_dataset, TOKEN_BUDGET, batch_size=8, ga=2, tokens=700)
    resumed.load_state_dict(state)
    got = [_sample_set(window) for _, window in zip(range(2), resumed, strict=False)]
    assert got == expected


def test_a_checkpoint_of_the_micro_batch_loader_is_refused_with_a_message(bundled_dataset):
    loader = windows_of(bundled_dataset, FIXED)
    with pytest.raises(ValueError, match="loaded micro-batches, not windows"):
        loader.load_state_dict({"_num_yielded": 3})


# --- two ranks with unequal token-budget plans ---------------------------------------------------


def rank_samples(rank: int) -> list[dict]:
    """Rank 0: eight short rows (one micro-batch under a budget of 64 positions at width 8);
    rank 1: the make_rows rows, which the same budget cuts into several micro-batches."""
    if rank == 0:
        gen = torch.Generator().manual_seed(1)
        rows = [(torch.randint(1, 64, (8,), generator=gen),) * 2 for _ in range(8)]
    else:
        rows = make_rows()
    return [{"tokens": t.tolist(), "labels": lab.tolist()} for t, lab in rows]


def _budget_worker(rank: int) -> dict:
    model = tiny_model()
    loss_fn = make_loss("chunked", model)
    collator = WindowCollator(settings(TOKEN_BUDGET, batch_size=2, tokens=64), 8, _collate_lists)
    normalizer = GroupingNormalizer(loss_fn, 4, dp_group=dist.group.WORLD)
    (window,) = normalizer.windows([collator(rank_samples(rank))])
    num_run = 0
    for mb in window.micro_batches_to_run():
        window.scale(micro_batch_loss(model, loss_fn, mb.batch), mb).backward()
        num_run += 1
    for param in model.parameters():  # what FSDP does: average over ranks
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    all_rows = [
        (torch.tensor(s["tokens"]), torch.tensor(s["labels"]))
        for r in (0, 1)
        for s in rank_samples(r)
    ]
    return {
        "num_planned": len(window.micro_batches),
        "num_run": num_run,
        "num_fillers": window.num_filler_micro_batches(),
        "positions_per_rank": window.positions_per_rank(),
        "rel_err": rel_err(flat_grad(model), full_batch_grad(model, all_rows)),
    }


def test_ranks_with_fewer_budget_micro_batches_run_zero_weight_fillers(two_ranks) -> None:
    rank0, rank1 = two_ranks(_budget_worker)
    assert rank0["num_planned"] == 1 < rank1["num_planned"]
    assert rank0["num_run"] == rank1["num_run"] == rank1["num_planned"]
    assert rank0["num_fillers"] == rank1["num_planned"] - 1 and rank1["num_fillers"] == 0
    assert rank0["positions_per_rank"] == rank1["positions_per_rank"]
    assert rank0["positions_per_rank"][0] == 64
    for result in (rank0, rank1):
        assert result["rel_err"] < EXACT_TOL
