"""Kill a run with SIGKILL at a random step, resume it, and end where an uninterrupted run ends.

Tier (b) of docs/contributing.md point 9: the real ``tune run`` in a subprocess, on CPU, offline.
Each scenario trains 8 steps over two epochs with a step checkpoint after every step, once without
interruption and once killed (the whole process group, as a lost machine would be) as soon as
a checkpoint of a randomly drawn step exists, plus a random delay so the kill may land mid-step
or mid-save. The resumed run must end with the same weights (relative L2 <= 1e-6; in practice
they are bit-identical) and, logging into a folder of its own, log exactly the steps after the
checkpoint it went on from, with the uninterrupted run's losses: a run that printed "Resuming"
and then retrained from step 0 would end on the same weights too (same seed, same data), and
only its logged steps tell it apart. The draws are printed (``-rP``); ``EXACTGA_KILL_SEED``
replays them.

Launches: the kills, one each (what they show needs a process killed with SIGKILL); every other
run shares a launch per rank count (tests/many_runs.py): the uninterrupted runs with the runs that
must fail on a finished run and the resume lineage's three runs, and the resumed runs.

The resume lineage (issue #62; [retired step checkpoints] in exactga.run.checkpointing): launch A
stops after step 7; launch B, the same command, starts over in the same folder (A's step
checkpoints are moved aside, with a note) and stops after step 5; B's printed command resumes
B's step 5, ends bit-identical to the uninterrupted run and logs into B's TensorBoard run.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
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
    relative_l2,
)
from run_hooks import STOP_AFTER_STEP

from exactga.checkpoints.contents import BEST_RECORD

# Every test reads the module's shared launches (the fixtures ``uninterrupted`` and ``resumed``).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume_uninterrupted")]

TOLERANCE = 1e-6
# Kills land after steps 1 to 4 of 8 (4 left, so the run is still training when the kill
# lands); the lineage's B resumes in the second epoch.
STEPS_PER_EPOCH = 4
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
# Validation during training (docs/validation.md) in the LoRA scenario: after steps 3 and 6,
# and at each epoch's end (4, 8), on the training rows' first 6 (2 batches of 3). A resumed run
# validates the steps after its checkpoint, with the uninterrupted run's figures, and keeps the
# same best checkpoint (keep_best_checkpoint: its figure is in the step checkpoints).
VALIDATED = {
    "dataset_val": "${dataset}",
    "run_val_every_n_steps": 3,
    "batch_size_val": 3,
    "max_val_batches": 2,
    "keep_best_checkpoint": True,
}
VALIDATED_STEPS = [3, 4, 6, 8]
SCENARIOS = {
    # TensorBoard: the resumed launch goes on in the killed one's run folder (see
    # [resumed TensorBoard run] in exactga.run.metric_logging).
    "full": ([RECIPE, "--config", TINY_CONFIG], {"metric_logger._component_": TENSORBOARD}),
    "lora": ([LORA_RECIPE, "--config", LORA_TINY_CONFIG], VALIDATED),
    # fp32 master weights under bf16 (docs/precision.md): the step checkpoints hold the fp32
    # weights and optimizer state, so the resumed run ends bit for bit where this one ends.
    "full_bf16_master": (
        [RECIPE, "--config", TINY_CONFIG],
        {"dtype": "bf16", "master_weights": "fp32"},
    ),
    "lora_bf16_master": ([LORA_RECIPE, "--config", LORA_TINY_CONFIG], {"dtype": "bf16"}),
    # The data's first 128 rows, twice the 64 its 8 steps of 8 read (each epoch ends at its
    # step cap, not at the data's end): each rank's length index then tokenizes 64 rows at
    # start-up instead of the shipped 2,069's half. The killed, resumed and uninterrupted runs
    # all take the scenario's arguments, so the slice alike.
    "full_2ranks": (
        [
            *("--nproc_per_node", "2", "recipes/full_finetune.py"),
            *("--config", "configs/tiny/full_distributed.yaml"),
        ],
        {"dataset.split": "train[:128]"},
    ),
}


def _args(scenario: str, out: Path, **overrides: object) -> list[str]:
    head, extra = SCENARIOS[scenario]
    settings = {**SMALL_MODEL, **RESUMABLE, **extra, "output_dir": out, **overrides}
    return [*head, *(f"{key}={value}" for key, value in settings.items())]


def _kill_seed() -> int:
    return int(os.environ.get("EXACTGA_KILL_SEED", time.time_ns() % 1_000_000))


def _run_and_kill(scenario: str, out: Path, rng: random.Random, first_step: int = 1) -> str:
    """Launch, and SIGKILL it (every rank) once a random step's checkpoint exists; returns
    the draw, for the test to print."""
    kill_after = rng.randint(first_step, STEPS_PER_EPOCH * EPOCHS - 4)
    delay = rng.uniform(0.0, 0.2)
    launch_and_kill(
        _args(scenario, out),
        out.parent / f"{out.name}_killed.txt",
        ready=lambda: latest_step_checkpoint(out) >= kill_after,
        timeout_s=KILL_TIMEOUT_S,
        delay_s=delay,
    )
    return f"{scenario}: killed after step {kill_after} + {delay:.2f} s"


# A run whose last step checkpoint is cut in half before it resumes: the "full" scenario's.
TRUNCATED = "truncated"
# The absurd learning rate of the non-finite loss test.
BLOW_UP = {
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 1e30,
    "~optimizer.weight_decay": None,
    "lr_scheduler.num_warmup_steps": 0,
    "save_every_n_steps": 100,
    "epochs": 1,
}


def _blow_up_args(out: Path, nonfinite_loss: str, *extra: str) -> list[str]:
    args = _args("full", out, **{k: v for k, v in BLOW_UP.items() if v is not None})
    return [
        *args,
        *(k for k, v in BLOW_UP.items() if v is None),
        f"nonfinite_loss={nonfinite_loss}",
        *extra,
    ]


def _failing_runs(root: Path) -> dict[str, list[str]]:
    """The module's runs that read a finished run (made first in the same launch) or follow
    one another: the refusals and the non-finite loss's stop then resume. Each runs in the
    folder ``root / name``, output directories as named."""
    finished = root / "full"  # the uninterrupted run, made before these in the launch
    to_refuse = root / "refusal_base" / "run"  # a finished run the refusal may not touch
    other = root / "other_model"
    return {
        "refusal_base": _args("full", to_refuse),
        # 2 x 4 on one device: the same global batch of 8 as the config's 4 x 2, which resumes
        # (tests/test_resume_resharded.py); 2 x 2 is another run.
        "changed_global_batch": _args("full", to_refuse, resume_from_checkpoint=True, batch_size=2),
        # The tiny config's own sizes (embed_dim 256) pointed at the small model's weights (64).
        "other_model": [
            RECIPE,
            "--config",
            TINY_CONFIG,
            f"output_dir={other / 'out'}",
            f"checkpointer.checkpoint_dir={finished / 'base_model'}",
            "max_steps_per_epoch=1",
        ],
        "nonfinite_stop": _blow_up_args(root / "nonfinite", "stop"),
        "nonfinite_skip": _blow_up_args(root / "nonfinite", "skip", "resume_from_checkpoint=True"),
    }


# The resume lineage: A stops after LINEAGE_A_STOP, B (starting over) after LINEAGE_B_STOP, then
# B's printed command runs. Each stop is a SIGTERM the run sends itself after that step
# (tests/run_hooks.py), and the command line is set as typed (``tune run ...``), as tune's
# launcher sets it for its ranks: the tests start the virtual environment's tune by its path.
# B's step 5 is older than A's last two (6, 7), and B resumes after one step of the second epoch.
LINEAGE_A_STOP, LINEAGE_B_STOP = 7, 5
LAUNCH_COMMAND_ENV = "EXACTGA_LAUNCH_COMMAND"  # exactga.launch.stopping's
LINEAGE_STOP = re.compile(
    r"exactga: stopped by SIGTERM after step (\d+) of 8 \(epoch \d of 2\); "
    r"step checkpoint in (\S+)\. To go on: (.+)$",
    re.M,
)


def _lineage_runs(root: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The resume lineage's runs in launch order, each with its environment: all three train
    into ``root / "lineage" / "run"``."""
    out = root / "lineage" / "run"
    command = _args("full", out)
    resume = [*command, "resume_from_checkpoint=True"]  # what B's stop line must print
    return {
        "lineage_a": (command, {STOP_AFTER_STEP: str(LINEAGE_A_STOP)}),
        "lineage_b": (command, {STOP_AFTER_STEP: str(LINEAGE_B_STOP)}),
        "lineage_b_resumed": (resume, {}),
    }


