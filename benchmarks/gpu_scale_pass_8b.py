"""ga=1 step time on a Llama-3.1-8B-shaped model in bf16: stock torchtune 0.6.1 against exactga.

One process, one CUDA GPU, one model and one optimizer that both arms step in turn (two copies
of an 8B model with AdamW do not fit one card):

- **stock**: the body of stock torchtune 0.6.1's ``full_finetune_single_device`` loop at
  ``gradient_accumulation_steps: 1`` (its ``train``, as shipped in the wheel's ``recipes/``):
  count the labels on the device, loss times that count, backward, ``scale_grads(model, 1 /
  num_tokens)``, optimizer step, ``zero_grad``, ``running_loss.item()``. The scale pass is
  also timed inside each step with CUDA events.
- **exactga**: ``recipes/full_finetune.py``'s step: ``LossNormalizer`` opens the
  window (host token count), ``exactga.accumulation.step.train_window`` runs forward, backward (no
  scaling at ga=1) and the optimizer step under the recipe's profiler hook, then
  ``window.local_mean_loss()`` as a logged step reads it.

After warm-up the arms alternate (the order flips every round) and each step is timed between
two device synchronisations. Then exactga's profiler hook runs a few steps on its own with the
saved-latency sampling on every step, exactly as a recipe does on its sampled steps, and its
``normalization/saved_ms``, ``time/*``, ``throughput/*`` scalars are reported as it would log
them. The floor of the scale pass is its bytes (every gradient read and written once) over the
device-to-device copy bandwidth measured at the start.

Full width (embed 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256, untied output) with as
many of the 32 layers as fit: ``--layers`` is tried first and lowered by 4 on out-of-memory.
AdamW is torch's fused kernel (its foreach variant needs a temporary copy of the optimizer
state, about 16 GB more at 8B); activation checkpointing is on, as in torchtune's 8B configs.
The data are random token ids (the pass costs the same whatever the tokens), every position a
loss token. Prints a table and ratios; nothing is asserted.

    python benchmarks/gpu_scale_pass_8b.py [--layers 32] [--batch-size 2] [--seq-len 2048]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torchtune import modules, training, utils
from torchtune.models.llama3_1 import llama3_1
from torchtune.modules.loss import CEWithChunkedOutputLoss

from exactga.accumulation.step import train_window
from exactga.profiling import (
    ProfilerSettings,
    TrainingProfiler,
    device_peak_flops,
    model_flops_per_token,
)
from exactga.sft.loss import causal_lm_loss

# tools/grouping.py: windows of hand-collated micro-batches, as the tests make them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from grouping import GroupingNormalizer  # noqa: E402

SHAPE = dict(vocab_size=128_256, num_heads=32, num_kv_heads=8, embed_dim=4096,
             intermediate_dim=14_336)  # fmt: skip
TOKEN_IDS = 32_000  # random ids below this
DEVICE = torch.device("cuda")


def synchronize() -> None:
    torch.cuda.synchronize()


def copy_bandwidth_bytes_per_s(num_bytes: int = 2**32, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / seconds


def build(layers: int, args: argparse.Namespace):
    with training.set_default_dtype(torch.bfloat16), DEVICE:
        model = llama3_1(num_layers=layers, max_seq_len=args.seq_len, **SHAPE)
    if args.activation_checkpointing:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
        )
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    return model, loss_fn, optimizer


def make_batches(args: argparse.Namespace, count: int = 3) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, TOKEN_IDS, (args.batch_size, args.seq_len), generator=generator)
        batches.append({"tokens": tokens, "labels": tokens.clone()})
    return batches


class Stock:
    """Stock torchtune 0.6.1's step at ga=1, line for line (its ``train`` and ``_loss_step``)."""

    def __init__(self, model, loss_fn, optimizer, batch_size: int) -> None:
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.ignore_labels_cache = torch.full(
            (batch_size, 1), loss_fn.ignore_index, device=DEVICE, dtype=torch.long
        )
        self.scale_ms: list[float] = []

    def _loss_step(self, batch):
        labels = batch.pop("labels")
        logits = self.model(**batch)
        labels = torch.hstack((labels[..., 1:], self.ignore_labels_cache[: labels.shape[0]]))
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        loss = self.loss_fn(logits, labels)
        del logits
        return loss

    def step(self, batch) -> float:
        batch = dict(batch)
        utils.batch_to_device(batch, DEVICE)
        current_num_tokens = (batch["labels"] != self.loss_fn.ignore_index).sum()
        num_tokens = current_num_tokens
        current_loss = self._loss_step(batch) * current_num_tokens
        running_loss = current_loss
        current_loss.backward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        training.scale_grads(self.model, 1 / num_tokens)
        end.record()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_to_log = running_loss.item() / num_tokens
        self.scale_ms.append(start.elapsed_time(end))  # recorded; the .item() above synced
        return float(loss_to_log)


