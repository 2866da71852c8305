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
traceback and failure table, about 50 lines under the message. So each rank writes the message,
marked, to the error file torchrun gives it (``TORCHELASTIC_ERROR_FILE``), and ``tune run``'s
torchrun path is wrapped (:func:`quiet_user_errors_under_torchrun`, installed by the start-up
hook ``_exactga_recipes_hook``) to print the message of the lowest failed rank itself, once, and
exit with status 1 and no traceback, when every failed rank reported a user error or was
stopped by the launcher after one did. The launcher prints it, not rank 0: the rank that fails
first may be another (its own data shard, or just faster), and the launcher then stops rank 0
before it gets to print; its ranks (``LAUNCHER_STOP_FILE_ENV`` set) print no user error.

The same wrap makes a stop on SIGINT or SIGTERM (see [stop at a step boundary] in
exactga.launch.stopping) end the launch as quietly: see [torchrun and a stop].
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from exactga.launch.mixups import (
    lora_model_problem,
    misplaced_torchrun_options,
    path_only_recipe,
    recipe_family_problem,
    several_nodes_without_rendezvous,
    single_device_problem,
    tune_run_problem,
)
from exactga.launch.registry import PREFIX, RECIPES, recipe_entry
from exactga.launch.stopping import (
    LAUNCH_COMMAND_ENV,
    LAUNCHER_STOP_FILE_ENV,
    STOP_SIGNALS,
    exit_status,
    is_a_rank_of_the_launcher_wrap,
    stopping_on_signals,
)
from exactga.launch.twins import LAUNCHED_AS_ENV, launched_as

TRACEBACK_ENV = "EXACTGA_TRACEBACK"
# How a rank's error file marks a user error for the launcher (see [user errors]).
USER_ERROR_MARK = "exactga user error: "
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # exactga/, above launch/


def run_recipe(recipe_main: Callable[[], Any]) -> int:
    """Call ``recipe_main`` (a recipe's ``@config.parse`` entry point); return the exit status.

    See [user errors].
    """
    # below torchtune's ``config.parse``: the recipe file's own function and module
    recipe_function = inspect.unwrap(recipe_main)
    recipe_file = Path(recipe_function.__code__.co_filename).resolve()
    # A single-device recipe under torchrun (see [launch mix-ups] in exactga.launch.mixups),
    # and what torchtune's parser would fail on with a traceback (25 to 72 lines).
    problem = (
        single_device_problem(recipe_file, recipe_function.__globals__)
        or _missing_config(sys.argv)
        or _command_line_problem(sys.argv)
        or _mixed_up_config(_launched_name(recipe_function.__globals__, sys.argv), sys.argv)
    )
    if problem is not None:
        _print_user_error(problem)
        return 1
    try:
        with stopping_on_signals():  # see [stop at a step boundary]
            recipe_main()
    except ValueError as err:
        if os.environ.get(TRACEBACK_ENV) or not _raised_by(err.__traceback__, recipe_file):
            raise
        _print_user_error(str(err))
        return 1
    return 0


def _print_user_error(message: str) -> None:
    """The message in the one form tests and users look for: on rank 0 alone, or under
    exactga's wrap of torchrun in this rank's error file, marked, for the launcher to print
    once (see [user errors]); under a plain torchrun both."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": USER_ERROR_MARK + message, "timestamp": int(time.time())}
        Path(error_file).write_text(json.dumps(record))
    if int(os.environ.get("RANK", "0")) == 0 and not is_a_rank_of_the_launcher_wrap():
        _print_message(message)


def _print_message(message: str) -> None:
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
        if arg.startswith("~") and not _has_dotted_key(yaml_args, arg[1:].split("=")[0]):
            return f"command-line override '{arg}': the config has no key {arg[1:]!r} to remove."
    if _merges(overrides, yaml_args):
        return None  # the common case: one merge, not one per override
    for arg in overrides:  # one of them fails: find which, to name it
        problem = _override_value_problem(arg, yaml_args)
        if problem is not None:
            return problem
    return None


# Note [command line]
# torchtune's parser takes ``--config <file>`` and overrides of the form ``key=value`` (one
# ``=``: it splits on every one), ``~key`` to drop a key, values read as YAML by omegaconf. Each
# other form fails inside it with a traceback, so ``run_recipe`` checks the arguments first, the
# values by handing them to torchtune's own merge (the same rules, ``None`` and
# ``max_filename`` included): all at once, and where that fails each alone, to name the one at
# fault (a merge per override cost 0.3 s of CPU at 16 overrides); a key that is well formed but
# unknown is left to ``validate_config``, which suggests the nearest one.


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


def _launched_name(recipe_globals: dict[str, Any], argv: list[str]) -> object:
    """The recipe's ``RECIPE_NAME``; for a file that serves two of torchtune's names (its
    ``RECIPE_NAME`` their family's, ``full_finetune``), the one this launch runs as, as its
    ``validated_config`` will pick it (see [one recipe, two launches])."""
    name = recipe_globals.get("RECIPE_NAME")
    if not any(entry.file and entry.file == name for entry in RECIPES):
        return name
    return launched_as(str(name), _config_keys(argv))


def _config_keys(argv: list[str]) -> set[str]:
    """The top-level keys of the launch's config: its file's and its overrides' (``~key``
    drops one), as torchtune's parser will merge them."""
    config_path, overrides = _config_and_overrides(argv[1:])
    yaml_args, _ = _read_config_file(config_path) if config_path else ({}, None)
    keys = set(yaml_args)
    for arg in overrides:
        key = arg.partition("=")[0]
        if key.startswith("~"):
            keys.discard(key[1:])  # a dotted one drops a key inside a section: no top key
        else:
            keys.add(key.split(".")[0])
    return keys


