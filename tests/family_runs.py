"""The runs of the two Qwen3 and Gemma 3 modules, shared (issue #41).

tests/test_family_config_sweep.py (every config of the families on tiny shapes) and
tests/test_recipe_model_families.py (exact splits and outputs transformers and PEFT load) each
plan their runs; here they are made together, once per session (``run_once``): the one-process
runs one after another, the 2-rank runs one after another beside them, each run forked from
the tests' server (tests/many_runs.py: still the recipe as ``tune run`` starts it). The two modules
are one xdist group, so one worker makes them. Nothing here is a test.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from many_runs import launch_runs

GROUP = "family_runs"  # the xdist group of both modules' tests that read these runs


def family_runs(run_once, module: str) -> Path:
    """The folder of ``module``'s runs (``"sweep"`` or ``"families"``)."""
    return run_once("family_runs", _launch_all) / module


def _launch_all(root: Path) -> None:
    from test_family_config_sweep import planned_runs as sweep_runs
    from test_recipe_model_families import planned_runs as family_model_runs

    one, two = [], []
    for plan in (sweep_runs(root / "sweep"), family_model_runs(root / "families")):
        one += plan[0]
        two += plan[1]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(launch_runs, two, nproc=2), pool.submit(launch_runs, one, nproc=0)]
        for future in futures:
            future.result()
