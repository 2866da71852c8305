"""What SIGINT and SIGTERM do to a run: stop at the next step boundary with a step checkpoint,
or, outside training or at a second signal, stop at once; and the command that goes on.

Note [stop at a step boundary]
Ctrl-C (SIGINT) and a scheduler's preemption (SIGTERM, then SIGKILL after a grace period) should
not cost the steps trained since the last checkpoint, nor print a ``KeyboardInterrupt``
traceback. So :func:`stopping_on_signals` (entered by ``run_recipe``) replaces both signals'
handlers with one that only records the request while training runs (the step bookkeeping
sets ``StopRequest.training`` from its first epoch to the end of its last): the step in
progress finishes, and at the next step boundary every rank writes a step checkpoint and the
run ends with one line saying where it stopped, what was saved and the command that goes on
(``exactga.run.steps``; under torchrun the ranks first agree on the step, see [every rank
stops at one step] there). The exit status is the shell's for a process ended by that signal,
128 + its number (130 for SIGINT, 143 for SIGTERM): the run did not finish, and a job chain
that starts an evaluation "after success" must not start it; a requeued job goes on with
``resume_from_checkpoint=auto`` (docs/reliability.md, "Stopping").

A second signal, or a signal before training starts or after it ends (loading the model and
data, the closing report), stops at once: one line, no traceback, the same status, nothing more
written. The atomic step checkpoints (see [atomic step checkpoints] in
exactga.run.checkpointing) make that safe at any moment.

Kept free of torch: the ``tune`` launcher imports this package to wrap torchrun.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The command line of ``tune run`` under torchrun, set by the launcher for its ranks (whose
# own command line is torchrun's ``python -m recipes.<name> ...``): a JSON list.
LAUNCH_COMMAND_ENV = "EXACTGA_LAUNCH_COMMAND"
# Set by exactga's wrap of torchrun for its ranks: a file that exists once the launcher itself
# got a stop signal (see [torchrun and a stop] in exactga.launch.cli).
LAUNCHER_STOP_FILE_ENV = "EXACTGA_LAUNCHER_STOP_FILE"
RESUME_KEY = "resume_from_checkpoint"


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


class RunStopped(SystemExit):
    """The run stopped on a signal after saving (see [stop at a step boundary]); a
    ``SystemExit``, so it ends the process with its status and no traceback."""

    def __init__(self, signum: int) -> None:
        super().__init__(exit_status(signum))


@dataclass
class StopRequest:
    """This process's stop request: the first signal seen, and whether training runs (then a
    signal waits for the step boundary; otherwise it stops at once)."""

    signal: signal.Signals | None = None
    training: bool = False

    def clear(self) -> None:
        self.signal, self.training = None, False


_REQUEST = StopRequest()  # signals are per process, so is the request


def stop_request() -> StopRequest:
    """The process's stop request, which the step bookkeeping reads and marks."""
    return _REQUEST


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[StopRequest]:
    """SIGINT and SIGTERM as stop requests while inside; see [stop at a step boundary]. The
    previous handlers are put back on leaving. Outside the main thread (where Python allows no
    handler) nothing changes."""
    _REQUEST.clear()
    if threading.current_thread() is not threading.main_thread():
        yield _REQUEST
        return
    previous = {signum: signal.signal(signum, _on_signal) for signum in STOP_SIGNALS}
    try:
        yield _REQUEST
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _REQUEST.clear()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _REQUEST.signal is not None or not _REQUEST.training:
        _stop_at_once(signal.Signals(signum))
    _REQUEST.signal = signal.Signals(signum)


def _stop_at_once(signum: signal.Signals) -> None:
    """One line on rank 0, then exit without unwinding: nothing runs that could block."""
    if _REQUEST.signal is not None:
        what = f"{signum.name} again: stopped at once, without finishing the step"
    else:
        what = f"{signum.name}: stopped at once, outside training (nothing more is saved)"
    for stream in (sys.stdout, sys.stderr):  # what the run printed before the line
        with contextlib.suppress(RuntimeError, OSError, ValueError):  # a write it interrupted
            stream.flush()
    if int(os.environ.get("RANK", "0")) == 0 and not _stopped_after_a_peer_failed():
        # os.write, not print: the signal may have come inside a write to the same stream,
        # and a buffered stream refuses to be written to again from there.
        os.write(sys.stderr.fileno(), f"\nexactga: {what}.\n".encode())
    os._exit(exit_status(signum))


def is_a_rank_of_the_launcher_wrap() -> bool:
    """Whether this process is a rank started by exactga's wrap of torchrun: its launcher reads
    the rank's error file and marks the stop signals it gets (see [torchrun and a stop] in
    exactga.launch.cli)."""
    return bool(
        os.environ.get(LAUNCHER_STOP_FILE_ENV) and os.environ.get("TORCHELASTIC_ERROR_FILE")
    )


def _stopped_after_a_peer_failed() -> bool:
    """Whether this rank of exactga's torchrun wrap was stopped outside training by a signal
    its launcher did not get: the launcher's clean-up after another rank failed (or a signal
    sent to the ranks alone), where a stop line would only hide that rank's error."""
    if not is_a_rank_of_the_launcher_wrap():
        return False
    return _REQUEST.signal is None and not os.path.exists(os.environ[LAUNCHER_STOP_FILE_ENV])


def resume_command(
    orig_argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """The command line that launched this run with ``resume_from_checkpoint=True`` in place of
    any value it had: ``tune run ...`` as typed (under torchrun, the launcher's, with its
    ``--nproc_per_node``), or the interpreter's command line when not started by ``tune``."""
    environ = os.environ if environ is None else environ
    argv = list(sys.orig_argv if orig_argv is None else orig_argv)
    if LAUNCH_COMMAND_ENV in environ:
        argv = json.loads(environ[LAUNCH_COMMAND_ENV])
    elif len(argv) > 1 and os.path.basename(argv[1]) == "tune":  # python <path>/tune run ...
        argv = argv[1:]
    if argv and os.path.basename(argv[0]) == "tune" and _on_path(argv[0]):
        argv[0] = "tune"  # as the user most likely typed it
    kept = [arg for arg in argv if not arg.startswith(f"{RESUME_KEY}=")]
    return shlex.join([*kept, f"{RESUME_KEY}=True"])


def _on_path(executable: str) -> bool:
    found = shutil.which(os.path.basename(executable))
    return found is not None and os.path.realpath(found) == os.path.realpath(executable)
