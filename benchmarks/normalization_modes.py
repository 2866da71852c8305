"""Step time of the three loss-normalisation modes, side by side in one process.

``naive`` (mean of micro-batch means / ga), ``post_scale`` (stock torchtune 0.6.1: loss times
the token count, then a ``scale_grads`` pass over every gradient) and ``exact`` (exactga: loss
scaled before backward, no gradient pass) each train their own copy of the same model (same
initial weights, own optimizer) on the same data. Every step is driven as
``recipes/full_finetune.py`` drives it: ``GroupingNormalizer(loss_fn, ga, mode=...)``
opens the window (host token counts), then per micro-batch forward, ``window.scale(loss,
mb).backward()``, then ``window.finish_gradients(model)``, optimizer step, ``zero_grad``.

After warm-up the modes run round-robin, one optimizer step each per round (the order rotates
every round), so slow phases of a shared machine hit all of them alike. Per round the stock
gradient-scaling pass is also timed on its own (``time_gradient_pass`` of
``tools/profiling_utils.py``, factor 1, on fresh gradients of the ``exact`` copy, outside every
step's timer). Reported per (size, ga):

- step ms: median over the measured rounds (window opening through ``zero_grad``);
- norm overhead ms: median time in ``window.scale`` plus ``window.finish_gradients`` per step
  (plain host timers on CPU; on CUDA the device is synchronised around each call, in every
  mode alike, so the step times of all modes carry the same synchronisations);
- peak mem: CUDA ``max_memory_allocated`` during the step (reset before it; the other modes'
  copies are resident too, alike for all); ``n/a`` on CPU;
- step time ratio vs exact: median over rounds of (this mode's step / exact's step in the same
  round), a paired ratio that cancels round-to-round data and machine variation;
- step CPU ms and its ratio (CPU runs only): the same for the main thread's CPU time
  (``time.thread_time``; with one intra-op thread all compute runs there). Time slices lost to
  other processes on a shared machine count in wall time but not in CPU time.

The line under each group gives exact's saving against post_scale (median and interquartile
range of paired per-round differences) next to the pass timed alone.

Default CPU run (4m and 30m, ga 1 and 4, micro-batches of one sample truncated to 32 tokens
with the loss on prompt and response, 1 warm-up and 8 measured rounds, one thread). It needs
about 2 minutes of CPU time; on 2 shared cores at a load average of 7-9 it took 9 minutes of
wall time. The pass costs the same whatever the tokens, so short micro-batches make its share
of a step as large as this CPU allows::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/normalization_modes.py

GPU, the sizes of torchtune's Llama 3.2 1B and Llama 3.1 8B (the 8B case of torchtune #2515;
models larger than ``--share-above`` parameters share one copy frozen by SGD with lr=0, see
``--share-above``)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/normalization_modes.py \\
        --device cuda --dtype bf16 --sizes 1b 8b --batch-size 4 --max-seq-len 512

Run from the repository root (the data and tokenizer are ``configs/tiny/``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchtune import training, utils
from torchtune.data import padded_collate_sft
from torchtune.datasets import alpaca_dataset
from torchtune.models.llama2 import llama2_tokenizer
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss

from exactga.accumulation.normalization import MicroBatch, NormMode, Window
from exactga.sft.loss import causal_lm_loss

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = REPO_ROOT / "tools"
if str(TOOLS) not in sys.path:  # tools/profiling_utils.py: the gradient-pass timer
    sys.path.insert(0, str(TOOLS))

from grouping import GroupingNormalizer  # noqa: E402
from profiling_utils import time_gradient_pass  # noqa: E402

DATA_FILE = "configs/tiny/data.json"
TOKENIZER_FILE = "configs/tiny/tokenizer.model"
MODES = (NormMode.NAIVE, NormMode.POST_SCALE, NormMode.EXACT)

# llama3_2 builder arguments. "4m" is configs/tiny's model; "1b"/"3b" are torchtune's
# llama3_2_1b/3b; "8b" has Llama 3.1 8B's shapes (untied output), built with the same builder.
TINY_VOCAB = 2048  # the bundled tokenizer has 2000 pieces
PRESETS: dict[str, dict[str, Any]] = {
    "4m": dict(vocab_size=TINY_VOCAB, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=256,
               intermediate_dim=768, tie_word_embeddings=True),
    "30m": dict(vocab_size=TINY_VOCAB, num_layers=10, num_heads=8, num_kv_heads=4, embed_dim=512,
                intermediate_dim=1536, tie_word_embeddings=True),
    "1b": dict(vocab_size=128_256, num_layers=16, num_heads=32, num_kv_heads=8, embed_dim=2048,
               intermediate_dim=8192, tie_word_embeddings=True),
    "3b": dict(vocab_size=128_256, num_layers=28, num_heads=24, num_kv_heads=8, embed_dim=3072,
               intermediate_dim=8192, tie_word_embeddings=True),
    "8b": dict(vocab_size=128_256, num_layers=32, num_heads=32, num_kv_heads=8, embed_dim=4096,
               intermediate_dim=14_336, tie_word_embeddings=False),
}  # fmt: skip


@dataclass
class Arm:
    """One mode's model, optimizer and normaliser, and what was measured for it."""

    mode: NormMode
    model: nn.Module
    optimizer: torch.optim.Optimizer
    normalizer: GroupingNormalizer
    step_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # this thread's CPU time (CPU runs)
    overhead_ms: list[float] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its milliseconds, the device synchronised before and after on CUDA."""
    synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, (time.perf_counter() - t0) * 1e3


def load_batches(
    batch_size: int, max_seq_len: int, train_on_input: bool, count: int
) -> list[dict[str, torch.Tensor]]:
    """``count`` padded micro-batches of the bundled alpaca data, in file order.

    Samples without a loss token after the label shift are left out, so every micro-batch does
    the same work in every mode (the recipe would skip them; here that would only add noise).
    With ``train_on_input`` every sample has loss tokens even when truncated short; without
    it, the prompts need about 80 tokens before any response token survives truncation.
    """
    tokenizer = llama2_tokenizer(
        str(REPO_ROOT / TOKENIZER_FILE), max_seq_len=max_seq_len, prompt_template=None
    )
    dataset = alpaca_dataset(
        tokenizer, source="json", data_files=str(REPO_ROOT / DATA_FILE), split="train",
        train_on_input=train_on_input,
    )  # fmt: skip
    collate = partial(padded_collate_sft, padding_idx=tokenizer.pad_id, ignore_idx=-100)
    batches, pending = [], []
    for index in range(len(dataset)):
        sample = dataset[index]
        if sum(label != -100 for label in sample["labels"][1:]) == 0:
            continue
        pending.append(sample)
        if len(pending) == batch_size:
            batches.append(collate(pending))
            pending = []
            if len(batches) == count:
                return batches
    raise ValueError(f"the data holds fewer than {count} micro-batches of {batch_size}")


def build_model(preset: dict[str, Any], max_seq_len: int, seed: int) -> nn.Module:
    """The preset on the default device and dtype, GPT-style init (std 0.02), seeded."""
    torch.manual_seed(seed)
    model = llama3_2(**preset, max_seq_len=max(512, max_seq_len))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
    return model


def loss_step(arm: Arm, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward and mean loss of one micro-batch, as the recipe's ``_loss_step``."""
    return causal_lm_loss(arm.model, arm.normalizer.loss_fn, batch)


