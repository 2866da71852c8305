"""What the reliability checks cost: a checkpoint's CRC32 check, and the per-sample id check.

Two figures of docs/reliability.md, measured with the project's own functions:

- **Checkpoint check**: ``exactga.run.checkpointing._crc32``, the function that fills a step
  checkpoint's manifest on save and checks every file against it on resume. By default it reads
  a synthetic file of ``--size-mb`` random bytes written under ``--tmp-dir`` (so it sits in the
  page cache, as a checkpoint just saved does); ``--checkpoint DIR`` instead checks a real step
  checkpoint folder (``<output_dir>/step_checkpoints/step_N``) through the manifest check a
  resume runs (``_read_manifest`` then ``_verify_files``). Throughput is bytes read per second
  of the process's CPU time, and per second of wall time; the median of ``--repeats``. A file
  not in the page cache is read at the disk's speed instead, when that is slower.
- **Token-id check**: ``CheckedDataset._check_sample`` of ``exactga.data.loader``, the min and max
of
  every sample's ids against the embedding table that the recipes' loader runs per sample (see
  [checked rows] there), next to what producing that sample costs: ``SFTDataset.__getitem__``
  (the row read, torchtune's Alpaca transform and the SentencePiece tokenizer). The dataset and
  tokenizer are those of ``--config`` (default ``configs/tiny/full_single_device.yaml``:
  ``configs/tiny/data.json`` and ``configs/tiny/tokenizer.model``, 256 tokens at most), built
  with ``exactga.data.loader.load_dataset`` as the recipes build them. Each sample is tokenized once
  per repeat and checked ``--check-loops`` times per repeat; times are the process's CPU time
  per sample (mean over the dataset, median over repeats), over all samples and over those cut
  at ``max_seq_len``.

CPU time is what the checks cost the process; on a shared machine it is distorted far less by
other jobs than wall time, which is printed too. The load average (``os.getloadavg``) is printed
before and after.

Run from the repository root (about 20 s; offline)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python \\
        benchmarks/reliability_costs.py

Results are in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torchtune import config

from exactga import checkpointing
from exactga.data.loader import load_dataset

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs/tiny/full_single_device.yaml"
GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-mb", type=int, default=256, help="synthetic file size (MB)")
    parser.add_argument("--tmp-dir", type=Path, default=None, help="where the file is written")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="a step checkpoint folder to check instead of a synthetic file",
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-loops", type=int, default=20, help="id checks per sample/repeat")
    parser.add_argument("--skip-crc", action="store_true")
    parser.add_argument("--skip-ids", action="store_true")
    return parser.parse_args(argv)


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) that ``fn()`` took."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def crc_rows(args: argparse.Namespace) -> list[str]:
    if args.checkpoint is not None:
        folder = args.checkpoint
        num_bytes = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())

        def check() -> None:
            manifest = checkpointing._read_manifest(folder)
            checkpointing._verify_files(folder, manifest)

        what = f"manifest check of {folder} ({num_bytes / 1e6:.0f} MB)"
        return _crc_table(what, check, num_bytes, args.repeats)
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        path = Path(tmp) / "synthetic.bin"
        num_bytes = args.size_mb * 10**6
        with open(path, "wb") as f:
            for _ in range(args.size_mb):
                f.write(os.urandom(10**6))
        what = f"`_crc32` of a {args.size_mb} MB file in the page cache"
        return _crc_table(what, lambda: checkpointing._crc32(path), num_bytes, args.repeats)


def _crc_table(what: str, check: Callable[[], object], num_bytes: int, repeats: int) -> list[str]:
    check()  # warm-up: the first read may still come from disk
    times = [_timed(check) for _ in range(repeats)]
    cpu = statistics.median(t[0] for t in times)
    wall = statistics.median(t[1] for t in times)
    return [
        "| checkpoint check | bytes | CPU time (ms) | GB/s of CPU time | wall (ms) "
        "| GB/s of wall |",
        "|---|---|---|---|---|---|",
        f"| {what} | {num_bytes:,} | {1e3 * cpu:.1f} | {num_bytes / cpu / GB:.2f} "
        f"| {1e3 * wall:.1f} | {num_bytes / wall / GB:.2f} |",
    ]


def id_rows(args: argparse.Namespace) -> list[str]:
    cfg = OmegaConf.load(args.config)
    tokenizer = config.instantiate(cfg.tokenizer)
    checked = load_dataset(cfg.dataset, tokenizer, vocab_size=cfg.model.vocab_size)
    raw = checked._dataset  # the SFTDataset: row read, message transform, tokenizer
    indices = range(len(raw))
    samples = [raw[i] for i in indices]  # warm-up, and the samples the checks run on
    lengths = [len(s["tokens"]) for s in samples]
    max_len = max(lengths)

    tokenize_cpu, check_cpu = [], []
    tokenize_wall, check_wall = [], []
    for _ in range(args.repeats):
        per_sample_t, per_sample_c, wall_t, wall_c = [], [], [], []
        for i in indices:
            cpu, wall = _timed(lambda i=i: raw[i])
            per_sample_t.append(cpu)
            wall_t.append(wall)

            def check(i: int = i) -> None:
                for _ in range(args.check_loops):
                    checked._check_sample(i, samples[i])

            cpu, wall = _timed(check)
            per_sample_c.append(cpu / args.check_loops)
            wall_c.append(wall / args.check_loops)
        tokenize_cpu.append(per_sample_t)
        check_cpu.append(per_sample_c)
        tokenize_wall.append(wall_t)
        check_wall.append(wall_c)

    def mean_us(runs: list[list[float]], keep: Callable[[int], bool]) -> float:
        """Mean over the kept samples, median over repeats, in microseconds."""
        kept = [i for i in indices if keep(i)]
        return 1e6 * statistics.median(sum(run[i] for i in kept) / len(kept) for run in runs)

    rows = [
        f"| samples ({args.config.name}: {len(samples)} rows, ids below "
        f"{cfg.model.vocab_size}) | mean tokens | id check, CPU (µs) | tokenize, CPU (µs) "
        "| ratio | id check, wall (µs) | tokenize, wall (µs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, keep in (
        ("all", lambda i: True),
        (f"cut at {max_len} tokens", lambda i: lengths[i] == max_len),
    ):
        kept = [i for i in indices if keep(i)]
        check_us, tokenize_us = mean_us(check_cpu, keep), mean_us(tokenize_cpu, keep)
        rows.append(
            f"| {name} ({len(kept)}) | {statistics.mean(lengths[i] for i in kept):.0f} "
            f"| {check_us:.1f} | {tokenize_us:.0f} | {tokenize_us / check_us:.0f}x "
            f"| {mean_us(check_wall, keep):.1f} | {mean_us(tokenize_wall, keep):.0f} |"
        )
    return rows


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()
    lines = [
        f"Setting: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"{args.repeats} repeats; load average before "
        + ", ".join(f"{x:.2f}" for x in load_before)
        + ".",
        "",
    ]
    if not args.skip_crc:
        lines += crc_rows(args) + [""]
    if not args.skip_ids:
        lines += id_rows(args) + [""]
    lines.append("Load average after: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + ".")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
