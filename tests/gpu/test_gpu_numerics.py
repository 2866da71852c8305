"""bf16 on CUDA through ``tune run``: ``compile``, activation checkpointing and activation
offloading train the same loss curve as eager, within bf16 tolerance.

See [bf16 curve tolerance] in cuda_runs.py for the bound and why.
"""

from __future__ import annotations

import pytest
from cuda_runs import (
    BF16_CURVE_RTOL,
    FULL_SINGLE,
    Launch,
    all_finite,
    launch_all,
    max_relative_difference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu_numerics")]

STEPS = 8
BASE = {"dtype": "bf16", "max_steps_per_epoch": STEPS, "saved_latency_every_n_steps": 0}
VARIANTS = {
    "compile": {"compile": True},
    "activation_checkpointing": {"enable_activation_checkpointing": True},
    "activation_offloading": {
        "enable_activation_checkpointing": True,
        "enable_activation_offloading": True,
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launches = {"eager": Launch(FULL_SINGLE, BASE)}
    for name, overrides in VARIANTS.items():
        launches[name] = Launch(FULL_SINGLE, {**BASE, **overrides})
    return launch_all(launches, tmp_path_factory.mktemp("gpu_numerics"))


def test_bf16_eager_run_finishes_with_finite_loss(runs):
    losses = runs["eager"].losses()
    assert len(losses) == STEPS and all_finite(losses)
    assert losses[-1] < losses[0], "eight steps of AdamW should lower the loss"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_the_eager_loss_curve(runs, variant, record_property):
    eager, losses = runs["eager"].losses(), runs[variant].losses()
    assert all_finite(losses)
    difference = max_relative_difference(losses, eager)
    record_property("max_relative_loss_difference", f"{difference:.2e}")
    record_property("first_step_relative_difference", f"{abs(losses[0] / eager[0] - 1):.2e}")
    assert difference <= BF16_CURVE_RTOL, (variant, losses, eager)  # See [bf16 curve tolerance]
