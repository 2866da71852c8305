"""Record what every training recipe computes, to show that a refactor changed no number.

Launches each training recipe once on its tiny config with the tests' small model (one or two
gloo ranks, one thread each, a few steps), and writes a JSON file holding, per recipe, every
logged metric of every step except timings and throughput (which vary run to run) and a SHA-256
of the weights it saved. Run it before and after a change and compare the two files::

    .venv/bin/python tools/recipe_snapshot.py record before.json      # on the old commit
    .venv/bin/python tools/recipe_snapshot.py record after.json       # on the new one
    .venv/bin/python tools/recipe_snapshot.py compare before.json after.json

``compare`` prints one line per recipe, ``identical`` or what differs, and exits 1 unless every
recipe is identical. ``record ... NAME ...`` records only the named runs. The launches use the
checkout the script lies in, its ``src`` first on the path: run the copy in a worktree of the old
commit (``git worktree add ../old <commit>``) for the "before" file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiny_runs import SMALL_MODEL, SMALL_TEACHER  # tools/, next to this script

REPO = Path(__file__).resolve().parents[1]

DISK_LOGGER = {"metric_logger._component_": "torchtune.training.metric_logging.DiskLogger"}
# Metrics that measure time or speed, not what was computed.
VOLATILE = ("time/", "throughput/", "tokens_per_second", "normalization/saved")
# name (also the tiny config's): (recipe file under recipes/, processes, overrides); the one file of
# torchtune's two names runs distributed under torchrun (2 processes), else on one device.
RUNS = {
    "full_single_device": ("full_finetune", 1, {"max_steps_per_epoch": 8}),
    "lora_single_device": ("lora_finetune", 1, {"max_steps_per_epoch": 8}),
    "full_distributed": ("full_finetune", 2, {"max_steps_per_epoch": 8}),
    "lora_distributed": ("lora_finetune", 2, {"max_steps_per_epoch": 8}),
    "kd_single_device": (
        "knowledge_distillation",
        1,
        {**SMALL_TEACHER, "max_steps_per_epoch": 8},
    ),
    "kd_distributed": (
        "knowledge_distillation",
        2,
        {**SMALL_TEACHER, "max_steps_per_epoch": 8},
    ),
    "lora_dpo_single_device": ("lora_dpo", 1, {"max_steps_per_epoch": 6}),
    "lora_dpo_distributed": ("lora_dpo", 2, {"max_steps_per_epoch": 6}),
    "full_dpo_distributed": ("full_dpo_distributed", 2, {"max_steps_per_epoch": 6}),
    "grpo_distributed": ("grpo_full_finetune_distributed", 2, {"num_steps": 4}),
    # A group size that divides the small model's widths (64, 128).
    "qat_distributed": (
        "qat_distributed",
        2,
        {"max_steps_per_epoch": 6, "quantizer.groupsize": 32},
    ),
    "qat_lora_distributed": (
        "qat_lora_finetune_distributed",
        2,
        {"max_steps_per_epoch": 6, "quantizer.groupsize": 32},
    ),
    # Its tiny models are small already, and it names them policy_model and
    # reward_and_value_model: no SMALL_MODEL.
    "ppo_single_device": ("ppo_full_finetune_single_device", 1, {"num_steps": 16}),
}
# Runs whose config has no ``model`` section for SMALL_MODEL to shrink.
OWN_MODELS = ("ppo_single_device",)
# The initial checkpoints the tiny configs write, not what a run saved.
INITIAL = {"base_model", "base_policy", "base_reward"}


def launch(name: str, output_dir: str) -> dict:
    """Run ``name`` into ``output_dir``; its logged metrics and weight hash, or its error."""
    recipe, nproc, overrides = RUNS[name]
    small = {} if name in OWN_MODELS else SMALL_MODEL
    settings = {**small, **overrides, **DISK_LOGGER, "output_dir": output_dir}
    head = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    tune = str(Path(sys.executable).parent / "tune")
    args = [tune, "run", *head, f"recipes/{recipe}.py", "--config", f"configs/tiny/{name}.yaml"]
    args += [f"{key}={value}" for key, value in settings.items()]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    # This checkout's library, whichever one the environment has installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if proc.returncode:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    return {
        "logged": logged_metrics(Path(output_dir) / "logs"),
        "weights": weights_hash(output_dir),
    }


def logged_metrics(log_dir: Path) -> list[list]:
    """``[step, {metric: value}]`` for every line of the run's ``DiskLogger`` files."""
    lines = []
    for log_file in sorted(log_dir.glob("log_*.txt")):
        for line in log_file.read_text().splitlines():
            step, _, metrics = line.removeprefix("Step ").partition(" | ")
            items = (item.partition(":") for item in metrics.split())
            kept = {key: value for key, _, value in items if not key.startswith(VOLATILE)}
            lines.append([step, kept])
    return lines


def weights_hash(output_dir: str) -> str:
    """SHA-256 over every safetensors file the run saved (not its initial weights)."""
    digest = hashlib.sha256()
    for path in sorted(Path(output_dir).rglob("*.safetensors")):
        if not INITIAL & set(path.parts):
            digest.update(str(path.relative_to(output_dir)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def record(path: Path, names: list[str]) -> int:
    with (
        tempfile.TemporaryDirectory(prefix="recipe-snapshot-") as root,
        ThreadPoolExecutor(2) as pool,
    ):
        runs = dict(zip(names, pool.map(lambda n: launch(n, f"{root}/{n}"), names), strict=True))
    path.write_text(json.dumps(runs, indent=1) + "\n")
    for name, run in runs.items():
        print(f"{name}: " + ("ERROR\n" + run["error"] if "error" in run else "recorded"))
    return 1 if any("error" in run for run in runs.values()) else 0


def compare(before: Path, after: Path) -> int:
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    identical = True
    for name in old:
        if name not in new:
            print(f"{name}: not in {after}")
            identical = False
        elif old[name] == new[name]:
            print(f"{name}: identical ({len(new[name]['logged'])} logged steps, weights equal)")
        else:
            same_weights = old[name].get("weights") == new[name].get("weights")
            print(f"{name}: DIFFERS (weights {'equal' if same_weights else 'differ'})")
            identical = False
    return 0 if identical else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    rec = verbs.add_parser("record", help="launch the runs and write what they computed")
    rec.add_argument("path", type=Path)
    rec.add_argument("names", nargs="*", help=f"any of {', '.join(RUNS)} (default: all)")
    cmp = verbs.add_parser("compare", help="compare two recorded files")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.verb == "compare":
        return compare(args.before, args.after)
    unknown = sorted(set(args.names) - set(RUNS))
    if unknown:
        parser.error(f"unknown run {', '.join(unknown)}; the runs are {', '.join(RUNS)}")
    return record(args.path, args.names or list(RUNS))


if __name__ == "__main__":
    sys.exit(main())
