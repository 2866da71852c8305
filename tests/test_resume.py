"""Kill a run with SIGKILL at a random step, resume it, and end where an uninterrupted run ends.

Tier (b) of docs/contributing.md point 9: the real ``tune run`` in a subprocess, on CPU, offline.
Each scenario trains 12 steps over two epochs with a step checkpoint after every step, once without
interruption and once killed (the whole process group, as a lost machine would be) as soon as
a checkpoint of a randomly drawn step exists, plus a random delay so the kill may land mid-step
or mid-save. The resumed run must end with the same weights (relative L2 <= 1e-6; in practice
they are bit-identical) and, logging into a folder of its own, log exactly the steps after the
checkpoint it went on from, with the uninterrupted run's losses: a run that printed "Resuming"
and then retrained from step 0 would end on the same weights too (same seed, same data), and
only its logged steps tell it apart. The draw is printed (``-rP``); ``EXACTGA_KILL_SEED``
replays one.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from many_runs import launch_runs, run_of
from recipe_utils import (
    LORA_RECIPE,
    LORA_TINY_CONFIG,
    RECIPE,
    SMALL_MODEL,
    TINY_CONFIG,
    latest_step_checkpoint,
    launch_and_kill,
    load_weights,
    logged_steps,
    output_of,
    relative_l2,
    run_tune,
)

pytestmark = pytest.mark.slow

TOLERANCE = 1e-6
STEPS_PER_EPOCH = 6
EPOCHS = 2
FINAL = f"epoch_{EPOCHS - 1}/model-00001-of-00001.safetensors"
INITIAL = "base_model/model.safetensors"
KILL_TIMEOUT_S = 240

# Every step checkpointed, AdamW with a warm-up and cosine schedule (the scheduler and the
# optimizer moments must both resume), shuffled data over two epochs.
RESUMABLE = {
    "max_steps_per_epoch": STEPS_PER_EPOCH,
    "epochs": EPOCHS,
    "save_every_n_steps": 1,
    "metric_logger._component_": "torchtune.training.metric_logging.DiskLogger",
}

TENSORBOARD = "torchtune.training.metric_logging.TensorBoardLogger"
SCENARIOS = {
    # TensorBoard: the resumed launch goes on in the killed one's run folder (see
    # [resumed TensorBoard run] in exactga.run.metric_logging).
    "full": ([RECIPE, "--config", TINY_CONFIG], {"metric_logger._component_": TENSORBOARD}),
    "lora": ([LORA_RECIPE, "--config", LORA_TINY_CONFIG], {}),
    # fp32 master weights under bf16 (docs/precision.md): the step checkpoints hold the fp32
    # weights and optimizer state, so the resumed run ends bit for bit where this one ends.
    "full_bf16_master": (
        [RECIPE, "--config", TINY_CONFIG],
        {"dtype": "bf16", "master_weights": "fp32"},
    ),
    "lora_bf16_master": ([LORA_RECIPE, "--config", LORA_TINY_CONFIG], {"dtype": "bf16"}),
    "full_2ranks": (
        [
            *("--nproc_per_node", "2", "recipes/full_finetune_distributed.py"),
            *("--config", "configs/tiny/full_distributed.yaml"),
        ],
        {},
    ),
}


def _args(scenario: str, out: Path, **overrides: object) -> list[str]:
    head, extra = SCENARIOS[scenario]
    settings = {**SMALL_MODEL, **RESUMABLE, **extra, "output_dir": out, **overrides}
    return [*head, *(f"{key}={value}" for key, value in settings.items())]


def _kill_seed() -> int:
    return int(os.environ.get("EXACTGA_KILL_SEED", time.time_ns() % 1_000_000))


def _run_and_kill(scenario: str, out: Path, rng: random.Random, first_step: int = 1) -> None:
    """Launch, and SIGKILL it (every rank) once a random step's checkpoint exists."""
    kill_after = rng.randint(first_step, STEPS_PER_EPOCH * EPOCHS - 4)
    delay = rng.uniform(0.0, 0.2)
    launch_and_kill(
        _args(scenario, out),
        out.parent / f"{out.name}_killed.txt",
        ready=lambda: latest_step_checkpoint(out) >= kill_after,
        timeout_s=KILL_TIMEOUT_S,
        delay_s=delay,
    )
    print(f"{scenario}: killed after step {kill_after} + {delay:.2f} s")


