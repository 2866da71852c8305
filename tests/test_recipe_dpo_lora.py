"""LoRA DPO through ``tune run``: every split of the same pairs takes the full-batch step.

The done-when of the DPO issue, on one device: the shipped variable-length pairs (their first
20: two windows of 8 and a partial one of 4 per epoch), 2 epochs, fp32. Splits 1x8, 2x4 (also
with the reference log-probs precomputed) and 4x2 cut into micro-batches by a token budget end
within 2e-6 of each other (relative L2 of the adapters' difference over their update), partial
windows included; 8x1 against 1x8 where the partial window is dropped (a window of 8 pairs in
one micro-batch cannot hold 4). Stock's
weighting and stock's recipe on the same data are compared in docs/dpo.md
(benchmarks/dpo_stock_vs_exactga.py).
"""

from __future__ import annotations

import math

import pytest
from dpo_utils import (
    LORA_SPLITS,
    assert_same_validation,
    initial_adapters,
    lora_dpo_run,
    trained_adapters,
    validation_figures,
)
from recipe_utils import read_scalars, relative_l2

# One group with tests/test_recipe_dpo_distributed.py: the two modules' runs are made together
# (tests/dpo_utils.py).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dpo_recipes")]

FLOOR = 2e-6  # fp32: the bound for every split


@pytest.fixture(scope="module")
def runs(run_once) -> dict:
    return {split: lora_dpo_run(run_once, split) for split in LORA_SPLITS}


@pytest.fixture(scope="module")
def initial() -> dict:
    return initial_adapters()


@pytest.mark.parametrize("epoch", [0, 1])
@pytest.mark.parametrize("split", ["2x4", "4x2_budget", "4x2_packed", "2x4_precomputed"])
def test_every_split_takes_the_full_batch_step(runs, initial, split: str, epoch: int) -> None:
    reference = trained_adapters(runs["1x8"], epoch)
    gap = relative_l2(trained_adapters(runs[split], epoch), reference, initial)
    assert gap <= FLOOR, f"{split} vs 1x8 after epoch {epoch}: relative L2 {gap:.2e}"


@pytest.mark.parametrize("split", ["2x4", "4x2_budget", "4x2_packed", "2x4_precomputed"])
def test_every_split_reports_the_same_validation(runs, split: str) -> None:
    """Validated at each epoch's end (steps 3 and 6) on 6 pairs, whatever the training split
    (with a precomputed reference, validation runs the adapters-off reference itself)."""
    assert list(validation_figures(runs["1x8"])["val/loss"]) == [3, 6]
    assert_same_validation(runs[split], runs["1x8"], rel=1e-5)


def test_the_adapters_moved_far_beyond_the_bound(runs, initial) -> None:
    """The bound is relative to the update; the update is ~10% of the adapters' norm."""
    trained = trained_adapters(runs["1x8"], 1)
    moved_sq = sum(
        float((trained[k].double() - initial[k].double()).square().sum()) for k in initial
    )
    norm_sq = sum(float(initial[k].double().square().sum()) for k in initial)
    assert (moved_sq / norm_sq) ** 0.5 > 0.05


def test_one_micro_batch_of_eight_pairs_is_eight_of_one(runs, initial) -> None:
    reference = trained_adapters(runs["1x8_drop"], 1)
    gap = relative_l2(trained_adapters(runs["8x1"], 1), reference, initial)
    assert gap <= FLOOR, f"8x1 vs 1x8 (partial windows dropped): relative L2 {gap:.2e}"


def test_the_partial_window_is_a_step_of_its_own(runs, initial) -> None:
    """Its 4 pairs are one step, weighed as 4 (stock runs them backward without a step, into
    the next epoch's first); dropping it trains something measurably else."""
    assert read_scalars(runs["1x8"] / "logs")["pairs"] == [8, 8, 4] * 2
    assert read_scalars(runs["1x8_drop"] / "logs")["pairs"] == [8, 8] * 2
    reference = trained_adapters(runs["1x8"], 1)
    gap = relative_l2(trained_adapters(runs["1x8_drop"], 1), reference, initial)
    assert gap > 1e3 * FLOOR, "the partial window changed nothing, so the tests above prove little"


@pytest.mark.parametrize("split", ["2x4", "4x2_budget"])
def test_losses_and_stock_metrics_are_exact_window_values(runs, split: str) -> None:
    """Loss, rewards and log-probs are means over the window's pairs, whatever the split
    (stock logs the last micro-batch's means)."""
    reference, scalars = read_scalars(runs["1x8"] / "logs"), read_scalars(runs[split] / "logs")
    for name in (
        "loss",
        "rewards/chosen",
        "rewards/margins",
        "rewards/accuracies",
        "log_probs/chosen",
        "log_probs/rejected",
    ):
        assert scalars[name] == pytest.approx(reference[name], rel=1e-5, abs=1e-6), name


def test_the_reference_is_the_model_without_its_adapters(runs) -> None:
    """lora_b starts at zero, so at the first step policy and reference agree: every reward is
    0 and the loss is log 2 exactly as DPO defines it; a later step has moved away."""
    scalars = read_scalars(runs["1x8"] / "logs")
    assert scalars["loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert scalars["rewards/chosen"][0] == scalars["rewards/rejected"][0] == 0.0
    assert abs(scalars["rewards/margins"][-1]) > 1e-3


def test_regrouping_pairs_by_length_pads_less(runs) -> None:
    """Sorting a window's pairs by their longer side saves positions over stock's order (less
    than on SFT data: a chosen row padded to its rejected one is padding no grouping removes)."""
    log = (runs["2x4"] / "output.txt").read_text()
    saved = float(log.split("% saved)")[0].rsplit("(", 1)[1])
    assert saved > 0, f"by_length saved {saved}% of fixed micro-batches' positions"
