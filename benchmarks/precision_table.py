"""The precision table of docs/precision.md, measured through the recipes (real ``tune run``).

Every run trains the tiny config with the tests' small model (``tools/tiny_runs.py``) for
``STEPS`` optimizer steps of 8 shuffled, variable-length sequences of the bundled data, with no
clipping and no warm-up, and writes a step checkpoint at its end: the trained weights exactly as
the run holds them (fp32 master weights in fp32, pure bf16 weights in bf16). Distances are the
project's relative L2, ``||w - w_ref|| / ||w_ref - w_init||`` (``exactga.parity.scoring``),
where ``w_init`` is the fp32 initial checkpoint (full) or the seeded initial adapters (LoRA):

- "split": the 1x8 run (or 2 ranks x 1x4) against the same precision's 8x1 run;
- "to fp32": the 8x1 run (or 2 ranks x 4x1) against the fp32 8x1 run on one device.

For LoRA only the adapters are compared (the base is frozen), against fp32 LoRA.

Run from the repository root (about 30 launches; 2 to 3 minutes on 2 CPU cores)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/precision_table.py

``tests/test_precision_recipes.py`` launches a subset of exactly these runs (it imports
``RUNS`` and ``launch`` from here, so the two cannot drift) and checks the bounds of issue #13.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = REPO_ROOT / "tools"
if str(TOOLS) not in sys.path:  # tools/tiny_runs.py: the tests' small model, a plain launch
    sys.path.insert(0, str(TOOLS))

from safetensors.torch import load_file as load_weights  # noqa: E402
from tiny_runs import SMALL_MODEL, output_of, run_tune  # noqa: E402

from exactga.parity.scoring import relative_l2  # noqa: E402
from exactga.run.checkpointing import step_checkpoint_weights  # noqa: E402

STEPS = 12
# Plain gradient descent with a large step, so its updates are far above bf16's rounding where
# the weights are fp32 and the distances measure precision, not noise; and the configs' AdamW.
OPTIMIZERS = {
    "sgd": ["optimizer._component_=torch.optim.SGD", "~optimizer.weight_decay"],
    "adamw": ["optimizer._component_=torch.optim.AdamW", "optimizer.weight_decay=0.01"],
}
# Learning rates by optimizer and kind. AdamW: the tiny configs'. SGD on LoRA: 0.1, as a step
# of 0.5 moves the adapters by tens of percent per step, where bf16's relative rounding hardly
# shows (pure bf16 then lands 4.0e-2 from fp32 against 4.2e-3 with fp32 adapters, 9.6x; at
# 0.1 it is 28x). docs/precision.md gives both.
LEARNING_RATES = {
    ("sgd", "full"): 0.5,
    ("sgd", "lora"): 0.1,
    ("adamw", "full"): 1e-3,
    ("adamw", "lora"): 3e-3,
}
# config keys of each precision row
PRECISIONS = {
    "fp32": ["dtype=fp32"],
    "bf16": ["dtype=bf16", "master_weights=none"],  # stock torchtune's pure bf16
    "bf16_master": ["dtype=bf16", "master_weights=fp32"],
    # pure bf16 whose optimizer rounds stochastically (AdamW only); see docs/precision.md
    "bf16_sr": [
        "dtype=bf16",
        "master_weights=none",
        "optimizer._component_=torchao.optim._AdamW",
        "optimizer.bf16_stochastic_round=True",
    ],
}
# torchao compiles its optimizer step on first use (40 s on 2 CPU cores); eager is the same step.
EAGER = {"TORCHDYNAMO_DISABLE": "1"}
RECIPES = {
    ("full", 1): ("recipes/full_finetune.py", "configs/tiny/full_single_device.yaml"),
    ("full", 2): ("recipes/full_finetune.py", "configs/tiny/full_distributed.yaml"),
    ("lora", 1): ("recipes/lora_finetune.py", "configs/tiny/lora_single_device.yaml"),
    ("lora", 2): ("recipes/lora_finetune.py", "configs/tiny/lora_distributed.yaml"),
}


@dataclass(frozen=True)
class Run:
    kind: str  # full | lora
    precision: str  # a key of PRECISIONS
    optimizer: str  # a key of OPTIMIZERS
    batch_size: int
    ga: int
    nproc: int = 1
    steps: int = STEPS
    lr: float | None = None  # None: the optimizer's default above

    def args(self, output_dir: Path) -> list[str]:
        recipe, config = RECIPES[(self.kind, self.nproc)]
        head = ["--nproc_per_node", str(self.nproc)] if self.nproc > 1 else []
        settings = {
            **SMALL_MODEL,
            "output_dir": output_dir,
            "batch_size": self.batch_size,
            "gradient_accumulation_steps": self.ga,
            "max_steps_per_epoch": self.steps,
            "save_every_n_steps": self.steps,  # the trained weights as held, fp32 or bf16
            "clip_grad_norm": "null",
            "lr_scheduler.num_warmup_steps": 0,
            "metric_logger._component_": "torchtune.training.metric_logging.DiskLogger",
        }
        lr = LEARNING_RATES[(self.optimizer, self.kind)] if self.lr is None else self.lr
        overrides = [
            *OPTIMIZERS[self.optimizer],
            *PRECISIONS[self.precision],
            f"optimizer.lr={lr}",
        ]
        return [
            *head,
            recipe,
            "--config",
            config,
            *(f"{k}={v}" for k, v in settings.items()),
            *overrides,
        ]


def _runs() -> dict[str, Run]:
    runs: dict[str, Run] = {}
    for kind in ("full", "lora"):
        for optimizer in OPTIMIZERS:
            for precision in PRECISIONS:
                if precision == "bf16_sr" and optimizer != "adamw":
                    continue
                for bs, ga in ((8, 1), (1, 8)):
                    runs[f"{kind}-{precision}-{optimizer}-{bs}x{ga}"] = Run(
                        kind, precision, optimizer, bs, ga
                    )
            for precision in ("fp32", "bf16_master"):
                for bs, ga in ((4, 1), (1, 4)):
                    runs[f"{kind}-{precision}-{optimizer}-2x{bs}x{ga}"] = Run(
                        kind, precision, optimizer, bs, ga, nproc=2
                    )
    # The seeded initial adapters: one step at learning rate 0 leaves them as drawn.
    runs["lora-init"] = Run("lora", "fp32", "sgd", 8, 1, steps=1, lr=0.0)
    return runs


RUNS = _runs()


def launch(name: str, root: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Train run ``name`` under ``root/name`` and return its final weights (step checkpoint)."""
    run = RUNS[name]
    out = root / name
    proc = run_tune(
        [*run.args(out), f"device={device}"],
        extra_env=EAGER if run.precision == "bf16_sr" else None,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} failed:\n{output_of(proc)[-4000:]}")
    return trained_weights(out, run.steps)


