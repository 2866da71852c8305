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
    # torchtune's parser would fail on either with a traceback (25 to 72 lines)
    problem = _missing_config(sys.argv) or _command_line_problem(sys.argv)
    if problem is not None:
        _print_user_error(problem)
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


def _command_line_problem(argv: list[str]) -> str | None:
    """A message naming the first argument after the recipe that torchtune's parser
    (``config.parse``: argparse, then ``_merge_yaml_and_cli_args``) would fail on, or the
    config file where it is not YAML; None when it would parse them all. See [command line].
    """
    config_path, overrides = _config_and_overrides(argv[1:])
    for position, arg in enumerate(overrides):
        problem = _override_form_problem(arg, overrides[position + 1 : position + 2])
        if problem is not None:
            return problem
    if config_path is None:
        return None  # argparse says --config is required, in one line
    yaml_args, problem = _read_config_file(config_path)
    if problem is not None:
        return problem
    for arg in overrides:
        problem = _override_value_problem(arg, yaml_args)
        if problem is not None:
            return problem
    return None


# Note [command line]
# torchtune's parser takes ``--config <file>`` and overrides of the form ``key=value`` (one
# ``=``: it splits on every one), ``~key`` to drop a key, values read as YAML by omegaconf. Each
# other form fails inside it with a traceback, so ``run_recipe`` checks the arguments first, the
# values by handing each override alone to torchtune's own merge (the same rules, ``None`` and
# ``max_filename`` included); a key that is well formed but unknown is left to
# ``validate_config``, which suggests the nearest one.


def _config_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """``--config``'s value (``--config X`` or ``--config=X``) and the other arguments."""
    config_path, overrides = None, []
    position = 0
    while position < len(args):
        arg = args[position]
        if arg == "--config" and position + 1 < len(args):
            config_path = args[position + 1]
            position += 2
            continue
        if arg.startswith("--config="):
            config_path = arg.removeprefix("--config=")
        else:
            overrides.append(arg)
        position += 1
    return config_path, overrides


def _override_form_problem(arg: str, following: list[str]) -> str | None:
    """What is wrong with the form of one override, or None; ``following`` is the argument
    after it (a value the shell split off: ``epochs 3``)."""
    if arg.startswith("--"):
        key, _, value = arg[2:].partition("=")
        return (
            f"command-line argument '{arg}': after the recipe, tune run takes only --config "
            f"<file> and key=value overrides; write it as {key}={value or '<value>'}."
        )
    if arg.startswith("~"):
        return None  # ~key drops a key: checked against the config with the values
    if "=" not in arg:
        value = following[0] if following and "=" not in following[0] else "<value>"
        return (
            f"command-line override '{arg}' is not key=value; write it as {arg}={value} "
            "(no spaces around '=')."
        )
    key = arg.split("=")[0]
    if not key.strip():
        return (
            f"command-line override '{arg}' has no key before '='; write key=value, e.g. epochs=3."
        )
    if arg.count("=") > 1:
        return (
            f"command-line override '{arg}' holds more than one '=', which torchtune's parser "
            "refuses; give that value in the config file instead."
        )
    return None


def _read_config_file(path: str) -> tuple[dict[str, Any], str | None]:
    """The config file's keys as torchtune's parser reads them (unresolved), or a message
    saying where it is not YAML."""
    import yaml
    from omegaconf import OmegaConf

    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        return {}, f"--config {path}: not valid YAML ({_yaml_problem(err)}); fix the file."
    if not OmegaConf.is_dict(loaded):
        return {}, f"--config {path}: holds a list, not a mapping of config keys; fix the file."
    return OmegaConf.to_container(loaded, resolve=False), None


def _override_value_problem(arg: str, yaml_args: dict[str, Any]) -> str | None:
    """torchtune's merge of the config file with this one override, or the message saying
    why it fails: a value that is not YAML, or a ``~key`` it cannot remove."""
    import copy
    from argparse import Namespace

    import yaml
    from omegaconf.errors import OmegaConfBaseException
    from torchtune.config._utils import _merge_yaml_and_cli_args

    if arg.startswith("~") and not _has_dotted_key(yaml_args, arg[1:].split("=")[0]):
        return f"command-line override '{arg}': the config has no key {arg[1:]!r} to remove."
    try:  # a copy: a ~key override removes the key in place
        _merge_yaml_and_cli_args(Namespace(**copy.deepcopy(yaml_args)), [arg])
    except ValueError:  # torchtune refuses to remove a section with a _component_
        return (
            f"command-line override '{arg}': torchtune cannot remove a component (a section "
            "with _component_) from the command line; remove it from the config file."
        )
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        # The line and column would be the parser's own, within the value: left out.
        reason = getattr(err, "problem", None) or str(err).splitlines()[0]
        return (
            f"command-line override '{arg}': its value {arg.partition('=')[2]!r} does not "
            f"parse ({reason}); fix it (a list is [a,b]), or set it in the config file."
        )
    return None


def _has_dotted_key(tree: Any, dotted: str) -> bool:
    """Whether nested dicts ``tree`` hold the key path ``a.b.c``."""
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def _yaml_problem(err: Exception) -> str:
    """A YAML error's problem and where, in one line (PyYAML counts lines and columns from 0)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


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