def _mixed_up_config(recipe_name: object, argv: list[str]) -> str | None:
    """A config of another recipe family (its loss or its model), refused before anything is
    written; see [launch mix-ups] in exactga.launch.mixups."""
    return recipe_family_problem(
        recipe_name, _component_of(argv, "loss"), argv[1:]
    ) or lora_model_problem(recipe_name, _component_of(argv, "model"), argv[1:])


def _component_of(argv: list[str], section: str) -> str | None:
    """``<section>._component_`` as the config file and the overrides set it (the last
    override wins, as in torchtune's parser); None where neither does."""
    config_path, overrides = _config_and_overrides(argv[1:])
    for arg in reversed(overrides):
        key, _, value = arg.partition("=")
        if key == f"{section}._component_":
            return value
    if config_path is None:
        return None
    yaml_args, problem = _read_config_file(config_path)
    component = yaml_args.get(section) if problem is None else None
    return component.get("_component_") if isinstance(component, dict) else None


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
    saying where it is not YAML. Read once per version of the file: the checks before a run ask
    for it three or four times, and omegaconf takes about 30 ms a read (the dict is shared:
    callers copy it before they change it)."""
    stat = os.stat(path)
    return _read_config_version(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read_config_version(path: str, mtime_ns: int, size: int) -> tuple[dict[str, Any], str | None]:
    import yaml
    from omegaconf import OmegaConf

    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as err:
        return {}, f"--config {path}: not valid YAML ({_yaml_problem(err)}); fix the file."
    if not OmegaConf.is_dict(loaded):
        return {}, f"--config {path}: holds a list, not a mapping of config keys; fix the file."
    return OmegaConf.to_container(loaded, resolve=False), None


def _merges(overrides: list[str], yaml_args: dict[str, Any]) -> bool:
    """Whether torchtune's merge takes the config file with all ``overrides`` at once."""
    import copy
    from argparse import Namespace

    from torchtune.config._utils import _merge_yaml_and_cli_args

    try:  # a copy: a ~key override removes the key in place
        _merge_yaml_and_cli_args(Namespace(**copy.deepcopy(yaml_args)), overrides)
    except Exception:  # which override, and why, is _override_value_problem's to say
        return False
    return True


def _override_value_problem(arg: str, yaml_args: dict[str, Any]) -> str | None:
    """torchtune's merge of the config file with this one override, or the message saying
    why it fails: a value that is not YAML, or a component it cannot remove (a ``~key`` with
    no key to remove is refused before)."""
    import copy
    from argparse import Namespace

    import yaml
    from omegaconf.errors import OmegaConfBaseException
    from torchtune.config._utils import _merge_yaml_and_cli_args

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


def patch_tune_run(run_module: Any) -> None:
    """Patch ``torchtune._cli.run`` (the start-up hook ``_exactga_recipes_hook`` calls this as
    ``tune`` imports it): the quiet end of a launch after user errors or a stop
    (:func:`quiet_user_errors_under_torchrun`), and the launch mix-ups refused or run as meant
    (:func:`refuse_launch_mixups`)."""
    quiet_user_errors_under_torchrun(run_module)
    refuse_launch_mixups(run_module)


