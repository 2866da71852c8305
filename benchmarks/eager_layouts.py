"""Eager step time of a window under ``token_budget`` against ``packed``, side by side in one
process.

``benchmarks/micro_batching.py`` times whole runs one after another, and on a shared machine
their step times swing more than the layouts differ. This one trains nothing: it times one
forward and backward of every micro-batch of the same windows under each layout, in one
process, the layouts' order reversed every other window (A B C, then C B A) so that a change in
load hits each alike. The config's model (default the tiny config's, fp32) on the bundled data
tokenized at ``tokenizer.max_seq_len``, each window of ``--window`` samples (in the data file's
order, not the sampler's) split as the recipe splits it (exactga.data.micro_batching):

- ``token_budget``: micro-batches of at most ``--budget`` padded positions, longest first,
  padded to their longest sample (torchtune's ``padded_collate_sft``);
- ``packed``: rows of ``--row`` positions, first-fit decreasing, each document attended alone
  and the padding not at all (exactga.runtime.document_attention);
- ``packed_m<m>``: the same rows with ``pad_to_multiple_of: m`` (``--multiple``), which trims
  each row's unfilled end.

The loss of a micro-batch is the sum of its tokens' cross-entropies on the labels after the
shift, as the recipes' exact normalisation sums it. It prints per layout the total time over the
windows, the positions processed and their padding share, then each packed layout's time over
``token_budget``'s: in total, and window by window (the median of the windows' ratios, their
quartiles, and in how many windows the packed layout was the faster), since a ratio of totals
hides how much the machine moved between windows.

Run from the repository root::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/eager_layouts.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchtune import config
from torchtune.data import padded_collate_sft

from exactga.accumulation.loss_units import IGNORE_INDEX, shift_labels
from exactga.config.options import MicroBatching
from exactga.data.loader import load_dataset
from exactga.data.micro_batching import (
    MicroBatchingSettings,
    first_fit_decreasing,
    plan_micro_batches,
)
from exactga.data.packing import pack_samples
from exactga.runtime.document_attention import instantiate_model

REPO_ROOT = Path(__file__).resolve().parents[1]
Layout = Callable[[list[dict]], list[dict]]


def windows(args: argparse.Namespace) -> list[list[dict]]:
    """The first ``--windows`` windows of ``--window`` samples of the config's data."""
    cfg = OmegaConf.load(REPO_ROOT / args.config)
    cfg.tokenizer.max_seq_len = args.max_seq_len
    dataset = load_dataset(cfg.dataset, config.instantiate(cfg.tokenizer), cfg.model.vocab_size)
    starts = range(0, args.windows * args.window, args.window)
    return [[dataset[i] for i in range(start, start + args.window)] for start in starts]


def token_budget(budget: int) -> Layout:
    settings = MicroBatchingSettings(MicroBatching.TOKEN_BUDGET, micro_batch_tokens=budget)

    def split(samples: list[dict]) -> list[dict]:
        groups = plan_micro_batches([len(s["tokens"]) for s in samples], settings)
        return [padded_collate_sft([samples[i] for i in group]) for group in groups]

    return split


def packed(row: int, multiple: int | None) -> Layout:
    def split(samples: list[dict]) -> list[dict]:
        rows = first_fit_decreasing([len(s["tokens"]) for s in samples], row)
        return [
            pack_samples([samples[i] for i in r], capacity=row, pad_to_multiple_of=multiple)
            for r in rows
        ]

    return split


def forward_backward(model: torch.nn.Module, micro_batches: list[dict]) -> float:
    """Seconds of one forward and backward of each micro-batch's summed token loss."""
    model.zero_grad(set_to_none=True)
    start = time.process_time()  # CPU time: a shared machine's load inflates wall time
    for batch in micro_batches:
        logits = model(batch["tokens"], mask=batch.get("mask"), input_pos=batch.get("input_pos"))
        labels = shift_labels(batch["labels"])
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        loss.backward()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny/full_single_device.yaml")
    parser.add_argument("--max-seq-len", type=int, default=512, help="tokenizer.max_seq_len")
    parser.add_argument("--window", type=int, default=64, help="samples per window")
    parser.add_argument("--windows", type=int, default=6, help="windows timed")
    parser.add_argument("--budget", type=int, default=1024, help="token_budget's positions")
    parser.add_argument("--row", type=int, default=1024, help="positions per packed row")
    parser.add_argument("--multiple", type=int, default=64, help="packed_m<m>'s multiple")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layouts: dict[str, Layout] = {
        "token_budget": token_budget(args.budget),
        "packed": packed(args.row, None),
        f"packed_m{args.multiple}": packed(args.row, args.multiple),
    }
    cfg_model = OmegaConf.load(REPO_ROOT / args.config).model
    cfg_model.max_seq_len = max(args.row, args.max_seq_len)
    torch.manual_seed(0)
    model = instantiate_model(cfg_model)
    data = windows(args)
    split = {name: [layout(w) for w in data] for name, layout in layouts.items()}
    for name in layouts:  # warm-up, each layout
        forward_backward(model, split[name][0])
    per_window: dict[str, list[float]] = {name: [] for name in layouts}
    load_before = os.getloadavg()
    for index in range(len(data)):
        order = list(layouts) if index % 2 == 0 else list(layouts)[::-1]
        for name in order:
            per_window[name].append(forward_backward(model, split[name][index]))
    load_after = os.getloadavg()
    seconds = {name: sum(times) for name, times in per_window.items()}
    print(
        f"# {args.config}, {len(data)} windows of {args.window} samples at "
        f"tokenizer.max_seq_len={args.max_seq_len}; torch {torch.__version__}, {args.threads} "
        f"thread(s); load average before {load_before[0]:.2f}, after {load_after[0]:.2f}"
    )
    for name in layouts:
        positions = sum(b["tokens"].numel() for w in split[name] for b in w)
        real = sum(len(s["tokens"]) for w in data for s in w)
        print(
            f"{name}: {seconds[name]:.2f} s, {positions:,} positions "
            f"({100 * (1 - real / positions):.1f}% padding)"
        )
    for name in list(layouts)[1:]:
        print(f"{name} / token_budget, total time: {seconds[name] / seconds['token_budget']:.3f}x")
    for name in list(layouts)[1:]:
        print(window_by_window(name, per_window[name], per_window["token_budget"]))


def window_by_window(name: str, times: list[float], budget_times: list[float]) -> str:
    """``name``'s time over ``token_budget``'s, each window against the same window: the median
    ratio, its quartiles, and the windows in which ``name`` was the faster."""
    ratios = sorted(t / b for t, b in zip(times, budget_times, strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    faster = sum(ratio < 1 for ratio in ratios)
    return (
        f"{name} / token_budget, window by window: median {statistics.median(ratios):.3f}x "
        f"(quartiles {quartiles[0]:.3f}x to {quartiles[2]:.3f}x), faster in {faster} of "
        f"{len(ratios)} windows"
    )


if __name__ == "__main__":
    main()
