"""What the tests, the benchmarks and the tools share to launch a tiny run: the small-model
overrides and a plain ``tune run`` launch (a fresh process; the tests launch through their own
faster launcher, tests/recipe_utils.py, which takes its environment from here).

Nothing here imports a test module: tests import this file (``pythonpath = ["tools"]`` in
pyproject.toml), never the other way round.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TUNE = Path(sys.executable).parent / "tune"

# The tiny config's architecture shrunk further so a step costs milliseconds on CPU.
SMALL_MODEL = {
    "model.num_layers": 2,
    "model.embed_dim": 64,
    "model.intermediate_dim": 128,
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
}

# The knowledge-distillation teacher: the student's sizes, twice as wide.
SMALL_TEACHER = {
    "teacher_model.num_layers": 2,
    "teacher_model.embed_dim": 128,
    "teacher_model.num_heads": 4,
    "teacher_model.num_kv_heads": 2,
    "teacher_model.intermediate_dim": 256,
}


def tune_env(extra_env: dict[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a launch: offline, unbuffered, one intra-op thread unless set.

    Launches run side by side (``pytest -n 2``, a sweep's two at a time); a tiny model gains
    nothing from more threads, and oversubscribed cores made each launch about twice as slow.
    """
    env = dict(os.environ)
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in (extra_env or {}).items():  # None: leave the variable unset
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_tune(
    args: list[str],
    cwd: Path | str = REPO_ROOT,
    extra_env: dict[str, str | None] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``tune run *args`` in a fresh process from ``cwd``, stdout and stderr captured as text."""
    return subprocess.run(
        [str(TUNE), "run", *args],
        cwd=cwd,
        env=tune_env(extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def output_of(proc: subprocess.CompletedProcess) -> str:
    """Both streams of a launch, for assertions and failure messages."""
    return f"{proc.stdout}\n{proc.stderr}"