def refuse_launch_mixups(run_module: Any) -> None:
    """Wrap ``torchtune._cli.run.Run`` so that ``tune run`` refuses, in one message and with
    status 1, a launch that would run something other than asked, and runs a recipe given by a
    path that is no module name by its path; see [launch mix-ups] in exactga.launch.mixups."""
    run_class = run_module.Run
    if getattr(run_class._run_cmd, "_exactga_checked", False):
        return
    run_cmd, get_recipe = run_class._run_cmd, run_class._get_recipe

    @functools.wraps(get_recipe)
    def get_recipe_or_file(self: Any, recipe_str: str) -> Any:
        recipe = get_recipe(self, recipe_str)
        path = path_only_recipe(recipe_str) if recipe is None else None
        if path is None:
            return recipe
        # Run by its path, as torchtune runs its own recipes (an absolute path survives its
        # join onto its folder); under torchrun the recipe itself refuses to run on several
        # processes where it is a single-device one. Its folder goes first on sys.path, where
        # ``python <file>`` (torchrun's form) puts it.
        sys.path.insert(0, str(path.parent))
        return run_module.Recipe(
            name=recipe_str, file_path=str(path), configs=[], supports_distributed=True
        )

    @functools.wraps(run_cmd)
    def checked_run_cmd(self: Any, args: Any) -> Any:
        listed = {
            recipe.name: recipe.supports_distributed for recipe in run_module.get_all_recipes()
        }
        problem = (
            misplaced_torchrun_options(args.recipe, args.recipe_args, _torchrun_options(run_module))
            or several_nodes_without_rendezvous(str(args.nnodes), args.rdzv_endpoint)
            or tune_run_problem(
                args.recipe,
                _config_file(self, args, run_module),
                self._is_distributed_args(args),
                listed,
            )
        )
        if problem is not None:
            print(f"\nexactga: {problem}", file=sys.stderr)
            raise SystemExit(1)
        record_launched_name(args.recipe)
        return run_cmd(self, args)

    checked_run_cmd._exactga_checked = True  # type: ignore[attr-defined]
    run_class._get_recipe = get_recipe_or_file
    run_class._run_cmd = checked_run_cmd


def record_launched_name(recipe: str) -> None:
    """Tell the recipe's process (this one, or torchrun's ranks) the exactga name ``tune run``
    was given, for a file that serves two names; nothing for a path (see [one recipe, two
    launches] in exactga.launch.twins)."""
    if recipe.startswith(PREFIX) and recipe_entry(recipe.removeprefix(PREFIX)) is not None:
        os.environ[LAUNCHED_AS_ENV] = recipe.removeprefix(PREFIX)
    else:
        os.environ.pop(LAUNCHED_AS_ENV, None)


def _torchrun_options(run_module: Any) -> dict[str, bool]:
    """torchrun's options (``--nproc_per_node``, ``-m``, ...), each with whether it takes a
    value, as ``tune run`` takes them before the recipe."""
    return {
        option: action.nargs != 0
        for action in run_module.get_torchrun_args_parser()._actions
        if action.dest not in ("training_script", "training_script_args", "help", "recipe")
        for option in action.option_strings
    }


def _config_file(run: Any, args: Any, run_module: Any) -> str | None:
    """``--config``'s file as ``tune run`` resolves it (a listed config name to its file), or
    None where it is not given (torchtune says so itself)."""
    if "--config" not in args.recipe_args[:-1]:
        return None
    config_str = args.recipe_args[args.recipe_args.index("--config") + 1]
    config = run._get_config(config_str, run._get_recipe(args.recipe))
    if config is None:
        return config_str
    return str(run_module.ROOT / "recipes" / "configs" / config.file_path)


