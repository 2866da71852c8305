"""Length-balanced ranks: step time and rank imbalance with ``rank_balancing`` none and
by_tokens, on 2 gloo ranks, and the imbalance expected at 8, 64 and 512 ranks.

Part 1, measured: trains the tiny distributed config (``recipes/full_finetune.py
--config configs/tiny/full_distributed.yaml``, on 2 gloo ranks of one thread each) at each
per-rank split (default ``1x8`` and ``4x2``: batch_size x gradient_accumulation_steps), once with
``rank_balancing=none`` (stock's deal: rank r reads every 2nd sample of the shuffled order) and
once with ``by_tokens``, as real ``tune run`` subprocesses side by side in the sense of
farm-bench's pairs: per split the two run one after the other, their order flipped every repeat,
so that a drift in the machine's speed hits both. From each run's TensorBoard events: the median
``time/step_ms`` over the steps after warm-up, the mean and max ``throughput/rank_imbalance``
(the busiest rank's positions processed over the ranks' mean, per step), and the start-up cost
of the length index (the run's ``exactga: length index`` line). Then, pair by pair, by_tokens'
step time over none's. The weights of each pair are compared too (relative L2 over the update,
which exactness keeps at fp32 rounding).

Part 2, simulated: windows drawn from the bundled data's length distribution (the tiny config's
tokenizer, ``tokenizer.max_seq_len``), dealt to 8, 64 and 512 ranks of each split, each rank's
share cut by ``micro_batching: by_length`` as the recipes cut it; the per-step imbalance of
positions processed (padding included), the mean and the 99th percentile over ``--windows``
windows, stock's deal (a random one: the shuffled order's every n-th) against by_tokens
(exactga.data.rank_balancing.deal_by_length, refined on by_length's positions as the sampler does),
and the time one such deal takes (every rank deals every window itself, once per step).

Run from the repository root (about 6 minutes on 2 cores with the defaults)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rank_balancing.py

``--splits``, ``--steps``, ``--warmup-steps``, ``--repeats`` set part 1 (``--skip-runs`` leaves it
out), ``--ranks`` and ``--windows`` part 2; ``--out DIR`` keeps the run folders.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from omegaconf import OmegaConf
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from exactga.data.micro_batching import MicroBatching, MicroBatchingSettings
from exactga.data.rank_balancing import deal_by_length, planned_positions
from exactga.parity.scoring import relative_l2

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/full_finetune.py"
CONFIG = "configs/tiny/full_distributed.yaml"
BALANCINGS = ("none", "by_tokens")
INDEX_LINE = re.compile(r"exactga: length index of ([\d,]+) samples in ([\d.]+) s")


@dataclass(frozen=True)
class Run:
    split: str
    balancing: str
    repeat: int
    output_dir: Path
    wall_s: float
    step_ms: list[float]
    imbalance: list[float]
    index_s: float | None


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    for event_file in sorted(log_dir.rglob("events.out.tfevents.*")):
        if "profiling_report" in event_file.parts:
            continue
        ea = EventAccumulator(str(event_file), size_guidance={"tensors": 0, "scalars": 0})
        ea.Reload()
        for tag in ea.Tags().get("tensors", []):
            for e in ea.Tensors(tag):
                if not e.tensor_proto.string_val:
                    value = float(tensor_util.make_ndarray(e.tensor_proto))
                    series.setdefault(tag, {})[e.step] = value
    return series


def launch(split: str, balancing: str, repeat: int, args: argparse.Namespace, out: Path) -> Run:
    batch_size, ga = (int(x) for x in split.split("x"))
    output_dir = out / f"{split}-{balancing}-{repeat}"
    tune = Path(sys.executable).with_name("tune")
    command = [
        str(tune), "run", "--nproc_per_node", "2", RECIPE, "--config", CONFIG,
        f"output_dir={output_dir}", f"batch_size={batch_size}",
        f"gradient_accumulation_steps={ga}", f"max_steps_per_epoch={args.steps}",
        f"rank_balancing={balancing}", "saved_latency_every_n_steps=0",
        # The same micro-batching on both, the recipes' default, and one thread per rank.
        "micro_batching=by_length", "cpu_threads=1",
    ]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    (out / f"{output_dir.name}.log").write_text(output)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{output[-3000:]}")
    scalars = read_scalars(output_dir / "logs")
    steps = sorted(scalars["time/step_ms"])
    match = INDEX_LINE.search(output)
    return Run(
        split=split,
        balancing=balancing,
        repeat=repeat,
        output_dir=output_dir,
        wall_s=wall_s,
        step_ms=[scalars["time/step_ms"][s] for s in steps if s > args.warmup_steps],
        imbalance=[scalars["throughput/rank_imbalance"][s] for s in steps],
        index_s=float(match[2]) if match else None,
    )


def trained_weights(run: Run) -> dict:
    return load_file(str(next((run.output_dir / "epoch_0").glob("*.safetensors"))))


def measured_table(runs: list[Run], args: argparse.Namespace) -> list[str]:
    header = [
        "per-rank split", "rank_balancing", "ms/step (median)", "imbalance mean",
        "imbalance max", "length index s", "launches",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for split in args.splits:
        for balancing in BALANCINGS:
            these = [r for r in runs if r.split == split and r.balancing == balancing]
            index = [r.index_s for r in these if r.index_s is not None]
            cells = [
                split,
                balancing,
                f"{statistics.median(statistics.median(r.step_ms) for r in these):.0f}",
                f"{statistics.mean(v for r in these for v in r.imbalance):.3f}",
                f"{max(v for r in these for v in r.imbalance):.3f}",
                f"{statistics.median(index):.2f}" if index else "-",
                ", ".join(f"{r.wall_s:.0f} s" for r in these),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for split in args.splits:
        by_key = {(r.balancing, r.repeat): r for r in runs if r.split == split}
        ratios, gaps = [], []
        for repeat in range(args.repeats):
            none, balanced = by_key[("none", repeat)], by_key[("by_tokens", repeat)]
            ratios.append(statistics.median(balanced.step_ms) / statistics.median(none.step_ms))
            initial = load_file(str(none.output_dir / "base_model" / "model.safetensors"))
            gaps.append(relative_l2(trained_weights(balanced), trained_weights(none), initial))
        lines.append(
            f"- {split}: by_tokens / none, ms/step {statistics.median(ratios):.2f}x ("
            + ", ".join(f"{x:.2f}" for x in ratios)
            + f"); weights apart by relative L2 {max(gaps):.1e} (fp32 rounding)"
        )
    return lines


def bundled_lengths() -> list[int]:
    """The bundled data's sample lengths as the tiny config tokenizes it."""
    from torchtune import config

    from exactga.data.loader import load_dataset
    from exactga.data.micro_batching import sample_positions

    cfg = OmegaConf.load(REPO_ROOT / CONFIG)
    cfg.tokenizer.path = str(REPO_ROOT / "configs/tiny/tokenizer.model")
    cfg.dataset.data_files = str(REPO_ROOT / "configs/tiny/data.json")
    dataset = load_dataset(cfg.dataset, config.instantiate(cfg.tokenizer), vocab_size=2048)
    return [sample_positions(dataset[i]) for i in range(len(dataset))]


