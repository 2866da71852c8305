"""Gradient-accumulation parity: stock torchtune 0.6.1 recipe versus exactga's drop-in.

For each ``dataset.train_on_input`` in {False, True} and optimizer in {SGD, AdamW}, trains 12
optimizer steps on the tiny default config (a smaller model, no clipping) twice, as batch size
8 with no accumulation (8x1) and as batch size 1 accumulated over 8 micro-batches (1x8), once
with torchtune's built-in ``full_finetune_single_device`` and once with
``recipes/full_finetune.py``. Every run is a real ``tune run`` subprocess in its
own output folder and starts from the same seeded checkpoint. It prints a markdown table of

    rel-L2 = ||w_8x1 - w_1x8|| / ||w_8x1 - w_init||

over all weights after the last step: about fp32 round-off when accumulation is exact. Wall
times are printed as a side note only; this is not a speed benchmark.

Run from the repository root (about 16 runs of 10-20 s each on 2 CPU cores)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/ga_parity_stock_vs_exactga.py

``--train-on-input false`` / ``--optimizer adamw`` restrict the grid; ``--out DIR`` keeps the
run folders (default: a temporary folder, deleted afterwards).
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny/full_single_device.yaml"
OUR_RECIPE = "recipes/full_finetune.py"
STOCK_RECIPE = "full_finetune_single_device"
NUM_STEPS = 12
WINDOW = 8  # samples per optimizer step: 8x1 and 1x8 see the same ones
SMALL_MODEL = [
    "model.num_layers=2",
    "model.embed_dim=64",
    "model.intermediate_dim=128",
    "model.num_heads=4",
    "model.num_kv_heads=2",
]
# SGD takes a large lr and no weight decay: with the config's lr of 1e-3 the 12 updates are so
# small next to the weights that fp32 storage rounding alone gives ~2e-5 between any two runs.
OPTIMIZERS = {
    "sgd": ["optimizer._component_=torch.optim.SGD", "optimizer.lr=0.5", "~optimizer.weight_decay"],
    "adamw": ["optimizer._component_=torch.optim.AdamW"],
}
RECIPES = {"stock": STOCK_RECIPE, "exactga": OUR_RECIPE}
SPLITS = {"8x1": (WINDOW, 1), "1x8": (1, WINDOW)}
WEIGHTS_FILE = "epoch_0/model-00001-of-00001.safetensors"
INIT_FILE = "base_model/model.safetensors"


@dataclass(frozen=True)
class Run:
    """One training run of the grid."""

    recipe: str  # key of RECIPES
    train_on_input: bool
    optimizer: str  # key of OPTIMIZERS
    split: str  # key of SPLITS

    @property
    def name(self) -> str:
        return f"{self.recipe}-toi{int(self.train_on_input)}-{self.optimizer}-{self.split}"


def tune_command(run: Run, output_dir: Path) -> list[str]:
    """The ``tune run`` command line of ``run``, writing under ``output_dir``."""
    batch_size, ga = SPLITS[run.split]
    tune = Path(sys.executable).with_name("tune")
    return [
        str(tune),
        "run",
        RECIPES[run.recipe],
        "--config",
        CONFIG,
        f"output_dir={output_dir}",
        *SMALL_MODEL,
        f"dataset.train_on_input={run.train_on_input}",
        *OPTIMIZERS[run.optimizer],
        f"batch_size={batch_size}",
        f"gradient_accumulation_steps={ga}",
        f"max_steps_per_epoch={NUM_STEPS}",
        "clip_grad_norm=null",
    ]


def launch(run: Run, output_dir: Path) -> float:
    """Train ``run`` in a subprocess from the repository root; returns its wall time (s)."""
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        tune_command(run, output_dir), cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{run.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall_s


def load_flat(path: Path) -> torch.Tensor:
    """All weights of a safetensors file as one fp64 vector, in sorted key order."""
    state = load_file(str(path))
    return torch.cat([state[key].double().flatten() for key in sorted(state)])


def rel_l2(final_a: torch.Tensor, final_b: torch.Tensor, init: torch.Tensor) -> float:
    """``||a - b|| / ||a - init||``: the gap between two runs relative to how far they moved."""
    return float((final_a - final_b).norm() / (final_a - init).norm())


def parity(out_root: Path, recipe: str, train_on_input: bool, optimizer: str) -> float:
    """rel-L2 between the 8x1 and 1x8 runs of one recipe and grid cell."""
    dirs = {s: out_root / Run(recipe, train_on_input, optimizer, s).name for s in SPLITS}
    init = load_flat(dirs["8x1"] / INIT_FILE)
    full, accumulated = (load_flat(dirs[s] / WEIGHTS_FILE) for s in ("8x1", "1x8"))
    return rel_l2(full, accumulated, init)


def cross_recipe_8x1(out_root: Path, train_on_input: bool, optimizer: str) -> float:
    """rel-L2 between stock and exactga at 8x1, where both should agree up to round-off."""
    dirs = {r: out_root / Run(r, train_on_input, optimizer, "8x1").name for r in RECIPES}
    init = load_flat(dirs["stock"] / INIT_FILE)
    stock, ours = (load_flat(dirs[r] / WEIGHTS_FILE) for r in ("stock", "exactga"))
    return rel_l2(stock, ours, init)


def format_table(out_root: Path, cells: list[tuple[bool, str]]) -> str:
    """The markdown parity table, one row per (train_on_input, optimizer)."""
    lines = [
        "| train_on_input | optimizer | stock rel-L2 (8×1 vs 1×8) | exactga rel-L2 | ratio |",
        "|---|---|---|---|---|",
    ]
    for train_on_input, optimizer in cells:
        stock = parity(out_root, "stock", train_on_input, optimizer)
        ours = parity(out_root, "exactga", train_on_input, optimizer)
        ratio = f"{stock / ours:.3g}" if ours > 0 else "inf"
        name = "SGD" if optimizer == "sgd" else "AdamW"
        lines.append(f"| {train_on_input} | {name} | {stock:.3e} | {ours:.3e} | {ratio} |")
    return "\n".join(lines)


def format_notes(out_root: Path, cells: list[tuple[bool, str]], wall: dict[Run, float]) -> str:
    """Setting, the stock-vs-exactga 8x1 sanity check, and wall times (a side note)."""
    lines = [
        "",
        f"Setting: {CONFIG} with {' '.join(SMALL_MODEL)}, {NUM_STEPS} optimizer steps of "
        f"{WINDOW} samples, clip_grad_norm=null; AdamW as in the config, SGD with lr 0.5 and "
        "no weight decay. The stock "
        "recipe ran on CPU with no extra override (it turns log_peak_memory_stats off on CPU "
        "itself). ratio = stock / exactga.",
        "",
        "Sanity check, stock vs exactga at 8×1 (no accumulation, should be round-off):",
    ]
    for train_on_input, optimizer in cells:
        gap = cross_recipe_8x1(out_root, train_on_input, optimizer)
        lines.append(f"  train_on_input={train_on_input} {optimizer}: rel-L2 {gap:.3e}")
    totals = {r: sum(t for run, t in wall.items() if run.recipe == r) for r in RECIPES}
    num_runs = {r: sum(run.recipe == r for run in wall) for r in RECIPES}
    lines.append("")
    lines.append(
        "Wall time (side note, not a speed claim; includes ~8 s tune start-up per run): "
        + ", ".join(f"{r} {totals[r]:.1f} s over {num_runs[r]} runs" for r in RECIPES)
    )
    return "\n".join(lines)


def run_grid(out_root: Path, cells: list[tuple[bool, str]]) -> dict[Run, float]:
    """Train every run of the grid; returns each run's wall time."""
    wall = {}
    for (train_on_input, optimizer), recipe, split in itertools.product(cells, RECIPES, SPLITS):
        run = Run(recipe, train_on_input, optimizer, split)
        wall[run] = launch(run, out_root / run.name)
        print(f"{run.name}: {wall[run]:.1f} s", file=sys.stderr, flush=True)
    return wall


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--train-on-input",
        choices=["false", "true", "both"],
        default="both",
        help="which dataset.train_on_input values to run (default: both)",
    )
    parser.add_argument(
        "--optimizer",
        choices=[*OPTIMIZERS, "both"],
        default="both",
        help="which optimizers to run (default: both)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="keep run folders here (default: a temp folder)"
    )
    return parser.parse_args(argv)


def grid_cells(args: argparse.Namespace) -> list[tuple[bool, str]]:
    """The (train_on_input, optimizer) pairs selected on the command line."""
    toi = [False, True] if args.train_on_input == "both" else [args.train_on_input == "true"]
    optimizers = list(OPTIMIZERS) if args.optimizer == "both" else [args.optimizer]
    return list(itertools.product(toi, optimizers))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cells = grid_cells(args)
    with tempfile.TemporaryDirectory(prefix="ga_parity_") as tmp:
        out_root = (args.out or Path(tmp)).resolve()
        out_root.mkdir(parents=True, exist_ok=True)
        wall = run_grid(out_root, cells)
        print(format_table(out_root, cells))
        print(format_notes(out_root, cells, wall))


if __name__ == "__main__":
    main()