# Note [torchrun and a stop]
# Under ``tune run --nproc_per_node N`` the launcher process is torchrun's agent. It handles
# SIGINT and SIGTERM itself: it sends the same signal to each rank (every rank runs in a session
# of its own, so a terminal's Ctrl-C reaches the ranks only this way, once), waits for them up
# to its shutdown timeout, kills what is left with SIGKILL, and raises ``SignalException``,
# printed with a traceback. The wrap of its launch therefore:
# - gives the ranks 300 s, not torch's 30, to finish their step and write the stop checkpoint
#   when the launcher itself got the signal (unless ``--shutdown_timeout`` or
#   ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` says otherwise); a scheduler's own grace period still
#   bounds it, and a second signal ends the ranks at once. When a rank fails instead, the
#   others are stopped with torch's timeout as before: a survivor blocked in a collective with
#   its dead peer (NCCL waits) runs no Python and is killed after it, not 300 s;
# - exits with the ranks' status, 128 + the signal, without a traceback, on
#   ``SignalException``, and on a failure whose every rank exited so (a signal sent to the
#   ranks alone, as Slurm's scancel does);
# - leaves out the agent's lines about passing the signal on; its line about a rank that
#   outlived the timeout ("forcefully exiting via SIGKILL") stays;
# - writes a file of the launch's own (``LAUNCHER_STOP_FILE_ENV``) when it got the signal
#   itself, before passing it on: a rank stopped outside training while that file is missing
#   was stopped by the agent's clean-up after another rank failed, and prints no stop line,
#   which would stand where that rank's error belongs (see [user errors]);
# - hands the ranks its own command line (``EXACTGA_LAUNCH_COMMAND``), since theirs is
#   torchrun's ``python -m recipes.<name>``, for the command that goes on;
# - sets ``OMP_NUM_THREADS=1`` where torchrun would (several ranks, the variable unset): the
#   value torchrun sets, so no rank computes differently, without torchrun's seven-line warning
#   about it. A rank's count is still the config's ``cpu_threads`` where set ([cpu threads] in
#   exactga.runtime.threads).

SHUTDOWN_TIMEOUT_S = 300  # see [torchrun and a stop]


def quiet_user_errors_under_torchrun(run_module: Any) -> None:
    """Wrap ``torchtune._cli.run.Run._run_distributed`` so that a launch whose ranks ended on a
    user error exits with status 1 without the launcher's traceback (see [user errors]), and a
    launch stopped by SIGINT or SIGTERM with the ranks' status (see [torchrun and a stop]); any
    other failure is reported as before, through torch's ``record``."""
    from torch.distributed.elastic.multiprocessing.errors import record

    run_class = run_module.Run
    recorded = run_class._run_distributed
    if getattr(recorded, "_exactga_quiet", False):
        return
    launch = getattr(recorded, "__wrapped__", recorded)  # below torch's ``record``

    @functools.wraps(launch)
    def run_distributed(self: Any, args: Any, is_builtin: bool) -> Any:
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        launch_folder = _prepare_ranks(args)
        try:
            return launch(self, args, is_builtin)
        except SignalException as err:
            raise SystemExit(exit_status(err.sigval)) from None
        except ChildFailedError as err:
            if os.environ.get(TRACEBACK_ENV):
                raise
            if _ended_on_user_error(err):
                _print_message(_first_user_error(err))
                raise SystemExit(1) from None
            stopped = _stopped_by_signal(err)
            if stopped is not None:
                raise SystemExit(stopped) from None
            raise
        finally:
            shutil.rmtree(launch_folder, ignore_errors=True)

    quiet = record(run_distributed)
    quiet._exactga_quiet = True
    run_class._run_distributed = quiet