class Exact:
    """exactga's step at ga=1, as ``recipes/full_finetune.py`` runs it."""

    def __init__(self, model, loss_fn, optimizer, every_n: int) -> None:
        self.model, self.optimizer = model, optimizer
        self.normalizer = GroupingNormalizer(loss_fn, 1)
        self.loss_step = partial(causal_lm_loss, model, loss_fn)
        settings = ProfilerSettings(saved_latency_every_n_steps=every_n)
        self.profiler = TrainingProfiler(settings, DEVICE, model)
        self.num_steps = 0

    def step(self, batch) -> float:
        (window,) = self.normalizer.windows([dict(batch)], max_windows=1)
        train_window(
            window,
            model=self.model,
            loss_step=self.loss_step,
            optimizer=self.optimizer,
            profiler=self.profiler,
            device=DEVICE,
            step=self.num_steps + 1,
        )
        self.num_steps += 1
        self.profiler.step(window.num_input_tokens)
        return window.local_mean_loss()


def timed_ms(step, batch) -> float:
    synchronize()
    start = time.perf_counter()
    step(batch)
    synchronize()
    return (time.perf_counter() - start) * 1e3


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def measure(layers: int, args: argparse.Namespace) -> dict:
    model, loss_fn, optimizer = build(layers, args)
    batches = make_batches(args)
    stock = Stock(model, loss_fn, optimizer, args.batch_size)
    exact = Exact(model, loss_fn, optimizer, every_n=0)
    stock_ms, exact_ms = [], []
    for round_index in range(args.warmup + args.rounds):
        batch = batches[round_index % len(batches)]
        arms = [("stock", stock.step), ("exact", exact.step)]
        if round_index % 2:
            arms.reverse()
        for name, step in arms:
            ms = timed_ms(step, batch)
            if round_index >= args.warmup:
                (stock_ms if name == "stock" else exact_ms).append(ms)
    # The profiler hook on its own, sampling the skipped pass on every step as a recipe does
    # on its sampled steps; its scalars are what the recipe would log for these steps.
    sampler = Exact(model, loss_fn, optimizer, every_n=1)
    sampler.profiler.__enter__()
    for index in range(args.samples):
        sampler.step(batches[index % len(batches)])
    hook_metrics = sampler.profiler.metrics()
    sampler.profiler.__exit__(None, None, None)
    synchronize()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {
        "layers": layers,
        "params": sum(p.numel() for p in model.parameters()),
        "grad_bytes": grad_bytes,
        "tokens_per_step": args.batch_size * args.seq_len,
        "flops_per_token": model_flops_per_token(model),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "stock_ms": stock_ms,
        "exact_ms": exact_ms,
        "scale_pass_in_stock_step_ms": stock.scale_ms[args.warmup :],
        "saved_ms_samples": sampler.profiler.saved_ms_samples,
        "hook_metrics": hook_metrics,
    }
    del model, loss_fn, optimizer, stock, exact, sampler
    return result


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def summarize(result: dict, args: argparse.Namespace, bandwidth: float) -> str:
    peak = device_peak_flops(DEVICE)
    stock, exact = result["stock_ms"], result["exact_ms"]
    diffs = [s - e for s, e in zip(stock, exact, strict=True)]
    ratios = [s / e for s, e in zip(stock, exact, strict=True)]
    d1, d2, d3 = quartiles(diffs)
    r1, r2, r3 = quartiles(ratios)
    p1, p2, p3 = quartiles(result["scale_pass_in_stock_step_ms"])
    s1, s2, s3 = quartiles(result["saved_ms_samples"])
    floor_ms = 2 * result["grad_bytes"] / bandwidth * 1e3
    hook = result["hook_metrics"]
    rows = []
    for name, values in (("stock torchtune 0.6.1 (scale_grads)", stock), ("exactga", exact)):
        q1, q2, q3 = quartiles(values)
        tokens_per_s = result["tokens_per_step"] / (q2 / 1e3)
        mfu = f"{tokens_per_s * result['flops_per_token'] / peak:.3f}" if peak else "n/a"
        rows.append(f"| {name} | {q2:.1f} | {q1:.1f} to {q3:.1f} | {tokens_per_s:,.0f} | {mfu} |")
    ac = "on" if args.activation_checkpointing else "off"
    lines = [
        f"Llama-3.1-8B-shaped, {result['layers']} of 32 layers, {result['params'] / 1e9:.2f}B "
        f"parameters, bf16 weights and gradients, fused AdamW, activation checkpointing {ac}; "
        f"{args.batch_size} x {args.seq_len} tokens per step, ga = 1; {args.rounds} paired "
        f"rounds after {args.warmup} warm-up rounds; peak memory "
        f"{result['peak_memory_gib']:.1f} GiB.",
        "",
        "| step | ms per step (median) | IQR | tokens/s | MFU |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"- Paired ratio stock / exactga: {r2:.4f} (IQR {r1:.4f} to {r3:.4f}); exactga saves "
        f"{d2:.2f} ms per step (IQR {d1:.2f} to {d3:.2f}), "
        f"{100 * d2 / statistics.median(stock):.1f}% of stock's step.",
        f"- The scale pass inside stock's step (CUDA events around `scale_grads`): {p2:.2f} ms "
        f"(IQR {p1:.2f} to {p3:.2f}); its floor, {result['grad_bytes'] / 1e9:.1f} GB of "
        f"gradients read and written once at the measured copy bandwidth of "
        f"{bandwidth / 1e12:.2f} TB/s: {floor_ms:.2f} ms; measured / floor = "
        f"{p2 / floor_ms:.2f}.",
        f"- exactga's profiler, `time_gradient_pass` on {len(result['saved_ms_samples'])} "
        f"sampled steps: {s2:.2f} ms (IQR {s1:.2f} to {s3:.2f}); as logged: "
        f"`normalization/saved_ms` {hook.get('normalization/saved_ms', float('nan')):.2f}, "
        f"`normalization/saved_fraction` {hook.get('normalization/saved_fraction', 0):.4f}, "
        f"`time/step_ms` {hook.get('time/step_ms', float('nan')):.1f}, "
        f"`throughput/tokens_per_second` {hook.get('throughput/tokens_per_second', 0):,.0f}, "
        f"`throughput/mfu` {hook.get('throughput/mfu', float('nan')):.3f} (these steps also "
        "carry the sampled pass and its two synchronisations).",
        f"- MFU counts {result['flops_per_token'] / 1e9:.2f} GFLOP per token (6 x matmul "
        "parameters plus attention, exactga.profiling.model_flops_per_token; recomputation "
        "under activation checkpointing not counted) against "
        + (f"{peak / 1e12:.0f} TFLOP/s dense bf16." if peak else "no known peak."),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="tried first; lowered on OOM")
    parser.add_argument("--min-layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds (both arms)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up rounds")
    parser.add_argument("--samples", type=int, default=4, help="steps of the profiler hook")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_scale_pass_8b: no CUDA device; nothing measured.")
        if args.json:
            args.json.write_text(json.dumps({"markdown": "No CUDA device: nothing measured."}))
        return 0
    name = torch.cuda.get_device_name()
    print(f"# gpu_scale_pass_8b on {name}, torch {torch.__version__}", flush=True)
    bandwidth = copy_bandwidth_bytes_per_s()
    layers, result, attempts = args.layers, None, []
    while result is None and layers >= args.min_layers:
        start = time.perf_counter()
        try:
            result = measure(layers, args)
        except torch.OutOfMemoryError:
            attempts.append(layers)
            print(f"  {layers} layers: out of memory; trying {layers - 4}", file=sys.stderr)
            layers -= 4
        free_memory()
        print(f"  {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    if result is None:
        print("gpu_scale_pass_8b: even the smallest model ran out of memory.")
        return 1
    markdown = summarize(result, args, bandwidth)
    if attempts:
        markdown += f"\n- Out of memory at {', '.join(map(str, attempts))} layers first."
    markdown = f"Measured on {name}.\n\n" + markdown
    print(markdown)
    if args.json:
        payload = {"device": name, "bandwidth_bytes_per_s": bandwidth, **result}
        payload.update(markdown=markdown, command=" ".join(["python", *sys.argv]))
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
