"""How the tests run a recipe when the launch is not what they test: ``run_recipe``.

Most recipe tests are about a run (its numbers, checkpoints, messages), not about how ``tune run``
and torchrun start processes, and a fresh process spends about 5 s of CPU importing torch,
torchtune and datasets before a tiny step of milliseconds. So ``run_recipe(args)`` takes the
arguments of ``tune run`` (``[--nproc_per_node N] <recipe> --config <file> key=value ...``) and
starts each rank as a child of multiprocessing's forkserver, which imported those libraries and
exactga once (``forkserver``: one per test process, shared with the 2-rank harness of
tests/unit_utils.py). Each child, like a rank torchrun starts:
- gets the test's environment and, with ``--nproc_per_node N``, the variables torchrun gives a
  rank (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` of a free port, ...);
- runs ``tune run <recipe> ...`` without ``--nproc_per_node`` through torchtune's own command
  line (recipe and config names resolved as ``tune`` does, exactga's start-up patches in place),
  which runs the recipe file as ``__main__`` in that child;
- writes its stdout and stderr to the run's two files, the ranks interleaved as under torchrun.
A rank that fails ends its peers (SIGKILL, after a grace for them to end by themselves), as
torchrun's agent does; the run's status is the first failing rank's. Each run is a fork of its
own, so nothing of one run (dynamo's caches, a process group, a warning shown once) reaches the
next. A setting a test would otherwise need a fresh process for is a hook of tests/run_hooks.py,
switched on by the run's environment.

What a child cannot show stays a real launch, ``tools/tiny_runs.run_tune``: anything read when a
module is imported (the forkserver imported everything under ``FORKSERVER_ENV`` and the first
caller's environment), the console of a fresh process, torchrun's agent (its messages, signals
passed to the ranks, rendezvous across nodes) and exactga's wrap of it (a user error printed once
by the launcher, a stop signal marked). tests/test_launching.py,
tests/test_multi_node_launch.py and tests/test_dead_rank.py are such tests, and a few of
tests/test_stop_on_signal.py's and tests/test_bad_input_launch.py's (tests/test_architecture.py
keeps the list).

Fork safety: a child is forked from the forkserver, a process of one thread that has imported
modules and run nothing. Under ``FORKSERVER_ENV`` the imports start no thread (numpy's BLAS pool
takes ``OMP_NUM_THREADS``; pyarrow's jemalloc is told not to start its background thread); each
child checks that its parent still has one thread and fails, naming the threads, if not.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pkgutil
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from pathlib import Path

from tiny_runs import REPO_ROOT, TUNE  # noqa: F401 - REPO_ROOT re-exported for many_runs

# The forkserver's own environment on top of its starter's: no thread started by the imports.
FORKSERVER_ENV = {
    "OMP_NUM_THREADS": "1",
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
    "HF_DATASETS_OFFLINE": "1",  # read by datasets at import; every run of the tests is offline
    "HF_HUB_OFFLINE": "1",
}
# What a run imports before its first step; exactga's modules are added when the server starts.
# Installed modules only: CPython's forkserver (3.11, 3.12) does not get the tests' sys.path, so a
# module of tests/ would fail to import there, silently.
PRELOAD = [
    "datasets",
    "omegaconf",
    "safetensors.torch",
    "torch",
    # What a compiled run imports on its first compile (0.7 CPU-s, no thread started): once here
    # instead of in each compiled run.
    "torch._functorch.aot_autograd",
    "torch._inductor.compile_fx",
    "torch.distributed.fsdp",
    "torch.utils.tensorboard",
    "torchao",
    "torchtune._cli.tune",
    "torchtune.datasets",
    "torchtune.models",
    "torchtune.modules",
    "torchtune.training",
]

# A failed rank's peers: seconds to end by themselves before SIGKILL (see ``RecipeRun.poll``).
PEER_GRACE_S = 10.0
# Set to a file: each forked rank appends a JSON line of its test, command, wall and CPU seconds
# (what the suite's time goes to; tests/run_costs.py sums it by module).
RUN_COST_LOG = "EXACTGA_TEST_RUN_COST_LOG"


_lock = threading.Lock()
_started: list[bool] = []


def forkserver() -> multiprocessing.context.BaseContext:
    """multiprocessing's forkserver context, the server started (once per process) with
    ``PRELOAD`` and every importable exactga module, under ``FORKSERVER_ENV``."""
    context = multiprocessing.get_context("forkserver")
    with _lock:
        if not _started:
            import exactga

            modules = [m.name for m in pkgutil.walk_packages(exactga.__path__, "exactga.")]
            context.set_forkserver_preload([*PRELOAD, *modules])
            starter = dict(os.environ)
            os.environ.update(FORKSERVER_ENV)  # the server takes this process's environment
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(starter)
            _started.append(True)
    return context


class RecipeRun:
    """The ranks of one ``run_recipe`` launch, started; ``stdout`` and ``stderr`` are the files
    every rank writes to."""

    def __init__(self, args: list[str], cwd: Path | str, env: dict[str, str], folder: Path):
        nproc = 0
        if args[:1] == ["--nproc_per_node"]:
            nproc, args = int(args[1]), args[2:]
        if args[0].startswith("-"):  # another torchrun option: torchrun's agent is run_tune's
            raise ValueError(f"run_recipe takes --nproc_per_node N alone before the recipe: {args}")
        typed = [str(TUNE), "run", *(["--nproc_per_node", str(nproc)] if nproc else []), *args]
        self.args, self.stdout, self.stderr = typed, folder / "stdout", folder / "stderr"
        self.stdout.touch()
        self.stderr.touch()
        context = forkserver()
        port = _free_port()
        self.ranks = []
        self.failed_at: float | None = None  # when a rank first failed
        for rank in range(max(nproc, 1)):
            rank_env = {**env, **_torchrun_variables(rank, nproc, port, typed)} if nproc else env
            child = context.Process(
                target=_run_rank,
                args=([str(TUNE), "run", *args], rank_env, str(cwd), self.stdout, self.stderr),
                name=f"rank{rank}",
            )
            child.start()
            self.ranks.append(child)

    def poll(self) -> int | None:
        """The run's status once every rank ended, else None. A failed rank's peers get
        ``PEER_GRACE_S`` to end by themselves (each refusing the same input: rank 0 prints the
        message), then SIGKILL, as torchrun's agent ends them."""
        codes = [rank.exitcode for rank in self.ranks]
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is None:
            return 0 if None not in codes else None
        if None in codes:
            self.failed_at = self.failed_at or time.monotonic()
            if time.monotonic() - self.failed_at < PEER_GRACE_S:
                return None
            self.kill()
        return failed

    def wait(self, timeout: float) -> int:
        """The run's status; kills the ranks and raises ``subprocess.TimeoutExpired`` after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise subprocess.TimeoutExpired(self.args, timeout)
            running = [rank.sentinel for rank in self.ranks if rank.exitcode is None]
            multiprocessing.connection.wait(running, timeout=min(left, 0.5))
        return status

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to every rank still running (as a ``kill`` of a job's ranks)."""
        for rank in self.ranks:
            if rank.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.pid, signum)

    def kill(self) -> None:
        """SIGKILL every rank still running, and wait until each has ended."""
        for rank in self.ranks:
            if rank.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.pid, signal.SIGKILL)
        for rank in self.ranks:
            rank.join()


