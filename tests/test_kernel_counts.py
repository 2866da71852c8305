"""benchmarks/kernel_counts.py's counter, in-process on tiny cases (issue #66, "launches counted").

What the benchmark's figures rest on: the dispatch-mode counter sees every operator of a
forward and backward, by phase, and tells views from launches (a case counted by hand); a
decoder's count is a fixed part plus the same part per layer (the estimate at 16 layers takes
it so); and a compiled function launches fewer kernels than it dispatches eager (inductor's
kernels are counted at run time, the operators inside a compiled graph are not counted twice).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.config

REPO_ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "kernel_counts", REPO_ROOT / "benchmarks/kernel_counts.py"
)
kernel_counts = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = kernel_counts  # its dataclasses look their module up there
_spec.loader.exec_module(kernel_counts)

TINY = {
    "vocab_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 32,
    "intermediate_dim": 64,
    "tie_word_embeddings": True,
}


def _affine_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 2 + 1).sum()


def _counted(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, compiled: bool):
    """The count of ``fn(x)``'s forward and backward, after an uncounted one (so ``x.grad``
    exists and is accumulated into, as in all micro-batches but a window's first)."""

    def run(on_phase) -> None:  # noqa: ANN001
        with on_phase("forward"):
            loss = fn(x)
        with on_phase("backward"):
            loss.backward()

    return kernel_counts.count_run(run, profile_kernels=compiled)


def test_counts_an_affine_sum_by_hand() -> None:
    # Forward: mul, add, sum. Backward: ones_like (the root's gradient), expand (sum's
    # backward, a view: no kernel), mul (by 2; add's backward passes the gradient on), add_
    # (into x.grad).
    counted = _counted(_affine_sum, torch.randn(3, requires_grad=True), compiled=False)
    assert counted.dispatched == {"forward": 3, "backward": 4}
    assert counted.launching == {"forward": 3, "backward": 3}
    assert counted.operators == {"mul": 2, "add": 1, "sum": 1, "ones_like": 1, "add_": 1}
    assert counted.kernels() == 6


def test_a_decoder_count_grows_by_the_same_part_per_layer() -> None:
    # On meta: no memory, no compute, the recipe's micro-batch (loss, scaling, backward).
    base = kernel_counts.Setting("meta", 1, TINY, "chunked", "bf16", batch=2, seq=8)
    kernels = [
        kernel_counts.count(dataclasses.replace(base, layers=n)).kernels() for n in (1, 2, 3)
    ]
    assert kernels[1] - kernels[0] == kernels[2] - kernels[1] > 0
    # exactga's fused loss asks autocast about the device, which meta has not: on the CPU.
    on_cpu = dataclasses.replace(base, device="cpu")
    fused = kernel_counts.count(dataclasses.replace(on_cpu, loss="fused"))
    assert 0 < fused.kernels() != kernel_counts.count(on_cpu).kernels()  # a path of its own


def test_compiled_launches_fewer_than_eager() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    chain = lambda t: (t * 2 + 1).sin().cos().exp().sum()  # noqa: E731
    eager = _counted(chain, x, compiled=False)
    # Inductor's CPU kernels as profiler events, as the benchmark sets it; here for this test only.
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        compiled = _counted(torch.compile(chain), x, compiled=True)
    assert compiled.inductor["forward"] >= 1 and compiled.inductor["backward"] >= 1
    assert compiled.kernels() < eager.kernels()
