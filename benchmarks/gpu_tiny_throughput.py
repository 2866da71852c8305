"""Tokens/s and MFU of the tiny config on a CUDA GPU: stock torchtune 0.6.1 against exactga.

Launches ``tune run full_finetune_single_device`` (stock, the recipe in torchtune's wheel) and
``tune run recipes/full_finetune.py`` (exactga) on ``configs/tiny/
full_single_device.yaml`` with ``device=cuda dtype=bf16``, one after the other, alternating
(stock, exactga, exactga, stock, ...), each in its own folder from the same seeded checkpoint,
so both read the same batches. Per run:

- ms per step: from the wall times of the ``loss`` events both recipes log at every step,
  over steps 3..n (the first two are warm-up), so start-up and checkpointing are left out;
- tokens/s: processed tokens (every position of every micro-batch, padding included) per
  second. exactga logs it (``throughput/tokens_per_second``); stock does not, so its figure
  is exactga's processed tokens per step (the same batches) over stock's ms per step;
- MFU: tokens/s times FLOPs per token over the device's dense bf16 peak, from exactga's
  ``throughput/mfu`` (see docs/profiling.md); stock's with the same FLOPs per token;
- exactga's ``normalization/saved_ms``: its profiler's timing of the pass it skips;
- the cost of attention at a new sequence length: this data's padded batches change length at
  almost every step, and on some GPUs torch's default attention backend (cuDNN's) sets up a
  plan for each new shape, in both recipes alike.

Prints a table and the exactga / stock ratios; nothing is asserted. Run from the repository
root (the command line is the recipes'; ``--set KEY=VALUE`` adds overrides to both)::

    python benchmarks/gpu_tiny_throughput.py [--steps 40] [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny/full_single_device.yaml"
RECIPES = {
    "stock": "full_finetune_single_device",
    "exactga": "recipes/full_finetune.py",
}
WARMUP_STEPS = 2
PHASES = ("data", "forward", "backward", "optimizer")


def tune_executable() -> str:
    beside = Path(sys.executable).with_name("tune")
    return str(beside) if beside.exists() else (shutil.which("tune") or "tune")


def read_events(log_root: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar under ``log_root`` as (step, wall time, value), by tag, in step order."""
    events: dict[str, list[tuple[int, float, float]]] = {}
    for path in sorted(log_root.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(path), size_guidance={"tensors": 0, "scalars": 0})
        accumulator.Reload()
        tags = accumulator.Tags()
        for tag in tags.get("tensors", []):
            for e in accumulator.Tensors(tag):
                if e.tensor_proto.string_val:  # text and layouts, not scalars
                    continue
                value = float(make_ndarray(e.tensor_proto).reshape(-1)[0])
                events.setdefault(tag, []).append((e.step, e.wall_time, value))
        for tag in tags.get("scalars", []):
            for e in accumulator.Scalars(tag):
                events.setdefault(tag, []).append((e.step, e.wall_time, float(e.value)))
    return {tag: sorted(values) for tag, values in events.items()}


def launch(recipe: str, output_dir: Path, args: argparse.Namespace) -> dict[str, list]:
    overrides = [
        f"output_dir={output_dir}",
        "device=cuda",
        "dtype=bf16",
        f"max_steps_per_epoch={args.steps}",
        "log_every_n_steps=1",
        *args.set,
    ]
    cmd = [tune_executable(), "run", RECIPES[recipe], "--config", CONFIG, *overrides]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{recipe} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return read_events(output_dir / "logs")


def ms_per_step(events: dict[str, list]) -> float:
    steps = [e for e in events["loss"] if e[0] > WARMUP_STEPS]
    return (steps[-1][1] - steps[0][1]) * 1e3 / (len(steps) - 1)


def tail_mean(events: dict[str, list], tag: str) -> float:
    return statistics.mean(value for step, _, value in events[tag] if step > WARMUP_STEPS)


def measure(args: argparse.Namespace, root: Path) -> dict:
    order = []
    for repeat in range(args.repeats):
        order += ["stock", "exactga"] if repeat % 2 == 0 else ["exactga", "stock"]
    runs = []
    for index, recipe in enumerate(order):
        events = launch(recipe, root / f"{index}_{recipe}", args)
        run = {"recipe": recipe, "ms_per_step": ms_per_step(events)}
        if recipe == "exactga":
            tokens_per_s = [
                v for s, _, v in events["throughput/tokens_per_second"] if s > WARMUP_STEPS
            ]
            step_ms = [v for s, _, v in events["time/step_ms"] if s > WARMUP_STEPS]
            # processed tokens per step, step by step: the same batches in both recipes
            run["tokens_per_step"] = statistics.mean(
                t * ms / 1e3 for t, ms in zip(tokens_per_s, step_ms, strict=True)
            )
            run["logged_tokens_per_s"] = tail_mean(events, "throughput/tokens_per_second")
            if "throughput/mfu" in events:
                run["logged_mfu"] = tail_mean(events, "throughput/mfu")
                run["mfu_per_token_per_s"] = run["logged_mfu"] / run["logged_tokens_per_s"]
            # logged at every step, repeating the latest sample: keep each sample once
            logged = [v for _, _, v in events.get("normalization/saved_ms", [])]
            run["saved_ms"] = [v for i, v in enumerate(logged) if i == 0 or v != logged[i - 1]]
            run["logged_step_ms"] = statistics.mean(step_ms)
            run["phases_ms"] = {phase: tail_mean(events, f"time/{phase}_ms") for phase in PHASES}
        runs.append(run)
        print(f"  run {index + 1}: {recipe} {run['ms_per_step']:.2f} ms/step", file=sys.stderr)
    return {"runs": runs}


