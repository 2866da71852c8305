"""Unit tier: accumulated gradients equal full-batch gradients under uneven masking.

A tiny Llama from torchtune's builders is trained on hand-made rows of very different lengths
and masks (some with the first label unmasked, one with every label masked). The full-batch
gradient of the window loss is the reference; every split into micro-batches must reproduce it.
"""

from __future__ import annotations

import math

import pytest
import torch
from grouping import GroupingNormalizer
from torch import nn
from torchtune.modules.loss import CEWithChunkedOutputLoss
from unit_utils import (
    EXACT_TOL,
    collate,
    flat_grad,
    full_batch_grad,
    make_loss,
    make_rows,
    masked,
    micro_batch_loss,
    reference_window_loss,
    rel_err,
    split,
    tiny_model,
)

from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    count_loss_tokens,
    count_unshifted_tokens,
    loss_denominator,
    shift_labels,
    verify_loss_denominator,
)
from exactga.accumulation.normalization import NormMode


def accumulated_grads(
    model: nn.Module,
    loss_fn: nn.Module,
    batches: list[dict],
    ga: int,
    mode: NormMode = NormMode.EXACT,
) -> list[torch.Tensor]:
    """One flat gradient per window, as the recipes accumulate it."""
    normalizer = GroupingNormalizer(loss_fn, ga, mode=mode)
    grads = []
    for window in normalizer.windows(batches):
        model.zero_grad(set_to_none=True)
        for mb in window.nonempty_micro_batches():
            window.scale(micro_batch_loss(model, loss_fn, mb.batch), mb).backward()
        window.finish_gradients(model)
        grads.append(flat_grad(model))
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("loss_kind", ["chunked", "cross_entropy"])
@pytest.mark.parametrize("ga", [1, 2, 4, 8])
def test_accumulated_gradient_equals_full_batch(loss_kind: str, ga: int) -> None:
    model = tiny_model()
    loss_fn = make_loss(loss_kind, model)
    rows = make_rows()
    reference = full_batch_grad(model, rows)
    (grad,) = accumulated_grads(model, loss_fn, split(rows, len(rows) // ga), ga)
    assert rel_err(grad, reference) <= EXACT_TOL


@pytest.mark.parametrize("mode", [NormMode.NAIVE, NormMode.POST_SCALE])
def test_baseline_modes_are_not_exact(mode: NormMode) -> None:
    """The same check catches the bugs it exists for: it is not vacuous."""
    model = tiny_model()
    loss_fn = make_loss("chunked", model)
    rows = make_rows()
    reference = full_batch_grad(model, rows)
    (grad,) = accumulated_grads(model, loss_fn, split(rows, 1), 8, mode=mode)
    # naive weights rows of 1 and 39 tokens alike; post_scale counts unmasked first labels.
    assert rel_err(grad, reference) > (1e-2 if mode is NormMode.NAIVE else 1e-4)


def test_partial_window_is_a_step_of_its_own() -> None:
    model = tiny_model()
    loss_fn = make_loss("chunked", model)
    rows = make_rows()
    grads = accumulated_grads(model, loss_fn, split(rows, 1), ga=3)
    assert len(grads) == 3  # 3 + 3 + 2 micro-batches
    for grad, window_rows in zip(grads, [rows[0:3], rows[3:6], rows[6:8]], strict=True):
        assert rel_err(grad, full_batch_grad(model, window_rows)) <= EXACT_TOL


def test_drop_partial_window_drops_it() -> None:
    loss_fn = CEWithChunkedOutputLoss()
    batches = split(make_rows(), 1)
    normalizer = GroupingNormalizer(loss_fn, 3, drop_partial_window=True)
    assert [len(w.micro_batches) for w in normalizer.windows(batches)] == [3, 3]
    assert normalizer.num_windows(len(batches)) == 2
    keep = GroupingNormalizer(loss_fn, 3)
    assert [len(w.micro_batches) for w in keep.windows(batches)] == [3, 3, 2]
    assert keep.num_windows(len(batches)) == 3


def test_windows_stop_at_the_end_of_each_epoch_and_at_max_windows() -> None:
    normalizer = GroupingNormalizer(CEWithChunkedOutputLoss(), 3)
    epoch = split(make_rows(), 2)  # 4 batches per epoch
    sizes = [[len(w.micro_batches) for w in normalizer.windows(epoch)] for _ in range(2)]
    assert sizes == [[3, 1], [3, 1]]  # the short window is never topped up from the next epoch
    assert len(list(normalizer.windows(epoch, max_windows=1))) == 1


def test_an_epoch_read_to_its_last_window_leaves_the_loader_exhausted() -> None:
    """A stateful loader must see StopIteration, or a resumed run starts an empty epoch."""
    normalizer = GroupingNormalizer(CEWithChunkedOutputLoss(), 2)
    epoch = iter(split(make_rows(), 2))  # 4 batches: exactly 2 windows
    assert len(list(normalizer.windows(epoch, max_windows=2))) == 2
    assert next(epoch, None) is None


def test_zero_token_micro_batch_is_skipped_inside_a_window() -> None:
    rows = make_rows()
    normalizer = GroupingNormalizer(CEWithChunkedOutputLoss(), 8)
    (window,) = normalizer.windows(split(rows, 1))
    counts = [mb.num_units for mb in window.micro_batches]
    assert counts[3] == 0
    assert [mb.num_units for mb in window.nonempty_micro_batches()] == counts[:3] + counts[4:]
    assert not window.should_skip_step()


def test_zero_token_window_skips_the_step_and_leaves_weights_unchanged() -> None:
    model = tiny_model()
    loss_fn = make_loss("chunked", model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    empty = masked(make_rows()[:4])
    normalizer = GroupingNormalizer(loss_fn, 2)
    batches = split(make_rows()[:4], 2) + split(empty, 2)
    snapshots = []
    for window in normalizer.windows(batches):
        if not window.should_skip_step():
            for mb in window.nonempty_micro_batches():
                window.scale(micro_batch_loss(model, loss_fn, mb.batch), mb).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        snapshots.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    assert torch.isfinite(snapshots[-1]).all()
    assert torch.equal(snapshots[0], snapshots[1])
    assert math.isnan(list(normalizer.windows(split(empty, 2)))[0].local_mean_loss())


def test_single_micro_batch_on_one_rank_applies_no_scaling_op() -> None:
    model = tiny_model()
    loss_fn = make_loss("chunked", model)
    (window,) = GroupingNormalizer(loss_fn, 1).windows([collate(make_rows())])
    (mb,) = window.nonempty_micro_batches()
    loss = micro_batch_loss(model, loss_fn, mb.batch)
    assert window.scale(loss, mb) is loss
    (window,) = GroupingNormalizer(loss_fn, 2).windows(split(make_rows(), 4))
    mb = next(window.nonempty_micro_batches())
    loss = micro_batch_loss(model, loss_fn, mb.batch)
    assert window.scale(loss, mb) is not loss


def test_logged_loss_is_the_exact_window_loss() -> None:
    model = tiny_model()
    loss_fn = make_loss("cross_entropy", model)
    rows = make_rows()
    batch = collate(rows)
    with torch.no_grad():
        expected = float(reference_window_loss(model(batch["tokens"]), batch["labels"]))
        (window,) = GroupingNormalizer(loss_fn, 4).windows(split(rows, 2))
        for mb in window.nonempty_micro_batches():
            window.scale(micro_batch_loss(model, loss_fn, mb.batch), mb)
    assert window.local_mean_loss() == pytest.approx(expected, rel=1e-6)


def test_bf16_accumulation_matches_full_batch_to_bf16_precision() -> None:
    model = tiny_model(torch.bfloat16)
    loss_fn = make_loss("chunked", model)
    rows = make_rows()
    reference = full_batch_grad(model, rows)
    (grad,) = accumulated_grads(model, loss_fn, split(rows, 1), 8)
    assert rel_err(grad, reference) < 3e-2


def test_token_count_is_taken_after_the_shift() -> None:
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7], [IGNORE_INDEX, IGNORE_INDEX, 8, 9]])
    assert count_loss_tokens(labels) == 4  # [6, -, 7] and [-, 8, 9]
    assert count_unshifted_tokens(labels) == 5  # stock torchtune also counts the leading 5
    shifted = shift_labels(labels)
    assert shifted.tolist() == [[6, IGNORE_INDEX, 7, IGNORE_INDEX], [IGNORE_INDEX, 8, 9, -100]]
    assert int((shifted != IGNORE_INDEX).sum()) == count_loss_tokens(labels)