def open_window(arm: Arm, batches: list[dict[str, torch.Tensor]]) -> Window:
    # Shallow copies: the step pops labels and moves tensors, the round's batches are shared.
    return next(arm.normalizer.windows([dict(b) for b in batches], max_windows=1))


def train_step(arm: Arm, batches: list[dict[str, torch.Tensor]], device: torch.device) -> None:
    """One optimizer step of ``arm`` over the window ``batches``, timed."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    window = open_window(arm, batches)
    assert not window.should_skip_step(), "load_batches keeps only micro-batches with loss tokens"
    overhead_ms = 0.0
    for micro_batch in window.nonempty_micro_batches():
        utils.batch_to_device(micro_batch.batch, device)
        loss = loss_step(arm, micro_batch.batch)
        scaled, ms = timed_ms(device, partial(window.scale, loss, micro_batch))
        overhead_ms += ms
        scaled.backward()
    _, ms = timed_ms(device, partial(window.finish_gradients, arm.model))
    overhead_ms += ms
    arm.optimizer.step()
    arm.optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    arm.step_ms.append((time.perf_counter() - t0) * 1e3)
    arm.cpu_ms.append((time.thread_time() - cpu0) * 1e3)
    arm.overhead_ms.append(overhead_ms)
    if device.type == "cuda":
        arm.peak_bytes.append(torch.cuda.max_memory_allocated(device))


def probe_gradient_pass(arm: Arm, batch: dict[str, torch.Tensor], device: torch.device) -> float:
    """The stock pass timed alone on fresh gradients of ``arm`` (factor 1; no weight moves)."""
    window = open_window(arm, [batch])
    micro_batch: MicroBatch = window.micro_batches[0]
    utils.batch_to_device(micro_batch.batch, device)
    loss_step(arm, micro_batch.batch).backward()
    ms = time_gradient_pass(arm.model, device)
    arm.model.zero_grad(set_to_none=True)
    return ms


def make_arms(args: argparse.Namespace, size: str, ga: int, device: torch.device) -> list[Arm]:
    """One arm per mode, each with its own copy of the same initial model (or one shared)."""
    dtype = training.get_dtype(args.dtype, device=device)
    with training.set_default_dtype(dtype), device:
        base = build_model(PRESETS[size], args.max_seq_len, args.seed)
    num_params = sum(p.numel() for p in base.parameters())
    share = num_params > args.share_above
    arms = []
    for index, mode in enumerate(MODES):
        model = base if share or index == len(MODES) - 1 else copy.deepcopy(base)
        loss_fn = CEWithChunkedOutputLoss()
        model.set_num_output_chunks(loss_fn.num_output_chunks)
        if share:
            # One copy frozen by SGD with lr=0: the weights never move, so the modes share
            # nothing that changes; the step still reads every gradient.
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        arms.append(Arm(mode, model, optimizer, GroupingNormalizer(loss_fn, ga, mode=mode)))
    return arms


def measure(args: argparse.Namespace, size: str, ga: int, device: torch.device) -> dict[str, Any]:
    """Warm-up, then round-robin rounds; returns the arms and the pass probes."""
    arms = make_arms(args, size, ga, device)
    num_batches = ga * (args.warmup + args.steps)
    batches = load_batches(args.batch_size, args.max_seq_len, args.train_on_input, num_batches)
    probes: list[float] = []
    gc.collect()
    gc.disable()  # a collection inside one arm's step would land on that arm only
    try:
        for round_index in range(args.warmup + args.steps):
            window_batches = batches[round_index * ga : (round_index + 1) * ga]
            shift = round_index % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                train_step(arm, window_batches, device)
            probe_ms = probe_gradient_pass(arms[-1], window_batches[0], device)
            if round_index >= args.warmup:
                probes.append(probe_ms)
            gc.collect()
    finally:
        gc.enable()
    for arm in arms:  # drop warm-up rounds
        arm.step_ms = arm.step_ms[args.warmup :]
        arm.cpu_ms = arm.cpu_ms[args.warmup :]
        arm.overhead_ms = arm.overhead_ms[args.warmup :]
        arm.peak_bytes = arm.peak_bytes[args.warmup :]
    num_params = sum(p.numel() for p in arms[-1].model.parameters())
    shared = arms[0].model is arms[-1].model
    return {"arms": arms, "probes": probes, "num_params": num_params, "shared": shared}


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def format_results(results: list[tuple[str, int, dict[str, Any]]], cuda: bool) -> str:
    lines = [
        "| size | ga | mode | step ms | norm overhead ms | peak mem | step time ratio vs exact "
        "| step CPU ms | CPU time ratio vs exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for size, ga, result in results:
        arms = {arm.mode: arm for arm in result["arms"]}
        exact = arms[NormMode.EXACT]
        label = f"{size} ({result['num_params'] / 1e6:.1f}M)"
        for mode in MODES:
            arm = arms[mode]
            pairs = zip(arm.step_ms, exact.step_ms, strict=True)
            ratio = statistics.median(a / b for a, b in pairs)
            peak = f"{max(arm.peak_bytes) / 2**20:.0f} MiB" if cuda else "n/a"
            cpu, cpu_ratio = "n/a", "n/a"
            if not cuda:
                cpu = f"{statistics.median(arm.cpu_ms):.2f}"
                pairs = zip(arm.cpu_ms, exact.cpu_ms, strict=True)
                cpu_ratio = f"{statistics.median(a / b for a, b in pairs):.3f}"
            lines.append(
                f"| {label} | {ga} | {mode.value} | {statistics.median(arm.step_ms):.2f} | "
                f"{statistics.median(arm.overhead_ms):.3f} | {peak} | {ratio:.3f} | {cpu} | "
                f"{cpu_ratio} |"
            )
        post = arms[NormMode.POST_SCALE]
        diffs = [a - b for a, b in zip(post.step_ms, exact.step_ms, strict=True)]
        d1, d2, d3 = quartiles(diffs)
        p1, p2, p3 = quartiles(result["probes"])
        shared = " (one shared copy, SGD lr=0)" if result["shared"] else ""
        cpu_note = ""
        if not cuda:
            c1, c2, c3 = quartiles([a - b for a, b in zip(post.cpu_ms, exact.cpu_ms, strict=True)])
            cpu_note = f"; in CPU time {c2:.2f} ms (IQR {c1:.2f} to {c3:.2f})"
        notes.append(
            f"- {label}, ga={ga}{shared}: exact saves {d2:.2f} ms per step vs post_scale "
            f"(median of {len(diffs)} paired rounds, IQR {d1:.2f} to {d3:.2f}){cpu_note}; "
            "post_scale's "
            f"overhead {statistics.median(post.overhead_ms):.2f} ms, exact's "
            f"{statistics.median(exact.overhead_ms):.3f} ms; the gradient-scaling pass timed "
            f"alone (time_gradient_pass): {p2:.2f} ms (IQR {p1:.2f} to {p3:.2f})."
        )
    return "\n".join([*lines, "", *notes])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=list(PRESETS), default=["4m", "30m"])
    parser.add_argument("--ga", nargs="+", type=int, default=[1, 4], help="accumulation steps")
    parser.add_argument("--batch-size", type=int, default=1, help="micro-batch size")
    parser.add_argument("--max-seq-len", type=int, default=32, help="tokenizer truncation")
    parser.add_argument(
        "--train-on-input",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="loss on prompt tokens too (default; lets short sequences keep loss tokens)",
    )
    parser.add_argument("--steps", type=int, default=8, help="measured rounds per (size, ga)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up rounds per (size, ga)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    parser.add_argument(
        "--share-above",
        type=float,
        default=2e9,
        help="models with more parameters share one copy frozen by SGD lr=0 (three AdamW "
        "copies of an 8B model do not fit one GPU); default 2e9",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on CPU, where the cores are shared and two "
        "spinning OpenMP threads made steps several times slower; torch's default on CUDA)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = utils.get_device(args.device)
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    print(
        f"# normalization_modes: device={device} dtype={args.dtype} "
        f"batch_size={args.batch_size} max_seq_len={args.max_seq_len} "
        f"train_on_input={args.train_on_input} warmup={args.warmup} "
        f"rounds={args.steps} threads={torch.get_num_threads()} torch={torch.__version__}"
        + (f" gpu={torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
        flush=True,
    )
    results = []
    for size in args.sizes:
        for ga in args.ga:
            start = time.perf_counter()
            results.append((size, ga, measure(args, size, ga, device)))
            print(f"  {size} ga={ga}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(format_results(results, cuda=device.type == "cuda"))


if __name__ == "__main__":
    main()
