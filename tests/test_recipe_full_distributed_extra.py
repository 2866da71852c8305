"""``optimizer_in_bwd`` in recipes/full_finetune_distributed.py, through the real ``tune run``.

Tier (b) of docs/contributing.md point 9, 2 gloo ranks on CPU, offline. Under FSDP2 the
per-parameter optimizers run inside backward, on each rank's *sharded*, already reduce-scattered
gradient; this checks that this is the same training as the ordinary optimizer step, and that the
combination that cannot work (accumulation) is refused by name. The three launches run side
by side in one module fixture (about 40-60 s on 2 shared cores). Run with ``-rP`` to see the
measured distance (docs/full_finetune_distributed.md quotes it).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from recipe_utils import (
    INITIAL,
    SMALL_MODEL,
    TRAINED,
    load_weights,
    output_of,
    read_scalars,
    relative_l2,
    run_tune,
)

pytestmark = pytest.mark.slow

DISTRIBUTED = "recipes/full_finetune_distributed.py"
DISTRIBUTED_CONFIG = "configs/tiny/full_distributed.yaml"
TOLERANCE = 1e-5

# 2 ranks x 4 sequences x ga 1, the tiny config's AdamW(lr=1e-3, weight_decay=0.01), no warm-up
# (so the first step moves the weights) and no clipping (optimizer_in_bwd cannot clip).
# Six steps keep the AdamW rounding floor well under the tolerance (see the single-device
# parity test: its first updates divide tiny gradients by their own magnitude).
IN_BWD_RUN = {
    "batch_size": 4,
    "gradient_accumulation_steps": 1,
    "max_steps_per_epoch": 6,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
}


def _launch(out: Path, settings: dict[str, object]):
    merged = {**SMALL_MODEL, "output_dir": out, **settings}
    args = ["--nproc_per_node", "2", DISTRIBUTED, "--config", DISTRIBUTED_CONFIG]
    args += [f"{key}={value}" for key, value in merged.items()]
    return run_tune(args, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizer_in_bwd")
    launches = {
        "in_bwd": (root / "in_bwd", {**IN_BWD_RUN, "optimizer_in_bwd": True}),
        "step": (root / "step", {**IN_BWD_RUN, "optimizer_in_bwd": False}),
        "in_bwd_ga2": (
            root / "in_bwd_ga2",
            {**IN_BWD_RUN, "optimizer_in_bwd": True, "gradient_accumulation_steps": 2},
        ),
    }
    # The refused launch only starts and fails, so three at once stay within two cores' worth.
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_launch, *launch) for name, launch in launches.items()}
        procs = {name: future.result() for name, future in futures.items()}
    return {name: (launches[name][0], proc) for name, proc in procs.items()}


@pytest.mark.xdist_group("full_distributed_extra")
def test_optimizer_in_bwd_matches_optimizer_step(runs):
    """2 ranks 4x1: the per-parameter optimizers inside backward train the weights of one
    optimizer step after backward (relative L2 <= 1e-5), with the same logged losses."""
    (in_bwd, proc_in_bwd), (step, proc_step) = runs["in_bwd"], runs["step"]
    assert proc_in_bwd.returncode == 0, output_of(proc_in_bwd)[-4000:]
    assert proc_step.returncode == 0, output_of(proc_step)[-4000:]
    rel = relative_l2(
        load_weights(in_bwd / TRAINED),
        load_weights(step / TRAINED),
        load_weights(step / INITIAL),
    )
    print(f"optimizer_in_bwd vs optimizer step, 2 ranks 4x1, 6 AdamW steps: relative L2 {rel:.3e}")
    assert rel <= TOLERANCE
    scalars, ref_scalars = read_scalars(in_bwd / "logs"), read_scalars(step / "logs")
    assert len(scalars["loss"]) == IN_BWD_RUN["max_steps_per_epoch"]
    assert scalars["loss"] == pytest.approx(ref_scalars["loss"], rel=1e-5)
    assert scalars["lr"] == pytest.approx(ref_scalars["lr"])


@pytest.mark.xdist_group("full_distributed_extra")
def test_optimizer_in_bwd_with_accumulation_is_refused_naming_both_keys(runs):
    _, proc = runs["in_bwd_ga2"]
    output = output_of(proc)
    assert proc.returncode != 0
    # One message from rank 0, without a traceback; see [user errors] in exactga.launch.cli.
    assert "exactga: config keys 'optimizer_in_bwd' and 'gradient_accumulation_steps'" in output
    assert output.count("exactga: config keys 'optimizer_in_bwd'") == 1


# Tensor parallelism on 2 CPU ranks (dp 1 x tp 2) against the single-device recipe. torchtune
# 0.6.1's Llama TP plan shards the output projection as a Linear, so the model is untied here
# (a tied output is refused by name: see test_tied_output_with_tensor_parallelism_is_refused).
TP_RUN = {
    **SMALL_MODEL,
    "model.tie_word_embeddings": False,
    "batch_size": 8,
    "gradient_accumulation_steps": 1,
    "max_steps_per_epoch": 4,
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


def test_tensor_parallel_run_matches_one_device(tmp_path):
    single = tmp_path / "single"
    tp = tmp_path / "tp2"
    launches = [
        (
            _args(
                "recipes/full_finetune_single_device.py",
                "configs/tiny/full_single_device.yaml",
                single,
                TP_RUN,
            ),
            [],
        ),
        (
            [
                "--nproc_per_node",
                "2",
                *_args(DISTRIBUTED, DISTRIBUTED_CONFIG, tp, TP_RUN),
                "tensor_parallel_dim=2",
                TP_PLAN,
            ],
            [],
        ),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda launch: run_tune(launch[0]), launches))
    for proc in procs:
        assert proc.returncode == 0, output_of(proc)[-4000:]
    rel = relative_l2(
        load_weights(tp / TRAINED), load_weights(single / TRAINED), load_weights(single / INITIAL)
    )
    print(f"tensor_parallel_dim=2 vs one device: relative L2 {rel:.3e}")
    assert rel <= TOLERANCE
    assert read_scalars(tp / "logs")["loss"] == pytest.approx(
        read_scalars(single / "logs")["loss"], rel=1e-5
    )


def test_tied_output_with_tensor_parallelism_is_refused(tmp_path):
    settings = {**TP_RUN, "model.tie_word_embeddings": True}
    args = ["--nproc_per_node", "2", *_args(DISTRIBUTED, DISTRIBUTED_CONFIG, tmp_path, settings)]
    proc = run_tune([*args, "tensor_parallel_dim=2", TP_PLAN])
    assert proc.returncode != 0
    assert "model.tie_word_embeddings" in output_of(proc)
