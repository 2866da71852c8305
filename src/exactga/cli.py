"""How a recipe ends on bad input: one message, no traceback, a non-zero exit.

Note [user errors]
exactga raises ``ValueError`` only for input a user can fix (a config key, a file, a data row, a
checkpoint), naming what is wrong and how to fix it, and ``assert`` for its own invariants
(STYLE.md point 7). So a ``ValueError`` raised from exactga's own code or from the recipe file
is printed as that message alone, on rank 0, and the process exits with status 1; the 25 to 60
lines of traceback above it would only bury it. Any other exception, a ``ValueError`` raised
inside torch or torchtune included, keeps its traceback: that is a bug to report, not an input to
fix. ``EXACTGA_TRACEBACK=1`` shows the traceback of user errors too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

TRACEBACK_ENV = "EXACTGA_TRACEBACK"
_PACKAGE_DIR = Path(__file__).resolve().parent


def run_recipe(recipe_main: Callable[[], Any]) -> int:
    """Call ``recipe_main`` (a recipe's ``@config.parse`` entry point); return the exit status.

    See [user errors].
    """
    try:
        recipe_main()
    except ValueError as err:
        recipe_file = Path(recipe_main.__code__.co_filename).resolve()
        if os.environ.get(TRACEBACK_ENV) or not _raised_by(err.__traceback__, recipe_file):
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"\nexactga: {err}\n(the traceback is hidden; {TRACEBACK_ENV}=1 shows it)",
                file=sys.stderr,
            )
        return 1
    return 0


def _raised_by(tb: TracebackType | None, recipe_file: Path) -> bool:
    """Whether the innermost frame of ``tb`` is exactga's code or the recipe file's."""
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = Path(tb.tb_frame.f_code.co_filename).resolve()
    return path == recipe_file or _PACKAGE_DIR in path.parents
