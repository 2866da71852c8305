"""A DPO run killed with SIGKILL at a random step resumes to the uninterrupted run's weights.

LoRA DPO on one device and full DPO on 2 ranks (its reference read again from
``ref_checkpointer``, never from a checkpoint), each with AdamW and the config's schedule, a
step checkpoint after every step, 2 epochs with a partial last window each. The resumed run
trains only the steps after the checkpoint it found, with the losses the uninterrupted run
logged. ``EXACTGA_KILL_SEED`` replays a kill point.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from dpo_utils import FULL_DISTRIBUTED, LORA_SINGLE, dpo_args, trained_adapters, trained_weights
from recipe_utils import (
    INITIAL,
    latest_step_checkpoint,
    launch_and_kill,
    load_weights,
    logged_steps,
    output_of,
    relative_l2,
    run_tune,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dpo_resume")]

TOLERANCE = 1e-6  # as tests/test_resume.py
EPOCHS = 2
STEPS = 10  # 20 pairs, windows of 4: 4 + 4 + 4 + 4 + 4 per epoch
RESUMABLE = {
    "epochs": EPOCHS,
    "save_every_n_steps": 1,
    "metric_logger._component_": "torchtune.training.metric_logging.DiskLogger",
}
SCENARIOS = {  # (recipe, ranks, split)
    "lora": (LORA_SINGLE, 0, {"batch_size": 2, "gradient_accumulation_steps": 2}),
    "full_2ranks": (FULL_DISTRIBUTED, 2, {"batch_size": 1, "gradient_accumulation_steps": 2}),
}


def _args(scenario: str, out: Path, **overrides: object) -> list[str]:
    recipe, nproc, split = SCENARIOS[scenario]
    return dpo_args(recipe, out, nproc, **RESUMABLE, **split, **overrides)


def _final(scenario: str, run: Path):
    return (
        trained_adapters(run, EPOCHS - 1)
        if scenario == "lora"
        else trained_weights(run, EPOCHS - 1)
    )


@pytest.fixture(scope="module")
def uninterrupted(run_once):
    def make(out: Path, scenario: str) -> None:
        proc = run_tune(_args(scenario, out), timeout=600)
        assert proc.returncode == 0, output_of(proc)[-4000:]

    return lambda scenario: run_once(f"dpo_resume_{scenario}", lambda out: make(out, scenario))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_killed_dpo_run_resumes_to_the_uninterrupted_weights(tmp_path, uninterrupted, scenario):
    seed = int(os.environ.get("EXACTGA_KILL_SEED", time.time_ns() % 1_000_000))
    print(f"EXACTGA_KILL_SEED={seed}")
    rng = random.Random(seed)
    out, kill_after = tmp_path / "run", rng.randint(1, STEPS - 4)
    launch_and_kill(
        _args(scenario, out),
        tmp_path / "killed.txt",
        ready=lambda: latest_step_checkpoint(out) >= kill_after,
        timeout_s=300,
        delay_s=rng.uniform(0.0, 0.2),
    )
    checkpoint = latest_step_checkpoint(out)
    log_dir = tmp_path / "resumed_logs"
    proc = run_tune(
        _args(scenario, out, resume_from_checkpoint=True, metric_logger__log_dir=log_dir),
        timeout=600,
    )
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert "Resuming from step checkpoint" in output_of(proc)

    reference = uninterrupted(scenario)
    if scenario == "lora":
        initial = trained_adapters(reference, 0)  # any fixed point: the gap must be ~0
    else:
        initial = load_weights(reference / INITIAL)
    gap = relative_l2(_final(scenario, out), _final(scenario, reference), initial)
    print(f"{scenario}: killed after step {checkpoint}, resumed vs uninterrupted {gap:.3e}")
    assert gap <= TOLERANCE
    resumed, full = logged_steps(log_dir), logged_steps(reference / "logs")
    assert list(full) == list(range(1, STEPS + 1))
    assert list(resumed) == list(range(checkpoint + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], rel=1e-6), step
