"""GRPO through ``tune run``: the step does not depend on how rollouts are split.

The issue's done-when: for each ``loss_aggregation``, with ``ppo_epochs`` 1 and 2, the trained
weights of 1 rank x GA 1, 1 rank x GA 4 and 2 ranks x GA 2 (one global batch of 4 prompts x 4
completions, 2 optimizer steps, fp32) land within a relative L2 of 1e-5 of each other, and the
``naive`` baseline (each micro-batch's own mean over GA) is measurably off. Here the recipe
trains every aggregation at ``ppo_epochs`` 2 (one rollout step, two optimizer steps on it) and
``token_mean`` at ``ppo_epochs`` 1 (two rollout steps); the GA parity report on the same config
takes the recipe's own steps (equal losses at GA 1 and GA 4, below), and
tests/test_recipe_ga_parity_grpo.py runs it for every aggregation at ``ppo_epochs`` 1 over one
device and two ranks, with the naive baseline. Every one-rank run is made one after another,
every two-rank run likewise beside them (tests/many_runs.py: each forked from the tests' server).

The ``token_mean`` runs at ``ppo_epochs`` 1 under GA 4 and on 2 ranks also validate after each
step on 5 held-out prompts (issue #64; exactga.grpo.validation): in 1 batch of 5 on one rank, in
batches of 1 on two (3 prompts and 2 plus a filler group); the figures agree, and the GA 4 run's
losses are still the parity report's, bit for bit, so validating changes no training step.

``keep_best_checkpoint`` (docs/validation.md, "The best checkpoint") rides on these runs:
a 2-rank run of 3 one-step epochs validates at each epoch's end, and ``best/`` must hold the
epoch folder of its highest ``val/reward_mean``; a one-rank run of the same config stops
after step 2 (a SIGTERM it sends itself, tests/run_hooks.py) and is resumed, and keeps that
best.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from grpo_utils import RECIPE, SPLITS, grpo_args, initial_weights, trained_weights
from many_runs import Run, launch_runs
from recipe_utils import load_weights, logged_steps, read_scalars, relative_l2
from run_hooks import NO_FIGURE, STOP_AFTER_STEP

from exactga.checkpoints.contents import BEST_RECORD

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("grpo")]

FLOOR = 1e-5  # the bound, fp32
AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
# (ppo_epochs, rollout steps): two optimizer steps either way.
PPO = {1: 2, 2: 1}
# (aggregation, ppo_epochs) trained under every split; see the module's docstring.
TRAINED = [(aggregation, 2) for aggregation in AGGREGATIONS] + [("token_mean", 1)]
# The runs that validate, and their batching of the same 5 held-out prompts.
VALIDATED = ("token_mean", 1)
HELD_OUT = 5
VALIDATION = {
    "1rank_ga4": {"batch_size_val": HELD_OUT, "max_val_batches": 1},
    "2ranks_ga2": {"batch_size_val": 1, "max_val_batches": HELD_OUT},
}


def _name(aggregation: str, ppo_epochs: int, split: str, mode: str = "exact") -> str:
    return f"{aggregation}_ppo{ppo_epochs}_{split}_{mode}"


def _runs(root: Path, nproc: int) -> list[Run]:
    runs = []
    for aggregation, ppo_epochs in TRAINED:
        for split, (ranks, overrides) in SPLITS.items():
            if ranks != nproc:
                continue
            out = root / _name(aggregation, ppo_epochs, split)
            validation = {}
            if (aggregation, ppo_epochs) == VALIDATED and split in VALIDATION:
                validation = {
                    "dataset_val": "${dataset}",
                    "run_val_every_n_steps": 1,
                    **VALIDATION[split],
                }
            args = grpo_args(
                out,
                loss_aggregation=aggregation,
                ppo_epochs=ppo_epochs,
                num_steps=PPO[ppo_epochs],
                micro_batching="fixed",  # as the parity report's run below
                **overrides,
                **validation,
            )
            runs.append(Run(RECIPE, args, out))
    return runs


# keep_best_checkpoint: three epochs of one rollout step, validated at each epoch's end.
BEST = {
    "epochs": 3,
    "num_steps": 1,
    "dataset_val": "${dataset}",
    "batch_size_val": 1,
    "max_val_batches": HELD_OUT,
    "keep_best_checkpoint": True,
}
BEST_STOP = 2  # the stopped one-rank run's last step, before its resume
WEIGHTS = "model-00001-of-00001.safetensors"


def _best_runs(root: Path, nproc: int) -> list[Run]:
    """The 2-rank best run; or, on one rank, the run that stops after ``BEST_STOP`` and its
    resume, both in ``root / "best_resumed_run"``."""
    if nproc == 2:
        out = root / "best"
        return [Run(RECIPE, grpo_args(out, **SPLITS["2ranks_ga2"][1], **BEST), out)]
    out = root / "best_resumed_run"
    one_rank = {**SPLITS["1rank_ga1"][1], **BEST}
    resumed = {**one_rank, "resume_from_checkpoint": True}
    return [
        Run(
            RECIPE,
            grpo_args(out, **one_rank),
            root / "best_stopped",
            {STOP_AFTER_STEP: str(BEST_STOP)},
        ),
        Run(RECIPE, grpo_args(out, **resumed), root / "best_resumed"),
    ]


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
    # Its losses only: the figure is tests/test_recipe_ga_parity.py's (tests/run_hooks.py).
    return Run("recipes/ga_parity.py", args, out, {NO_FIGURE: "1"})


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    def make(root: Path) -> None:
        # grpo_rewards; before the caller's own path (a worktree's src/), not instead of it.
        paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]
        tests_on_path = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        one_rank = [*_runs(root, 0), _parity_run(root), *_best_runs(root, 0)]
        # the resume after the stopped run (a stop exits with the signal's status)
        launch_runs(one_rank, nproc=0, extra_env=tests_on_path)
        launch_runs([*_runs(root, 2), *_best_runs(root, 2)], nproc=2, extra_env=tests_on_path)

    root = run_once("grpo_parity_runs", make)
    for folder in root.iterdir():
        if (folder / "returncode").exists() and folder.name != "best_stopped":
            output = (folder / "output.txt").read_text()
            assert (folder / "returncode").read_text() == "0", f"{folder.name}\n{output[-4000:]}"
    return root


@pytest.mark.parametrize(("aggregation", "ppo_epochs"), TRAINED)
@pytest.mark.parametrize("split", ["1rank_ga4", "2ranks_ga2"])
def test_split_trains_the_full_batch_step(runs, aggregation, ppo_epochs, split) -> None:
    reference = runs / _name(aggregation, ppo_epochs, "1rank_ga1")
    initial = initial_weights(reference)
    trained = trained_weights(runs / _name(aggregation, ppo_epochs, split))
    gap = relative_l2(trained, trained_weights(reference), initial)
    assert gap <= FLOOR, f"{aggregation}, ppo_epochs {ppo_epochs}, {split} vs GA 1: {gap:.2e}"


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
    summary = json.loads((runs / PARITY / "parity" / "token-mean" / "summary.json").read_text())
    (split,) = [run for run in summary["runs"] if run["split"] == "4x4"]
    for name, losses in (
        ("1rank_ga1", summary["reference_losses"]),
        ("1rank_ga4", split["losses"]),
    ):
        logged = read_scalars(runs / _name("token_mean", 1, name) / "logs")["loss"]
        assert logged == [float(np.float32(loss)) for loss in losses], name


def test_validation_is_the_same_on_one_rank_and_two(runs) -> None:
    """val/reward_mean after each of the two steps, over the same 20 completions, in one batch
    of 5 prompts on one rank and in batches of 1 on two (a filler on rank 1); the rewards
    define no success, so there is no success rate. The GA 4 run's training losses are the
    parity report's, bit for bit (test_the_parity_report_takes_the_recipes_own_steps)."""
    figures = {}
    for split in VALIDATION:
        scalars = read_scalars(runs / _name(*VALIDATED, split) / "logs")
        assert "val/success_rate" not in scalars
        figures[split] = scalars["val/reward_mean"]
    print(f"val/reward_mean per step: {figures}")
    one_rank, two_ranks = figures.values()
    assert len(one_rank) == PPO[1]  # after each step; the epoch's end is step 2, validated once
    assert two_ranks == pytest.approx(one_rank, rel=1e-6)


