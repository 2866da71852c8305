"""What the tests, the benchmarks and the tools share to launch a tiny run and read it: the
small-model overrides, a plain ``tune run`` launch (a fresh process; the tests launch through
their own faster launcher, tests/recipe_utils.py, which takes its environment from here) and
the values a run logged, per step.

Nothing here imports a test module: tests import this file (``pythonpath = ["tools"]`` in
pyproject.toml), never the other way round.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from exactga.launch.registry import recipe_entry

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


def recipe_script(name: str) -> str:
    """The file ``tune run`` launches by path for exactga's recipe ``name``, from the repository
    root: ``recipes/<file>.py`` (torchtune's two names of a family share one file)."""
    entry = recipe_entry(name)
    return f"recipes/{entry.recipe_file if entry is not None else name}.py"


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


def logged_steps(log_root: Path | str, tag: str = "loss") -> dict[int, float]:
    """``{step: value}`` of every ``tag`` logged under ``log_root`` (or in that one event file),
    from TensorBoard events or ``DiskLogger`` text files (``Step 3 | loss:7.61 lr:...``),
    whichever the run wrote.

    :func:`read_scalars` drops the steps; a resumed run logging into a folder of its own shows
    here which steps it trained, which is what tells resuming from retraining from step 0.
    """
    root = Path(log_root)
    events: list[tuple[int, float]] = []
    # A folder, or one launch's event file.
    event_files = [root] if root.is_file() else sorted(root.rglob("events.out.tfevents.*"))
    for log_file in sorted(root.rglob("log_*.txt")) if root.is_dir() else []:
        for line in log_file.read_text().splitlines():
            step, _, metrics = line.removeprefix("Step ").partition(" | ")
            for item in metrics.split():
                key, _, value = item.partition(":")
                if key == tag:
                    events.append((int(step), float(value)))
    if event_files:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.util.tensor_util import make_ndarray

    for event_file in event_files:
        ea = EventAccumulator(str(event_file), size_guidance={"tensors": 0, "scalars": 0})
        ea.Reload()
        tags = ea.Tags()
        if tag in tags.get("tensors", []):
            events += [
                (e.step, float(make_ndarray(e.tensor_proto).reshape(-1)[0]))
                for e in ea.Tensors(tag)
            ]
        if tag in tags.get("scalars", []):
            events += [(e.step, float(e.value)) for e in ea.Scalars(tag)]
    steps = [step for step, _ in events]
    assert len(set(steps)) == len(steps), f"a step logged twice under {root}: {sorted(steps)}"
    return dict(sorted(events))
