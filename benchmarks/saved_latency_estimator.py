"""How far the recipes' saved-latency estimate lands from the full gradient pass it estimates.

The recipes never run stock torchtune's full gradient-scaling pass: they time it on a few
subsets of the gradients and estimate the full pass (see [saved latency] in
``exactga.profiling``). This script builds torchtune ``llama3_2`` models of three sizes with
random gradients, times the full pass and each of the recipes' samples (the same subsets, the
same timing function, the same estimate), and prints the estimate's error. Each timing is a
median of ``--timings`` runs with the caches flushed before each (writing 256 MB), since a
training step leaves the gradients out of cache.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/saved_latency_estimator.py
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torchtune.models.llama3_2 import llama3_2

from exactga.profiling import (
    SAVED_LATENCY_NUM_SAMPLES,
    SavedLatencySample,
    sample_gradients,
    time_scaling_pass,
)

# name -> llama3_2 builder arguments (max_seq_len 256 everywhere)
MODELS = {
    "0.4M (the tests' tiny size)": dict(
        vocab_size=2048, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2,
        intermediate_dim=128,
    ),
    "3.7M (the tiny config)": dict(
        vocab_size=2048, num_layers=4, embed_dim=256, num_heads=4, num_kv_heads=2,
        intermediate_dim=768,
    ),
    "32.5M": dict(
        vocab_size=8192, num_layers=8, embed_dim=512, num_heads=8, num_kv_heads=4,
        intermediate_dim=2048,
    ),
}  # fmt: skip

CPU = torch.device("cpu")
_FLUSH = torch.empty(64 * 2**20)  # 256 MB


def cold_ms(grads: list[torch.Tensor], timings: int) -> float:
    """Median milliseconds of the scaling pass over ``grads``, caches flushed before each."""
    times = []
    for _ in range(timings):
        _FLUSH.fill_(1.0)
        times.append(time_scaling_pass(grads, CPU))
    return statistics.median(times)


def random_gradients(sizes: dict) -> list[torch.Tensor]:
    model = llama3_2(max_seq_len=256, **sizes)
    grads = []
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
        grads.append(parameter.grad)
    return grads


def estimates(grads: list[torch.Tensor], timings: int) -> list[float]:
    """The recipes' estimate of the full pass from each of their samples."""
    result = []
    for index in range(SAVED_LATENCY_NUM_SAMPLES):
        subset = sample_gradients(grads, index)
        sample = SavedLatencySample(
            step=index,
            measured_ms=cold_ms(subset, timings),
            num_elements=sum(g.numel() for g in subset),
            num_tensors=len(subset),
            total_elements=sum(g.numel() for g in grads),
            total_tensors=len(grads),
        )
        result.append(sample.estimate_ms)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timings", type=int, default=21, help="timings per median")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} thread(s); median of {args.timings} cold timings each")
    print("| model | tensors | full pass ms | median estimate ms (samples' range) | error |")
    print("|---|---|---|---|---|")
    for name, sizes in MODELS.items():
        grads = random_gradients(sizes)
        full = cold_ms(grads, args.timings)
        found = estimates(grads, args.timings)
        median = statistics.median(found)
        print(
            f"| {name} | {len(grads)} | {full:.2f} | {median:.2f} ({min(found):.2f}-"
            f"{max(found):.2f}) | {(median - full) / full:+.0%} |"
        )


if __name__ == "__main__":
    main()
