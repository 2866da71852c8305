"""Bytes per parameter of each precision choice, measured on a GPU (docs/precision.md).

A stack of ``--layers`` MLP blocks (``dim -> 4 dim -> dim``, 0.8 B parameters by default) trains
two AdamW steps on a short batch, so activations are negligible next to the weights. For each
choice the script prints, per trainable parameter, what CUDA's allocator holds after a step
(weights + gradients + optimizer state, before ``zero_grad``) and the peak of the second step
(which adds the bf16 weight copies autocast saves for backward and the optimizer's temporaries).
The choices are made by ``exactga.runtime.precision.Precision``, the recipes' own calls:

    fp32            dtype: fp32
    bf16            dtype: bf16, master_weights: none (stock torchtune)
    bf16_master     dtype: bf16, master_weights: fp32 (bf16 autocast over fp32 weights)
    lora_master     a frozen bf16 base with fp32 rank-16 adapters on every linear

Needs only torch and src/ (no torchtune)::

    PYTHONPATH=src python benchmarks/precision_memory.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from exactga.runtime.precision import Precision

GIB = 1 << 30


class Block(nn.Module):
    def __init__(self, dim: int, rank: int = 0) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.rank = rank
        if rank:  # LoRA adapters on both linears
            self.up_a = nn.Linear(dim, rank, bias=False)
            self.up_b = nn.Linear(rank, 4 * dim, bias=False)
            self.down_a = nn.Linear(4 * dim, rank, bias=False)
            self.down_b = nn.Linear(rank, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.rank:
            h = h + self.up_b(self.up_a(x))
        h = torch.relu(h)
        out = self.down(h)
        if self.rank:
            out = out + self.down_b(self.down_a(h))
        return x + out


def measure(choice: str, layers: int, dim: int) -> dict[str, float]:
    dtype = torch.float32 if choice == "fp32" else torch.bfloat16
    master = "fp32" if choice in ("bf16_master", "lora_master") else "none"
    precision = Precision.from_config(dtype, master, torch.device("cuda"))
    rank = 16 if choice == "lora_master" else 0
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = nn.Sequential(*(Block(dim, rank) for _ in range(layers))).to(dtype)
    if rank:
        for name, param in model.named_parameters():
            param.requires_grad = name.split(".")[-2].endswith(("_a", "_b"))
    precision.cast_trainable(model)  # what the recipes call
    trainable = [p for p in model.parameters() if p.requires_grad]
    num_trainable = sum(p.numel() for p in trainable)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    x = torch.randn(1, 64, dim, device="cuda", dtype=dtype)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        with precision.autocast():
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()

    weights = torch.cuda.memory_allocated()
    step(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # weights + optimizer state
    step(model, optimizer)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()  # + gradients
    peak = torch.cuda.max_memory_allocated()
    result = {
        "params_B": num_params / 1e9,
        "trainable_B": num_trainable / 1e9,
        "weights_per_param": weights / num_params,
        "held_per_trainable": held / num_trainable,
        "optimizer_per_trainable": (base - weights) / num_trainable,
        "peak_per_trainable": peak / num_trainable,
        "peak_per_param": peak / num_params,
        "peak_GiB": peak / GIB,
    }
    del model, optimizer, trainable
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=2048)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        "| choice | parameters | trainable | weights B/param | optimizer B/trainable | "
        "after step B/trainable | peak B/trainable | peak B/param | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for choice in ("fp32", "bf16", "bf16_master", "lora_master"):
        r = measure(choice, args.layers, args.dim)
        print(
            f"| {choice} | {r['params_B']:.3f} B | {r['trainable_B'] * 1e3:.2f} M | "
            f"{r['weights_per_param']:.2f} | {r['optimizer_per_trainable']:.2f} | "
            f"{r['held_per_trainable']:.2f} | {r['peak_per_trainable']:.2f} | "
            f"{r['peak_per_param']:.2f} | {r['peak_GiB']:.2f} |"
        )


if __name__ == "__main__":
    main()