@pytest.fixture(scope="module")
def uninterrupted(run_once):
    """Each scenario's run without interruption, made on first use, once per session (under
    ``pytest -n`` the module's tests run on several workers; they share these runs): every
    scenario's, one launch per rank count (tests/many_runs.py)."""

    def make(root: Path) -> None:
        by_ranks: dict[int, list] = {}
        for scenario in SCENARIOS:
            nproc, run = run_of(_args(scenario, root / scenario), root / scenario)
            by_ranks.setdefault(nproc, []).append(run)
        for nproc, runs in by_ranks.items():
            launch_runs(runs, nproc=nproc)
        for scenario in SCENARIOS:
            output = (root / scenario / "output.txt").read_text()
            assert (root / scenario / "returncode").read_text() == "0", output[-4000:]

    def get(scenario: str) -> Path:
        return run_once("resume_uninterrupted", make) / scenario

    return get


def _distance(run: Path, reference: Path) -> float:
    initial = load_weights(reference / INITIAL)
    return relative_l2(load_weights(run / FINAL), load_weights(reference / FINAL), initial)


def _resume(scenario: str, out: Path, log_dir: Path | None) -> None:
    """Resume the killed run in ``out``, logging into ``log_dir`` (a folder of its own), or
    with ``None`` into the run's own."""
    overrides: dict[str, object] = {"resume_from_checkpoint": True}
    if log_dir is not None:
        overrides["metric_logger.log_dir"] = log_dir
    proc = run_tune(_args(scenario, out, **overrides), timeout=600)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert "Resuming from step checkpoint" in output_of(proc)


def _resumed_launch_events(log_dir: Path, reference: Path) -> Path:
    """The resumed launch's own event file in the killed run's TensorBoard run folder, after
    checking that folder reads as one run: each step once, with the uninterrupted run's loss
    (the killed launch's steps past its checkpoint were dropped, those before it flushed)."""
    folders = sorted(log_dir.glob("run_*"))
    # A second folder: the launch started a run of its own instead of going on with the killed one.
    assert len(folders) == 1, f"the resumed launch logged as another run: {folders}"
    (run_folder,) = folders
    whole, uninterrupted = logged_steps(run_folder), logged_steps(reference / "logs")
    assert list(whole) == list(uninterrupted)
    for step, loss in whole.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6), step
    files = run_folder.glob("events.out.tfevents.*")
    return max(files, key=lambda path: float(path.name.split(".")[3]))


def _check_trained_only_the_rest(log_dir: Path, reference: Path, after_step: int) -> None:
    """The resumed run logged steps ``after_step + 1`` to the last and no other, each with the
    loss the uninterrupted run ``reference`` logged at that step. (The message "Resuming from
    step checkpoint" is printed before anything is restored, so it does not show this.)"""
    resumed, uninterrupted = logged_steps(log_dir), logged_steps(reference / "logs")
    print(f"resumed after step {after_step}: logged steps {list(resumed)}")
    assert list(uninterrupted) == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))
    assert list(resumed) == list(range(after_step + 1, STEPS_PER_EPOCH * EPOCHS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6), step


@pytest.mark.xdist_group("resume_uninterrupted")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_killed_run_resumes_to_the_uninterrupted_weights(tmp_path, uninterrupted, scenario):
    seed = _kill_seed()
    print(f"EXACTGA_KILL_SEED={seed}")
    out = tmp_path / "run"
    _run_and_kill(scenario, out, random.Random(seed))
    checkpoint = latest_step_checkpoint(out)  # what the resumed run must go on from

    appends = SCENARIOS[scenario][1].get("metric_logger._component_") == TENSORBOARD
    log_dir = None if appends else tmp_path / "resumed_logs"
    _resume(scenario, out, log_dir)
    rel = _distance(out, uninterrupted(scenario))
    print(f"{scenario}: resumed vs uninterrupted relative L2 {rel:.3e}")
    assert rel <= TOLERANCE
    if appends:
        log_dir = _resumed_launch_events(out / "logs", uninterrupted(scenario))
    _check_trained_only_the_rest(log_dir, uninterrupted(scenario), checkpoint)


@pytest.mark.xdist_group("resume_uninterrupted")
def test_truncated_latest_checkpoint_falls_back_to_the_previous(tmp_path, uninterrupted):
    out = tmp_path / "run"
    _run_and_kill("full", out, random.Random(_kill_seed()), first_step=2)  # two checkpoints
    step = latest_step_checkpoint(out)
    latest = out / "step_checkpoints" / f"step_{step:06d}" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])

    log_dir = tmp_path / "resumed_logs"
    overrides = {"resume_from_checkpoint": True, "metric_logger.log_dir": log_dir}
    proc = run_tune(_args("full", out, **overrides), timeout=600)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert f"{latest}" in output_of(proc) and "truncated" in output_of(proc)
    assert "falling back to the previous step checkpoint" in output_of(proc)
    assert _distance(out, uninterrupted("full")) <= TOLERANCE
    _check_trained_only_the_rest(log_dir, uninterrupted("full"), after_step=step - 1)


