"""recipes/knowledge_distillation.py on 2 gloo CPU ranks, through ``tune run``.

Tier (b) of docs/contributing.md point 9. Two data-parallel ranks, student and teacher both
sharded, must distil into the adapters one rank does with the same global batch (the 1-rank 8x1
runs of tests/test_recipe_kd_single_device.py, shared through ``run_once``), and a window with no
loss token on any rank must skip its step while micro-batches empty on one rank still run with
weight 0. One rank of the distributed recipe (through torchrun and without it, with a tied and an
untied teacher) must land where two ranks do: issue #22 crashed there. Launches: two, one per
number of ranks (2, 1 through torchrun), each making its runs one after another
(tests/many_runs.py), and the shared one-device runs (tests/kd_utils.py), which also
runs the recipe as one rank without torchrun.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from kd_utils import (
    ADAPTER_CONFIG,
    ADAPTERS,
    CASES,
    KD_DISTRIBUTED_CONFIG,
    KD_DISTRIBUTED_RECIPE,
    MERGED,
    NO_TORCHRUN_RUN,
    PARITY_STEPS,
    PEFT_ADAPTERS,
    UNTIED_STEPS,
    UNTIED_TEACHER,
    VALIDATED,
    VALIDATED_STEPS,
    VALIDATION_TAGS,
    initial_adapters,
    kd_args,
    no_torchrun_run,
    one_rank_run,
    parity_args,
)
from many_runs import Run, launch_runs, run_of
from recipe_utils import (
    EMPTY_WINDOW_RUN,
    load_adapters,
    logged_steps,
    read_scalars,
    relative_l2,
    rows_with_an_empty_window,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("kd_recipes")]

TWO_RANKS = {"recipe": KD_DISTRIBUTED_RECIPE, "config": KD_DISTRIBUTED_CONFIG, "nproc": 2}
# (case, batch size, ga) on two ranks: the same 8 sequences per step as 8x1 on one.
RANK_SPLITS = [("fp64_masked", 4, 1), ("fp32_train_on_input", 1, 4)]
# One rank of the distributed recipe, 8x1, against two ranks 1x4 (the same global batch), fp32:
# launched through torchrun, here; without it, with an untied teacher, NO_TORCHRUN_RUN of
# tests/kd_utils.py, and its two-rank twin: 3 steps (UNTIED_STEPS), the pair compared with nothing
# else. The bound is the fp32 parity bound, 2e-6. The issue #22 runs of this module (one rank
# through torchrun, the untied two ranks) leave out the fp32 case's validation, which no test
# reads there: their partners validate, so each comparison also shows that validating changes
# no training step.


def _two_rank_args(out: Path, case: str, batch_size: int, ga: int) -> list[str]:
    # The fp32 case's step checkpoints are the single-device resume test's; not needed here.
    return [*parity_args(out, case, batch_size, ga, **TWO_RANKS), "save_every_n_steps=null"]


def _unvalidated(args: list[str]) -> list[str]:
    """``args`` without the fp32 case's validation keys (``VALIDATED``)."""
    return [arg for arg in args if arg not in VALIDATED]


def _one_rank_args(out: Path) -> list[str]:
    args = parity_args(out, "fp32_train_on_input", 8, 1, recipe=KD_DISTRIBUTED_RECIPE)
    return ["--nproc_per_node", "1", *_unvalidated(args), "save_every_n_steps=null"]


def _two_rank_untied_args(out: Path) -> list[str]:
    args = parity_args(
        out, "fp32_train_on_input", 1, 4, max_steps_per_epoch=UNTIED_STEPS, **TWO_RANKS
    )
    return [*_unvalidated(args), "save_every_n_steps=null", *UNTIED_TEACHER]


def _empty_window_args(out: Path) -> list[str]:
    out.mkdir(parents=True)
    data = out / "data.json"
    data.write_text(json.dumps(rows_with_an_empty_window()))
    # One sequence per micro-batch on each of 2 ranks: the windows of the single-device test.
    settings = {**EMPTY_WINDOW_RUN, "batch_size": 1, "dataset__data_files": data}
    return kd_args(out / "run", **TWO_RANKS, **settings)