def _with_launch_command(args: list[str], env: dict[str, str]) -> dict[str, str]:
    return {**env, LAUNCH_COMMAND_ENV: json.dumps(["tune", "run", *args])}


@pytest.fixture(scope="module")
def uninterrupted(run_once):
    """Each scenario's run without interruption, made on first use, once per session (under
    ``pytest -n`` the module's tests run on several workers; they share these runs): every
    scenario's, one after another per rank count (tests/many_runs.py). The one-process runs go
    on with the runs of ``_failing_runs`` (each keeping its own status and output), which must
    come after the finished run they read."""

    def make(root: Path) -> None:
        by_ranks: dict[int, list] = {}
        for scenario in SCENARIOS:
            nproc, run = run_of(_args(scenario, root / scenario), root / scenario)
            by_ranks.setdefault(nproc, []).append(run)
        for name, args in _failing_runs(root).items():
            nproc, run = run_of(args, root / name / "launch")
            assert nproc == 0
            by_ranks[0].append(run)
        for name, (args, env) in _lineage_runs(root).items():
            nproc, run = run_of(args, root / name / "launch")
            assert nproc == 0
            by_ranks[0].append(run._replace(env=_with_launch_command(args, env)))
        for nproc, runs in by_ranks.items():
            launch_runs(runs, nproc=nproc)
        for scenario in SCENARIOS:
            output = (root / scenario / "output.txt").read_text()
            assert (root / scenario / "returncode").read_text() == "0", output[-4000:]

    def get(scenario: str) -> Path:
        return run_once("resume_uninterrupted", make) / scenario

    return get


