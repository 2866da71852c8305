"""Launch the tiny configs on CUDA through the real ``tune run`` and read back what they wrote.

The GPU tests' counterpart of ``tests/recipe_utils.py`` (whose ``run_tune`` and
``read_scalars`` they use): no recipe is imported, every run is a subprocess, offline. The
tiny configs' own model (about 3.7M parameters, head dimension 64) is used as shipped, not the
smaller CPU-test model: on a GPU it costs nothing and keeps the attention kernels realistic.
Several launches of a module start at once from threads (a GPU has room for many tiny runs),
so a module costs about as much as its slowest launch.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from recipe_utils import load_weights, output_of, read_scalars, relative_l2, run_tune

FULL_SINGLE = ("recipes/full_finetune.py", "configs/tiny/full_single_device.yaml")
LORA_SINGLE = ("recipes/lora_finetune.py", "configs/tiny/lora_single_device.yaml")
FULL_DISTRIBUTED = ("recipes/full_finetune.py", "configs/tiny/full_distributed.yaml")
LORA_DISTRIBUTED = ("recipes/lora_finetune.py", "configs/tiny/lora_distributed.yaml")

# EXACTGA_GPU_DRY_RUN=1: the rehearsal of tests/gpu/conftest.py, these tests on the CPU.
DRY_RUN = os.environ.get("EXACTGA_GPU_DRY_RUN") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"
# A test of CUDA itself (its kernels, memory, NCCL): nothing to check on the rehearsal.
cuda_only = pytest.mark.skipif(
    DRY_RUN, reason="rehearsal on the CPU (EXACTGA_GPU_DRY_RUN=1): no CUDA to check"
)
TRAINED = "epoch_0/model-00001-of-00001.safetensors"
INITIAL = "base_model/model.safetensors"
LAUNCH_TIMEOUT_S = 900  # compile and flex attention compile kernels on first use

# [bf16 curve tolerance]
# Runs compared in bf16 start from the same seeded checkpoint and read the same batches, so
# their loss curves can differ only by rounding. Activation checkpointing recomputes the same
# kernels on the same inputs and offloading only moves saved activations to host memory and
# back: they match eager up to the nondeterministic atomics of some backward kernels (on an
# H100 they matched bit for bit). ``compile`` fuses pointwise chains and keeps their
# intermediates in fp32 where eager rounds to bf16 after every op, and the distributed recipe
# draws the initial LoRA adapters on the host, in another rounding than the single-device
# recipe: differences of single bf16 roundings (2**-8 relative) in some values. The logged loss
# averages over thousands of token losses computed in fp32, so such differences mostly cancel;
# measured on an H100 over 6-8 AdamW steps: 3e-5 relative (compile) and 1.4e-3 (LoRA,
# distributed vs single device). The bound, 1e-2 relative per step (about 2.5 bf16 rounding
# steps), leaves room for other GPUs and kernels, and stays far below what a real fault
# moves: a skipped layer, a mis-scaled micro-batch or a broken recompute changes the loss
# by tenths.
BF16_CURVE_RTOL = 1e-2


@dataclass(frozen=True)
class Launch:
    """One ``tune run``: recipe and config, overrides, and the process count (None: one
    device, no torchrun)."""

    recipe_config: tuple[str, str]
    overrides: dict[str, object]
    nproc: int | None = None
    expect_success: bool = True
    env: dict[str, str] | None = None  # added to the launch's environment

    def args(self, output_dir: Path) -> list[str]:
        """The command line after ``tune run``; an override whose value is None is passed
        bare (``~key`` deletes a key)."""
        recipe, config = self.recipe_config
        merged = {"output_dir": output_dir, "device": DEVICE, **self.overrides}
        overrides = [key if value is None else f"{key}={value}" for key, value in merged.items()]
        torchrun = [] if self.nproc is None else ["--nproc_per_node", str(self.nproc)]
        return [*torchrun, recipe, "--config", config, *overrides]


@dataclass(frozen=True)
class Run:
    """What one launch left behind."""

    name: str
    output_dir: Path
    returncode: int
    output: str

    def scalars(self) -> dict[str, list[float]]:
        """Every TensorBoard scalar of the run, by tag, in step order."""
        return read_scalars(self.output_dir / "logs")

    def losses(self) -> list[float]:
        return self.scalars()["loss"]

    def weights(self, relative_path: str = TRAINED):
        return load_weights(self.output_dir / relative_path)


def launch_all(launches: dict[str, Launch], root: Path) -> dict[str, Run]:
    """Run every launch at once, each in ``root/<name>``; fail naming a run that did not end
    as expected (its output's tail in the message)."""

    def one(name: str) -> Run:
        launch = launches[name]
        output_dir = root / name
        proc = run_tune(launch.args(output_dir), extra_env=launch.env, timeout=LAUNCH_TIMEOUT_S)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "output.txt").write_text(output_of(proc))
        return Run(name, output_dir, proc.returncode, output_of(proc))

    with ThreadPoolExecutor(max_workers=len(launches)) as pool:
        runs = dict(zip(launches, pool.map(one, launches), strict=True))
    for name, run in runs.items():
        succeeded = run.returncode == 0
        assert succeeded == launches[name].expect_success, (
            f"run '{name}' exited with {run.returncode}:\n{run.output[-6000:]}"
        )
    return runs


def max_relative_difference(values: list[float], reference: list[float]) -> float:
    """``max |a - b| / |b|`` over two loss curves of the same length."""
    assert len(values) == len(reference), (len(values), len(reference))
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))


def all_finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


__all__ = [
    "BF16_CURVE_RTOL",
    "DEVICE",
    "DRY_RUN",
    "FULL_DISTRIBUTED",
    "FULL_SINGLE",
    "INITIAL",
    "LORA_DISTRIBUTED",
    "LORA_SINGLE",
    "TRAINED",
    "Launch",
    "Run",
    "all_finite",
    "cuda_only",
    "launch_all",
    "max_relative_difference",
    "relative_l2",
]
