"""Peak memory and step time of the loss on large vocabularies: materialised logits, torchtune's
chunked loss, and the projection fused with the loss, measured side by side in one run.

One micro-batch (``--rows`` x ``--seq-len`` tokens, every label scored) through a torchtune
decoder of ``--num-layers`` layers and ``--embed-dim`` width with the real vocabularies of the new
model families (Qwen3: 151,936, untied output; Gemma 3: 262,144, tied to the embedding), forward
and backward through ``exactga.sft.loss.causal_lm_loss`` as a recipe's loss step runs it:

- ``materialised``: ``torch.nn.CrossEntropyLoss`` on the whole fp32 logits tensor;
- ``chunked``: torchtune's ``CEWithChunkedOutputLoss`` (8 chunks; ``set_num_output_chunks``);
- ``fused``: ``exactga.accumulation.linear_cross_entropy.LinearCrossEntropyLoss`` (8 chunks);
- ``torch``: torch's own ``F.linear_cross_entropy`` (chunked path, ``reduction="none"``, 8
  chunks), where the installed torch has it; for comparison, not a recipe path.

    .venv/bin/python benchmarks/large_vocab_loss.py                    # CPU, fp32
    .venv/bin/python benchmarks/large_vocab_loss.py --device cuda      # bf16 autocast

``--architecture family`` builds the models themselves instead of a Llama stand-in of
``--embed-dim``: exactga's Qwen3 8B and Gemma 3 4B builders at their released widths, heads and
vocabularies (Qwen3's output untied, Gemma 3's tied to its 262,208-row embedding), cut to
``--num-layers`` layers, so a micro-batch meets the real output projection and attention
(Gemma 3's sliding window included). ``--json PATH`` also writes the table for
tools/gpu_check.py; ``--device cuda`` without a CUDA device measures nothing and says so.

Each variant runs in a process of its own, so one's allocations cannot inflate another's peak.
The peak is what the measured steps need above the resident model and its (already allocated)
gradients: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the process's peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs`` before the steps) less its resident set then.
Step time is the median over ``--steps`` forward+backward steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules import TiedLinear, TransformerDecoder
from torchtune.modules.loss import CEWithChunkedOutputLoss

from exactga.accumulation.linear_cross_entropy import LinearCrossEntropyLoss
from exactga.accumulation.loss_units import LOSS_POSITIONS, loss_positions, shift_labels
from exactga.models.gemma3 import BUILDER_ARGUMENTS as GEMMA3_SIZES
from exactga.models.gemma3 import gemma3
from exactga.models.qwen3 import BUILDER_ARGUMENTS as QWEN3_SIZES
from exactga.models.qwen3 import qwen3
from exactga.runtime.precision import Precision
from exactga.sft.loss import causal_lm_loss

MODELS = {  # name: (vocabulary, output tied to the embedding)
    "qwen3": (151_936, False),
    "gemma3": (262_144, True),
}
# --architecture family: name -> (its builder's arguments, the component builder).
FAMILY_SIZES = {
    "qwen3": (QWEN3_SIZES["qwen3_8b"], qwen3),
    "gemma3": (GEMMA3_SIZES["gemma3_4b"], gemma3),
}
ARCHITECTURES = ("stand_in", "family")
VARIANTS = ("materialised", "chunked", "fused", "torch")
NUM_CHUNKS = 8
MIB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--embed-dim", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="measured steps after a warm-up")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default=None,
        help="bf16: autocast over fp32 weights (master_weights: fp32). Default: fp32 on CPU, "
        "bf16 on CUDA",
    )
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="stand_in")
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one variant's JSON spec
    return parser.parse_args()


# --- one variant, in its own process ------------------------------------------------------------


def vocabulary(model: str, architecture: str) -> int:
    if architecture == "family":
        return FAMILY_SIZES[model][0]["vocab_size"]
    return MODELS[model][0]


def build_family_model(spec: dict[str, Any]) -> TransformerDecoder:
    """The released size's shape, ``num_layers`` deep (the first layers' kinds: Gemma 3's
    sliding-window layers come before its first global one, at layer 6)."""
    arguments, builder = FAMILY_SIZES[spec["model"]]
    arguments = {**arguments, "num_layers": spec["num_layers"], "max_seq_len": spec["seq_len"]}
    torch.manual_seed(0)
    with torch.device(spec["device"]):
        return builder(**arguments)


def build_model(spec: dict[str, Any]) -> TransformerDecoder:
    if spec["architecture"] == "family":
        return build_family_model(spec)
    vocab, tied = MODELS[spec["model"]]
    torch.manual_seed(0)
    with torch.device(spec["device"]):
        model = llama3_2(
            vocab_size=vocab,
            num_layers=spec["num_layers"],
            num_heads=spec["embed_dim"] // 64,
            num_kv_heads=spec["embed_dim"] // 128,
            embed_dim=spec["embed_dim"],
            intermediate_dim=4 * spec["embed_dim"],
            max_seq_len=spec["seq_len"],
            tie_word_embeddings=tied,
        )
    return model


def make_batch(spec: dict[str, Any], vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (spec["rows"], spec["seq_len"]), generator=generator)
    batch = {"tokens": tokens, "labels": tokens.clone()}  # every label scored
    batch[LOSS_POSITIONS] = loss_positions(batch["labels"])  # as every recipe's batch carries
    return {key: value.to(spec["device"]) for key, value in batch.items()}


class TorchLinearCrossEntropy(torch.nn.Module):
    """torch's ``F.linear_cross_entropy`` as the loss of a decoder: the decoder's ``unembed``
    returns the final-normed hidden states at the scored positions, the loss is taken on them."""

    ignore_index = -100

    def loss(self, model: TransformerDecoder, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        positions = batch.pop(LOSS_POSITIONS)
        labels = shift_labels(batch.pop("labels")).reshape(-1).index_select(0, positions)
        model.unembed = lambda h: model.norm(h.reshape(-1, h.size(-1)).index_select(0, positions))
        try:
            hidden = model(**batch)
        finally:
            del model.unembed
        output = model.output
        weight = output.tied_module.weight if isinstance(output, TiedLinear) else output.weight
        if torch.is_autocast_enabled(hidden.device.type):  # the op takes no autocast
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        chunk = -(-hidden.size(0) // NUM_CHUNKS)
        options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk, chunking_method=None)
        losses = F.linear_cross_entropy(
            hidden, weight, labels, reduction="none", ignore_index=-100, options=options
        )
        return losses.float().sum() / (labels != -100).sum()


def loss_fn_for(variant: str, model: TransformerDecoder) -> torch.nn.Module:
    if variant == "materialised":
        return torch.nn.CrossEntropyLoss()
    if variant == "chunked":
        model.set_num_output_chunks(NUM_CHUNKS)
        return CEWithChunkedOutputLoss(num_output_chunks=NUM_CHUNKS)
    if variant == "fused":
        return LinearCrossEntropyLoss(num_output_chunks=NUM_CHUNKS)
    if not hasattr(F, "linear_cross_entropy"):
        raise SystemExit(f"torch {torch.__version__} has no F.linear_cross_entropy")
    return TorchLinearCrossEntropy()


def step(model, loss_fn, batch, precision: Precision | None) -> float:
    batch = dict(batch)
    if isinstance(loss_fn, TorchLinearCrossEntropy):
        autocast = precision.autocast() if precision else contextlib.nullcontext()
        with autocast:
            loss = loss_fn.loss(model, batch)
    else:
        loss = causal_lm_loss(model, loss_fn, batch, precision=precision).main
    loss.backward()
    return loss.item()


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


@contextlib.contextmanager
def peak_above_now(device: str) -> Iterator[dict[str, float]]:
    """Yields a dict that holds, after the block, the peak bytes it needed above what was
    allocated (CUDA) or resident (CPU) when it began."""
    result: dict[str, float] = {}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield result
        torch.cuda.synchronize()
        result["peak"] = torch.cuda.max_memory_allocated() - base
        return
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the present resident set
    base = _status_bytes("VmRSS:")
    yield result
    result["peak"] = _status_bytes("VmHWM:") - base


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    model = build_model(spec)
    batch = make_batch(spec, vocabulary(spec["model"], spec["architecture"]))
    loss_fn = loss_fn_for(spec["variant"], model)
    precision = None
    if spec["precision"] == "bf16":
        precision = Precision(torch.bfloat16, torch.float32, spec["device"])
    step(model, loss_fn, batch, precision)  # warm-up; allocates every gradient
    model.zero_grad(set_to_none=False)  # gradients stay allocated: part of the baseline
    times, losses = [], []
    with peak_above_now(spec["device"]) as memory:
        for _ in range(spec["steps"]):
            start = time.perf_counter()
            losses.append(step(model, loss_fn, batch, precision))
            if spec["device"] == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=False)
    return {"peak_mib": memory["peak"] / MIB, "step_s": statistics.median(times), "loss": losses[0]}


# --- the run: every variant side by side --------------------------------------------------------


def measure(args: argparse.Namespace, model: str, variant: str) -> dict[str, Any]:
    spec = {
        "model": model,
        "variant": variant,
        "device": args.device,
        "precision": args.precision,
        "architecture": args.architecture,
        **{key: getattr(args, key) for key in ("rows", "seq_len", "embed_dim", "num_layers")},
        "steps": args.steps,
    }
    command = [sys.executable, __file__, "--worker", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[tuple[str, str, dict[str, Any]]], architecture: str) -> list[str]:
    columns = ["model", "vocab", "loss", "peak above model (MiB)", "x materialised"]
    columns += ["step (s)", "x materialised", "loss value"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    baselines = {model: result for model, variant, result in rows if variant == "materialised"}
    for model, variant, result in rows:
        vocab = f"{vocabulary(model, architecture):,}"
        if "error" in result:
            lines.append(f"| {model} | {vocab} | {variant} | {result['error']} |||||")
            continue
        base = baselines.get(model, {})
        memory_ratio = _ratio(result["peak_mib"], base.get("peak_mib"))
        time_ratio = _ratio(result["step_s"], base.get("step_s"))
        lines.append(
            f"| {model} | {vocab} | {variant} | {result['peak_mib']:,.0f} | {memory_ratio} "
            f"| {result['step_s']:.2f} | {time_ratio} | {result['loss']:.6f} |"
        )
    return lines


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        print("large_vocab_loss: no CUDA device; nothing measured.")
        write_json(args, {"markdown": "No CUDA device: nothing measured."})
        return
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    width = "the released widths" if args.architecture == "family" else f"embed {args.embed_dim}"
    heading = (
        f"{device_name}, torch {torch.__version__}, {args.precision}, {args.rows} x "
        f"{args.seq_len} tokens, {args.architecture} models ({width}), {args.num_layers} "
        f"layers, {torch.get_num_threads()} threads, median of {args.steps} steps"
    )
    print(f"# {heading}")
    rows = []
    for model in args.models:
        for variant in args.variants:
            rows.append((model, variant, measure(args, model, variant)))
            print(f"# {model} {variant}: {rows[-1][2]}", file=sys.stderr, flush=True)
    lines = table(rows, args.architecture)
    print("\n".join(lines))
    results = [{"model": m, "variant": v, **result} for m, v, result in rows]
    write_json(
        args,
        {
            "device": device_name,
            "rows": results,
            "markdown": "\n".join([f"Measured on {heading}.", "", *lines]),
        },
    )


def write_json(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    if args.json:
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