def summarize(result: dict, args: argparse.Namespace) -> str:
    runs = result["runs"]
    exact = [r for r in runs if r["recipe"] == "exactga"]
    tokens_per_step = statistics.mean(r["tokens_per_step"] for r in exact)
    mfu_factor = statistics.mean(r.get("mfu_per_token_per_s", 0.0) for r in exact)
    lines = [
        f"configs/tiny/full_single_device.yaml (3.7M parameters), device=cuda dtype=bf16, "
        f"{args.steps} steps of the config's batch_size x gradient_accumulation_steps (4 x 2), "
        f"steps 3..{args.steps} timed; "
        f"{tokens_per_step:,.0f} processed tokens per step on average.",
        "",
        "| run | recipe | ms per step | tokens/s | MFU |",
        "|---|---|---|---|---|",
    ]
    medians = {}
    for recipe in RECIPES:
        values = [r["ms_per_step"] for r in runs if r["recipe"] == recipe]
        medians[recipe] = statistics.median(values)
    for index, run in enumerate(runs):
        tokens_per_s = tokens_per_step / (run["ms_per_step"] / 1e3)
        mfu = f"{tokens_per_s * mfu_factor:.2e}" if mfu_factor else "n/a"
        lines.append(
            f"| {index + 1} | {run['recipe']} | {run['ms_per_step']:.2f} | "
            f"{tokens_per_s:,.0f} | {mfu} |"
        )
    phases = ", ".join(
        f"{phase} {statistics.mean(r['phases_ms'][phase] for r in exact):.1f}" for phase in PHASES
    )
    step_ms = statistics.mean(r["logged_step_ms"] for r in exact)
    saved = [v for r in exact for v in r["saved_ms"]]
    # Over the whole run (tokens over time), not the mean of per-step rates: steps that meet a
    # new sequence length are far slower than the others (see the attention line below).
    logged = tokens_per_step / (step_ms / 1e3)
    lines += [
        "",
        f"- Median ms per step: stock {medians['stock']:.2f}, exactga {medians['exactga']:.2f}; "
        f"ratio exactga / stock = {medians['exactga'] / medians['stock']:.3f} (below 1: "
        "exactga faster).",
        f"- exactga's own scalars over steps 3..n: `throughput/tokens_per_second` {logged:,.0f}"
        + (f", `throughput/mfu` {logged * mfu_factor:.2e}" if mfu_factor else ", no MFU")
        + f"; where its step goes (`time/*_ms`): {phases}; `time/step_ms` {step_ms:.1f}.",
        "- exactga's `normalization/saved_ms` samples (the skipped scale pass on this model): "
        + (", ".join(f"{v:.3f}" for v in saved) if saved else "none")
        + " ms.",
    ]
    probe = result.get("sdpa_probe")
    if probe:
        lines.append(
            "- Attention at this model's shapes (4 sequences, 4 heads of 64, bf16, causal; "
            "`F.scaled_dot_product_attention` forward and backward, ms per call): one length "
            f"repeated {probe['default_same_length']:.2f}; a new length every call "
            f"{probe['default_new_length']:.2f} with torch's default backends (cuDNN's enabled: "
            f"{probe['cudnn_sdp_enabled']}), {probe['no_cudnn_new_length']:.2f} without "
            "cuDNN's. The padded batches of this data change length at almost every step, so a "
            "large part of forward and backward above is attention-plan set-up, in both "
            "recipes alike; the 8B-shaped benchmark (fixed shapes) is the one to read for MFU."
        )
    return "\n".join(lines)


def sdpa_probe(calls: int = 20) -> dict:
    """Milliseconds per attention forward and backward at the tiny model's shapes, for one
    length repeated and for a new length every call, with and without cuDNN's kernel."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def per_call_ms(lengths, backends=None) -> float:
        context = sdpa_kernel(backends) if backends else contextlib.nullcontext()
        with context:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for length in lengths:
                q, k, v = (
                    torch.randn(
                        4, 4, length, 64, device="cuda", dtype=torch.bfloat16
                    ).requires_grad_()
                    for _ in range(3)
                )
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / len(lengths)

    no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    per_call_ms([256] * 3)  # warm-up
    per_call_ms([256] * 3, no_cudnn)
    return {
        "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
        "default_same_length": per_call_ms([256] * calls),
        "default_new_length": per_call_ms(range(101, 101 + 2 * calls, 2)),
        "no_cudnn_new_length": per_call_ms(range(102, 102 + 2 * calls, 2), no_cudnn),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2, help="runs per recipe")
    parser.add_argument("--set", nargs="*", default=[], help="KEY=VALUE overrides, both recipes")
    parser.add_argument("--out", type=Path, help="keep the run folders here")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_tiny_throughput: no CUDA device; nothing measured.")
        if args.json:
            args.json.write_text(json.dumps({"markdown": "No CUDA device: nothing measured."}))
        return 0
    name = torch.cuda.get_device_name()
    print(f"# gpu_tiny_throughput on {name}, torch {torch.__version__}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = measure(args, args.out)
    else:
        with tempfile.TemporaryDirectory() as root:
            result = measure(args, Path(root))
    result["sdpa_probe"] = sdpa_probe()
    markdown = f"Measured on {name}.\n\n" + summarize(result, args)
    print(markdown)
    if args.json:
        payload = {"device": name, **result, "markdown": markdown}
        payload["command"] = " ".join(["python", *sys.argv])
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
