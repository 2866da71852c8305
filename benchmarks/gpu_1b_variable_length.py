"""Micro-batching at real width on a GPU: a Llama-3.2-1B-shaped model on variable-length data.

The figure users compare (issue #30): stock torchtune 0.6.1's ``full_finetune_single_device``
beside exactga's recipe with ``micro_batching`` ``fixed``, ``by_length`` and ``token_budget``,
each a real ``tune run`` on the bundled instruction data (2,069 samples, 74 to 1,241 tokens,
median 134, at ``tokenizer.max_seq_len=1024``), batch size 8 x ga 8, bf16 with fp32 master
weights (``master_weights: fp32``; stock has no such key and trains pure bf16), fused AdamW,
from the same seeded checkpoint in the same sample order. The runs are the ones of
benchmarks/micro_batching.py (imported: the same launcher, step timer and padding reader), with
the model widened to Llama 3.2 1B's shape (16 layers, width 2,048, 32 heads, 8 KV heads, MLP
8,192, 128,256-word tied vocabulary: 1.24B parameters, randomly initialised). Groups:

- ``as_shipped``: each recipe as a user gets it: stock with torch's default attention backends
  (on an H100 cuDNN's is chosen first), exactga's with its default ``cudnn_attention: False``;
- ``cudnn_on``: cuDNN's attention allowed in every run (exactga's ``cudnn_attention=True``);
- ``no_cudnn``: cuDNN's attention switched off in every run process, stock's too
  (``torch.backends.cuda.enable_cudnn_sdp(False)`` from a ``sitecustomize`` the benchmark puts
  on ``PYTHONPATH``; the recipes are not changed);
- ``compile``: ``compile=True`` (torchtune's per-layer compile), cuDNN's attention allowed.

Per run: ms per step (median over the steps after warm-up, from the ``loss`` events' wall
times), tokens/s (the samples' own tokens, padding excluded, over the timed steps' time), MFU
(those tokens' model FLOPs, ``6 N`` per token plus ``12 L d T`` attention for a sample of
``T`` tokens (PaLM, appendix B), over the device's dense bf16 peak), the padding share of the
positions processed, peak GPU memory (the recipes' ``peak_memory_alloc``), under ``compile``
dynamo's graphs and graph breaks at the run's end (the recipe's ``compile/graphs`` and
``compile/graph_breaks``; a packed row's flex attention breaks no layer's graph), the number of
distinct micro-batch shapes the run's forward saw (replayed from exactga's loader on the host:
the same sampler, seed and split), and, in the first group run, each run's trained weights
against the ``fixed`` run's (relative L2 over the update; bf16 rounding differs between splits,
so this is the precision floor, not zero). Nothing is asserted.

Modes: stock and exactga's ``fixed``, ``by_length`` and ``token_budget`` as above; ``packed``,
the window's samples packed into rows of ``--packed-row`` positions (4,096) under a document
mask (flex attention on CUDA); ``packed_window``, rows of ``--window-row`` positions (16,384), so
that a whole window is one micro-batch (see [one row a window]). A packed run has one shape, which
``compile`` compiles once. ``--runs GROUP/MODE ...`` picks runs across groups, in order (issue
#46's plan in tools/gpu_check.py does); the JSON is rewritten after every run.

Run from the repository root on a CUDA machine (about 90 s a run on an H100)::

    python benchmarks/gpu_1b_variable_length.py [--groups as_shipped no_cudnn] [--json out.json]
    python benchmarks/gpu_1b_variable_length.py --runs as_shipped/packed compile/packed
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torchtune import config

sys.path.insert(0, str(Path(__file__).resolve().parent))

import micro_batching as mb  # noqa: E402

from exactga.data.loader import build_dataloader, load_dataset  # noqa: E402
from exactga.data.micro_batching import MicroBatching, MicroBatchingSettings  # noqa: E402
from exactga.parity.scoring import relative_l2  # noqa: E402
from exactga.profiling import device_peak_flops  # noqa: E402

LLAMA_3_2_1B = {
    "vocab_size": 128_256,
    "num_layers": 16,
    "num_heads": 32,
    "num_kv_heads": 8,
    "embed_dim": 2048,
    "intermediate_dim": 8192,
    "tie_word_embeddings": True,
}
MODES = ("stock", "fixed", "by_length", "token_budget", "packed", "packed_window")
# group -> (overrides of every run, environment of every run). Stock ignores exactga's keys.
GROUPS = {
    "as_shipped": ([], {}),
    "cudnn_on": (["cudnn_attention=True"], {}),
    "no_cudnn": ([], {"EXACTGA_BENCH_CUDNN_SDP": "0"}),
    "compile": (["compile=True", "cudnn_attention=True"], {}),
}
SITECUSTOMIZE = """\
import os, sys

