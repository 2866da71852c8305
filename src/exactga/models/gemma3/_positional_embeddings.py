"""Gemma 3's rotary position embedding: Hugging Face's rotate-half layout, one base per layer
kind and an optional linear scaling of the positions.

Gemma 3 rotates sliding-window layers with base 10,000 and global layers with base 1,000,000;
from 4B up the global layers' positions are also divided by 8 (``rope_scaling`` ``{"rope_type":
"linear", "factor": 8.0}``), which is the same as dividing their inverse frequencies by 8. A
model holds one module per kind, shared by the layers of that kind.

Why not torchtune's ``RotaryPositionalEmbeddings``: it rotates interleaved pairs (dims 2i,
2i+1), Hugging Face rotates the two halves (dims i, i + head_dim/2). The layouts are equivalent
up to a permutation of every head's q/k dims, but Gemma 3 normalises q and k over ``head_dim``
*before* RoPE with a per-dim scale, so an interleaved RoPE would need that permutation on the
q/k projections, on ``q_norm``/``k_norm`` and on every LoRA ``lora_b`` as well. With HF's
layout the weights, adapters and merged checkpoints need no permutation at all. Why not
torchtune's Qwen2 (rotate-half) module either: it caches cos/sin for every position up to
``max_seq_len``, 256 MiB per module at 4B's 131,072 positions and ``head_dim`` 256, and has no
scaling. This module computes cos/sin for the positions it is given, in float32, as
transformers does.
"""

from __future__ import annotations

import torch
from torch import nn


def inverse_frequencies(dim: int, base: float, scaling_factor: float = 1.0) -> torch.Tensor:
    """RoPE's ``dim // 2`` inverse frequencies, float32, on the CPU.

    Computed on the CPU in float32 exactly as transformers' ``_compute_linear_scaling_rope_
    parameters`` does (``base ** (arange(0, dim, 2) / dim)``, then divided by the factor), so the
    table is bit-identical to the one a ``Gemma3ForCausalLM`` holds whatever device the model
    runs on: a one-ulp difference here is a phase error of position x ulp at long positions.
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return (1.0 / (base**exponents)) / scaling_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``x``'s last dim, halves swapped and the new first half negated: ``(-x2, x1)``."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Gemma3RotaryPositionalEmbeddings(nn.Module):
    """Rotate-half RoPE with base ``base`` and positions divided by ``scaling_factor``.

    Args:
        dim: the head dimension (even).
        base: the RoPE base (theta): 10,000 for Gemma 3's local layers, 1,000,000 for its
            global ones.
        scaling_factor: linear position scaling, 1.0 for none (Gemma 3's global layers at
            4B, 12B and 27B: 8.0).

    ``forward`` takes torchtune's layout, ``[b, s, n_heads, head_dim]``, and ``input_pos``
    (``[b, s]`` or ``[s]``, the position of each token; ``None``: ``0 .. s-1``), so it drops in
    wherever torchtune's RoPE modules go.
    """

    def __init__(self, dim: int, base: float, scaling_factor: float = 1.0) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {dim}")
        self.dim = dim
        self.base = base
        self.scaling_factor = scaling_factor
        self.rope_init()

    def rope_init(self) -> None:
        """(Re)make the inverse-frequency buffer on the default device.

        Named as torchtune's RoPE method, which recipes call after materialising a model built
        on the meta device (the buffer is not in the state dict)."""
        inv_freq = inverse_frequencies(self.dim, self.base, self.scaling_factor)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, x: torch.Tensor, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[b, s, n_heads, head_dim]`` rotated by each token's position."""
        positions = input_pos
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        # float32 angles whatever x's dtype, as transformers: a bfloat16 position is exact only
        # up to 256.
        angles = positions[..., None].float() * self.inv_freq.float()  # [(b,) s, head_dim/2]
        angles = torch.cat((angles, angles), dim=-1)
        cos = angles.cos().to(x.dtype).unsqueeze(-2)  # broadcast over heads
        sin = angles.sin().to(x.dtype).unsqueeze(-2)
        return x * cos + rotate_half(x) * sin

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, scaling_factor={self.scaling_factor}"
