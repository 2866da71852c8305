"""Unsloth's gradient-accumulation check, for LoRA, on the bundled data.

Unsloth compared the LoRA weights trained with batch size 16 and no accumulation against batch
size 1 accumulated over 16 micro-batches, by the L2 norm of their difference (blog post in
docs/math.md §9). This script does the same through ``recipes/lora_finetune.py``
(a real ``tune run`` per run) for each ``loss_normalization`` mode:

    naive       mean of micro-batch means / ga (the pre-fix Hugging Face Trainer)
    post_scale  stock torchtune 0.6.1 (token count before the label shift, grads scaled after)
    exact       exactga

and prints, side by side, ``||a_16x1 - a_1x16||`` (absolute, as Unsloth reported it) and the same
divided by ``||a_16x1 - a_init||`` over all adapter weights. Setting: configs/tiny/
lora_single_device.yaml with the small-model overrides of the tests, ``train_on_input`` True,
SGD, no clipping, no warm-up, ``--steps`` optimizer steps of 16 samples.

Run from the repository root (7 runs; a few minutes on 2 CPU cores)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/unsloth_lora_l2.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/lora_finetune.py"
CONFIG = "configs/tiny/lora_single_device.yaml"
MODES = ("naive", "post_scale", "exact")
SPLITS = {"16x1": (16, 1), "1x16": (1, 16)}
ADAPTERS = "epoch_0/adapter_model.pt"
SETTINGS = [
    "model.num_layers=2",
    "model.embed_dim=64",
    "model.intermediate_dim=128",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "optimizer._component_=torch.optim.SGD",
    "~optimizer.weight_decay",
    "clip_grad_norm=null",
    "lr_scheduler.num_warmup_steps=0",
    "dataset.train_on_input=True",
]


def train(output_dir: Path, mode: str, batch_size: int, ga: int, steps: int, lr: float) -> Path:
    """One ``tune run``; returns the adapter checkpoint it wrote."""
    tune = Path(sys.executable).with_name("tune")
    cmd = [
        str(tune), "run", RECIPE, "--config", CONFIG, *SETTINGS,
        f"output_dir={output_dir}", f"loss_normalization={mode}", "micro_batching=fixed",
        f"batch_size={batch_size}",
        f"gradient_accumulation_steps={ga}", f"max_steps_per_epoch={steps}", f"optimizer.lr={lr}",
    ]  # fmt: skip
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return output_dir / ADAPTERS


def norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        init_path = train(root / "init", "exact", 16, 1, 1, 0.0)  # lr 0: the seeded init
        init = torch.load(init_path, weights_only=True)
        rows = []
        for mode in MODES:
            a = {
                split: torch.load(
                    train(root / f"{mode}-{split}", mode, bs, ga, args.steps, args.lr),
                    weights_only=True,
                )
                for split, (bs, ga) in SPLITS.items()
            }
            diff = norm(a["16x1"], a["1x16"])
            rows.append((mode, diff, diff / norm(a["16x1"], init)))
    print("| loss_normalization | L2(a_16x1 - a_1x16) | relative to L2(a_16x1 - a_init) |")
    print("|---|---|---|")
    for mode, diff, rel in rows:
        print(f"| {mode} | {diff:.3e} | {rel:.3e} |")
    print(
        f"\nSetting: {CONFIG} with {' '.join(SETTINGS)}, {args.steps} optimizer steps of 16 "
        f"samples, SGD lr {args.lr}."
    )


if __name__ == "__main__":
    main()
