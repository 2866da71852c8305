"""Per-step time: stock torchtune 0.6.1 recipe versus exactga's drop-in, on the same config.

Launches ``tune run full_finetune_single_device --config <yaml>`` (stock) and
``tune run recipes/full_finetune.py --config <yaml>`` (exactga) as real
subprocesses, alternating (the order flips every repeat: stock, exactga, exactga, stock, ...),
each in its own output folder and from the same seeded checkpoint. Both recipes log the
``loss`` scalar to TensorBoard at every step (the config's ``log_every_n_steps`` must be 1);
the per-step time of a run is ``(t_last - t_first) / (n - 1)`` over the event wall-times of
steps 3..n (the first 2 steps are warm-up), so start-up, data loading set-up and checkpoint
saving are left out. Prints a table of every run, the median per recipe and the ratio.

Run from the repository root (default: the tiny config, 20 steps, 2 repeats per recipe; about
3.5 minutes of CPU time, 13 minutes of wall time on 2 shared cores at a load average of 7-9)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/stock_vs_exactga_speed.py

``--max-steps``, ``--batch-size``, ``--ga``, ``--repeats``, ``--omp-threads`` (default 1) and
``--set KEY=VALUE`` (more overrides, both recipes) change the setting; ``--out DIR`` keeps the
run folders.

Both recipes run the config unchanged (exactga's own keys, ``loss_normalization``,
``log_timings``, ``saved_latency_every_n_steps``, ``peak_flops``, ... are top-level keys the stock
recipe never reads). exactga's profiler hook therefore times the stock gradient pass on its
sampled steps (step 2 and every ``saved_latency_every_n_steps``, by default 10), which makes those
steps slower by about that pass; ``--set saved_latency_every_n_steps=0`` turns the sampling off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "stock": "full_finetune_single_device",
    "exactga": "recipes/full_finetune.py",
}
WARMUP_STEPS = 2


def tune_command(recipe: str, args: argparse.Namespace, output_dir: Path) -> list[str]:
    """The ``tune run`` command line of one run."""
    tune = Path(sys.executable).with_name("tune")
    overrides = [
        f"output_dir={output_dir}",
        f"max_steps_per_epoch={args.max_steps}",
        "log_every_n_steps=1",
        *args.set,
    ]
    if args.batch_size is not None:
        overrides.append(f"batch_size={args.batch_size}")
    if args.ga is not None:
        overrides.append(f"gradient_accumulation_steps={args.ga}")
    return [str(tune), "run", RECIPES[recipe], "--config", args.config, *overrides]


def launch(recipe: str, args: argparse.Namespace, output_dir: Path) -> float:
    """Train in a subprocess; returns the whole run's wall time in seconds."""
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(args.omp_threads),
        "PYTHONUNBUFFERED": "1",
    }
    start = time.perf_counter()
    proc = subprocess.run(
        tune_command(recipe, args, output_dir),
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{recipe} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall_s


def loss_wall_times(output_dir: Path) -> list[tuple[int, float]]:
    """(step, wall time) of every logged ``loss`` event under ``output_dir``, in step order."""
    event_files = sorted(output_dir.rglob("events.out.tfevents.*"))
    if not event_files:
        raise FileNotFoundError(f"no TensorBoard events under {output_dir}")
    points = []
    for event_file in event_files:
        ea = EventAccumulator(str(event_file), size_guidance={"tensors": 0})
        ea.Reload()
        if "loss" in ea.Tags().get("tensors", []):
            points += [(e.step, e.wall_time) for e in ea.Tensors("loss")]
    return sorted(points)


def per_step_ms(points: list[tuple[int, float]]) -> tuple[float, int]:
    """Mean step time over the steps after warm-up, and how many steps it spans."""
    kept = [t for step, t in points if step > WARMUP_STEPS]
    if len(kept) < 2:
        raise ValueError(f"only {len(kept)} logged steps after warm-up; raise --max-steps")
    return (kept[-1] - kept[0]) * 1e3 / (len(kept) - 1), len(kept)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny/full_single_device.yaml")
    parser.add_argument("--max-steps", type=int, default=20, help="max_steps_per_epoch")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the config's")
    parser.add_argument("--ga", type=int, default=None, help="default: the config's")
    parser.add_argument("--repeats", type=int, default=2, help="runs per recipe")
    parser.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of runs")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra override"
    )
    parser.add_argument("--out", type=Path, default=None, help="keep run folders here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows: list[tuple[str, int, float, int, float]] = []
    with tempfile.TemporaryDirectory(prefix="speed_") as tmp:
        out_root = (args.out or Path(tmp)).resolve()
        for repeat in range(args.repeats):
            order = list(RECIPES) if repeat % 2 == 0 else list(reversed(RECIPES))
            for recipe in order:
                output_dir = out_root / f"{recipe}-{repeat}"
                wall_s = launch(recipe, args, output_dir)
                step_ms, num_steps = per_step_ms(loss_wall_times(output_dir / "logs"))
                rows.append((recipe, repeat, step_ms, num_steps, wall_s))
                print(f"{recipe} #{repeat}: {step_ms:.1f} ms/step", file=sys.stderr, flush=True)
    setting = " ".join(
        [f"--config {args.config}", f"max_steps_per_epoch={args.max_steps}"]
        + ([f"batch_size={args.batch_size}"] if args.batch_size is not None else [])
        + ([f"gradient_accumulation_steps={args.ga}"] if args.ga is not None else [])
        + args.set
    )
    print(f"# stock_vs_exactga_speed: {setting}; OMP_NUM_THREADS={args.omp_threads}")
    print("| run | recipe | ms/step (steps 3..n) | steps timed | run wall s |")
    print("|---|---|---|---|---|")
    for index, (recipe, repeat, step_ms, num_steps, wall_s) in enumerate(rows):
        print(f"| {index + 1} | {recipe} #{repeat} | {step_ms:.1f} | {num_steps} | {wall_s:.1f} |")
    medians = {
        recipe: statistics.median(r[2] for r in rows if r[0] == recipe) for recipe in RECIPES
    }
    print("")
    print(
        f"median ms/step: stock {medians['stock']:.1f}, exactga {medians['exactga']:.1f}; "
        f"ratio exactga / stock = {medians['exactga'] / medians['stock']:.3f}"
    )


if __name__ == "__main__":
    main()