# First any sitecustomize further along the path (tools/gpu_check.py --no-venv writes one that
# sets up the site directories), which this one would otherwise shadow.
_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _candidate = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.abspath(_entry or ".") != _here and os.path.isfile(_candidate):
        with open(_candidate) as _file:
            exec(compile(_file.read(), _candidate, "exec"), {"__file__": _candidate})
        break
if os.environ.get("EXACTGA_BENCH_CUDNN_SDP") == "0":
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
"""


@dataclass(frozen=True)
class Row:
    group: str
    mode: str
    ms_per_step: float
    tokens_per_s: float
    mfu: float | None
    padding: float | None  # None: stock, which trains the fixed run's micro-batches
    peak_gib: float | None
    shapes: int
    compiled: tuple[int, int] | None  # dynamo's graphs and graph breaks; None: an eager run
    rel_l2_to_fixed: float | None


def model_overrides(args: argparse.Namespace) -> list[str]:
    """The 1B shape; its position table covers a packed row longer than one sample."""
    return [f"model.{key}={value}" for key, value in LLAMA_3_2_1B.items()] + [
        f"model.max_seq_len={max(args.max_seq_len, args.packed_row, args.window_row)}"
    ]


def benchmark_args(args: argparse.Namespace, root: Path, extra: list[str]) -> argparse.Namespace:
    """The micro_batching benchmark's arguments for one group's four runs."""
    sets = [
        "device=cuda",
        "dtype=bf16",
        "master_weights=fp32",
        "optimizer.fused=True",
        "clip_grad_norm=null",  # stock clips the scaled gradients too; both skip it here
        f"checkpointer.checkpoint_dir={root / 'base_model'}",  # one seeded 1B init, shared
        *model_overrides(args),
        *extra,
    ]
    return mb.parse_args(
        [
            "--batch-size", str(args.batch_size), "--ga", str(args.ga),
            "--micro-batch-tokens", str(args.micro_batch_tokens),
            "--packed-row", str(args.packed_row),
            "--max-seq-len", str(args.max_seq_len), "--max-steps", str(args.steps),
            "--warmup-steps", str(args.warmup_steps), "--omp-threads", "4",
            *(item for s in sets for item in ("--set", s)),
        ]
    )  # fmt: skip


def bundled_data(args: argparse.Namespace) -> tuple[Any, Any]:
    """The tiny config's dataset and tokenizer at ``--max-seq-len``, as the runs load them."""
    cfg = OmegaConf.load(mb.REPO_ROOT / "configs/tiny/full_single_device.yaml")
    tokenizer = config.instantiate(cfg.tokenizer, max_seq_len=args.max_seq_len)
    return load_dataset(cfg.dataset, tokenizer, LLAMA_3_2_1B["vocab_size"]), tokenizer