def by_length_positions(lengths: list[int], batch_size: int) -> int:
    """Positions a rank processes for these samples cut by ``by_length``."""
    ordered = sorted(lengths, reverse=True)
    return sum(batch_size * ordered[i] for i in range(0, len(ordered), batch_size))


def simulated_imbalance(
    lengths: list[int], num_ranks: int, split: str, num_windows: int, balanced: bool
) -> tuple[float, float, float]:
    """Mean and 99th percentile of the per-step imbalance over ``num_windows`` windows, and the
    median milliseconds a deal took."""
    batch_size, ga = (int(x) for x in split.split("x"))
    rng = random.Random(0)
    per_rank = batch_size * ga
    values, seconds = [], []
    for _ in range(num_windows):
        window = [rng.choice(lengths) for _ in range(per_rank * num_ranks)]
        start = time.perf_counter()
        if balanced:
            settings = MicroBatchingSettings(MicroBatching.BY_LENGTH, batch_size=batch_size)
            cost = planned_positions(window, window, settings, rows=1)
            shares = deal_by_length(window, num_ranks, cost)
        else:
            shares = [list(range(r, len(window), num_ranks)) for r in range(num_ranks)]
        seconds.append(time.perf_counter() - start)
        positions = [by_length_positions([window[i] for i in s], batch_size) for s in shares]
        values.append(max(positions) * num_ranks / sum(positions))
    values.sort()
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    return statistics.mean(values), p99, 1e3 * statistics.median(seconds)