def _launched(root: Path, name: str) -> tuple[int, str]:
    """The status and output of the run ``name`` of ``_failing_runs``."""
    folder = root / name / "launch"
    return int((folder / "returncode").read_text()), (folder / "output.txt").read_text()


@pytest.fixture(scope="module")
def resumed(run_once, uninterrupted):
    """Every scenario's run killed at a random step (and ``TRUNCATED``'s, after its second
    checkpoint, with its latest checkpoint then cut in half), each killed with SIGKILL, two at
    a time; then resumed, one after another (tests/many_runs.py, each keeping its own status
    and output). Each resumed run logs into a folder of its own, except the TensorBoard
    scenario's (the run's own, which it must go on in).

    ``resumed(name)``: the run's folder (``run``: the killed and resumed output directory;
    ``draw``: the kill's draw; ``checkpoint``: the step it resumed from; ``launch``: the resumed
    launch's ``output.txt`` and ``returncode``), or the failure of its kill."""
    seed = _kill_seed()

    def kill(root: Path, name: str) -> None:
        folder = root / name
        folder.mkdir()
        scenario = "full" if name == TRUNCATED else name
        rng = random.Random(f"{seed}/{name}")
        try:
            draw = _run_and_kill(scenario, folder / "run", rng, 2 if name == TRUNCATED else 1)
        except BaseException:  # noqa: BLE001 - the scenario's own test reports it
            (folder / "kill_failed").write_text(traceback.format_exc()[-8000:])
            return
        (folder / "draw").write_text(f"EXACTGA_KILL_SEED={seed}: {draw}")
        step = latest_step_checkpoint(folder / "run")
        (folder / "checkpoint").write_text(str(step))
        if name == TRUNCATED:
            latest = folder / "run" / "step_checkpoints" / f"step_{step:06d}" / "model.safetensors"
            latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
            (folder / "truncated").write_text(str(latest))

    def make(root: Path) -> None:
        uninterrupted("full")  # made first: the kills would compete with it for the cores
        names = [*SCENARIOS, TRUNCATED]
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda name: kill(root, name), names))
        by_ranks: dict[int, list] = {}
        for name in names:
            if (root / name / "kill_failed").exists():
                continue
            scenario = "full" if name == TRUNCATED else name
            overrides: dict[str, object] = {"resume_from_checkpoint": True}
            appends = SCENARIOS[scenario][1].get("metric_logger._component_") == TENSORBOARD
            if name == TRUNCATED or not appends:  # the truncated run's logs: a folder of their own
                overrides["metric_logger.log_dir"] = root / name / "resumed_logs"
            args = _args(scenario, root / name / "run", **overrides)
            nproc, run = run_of(args, root / name / "launch")
            by_ranks.setdefault(nproc, []).append(run)
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [
                pool.submit(launch_runs, runs, nproc=nproc) for nproc, runs in by_ranks.items()
            ]
            for future in futures:
                future.result()

    def get(name: str) -> Path:
        folder = run_once("resume_killed", make) / name
        if (folder / "kill_failed").exists():
            pytest.fail(f"{name}: the kill failed:\n{(folder / 'kill_failed').read_text()}")
        print((folder / "draw").read_text())
        output = (folder / "launch" / "output.txt").read_text()
        assert (folder / "launch" / "returncode").read_text() == "0", output[-4000:]
        assert "Resuming from step checkpoint" in output
        return folder

    return get


