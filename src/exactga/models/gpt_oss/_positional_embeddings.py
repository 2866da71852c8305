"""gpt-oss's RoPE: rotate-half rotation with YaRN-scaled inverse frequencies.

YaRN (Peng et al., 2023) keeps the fast-rotating dimensions as trained (extrapolation), divides
the slow ones' frequencies by ``factor`` (interpolation), blends the two over a linear ramp
between the dimensions that turn ``beta_fast`` and ``beta_slow`` times within
``original_max_seq_len`` positions, and multiplies cos and sin by an attention factor
``0.1 * ln(factor) + 1``. The table is computed as transformers' ``_compute_yarn_parameters``
computes it (float32, on the CPU, the same operations in the same order), so the angles are
bit-identical to those a ``GptOssForCausalLM`` uses.
"""

from __future__ import annotations

import math

import torch

from exactga.models.gemma3._positional_embeddings import (
    Gemma3RotaryPositionalEmbeddings,
    rotate_half,
)


def yarn_attention_factor(factor: float) -> float:
    """The scale YaRN puts on cos and sin (the paper's ``sqrt(1/t)``): 1 without scaling."""
    if factor <= 1:
        return 1.0
    return 0.1 * math.log(factor) + 1.0


def _correction_dim(
    num_rotations: float, dim: int, base: float, original_max_seq_len: int
) -> float:
    """The (fractional) dimension pair that turns ``num_rotations`` times over the context."""
    return (dim * math.log(original_max_seq_len / (num_rotations * 2 * math.pi))) / (
        2 * math.log(base)
    )


def yarn_inverse_frequencies(
    dim: int,
    base: float,
    factor: float,
    original_max_seq_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """RoPE's ``dim // 2`` inverse frequencies under YaRN, float32 on the CPU.

    Args:
        dim: the rotated head dimension.
        base: RoPE's base (``rope_theta``).
        factor: the context extension factor.
        original_max_seq_len: the context the model was pre-trained on.
        beta_fast: rotations at which a dimension is kept as trained.
        beta_slow: rotations at which a dimension is fully interpolated.
        truncate: round the ramp's ends to whole dimensions (transformers' default; the
            gpt-oss release sets it false).
    """
    low = _correction_dim(beta_fast, dim, base, original_max_seq_len)
    high = _correction_dim(beta_slow, dim, base, original_max_seq_len)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    keep_share = 1 - ramp  # 1: the dimension rotates as trained
    return interpolated * (1 - keep_share) + extrapolated * keep_share


class YarnRotaryPositionalEmbeddings(Gemma3RotaryPositionalEmbeddings):
    """Rotate-half RoPE (Hugging Face's layout, as Gemma 3's module) with YaRN's frequencies
    and attention factor; ``forward`` as torchtune's RoPE modules (``[b, s, n_h, h_d]``,
    ``input_pos``).

    Args:
        dim, base, factor, original_max_seq_len, beta_fast, beta_slow, truncate: as
            :func:`yarn_inverse_frequencies`.
    """

    def __init__(
        self,
        dim: int,
        base: float,
        factor: float,
        original_max_seq_len: int,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        truncate: bool = True,
    ) -> None:
        self.factor, self.original_max_seq_len = factor, original_max_seq_len
        self.beta_fast, self.beta_slow, self.truncate = beta_fast, beta_slow, truncate
        self.attention_factor = yarn_attention_factor(factor)
        super().__init__(dim, base)

    def rope_init(self) -> None:
        """(Re)make the inverse-frequency buffer on the default device (see Gemma 3's)."""
        inv_freq = yarn_inverse_frequencies(
            self.dim,
            self.base,
            self.factor,
            self.original_max_seq_len,
            self.beta_fast,
            self.beta_slow,
            self.truncate,
        )
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, x: torch.Tensor, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[b, s, n_heads, head_dim]`` rotated by each token's position."""
        positions = input_pos
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        angles = positions[..., None].float() * self.inv_freq.float()  # float32, as transformers
        # The attention factor multiplies cos and sin in float32, before the cast (transformers').
        cos = (angles.cos() * self.attention_factor).to(x.dtype)
        sin = (angles.sin() * self.attention_factor).to(x.dtype)
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(-2)  # broadcast over heads
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(-2)
        return x * cos + rotate_half(x) * sin

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, base={self.base}, factor={self.factor}, "
            f"original_max_seq_len={self.original_max_seq_len}, beta_fast={self.beta_fast}, "
            f"beta_slow={self.beta_slow}, truncate={self.truncate}"
        )