def start_recipe(
    args: list[str], cwd: Path | str, env: dict[str, str], folder: Path | str
) -> RecipeRun:
    """Start ``tune run *args`` as forked ranks (see the module's docstring), with exactly the
    environment ``env``; its output goes to ``folder/stdout`` and ``folder/stderr``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return RecipeRun(list(args), cwd, env, folder)


def run_recipe(
    args: list[str], cwd: Path | str, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    """``tune run *args`` as forked ranks, to its end: the status and both streams, as
    ``subprocess.run(..., capture_output=True, text=True)`` returns them."""
    with tempfile.TemporaryDirectory(prefix="exactga_run_") as folder:
        run = start_recipe(args, cwd, env, folder)
        status = run.wait(timeout)
        stdout, stderr = (path.read_text(errors="replace") for path in (run.stdout, run.stderr))
    return subprocess.CompletedProcess(run.args, status, stdout, stderr)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torchrun_variables(rank: int, nproc: int, port: int, typed: list[str]) -> dict[str, str]:
    """What torchrun sets for rank ``rank`` of ``nproc`` on one node, and what exactga's wrap of
    it adds for the ranks (the command as typed, for a stop line's resume command)."""
    from exactga.launch.stopping import LAUNCH_COMMAND_ENV

    counts = {"WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "ROLE_WORLD_SIZE": nproc}
    ranks = {"RANK": rank, "LOCAL_RANK": rank, "ROLE_RANK": rank, "GROUP_RANK": 0}
    return {
        **{key: str(value) for key, value in {**counts, **ranks}.items()},
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": f"tests_{port}",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        LAUNCH_COMMAND_ENV: json.dumps(typed),
    }


# --- in each child ------------------------------------------------------------------------------


def _run_rank(argv: list[str], env: dict[str, str], cwd: str, stdout: Path, stderr: Path) -> None:
    """A forked child: become what torchrun's ``python -u <recipe>`` would be, run ``tune run``
    in it, and end as an interpreter ends."""
    _check_forked_from_one_thread()
    gc.freeze()  # the server's imports, never garbage: each collection skips them
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for stream, path in ((1, stdout), (2, stderr)):
        with open(path, "a") as file:  # appending: the ranks' lines interleave, none lost
            os.dup2(file.fileno(), stream)
    faulthandler.enable()  # a rank that crashes in C (a segfault in gloo) prints its Python stack
    _put_python_path_first(env.get("PYTHONPATH", ""))
    sys.argv = argv
    sys.orig_argv = [sys.executable, *argv]  # what `tune` (a Python script) has
    started = time.monotonic()
    status = _tune_main()
    _log_cost(env.get(RUN_COST_LOG), argv, env.get("PYTEST_CURRENT_TEST"), started)
    _drop_operator_deregistration()
    atexit._run_exitfuncs()  # what an interpreter runs as it ends, which a forked child skips
    sys.exit(status)  # multiprocessing then ends the child as an interpreter ends: it joins the
    # non-daemon threads after telling executors' workers to stop, and flushes the streams


def _log_cost(path: str | None, argv: list[str], test: str | None, started: float) -> None:
    """One JSON line on this rank's cost appended to ``path`` (``RUN_COST_LOG``), if set."""
    if not path:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)  # the fork's own: it starts at zero
    line = {
        "test": test,
        "argv": argv[2:],
        "rank": os.environ.get("RANK"),
        "wall_s": round(time.monotonic() - started, 3),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
    }
    with open(path, "a") as file:  # one short write: the ranks' lines do not interleave
        file.write(json.dumps(line) + "\n")


def _drop_operator_deregistration() -> None:
    """Leave out, at exit, torch.library's finalizers of the operator libraries the server
    imported (213 with torchao and torchtune): each deregisters its operators from the
    dispatcher, which changes nothing a run leaves behind and costs a rank 0.03-0.05 CPU-s,
    3.5% of the suite's rank CPU (py-spy). A real launch still runs them."""
    import torch.library

    for finalizer, info in list(weakref.finalize._registry.items()):  # no public list of them
        if info.func is torch.library._del_library:
            finalizer.atexit = False


def _check_forked_from_one_thread() -> None:
    threads = list(Path(f"/proc/{os.getppid()}/task").iterdir())
    if len(threads) != 1:
        names = [(task / "comm").read_text().strip() for task in threads]
        message = f"the forkserver runs threads {names} (see 'Fork safety' in tests/launcher.py)"
        raise RuntimeError(message)


def _put_python_path_first(python_path: str) -> None:
    """``PYTHONPATH``'s entries first on ``sys.path`` (after the script's folder), as a fresh
    interpreter puts them, and a ``sitecustomize`` among them run, as one runs it at start
    (tests/collective_counter)."""
    entries = [entry for entry in python_path.split(os.pathsep) if entry]
    sys.path[1:1] = [entry for entry in entries if entry not in sys.path]
    if any((Path(entry) / "sitecustomize.py").is_file() for entry in entries):
        sys.modules.pop("sitecustomize", None)
        __import__("sitecustomize")


def _tune_main() -> int:
    """torchtune's ``tune`` on ``sys.argv``, with the tests' hooks (tests/run_hooks.py); the
    exit status."""
    import run_hooks
    from torchtune._cli.tune import main

    try:
        with run_hooks.active():
            main()
        return 0
    except SystemExit as exit_:
        code = exit_.code
        if isinstance(code, int):
            return code
        if code is not None:
            print(code, file=sys.stderr)
        return 0 if code is None else 1
    except BaseException:  # noqa: BLE001 - printed as an interpreter prints it
        traceback.print_exc()
        return 1