def _distance(run: Path, reference: Path) -> float:
    initial = load_weights(reference / INITIAL)
    return relative_l2(load_weights(run / FINAL), load_weights(reference / FINAL), initial)


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


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_killed_run_resumes_to_the_uninterrupted_weights(resumed, uninterrupted, scenario):
    folder = resumed(scenario)
    out = folder / "run"
    checkpoint = int((folder / "checkpoint").read_text())  # what the resumed run went on from
    appends = SCENARIOS[scenario][1].get("metric_logger._component_") == TENSORBOARD
    rel = _distance(out, uninterrupted(scenario))
    print(f"{scenario}: resumed vs uninterrupted relative L2 {rel:.3e}")
    assert rel <= TOLERANCE
    if appends:
        log_dir = _resumed_launch_events(out / "logs", uninterrupted(scenario))
    else:
        log_dir = folder / "resumed_logs"
    _check_trained_only_the_rest(log_dir, uninterrupted(scenario), checkpoint)
    if "dataset_val" in SCENARIOS[scenario][1]:
        _check_validated_the_rest(log_dir, uninterrupted(scenario), checkpoint)
        _check_kept_the_same_best(folder, uninterrupted(scenario), checkpoint)


def _check_validated_the_rest(log_dir: Path, reference: Path, after_step: int) -> None:
    """The uninterrupted run validated at ``VALIDATED_STEPS``, and the resumed one at those after
    ``after_step``, each with the uninterrupted run's figure."""
    resumed = logged_steps(log_dir, tag="val/loss")
    uninterrupted = logged_steps(reference / "logs", tag="val/loss")
    print(f"validation: uninterrupted {uninterrupted}, resumed after {after_step} {resumed}")
    assert list(uninterrupted) == VALIDATED_STEPS
    assert list(resumed) == [step for step in VALIDATED_STEPS if step > after_step]
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6), step