def trained_weights(out: Path, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The weights a run held after ``steps`` steps: all of them (full) or the adapters."""
    return step_checkpoint_weights(out / "step_checkpoints" / f"step_{steps:06d}")


def initial_weights(kind: str, root: Path) -> dict[str, torch.Tensor]:
    """``w_init`` of run kind ``kind`` from already launched runs under ``root``."""
    if kind == "lora":
        return trained_weights(root / "lora-init", 1)
    return initial_full_weights(root / "full-fp32-sgd-8x1")


def initial_full_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 checkpoint a full run started from, in torchtune's names and layout (the
    checkpoint is in Hugging Face's, whose q and k rows are permuted)."""
    from torchtune.models.convert_weights import hf_to_tune

    hf = load_weights(run_dir / "base_model" / "model.safetensors")
    return hf_to_tune(
        hf,
        num_heads=SMALL_MODEL["model.num_heads"],
        num_kv_heads=SMALL_MODEL["model.num_kv_heads"],
        dim=SMALL_MODEL["model.embed_dim"],
    )


def launch_all(
    names: list[str], root: Path, jobs: int = 2, device: str = "cpu"
) -> dict[str, dict[str, torch.Tensor]]:
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {name: pool.submit(launch, name, root, device) for name in names}
        return {name: future.result() for name, future in futures.items()}


def distance(
    weights: dict[str, dict[str, torch.Tensor]],
    root: Path,
    run: str,
    reference: str,
) -> float:
    """Relative L2 of run ``run`` to run ``reference`` (both launched under ``root``)."""
    kind = run.split("-")[0]
    return relative_l2(weights[run], weights[reference], initial_weights(kind, root))


ROWS = [  # (label, kind, precision, two ranks)
    ("fp32", "full", "fp32", False),
    ("pure bf16 (stock)", "full", "bf16", False),
    ("pure bf16, AdamW with bf16 stochastic rounding", "full", "bf16_sr", False),
    ("fp32 master weights, bf16 autocast", "full", "bf16_master", False),
    ("2 ranks, fp32", "full", "fp32", True),
    ("2 ranks, FSDP2 bf16 over fp32 master weights", "full", "bf16_master", True),
    ("LoRA, pure bf16 (stock)", "lora", "bf16", False),
    ("LoRA, AdamW with bf16 stochastic rounding", "lora", "bf16_sr", False),
    ("LoRA, fp32 adapters over a bf16 base, autocast", "lora", "bf16_master", False),
    ("LoRA, 2 ranks, fp32 adapters, FSDP2 bf16", "lora", "bf16_master", True),
]


def table(weights: dict[str, dict[str, torch.Tensor]], root: Path) -> str:
    lines = [
        "| precision | SGD: 8x1 vs 1x8 | SGD: to fp32 8x1 | AdamW: 8x1 vs 1x8 | "
        "AdamW: to fp32 8x1 |",
        "|---|---|---|---|---|",
    ]
    for label, kind, precision, two_ranks in ROWS:
        cells = []
        for optimizer in OPTIMIZERS:
            whole, split = ("2x4x1", "2x1x4") if two_ranks else ("8x1", "1x8")
            run = f"{kind}-{precision}-{optimizer}-{whole}"
            if run not in weights:
                cells += ["n/a", "n/a"]
                continue
            other = f"{kind}-{precision}-{optimizer}-{split}"
            reference = f"{kind}-fp32-{optimizer}-8x1"
            cells.append(f"{distance(weights, root, other, run):.1e}")
            cells.append(f"{distance(weights, root, run, reference):.1e}")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="launches at a time")
    parser.add_argument("--keep", type=Path, help="write the runs here instead of a temp dir")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: one GPU, so the 2-rank rows (one GPU per NCCL rank) are left out",
    )
    parser.add_argument("--json", type=Path, help="also write the table here (tools/gpu_check)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("precision_table: no CUDA device; nothing measured.")
        if args.json:
            args.json.write_text(json.dumps({"markdown": "No CUDA device: nothing measured."}))
        return
    names = [n for n in RUNS if args.device == "cpu" or RUNS[n].nproc == 1]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        weights = launch_all(names, root, jobs=args.jobs, device=args.device)
        text = table(weights, root)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    text += (
        f"\n\nMeasured on {where} (device={args.device}), torch {torch.__version__}: {STEPS} "
        f"steps of 8 sequences (configs/tiny/data.json, shuffled), small model {SMALL_MODEL}, "
        f"no clipping, no warm-up; learning rates {LEARNING_RATES}."
    )
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"markdown": text}))


if __name__ == "__main__":
    main()
