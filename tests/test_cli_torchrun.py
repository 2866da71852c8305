"""How a torchrun launch ends after its ranks' user errors (see [user errors] in
exactga.launch.cli): which failures count as a user error, what a rank writes for its launcher, and
the wrap of ``tune run``'s torchrun path. The launch itself: tests/test_bad_input_launch.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from exactga.launch import cli


def _failure(exitcode: int, message: str) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, message=message)


def _failed_launch(*failures: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(failures=dict(enumerate(failures)))


USER = cli.USER_ERROR_MARK + "config key 'epoch' ..."
CRASH = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"


@pytest.mark.parametrize(
    ("failures", "quiet"),
    [
        ((_failure(1, USER), _failure(1, USER)), True),  # every rank on the same key
        ((_failure(1, USER), _failure(-15, "Signal 15 (SIGTERM)")), True),  # the other stopped
        # the other was stopped by its own stop handler (a race seen in a fresh-clone run)
        ((_failure(1, USER), _failure(143, "<N/A>")), True),
        ((_failure(1, USER), _failure(2, "<N/A>")), False),  # the other failed otherwise
        ((_failure(1, USER), _failure(1, CRASH)), False),  # one rank crashed: show it
        ((_failure(1, CRASH), _failure(-15, "Signal 15 (SIGTERM)")), False),
        ((_failure(-9, "Signal 9 (SIGKILL)"),), False),  # killed, no user error at all
    ],
)
def test_only_a_launch_that_ended_on_user_errors_is_quiet(failures, quiet):
    assert cli._ended_on_user_error(_failed_launch(*failures)) is quiet


def test_a_rank_marks_its_user_error_in_the_launchers_error_file(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")
    cli._print_user_error("config key 'epoch' is unknown")
    record = json.loads(error_file.read_text())
    assert record["message"] == cli.USER_ERROR_MARK + "config key 'epoch' is unknown"
    assert capsys.readouterr().err == ""  # rank 0 alone prints


def test_the_wrap_exits_1_quietly_on_user_errors_and_reraises_the_rest(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failure(tmp_error_file: str, exitcode: int) -> ProcessFailure:
        return ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=tmp_error_file)

    outcome: dict[str, object] = {}

    class Run:  # the shape of torchtune._cli.run.Run
        def _run_distributed(self, args, is_builtin):
            raise outcome["error"]

    module = SimpleNamespace(Run=Run)
    cli.quiet_user_errors_under_torchrun(module)
    cli.quiet_user_errors_under_torchrun(module)  # installed once
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    # The wrap sets these: put back after. (A bare delenv of an unset variable records nothing
    # to undo, and the launcher's variables leaked into later launches of the worker.)
    for name in (cli.LAUNCH_COMMAND_ENV, cli.LAUNCHER_STOP_FILE_ENV, "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    args = SimpleNamespace(nproc_per_node="1", shutdown_timeout=30)  # torch stays unpatched
    marked = failure("/nonexistent", 1)
    marked.message = USER
    outcome["error"] = ChildFailedError("recipe", {0: marked})
    with pytest.raises(SystemExit) as exit_info:
        Run()._run_distributed(args, False)
    assert exit_info.value.code == 1
    # The launcher prints the message, once: rank 0 may have been stopped before it could.
    assert capsys.readouterr().err.count("exactga: config key 'epoch' ...") == 1
    stopped = failure("/nonexistent", -15)
    outcome["error"] = ChildFailedError("recipe", {0: stopped, 1: marked})
    with pytest.raises(SystemExit):
        Run()._run_distributed(args, False)
    assert capsys.readouterr().err.count("exactga: config key 'epoch' ...") == 1
    # Every rank failed on the same key (a config error on 2 ranks): one message still.
    also_marked = failure("/nonexistent", 1)
    also_marked.message = USER
    outcome["error"] = ChildFailedError("recipe", {0: marked, 1: also_marked})
    with pytest.raises(SystemExit) as exit_info:
        Run()._run_distributed(args, False)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.count("exactga: config key 'epoch' ...") == 1
    launch_folder = Path(os.environ[cli.LAUNCHER_STOP_FILE_ENV]).parent
    assert not launch_folder.exists()  # removed when the launch ended
    crashed = failure("/nonexistent", 1)  # no error file: torch's generic message
    outcome["error"] = ChildFailedError("recipe", {0: crashed})
    with pytest.raises(ChildFailedError):
        Run()._run_distributed(args, False)
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")  # asked for: the launcher's report stays
    outcome["error"] = ChildFailedError("recipe", {0: marked})
    with pytest.raises(ChildFailedError):
        Run()._run_distributed(args, False)


# --- stopping on a signal: see [torchrun and a stop] in exactga.launch.cli -------------------


def test_a_launch_whose_ranks_all_stopped_on_a_signal_exits_with_their_status():
    stopped = _failed_launch(_failure(143, ""), _failure(143, ""))
    assert cli._stopped_by_signal(stopped) == 143
    assert cli._stopped_by_signal(_failed_launch(_failure(130, ""))) == 130
    assert cli._stopped_by_signal(_failed_launch(_failure(143, ""), _failure(1, CRASH))) is None
    assert cli._stopped_by_signal(_failed_launch(_failure(-9, "Signal 9 (SIGKILL)"))) is None


def test_the_agents_lines_about_passing_a_stop_on_are_left_out():
    import logging

    def record(msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("torch", logging.WARNING, "api.py", 1, msg, args, None)

    quiet = cli._forwarding_a_stop
    assert not quiet(record("Received %s death signal, shutting down workers", 15))
    assert not quiet(record("Sending process %s closing signal %s", 123, "SIGINT"))
    assert quiet(record("Sending process %s closing signal %s", 123, "SIGHUP"))
    assert quiet(
        record("Unable to shutdown process %s via %s, forcefully exiting via %s", 1, 15, 9)
    )


def test_the_command_that_goes_on_is_the_launch_with_the_resume_key():
    from exactga.launch.stopping import LAUNCH_COMMAND_ENV, resume_command

    typed = ["python3", "/nowhere/bin/tune", "run", "r.py", "--config", "c.yaml", "a=b c"]
    assert resume_command(typed, {}) == (
        "/nowhere/bin/tune run r.py --config c.yaml 'a=b c' resume_from_checkpoint=True"
    )
    again = [*typed[:-1], "resume_from_checkpoint=False"]
    assert resume_command(again, {}).endswith("c.yaml resume_from_checkpoint=True")
    launcher = ["tune", "run", "--nproc_per_node", "2", "r.py", "resume_from_checkpoint=auto"]
    ranks = ["python3", "-u", "-m", "recipes.r"]  # a rank's own command line under torchrun
    environ = {LAUNCH_COMMAND_ENV: json.dumps(launcher)}
    assert resume_command(ranks, environ) == (
        "tune run --nproc_per_node 2 r.py resume_from_checkpoint=True"
    )


SIGNALLED_RUN = """
import os, signal, sys, time
from exactga.launch.cli import run_recipe
from exactga.launch.stopping import stop_request

