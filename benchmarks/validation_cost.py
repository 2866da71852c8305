"""What validation during training costs: one validation call against one optimizer step.

For each model it times, in this one process and side by side, (a) one training optimizer step
of the fine-tuning recipes' exact step, written out plainly (each micro-batch's mean token loss
through ``exactga.sft.loss.mean_token_loss``, weighed by its share of the window's tokens,
backward; gradient clipping at 1.0; ``AdamW.step``; gradients zeroed), and (b) one
``exactga.sft.validation.validation_loss`` call on a ``ValidationSet``, as ``_validate_if_due``
makes it, once over the whole set and once bounded by ``max_val_batches``. It prints the
validation time per call and its share of training time when validating every
``run_val_every_n_steps`` = 50 steps: ``val_ms / (50 * step_ms)``; also milliseconds per scored
token, training's and validation's, which say where the difference comes from.

- ``tiny``: configs/tiny/full_single_device.yaml's model (4 layers, width 256, vocabulary 2048,
  tied embeddings), fp32, ``batch_size`` 4 x ``gradient_accumulation_steps`` 2, the tiny
  tokenizer at ``max_seq_len`` 256; validation on 256 rows at ``batch_size_val`` 4, bounded by
  ``max_val_batches`` 8 (32 rows).
- ``1B``: torchtune's ``llama3_2_1b`` shape (16 layers, width 2048, vocabulary 128,256, 1.24B
  parameters), bf16 weights and optimizer state as torchtune's 1B configs train (``dtype:
  bf16``). On a CPU it runs short rows (the tiny tokenizer at ``max_seq_len`` 128, the
  shortest at which the first rows keep answer tokens after their masked prompts; its ids fit
  the large vocabulary) and few of them, so that it finishes in minutes: ``batch_size`` 1 x
  ``gradient_accumulation_steps`` 2; validation on 8 rows at ``batch_size_val`` 2, bounded by
  ``max_val_batches`` 1 (2 rows); one repeat of one step (a CPU step takes a minute or more).

Both take the loss of the tiny config, torchtune's ``CEWithChunkedOutputLoss`` (8 output chunks),
and the rows of configs/tiny/data.json (alpaca template, prompts masked): training windows from
the file's start, the validation set from row 1,000 on, never shuffled. The model, its seed (0)
and the rows are fixed. After one warm-up of the step and of the bounded call, every repeat
times ``--steps`` training steps (their mean), the whole-set call and the bounded call, in an
order reversed every other repeat so that a change in machine load hits each alike; the table
gives each one's median over ``--repeats``. Validation tokenizes its rows on access, as the
recipes' datasets do, and that time is in its figure; the training window is collated once,
outside the timed step, so the share is if anything overstated.

Run from the repository root (default: both models; about 3 minutes on 2 CPU cores, the tiny
model 20 s idle to 100 s under load, the 1B one 90 s or more)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/validation_cost.py

``--quick``: the tiny model only, 2 repeats (seconds). ``--device cuda`` runs on a GPU (the 1B
model then at ``max_seq_len`` 1024 unless ``--seq-len-1b`` says otherwise).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, Subset
from torchtune import training, utils
from torchtune.datasets import alpaca_dataset
from torchtune.models.llama2 import llama2_tokenizer
from torchtune.models.llama3_2 import llama3_2, llama3_2_1b
from torchtune.modules.loss import CEWithChunkedOutputLoss

from exactga.accumulation.loss_units import IGNORE_INDEX, ShiftedTokens
from exactga.data.collation import micro_batch_collate
from exactga.data.micro_batching import MicroBatchingSettings
from exactga.sft.loss import mean_token_loss
from exactga.sft.validation import ValidationLoss, validation_loss
from exactga.validation.held_out import ValidationSet

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = REPO_ROOT / "configs/tiny/tokenizer.model"
DATA = REPO_ROOT / "configs/tiny/data.json"
VAL_EVERY = 50  # run_val_every_n_steps of the share column
VAL_START = 1000  # the validation rows are the file's from here on
OUTPUT_CHUNKS = 8  # CEWithChunkedOutputLoss's default
SEED = 0


@dataclass(frozen=True)
class Shape:
    """One model of the table and the sizes it is timed at."""

    name: str
    build: Callable[[], nn.Module]
    dtype: torch.dtype
    seq_len: int  # the tokenizer's max_seq_len
    batch_size: int
    grad_accum: int
    val_rows: int
    batch_size_val: int
    max_val_batches: int
    timed_once: bool = False  # one repeat of one step, whatever --repeats and --steps say


def tiny_model() -> nn.Module:
    """configs/tiny/full_single_device.yaml's ``model`` section."""
    return llama3_2(
        vocab_size=2048,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=256,
        intermediate_dim=768,
        max_seq_len=512,
        tie_word_embeddings=True,
    )


def shapes(args: argparse.Namespace) -> list[Shape]:
    tiny = Shape("tiny", tiny_model, torch.float32, 256, 4, 2, 256, 4, 8)
    one_b = Shape("1B", llama3_2_1b, torch.bfloat16, args.seq_len_1b, 1, 2, 8, 2, 1, True)
    return [tiny] if args.quick else [tiny, one_b]


def dataset(seq_len: int) -> Dataset:
    """configs/tiny's training data, tokenized on access by the tiny tokenizer."""
    tokenizer = llama2_tokenizer(str(TOKENIZER), max_seq_len=seq_len, prompt_template=None)
    return alpaca_dataset(
        tokenizer, source="json", data_files=str(DATA), split="train", train_on_input=False
    )


