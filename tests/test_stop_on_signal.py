"""SIGINT and SIGTERM stop a run at a step boundary with a step checkpoint and one line, and the
command that line prints goes on to the uninterrupted run's weights, bit for bit.

See [stop at a step boundary] in exactga.launch.stopping, [every rank stops at one step] in
exactga.run.steps and [torchrun and a stop] in exactga.launch.cli. Each scenario launches
``tune run``, waits until the progress bar shows a second finished step, and sends the signal:
the two ``FRESH`` scenarios are real launches in a session of their own (as a terminal's
foreground job), and the signal goes to the launch's process group, as Ctrl-C or a ``kill`` of
the job does (on one device the recipe's process; under torchrun the launcher, which passes it on
to each rank); the other two fork their ranks (tests/launcher.py) and the signal goes to each.
No step checkpoints are asked for (``save_every_n_steps`` is off), so the stop's checkpoint is the
only one. Watching the output rather than sleeping keeps it right on a loaded machine: the signal
always lands in training, at whatever step it is by then.

The console test reads the two stopped runs that are fresh processes (``FRESH``: one on one
device, one under torchrun, each reading the data file for the first time).

The four stopped runs are a launch each; the resumes, each the printed command run as ``tune
run`` runs it (tests/many_runs.py), and the uninterrupted references
run one after another per rank count. The single-device reference is a launch into a copy of a
stopped run's folder without the resume key, which must say that a step checkpoint of the run
is there and how to go on.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from launcher import start_recipe
from many_runs import launch_runs, run_of
from recipe_utils import REPO_ROOT, SMALL_MODEL, TUNE, kill_launch, load_weights, tune_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("stop_on_signal")]

# 8 steps: the signal, sent once a second step is done, lands with steps left to resume, and the
# resumed run crosses the epoch boundary.
STEPS_PER_EPOCH = 4
SETTINGS = {**SMALL_MODEL, "max_steps_per_epoch": STEPS_PER_EPOCH, "epochs": 2}
FINAL = "epoch_1/model-00001-of-00001.safetensors"
HEADS = {
    0: [
        "recipes/full_finetune.py",
        "--config",
        "configs/tiny/full_single_device.yaml",
    ],
    2: [
        *("--nproc_per_node", "2", "recipes/full_finetune.py"),
        *("--config", "configs/tiny/full_distributed.yaml"),
    ],
}
SCENARIOS = {
    "one_device_sigint": (0, signal.SIGINT),
    "one_device_sigterm": (0, signal.SIGTERM),
    "two_ranks_sigint": (2, signal.SIGINT),
    "two_ranks_sigterm": (2, signal.SIGTERM),
}
# The scenarios whose launch is a fresh process, as a user's (one per launcher): the console test
# reads theirs. The others fork their ranks (tests/launcher.py): what they test (the stop, its
# checkpoint, the printed command going on bit for bit) is the run's, not the process start's.
FRESH = ("one_device_sigint", "two_ranks_sigterm")
RERUN = "one_device_sigterm"  # the stopped run whose folder a launch without the key reuses
# The bar after a second finished step: "epoch 1:  50%|█████     | 2/4 [...]".
SECOND_STEP_DONE = re.compile(r"epoch \d+:[^\r\n]*\|\s*(?:[2-9]|\d\d+)/\d+")
STOP_LINE = re.compile(
    r"exactga: stopped by (SIG\w+) after step (\d+) of 8 \(epoch \d of 2\); "
    r"step checkpoint in (\S+)\. To go on: (.+)$",
    re.M,
)
START_TIMEOUT_S = 240  # two ranks starting on a busy 2-core machine
STOP_TIMEOUT_S = 120


def _args(nproc: int, out: Path) -> list[str]:
    return [*HEADS[nproc], *(f"{k}={v}" for k, v in {**SETTINGS, "output_dir": out}.items())]


def _launch_and_signal(nproc: int, signum: signal.Signals, out: Path, log: Path) -> int:
    """Launch, send ``signum`` once a second step is done, and return the run's exit status
    (the launch is killed if it outlives the bound)."""
    if out.parent.name not in FRESH:  # the stop of the run itself: its ranks get the signal
        return _fork_and_signal(nproc, signum, out, log)
    # A datasets cache of its own: the data file is read for the first time, as on a fresh
    # clone, when datasets would print its progress bars (the console test). A real launch: a
    # fresh console, import-time warnings included, as a user's; the signal goes to the
    # launch's process group (under torchrun its agent, which passes it on to the ranks).
    extra = {"HF_DATASETS_CACHE": str(out.parent / "datasets_cache")}
    with open(log, "w") as output:
        proc = subprocess.Popen(
            [str(TUNE), "run", *_args(nproc, out)],
            cwd=REPO_ROOT,
            env=tune_env(extra),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for_a_second_step(log, proc.poll)
        os.killpg(proc.pid, signum)
        return proc.wait(timeout=STOP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            kill_launch(proc)


def _fork_and_signal(nproc: int, signum: signal.Signals, out: Path, log: Path) -> int:
    """``_launch_and_signal`` with the ranks forked (tests/launcher.py): each gets the signal."""
    folder = log.with_name(f"{log.name}.ranks")
    run = start_recipe(_args(nproc, out), REPO_ROOT, tune_env(), folder)
    try:
        _wait_for_a_second_step(run.stderr, run.poll)
        run.send_signal(signum)
        return run.wait(timeout=STOP_TIMEOUT_S)
    finally:
        run.kill()
        log.write_text(run.stdout.read_text() + run.stderr.read_text())


def _wait_for_a_second_step(log: Path, poll) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not SECOND_STEP_DONE.search(log.read_text(errors="replace")):
        assert poll() is None, f"ended before its signal:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no second step:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    """Every launch of the module, made once per session: the four stopped runs, then their
    resumes and the references (see the module docstring)."""

    def make(root: Path) -> None:
        for name, (nproc, signum) in SCENARIOS.items():
            folder = root / name
            folder.mkdir()
            status = _launch_and_signal(nproc, signum, folder / "run", folder / "stopped.txt")
            (folder / "stopped_status").write_text(str(status))
        shutil.copytree(root / RERUN / "run", root / "rerun" / "run")
        by_nproc: dict[int, list] = {0: [], 2: []}
        for name in SCENARIOS:
            found = STOP_LINE.search((root / name / "stopped.txt").read_text(errors="replace"))
            if found is None:  # the stop test names it; the resume has nothing to run
                continue
            command = shlex.split(found.group(4))
            nproc, run = run_of(command[command.index("run") + 1 :], root / name / "resumed")
            by_nproc[nproc].append(run)
        by_nproc[0].append(run_of(_args(0, root / "rerun" / "run"), root / "rerun")[1])
        by_nproc[2].append(run_of(_args(2, root / "reference" / "run"), root / "reference")[1])
        for nproc, pending in by_nproc.items():
            launch_runs(pending, nproc=nproc)

    return run_once("stop_on_signal", make)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_signal_stops_at_a_step_with_a_checkpoint_and_one_line(runs, scenario) -> None:
    _, signum = SCENARIOS[scenario]
    output = (runs / scenario / "stopped.txt").read_text(errors="replace")
    status = int((runs / scenario / "stopped_status").read_text())
    assert status == 128 + signum, output[-3000:]  # 130, 143: see docs/reliability.md
    lines = [line for line in re.split(r"[\r\n]", output) if "exactga: stopped" in line]
    assert len(lines) == 1, output[-3000:]
    found = STOP_LINE.search(output)
    assert found is not None, lines
    assert found.group(1) == signum.name
    step, checkpoint = int(found.group(2)), Path(found.group(3))
    assert checkpoint == runs / scenario / "run" / "step_checkpoints" / f"step_{step:06d}"
    assert sorted(checkpoint.parent.iterdir()) == [checkpoint]  # save_every_n_steps is off
    assert (checkpoint / "trainer_state.json").is_file()
    assert "resume_from_checkpoint=True" in found.group(4)
    assert "Traceback" not in output and "death signal" not in output, output[-3000:]
    print(f"{scenario}: stopped after step {step}")


# Third-party lines that tell the user nothing (issue #43): datasets' progress bars as it first
# reads the data file, torchdata's deprecation warning. (torchrun's thread warning needs
# OMP_NUM_THREADS unset, which these launches set: tests/test_cli_torchrun.py checks the wrap.)
NOISE = ("Generating train split", "set_vital", "Traceback")


@pytest.mark.parametrize("scenario", FRESH)  # a fresh process's console: see FRESH
def test_the_console_holds_each_step_once_and_no_third_party_noise(runs, scenario) -> None:
    output = (runs / scenario / "stopped.txt").read_text(errors="replace")
    assert SECOND_STEP_DONE.search(output)
    assert not [noise for noise in NOISE if noise in output], output[-3000:]
    # The bar's states go forward, each drawn once: tqdm may skip a fast step's state, and
    # draws the latest state once more when the stop line is printed above it (on a terminal
    # the same place). A step drawn twice, as each step was before, fails here.
    shown = [int(n) for n in re.findall(rf"epoch 1:[^\r\n]*\| (\d+)/{STEPS_PER_EPOCH} \[", output)]
    repeats = len(shown) - len(set(shown))
    assert len(set(shown)) > 1 and shown == sorted(shown) and repeats <= 1, output[-3000:]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_printed_command_goes_on_to_the_uninterrupted_weights(runs, scenario) -> None:
    nproc, _ = SCENARIOS[scenario]
    resumed = runs / scenario / "resumed"
    output = (resumed / "output.txt").read_text()
    assert (resumed / "returncode").read_text() == "0", output[-3000:]
    assert "Resuming from step checkpoint" in output
    reference = runs / ("rerun" if nproc == 0 else "reference")
    assert (reference / "returncode").read_text() == "0", (reference / "output.txt").read_text()
    weights = load_weights(runs / scenario / "run" / FINAL)
    expected = load_weights(reference / "run" / FINAL)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[key], expected[key]) for key in expected)  # bit for bit


def test_a_launch_into_a_stopped_runs_folder_says_how_to_go_on(runs) -> None:
    output = (runs / "rerun" / "output.txt").read_text()
    hints = [line for line in output.splitlines() if "is a step checkpoint of this run" in line]
    assert len(hints) == 1, output[-3000:]
    assert str(runs / "rerun" / "run" / "step_checkpoints") in hints[0]
    assert "resume_from_checkpoint=True" in hints[0] and "resume_from_checkpoint=auto" in hints[0]