def _launch_all(root: Path) -> None:
    """Every run of this module, grouped by number of ranks (tests/many_runs.py: the runs one
    after another, each forked from the tests' server, as ``tune run`` starts it)."""
    launches = {
        f"{case}_{bs}x{ga}x2": _two_rank_args(root / f"{case}_{bs}x{ga}x2", case, bs, ga)
        for case, bs, ga in RANK_SPLITS
    }
    launches["empty_window"] = _empty_window_args(root / "empty_window")
    launches["one_rank_torchrun"] = _one_rank_args(root / "one_rank_torchrun")
    launches["untied_1x4x2"] = _two_rank_untied_args(root / "untied_1x4x2")
    by_ranks: dict[int, list[Run]] = {}
    for name, args in launches.items():
        nproc, run = run_of(args, root / name)
        by_ranks.setdefault(nproc, []).append(run)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(launch_runs, runs, nproc) for nproc, runs in by_ranks.items()]
        for future in futures:
            future.result()
    for name in launches:
        output = (root / name / "output.txt").read_text()
        assert (root / name / "returncode").read_text() == "0", f"{name}:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def runs(run_once) -> dict[str, Path]:
    """This module's runs and the one-rank references (tests/kd_utils.py), once per session."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        made = pool.submit(run_once, "kd_dist_runs", _launch_all)
        refs = {case: pool.submit(one_rank_run, run_once, case, (8, 1)) for case in CASES}
        root = made.result()
        found = {path.name: path for path in root.iterdir() if path.is_dir()}
        found.update({f"{case}_8x1": future.result() for case, future in refs.items()})
        found[NO_TORCHRUN_RUN] = no_torchrun_run(run_once)
    return found


@pytest.mark.parametrize(("case", "batch_size", "ga"), RANK_SPLITS)
def test_two_ranks_match_one_rank(runs, case, batch_size, ga):
    """4x1 and 1x4 on two ranks against 8x1 on one: fp64 <= 1e-7, fp32 <= 2e-6."""
    run, reference = runs[f"{case}_{batch_size}x{ga}x2"], runs[f"{case}_8x1"]
    rel = relative_l2(
        load_adapters(run / ADAPTERS), load_adapters(reference / ADAPTERS), initial_adapters(case)
    )
    print(f"{case} {batch_size}x{ga}x2 vs 8x1 on one rank: relative L2 {rel:.3e}")
    assert rel <= CASES[case][1]
    ours, ref = read_scalars(run / "logs"), read_scalars(reference / "logs")
    assert ours["loss_tokens"] == ref["loss_tokens"]  # the window's count over both ranks
    for name in ("loss", "class_loss", "kd_loss"):  # exact means over both ranks
        for value, expected in zip(ours[name], ref[name], strict=True):
            assert math.isclose(value, expected, rel_tol=1e-5), (name, value, expected)
    if "dataset_val=${dataset}" in CASES[case][0]:  # the validation set's figures, both ranks'
        for tag in VALIDATION_TAGS:
            value, expected = logged_steps(run / "logs", tag), logged_steps(reference / "logs", tag)
            print(f"{tag}: 2 ranks {value}, 1 rank {expected}")
            assert list(value) == list(expected) == VALIDATED_STEPS, tag
            for step in VALIDATED_STEPS:
                assert math.isclose(value[step], expected[step], rel_tol=1e-5), (tag, step)


@pytest.mark.parametrize(
    ("one_rank", "two_ranks", "steps"),
    [
        ("one_rank_torchrun", "fp32_train_on_input_1x4x2", PARITY_STEPS),
        ("one_rank_no_torchrun_untied", "untied_1x4x2", UNTIED_STEPS),
    ],
)
def test_one_rank_trains_and_matches_two_ranks(runs, one_rank, two_ranks, steps):
    """Issue #22: one rank of the distributed recipe (sharded teacher) trains every step and
    lands within 2e-6 (fp32) of two ranks at the same global batch, tied or untied teacher."""
    run, reference = runs[one_rank], runs[two_ranks]
    rel = relative_l2(
        load_adapters(run / ADAPTERS),
        load_adapters(reference / ADAPTERS),
        initial_adapters("fp32_train_on_input"),
    )
    print(f"{one_rank} vs {two_ranks}: relative L2 {rel:.3e}")
    assert rel <= CASES["fp32_train_on_input"][1]
    ours, ref = read_scalars(run / "logs"), read_scalars(reference / "logs")
    assert len(ours["loss"]) == len(ref["loss"]) == steps
    assert ours["loss_tokens"] == ref["loss_tokens"]


def test_empty_window_skips_and_empty_micro_batches_weigh_nothing(runs):
    """Window 1 has no loss token on either rank: skipped on both. Window 2 gives each rank one
    empty micro-batch, which still runs (planted label, weight 0): were its KD and class
    losses to leak into the logged parts, they would no longer mix into the logged loss, which
    the shared normaliser weighs by the recorded counts."""
    out = runs["empty_window"] / "run"
    scalars = read_scalars(out / "logs")
    assert scalars["skipped_steps"] == [1.0, 1.0, 1.0]
    assert scalars["loss_tokens"][0] == 0
    assert len(scalars["kd_loss"]) == len(scalars["class_loss"]) == 2
    for loss, ce, kd in zip(
        scalars["loss"], scalars["class_loss"], scalars["kd_loss"], strict=True
    ):
        assert math.isfinite(loss) and math.isclose(loss, 0.5 * ce + 0.5 * kd, rel_tol=1e-6)
    for name, tensor in load_adapters(out / ADAPTERS).items():
        assert torch.isfinite(tensor).all(), name


def test_artefacts_and_metrics_match_stock(runs):
    out = runs["empty_window"] / "run"
    for artefact in (ADAPTERS, PEFT_ADAPTERS, ADAPTER_CONFIG, MERGED):
        assert (out / artefact).is_file(), artefact
    scalars = read_scalars(out / "logs")
    for name in ("loss", "class_loss", "kd_loss", "lr", "tokens_per_second_per_gpu"):
        assert name in scalars, name
