"""How a torchrun launch ends after its ranks' user errors (see [user errors] in
exactga.launch.cli): which failures count as a user error, what a rank writes for its launcher, and
the wrap of ``tune run``'s torchrun path. The launch itself: tests/test_bad_input_launch.py."""

from __future__ import annotations

import json
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


def test_the_wrap_exits_1_quietly_on_user_errors_and_reraises_the_rest(monkeypatch):
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
    for name in (cli.LAUNCH_COMMAND_ENV, "OMP_NUM_THREADS"):  # the wrap sets them: restore after
        monkeypatch.delenv(name, raising=False)
    args = SimpleNamespace(nproc_per_node="1", shutdown_timeout=None)
    marked = failure("/nonexistent", 1)
    marked.message = USER
    outcome["error"] = ChildFailedError("recipe", {0: marked})
    with pytest.raises(SystemExit) as exit_info:
        Run()._run_distributed(args, False)
    assert exit_info.value.code == 1
    crashed = failure("/nonexistent", 1)  # no error file: torch's generic message
    outcome["error"] = ChildFailedError("recipe", {0: crashed})
    with pytest.raises(ChildFailedError):
        Run()._run_distributed(args, False)
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")  # asked for: the launcher's report stays
    outcome["error"] = ChildFailedError("recipe", {0: marked})
    with pytest.raises(ChildFailedError):
        Run()._run_distributed(args, False)
