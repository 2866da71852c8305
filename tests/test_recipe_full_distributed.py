"""recipes/full_finetune.py through ``tune run --nproc_per_node 2`` on CPU.

Tier (b) of docs/contributing.md point 9, gloo ranks, offline. All runs of the module are made
once, in a module fixture (tests/many_runs.py: each run ``tune run`` on its command line, its ranks
forked by tests/launcher.py); each test then reads what they wrote. A real launch of this recipe
under torchrun is tests/test_launching.py's, across two nodes tests/test_multi_node_launch.py's
(which must train what a 2-rank run of one node trains). The one-rank reference
is the single-device recipe (same sampler order, same initial checkpoint), so these runs also
check the two recipes against each other.

Collectives are counted by ``tests/collective_counter/sitecustomize.py``, which the launches
load through ``PYTHONPATH``; the recipes know nothing of it. Run with ``-rP`` to see the
measured distances (docs/full_finetune_distributed.md quotes them).
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from many_runs import Run, launch_runs
from recipe_utils import (
    REPO_ROOT,
    SMALL_MODEL,
    load_weights,
    read_scalars,
    relative_l2,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("full_distributed")]

SINGLE = "recipes/full_finetune.py"
SINGLE_CONFIG = "configs/tiny/full_single_device.yaml"
DISTRIBUTED = "recipes/full_finetune.py"
DISTRIBUTED_CONFIG = "configs/tiny/full_distributed.yaml"
TRAINED = "epoch_0/model-00001-of-00001.safetensors"
INITIAL = "base_model/model.safetensors"
COUNTER = REPO_ROOT / "tests/collective_counter"
PARITY_TOLERANCE = 1e-5

# As in the single-device parity test: 6 AdamW steps (its AdamW count: fewer raise AdamW's
# rounding floor, 4 steps measured 4.9e-6), no clipping, no warm-up. The runs read 48 samples
# (6 steps x 8): every run, the reference too, reads the data's first 128 rows, so each rank's
# length index (rank_balancing: by_tokens) tokenizes 128 rows, not all 2,069; their lengths
# still vary (79 to 256 tokens).
PARITY = {
    "max_steps_per_epoch": 6,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
    "dataset.split": "train[:128]",
}
# The ragged data: 6 plain SGD steps (large lr so the update dwarfs rounding), in file order.
SGD = {
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "~optimizer.weight_decay": None,
    "max_steps_per_epoch": 6,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
    "shuffle": False,
    "tokenizer.max_seq_len": 64,
}


def _row(instruction: str, output: str) -> dict[str, str]:
    return {"instruction": instruction, "input": "", "output": output}


def ragged_rows() -> list[dict[str, str]]:
    """Eight rows per step; unshuffled, rank 0 reads the even rows and rank 1 the odd ones.

    step 0: rank 0 long answers, rank 1 two-word answers (very different counts)
    step 1: rank 1 only prompts longer than max_seq_len: no loss token on that rank
    step 2: no loss token on any rank: the step is skipped everywhere
    step 3: rank 0's first micro-batch (2x2) is empty, its second long
    steps 4-5: rank 0 short, rank 1 long
    """
    long = _row("Tell a story.", " ".join(["the quick brown fox jumps over the lazy dog"] * 5))
    short = _row("Say hi.", "Hi there.")
    masked = _row(" ".join(["describe the weather in a very long sentence"] * 30), "Sunny.")
    steps = [
        [long, short] * 4,
        [long, masked] * 4,
        [masked] * 8,
        [masked, short, masked, short, long, short, long, short],
        [short, long] * 4,
        [short, long] * 4,
    ]
    return [row for step in steps for row in step]


def _args(recipe: str, config: str, out: Path, settings: dict[str, object]) -> list[str]:
    merged = {**SMALL_MODEL, "output_dir": out, **settings}
    overrides = [k if v is None else f"{k}={v}" for k, v in merged.items()]
    return [recipe, "--config", config, *overrides]


def _run(name: str, nproc: int, settings: dict[str, object], root: Path) -> Run:
    """The run ``name`` on ``nproc`` ranks (1: the single-device recipe, 0: the distributed one
    without torchrun), its collectives counted into ``<name>_collectives``."""
    out = root / name
    counts = root / f"{name}_collectives"
    counts.mkdir(parents=True)
    if nproc == 1:
        args = _args(SINGLE, SINGLE_CONFIG, out, settings)
    else:
        args = _args(DISTRIBUTED, DISTRIBUTED_CONFIG, out, settings)
    return Run(args[0], args[1:], out, env={"EXACTGA_COUNT_COLLECTIVES_DIR": str(counts)})


@pytest.fixture(scope="module")
def runs(run_once) -> dict[str, Path]:
    """The launches' output folders, made once per test session for every xdist worker."""
    root = run_once("full_distributed_runs", _launch_all)
    return {path.name: path for path in root.iterdir() if (path / "epoch_0").is_dir()}


