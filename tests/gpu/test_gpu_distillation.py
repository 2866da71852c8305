"""Both distillation recipes in bf16 on CUDA through ``tune run``; the distributed one under
torchrun with one process on the GPU and the NCCL backend (issue #30).

The distributed recipe's teacher is sharded with FSDP2 and runs under ``no_grad`` (issue #22:
under ``inference_mode`` it failed on one rank). With one data-parallel rank it trains the same
batches as the single-device recipe from the same checkpoints, so its loss tokens must equal the
single-device run's exactly, and its losses (the same mix of cross-entropy and KL) up to bf16
rounding. Both recipes must also log the KD-specific scalars and keep the teacher's memory
out of the autograd graph: a teacher forward that saved activations would show as a peak far
above the student-only run's.
"""

from __future__ import annotations

import pytest
from cuda_runs import BF16_CURVE_RTOL, Launch, all_finite, launch_all, max_relative_difference

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu_distillation")]

KD_SINGLE = (
    "recipes/knowledge_distillation.py",
    "configs/tiny/kd_single_device.yaml",
)
KD_DISTRIBUTED = (
    "recipes/knowledge_distillation.py",
    "configs/tiny/kd_distributed.yaml",
)
STEPS = 6
BF16 = {
    "dtype": "bf16",
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_steps_per_epoch": STEPS,
    "log_peak_memory_stats": True,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launches = {
        "single_device": Launch(KD_SINGLE, BF16),
        "distributed": Launch(KD_DISTRIBUTED, BF16, nproc=1, env={"NCCL_DEBUG": "INFO"}),
    }
    return launch_all(launches, tmp_path_factory.mktemp("gpu_distillation"))


@pytest.mark.parametrize("recipe", ["single_device", "distributed"])
def test_bf16_distillation_finishes_with_finite_losses(runs, recipe, record_property):
    scalars = runs[recipe].scalars()
    assert len(scalars["loss"]) == STEPS and all_finite(scalars["loss"])
    kd_tags = [tag for tag in scalars if "kd" in tag.lower()]
    assert kd_tags, f"no KD scalar logged: {sorted(scalars)}"
    assert all(all_finite(scalars[tag]) for tag in kd_tags)
    assert all(value > 0 for value in scalars["peak_memory_alloc"])
    assert (runs[recipe].output_dir / "epoch_0" / "adapter" / "adapter_config.json").is_file()
    record_property("final_loss", f"{scalars['loss'][-1]:.4f}")
    record_property("peak_memory_alloc_gib", f"{max(scalars['peak_memory_alloc']):.3f}")


def test_one_nccl_rank_distils_as_one_device(runs, record_property):
    single, distributed = runs["single_device"], runs["distributed"]
    assert "NCCL INFO" in distributed.output, "no NCCL communicator was created"
    assert distributed.scalars()["loss_tokens"] == single.scalars()["loss_tokens"]
    difference = max_relative_difference(distributed.losses(), single.losses())
    record_property("max_relative_loss_difference", f"{difference:.2e}")
    assert difference <= BF16_CURVE_RTOL  # See [bf16 curve tolerance] in cuda_runs.py
