"""GRPO through ``tune run``: the step does not depend on how rollouts are split.

The issue's done-when: for each ``loss_aggregation``, with ``ppo_epochs`` 1 and 2, the trained
weights of 1 rank x GA 1, 1 rank x GA 4 and 2 ranks x GA 2 (one global batch of 4 prompts x 4
completions, 2 optimizer steps, fp32) land within a relative L2 of 1e-5 of each other; the
``naive`` baseline (each micro-batch's own mean over GA) is measurably off. Every one-rank run
is made in one launch and every two-rank run in another (tests/many_runs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from grpo_utils import RECIPE, SPLITS, grpo_args, initial_weights, trained_weights
from many_runs import Run, launch_runs
from recipe_utils import read_scalars, relative_l2

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("grpo")]

FLOOR = 1e-5  # the bound, fp32
AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
# (ppo_epochs, rollout steps): two optimizer steps either way.
PPO = {1: 2, 2: 1}


def _name(aggregation: str, ppo_epochs: int, split: str, mode: str = "exact") -> str:
    return f"{aggregation}_ppo{ppo_epochs}_{split}_{mode}"


def _runs(root: Path, nproc: int) -> list[Run]:
    runs = []
    for aggregation in AGGREGATIONS:
        for ppo_epochs, num_steps in PPO.items():
            for split, (ranks, overrides) in SPLITS.items():
                # The baseline once per aggregation, where it is meant to differ.
                naive = split == "1rank_ga4" and ppo_epochs == 1
                modes = ["exact", "naive"] if naive else ["exact"]
                for mode in modes if ranks == nproc else []:
                    out = root / _name(aggregation, ppo_epochs, split, mode)
                    args = grpo_args(
                        out,
                        loss_aggregation=aggregation,
                        ppo_epochs=ppo_epochs,
                        num_steps=num_steps,
                        loss_normalization=mode,
                        micro_batching="fixed",  # the naive baseline accepts only fixed
                        **overrides,
                    )
                    runs.append(Run(RECIPE, args, out))
    return runs


PARITY = "ga_parity_token_mean"


def _parity_run(root: Path) -> Run:
    """The GA parity report on the same config (token_mean, ppo_epochs 1): its full batch and
    its exact 4x4 split must take the recipe's own steps (see test_the_parity_report...)."""
    out = root / PARITY
    args = grpo_args(
        out,
        loss_aggregation="token_mean",
        micro_batching="fixed",
        **{
            "parity.splits": "[4x4]",
            "parity.loss_aggregations": "[token_mean]",
            "parity.modes": "[exact]",
            "parity.micro_batching": "[fixed]",
            "parity.num_steps": PPO[1],
        },
    )
    return Run("recipes/ga_parity.py", args, out)


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    def make(root: Path) -> None:
        tests_on_path = {"PYTHONPATH": str(Path(__file__).parent)}  # grpo_rewards
        launch_runs([*_runs(root, 0), _parity_run(root)], nproc=0, extra_env=tests_on_path)
        launch_runs(_runs(root, 2), nproc=2, extra_env=tests_on_path)

    root = run_once("grpo_parity_runs", make)
    for folder in root.iterdir():
        if (folder / "returncode").exists():
            output = (folder / "output.txt").read_text()
            assert (folder / "returncode").read_text() == "0", f"{folder.name}\n{output[-4000:]}"
    return root


@pytest.mark.parametrize("ppo_epochs", sorted(PPO))
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("split", ["1rank_ga4", "2ranks_ga2"])
def test_split_trains_the_full_batch_step(runs, aggregation, ppo_epochs, split) -> None:
    reference = runs / _name(aggregation, ppo_epochs, "1rank_ga1")
    initial = initial_weights(reference)
    trained = trained_weights(runs / _name(aggregation, ppo_epochs, split))
    gap = relative_l2(trained, trained_weights(reference), initial)
    assert gap <= FLOOR, f"{aggregation}, ppo_epochs {ppo_epochs}, {split} vs GA 1: {gap:.2e}"


def test_naive_baseline_is_off_for_token_mean(runs) -> None:
    """Each micro-batch's own token mean divided by GA is not the step (so the test above can
    fail): the micro-batches hold different numbers of completion tokens."""
    reference = runs / _name("token_mean", 1, "1rank_ga1")
    naive = trained_weights(runs / _name("token_mean", 1, "1rank_ga4", "naive"))
    gap = relative_l2(naive, trained_weights(reference), initial_weights(reference))
    assert gap > 100 * FLOOR, f"naive GA 4 only {gap:.2e} from GA 1"


@pytest.mark.parametrize("aggregation", ["sequence_mean", "constant"])
def test_naive_baseline_is_exact_when_micro_batches_hold_equal_completions(runs, aggregation):
    """Completions are the units here and every micro-batch holds 4: naive's 1/GA is then each
    micro-batch's share, so naive lands with exact (see docs/grpo.md)."""
    reference = runs / _name(aggregation, 1, "1rank_ga1")
    naive = trained_weights(runs / _name(aggregation, 1, "1rank_ga4", "naive"))
    gap = relative_l2(naive, trained_weights(reference), initial_weights(reference))
    assert gap <= FLOOR, f"{aggregation}: naive GA 4 {gap:.2e} from GA 1"


def test_completions_vary_in_length(runs) -> None:
    """Lengths differ, so the three denominators differ (else the parity shows nothing)."""
    scalars = read_scalars(runs / _name("token_mean", 1, "1rank_ga1") / "logs")
    assert scalars["completions/max_length"][0] > scalars["completions/mean_length"][0] > 1.0


@pytest.mark.parametrize("split", ["1rank_ga4", "2ranks_ga2"])
def test_logged_step_values_match_across_splits(runs, split) -> None:
    reference = read_scalars(runs / _name("sequence_mean", 2, "1rank_ga1") / "logs")
    scalars = read_scalars(runs / _name("sequence_mean", 2, split) / "logs")
    for name in ("rewards/mean", "rewards/std", "completions/mean_length"):
        assert scalars[name] == reference[name], name
    for name in ("loss", "policy/kl", "policy/ratio"):
        assert scalars[name] == pytest.approx(reference[name], rel=1e-5, abs=1e-7), name


def test_the_parity_report_takes_the_recipes_own_steps(runs) -> None:
    """recipes/ga_parity.py on this config (exactga.parity.grpo) and the recipe, one rank:
    equal window losses, step by step, for the full batch (GA 1) and the 4x4 split (GA 4)."""
    summary = json.loads((runs / PARITY / "parity" / "token_mean" / "summary.json").read_text())
    (split,) = [run for run in summary["runs"] if run["split"] == "4x4"]
    for name, losses in (
        ("1rank_ga1", summary["reference_losses"]),
        ("1rank_ga4", split["losses"]),
    ):
        logged = read_scalars(runs / _name("token_mean", 1, name) / "logs")["loss"]
        assert logged == [float(np.float32(loss)) for loss in losses], name