def _best(out: Path) -> tuple[dict, dict]:
    """The record of ``out``'s ``best/`` and its weights."""
    best = out / "best"
    return json.loads((best / BEST_RECORD).read_text()), load_weights(best / WEIGHTS)


def test_the_best_checkpoint_holds_the_highest_reward_on_two_ranks(runs) -> None:
    """``best/`` is the epoch folder of the first highest val/reward_mean (each epoch is one
    step), bit for bit, written by rank 0 after a decision every rank took alike (else a rank
    would wait in the gather of a save the other skipped); one console line per new best."""
    series = logged_steps(runs / "best" / "logs", "val/reward_mean")
    output = (runs / "best" / "output.txt").read_text()
    print(f"val/reward_mean per step: {series}")
    assert list(series) == [1, 2, 3]
    best_step = max(series, key=series.__getitem__)  # the first of the highest
    assert best_step != 3 and series[best_step] > min(series.values()), "pick another seed"
    record, weights = _best(runs / "best")
    assert record["step"] == best_step and record["epoch"] == best_step - 1
    assert record["val/reward_mean"] == pytest.approx(series[best_step], rel=1e-6)
    for epoch in range(3):
        saved = trained_weights(runs / "best", epoch)
        same = all(weights[name].equal(weight) for name, weight in saved.items())
        assert same == (epoch == best_step - 1), epoch
    improvements, highest = 0, -math.inf
    for figure in series.values():  # in step order
        if figure > highest:
            improvements, highest = improvements + 1, figure
    assert output.count("exactga: best val/reward_mean") == improvements, output[-4000:]