def _check_kept_the_same_best(folder: Path, reference: Path, after_step: int) -> None:
    """keep_best_checkpoint (docs/validation.md): the uninterrupted run's ``best/`` is an epoch
    folder holding the weights of its lowest val/loss, named in its record with one console
    line per new best; the resumed run's is the same (weights within the resume tolerance), and
    its first new best is measured against the best its checkpoint recorded."""
    run = folder / "run"
    series = logged_steps(reference / "logs", tag="val/loss")
    before = [loss for step, loss in series.items() if step <= after_step]
    lines = re.findall(r"exactga: best val/loss .*", (folder / "launch" / "output.txt").read_text())
    if before and lines:
        assert f"(the best was {min(before):.4f})" in lines[0], lines
    best_step = min(series, key=series.__getitem__)
    improvements, lowest = 0, float("inf")
    for loss in series.values():  # in step order
        if loss < lowest:
            improvements, lowest = improvements + 1, loss
    output = (reference / "output.txt").read_text()
    assert output.count("exactga: best val/loss") == improvements, output[-4000:]
    record = json.loads((reference / "best" / BEST_RECORD).read_text())
    resumed = json.loads((run / "best" / BEST_RECORD).read_text())
    print(f"best: val/loss {series}, uninterrupted {record}, resumed {resumed}")
    for kept in (record, resumed):
        assert kept["step"] == best_step
        assert kept["val/loss"] == pytest.approx(series[best_step], rel=1e-6)
    last_epoch = reference / FINAL.split("/")[0]
    assert {p.name for p in (reference / "best").iterdir()} == {
        p.name for p in last_epoch.iterdir()
    } | {BEST_RECORD}
    weights = FINAL.split("/")[1]
    best = load_weights(reference / "best" / weights)
    initial = load_weights(reference / INITIAL)
    assert relative_l2(load_weights(run / "best" / weights), best, initial) <= TOLERANCE
    epoch_ends = {STEPS_PER_EPOCH * (epoch + 1): epoch for epoch in range(EPOCHS)}
    if best_step in epoch_ends:  # the weights of that step: its epoch folder's
        epoch = load_weights(reference / f"epoch_{epoch_ends[best_step]}" / weights)
        assert best.keys() == epoch.keys()
        assert all(torch.equal(best[key], epoch[key]) for key in best)


def test_truncated_latest_checkpoint_falls_back_to_the_previous(resumed, uninterrupted):
    folder = resumed(TRUNCATED)
    step = int((folder / "checkpoint").read_text())
    latest = (folder / "truncated").read_text()
    output = (folder / "launch" / "output.txt").read_text()
    assert latest in output and "truncated" in output
    assert "falling back to the previous step checkpoint" in output
    assert _distance(folder / "run", uninterrupted("full")) <= TOLERANCE
    _check_trained_only_the_rest(
        folder / "resumed_logs", uninterrupted("full"), after_step=step - 1
    )


def test_resume_refuses_a_changed_global_batch(uninterrupted):
    root = uninterrupted("full").parent
    status, message = _launched(root, "refusal_base")
    assert status == 0, message[-4000:]
    status, message = _launched(root, "changed_global_batch")
    assert status != 0
    assert (
        "'samples_per_step' (batch_size x gradient_accumulation_steps x data-parallel ranks): "
        "8 in the checkpoint, 4 now" in message
    )
    assert "resume_allow_changed_keys=[samples_per_step]" in message


def test_nonfinite_loss_stops_with_a_checkpoint_then_skips(uninterrupted):
    """An absurd learning rate makes the loss or the gradient norm inf/NaN within two steps.
    ``stop`` names the step and saves the finite weights before it; resumed under ``skip``, the
    run skips the rest and ends with finite weights."""
    root = uninterrupted("full").parent
    out = root / "nonfinite"
    status, output = _launched(root, "nonfinite_stop")
    assert status != 0
    stopped = re.search(r"non-finite loss at step (\d+) \(nonfinite_loss: stop\)", output)
    assert stopped, output[-4000:]
    saved = out / "step_checkpoints" / f"step_{int(stopped.group(1)):06d}"
    assert f"saved in {saved}" in output
    weights = load_weights(saved / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())

    status, output = _launched(root, "nonfinite_skip")
    assert status == 0, output[-4000:]
    assert "the step is skipped (nonfinite_loss: skip)" in output
    final = load_weights(out / "epoch_0/model-00001-of-00001.safetensors")
    assert all(torch.isfinite(w).all() for w in final.values())


def test_checkpoint_of_another_model_is_named(uninterrupted):
    """The tiny config's own sizes (embed_dim 256) pointed at the small model's weights (64)."""
    small = uninterrupted("full")
    status, message = _launched(small.parent, "other_model")
    assert status != 0
    assert (
        f"checkpointer.checkpoint_dir ({small / 'base_model'}) does not fit config key" in message
    )
    assert "has shape (2048, 64) in the checkpoint and (2048, 256) in the model" in message