def _prepare_ranks(args: Any) -> str:
    """The environment and launcher settings of [torchrun and a stop]; returns the launch's
    temporary folder, for the caller to remove."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api as processes
    from torch.distributed.run import determine_local_world_size

    os.environ[LAUNCH_COMMAND_ENV] = json.dumps(sys.argv)
    # A path of this launch's own; the file exists once the launcher got a stop signal.
    launch_folder = tempfile.mkdtemp(prefix="exactga_launch_")
    os.environ[LAUNCHER_STOP_FILE_ENV] = str(Path(launch_folder) / "stop_signal")
    mark_a_stop_signal(processes)
    if getattr(args, "shutdown_timeout", None) is None and not os.environ.get(
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    ):
        grace_after_a_stop_signal(processes, LocalElasticAgent)
    try:
        num_ranks = determine_local_world_size(args.nproc_per_node)
    except ValueError:  # torchrun reports it itself
        num_ranks = 1
    if num_ranks > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).addFilter(_forwarding_a_stop)
    return launch_folder


def mark_a_stop_signal(processes: Any) -> None:
    """Make torchrun's agent write the file ``LAUNCHER_STOP_FILE_ENV`` names when it gets
    SIGINT or SIGTERM itself, before it passes the signal on: a rank stopped outside training
    by a signal the launcher did not get was stopped by the launcher's clean-up after another
    rank failed, and prints no stop line (see [torchrun and a stop]). ``processes`` is torch's
    ``torch.distributed.elastic.multiprocessing.api``."""
    if getattr(processes, "_exactga_marks_stops", False):
        return
    raise_in_agent = processes._terminate_process_handler

    def marking_handler(signum: int, frame: Any) -> None:
        stop_file = os.environ.get(LAUNCHER_STOP_FILE_ENV)
        if signum in STOP_SIGNALS and stop_file:
            with contextlib.suppress(OSError):
                Path(stop_file).touch()
        raise_in_agent(signum, frame)

    processes._terminate_process_handler = marking_handler
    processes._exactga_marks_stops = True


_SHUTDOWN_TRIES = 3  # torch's clean-up of the ranks, tried again after a rank ended mid-way


def grace_after_a_stop_signal(processes: Any, agent_class: Any) -> None:
    """Make torchrun's agent wait :data:`SHUTDOWN_TIMEOUT_S` for its ranks once it got SIGINT
    or SIGTERM itself (see [torchrun and a stop]): ``processes`` is torch's
    ``torch.distributed.elastic.multiprocessing.api``, whose signal handler the agent installs
    when it starts the ranks, and ``agent_class`` its ``LocalElasticAgent``."""
    if getattr(agent_class._shutdown, "_exactga_grace", False):
        return
    raise_in_agent = processes._terminate_process_handler
    shutdown = agent_class._shutdown
    received: list[int] = []

    def recording_handler(signum: int, frame: Any) -> None:
        received.append(signum)
        raise_in_agent(signum, frame)

    def shutdown_with_grace(self: Any, death_sig: Any = signal.SIGTERM, timeout: int = 30) -> None:
        if any(signum in STOP_SIGNALS for signum in received):
            timeout = max(timeout, SHUTDOWN_TIMEOUT_S)
        for _ in range(_SHUTDOWN_TRIES - 1):
            try:
                return shutdown(self, death_sig, timeout)
            except ProcessLookupError:
                # A rank ended between torch's poll and its killpg; without this the agent dies
                # here and the failing rank's one-line message is never printed. Again: the
                # ended rank is polled as done now, and the others are closed.
                continue
        shutdown(self, death_sig, timeout)

    shutdown_with_grace._exactga_grace = True  # type: ignore[attr-defined]
    processes._terminate_process_handler = recording_handler
    agent_class._shutdown = shutdown_with_grace


# torch's loggers that tell of passing a stop signal on to the ranks.
_AGENT_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)


def _forwarding_a_stop(record: logging.LogRecord) -> bool:
    """False for the agent's lines about passing SIGINT or SIGTERM on (a logging filter):
    ``Received 15 death signal, ...`` and ``Sending process 123 closing signal SIGTERM``."""
    template = str(record.msg)
    if "death signal" not in template and "closing signal" not in template:
        return True
    sent = record.args[-1] if isinstance(record.args, tuple) and record.args else None
    stops = {str(form) for signum in STOP_SIGNALS for form in (signum.name, int(signum), signum)}
    return getattr(sent, "name", str(sent)) not in stops and str(sent) not in stops


def _stopped_by_signal(err: Any) -> int | None:
    """The status every failed rank of the launch exited with, when it is a stop's (130 or 143;
    see [stop at a step boundary] in exactga.launch.stopping), else None."""
    codes = {failure.exitcode for failure in err.failures.values()}
    stops = {exit_status(signum) for signum in STOP_SIGNALS}
    return codes.pop() if len(codes) == 1 and codes <= stops else None


def _first_user_error(err: Any) -> str:
    """The user error of the lowest rank that reported one, without its mark."""
    for _, failure in sorted(err.failures.items()):
        message = str(failure.message)
        if message.startswith(USER_ERROR_MARK):
            return message.removeprefix(USER_ERROR_MARK)
    raise AssertionError("no rank reported a user error")  # _ended_on_user_error said one did


def _ended_on_user_error(err: Any) -> bool:
    """Whether some rank of the failed launch reported a user error and every other failed
    rank did too or was stopped by a signal (the launcher stops the others after one fails):
    killed by it (a negative code) or ended by our stop handler (130 or 143), which a rank
    has installed once its recipe started, so which of the two a peer shows is a race."""
    messages = [str(failure.message) for failure in err.failures.values()]
    codes = [failure.exitcode for failure in err.failures.values()]
    marked = [message.startswith(USER_ERROR_MARK) for message in messages]
    stops = {exit_status(signum) for signum in STOP_SIGNALS}
    stopped = [code < 0 or code in stops for code in codes]
    return any(marked) and all(m or s for m, s in zip(marked, stopped, strict=True))
