"""Packed rows' attention, per document against the dense mask, side by side in one process.

``benchmarks/micro_batching.py`` times whole runs, one configuration after another, so a shared
machine's changing load lands on them unevenly. This one times the two attention paths of
``micro_batching: packed`` (exactga.runtime.document_attention) on the very same rows in one
process, alternating A B B A row by row so that a change in load hits both alike: the
config's model (default the tiny config's, fp32), the bundled data tokenized at
``tokenizer.max_seq_len``, each window of ``--window`` samples packed into rows of ``--row``
positions as the recipe packs them (first-fit decreasing, then the padding; the windows in the
data file's order, not the sampler's), and per row one forward and backward of the documents'
summed logits (the padding's weigh nothing, as its ignored labels weigh nothing in a loss):

- ``per_document``: the row's ``DocumentLengths`` (each document attended alone, the padding
  not at all);
- ``dense``: the same row under torchtune's dense ``(1, N, N)`` block-causal mask (the padding
  one more document).

It prints the median over rows of each path's time, the ratio of their total times, and the
logits' and gradients' largest relative difference (the paths compute the same thing).

Run from the repository root::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/packed_attention.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torchtune import config
from torchtune.modules.attention_utils import create_block_causal_mask

from exactga.data.loader import load_dataset
from exactga.data.micro_batching import first_fit_decreasing
from exactga.data.packing import pack_samples
from exactga.runtime.document_attention import accept_document_lengths

REPO_ROOT = Path(__file__).resolve().parents[1]


def packed_rows(args: argparse.Namespace) -> tuple[list[dict], int]:
    """The first ``--rows`` rows the recipe would pack from the config's data, and its vocab."""
    cfg = OmegaConf.load(REPO_ROOT / args.config)
    cfg.tokenizer.max_seq_len = args.max_seq_len
    vocab = cfg.model.vocab_size
    dataset = load_dataset(cfg.dataset, config.instantiate(cfg.tokenizer), vocab_size=vocab)
    rows: list[dict] = []
    for start in range(0, len(dataset), args.window):
        samples = [dataset[i] for i in range(start, min(start + args.window, len(dataset)))]
        for row in first_fit_decreasing([len(s["tokens"]) for s in samples], args.row):
            rows.append(pack_samples([samples[i] for i in row], capacity=args.row))
            if len(rows) == args.rows:
                return rows, vocab
    return rows, vocab


def spans(row: dict) -> list[int]:
    """The row's documents' lengths, then its padding's (a negative length in its mask)."""
    return [abs(length) for length in row["mask"].tolist()[0]]


def dense_mask(row: dict) -> torch.Tensor:
    """The row's dense block-causal mask, the padding one more document."""
    return create_block_causal_mask([torch.tensor(spans(row))])


def forward_backward(model: torch.nn.Module, row: dict, mask) -> tuple[float, torch.Tensor, list]:
    """Seconds of one forward and backward of the documents' summed logits (the padding's weigh
    nothing, as in a loss), those logits, the grads."""
    model.zero_grad(set_to_none=True)
    documents = sum(length for length in row["mask"].tolist()[0] if length > 0)
    start = time.perf_counter()
    logits = model(row["tokens"], mask=mask, input_pos=row["input_pos"])[:, :documents]
    logits.sum().backward()
    seconds = time.perf_counter() - start
    return seconds, logits.detach(), [p.grad.clone() for p in model.parameters()]


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny/full_single_device.yaml")
    parser.add_argument("--max-seq-len", type=int, default=512, help="tokenizer.max_seq_len")
    parser.add_argument("--window", type=int, default=64, help="samples per window")
    parser.add_argument("--row", type=int, default=1024, help="positions per packed row")
    parser.add_argument("--rows", type=int, default=24, help="rows timed")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, _ = packed_rows(args)
    cfg_model = OmegaConf.load(REPO_ROOT / args.config).model
    cfg_model.max_seq_len = args.row
    torch.manual_seed(0)
    model = accept_document_lengths(config.instantiate(cfg_model))
    forward_backward(model, rows[0], rows[0]["mask"])  # warm-up, both paths
    forward_backward(model, rows[0], dense_mask(rows[0]))
    times: dict[str, list[float]] = {"per_document": [], "dense": []}
    worst_logits = worst_grad = 0.0
    load_before = os.getloadavg()
    for index, row in enumerate(rows):
        dense = dense_mask(row)
        order = [("per_document", row["mask"]), ("dense", dense)]
        results = {}
        for name, mask in order if index % 2 == 0 else order[::-1]:  # A B, then B A
            seconds, logits, grads = forward_backward(model, row, mask)
            times[name].append(seconds)
            results[name] = (logits, grads)
        (ours, our_grads), (theirs, their_grads) = results["per_document"], results["dense"]
        worst_logits = max(worst_logits, relative_difference(ours, theirs))
        pairs = zip(our_grads, their_grads, strict=True)
        worst_grad = max(worst_grad, *(relative_difference(a, b) for a, b in pairs))
    load_after = os.getloadavg()
    documents = [len(spans(row)) for row in rows]
    print(
        f"# {args.config}, rows of {args.row} from windows of {args.window} samples at "
        f"tokenizer.max_seq_len={args.max_seq_len}; {len(rows)} rows of "
        f"{min(documents)} to {max(documents)} spans (the padding one of them); "
        f"torch {torch.__version__}, {args.threads} thread(s); load average before "
        f"{load_before[0]:.2f}, after {load_after[0]:.2f}"
    )
    for name, values in times.items():
        print(f"{name}: median {1e3 * statistics.median(values):.0f} ms per row (fwd + bwd)")
    ratio = sum(times["dense"]) / sum(times["per_document"])
    print(f"dense / per_document, total time: {ratio:.2f}x")
    print(f"largest relative difference: logits {worst_logits:.1e}, gradients {worst_grad:.1e}")


if __name__ == "__main__":
    main()
