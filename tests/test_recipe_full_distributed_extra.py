"""``optimizer_in_bwd`` and tensor parallelism in recipes/full_finetune.py, through
the real ``tune run``.

Tier (b) of docs/contributing.md point 9, 2 gloo ranks on CPU, offline. Under FSDP2 the
per-parameter optimizers run inside backward, on each rank's *sharded*, already reduce-scattered
gradient; this checks that this is the same training as the ordinary optimizer step. Tensor
parallelism (dp 1 x tp 2) trains what one device trains. The 2-rank runs run one after another,
the one-device reference beside them (tests/many_runs.py); the refused tied output is the
2-rank runs' last, its message being what the test reads. (``optimizer_in_bwd`` with
accumulation is refused at validation: tests/test_config_checks.py.) Run with ``-rP`` to see the
measured distances (docs/full_finetune_distributed.md quotes them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from many_runs import Run, launch_runs
from recipe_utils import (
    INITIAL,
    SMALL_MODEL,
    TRAINED,
    load_weights,
    read_scalars,
    relative_l2,
)

pytestmark = pytest.mark.slow

DISTRIBUTED = "recipes/full_finetune.py"
DISTRIBUTED_CONFIG = "configs/tiny/full_distributed.yaml"
SINGLE = "recipes/full_finetune.py"
SINGLE_CONFIG = "configs/tiny/full_single_device.yaml"
TOLERANCE = 1e-5

# 2 ranks x 4 sequences x ga 1, the tiny config's AdamW(lr=1e-3, weight_decay=0.01), no warm-up
# (so the first step moves the weights) and no clipping (optimizer_in_bwd cannot clip).
# Three steps: the second and third read the AdamW state the first left. Both runs do the same
# arithmetic on the same shards, in another order only: 6 steps measured bit-identical weights.
# Each run reads 24 samples; all of this module's runs read the data's first 64 rows
# (``SLICE``), so each rank's length index (rank_balancing: by_tokens) tokenizes 64 rows, not
# all 2,069.
SLICE = {"dataset.split": "train[:64]"}
IN_BWD_RUN = {
    **SLICE,
    "batch_size": 4,
    "gradient_accumulation_steps": 1,
    "max_steps_per_epoch": 3,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
}


# Tensor parallelism on 2 CPU ranks (dp 1 x tp 2) against the single-device recipe. torchtune
# 0.6.1's Llama TP plan shards the output projection as a Linear, so the model is untied here
# (a tied output is refused by name: see test_tied_output_with_tensor_parallelism_is_refused).
TP_RUN = {
    **SMALL_MODEL,
    **SLICE,
    "model.tie_word_embeddings": False,
    "batch_size": 8,
    "gradient_accumulation_steps": 1,
    "max_steps_per_epoch": 3,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
    # Plain SGD with a large step: AdamW's first updates magnify rounding (5e-6 here in 4 steps).
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "~optimizer.weight_decay": None,
}
TP_PLAN = "tensor_parallel_plan._component_=torchtune.models.llama3.base_llama_tp_plan"


def _args(recipe: str, config: str, output_dir: Path, settings: dict) -> list[str]:
    return [recipe, "--config", config, f"output_dir={output_dir}"] + [
        key if value is None else f"{key}={value}" for key, value in settings.items()
    ]


def _run(recipe: str, config: str, out: Path, settings: dict, *extra: str) -> Run:
    recipe_file, *args = _args(recipe, config, out, settings)
    return Run(recipe_file, [*args, *extra], out)


def _launch_all(root: Path) -> None:
    two_ranks = [
        _run(
            DISTRIBUTED,
            DISTRIBUTED_CONFIG,
            root / "in_bwd",
            {**SMALL_MODEL, **IN_BWD_RUN, "optimizer_in_bwd": True},
        ),
        _run(
            DISTRIBUTED,
            DISTRIBUTED_CONFIG,
            root / "step",
            {**SMALL_MODEL, **IN_BWD_RUN, "optimizer_in_bwd": False},
        ),
        _run(
            DISTRIBUTED, DISTRIBUTED_CONFIG, root / "tp2", TP_RUN, "tensor_parallel_dim=2", TP_PLAN
        ),
        # Must fail (test_tied_output_with_tensor_parallelism_is_refused): last, since a failing
        # run ends a torchrun launch and the runs after it would be launched again.
        _run(
            DISTRIBUTED,
            DISTRIBUTED_CONFIG,
            root / "tied_tp2",
            {**TP_RUN, "model.tie_word_embeddings": True},
            "tensor_parallel_dim=2",
            TP_PLAN,
        ),
    ]
    launch_runs(two_ranks, nproc=2)
    launch_runs([_run(SINGLE, SINGLE_CONFIG, root / "single", TP_RUN)], nproc=0)


@pytest.fixture(scope="module")
def runs(run_once):
    """``name -> output folder`` of every finished run, each checked to have succeeded."""
    root = run_once("full_distributed_extra_runs", _launch_all)

    def get(name: str) -> Path:
        out = root / name
        assert (out / "returncode").read_text() == "0", (out / "output.txt").read_text()[-4000:]
        return out

    return get


@pytest.mark.xdist_group("full_distributed_extra")
def test_optimizer_in_bwd_matches_optimizer_step(runs):
    """2 ranks 4x1: the per-parameter optimizers inside backward train the weights of one
    optimizer step after backward (relative L2 <= 1e-5), with the same logged losses."""
    in_bwd, step = runs("in_bwd"), runs("step")
    rel = relative_l2(
        load_weights(in_bwd / TRAINED),
        load_weights(step / TRAINED),
        load_weights(step / INITIAL),
    )
    steps = IN_BWD_RUN["max_steps_per_epoch"]
    print(f"optimizer_in_bwd vs optimizer step, 2 ranks 4x1, {steps} AdamW steps: {rel:.3e}")
    assert rel <= TOLERANCE
    scalars, ref_scalars = read_scalars(in_bwd / "logs"), read_scalars(step / "logs")
    assert len(scalars["loss"]) == IN_BWD_RUN["max_steps_per_epoch"]
    assert scalars["loss"] == pytest.approx(ref_scalars["loss"], rel=1e-5)
    assert scalars["lr"] == pytest.approx(ref_scalars["lr"])


@pytest.mark.xdist_group("full_distributed_extra")
def test_tensor_parallel_run_matches_one_device(runs):
    tp, single = runs("tp2"), runs("single")
    rel = relative_l2(
        load_weights(tp / TRAINED), load_weights(single / TRAINED), load_weights(single / INITIAL)
    )
    print(f"tensor_parallel_dim=2 vs one device: relative L2 {rel:.3e}")
    assert rel <= TOLERANCE
    assert read_scalars(tp / "logs")["loss"] == pytest.approx(
        read_scalars(single / "logs")["loss"], rel=1e-5
    )


@pytest.mark.xdist_group("full_distributed_extra")
def test_tied_output_with_tensor_parallelism_is_refused(run_once):
    out = run_once("full_distributed_extra_runs", _launch_all) / "tied_tp2"
    assert (out / "returncode").read_text() != "0"
    assert "model.tie_word_embeddings" in (out / "output.txt").read_text()
