"""A rank that dies mid-training ends the whole launch within a bounded time, naming the rank.

recipes/full_finetune.py on 2 CPU ranks (gloo) through the real ``tune run``. Once
rank 0's progress bar shows a finished step, rank 1 is sent SIGKILL (no Python handler runs, as
when the kernel's OOM killer takes a rank). torchrun's elastic agent, which ``tune run`` runs
in its own process, polls its ranks, sees the exit, sends the surviving rank SIGTERM and exits
non-zero with a report whose root cause is rank 1, its pid and the signal: about 2 s in all.

What this does not cover: a rank on another node (another agent) is stopped by its own agent
only once it fails itself. A peer that exits closes its sockets, and gloo's pending read then
fails at once ("Connection reset by peer"). A peer that hangs, or a node that drops off the
network, leaves the survivors blocked in a collective until the process group's timeout
(torch's default: 30 min for gloo, 10 min for NCCL).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from recipe_utils import REPO_ROOT, SMALL_MODEL, TUNE, tune_env

pytestmark = pytest.mark.slow

DISTRIBUTED = "recipes/full_finetune.py"
DISTRIBUTED_CONFIG = "configs/tiny/full_distributed.yaml"
START_TIMEOUT_S = 120  # two ranks starting on a busy 2-core machine
EXIT_TIMEOUT_S = 60  # the bound under test
# tqdm's bar on rank 0 after a finished step: "epoch 1:   1%|          | 3/258 [...]".
# Set in the launch's environment, which the ranks inherit: a process is only ever killed by
# this test if it carries the marker, so a recycled pid is never another's process.
MARKER = "EXACTGA_DEAD_RANK_TEST"
STEP_DONE = re.compile(r"epoch \d+:.*\|\s*[1-9]\d*/\d+")


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(child) for child in text.split()]


def _descendants(pid: int) -> list[int]:
    children = _children(pid)
    return children + [grandchild for child in children for grandchild in _descendants(child)]


def _environ(pid: int) -> dict[str, str]:
    """The environment of process ``pid``; empty if it is gone or not ours to read."""
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return {}
    pairs = (entry.decode(errors="replace").partition("=") for entry in entries if entry)
    return {key: value for key, _, value in pairs}


def _rank_of(pid: int) -> int | None:
    """The ``RANK`` torchrun gave process ``pid``, or None if it is not a worker."""
    rank = _environ(pid).get("RANK")
    return None if rank is None else int(rank)


def _is_gone(pid: int) -> bool:
    """Exited (and reaped, or a zombie waiting to be): no longer running anything."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_for(condition, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def test_killed_rank_ends_the_launch_within_60s(tmp_path):
    overrides = {
        **SMALL_MODEL,
        "output_dir": tmp_path / "out",
        # Far more steps than the test lasts, so the ranks are training when one is killed.
        "epochs": 50,
        "max_steps_per_epoch": "null",
        "batch_size": 1,
        "gradient_accumulation_steps": 1,
    }
    args = ["--nproc_per_node", "2", DISTRIBUTED, "--config", DISTRIBUTED_CONFIG]
    args += [f"{key}={value}" for key, value in overrides.items()]
    ranks: dict[int | None, int] = {}
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        # Its own session, so a Ctrl-C reaches the test's finally block, not the launch. torchrun
        # starts each rank in a session of its own too, so they are stopped one by one there.
        launcher = subprocess.Popen(
            [str(TUNE), "run", *args],
            cwd=REPO_ROOT,
            env=tune_env({MARKER: str(tmp_path)}),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for(
            lambda: launcher.poll() is not None or STEP_DONE.search(log.read_text()),
            START_TIMEOUT_S,
            "finished training step",
            log,
        )
        assert launcher.poll() is None, f"the launch ended early:\n{log.read_text()[-4000:]}"
        ranks.update({_rank_of(pid): pid for pid in _children(launcher.pid)})
        assert {0, 1} <= ranks.keys(), f"workers of the launcher: {ranks}"

        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            returncode = launcher.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running {EXIT_TIMEOUT_S} s after rank 1 was killed")
        took = time.monotonic() - killed_at
        print(f"launcher exited {returncode} {took:.1f} s after rank 1 was killed")

        output = log.read_text()
        assert returncode != 0, output[-4000:]
        assert _is_gone(ranks[0]), "the surviving rank outlived its launcher"
        # torchrun's failure report names the rank, its process and the signal as the root cause.
        root_cause = output[output.rfind("Root Cause") :]
        assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), output[-4000:]
        assert f"Signal 9 (SIGKILL) received by PID {ranks[1]}" in root_cause, output[-4000:]
    finally:
        # Orphaned ranks (if the launcher died first) are in sessions of their own: kill each.
        launcher_alive = launcher.poll() is None
        pids = [*(_descendants(launcher.pid) if launcher_alive else []), *ranks.values()]
        for pid in pids:
            if _environ(pid).get(MARKER) == str(tmp_path):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if launcher_alive:
            launcher.kill()
        launcher.wait()