def _launch_all(root: Path) -> None:
    data = root / "ragged.json"
    data.write_text(json.dumps(ragged_rows()))
    ragged = {**SGD, "dataset.data_files": data}
    launches = {
        # name: (ranks, overrides); bs x ga per rank, 8 sequences per step in all
        "1rank_8x1": (1, {**PARITY, "batch_size": 8, "gradient_accumulation_steps": 1}),
        "2ranks_4x1": (2, {**PARITY, "batch_size": 4, "gradient_accumulation_steps": 1}),
        "2ranks_1x4": (
            2,
            {
                **PARITY,
                "batch_size": 1,
                "gradient_accumulation_steps": 4,
                "gradient_sync": "once_per_window",
            },
        ),
        "2ranks_2x2": (
            2,
            {
                **PARITY,
                "batch_size": 2,
                "gradient_accumulation_steps": 2,
                "gradient_sync": "every_micro_batch",
            },
        ),
        # Activation checkpointing, as most stock configs set it: must not change numbers.
        "2ranks_2x2_ac": (
            2,
            {
                **PARITY,
                "batch_size": 2,
                "gradient_accumulation_steps": 2,
                "enable_activation_checkpointing": True,
            },
        ),
        # tune run without --nproc_per_node: the distributed recipe trains as one rank.
        "no_torchrun_8x1": (0, {**PARITY, "batch_size": 8, "gradient_accumulation_steps": 1}),
        "ragged_1rank_8x1": (1, {**ragged, "batch_size": 8, "gradient_accumulation_steps": 1}),
        # The rows are laid out for stock's deal (rank r reads every 2nd row from r), which
        # rank_balancing: by_tokens would even out: the empty and ragged ranks are the point.
        "ragged_2ranks_2x2": (
            2,
            {
                **ragged,
                "batch_size": 2,
                "gradient_accumulation_steps": 2,
                "rank_balancing": "none",
            },
        ),
    }
    # The one-device runs and the distributed recipe without torchrun one after another, the
    # 2-rank runs beside them (tests/many_runs.py).
    by_ranks: dict[int, list[Run]] = {0: [], 2: []}
    for name, (nproc, settings) in launches.items():
        by_ranks[2 if nproc == 2 else 0].append(_run(name, nproc, settings, root))
    # The counter needs its variable at start-up; each run then names its own folder.
    python_path = os.pathsep.join(filter(None, [str(COUNTER), os.environ.get("PYTHONPATH")]))
    counter = {"PYTHONPATH": python_path, "EXACTGA_COUNT_COLLECTIVES_DIR": str(root)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(launch_runs, by_ranks[0], 0, extra_env=counter),
            pool.submit(launch_runs, by_ranks[2], 2, extra_env=counter),
        ]
        for future in futures:
            future.result()
    for name in launches:
        output = (root / name / "output.txt").read_text()
        assert (root / name / "returncode").read_text() == "0", f"{name}:\n{output[-4000:]}"


def _distance(run: Path, reference: Path) -> float:
    return relative_l2(
        load_weights(run / TRAINED),
        load_weights(reference / TRAINED),
        load_weights(reference / INITIAL),
    )


@pytest.mark.parametrize("name", ["2ranks_4x1", "2ranks_1x4", "2ranks_2x2"])
def test_rank_and_accumulation_splits_match_one_rank(runs, name):
    """2 ranks x (4x1, 1x4, 2x2) train to the weights
    of 1 rank 8x1 (relative L2 <= 1e-5)."""
    reference = runs["1rank_8x1"]
    scalars, ref_scalars = read_scalars(runs[name] / "logs"), read_scalars(reference / "logs")
    assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]  # the same 8 sequences per step
    rel = _distance(runs[name], reference)
    print(f"{name} vs 1 rank 8x1: relative L2 {rel:.3e}")
    assert rel <= PARITY_TOLERANCE
    # The logged loss is the exact window loss over both ranks, as on one rank.
    assert scalars["loss"] == pytest.approx(ref_scalars["loss"], rel=1e-4)
    # The profiler hook's scalars, logged by rank 0 at every step.
    for tag in ("time/step_ms", "time/backward_ms", "throughput/tokens_per_second"):
        assert len(scalars[tag]) == len(scalars["loss"]) and min(scalars[tag]) > 0, tag
    # A sample at step 2 only (one every 10 steps): too few for a figure (see [saved latency on
    # a busy machine]), so none is logged; tests/test_recipe_profiling.py logs one.
    assert "normalization/saved_ms" not in scalars


