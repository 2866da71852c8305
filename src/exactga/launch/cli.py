"""How a recipe ends on bad input: one message, no traceback, a non-zero exit.

Note [user errors]
exactga raises ``ValueError`` only for input a user can fix (a config key, a file, a data row, a
checkpoint), naming what is wrong and how to fix it, and ``assert`` for its own invariants
(docs/contributing.md point 7). So a ``ValueError`` raised from exactga's own code or from the
recipe file is printed as that message alone, on rank 0, and the process exits with status 1; the
25 to 60 lines of traceback above it would only bury it. Any other exception, a ``ValueError``
raised inside torch or torchtune included, keeps its traceback: that is a bug to report, not an
input to fix. ``EXACTGA_TRACEBACK=1`` shows the traceback of user errors too.

Under torchrun every rank ends so, and the launcher would then print its own ``ChildFailedError``
traceback and failure table, about 50 lines under the message. So each rank also writes the
message, marked, to the error file torchrun gives it (``TORCHELASTIC_ERROR_FILE``), and
``tune run``'s torchrun path is wrapped (:func:`quiet_user_errors_under_torchrun`, installed by
the start-up hook ``_exactga_recipes_hook``) to exit with status 1 and no traceback when every
failed rank reported a user error or was stopped by the launcher after one did.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

TRACEBACK_ENV = "EXACTGA_TRACEBACK"
# How a rank's error file marks a user error for the launcher (see [user errors]).
USER_ERROR_MARK = "exactga user error: "
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # exactga/, above launch/


def run_recipe(recipe_main: Callable[[], Any]) -> int:
    """Call ``recipe_main`` (a recipe's ``@config.parse`` entry point); return the exit status.

    See [user errors].
    """
    missing = _missing_config(sys.argv)
    if missing is not None:  # torchtune's parser would fail on it with a traceback
        _print_user_error(missing)
        return 1
    try:
        recipe_main()
    except ValueError as err:
        recipe_file = Path(recipe_main.__code__.co_filename).resolve()
        if os.environ.get(TRACEBACK_ENV) or not _raised_by(err.__traceback__, recipe_file):
            raise
        _print_user_error(str(err))
        return 1
    return 0


def _print_user_error(message: str) -> None:
    """The message on rank 0 alone, in the one form tests and users look for; under torchrun
    also in this rank's error file, marked (see [user errors])."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": USER_ERROR_MARK + message, "timestamp": int(time.time())}
        Path(error_file).write_text(json.dumps(record))
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"\nexactga: {message}\n(the traceback is hidden; {TRACEBACK_ENV}=1 shows it)",
            file=sys.stderr,
        )


def _missing_config(argv: list[str]) -> str | None:
    """A message naming ``--config``'s file where it does not exist, else None (``tune run``
    has already turned a built-in config's name into its path)."""
    if "--config" not in argv[:-1]:
        return None
    path = Path(argv[argv.index("--config") + 1])
    if path.is_file():
        return None
    return (
        f"--config {path}: no such file (relative to the working directory {Path.cwd()}); give "
        "a YAML file's path, or a config name that 'tune ls' lists."
    )


def _raised_by(tb: TracebackType | None, recipe_file: Path) -> bool:
    """Whether the innermost frame of ``tb`` is exactga's code or the recipe file's."""
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    return path == recipe_file or _PACKAGE_DIR in path.parents


def quiet_user_errors_under_torchrun(run_module: Any) -> None:
    """Wrap ``torchtune._cli.run.Run._run_distributed`` so that a launch whose ranks ended on a
    user error exits with status 1 without the launcher's traceback (see [user errors]); any
    other failure is reported as before, through torch's ``record``."""
    from torch.distributed.elastic.multiprocessing.errors import record

    run_class = run_module.Run
    recorded = run_class._run_distributed
    if getattr(recorded, "_exactga_quiet", False):
        return
    launch = getattr(recorded, "__wrapped__", recorded)  # below torch's ``record``

    @functools.wraps(launch)
    def run_distributed(self: Any, args: Any, is_builtin: bool) -> Any:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        try:
            return launch(self, args, is_builtin)
        except ChildFailedError as err:
            if not os.environ.get(TRACEBACK_ENV) and _ended_on_user_error(err):
                raise SystemExit(1) from None
            raise

    quiet = record(run_distributed)
    quiet._exactga_quiet = True
    run_class._run_distributed = quiet


def _ended_on_user_error(err: Any) -> bool:
    """Whether some rank of the failed launch reported a user error and every other failed
    rank did too or was stopped by a signal (the launcher stops the others after one fails)."""
    messages = [str(failure.message) for failure in err.failures.values()]
    codes = [failure.exitcode for failure in err.failures.values()]
    marked = [message.startswith(USER_ERROR_MARK) for message in messages]
    return any(marked) and all(m or code < 0 for m, code in zip(marked, codes, strict=True))