def test_a_resumed_run_keeps_the_uninterrupted_best(runs) -> None:
    """The one-rank run stopped after step 2 and resumed validates step 3, whose figure is below
    the best of steps 1 and 2: it keeps the uninterrupted (2-rank) run's best step, figure and
    weights (within the layouts' floor), and prints no new best. A resume that forgot the best
    its checkpoint recorded would take step 3's."""
    status = (runs / "best_stopped" / "returncode").read_text()
    assert status != "0", "the run did not stop"
    assert (
        f"stopped by SIGTERM after step {BEST_STOP}"
        in (runs / "best_stopped" / "output.txt").read_text()
    )
    resumed_output = (runs / "best_resumed" / "output.txt").read_text()
    assert (runs / "best_resumed" / "returncode").read_text() == "0", resumed_output[-4000:]
    assert "Resuming from step checkpoint" in resumed_output
    series = logged_steps(runs / "best" / "logs", "val/reward_mean")
    best_step = max(series, key=series.__getitem__)
    assert best_step <= BEST_STOP and series[3] < series[best_step], "pick another seed"
    assert "exactga: best" not in resumed_output
    (record, weights), (resumed, resumed_weights) = (
        _best(runs / "best"),
        _best(runs / "best_resumed_run"),
    )
    print(f"uninterrupted {record}, resumed {resumed}")
    assert resumed["step"] == record["step"]
    assert resumed["val/reward_mean"] == pytest.approx(record["val/reward_mean"], rel=1e-6)
    initial = initial_weights(runs / "best")
    assert relative_l2(resumed_weights, weights, initial) <= FLOOR