def recipe_main():
    stop_request().training = {training}
    print("ready", flush=True)
    while stop_request().signal is None:  # training: the first signal is only recorded
        time.sleep(0.01)
    print("recorded", flush=True)
    time.sleep(60)
    sys.exit(5)  # the second signal never came

sys.exit(run_recipe(recipe_main))
"""


@pytest.mark.parametrize(
    ("training", "signals", "line"),
    [
        (True, 2, "exactga: SIGINT again: stopped at once, without finishing the step."),
        (False, 1, "exactga: SIGINT: stopped at once, outside training (nothing more is saved)."),
    ],
)
def test_a_second_signal_or_one_outside_training_stops_at_once_in_one_line(training, signals, line):
    """A plain Python process (no torch): the first signal during training is only recorded
    (the step book acts on it at the step's end), the next one ends the process at once."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    src = Path(cli.__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED_RUN.format(training=training)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(src), "PATH": ""},
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    if signals == 2:  # after the first was handled: a signal sent before that would merge with it
        assert proc.stdout.readline() == "recorded\n"
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err.strip() == line


def test_the_agent_waits_longer_for_its_ranks_only_after_a_stop_signal_of_its_own():
    import signal

    class Agent:  # the shape of torch's LocalElasticAgent
        def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
            waited.append(timeout)

    def raise_in_agent(signum, frame):
        raise RuntimeError(f"signal {signum}")  # torch's raises SignalException

    waited: list[int] = []
    processes = SimpleNamespace(_terminate_process_handler=raise_in_agent)
    cli.grace_after_a_stop_signal(processes, Agent)
    cli.grace_after_a_stop_signal(processes, Agent)  # installed once
    Agent()._shutdown(timeout=30)  # a rank failed: torch's timeout
    with pytest.raises(RuntimeError, match="signal 15"):
        processes._terminate_process_handler(signal.SIGTERM, None)
    Agent()._shutdown(signal.SIGTERM, timeout=30)
    assert waited == [30, cli.SHUTDOWN_TIMEOUT_S]


def test_the_agent_closes_the_other_ranks_when_one_ends_during_its_clean_up():
    """torch polls a rank, then signals its process group: a rank that ended in between made
    the agent die of ProcessLookupError before it printed the failing rank's message."""
    import signal

    class Agent:  # the shape of torch's LocalElasticAgent
        def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
            calls.append(timeout)
            if len(calls) == 1:
                raise ProcessLookupError(3, "No such process")

    calls: list[int] = []
    processes = SimpleNamespace(_terminate_process_handler=lambda signum, frame: None)
    cli.grace_after_a_stop_signal(processes, Agent)
    Agent()._shutdown(timeout=30)
    assert calls == [30, 30]  # tried again, and the second clean-up ended normally


def test_the_agent_marks_a_stop_signal_of_its_own_before_passing_it_on(tmp_path, monkeypatch):
    import signal

    from exactga.launch import stopping

    def raise_in_agent(signum, frame):
        raise RuntimeError(f"signal {signum}")  # torch's raises SignalException

    processes = SimpleNamespace(_terminate_process_handler=raise_in_agent)
    cli.mark_a_stop_signal(processes)
    cli.mark_a_stop_signal(processes)  # installed once
    stop_file = tmp_path / "stop_signal"
    monkeypatch.setenv(cli.LAUNCHER_STOP_FILE_ENV, str(stop_file))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(stopping, "_REQUEST", stopping.StopRequest())
    # A rank stopped while the file is missing: the agent's clean-up after a failed peer.
    assert stopping._stopped_after_a_peer_failed()
    with pytest.raises(RuntimeError, match="signal 1"):
        processes._terminate_process_handler(signal.SIGHUP, None)
    assert not stop_file.exists()  # not a stop signal
    with pytest.raises(RuntimeError, match="signal 2"):
        processes._terminate_process_handler(signal.SIGINT, None)
    assert stop_file.exists()
    assert not stopping._stopped_after_a_peer_failed()  # the user's Ctrl-C: the line prints
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    stop_file.unlink()
    assert not stopping._stopped_after_a_peer_failed()  # not a rank of the wrap