@pytest.mark.xdist_group("resume_uninterrupted")
def test_resume_refuses_a_changed_batch_split(uninterrupted, tmp_path):
    done = uninterrupted("full")
    out = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(done), str(out)], check=True)
    proc = run_tune(
        _args("full", out, resume_from_checkpoint=True, batch_size=2, gradient_accumulation_steps=4)
    )
    assert proc.returncode != 0
    message = output_of(proc)
    assert "'batch_size': 4 in the checkpoint, 2 now" in message
    assert "'gradient_accumulation_steps': 2 in the checkpoint, 4 now" in message
    assert "resume_allow_changed_keys=[batch_size,gradient_accumulation_steps]" in message


def test_nonfinite_loss_stops_with_a_checkpoint_then_skips(tmp_path):
    """An absurd learning rate makes the loss or the gradient norm inf/NaN within two steps.
    ``stop`` names the step and saves the finite weights before it; resumed under ``skip``, the
    run skips the rest and ends with finite weights."""
    out = tmp_path / "run"
    blow_up = {
        "optimizer._component_": "torch.optim.SGD",
        "optimizer.lr": 1e30,
        "~optimizer.weight_decay": None,
        "lr_scheduler.num_warmup_steps": 0,
        "save_every_n_steps": 100,
        "epochs": 1,
    }
    args = _args("full", out, **{k: v for k, v in blow_up.items() if v is not None})
    args += [k for k, v in blow_up.items() if v is None]
    proc = run_tune([*args, "nonfinite_loss=stop"])
    assert proc.returncode != 0
    stopped = re.search(r"non-finite loss at step (\d+) \(nonfinite_loss: stop\)", output_of(proc))
    assert stopped, output_of(proc)[-4000:]
    saved = out / "step_checkpoints" / f"step_{int(stopped.group(1)):06d}"
    assert f"saved in {saved}" in output_of(proc)
    weights = load_weights(saved / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())

    proc = run_tune([*args, "nonfinite_loss=skip", "resume_from_checkpoint=True"])
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert "the step is skipped (nonfinite_loss: skip)" in output_of(proc)
    final = load_weights(out / "epoch_0/model-00001-of-00001.safetensors")
    assert all(torch.isfinite(w).all() for w in final.values())


@pytest.mark.xdist_group("resume_uninterrupted")
def test_checkpoint_of_another_model_is_named(tmp_path, uninterrupted):
    """The tiny config's own sizes (embed_dim 256) pointed at the small model's weights (64)."""
    small = uninterrupted("full")
    proc = run_tune(
        [
            RECIPE,
            "--config",
            TINY_CONFIG,
            f"output_dir={tmp_path / 'other'}",
            f"checkpointer.checkpoint_dir={small / 'base_model'}",
            "max_steps_per_epoch=1",
        ]
    )
    assert proc.returncode != 0
    message = output_of(proc)
    assert (
        f"checkpointer.checkpoint_dir ({small / 'base_model'}) does not fit config key" in message
    )
    assert "has shape (2048, 64) in the checkpoint and (2048, 256) in the model" in message
