"""A DPO run killed with SIGKILL at a random step resumes to the uninterrupted run's weights.

LoRA DPO on one device and full DPO on 2 ranks (its reference read again from
``ref_checkpointer``, never from a checkpoint), each with AdamW and the config's schedule, a
step checkpoint after every step, 2 epochs of 12 pairs in 3 windows of 4. The resumed run
trains only the steps after the checkpoint it found, with the losses the uninterrupted run
logged. ``EXACTGA_KILL_SEED`` replays the kill points (printed with ``-rP``).

Launches: the two kills; then per scenario the uninterrupted run and the resume, one after
another (tests/many_runs.py: each forked from the tests' server).
"""

from __future__ import annotations

import os
import random
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dpo_utils import FULL_DISTRIBUTED, LORA_SINGLE, dpo_args, trained_adapters, trained_weights
from many_runs import launch_runs, run_of
from recipe_utils import (
    INITIAL,
    latest_step_checkpoint,
    launch_and_kill,
    load_weights,
    logged_steps,
    relative_l2,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dpo_resume")]

TOLERANCE = 1e-6  # as tests/test_resume.py
EPOCHS = 2
PAIRS = 12  # windows of 4: 3 steps per epoch, kills after step 1 or 2 (steps before and after)
STEPS = EPOCHS * PAIRS // 4
RESUMABLE = {
    "epochs": EPOCHS,
    "dataset.split": f"train[:{PAIRS}]",
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


def _kill_seed() -> int:
    return int(os.environ.get("EXACTGA_KILL_SEED", time.time_ns() % 1_000_000))


@pytest.fixture(scope="module")
def runs(run_once):
    """Every scenario's run killed with SIGKILL at a random step (each a launch of its own, side
    by side), then per scenario its uninterrupted run and the killed one's resume, one
    after another (tests/many_runs.py: each run still the recipe as ``tune run`` starts it), the
    two scenarios side by side. ``runs(scenario)``: the scenario's folder (``uninterrupted``;
    ``killed/run``, resumed; ``resumed_logs``)."""
    seed = _kill_seed()

    def kill(root: Path, scenario: str) -> None:
        folder = root / scenario / "killed"
        folder.mkdir(parents=True)
        rng = random.Random(f"{seed}/{scenario}")
        out, kill_after = folder / "run", rng.randint(1, STEPS - 4)
        try:
            launch_and_kill(
                _args(scenario, out),
                folder / "killed.txt",
                ready=lambda: latest_step_checkpoint(out) >= kill_after,
                timeout_s=300,
                delay_s=rng.uniform(0.0, 0.2),
            )
        except BaseException:  # noqa: BLE001 - the scenario's test reports it
            (folder / "kill_failed").write_text(traceback.format_exc()[-8000:])
            return
        (folder / "checkpoint").write_text(str(latest_step_checkpoint(out)))

    def launch(root: Path, scenario: str) -> None:
        folder = root / scenario
        nproc, run = run_of(_args(scenario, folder / "uninterrupted"), folder / "uninterrupted")
        runs = [run]
        if not (folder / "killed" / "kill_failed").exists():
            resume = _args(
                scenario,
                folder / "killed" / "run",
                resume_from_checkpoint=True,
                metric_logger__log_dir=folder / "resumed_logs",
            )
            runs.append(run_of(resume, folder / "killed" / "launch")[1])
        launch_runs(runs, nproc=nproc, timeout_per_run=600)

    def make(root: Path) -> None:
        (root / "seed").write_text(str(seed))
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda scenario: kill(root, scenario), SCENARIOS))
            list(pool.map(lambda scenario: launch(root, scenario), SCENARIOS))

    return lambda scenario: run_once("dpo_resume_runs", make) / scenario


def _launched(folder: Path) -> str:
    """A run's output, after checking it succeeded (tests/many_runs.py)."""
    output = (folder / "output.txt").read_text()
    assert (folder / "returncode").read_text() == "0", output[-4000:]
    return output


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_killed_dpo_run_resumes_to_the_uninterrupted_weights(runs, scenario):
    folder = runs(scenario)
    killed = folder / "killed"
    if (killed / "kill_failed").exists():
        pytest.fail(f"the kill failed:\n{(killed / 'kill_failed').read_text()}")
    print(f"EXACTGA_KILL_SEED={(folder.parent / 'seed').read_text()}")
    reference = folder / "uninterrupted"
    _launched(reference)
    out, checkpoint = killed / "run", int((killed / "checkpoint").read_text())
    assert "Resuming from step checkpoint" in _launched(killed / "launch")

    if scenario == "lora":
        initial = trained_adapters(reference, 0)  # any fixed point: the gap must be ~0
    else:
        initial = load_weights(reference / INITIAL)
    gap = relative_l2(_final(scenario, out), _final(scenario, reference), initial)
    print(f"{scenario}: killed after step {checkpoint}, resumed vs uninterrupted {gap:.3e}")
    assert gap <= TOLERANCE
    resumed, full = logged_steps(folder / "resumed_logs"), logged_steps(reference / "logs")
    assert list(full) == list(range(1, STEPS + 1))
    assert list(resumed) == list(range(checkpoint + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], rel=1e-6), step