def simulated_table(args: argparse.Namespace) -> list[str]:
    lengths = bundled_lengths()
    header = [
        "ranks", "per-rank split", "stock deal: mean", "p99", "by_tokens: mean", "p99",
        "deal ms",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for num_ranks in args.ranks:
        for split in args.splits:
            stock = simulated_imbalance(lengths, num_ranks, split, args.windows, False)
            balanced = simulated_imbalance(lengths, num_ranks, split, args.windows, True)
            ratios = (*stock[:2], *balanced[:2])
            cells = [str(num_ranks), split, *(f"{v:.3f}" for v in ratios), f"{balanced[2]:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def conditions() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), flags=re.M)
        cpu = names[0] if names else cpu
    return "; ".join(
        [
            f"date {datetime.datetime.now().astimezone().isoformat(timespec='minutes')}",
            f"{len(os.sched_getaffinity(0))} cores usable ({cpu})",
            f"torch {metadata.version('torch')}, torchtune {metadata.version('torchtune')}",
            f"Python {platform.python_version()}",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", nargs="+", default=["1x8", "4x2"], help="per rank, BxG")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="left out of the timing")
    parser.add_argument("--repeats", type=int, default=1, help="pairs per split")
    parser.add_argument("--skip-runs", action="store_true", help="part 2 only")
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 64, 512])
    parser.add_argument("--windows", type=int, default=200, help="simulated windows")
    parser.add_argument("--out", type=Path, default=None, help="keep run folders here")
    args = parser.parse_args(argv)
    if not 1 <= args.warmup_steps < args.steps:
        parser.error("need 1 <= --warmup-steps < --steps")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()
    start = time.perf_counter()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="rank_balancing_") as tmp:
        out = (args.out or Path(tmp)).resolve()
        out.mkdir(parents=True, exist_ok=True)
        if not args.skip_runs:
            for repeat in range(args.repeats):
                for split in args.splits:
                    order = BALANCINGS if repeat % 2 == 0 else BALANCINGS[::-1]
                    for balancing in order:
                        run = launch(split, balancing, repeat, args, out)
                        runs.append(run)
                        print(
                            f"{split} {balancing} #{repeat}: "
                            f"{statistics.median(run.step_ms):.0f} ms/step",
                            file=sys.stderr,
                        )
            measured = measured_table(runs, args)
    simulated = simulated_table(args)
    argv_text = shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"# benchmarks/rank_balancing.py {argv_text}".rstrip())
    print(f"# {conditions()}")
    print(
        "# load average (1, 5, 15 min): before "
        + ", ".join(f"{x:.2f}" for x in load_before)
        + "; after "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + f"; total wall time {time.perf_counter() - start:.0f} s"
    )
    if runs:
        print(f"\n## 2 gloo ranks: {RECIPE} --config {CONFIG}, {args.steps} steps\n")
        print("\n".join(measured))
    print(f"\n## Simulated: {args.windows} windows of the bundled data per row, by_length\n")
    print("\n".join(simulated))


if __name__ == "__main__":
    main()
