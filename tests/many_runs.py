"""Several recipe runs for one test module, each as ``tune run`` would start it, one after another.

A run is ``tune run [--nproc_per_node N] <recipe> *args`` with its output kept in its folder:
``output.txt`` (its ranks' stdout and stderr) and ``returncode``, as one launch would leave them.
``launch_runs`` starts each through tests/launcher.py (its ranks forked from a server that made
the imports once) and returns once all have ended: a failing run fails nothing else, and its
folder holds its own status and output.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from launcher import REPO_ROOT, run_recipe
from tiny_runs import output_of, tune_env


class Run(NamedTuple):
    """One recipe run: ``tune run <recipe> *args``, its output kept in ``folder``; ``env``
    holds variables set for this run alone (the launch's own are ``launch_runs``' argument)."""

    recipe: str  # a path relative to the repository, or a name, as given to tune run
    args: list[str]
    folder: Path
    env: dict[str, str] | None = None


def named_run(name: str, args: list[str], folder: Path) -> Run:
    """exactga's recipe ``name`` as ``tune run exactga/<name>`` starts it."""
    return Run(f"exactga/{name}", args, folder)


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
) -> None:
    """Run every run of ``runs`` on ``nproc`` ranks (0: no torchrun), one after another; each
    run's folder gets ``output.txt`` and ``returncode``."""
    for run in runs:
        run.folder.mkdir(parents=True, exist_ok=True)
        args = [*(["--nproc_per_node", str(nproc)] if nproc else []), run.recipe, *run.args]
        env = tune_env({**(extra_env or {}), **(run.env or {})})
        try:
            proc = run_recipe(args, REPO_ROOT, env, timeout=timeout_per_run)
            output, status = output_of(proc), proc.returncode
        except subprocess.TimeoutExpired as err:
            output, status = f"the run timed out: {err}", -9
        (run.folder / "output.txt").write_text(output)
        (run.folder / "returncode").write_text(str(status))
