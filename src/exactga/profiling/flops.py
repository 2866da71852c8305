"""FLOPs for model FLOPs utilisation: training FLOPs per token, and the device's peak.

``throughput/mfu`` is tokens per second times :func:`model_flops_per_token` over
:func:`device_peak_flops` (or the config key ``peak_flops``).
"""

from __future__ import annotations

import torch
from torch import nn

# Dense bf16 peak FLOP/s by device-name fragment (no sparsity). Override with peak_flops.
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "4090": 165e12,
}


def model_flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token: matmul weights, plus attention scores.

    Each matmul weight costs 2 FLOPs per token forward and 2 for the input gradient; 2 more for
    its own gradient when it trains (``6 * params`` for full fine-tuning, about ``4 * params``
    for LoRA). An untied input embedding is a lookup, not a matmul, and is left out (a tied one
    is the output projection). The attention term (``12 * layers * dim * context``, PaLM
    appendix B) uses the model's ``max_seq_len`` as context, an upper bound for padded batches.
    """
    lookup_only = _untied_embedding(model)
    params = [p for p in model.parameters() if p is not lookup_only]
    num_params = sum(p.numel() for p in params)
    num_trainable = sum(p.numel() for p in params if p.requires_grad)
    layers = getattr(model, "layers", None)
    embed = getattr(model, "tok_embeddings", None)
    context = getattr(model, "max_seq_len", None)
    attention = 0.0
    if layers is not None and embed is not None and context is not None:
        attention = 12.0 * len(layers) * embed.embedding_dim * context
    return 4.0 * num_params + 2.0 * num_trainable + attention


def _untied_embedding(model: nn.Module) -> torch.Tensor | None:
    """The input embedding's weight when the output projection has weights of its own."""
    embed, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    # torchtune's TiedLinear is a plain object over the embedding, not a module with weights.
    if embed is None or not isinstance(output, nn.Module):
        return None
    if next(output.parameters(), None) is None:
        return None
    return embed.weight


def device_peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known CUDA device, else None (MFU is then not logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, flops in PEAK_FLOPS_BF16.items():
        if fragment in name:
            return flops
    return None
