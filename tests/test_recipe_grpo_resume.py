"""GRPO runs killed with SIGKILL resume bit-identically, and bad input fails with one message.

A 2-rank run with ``ppo_epochs: 2`` and a step checkpoint after every rollout step (two
optimizer steps each) is killed at a random rollout step and resumed: its final weights equal
the uninterrupted run's exactly (the completions of a step depend only on the seed, the step
and the prompt, so the resumed run generates what the uninterrupted one did), and it logs only
the steps after its checkpoint, with the same losses. ``EXACTGA_KILL_SEED`` replays a kill
point. Then the issue's bad inputs, each one message naming what is at fault, no traceback.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import torch
from grpo_utils import RECIPE, grpo_args, trained_weights
from recipe_utils import (
    latest_step_checkpoint,
    launch_and_kill,
    logged_steps,
    output_of,
    run_tune,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("grpo_resume")]

ROLLOUT_STEPS = 4  # killed after 1 or 2, resumed for the rest
PPO_EPOCHS = 2
TESTS = {"PYTHONPATH": str(Path(__file__).parent)}  # grpo_rewards, for the dense reward
RESUMABLE = {
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "ppo_epochs": PPO_EPOCHS,
    "num_steps": ROLLOUT_STEPS,
    "save_every_n_steps": 1,
    "optimizer._component_": "torch.optim.AdamW",
    "optimizer.lr": 1e-3,
    "metric_logger._component_": "torchtune.training.metric_logging.DiskLogger",
}


def _args(out: Path, **overrides: object) -> list[str]:
    return ["--nproc_per_node", "2", RECIPE, *grpo_args(out, **RESUMABLE, **overrides)]


@pytest.fixture(scope="module")
def uninterrupted(run_once) -> Path:
    def make(out: Path) -> None:
        proc = run_tune(_args(out), extra_env=TESTS, timeout=600)
        assert proc.returncode == 0, output_of(proc)[-4000:]

    return run_once("grpo_resume_uninterrupted", make)


def test_killed_grpo_run_resumes_to_the_uninterrupted_weights(tmp_path, uninterrupted) -> None:
    seed = int(os.environ.get("EXACTGA_KILL_SEED", time.time_ns() % 1_000_000))
    print(f"EXACTGA_KILL_SEED={seed}")
    rng = random.Random(seed)
    out = tmp_path / "run"
    kill_after = PPO_EPOCHS * rng.randint(1, ROLLOUT_STEPS - 2)  # checkpoints are optimizer steps
    os.environ.update(TESTS)  # launch_and_kill launches with this process's environment
    try:
        launch_and_kill(
            _args(out),
            tmp_path / "killed.txt",
            ready=lambda: latest_step_checkpoint(out) >= kill_after,
            timeout_s=300,
            delay_s=rng.uniform(0.0, 0.2),
        )
    finally:
        os.environ.pop("PYTHONPATH", None)
    checkpoint = latest_step_checkpoint(out)
    assert checkpoint % PPO_EPOCHS == 0, "a step checkpoint inside a batch's PPO epochs"
    log_dir = tmp_path / "resumed_logs"
    proc = run_tune(
        _args(out, resume_from_checkpoint=True, metric_logger__log_dir=log_dir),
        extra_env=TESTS,
        timeout=600,
    )
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert "Resuming from step checkpoint" in output_of(proc)

    resumed, reference = trained_weights(out), trained_weights(uninterrupted)
    for name, weight in reference.items():
        assert torch.equal(resumed[name], weight), f"{name} (killed after step {checkpoint})"
    full, after = logged_steps(uninterrupted / "logs"), logged_steps(log_dir)
    assert list(full) == list(range(1, ROLLOUT_STEPS * PPO_EPOCHS + 1))
    assert list(after) == list(range(checkpoint + 1, ROLLOUT_STEPS * PPO_EPOCHS + 1))
    for step, loss in after.items():
        assert loss == full[step], step


BAD_INPUTS = {
    # key=value overrides -> words the one message must hold
    "grpo_samples_1": ({"grpo_samples": 1}, ["grpo_samples", "at least 2"]),
    "prompt_too_long": (
        {"model.max_seq_len": 12, "max_generated_tokens": 8},
        ["prompt", "max_seq_len"],
    ),
    "nan_reward": (
        {"rewards": "[{_component_: grpo_rewards.NaNReward}]"},
        ["nan_reward", "finite"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_with_one_message(tmp_path, case: str) -> None:
    overrides, words = BAD_INPUTS[case]
    args = [RECIPE, *grpo_args(tmp_path / "run", num_steps=1, batch_size=2, **overrides)]
    proc = run_tune(args, extra_env=TESTS, timeout=300)
    output = output_of(proc)
    assert proc.returncode != 0
    assert "Traceback" not in output, output[-3000:]
    message = [line for line in output.splitlines() if line.startswith("exactga:")]
    assert len(message) == 1, output[-3000:]
    for word in words:
        assert word in message[0], message[0]