# --- the resume lineage ----------------------------------------------------------------------


def _lineage_stop(root: Path, name: str, expected_status: int = 143) -> re.Match:
    status, output = _launched(root, name)
    assert status == expected_status, output[-4000:]
    stops = LINEAGE_STOP.findall(output)
    assert len(stops) == 1, output[-4000:]
    found = LINEAGE_STOP.search(output)
    assert found is not None
    return found


def test_a_launch_that_starts_over_retires_the_earlier_launchs_checkpoints(uninterrupted):
    """B starts over where A stopped after step 7: A's step checkpoints (6 and 7) are moved,
    intact, into one retired folder, and B's log says where, and that they are of this run."""
    root = uninterrupted("full").parent
    out = root / "lineage" / "run"
    stopped_a = _lineage_stop(root, "lineage_a")
    assert int(stopped_a.group(1)) == LINEAGE_A_STOP
    (retired,) = (out / "retired_step_checkpoints").iterdir()  # one launch started over
    assert sorted(p.name for p in retired.iterdir()) == ["step_000006", "step_000007"]
    manifest = json.loads((retired / "step_000007" / "trainer_state.json").read_text())
    assert manifest["step"] == 7 and manifest["trainer_state"]["global_step"] == 7
    _, output = _launched(root, "lineage_b")
    notes = [line for line in output.splitlines() if "this launch starts over" in line]
    assert len(notes) == 1, output[-4000:]
    note = notes[0]
    print(note)
    assert f"in {out / 'step_checkpoints'} " in note and f"to {retired}" in note
    assert "step_000007, is a step checkpoint of this run" in note
    assert "resume_from_checkpoint=True" in note


def test_the_stop_message_names_the_checkpoint_its_command_resumes(uninterrupted):
    """B stops after step 5 < A's 7; its line names B's step 5 and the command that goes on,
    which resumes exactly that checkpoint and ends bit-identical to the uninterrupted run."""
    root = uninterrupted("full").parent
    out = root / "lineage" / "run"
    stopped_b = _lineage_stop(root, "lineage_b")
    step, checkpoint, command = int(stopped_b.group(1)), stopped_b.group(2), stopped_b.group(3)
    assert step == LINEAGE_B_STOP
    assert checkpoint == str(out / "step_checkpoints" / f"step_{LINEAGE_B_STOP:06d}")
    resumed_args = _lineage_runs(root)["lineage_b_resumed"][0]
    assert shlex.split(command) == ["tune", "run", *resumed_args]  # the command that ran next
    status, output = _launched(root, "lineage_b_resumed")
    assert status == 0, output[-4000:]
    assert f"Resuming from step checkpoint {checkpoint}\n" in output + "\n", output[-4000:]
    final, reference = load_weights(out / FINAL), load_weights(uninterrupted("full") / FINAL)
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[key], reference[key]) for key in reference)  # bit for bit


def test_the_resumed_launch_goes_on_in_its_own_tensorboard_run(uninterrupted):
    """Two runs in the folder's logs: A's, steps 1 to 7 as A logged them, and B's, steps 1 to
    8 each once with the uninterrupted run's loss (B's 1 to 5, its resume's 6 to 8)."""
    root = uninterrupted("full").parent
    logs = root / "lineage" / "run" / "logs"
    runs = sorted(logs.glob("run_*"), key=lambda run: _record(run)["started"])
    assert len(runs) == 2, runs
    run_a, run_b = runs
    expected = logged_steps(uninterrupted("full") / "logs")
    for run, last in ((run_a, LINEAGE_A_STOP), (run_b, STEPS_PER_EPOCH * EPOCHS)):
        steps = logged_steps(run)
        assert list(steps) == list(range(1, last + 1)), (run.name, list(steps))
        for step, loss in steps.items():
            assert loss == pytest.approx(expected[step], rel=1e-6), (run.name, step)


def _record(run: Path) -> dict:
    """A TensorBoard run folder's record (exactga.run.metric_logging's ``RUN_RECORD``)."""
    return json.loads((run / "exactga_run.json").read_text())
