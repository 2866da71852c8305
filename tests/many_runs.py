"""Several recipe runs in one ``tune run`` launch, for the tests' sweeps of configs.

Most of a tiny launch is start-up: the ``tune`` process and every rank import torch and
torchtune (about 6 s of CPU each, so 15 to 20 s for two ranks) before a step of milliseconds.
``launch_runs`` pays that once for a list of runs: it launches ``tune run [--nproc_per_node N]
tests/many_runs.py --config <plan.json>``, and each rank runs the plan's recipes one after
another exactly as ``tune run`` starts one (``python -m recipes.<name> --config ...``): the
recipe file executed afresh as ``__main__`` by ``runpy``, its own ``recipe_main``, config
parsing, process group, training, checkpoints and ``sys.exit``. Nothing here imports a recipe
into a test (docs/contributing.md point 10); the recipes still run only in the launched processes.

What a fresh process would give each run, and a shared one would not, is reset per run:
- its own process group: rank 0 serves the run's rendezvous store on a port of its own (the
  ``env://`` rendezvous the recipe calls, without torchrun's agent store), since a second
  group on the agent's store reads the first group's stale gloo addresses and fails to
  connect, intermittently;
- Python's "once per location" warnings (``warnings.catch_warnings``) and torchtune's
  ``log_once``, so a run prints the warnings it would print alone;
- its output: file descriptors 1 and 2 of each rank go to ``<folder>/rank<R>.log``;
- torch.compile's caches (``torch._dynamo.reset()``, where dynamo was imported): each run
  compiles its own model afresh, as alone. Without it a later run reuses the earlier runs'
  graphs where their guards pass (its end-of-run line then reports 0 graphs) and adds
  recompilations to their frames where not, up to dynamo's recompile limit (8 a frame) and
  eager past it (tests/test_compile_parity.py's GRPO runs, after the SFT, LoRA and DPO ones,
  hit it). exactga's compile counts (exactga.profiling.compilations) start at the run's start,
  so after the reset they are the run's own;
- its working directory, the launch's (``sys.path`` and the imported modules are shared, so
  runs that need another ``PYTHONPATH`` or working directory get launches of their own).

A run that fails ends the launch (its peer may be waiting in one of its collectives); the runs
it did not reach are launched again, so a failure shows as that run's own, and never hides
another run's result. Each run's folder then holds ``output.txt`` (its ranks' output, and the
launch's when it failed) and ``returncode``, as one launch of its own would leave.

Runs expected to fail (the tests of bad input) may share a launch too: with
``go_on_after_failure=True``, which needs ``nproc=0`` (one process, no torchrun, so no peer
waits on a failed run), the launch goes on to the next run after a failing one, and each run's
folder holds its own status and exactly its own output (``output.txt``: its stdout and stderr,
nothing of the launch's or another run's). Only a run that ended the launch itself (the process
died or timed out in it) gets the launch's output too, and the runs after it are launched again,
as above. ``launch_runs`` returns each launch's own output (what the launch printed outside its
runs), for a caller to check. Without it, or under torchrun, a failing run ends the launch as
above.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import runpy
import socket
import subprocess
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

DRIVER = "tests/many_runs.py"


class Run(NamedTuple):
    """One recipe run: ``tune run <recipe> *args``, its output kept in ``folder``; ``env``
    holds variables set for this run alone (the launch's own are ``launch_runs``' argument)."""

    recipe: str  # a path relative to the repository, as given to tune run
    args: list[str]
    folder: Path
    env: dict[str, str] | None = None


def named_run(name: str, args: list[str], folder: Path) -> Run:
    """exactga's recipe ``name`` as ``tune run exactga/<name>`` starts it: its file, with the
    name recorded for the file that serves two of torchtune's names (a distributed one without
    torchrun runs as one rank; see [one recipe, two launches] in exactga.launch.twins)."""
    from tiny_runs import recipe_script

    from exactga.launch.twins import LAUNCHED_AS_ENV

    return Run(recipe_script(name), args, folder, {LAUNCHED_AS_ENV: name})


def run_of(args: Sequence[str], folder: Path) -> tuple[int, Run]:
    """The ranks (0: no torchrun) and the run of ``tune run *args``, whose only launcher
    option may be ``--nproc_per_node N``; its output is kept in ``folder``."""
    nproc = 0
    if args[0] == "--nproc_per_node":
        nproc, args = int(args[1]), args[2:]
    return nproc, Run(args[0], list(args[1:]), folder)


def launch_runs(
    runs: Sequence[Run],
    nproc: int = 2,
    timeout_per_run: float = 300,
    extra_env: dict[str, str] | None = None,
    go_on_after_failure: bool = False,
    nnodes: int = 1,
) -> list[str]:
    """Run every run of ``runs`` on ``nproc`` ranks (0: no torchrun), as few launches as
    possible; each run's folder gets ``output.txt`` and ``returncode``. With
    ``go_on_after_failure`` (``nproc=0`` only), a failing run does not end its launch. With
    ``nnodes`` 2 or more, a launch is that many ``tune run --nnodes N --nproc_per_node nproc``
    agents on this machine meeting through torchrun's c10d rendezvous on loopback (the
    multi-node launch path), ``nnodes * nproc`` ranks in all. Returns each launch's own output
    (outside its runs; the agents' one after another)."""
    from concurrent.futures import ThreadPoolExecutor

    from recipe_utils import output_of, run_tune  # host side only; the ranks never need it

    if go_on_after_failure and nproc:
        raise ValueError("go_on_after_failure needs nproc=0: under torchrun a peer would wait")
    if nnodes > 1 and not nproc:
        raise ValueError("nnodes needs nproc: each node's agent is torchrun's")
    ranks = max(nproc, 1) * nnodes
    pending = list(runs)
    for run in pending:
        run.folder.mkdir(parents=True, exist_ok=True)
    launch = 0
    launch_outputs = []
    while pending:
        plan = pending[0].folder / f"plan_{launch}.json"
        plan.write_text(
            json.dumps(
                {
                    "go_on_after_failure": go_on_after_failure,
                    "runs": [[r.recipe, r.args, str(r.folder), r.env or {}] for r in pending],
                }
            )
        )
        launcher = ["--nproc_per_node", str(nproc)] if nproc else []
        if nnodes > 1:
            launcher = ["--nnodes", str(nnodes), *launcher, *_rendezvous(plan)]

        def agent(_: int, args=(*launcher, DRIVER, "--config", str(plan))) -> tuple[str, int]:
            try:
                proc = run_tune(
                    list(args), extra_env=extra_env, timeout=timeout_per_run * len(pending)
                )
                return output_of(proc), proc.returncode
            except subprocess.TimeoutExpired as err:
                return f"launch timed out: {err}", -9

        with ThreadPoolExecutor(max_workers=nnodes) as pool:
            agents = list(pool.map(agent, range(nnodes)))
        launch_output = "\n".join(output for output, _ in agents)
        launch_status = next((status for _, status in agents if status), 0)
        launch_outputs.append(launch_output)
        while pending:
            run = pending.pop(0)
            statuses = [_read_status(run.folder, rank) for rank in range(ranks)]
            output = "\n".join(_read_log(run.folder, rank) for rank in range(ranks))
            if all(status == 0 for status in statuses):
                _finish(run.folder, output, 0)
                continue
            if go_on_after_failure and statuses[0] is not None:  # it failed; the launch went on
                _finish(run.folder, output, statuses[0])
                continue
            # The run that ended the launch: its failure is its own.
            failed = next((s for s in statuses if s not in (None, 0)), None)
            status = failed if failed is not None else (launch_status or 1)
            _finish(run.folder, f"{launch_output}\n--- the run's ranks ---\n{output}", status)
            break
        launch += 1
    return launch_outputs


def _rendezvous(plan: Path) -> list[str]:
    """torchrun's c10d rendezvous on a free loopback port, for the agents of one launch."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [
        *("--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"),
        *("--rdzv_id", f"many_runs_{plan.parent.name}_{plan.stem}"),
    ]


def _finish(folder: Path, output: str, status: int) -> None:
    (folder / "output.txt").write_text(output)
    (folder / "returncode").write_text(str(status))


def _write_status(folder: Path, rank: int, status: int) -> None:
    """Atomically: torchrun stops a rank whose peer failed, which may land between a plain
    write's truncation and its text, and an empty status file is no status at all."""
    partial = folder / f".exit{rank}.partial"
    partial.write_text(str(status))
    os.replace(partial, folder / f"exit{rank}")


def _read_status(folder: Path, rank: int) -> int | None:
    path = folder / f"exit{rank}"
    return int(path.read_text()) if path.exists() else None


def _read_log(folder: Path, rank: int) -> str:
    path = folder / f"rank{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


# --- in each rank ----------------------------------------------------------------------------


def _main() -> None:
    gc.freeze()  # the imports' objects, never garbage, left out of each run's collections
    plan = json.loads(Path(sys.argv[sys.argv.index("--config") + 1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    agent_store = _agent_store()
    go_on = plan["go_on_after_failure"] and agent_store is None  # no peer waits on a failure
    for index, (recipe, args, folder, env) in enumerate(plan["runs"]):
        if agent_store is not None:
            _own_rendezvous(agent_store, rank, index)
        launch_env = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        status = _run(recipe, args, Path(folder) / f"rank{rank}.log")
        for key, value in launch_env.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
        _write_status(Path(folder), rank, status)
        if status != 0 and not go_on:
            os._exit(status)  # torchrun ends the peer, which may wait in a collective


def _agent_store():
    """torchrun's store (its agent serves it), to agree on each run's rendezvous port."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)


def _own_rendezvous(agent_store, rank: int, index: int) -> None:
    """Point ``env://`` at a store of this run's own, served by rank 0 on a free port."""
    key = f"exactga_many_runs/{index}/port"
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        agent_store.set(key, str(port))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = agent_store.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


# A run whose env sets this times the skipped gradient-scaling pass with a steady clock: the
# real pass runs (its multiply by 1 must leave the weights as they are), and its time is the
# subset's element count in nanoseconds (a memory-bound pass), so every sample scales up to the
# same figure, STEADY_SAVED_MS_PER_ELEMENT per gradient element. On a busy machine the real
# samples may disagree, and the run then rightly withholds the figure ([saved latency on a busy
# machine]): a launch's test must not depend on that; tests/test_profiling.py times the real
# pass in-process and drives the figure with an injected clock.
STEADY_SCALING_PASS = "EXACTGA_TESTS_STEADY_SCALING_PASS"
STEADY_SAVED_MS_PER_ELEMENT = 1e-6


@contextlib.contextmanager
def _steady_scaling_pass():
    if not os.environ.get(STEADY_SCALING_PASS):
        yield
        return
    from exactga.profiling import saved_latency

    real = saved_latency.time_scaling_pass

    def steady(grads: list, device) -> float:
        real(grads, device)  # the multiply by 1 still runs; only its duration is replaced
        return STEADY_SAVED_MS_PER_ELEMENT * sum(g.numel() for g in grads)

    saved_latency.time_scaling_pass = steady
    try:
        yield
    finally:
        saved_latency.time_scaling_pass = real


# A run whose env sets this to N gets a SIGTERM from itself once step N ends, as a scheduler's
# preemption would send it: the real handler records it and the run stops at the step boundary
# after step N with its step checkpoint and stop line (see [stop at a step boundary] in
# exactga.launch.stopping), at a step a test can name, which a signal sent from outside cannot.
STOP_AFTER_STEP = "EXACTGA_TESTS_STOP_AFTER_STEP"


@contextlib.contextmanager
def _stop_after_step():
    if not os.environ.get(STOP_AFTER_STEP):
        yield
        return
    import signal

    from exactga.run.steps import StepBook

    stop_after = int(os.environ[STOP_AFTER_STEP])
    real = StepBook.end_step

    def end_step(self, *args, **kwargs):
        report = real(self, *args, **kwargs)
        if self.progress.global_step == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
        return report

    StepBook.end_step = end_step
    try:
        yield
    finally:
        StepBook.end_step = real


def _reset_dynamo() -> None:
    """torch.compile's caches as a fresh process has them; a launch that never imported dynamo
    (importing it costs over a second) has none to reset."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


def _run(recipe: str, args: list[str], log_path: Path) -> int:
    """``python -m recipes.<name> *args`` in this interpreter; the exit status."""
    from torchtune.utils._logging import log_once

    module = recipe.removesuffix(".py").replace("/", ".")
    log_once.cache_clear()
    _reset_dynamo()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    argv, cwd = sys.argv, os.getcwd()
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            sys.argv = [recipe, *args]
            with warnings.catch_warnings(), _steady_scaling_pass(), _stop_after_step():
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as exit_:
            code = exit_.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            sys.argv = argv
            os.chdir(cwd)
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return status


if __name__ == "__main__":
    _main()