def replay_windows(args: argparse.Namespace, mode: str) -> list[list[tuple[int, int]]]:
    """Each timed run's micro-batch shapes per step, from exactga's own loader on the host (the
    recipe's sampler, seed 0 and epoch 0, and split); stock trains the ``fixed`` split."""
    dataset, tokenizer = bundled_data(args)
    budget = mode == "token_budget"
    batch_size = args.batch_size * args.ga if budget else args.batch_size
    row_tokens = {
        "token_budget": args.micro_batch_tokens,
        "packed": args.packed_row,
        "packed_window": args.window_row,
    }
    loader_mode = {"stock": "fixed", "packed_window": "packed"}.get(mode, mode)
    settings = MicroBatchingSettings(
        mode=MicroBatching(loader_mode),
        batch_size=batch_size,
        micro_batch_tokens=row_tokens.get(mode),
    )
    loader = build_dataloader(
        dataset,
        batch_size=batch_size,
        gradient_accumulation_steps=1 if budget else args.ga,
        micro_batching=settings,
        shuffle=True,
        collate_fn="torchtune.data.padded_collate_sft",
        padding_idx=tokenizer.pad_id,
        ignore_idx=-100,
    )
    loader.sampler.set_epoch(0)
    steps = []
    for window in loader:
        steps.append([tuple(batch["tokens"].shape) for batch in window.micro_batches])
        if len(steps) == args.steps:
            break
    return steps


def sample_lengths(args: argparse.Namespace) -> list[list[int]]:
    """The samples' own token counts, per step (the fixed split's rows without padding)."""
    dataset, tokenizer = bundled_data(args)
    loader = build_dataloader(
        dataset,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.ga,
        shuffle=True,
        collate_fn="torchtune.data.padded_collate_sft",
        padding_idx=tokenizer.pad_id,
        ignore_idx=-100,
    )
    loader.sampler.set_epoch(0)
    lengths = []
    for window in loader:
        step = []
        for batch in window.micro_batches:
            step += (batch["tokens"] != tokenizer.pad_id).sum(dim=1).tolist()
        lengths.append(step)
        if len(lengths) == args.steps:
            break
    return lengths


def samples_flops(lengths: list[int], num_params: int, layers: int, width: int) -> float:
    """Model FLOPs of samples of these lengths: ``6 N T + 12 L d T^2`` each (PaLM, appendix B);
    per sample, as attention sees one document (hf_trainer_peer.py counts its runs with it)."""
    return sum(6 * num_params * t + 12 * layers * width * t * t for t in lengths)


@functools.cache  # one meta build, not one per timed step
def llama_1b_parameters() -> int:
    """The 1B shape's parameter count (tied: the projection once)."""
    with torch.device("meta"):
        from torchtune.models.llama3_2 import llama3_2

        model = llama3_2(**LLAMA_3_2_1B, max_seq_len=1)
    return sum(p.numel() for p in model.parameters())


def step_flops(lengths: list[int]) -> float:
    """Model FLOPs of one step's samples on the 1B shape."""
    layers, width = LLAMA_3_2_1B["num_layers"], LLAMA_3_2_1B["embed_dim"]
    return samples_flops(lengths, llama_1b_parameters(), layers, width)


def selected_runs(args: argparse.Namespace) -> dict[str, list[str]]:
    """group -> its modes, in order: ``--runs GROUP/MODE ...``, else every ``--modes`` of every
    ``--groups``."""
    if not args.runs:
        return {group: list(args.modes) for group in args.groups}
    chosen: dict[str, list[str]] = {}
    for item in args.runs:
        group, mode = item.split("/")
        chosen.setdefault(group, []).append(mode)
    return chosen


def run_specs(bench: argparse.Namespace, args: argparse.Namespace) -> list[mb.RunSpec]:
    """The micro_batching benchmark's runs, and ``packed_window``: its packed run with rows of
    ``--window-row`` positions."""
    specs = mb.run_specs(bench)
    packed = next(spec for spec in specs if spec.name == "packed")
    row = f"micro_batch_tokens={args.window_row}"
    overrides = tuple(row if o.startswith("micro_batch_tokens=") else o for o in packed.overrides)
    return [*specs, dataclasses.replace(packed, name="packed_window", overrides=overrides)]


