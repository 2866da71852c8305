"""Knowledge-distillation accumulation parity: stock torchtune 0.6.1 recipe versus exactga's.

For ``dataset.train_on_input`` in {False, True}, distils the tiny teacher into the tiny LoRA
student (configs/tiny/kd_single_device.yaml, a smaller student and a teacher twice its width,
fp32, AdamW, no clipping) for 12 optimizer steps as 8x1, 1x8 and 2x4 (batch size x
accumulation), once with torchtune's built-in ``knowledge_distillation_single_device`` and once
with ``recipes/knowledge_distillation.py``, on the same data in the same order,
and from each recipe's own initial adapters (a one-step run at learning rate 0). Every run is a
real ``tune run`` subprocess. It prints a markdown table of

    rel-L2 = ||a_split - a_8x1|| / ||a_8x1 - a_init||

over the student's adapters after the last step: fp32 round-off when accumulation is exact.

Run from the repository root (32 runs of 5-10 s each, two at a time)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/kd_stock_vs_exactga.py

``--out DIR`` keeps the run folders (default: a temporary folder, deleted afterwards).
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "src"))
from exactga.parity.scoring import relative_l2  # noqa: E402

CONFIG = "configs/tiny/kd_single_device.yaml"
RECIPES = {
    "stock 0.6.1": "knowledge_distillation_single_device",
    "exactga": "recipes/knowledge_distillation.py",
}
SPLITS = {"8x1": (8, 1), "1x8": (1, 8), "2x4": (2, 4)}
COMMON = [
    "model.num_layers=2",
    "model.embed_dim=64",
    "model.intermediate_dim=128",
    "teacher_model.num_layers=2",
    "teacher_model.embed_dim=128",
    "teacher_model.num_heads=4",
    "teacher_model.intermediate_dim=256",
    "max_steps_per_epoch=12",
    "clip_grad_norm=null",
    "optimizer.lr=3e-3",
    "lr_scheduler.num_warmup_steps=2",
    # stock's fixed micro-batches, so both recipes see the same samples in the same order
    "micro_batching=fixed",
    "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
]
ADAPTERS = "epoch_0/adapter_model.pt"


def launch(recipe: str, out: Path, split: tuple[int, int], extra: list[str]) -> Path:
    args = [str(Path(sys.executable).parent / "tune"), "run", RECIPES[recipe], "--config", CONFIG]
    args += [*COMMON, f"output_dir={out}", f"batch_size={split[0]}"]
    args += [f"gradient_accumulation_steps={split[1]}", *extra]
    if recipe == "stock 0.6.1":  # keys stock does not read would be harmless, but say so
        args = [a for a in args if not a.startswith("micro_batching=")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{recipe} {out.name} failed:\n{proc.stderr[-3000:]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()
    root = opts.out or Path(tempfile.mkdtemp(prefix="kd_parity_"))
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for recipe, toi in itertools.product(RECIPES, (False, True)):
            extra = [f"dataset.train_on_input={toi}"]
            tag = f"{'stock' if recipe != 'exactga' else 'exactga'}-toi{int(toi)}"
            for name, split in SPLITS.items():
                jobs[(recipe, toi, name)] = pool.submit(
                    launch, recipe, root / f"{tag}-{name}", split, extra
                )
            init_extra = [*extra, "optimizer.lr=0", "max_steps_per_epoch=1"]
            jobs[(recipe, toi, "init")] = pool.submit(
                launch, recipe, root / f"{tag}-init", (8, 1), init_extra
            )
        done = {key: future.result() for key, future in jobs.items()}

    def adapters(key) -> dict[str, torch.Tensor]:
        return torch.load(done[key] / ADAPTERS, map_location="cpu", weights_only=True)

    print("| train_on_input | split vs 8x1 | stock 0.6.1 rel-L2 | exactga rel-L2 |")
    print("|---|---|---|---|")
    for toi in (False, True):
        for name in ("1x8", "2x4"):
            cells = []
            for recipe in RECIPES:
                ref, init = adapters((recipe, toi, "8x1")), adapters((recipe, toi, "init"))
                cells.append(f"{relative_l2(adapters((recipe, toi, name)), ref, init):.2e}")
            print(f"| {toi} | {name} | {cells[0]} | {cells[1]} |")
    if opts.out is None:
        subprocess.run(["rm", "-rf", str(root)], check=False)


if __name__ == "__main__":
    main()
