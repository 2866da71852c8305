"""``compile: True`` keeps split parity (issue #66): full SFT, LoRA, LoRA DPO and GRPO, each
compiled on a split of the global batch, land where the full batch does, at fp32's floor.

Each recipe trains 2 steps of one global batch (same seed, data and config, fp32, plain SGD)
through ``tune run``: split and compiled, and as the full batch, eager (full-batch training, the
reference every split is held to); the trained weights (LoRA: the adapters) of the compiled split
land within the recipe's fp32 floor of the full batch's (relative L2 of their difference over
the full batch's update, exactga.parity.scoring). The configs are the neighbours' parity
runs (tests/test_recipe_full_single_device.py, tests/test_recipe_lora_single_device.py,
tests/test_recipe_dpo_lora.py, tests/test_recipe_grpo.py) cut to 2 steps, with ``compile=True``;
LoRA and LoRA DPO pad every micro-batch to one sequence length (``pad_to_multiple_of`` at the
tokenizer's ``max_seq_len``, both runs of a case), the product's advice for compiled runs: each
layer compiles for one shape instead of recompiling dynamic when the length first changes. SFT
keeps its variable lengths: its split is the suite's check that graphs recompiled dynamic after
a length change land where the full batch does (the families' compiled runs take one shape;
GRPO's generation recompiles as it must, padded or not). Every compiled run compiled: its
end-of-run line reports graphs, and no graph break.

The backend is ``aot_eager`` (recipe_utils.COMPILE_WITHOUT_INDUCTOR): dynamo's capture and AOT
autograd's graphs, the graphs the step runs, without inductor's code generation (its kernels are
tests/test_compile_launch.py's). The Qwen3, Gemma 3 and Qwen3 MoE (router term on) compiled
splits are tests/test_recipe_model_families.py's, among that module's runs.

The eight runs run one after another, each forked from the tests' server (tests/many_runs.py),
so each compiled one compiles afresh: no process, and so no dynamo cache, is shared between runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dpo_utils import LORA_OPTIMIZER, LORA_SINGLE, dpo_args, initial_adapters
from grpo_utils import RECIPE as GRPO_RECIPE
from grpo_utils import SPLITS as GRPO_SPLITS
from grpo_utils import grpo_args, initial_weights, trained_weights
from many_runs import Run, launch_runs
from recipe_utils import (
    COMPILE_WITHOUT_INDUCTOR,
    INITIAL,
    LORA_TINY_CONFIG,
    TRAINED,
    assert_compiled,
    load_adapters,
    load_weights,
    lora_tiny_args,
    relative_l2,
    tiny_args,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile_parity")]

STEPS = 2
# The neighbours' plain gradient descent (SFT and LoRA: tests/test_recipe_full_single_device.py
# and tests/test_recipe_lora_single_device.py), no clipping, no warm-up.
SGD = {"optimizer._component_": "torch.optim.SGD", "optimizer.lr": 0.5}
SFT_SHAPE = {
    **SGD,
    "max_steps_per_epoch": STEPS,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
    "~optimizer.weight_decay": None,
}
# LoRA's and LoRA DPO's one sequence length (the tiny configs' tokenizer max_seq_len): no
# recompilation for a new length (LoRA 4 graphs instead of 6, LoRA DPO 3 instead of 6), about
# half those compiled runs' CPU. SFT recompiles dynamic (the module docstring).
LORA_LENGTH = 256
DPO_LENGTH = 512
# fp32's floor for these 2-step splits, compiled, against the eager full batch. Measured with
# ``pytest tests/test_compile_parity.py -p no:xdist -rP`` (torch 2.13.0+cpu, 2026-11-29, padded
# as above): SFT 3.44e-7 (variable lengths), LoRA 2.42e-7, LoRA DPO 2.37e-7, GRPO 3.27e-7, the
# rounding of other summation orders as in the neighbours' eager splits (which bound it at 2e-6
# to 1e-5 over more steps); bounded about 3x above the worst, the neighbours' margin.
FLOOR = 1e-6


def _sft(out: Path, batch_size: int, ga: int, compiled: bool) -> list[str]:
    overrides = {**SFT_SHAPE, "compile": compiled, "batch_size": batch_size}
    return _args(tiny_args(out), {**overrides, "gradient_accumulation_steps": ga})


def _lora(out: Path, batch_size: int, ga: int, compiled: bool) -> list[str]:
    overrides = {**SFT_SHAPE, "compile": compiled, "batch_size": batch_size}
    overrides["pad_to_multiple_of"] = LORA_LENGTH
    return _args(lora_tiny_args(out), {**overrides, "gradient_accumulation_steps": ga})


def _args(base: list[str], overrides: dict[str, object]) -> list[str]:
    """``base`` (recipe first) then ``overrides``; a ``~key`` (deletion) has no value."""
    return base + [k if k.startswith("~") else f"{k}={v}" for k, v in overrides.items()]


def _lora_dpo(out: Path, batch_size: int, ga: int, compiled: bool) -> list[str]:
    # tests/test_recipe_dpo_lora.py's 1x8 and 2x4, one epoch of 2 steps.
    return dpo_args(
        LORA_SINGLE,
        out,
        **LORA_OPTIMIZER,
        compile=compiled,
        epochs=1,
        max_steps_per_epoch=STEPS,
        batch_size=batch_size,
        gradient_accumulation_steps=ga,
        pad_to_multiple_of=DPO_LENGTH,
    )


def _grpo(out: Path, split: str, compiled: bool) -> list[str]:
    # tests/test_recipe_grpo.py's token_mean at ppo_epochs 1: two rollout steps, one optimizer
    # step each.
    return [
        GRPO_RECIPE,
        *grpo_args(
            out,
            loss_aggregation="token_mean",
            ppo_epochs=1,
            num_steps=STEPS,
            micro_batching="fixed",
            compile=compiled,
            **GRPO_SPLITS[split][1],
        ),
    ]


# case -> (the full batch's run, eager; the split's run, compiled): name -> tune run arguments,
# given the folder and whether the run compiles.
CASES = {
    "sft": {"4x1": lambda out, c: _sft(out, 4, 1, c), "2x2": lambda out, c: _sft(out, 2, 2, c)},
    "lora": {
        "4x1": lambda out, c: _lora(out, 4, 1, c),
        "2x2": lambda out, c: _lora(out, 2, 2, c),
    },
    "lora_dpo": {
        "1x8": lambda out, c: _lora_dpo(out, 1, 8, c),
        "2x4": lambda out, c: _lora_dpo(out, 2, 4, c),
    },
    "grpo": {
        "1rank_ga1": lambda out, c: _grpo(out, "1rank_ga1", c),
        "1rank_ga4": lambda out, c: _grpo(out, "1rank_ga4", c),
    },
}


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    def make(root: Path) -> None:
        # grpo_rewards; before the caller's own path (a worktree's src/), not instead of it.
        paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]
        tests_on_path = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        planned = []
        for case, (full_batch, split) in CASES.items():
            for name, compiled in ((full_batch, False), (split, True)):
                out = root / case / name
                args = CASES[case][name](out, compiled)
                env = COMPILE_WITHOUT_INDUCTOR if compiled else None
                planned.append(Run(args[0], args[1:], out, env))
        launch_runs(planned, nproc=0, extra_env=tests_on_path)

    return run_once("compile_parity_runs", make)


def _finished_run(runs: Path, case: str, name: str, compiled: bool) -> Path:
    """The run's folder, after checking it succeeded and, compiled, compiled and broke no
    graph."""
    out = runs / case / name
    output = (out / "output.txt").read_text()
    assert (out / "returncode").read_text() == "0", output[-4000:]
    if compiled:
        print(f"{case} {name}: {assert_compiled(output)}")
    return out


def _weights(case: str, out: Path) -> dict:
    if case in ("lora", "lora_dpo"):
        return load_adapters(out / "epoch_0" / "adapter_model.pt")
    if case == "grpo":
        return trained_weights(out)
    return load_weights(out / TRAINED)


def _initial(case: str, out: Path) -> dict:
    if case == "lora":
        return initial_adapters(LORA_TINY_CONFIG)
    if case == "lora_dpo":
        return initial_adapters()
    if case == "grpo":
        return initial_weights(out)
    return load_weights(out / INITIAL)


@pytest.mark.parametrize("case", list(CASES))
def test_a_compiled_split_lands_where_the_full_batch_does(runs, case: str) -> None:
    full_batch, split = CASES[case]
    reference_dir = _finished_run(runs, case, full_batch, compiled=False)
    split_dir = _finished_run(runs, case, split, compiled=True)
    reference = _weights(case, reference_dir)
    gap = relative_l2(_weights(case, split_dir), reference, _initial(case, reference_dir))
    print(f"{case} compiled {split} vs eager {full_batch}: relative L2 {gap:.3e}")
    assert gap <= FLOOR