def collate_for(batch_size: int) -> Callable:
    return micro_batch_collate(
        MicroBatchingSettings(batch_size=batch_size),
        "torchtune.data.padded_collate_sft",
        padding_idx=0,
        ignore_idx=IGNORE_INDEX,
    )


class TrainingStep:
    """The exact optimizer step on a fixed window, repeated: the window is collated once."""

    def __init__(self, model: nn.Module, loss_fn: nn.Module, shape: Shape, data: Dataset):
        self.model = model
        self.loss_fn = loss_fn
        self.units = ShiftedTokens(loss_fn)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
        collate = collate_for(shape.batch_size)
        self.micro_batches = [
            collate([data[i] for i in range(start, start + shape.batch_size)])
            for start in range(0, shape.batch_size * shape.grad_accum, shape.batch_size)
        ]
        self.counts = [self.units.count(batch) for batch in self.micro_batches]
        self.tokens = sum(self.counts)

    def run(self, device: torch.device) -> None:
        self.model.train()
        for batch, count in zip(self.micro_batches, self.counts, strict=True):
            batch = self.units.prepare(batch, count, runs_empty=False)
            utils.batch_to_device(batch, device)
            loss = mean_token_loss(self.model, self.loss_fn, batch)
            (loss * (count / self.tokens)).backward()  # the window's token mean
        nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Row:
    name: str
    step_ms: float
    step_tokens: int
    val_ms: float
    val_rows: int
    val_tokens: int


def measure(shape: Shape, args: argparse.Namespace, device: torch.device) -> list[Row]:
    """The shape's step and its two validation calls, timed side by side."""
    repeats, steps = (1, 1) if shape.timed_once else (args.repeats, args.steps)
    torch.manual_seed(SEED)
    with training.set_default_dtype(shape.dtype), device:
        model = shape.build()
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=OUTPUT_CHUNKS)
    model.set_num_output_chunks(OUTPUT_CHUNKS)
    data = dataset(shape.seq_len)
    step = TrainingStep(model, loss_fn, shape, data)
    val_rows = Subset(data, range(VAL_START, VAL_START + shape.val_rows))
    sets = {
        "whole set": ValidationSet(
            val_rows, batch_size=shape.batch_size_val, collate=collate_for(shape.batch_size_val)
        ),
        f"max_val_batches={shape.max_val_batches}": ValidationSet(
            val_rows,
            batch_size=shape.batch_size_val,
            collate=collate_for(shape.batch_size_val),
            max_batches=shape.max_val_batches,
        ),
    }
    figures: dict[str, ValidationLoss] = {}

    def validate(name: str) -> float:
        def call() -> None:
            figures[name] = validation_loss(model, loss_fn, sets[name], device=device)

        return seconds(call, device)

    def train() -> float:
        return sum(seconds(lambda: step.run(device), device) for _ in range(steps)) / steps

    step.run(device)  # warm-up: the optimizer's state made
    validate(list(sets)[-1])  # warm-up, on the bounded (smaller) set
    timers: dict[str, Callable[[], float]] = {
        "step": train,
        **{name: (lambda name=name: validate(name)) for name in sets},
    }
    times: dict[str, list[float]] = {name: [] for name in timers}
    for repeat in range(repeats):
        order = list(timers) if repeat % 2 == 0 else list(reversed(timers))
        for name in order:
            times[name].append(timers[name]())
    step_ms = statistics.median(times["step"]) * 1e3
    return [
        Row(
            name=f"{shape.name}, {name}",
            step_ms=step_ms,
            step_tokens=step.tokens,
            val_ms=statistics.median(times[name]) * 1e3,
            val_rows=figures[name].num_samples,
            val_tokens=figures[name].num_tokens,
        )
        for name in sets
    ]


def conditions(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    return (
        f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs; load average before {load}"
    )


def print_table(rows: list[Row]) -> None:
    header = (
        "| model, validation set | step ms | val ms per call | val / step | share at every "
        f"{VAL_EVERY} steps | rows, tokens validated | ms/token train | ms/token val |"
    )
    print(header)
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        share = r.val_ms / (VAL_EVERY * r.step_ms)
        print(
            f"| {r.name} | {r.step_ms:,.1f} | {r.val_ms:,.1f} | {r.val_ms / r.step_ms:.2f} | "
            f"{share:.2%} | {r.val_rows}, {r.val_tokens:,} | {r.step_ms / r.step_tokens:.3f} | "
            f"{r.val_ms / r.val_tokens:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="training steps per repeat")
    parser.add_argument("--quick", action="store_true", help="tiny model only, 2 repeats")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len-1b", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    if args.seq_len_1b is None:
        args.seq_len_1b = 128 if device.type == "cpu" else 1024
    print(conditions(device), flush=True)
    rows: list[Row] = []
    for shape in shapes(args):
        started = time.perf_counter()
        rows += measure(shape, args, device)
        print(f"{shape.name}: measured in {time.perf_counter() - started:.0f} s", flush=True)
    once = "" if args.quick else "; 1B: one repeat of one step"
    print(f"tiny: median of {args.repeats} repeats, a step the mean of {args.steps}{once}")
    print_table(rows)


if __name__ == "__main__":
    main()
