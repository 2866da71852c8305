"""Preference pairs in the loader and the step bookkeeping: a pair is padded by its longer side,
costs both rows in a token budget, and is logged as a pair (not a loss token). In-process, on
hand-made pairs; see [micro-batching modes] in exactga.data.micro_batching."""

from __future__ import annotations

import pytest
from test_steps import Clock, Recorder, _book

from exactga.accumulation.step import StepOutcome
from exactga.config.options import MicroBatching
from exactga.data.micro_batching import (
    MicroBatchingSettings,
    PaddingMeter,
    WindowCollator,
    WindowWork,
    padded_positions,
    plan_micro_batches,
)
from exactga.dpo.preference import collate_pairs


def pair(chosen: int, rejected: int) -> dict[str, list[int]]:
    """A pair whose sides have these lengths; its responses are all but the first token."""
    return {
        "chosen_input_ids": [5] * chosen,
        "chosen_labels": [-100] + [5] * (chosen - 1),
        "rejected_input_ids": [6] * rejected,
        "rejected_labels": [-100] + [6] * (rejected - 1),
    }


# Longer sides 9, 3, 12, 4: a short chosen with a long rejected pads like a long pair.
PAIRS = [pair(2, 9), pair(3, 2), pair(12, 4), pair(4, 4)]


def collate(settings: MicroBatchingSettings):
    return WindowCollator(settings, window_size=len(PAIRS), collate=collate_pairs)(PAIRS)


def test_by_length_sorts_pairs_by_their_longer_side() -> None:
    window = collate(MicroBatchingSettings(MicroBatching.BY_LENGTH, batch_size=2))
    first, second = (mb["tokens"] for mb in window.micro_batches)
    assert first.shape == (4, 12) and second.shape == (4, 4)  # pairs 2 and 0, then 3 and 1
    assert window.num_sample_positions == sum(
        len(p["chosen_input_ids"]) + len(p["rejected_input_ids"]) for p in PAIRS
    )
    assert window.num_fixed_positions == 2 * (2 * 9 + 2 * 12)  # stock's order: (0, 1), (2, 3)
    processed = sum(mb["tokens"].numel() for mb in window.micro_batches)
    assert processed == 2 * (2 * 12 + 2 * 4) < window.num_fixed_positions


def test_a_token_budget_counts_both_rows_of_a_pair() -> None:
    lengths = [9, 3, 12, 4]
    groups = plan_micro_batches(
        lengths, MicroBatchingSettings(MicroBatching.TOKEN_BUDGET, 4, 24), 2
    )
    assert groups == [[2], [0], [3, 1]]  # 2 x 12 fills 24; 2 x 2 x 9 would be 36
    assert all(2 * len(g) * max(lengths[i] for i in g) <= 24 for g in groups)
    assert padded_positions(lengths, groups, 2) == 24 + 18 + 16
    window = collate(MicroBatchingSettings(MicroBatching.TOKEN_BUDGET, 4, 24))
    assert [mb["tokens"].shape for mb in window.micro_batches] == [(2, 12), (2, 9), (4, 4)]


def test_a_logged_preference_step_names_its_pairs_and_counts_their_own_tokens() -> None:
    recorder = Recorder()
    book, _ = _book(recorder, world_size=2, clock=Clock(10.0, 14.0, 99.0))
    windows = list(book.windows(0))
    for window in windows:  # as the normaliser opens a window of PreferencePairs
        window.units_name, window.num_sample_positions = "pairs", 100  # the rank's own tokens
    for window in windows:
        book.end_step(window, StepOutcome(skipped=False))
    metrics = recorder.logged[2]
    assert "loss_tokens" not in metrics and metrics["pairs"] == windows[1].num_global_units
    assert metrics["tokens_per_second_per_gpu"] == pytest.approx(2 * 100 / 4.0)  # rank's, 4 s


def test_the_padding_meter_names_the_rate_of_the_units_it_counts() -> None:
    meter = PaddingMeter()
    meter.add(WindowWork(num_positions=100, num_loss_tokens=6, units_name="pairs"))
    metrics = meter.read_interval(elapsed_s=2.0)
    assert metrics["throughput/pairs_per_second"] == 3.0
    assert "throughput/loss_tokens_per_second" not in metrics
