"""How much the gathered expert path saves over the obvious masked one, on CPU.

One :class:`~exactga.models.moe.GroupedExperts` (random fp32 weights) and random top-k routing
of ``tokens`` tokens, timed forward + backward two ways, side by side in one run:

- ``gathered``: the layer's own CPU path (``expert_path="loop"``): assignments sorted by expert,
  each expert's matmuls on its own tokens only (``tokens * top_k`` rows in all);
- ``masked``: every expert on every token, its output kept where routed (``tokens *
  num_experts`` rows): what a first implementation does.

Both give the same numbers (tests/test_models_qwen3_moe.py checks it); the ratio is
``masked / gathered`` wall time, the median of ``--repeats`` timed runs after one warm-up.
``torch._grouped_mm`` is not timed: the layer takes it on CUDA (bf16, sm90+) only.

    .venv/bin/python benchmarks/moe_experts.py
    .venv/bin/python benchmarks/moe_experts.py --threads 2 --repeats 5

Wall time, so the machine's load weighs on both columns alike (they alternate per repeat).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from exactga.models.moe import GroupedExperts, StackedLinear

# (tokens, dim, expert hidden dim, experts, top_k): Qwen3-30B-A3B's routing (128 experts, top-8)
# at a small width, then fewer experts, then a wider layer.
SHAPES = [
    (512, 128, 64, 128, 8),
    (1024, 128, 64, 32, 4),
    (1024, 256, 128, 8, 2),
    (1024, 256, 128, 64, 8),
]


def masked_experts(
    experts: GroupedExperts, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token, weighted by its routing weight (0 where not routed)."""
    output = torch.zeros_like(x)
    w1, w2, w3 = experts.w1.per_expert(), experts.w2.per_expert(), experts.w3.per_expert()
    for index in range(experts.num_experts):
        hidden = F.silu(w1[index](x)) * w3[index](x)
        routed_weight = (weights * (indices == index)).sum(dim=-1, keepdim=True)
        output = output + routed_weight * w2[index](hidden)
    return output


def time_forward_backward(run: Callable[[], torch.Tensor], upstream: torch.Tensor) -> float:
    start = time.perf_counter()
    run().backward(upstream)
    return time.perf_counter() - start


def measure(shape: tuple[int, int, int, int, int], repeats: int) -> tuple[float, float]:
    num_tokens, dim, hidden, num_experts, top_k = shape
    torch.manual_seed(0)
    experts = GroupedExperts(
        StackedLinear(num_experts, dim, hidden),
        StackedLinear(num_experts, hidden, dim),
        StackedLinear(num_experts, dim, hidden),
        path="loop",
    )
    x = torch.randn(num_tokens, dim, requires_grad=True)
    logits = torch.randn(num_tokens, num_experts)
    weights, indices = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    upstream = torch.randn(num_tokens, dim)
    runs = {
        "gathered": lambda: experts(x, indices, weights),
        "masked": lambda: masked_experts(experts, x, indices, weights),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        for name, run in runs.items():
            elapsed = time_forward_backward(run, upstream)
            if repeat:  # the first round warms up
                times[name].append(elapsed)
    return statistics.median(times["gathered"]), statistics.median(times["masked"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), fp32, forward + backward")
    print("| tokens | dim | hidden | experts | top_k | gathered (ms) | masked (ms) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        gathered, masked = measure(shape, args.repeats)
        cells = " | ".join(str(value) for value in shape)
        ratio = masked / gathered
        print(f"| {cells} | {gathered * 1e3:.1f} | {masked * 1e3:.1f} | {ratio:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