def test_without_torchrun_the_recipe_trains_as_one_rank(runs):
    """``tune run recipes/full_finetune.py`` with no ``--nproc_per_node`` says so
    and trains the one-device weights, instead of failing on torch's missing RANK."""
    run, reference = runs["no_torchrun_8x1"], runs["1rank_8x1"]
    output = (run / "output.txt").read_text()
    assert "No torchrun environment (RANK is not set): training as one rank" in output
    assert "tune run --nproc_per_node N" in output
    rel = _distance(run, reference)
    print(f"without torchrun vs 1 rank 8x1: relative L2 {rel:.3e}")
    assert rel <= PARITY_TOLERANCE
    assert read_scalars(run / "logs")["loss"] == pytest.approx(
        read_scalars(reference / "logs")["loss"], rel=1e-6
    )


def test_ragged_and_empty_ranks_match_one_rank(runs):
    """Very different token counts per rank, a rank with no loss token, a window empty on every
    rank: still the one-rank weights, finite, and the empty window skipped on both ranks."""
    run, reference = runs["ragged_2ranks_2x2"], runs["ragged_1rank_8x1"]
    scalars, ref_scalars = read_scalars(run / "logs"), read_scalars(reference / "logs")
    assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]
    assert scalars["loss_tokens"][2] == 0 and all(
        n > 0 for i, n in enumerate(scalars["loss_tokens"]) if i != 2
    )
    assert scalars["skipped_steps"][-1] == 1
    for name, tensor in load_weights(run / TRAINED).items():
        assert torch.isfinite(tensor).all(), f"{name} is not finite"
    assert all(math.isfinite(v) for v in scalars["loss"])
    rel = _distance(run, reference)
    print(f"ragged 2 ranks 2x2 vs 1 rank 8x1: relative L2 {rel:.3e}")
    assert rel <= PARITY_TOLERANCE
    assert (run / "output.txt").read_text().count("no loss token in this accumulation window") == 1


def test_activation_checkpointing_changes_no_number(runs):
    """The same 2x2 run with and without activation checkpointing: both within the parity
    bound of 1 rank 8x1, and of each other. Recomputation repeats the same ops on the same
    inputs, so nothing but rounding may differ."""
    plain, checkpointed = runs["2ranks_2x2"], runs["2ranks_2x2_ac"]
    resolved = (checkpointed / "resolved_config.yaml").read_text()  # the run's whole config
    assert "enable_activation_checkpointing: true" in resolved
    to_plain = _distance(checkpointed, plain)
    to_one_rank = _distance(checkpointed, runs["1rank_8x1"])
    print(
        f"2x2 with activation checkpointing: vs without {to_plain:.3e}, "
        f"vs 1 rank 8x1 {to_one_rank:.3e}"
    )
    assert to_plain <= PARITY_TOLERANCE and to_one_rank <= PARITY_TOLERANCE
    losses = read_scalars(checkpointed / "logs")["loss"]
    assert losses == pytest.approx(read_scalars(plain / "logs")["loss"], rel=1e-6)


def _steps(run: Path, rank: int) -> list[dict[str, int]]:
    return json.loads((run.parent / f"{run.name}_collectives" / f"rank{rank}.json").read_text())


def test_collectives_per_optimizer_step(runs):
    """One token-count all-reduce and one 1-byte non-finite-loss flag per step (besides the stop
    flag and a logged step's loss); gradients
    reduce-scattered once per parameter group per step with once_per_window whatever ga is,
    ga times with every_micro_batch."""
    per_step = {
        name: [_steps(runs[name], r) for r in range(2)]
        for name in ("2ranks_4x1", "2ranks_1x4", "2ranks_2x2")
    }
    groups = per_step["2ranks_4x1"][0][0]["reduce_scatter"]  # FSDP units: layers + root
    assert groups == SMALL_MODEL["model.num_layers"] + 1
    expected = {"2ranks_4x1": groups, "2ranks_1x4": groups, "2ranks_2x2": 2 * groups}
    for name, ranks in per_step.items():
        for steps in ranks:
            assert len(steps) == PARITY["max_steps_per_epoch"]
            for step in steps:
                assert step.get("token_count") == 1, (name, step)
                assert step.get("finite_flag") == 1, (name, step)
                assert step.get("reduce_scatter") == expected[name], (name, step)
                # The only others: the logged loss of the previous step, and the stop flag
                # the ranks agree on at every step boundary (see [every rank stops at one
                # step] in exactga.run.steps: one int on a CPU group).
                assert step.get("all_reduce_other", 0) <= 2, (name, step)
