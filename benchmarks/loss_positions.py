"""Logits only at loss positions against the full projection, side by side in one process.

One micro-batch of the tiny config's model (torchtune's ``llama3_2`` builder), forward and
backward through ``exactga.sft.loss.causal_lm_loss`` twice per repeat: once with the batch's
index of scored positions (what every recipe does; see [logits only at loss positions]) and
once without it (the full projection, as stock torchtune). Prints the median time of each, their
ratio, and how far the two gradients are apart (relative L2, which must sit at the fp32 floor).

    .venv/bin/python benchmarks/loss_positions.py                      # the tiny config's shape
    .venv/bin/python benchmarks/loss_positions.py --vocab 32768 --scored 0.3

The batch's rows have a prompt (ignored labels) and right padding chosen so that ``--scored`` of
its positions carry a loss label. Timings are wall time on this process's threads
(``OMP_NUM_THREADS``); the two variants alternate, so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss

from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    LOSS_POSITIONS,
    count_loss_tokens,
    loss_positions,
)
from exactga.sft.loss import causal_lm_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=300)
    parser.add_argument("--scored", type=float, default=0.4, help="share of scored positions")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--embed-dim", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    model = llama3_2(
        vocab_size=args.vocab,
        num_layers=args.num_layers,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=args.embed_dim,
        intermediate_dim=3 * args.embed_dim,
        max_seq_len=max(512, args.seq_len),
        tie_word_embeddings=True,
    )
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    return model


def prompt_masked_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Ragged, right-padded rows, each scoring its last ``args.scored * seq_len`` tokens."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=generator)
    labels = tokens.clone()
    for row in range(args.batch_size):
        length = args.seq_len - row * args.seq_len // (2 * args.batch_size)  # ragged rows
        answer = min(max(2, round(args.scored * args.seq_len)), length - 1)
        labels[row, : length - answer] = IGNORE_INDEX
        labels[row, length:] = IGNORE_INDEX
        tokens[row, length:] = 0
    return {"tokens": tokens, "labels": labels}


def step(model, loss_fn, batch, cut: bool) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    batch = dict(batch)
    if cut:
        batch[LOSS_POSITIONS] = loss_positions(batch["labels"])
    start = time.perf_counter()
    causal_lm_loss(model, loss_fn, batch).backward()
    elapsed = time.perf_counter() - start
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return elapsed, grads.double()


def main() -> None:
    args = parse_args()
    model = build_model(args)
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    batch = prompt_masked_batch(args)
    scored = count_loss_tokens(batch["labels"]) / batch["tokens"].numel()
    times: dict[bool, list[float]] = {False: [], True: []}
    grads: dict[bool, torch.Tensor] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for cut in (False, True) if repeat % 2 else (True, False):
            elapsed, grads[cut] = step(model, loss_fn, batch, cut)
            if repeat:
                times[cut].append(elapsed)
    full, cut = statistics.median(times[False]), statistics.median(times[True])
    rel_l2 = ((grads[True] - grads[False]).norm() / grads[False].norm()).item()
    print(
        f"batch {args.batch_size} x {args.seq_len}, {scored:.0%} of positions scored, "
        f"vocab {args.vocab}, width {args.embed_dim}, {args.num_layers} layers, "
        f"{torch.get_num_threads()} thread(s), median of {args.repeats}"
    )
    print(f"full projection     {full * 1e3:8.1f} ms")
    print(f"loss positions only {cut * 1e3:8.1f} ms   ({full / cut:.2f}x)")
    print(f"gradients apart by a relative L2 of {rel_l2:.1e}")


if __name__ == "__main__":
    main()