@pytest.mark.parametrize("loss_fn", [CEWithChunkedOutputLoss(4), nn.CrossEntropyLoss()])
def test_denominator_check_accepts_mean_losses(loss_fn: nn.Module) -> None:
    labels = collate(make_rows())["labels"]
    assert loss_denominator(loss_fn, shift_labels(labels)) == pytest.approx(
        count_loss_tokens(labels)
    )
    verify_loss_denominator(loss_fn, labels)


class _MeanOverAllPositions(nn.Module):
    """A loss that divides by every position, padding included: a classic silent bug."""

    ignore_index = IGNORE_INDEX

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, labels, reduction="sum") / labels.numel()


@pytest.mark.parametrize(
    "loss_fn", [nn.CrossEntropyLoss(reduction="sum"), _MeanOverAllPositions()], ids=str
)
def test_denominator_check_fails_loudly_on_a_disagreeing_loss(loss_fn: nn.Module) -> None:
    labels = collate(make_rows())["labels"]
    with pytest.raises(ValueError, match="divides the first batch by"):
        verify_loss_denominator(loss_fn, labels)


def test_normalizer_checks_the_first_nonempty_batch() -> None:
    batches = split(make_rows(), 2)
    bad = GroupingNormalizer(nn.CrossEntropyLoss(reduction="sum"), 2)
    with pytest.raises(ValueError, match="exactga counts"):
        next(bad.windows(batches))


def test_bad_settings_name_the_key() -> None:
    with pytest.raises(ValueError, match="'loss_normalization'='mean': choose one of exact"):
        GroupingNormalizer(CEWithChunkedOutputLoss(), 2, mode="mean")
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        GroupingNormalizer(CEWithChunkedOutputLoss(), 0)
