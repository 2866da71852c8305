"""Length-aware micro-batching on CUDA through ``tune run`` (docs/micro_batching.md).

The same global batch of 64 samples per step, split three ways: ``fixed`` 8x8 (stock's split),
``by_length`` 8x8 and ``token_budget`` 64x1 with 1024 positions per micro-batch. In fp32 the
three must train the same weights up to summation order (see [regrouping is exact] in
``exactga.data.micro_batching``), with the cuDNN/flash attention kernels of a GPU and, for one of
them, the one-rank NCCL path of the distributed recipe (the window's collective on the device).
Each run must also process fewer positions than ``fixed``: the padding fraction it logs drops.
"""

from __future__ import annotations

import pytest
from cuda_runs import FULL_DISTRIBUTED, FULL_SINGLE, INITIAL, Launch, launch_all
from recipe_utils import relative_l2

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu_micro_batching")]

FP32_PARITY = 1e-5  # the CPU parity bound (docs/math.md §7)
COMMON = {
    "dtype": "fp32",
    "max_steps_per_epoch": 4,
    "tokenizer.max_seq_len": 512,  # the bundled data then has about half padding at batch 8
    "clip_grad_norm": "null",
}
SPLITS = {
    "fixed": {"batch_size": 8, "gradient_accumulation_steps": 8, "micro_batching": "fixed"},
    "by_length": {"batch_size": 8, "gradient_accumulation_steps": 8, "micro_batching": "by_length"},
    "token_budget": {
        "batch_size": 64,
        "gradient_accumulation_steps": 1,
        "micro_batching": "token_budget",
        "micro_batch_tokens": 1024,
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launches = {name: Launch(FULL_SINGLE, {**COMMON, **split}) for name, split in SPLITS.items()}
    launches["token_budget_nccl"] = Launch(
        FULL_DISTRIBUTED, {**COMMON, **SPLITS["token_budget"]}, nproc=1
    )
    return launch_all(launches, tmp_path_factory.mktemp("gpu_micro_batching"))


@pytest.mark.parametrize("name", ["by_length", "token_budget", "token_budget_nccl"])
def test_regrouped_runs_train_the_weights_of_fixed(runs, name, record_property):
    fixed, run = runs["fixed"], runs[name]
    distance = relative_l2(run.weights(), fixed.weights(), fixed.weights(INITIAL))
    record_property("relative_l2_to_fixed", f"{distance:.2e}")
    padding = run.scalars()["throughput/padding_fraction"]
    fixed_padding = fixed.scalars()["throughput/padding_fraction"]
    record_property("padding_fraction", f"{sum(padding) / len(padding):.3f}")
    record_property("fixed_padding_fraction", f"{sum(fixed_padding) / len(fixed_padding):.3f}")
    assert distance <= FP32_PARITY
    assert run.scalars()["loss_tokens"] == fixed.scalars()["loss_tokens"]
    assert max(padding) < min(fixed_padding)