def result_row(group: str, name: str, result: Any, lengths, shapes) -> Row:
    """One run's figures (its gap to ``fixed`` is filled in when its group has one)."""
    timed = len(result.step_ms)
    timed_lengths = lengths[-timed:]  # the steps after warm-up
    seconds = sum(result.step_ms) / 1e3
    tokens = sum(sum(step) for step in timed_lengths)
    flops = sum(step_flops(step) for step in timed_lengths)
    peak = device_peak_flops(torch.device("cuda"))
    return Row(
        group=group,
        mode=name,
        ms_per_step=statistics.median(result.step_ms),
        tokens_per_s=tokens / seconds,
        mfu=flops / seconds / peak if peak else None,
        padding=None if name == "stock" or not result.padding else result.padding[0],
        peak_gib=result.gpu_peak_gib,
        shapes=len({shape for step in shapes[name] for shape in step}),
        compiled=result.compiled,
        rel_l2_to_fixed=None,
    )


def run_group(
    group: str,
    modes: list[str],
    args: argparse.Namespace,
    root: Path,
    data: tuple[Any, Any],
    rows: list[Row],
    publish: Callable[[], None],
) -> None:
    """Run ``modes`` of ``group``, appending each run's row to ``rows`` and publishing them as
    it ends, so that a benchmark stopped from outside keeps what it measured."""
    lengths, shapes = data
    extra, env = GROUPS[group]
    bench = benchmark_args(args, root, extra)
    (root / group).mkdir(parents=True, exist_ok=True)
    specs = sorted(
        (spec for spec in run_specs(bench, args) if spec.name in modes),
        key=lambda spec: modes.index(spec.name),
    )
    results = {}
    saved_env = dict(os.environ)
    os.environ.update(env)
    try:
        for spec in specs:
            start = time.perf_counter()
            results[spec.name] = mb.measure(spec, 0, bench, root / group)
            print(f"{group}/{spec.name}: {time.perf_counter() - start:.0f} s", flush=True)
            rows.append(result_row(group, spec.name, results[spec.name], lengths, shapes))
            publish()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    if group == next(iter(selected_runs(args))) and "fixed" in results:
        initial = mb.load_file(str(root / "base_model" / "model.safetensors"))
        fixed = mb.load_weights(results["fixed"].output_dir)
        for index, row in enumerate(rows):
            if row.group == group and row.mode != "fixed":
                trained = mb.load_weights(results[row.mode].output_dir)
                gap = relative_l2(trained, fixed, initial)
                rows[index] = dataclasses.replace(row, rel_l2_to_fixed=gap)
        publish()
    for result in results.values():
        shutil.rmtree(result.output_dir, ignore_errors=True)  # 1B checkpoints fill the disk


