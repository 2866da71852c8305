"""Golden loss curves: the per-step loss of one short, fixed run of each training recipe.

docs/contributing.md point 9c, after torchtitan's ``tests/assets/losses/``. For every training
recipe, the file ``<name>.json`` next to this script holds the loss of each optimizer step of one
run of its tiny config (``configs/tiny/<name>.yaml``), written at full precision (the float the
recipe logged, through torchtune's ``DiskLogger``, which prints it with ``repr``). The run is the
config as shipped (seed, data order, optimizer, warm-up, clipping, accumulation split) except for:

- the model, shrunk to the tests' ``SMALL_MODEL`` (``tests/recipe_utils.py``) so a step costs
  milliseconds, and for knowledge distillation the teacher to ``SMALL_TEACHER``
  (``tests/kd_utils.py``), twice as wide;
- ``max_steps_per_epoch``: ``STEPS`` optimizer steps (the 5 warm-up steps and 3 after);
- the metric logger (``DiskLogger`` instead of TensorBoard, which stores float32).

The distributed recipes run on 2 gloo ranks (``tune run --nproc_per_node 2``), with one intra-op
thread per process like every test launch (``tune_env``). ``tests/test_golden_losses.py``
launches exactly these runs (it imports them from here) and compares them
with the files.

Usage, from the repository root::

    .venv/bin/python tests/assets/losses/regenerate.py                # rewrite every curve
    .venv/bin/python tests/assets/losses/regenerate.py full_distributed   # only these curves
    .venv/bin/python tests/assets/losses/regenerate.py --check        # compare, write nothing

``--check`` launches the runs and prints, per curve, the largest absolute difference from the
file (0 means bit-identical); it exits 1 unless every curve is bit-identical. A refactor that
must not change numbers shows that output (docs/contributing.md point 11). Regenerate the files
only for a change that is meant to change the losses (a new default, another adapter
initialisation), and show the old and new curve in that change. The files also record the torch
version and the CPU instruction set they were made with: a different one may move the last digits
(the test's tolerance allows for that; ``--check`` will show it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]
for folder in (TESTS, TESTS.parent / "tools"):  # run as a script: as pytest's sys.path
    if str(folder) not in sys.path:  # (tests/recipe_utils.py imports tools/tiny_runs.py)
        sys.path.insert(0, str(folder))

from kd_utils import SMALL_TEACHER  # noqa: E402
from recipe_utils import SMALL_MODEL, output_of, run_tune  # noqa: E402

STEPS = 8
# name (also the config's and the data file's): (recipe, number of processes)
RUNS = {
    "full_single_device": ("recipes/full_finetune.py", 1),
    "lora_single_device": ("recipes/lora_finetune.py", 1),
    "full_distributed": ("recipes/full_finetune.py", 2),
    "lora_distributed": ("recipes/lora_finetune.py", 2),
    "kd_single_device": ("recipes/knowledge_distillation.py", 1),
    "kd_distributed": ("recipes/knowledge_distillation.py", 2),
}
OVERRIDES = {
    **SMALL_MODEL,
    "max_steps_per_epoch": STEPS,
    "metric_logger._component_": "torchtune.training.metric_logging.DiskLogger",
}
# Overrides of one run only, after OVERRIDES: the distillation runs' teacher.
RUN_OVERRIDES = {
    "kd_single_device": SMALL_TEACHER,
    "kd_distributed": SMALL_TEACHER,
}


def overrides_of(name: str) -> dict[str, object]:
    """The config keys run ``name`` sets on the command line."""
    return {**OVERRIDES, **RUN_OVERRIDES.get(name, {})}


def curve_path(name: str) -> Path:
    return HERE / f"{name}.json"


def launch_args(name: str, output_dir: Path) -> list[str]:
    """The ``tune run`` arguments of run ``name``, writing under ``output_dir``."""
    recipe, nproc = RUNS[name]
    head = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    overrides = [f"{key}={value}" for key, value in overrides_of(name).items()]
    config = f"configs/tiny/{name}.yaml"
    return [*head, recipe, "--config", config, *overrides, f"output_dir={output_dir}"]


def read_losses(log_dir: Path) -> list[float]:
    """The ``loss`` of every step in a ``DiskLogger`` file (``Step 3 | loss:7.61 lr:...``)."""
    (log_file,) = log_dir.glob("log_*.txt")
    losses: dict[int, float] = {}
    for line in log_file.read_text().splitlines():
        step, _, metrics = line.removeprefix("Step ").partition(" | ")
        for item in metrics.split():
            key, _, value = item.partition(":")
            if key == "loss":
                losses[int(step)] = float(value)
    assert sorted(losses) == list(range(1, len(losses) + 1)), f"steps logged: {sorted(losses)}"
    return [losses[step] for step in sorted(losses)]


def run_curve(name: str, output_dir: Path) -> list[float]:
    """Launch run ``name`` into ``output_dir`` and return its per-step losses."""
    proc = run_tune(launch_args(name, output_dir), timeout=600)
    assert proc.returncode == 0, f"{name}:\n{output_of(proc)[-4000:]}"
    losses = read_losses(output_dir / "logs")
    assert len(losses) == STEPS, f"{name}: {len(losses)} steps logged, {STEPS} expected"
    return losses


def run_all(names: list[str], root: Path, jobs: int = 2) -> dict[str, list[float]]:
    """Run ``names`` into ``root/<name>``, ``jobs`` launches at a time."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {name: pool.submit(run_curve, name, root / name) for name in names}
        return {name: future.result() for name, future in futures.items()}


def recorded(name: str) -> dict:
    """The data file of run ``name``."""
    return json.loads(curve_path(name).read_text())


def run_settings(name: str) -> dict:
    """What defines run ``name``, as recorded in its file (a change here needs new files)."""
    recipe, nproc = RUNS[name]
    return {
        "recipe": recipe,
        "config": f"configs/tiny/{name}.yaml",
        "nproc_per_node": nproc,
        "overrides": {key: str(value) for key, value in overrides_of(name).items()},
    }


def write_curve(name: str, losses: list[float]) -> None:
    import torch

    data = {
        **run_settings(name),
        "made_with": {
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "intra_op_threads": 1,
        },
        "loss": losses,
    }
    curve_path(name).write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(RUNS)} (default: all)")
    parser.add_argument(
        "--check", action="store_true", help="print the difference from the files; write nothing"
    )
    parser.add_argument("--jobs", type=int, default=2, help="launches at a time (default 2)")
    args = parser.parse_args(argv)
    names = args.names or list(RUNS)
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown run {', '.join(unknown)}; the runs are {', '.join(RUNS)}")

    with tempfile.TemporaryDirectory(prefix="golden-losses-") as root:
        curves = run_all(names, Path(root), args.jobs)

    identical = True
    for name, losses in curves.items():
        if not args.check:
            write_curve(name, losses)
            print(f"{name}: wrote {curve_path(name)} (loss {losses[0]:.6f} -> {losses[-1]:.6f})")
            continue
        old = recorded(name)
        same_run = {key: old.get(key) for key in run_settings(name)} == run_settings(name)
        if len(old["loss"]) == len(losses):
            diff = max(abs(a - b) for a, b in zip(losses, old["loss"], strict=True))
        else:
            diff = float("inf")
        identical &= diff == 0 and same_run
        note = "" if same_run else " (the file was made with other run settings: regenerate)"
        print(f"{name}: max abs difference {diff:.3e} over {len(losses)} steps{note}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
