"""GRPO runs killed with SIGKILL resume bit-identically, and bad input fails with one message.

A 2-rank run with ``ppo_epochs: 2`` and a step checkpoint after every rollout step (two
optimizer steps each) is killed at a random rollout step and resumed: its final weights equal
the uninterrupted run's exactly (the completions of a step depend only on the seed, the step
and the prompt, so the resumed run generates what the uninterrupted one did), and it logs only
the steps after its checkpoint, with the same losses. ``EXACTGA_KILL_SEED`` replays a kill
point. Then the issue's bad inputs, each one message naming what is at fault, no traceback.

Launches: the killed one; then, each run forked from the tests' server (tests/many_runs.py), the
uninterrupted run and the resume on 2 ranks, and the bad inputs, one after another.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from grpo_utils import RECIPE, grpo_args, trained_weights
from many_runs import launch_runs, run_of
from recipe_utils import latest_step_checkpoint, launch_and_kill, logged_steps

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("grpo_resume")]

ROLLOUT_STEPS = 4  # killed after 1 or 2, resumed for the rest
PPO_EPOCHS = 2
# grpo_rewards, for the dense reward, before what the launching environment already has.
PYTHONPATH = os.environ.get("PYTHONPATH")
TESTS = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), PYTHONPATH]))}
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


def _kill_seed() -> int:
    return int(os.environ.get("EXACTGA_KILL_SEED", time.time_ns() % 1_000_000))


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    """The module's runs, once per session: the killed launch (a launch of its own, killed with
    SIGKILL at a random rollout step), then the uninterrupted run and the killed run's resume
    one after another on 2 ranks, and the bad inputs one after another on one process, side
    by side (tests/many_runs.py: each run forked from the tests' server, still the recipe as
    ``tune run`` starts it, keeping its own status and output; a failing run fails no other)."""

    def make(root: Path) -> None:
        seed = _kill_seed()
        rng = random.Random(seed)
        out = root / "killed" / "run"
        out.parent.mkdir()
        kill_after = PPO_EPOCHS * rng.randint(1, ROLLOUT_STEPS - 2)  # optimizer steps
        try:
            launch_and_kill(
                _args(out),
                root / "killed" / "killed.txt",
                ready=lambda: latest_step_checkpoint(out) >= kill_after,
                timeout_s=300,
                delay_s=rng.uniform(0.0, 0.2),
                extra_env=TESTS,
            )
            (root / "killed" / "draw").write_text(f"EXACTGA_KILL_SEED={seed}")
        except BaseException:  # noqa: BLE001 - the resume test reports it
            (root / "killed" / "kill_failed").write_text(traceback.format_exc()[-8000:])
        two_ranks = [run_of(_args(root / "uninterrupted"), root / "uninterrupted")[1]]
        if not (root / "killed" / "kill_failed").exists():
            (root / "killed" / "checkpoint").write_text(str(latest_step_checkpoint(out)))
            resume = _args(
                out, resume_from_checkpoint=True, metric_logger__log_dir=root / "resumed_logs"
            )
            two_ranks.append(run_of(resume, root / "killed" / "launch")[1])
        bad = []
        for case, (overrides, _) in BAD_INPUTS.items():
            args = [RECIPE, *grpo_args(root / case / "run", num_steps=1, batch_size=2, **overrides)]
            bad.append(run_of(args, root / case / "launch")[1])
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [
                pool.submit(launch_runs, two_ranks, nproc=2, extra_env=TESTS, timeout_per_run=600),
                pool.submit(launch_runs, bad, nproc=0, extra_env=TESTS),
            ]
            for future in futures:
                future.result()

    return run_once("grpo_resume_runs", make)


def _launched(folder: Path) -> tuple[int, str]:
    """A run's status and output (tests/many_runs.py)."""
    return int((folder / "returncode").read_text()), (folder / "output.txt").read_text()


def test_killed_grpo_run_resumes_to_the_uninterrupted_weights(runs) -> None:
    killed = runs / "killed"
    if (killed / "kill_failed").exists():
        pytest.fail(f"the kill failed:\n{(killed / 'kill_failed').read_text()}")
    print((killed / "draw").read_text())
    uninterrupted = runs / "uninterrupted"
    status, output = _launched(uninterrupted)
    assert status == 0, output[-4000:]
    checkpoint = int((killed / "checkpoint").read_text())
    assert checkpoint % PPO_EPOCHS == 0, "a step checkpoint inside a batch's PPO epochs"
    status, output = _launched(killed / "launch")
    assert status == 0, output[-4000:]
    assert "Resuming from step checkpoint" in output

    resumed, reference = trained_weights(killed / "run"), trained_weights(uninterrupted)
    for name, weight in reference.items():
        assert torch.equal(resumed[name], weight), f"{name} (killed after step {checkpoint})"
    full, after = logged_steps(uninterrupted / "logs"), logged_steps(runs / "resumed_logs")
    assert list(full) == list(range(1, ROLLOUT_STEPS * PPO_EPOCHS + 1))
    assert list(after) == list(range(checkpoint + 1, ROLLOUT_STEPS * PPO_EPOCHS + 1))
    for step, loss in after.items():
        assert loss == full[step], step


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_with_one_message(runs, case: str) -> None:
    _, words = BAD_INPUTS[case]
    status, output = _launched(runs / case / "launch")
    assert status != 0
    assert "Traceback" not in output, output[-3000:]
    message = [line for line in output.splitlines() if line.startswith("exactga:")]
    assert len(message) == 1, output[-3000:]
    for word in words:
        assert word in message[0], message[0]