def markdown(rows: list[Row], args: argparse.Namespace, device: str) -> str:
    lines = [
        f"Measured on {device}; torch {torch.__version__}. Llama-3.2-1B-shaped (1.24B "
        f"parameters), {args.batch_size} x {args.ga} per step, tokenizer.max_seq_len="
        f"{args.max_seq_len}, token_budget {args.micro_batch_tokens} tokens, {args.steps} steps "
        f"of which {args.warmup_steps} warm-up; bf16 with fp32 master weights (stock: pure "
        "bf16), fused AdamW, no clipping.",
        "",
        "| group | run | ms/step | speed-up vs stock | tokens/s | MFU | padding | peak GPU GiB "
        "| distinct shapes | graphs (breaks) | rel-L2 to fixed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    stock = {row.group: row.ms_per_step for row in rows if row.mode == "stock"}
    for row in rows:
        speedup = f"{stock[row.group] / row.ms_per_step:.2f}x" if row.group in stock else "n/a"
        cells = [
            row.group,
            row.mode,
            f"{row.ms_per_step:.0f}",
            speedup,
            f"{row.tokens_per_s:,.0f}",
            "n/a" if row.mfu is None else f"{row.mfu:.3f}",
            "as fixed" if row.padding is None else f"{100 * row.padding:.1f}%",
            "n/a" if row.peak_gib is None else f"{row.peak_gib:.1f}",
            str(row.shapes),
            "eager" if row.compiled is None else f"{row.compiled[0]} ({row.compiled[1]})",
            "" if row.rel_l2_to_fixed is None else f"{row.rel_l2_to_fixed:.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "- tokens/s and MFU count the samples' own tokens (no padding), the same for every run "
        "of a step; MFU's FLOPs are `6 N T + 12 L d T^2` per sample of T tokens over the dense "
        "bf16 peak. Stock trains the fixed split's micro-batches (its padding and shapes are "
        "fixed's). Stock keeps weights, gradients and AdamW state in bf16, hence its lower peak.",
        "- as_shipped: stock with torch's default attention kernels, exactga with its default "
        "cudnn_attention: False; cudnn_on: cuDNN's attention allowed everywhere; no_cudnn: off "
        "in every process; compile: `compile=True`, cuDNN allowed. rel-L2: trained weights "
        "against the fixed run's, over the update (first group only).",
    ]
    return "\n".join(lines)


def run_name(text: str) -> str:
    """A ``--runs`` item: ``GROUP/MODE`` with a known group and mode."""
    group, _, mode = text.partition("/")
    if group not in GROUPS or mode not in MODES:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not GROUP/MODE with GROUP in {list(GROUPS)} and MODE in {list(MODES)}"
        )
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The default pair is what a user compares (as shipped) and the kernels held equal; about
    # 5 minutes on an H100, inside tools/gpu_check.py's per-benchmark limit. The other groups
    # take about 4 (cudnn_on) and 7 (compile) minutes more.
    parser.add_argument(
        "--groups", nargs="+", default=["as_shipped", "no_cudnn"], choices=list(GROUPS)
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ga", type=int, default=8)
    parser.add_argument(
        "--runs",
        nargs="+",
        default=[],
        type=run_name,
        metavar="GROUP/MODE",
        help="exactly these runs, in this order (instead of --groups x --modes); "
        "e.g. as_shipped/stock as_shipped/packed compile/packed",
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    # A packed row is one sequence to the model (its position table is widened to fit): 4,096
    # positions hold about 25 median samples, one shape for the whole run.
    parser.add_argument("--packed-row", type=int, default=4096, help="packed's positions per row")
    # [one row a window]
    # A window of 8 x 8 samples holds about 12,000 tokens (median 134 a sample, up to 1,024):
    # rows of 16,384 take it in one micro-batch of one shape, so the step pays the host's cost
    # of launching a forward and backward once, not once per micro-batch (round two measured
    # about 110 ms of host time per micro-batch at this size against 28 ms of GPU time, which
    # is what held MFU at 15.5%). A window that overflows the row gets a second one.
    parser.add_argument(
        "--window-row", type=int, default=16_384, help="packed_window's positions per row"
    )
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--out", type=Path, help="run folders here (deleted as measured)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_1b_variable_length: no CUDA device; nothing measured.")
        if args.json:
            args.json.write_text(json.dumps({"markdown": "No CUDA device: nothing measured."}))
        return 0
    device = torch.cuda.get_device_name()
    runs = selected_runs(args)
    lengths = sample_lengths(args)
    modes = {mode for group_modes in runs.values() for mode in group_modes}
    shapes = {mode: replay_windows(args, mode) for mode in modes}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu_1b_", dir=args.out) as tmp:
        root = Path(tmp)
        (root / "site").mkdir()
        (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = str(root / "site") + (os.pathsep + path if path else "")

        def publish() -> None:  # after every run: a later run's failure keeps these
            text = markdown(rows, args, device)
            print(text, flush=True)
            if args.json:
                payload = {"device": device, "rows": [vars(r) for r in rows], "markdown": text}
                args.json.write_text(json.dumps(payload, indent=1))

        for group, group_modes in runs.items():
            run_group(group, group_modes, args, root, (lengths, shapes), rows, publish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
