"""All four recipes in bf16 on CUDA through ``tune run``, the distributed ones under torchrun
with one process on the GPU and the NCCL backend.

With one data-parallel rank the distributed recipe does not shard, but it still reduces every
window's token count over its data-parallel group, here a one-rank NCCL group with the count
on the GPU, and it trains the same batches as the single-device recipe from the same
checkpoint. So its loss tokens must equal the single-device run's exactly, and its losses up
to bf16 rounding. ``NCCL_DEBUG=INFO`` makes NCCL log its communicators, which shows the
reduction went through NCCL rather than a CPU group.
"""

from __future__ import annotations

import pytest
from cuda_runs import (
    BF16_CURVE_RTOL,
    FULL_DISTRIBUTED,
    FULL_SINGLE,
    LORA_DISTRIBUTED,
    LORA_SINGLE,
    Launch,
    all_finite,
    launch_all,
    max_relative_difference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu_recipes")]

STEPS = 6
# The same split for every recipe: 2 sequences x 2 micro-batches per step on one rank.
BF16 = {
    "dtype": "bf16",
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_steps_per_epoch": STEPS,
    "log_peak_memory_stats": True,
}
NCCL_LOG = {"NCCL_DEBUG": "INFO"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launches = {
        "full_single_device": Launch(FULL_SINGLE, BF16),
        "lora_single_device": Launch(LORA_SINGLE, BF16),
        "full_distributed": Launch(FULL_DISTRIBUTED, BF16, nproc=1, env=NCCL_LOG),
        "lora_distributed": Launch(LORA_DISTRIBUTED, BF16, nproc=1, env=NCCL_LOG),
    }
    return launch_all(launches, tmp_path_factory.mktemp("gpu_recipes"))


@pytest.mark.parametrize(
    "recipe", ["full_single_device", "lora_single_device", "full_distributed", "lora_distributed"]
)
def test_bf16_run_finishes_with_finite_loss(runs, recipe, record_property):
    scalars = runs[recipe].scalars()
    assert len(scalars["loss"]) == STEPS and all_finite(scalars["loss"])
    assert all(value > 0 for value in scalars["peak_memory_alloc"])
    record_property("final_loss", f"{scalars['loss'][-1]:.4f}")
    record_property("peak_memory_alloc_gib", f"{max(scalars['peak_memory_alloc']):.3f}")


@pytest.mark.parametrize("recipe", ["full", "lora"])
def test_nccl_token_count_reduction_matches_one_device(runs, recipe, record_property):
    single, distributed = runs[f"{recipe}_single_device"], runs[f"{recipe}_distributed"]
    assert "NCCL INFO" in distributed.output, "no NCCL communicator was created"
    tokens = distributed.scalars()["loss_tokens"]
    assert tokens == single.scalars()["loss_tokens"]
    difference = max_relative_difference(distributed.losses(), single.losses())
    record_property("max_relative_loss_difference", f"{difference:.2e}")
    assert difference <= BF16_CURVE_RTOL  # See [bf16 curve tolerance] in cuda_runs.py
