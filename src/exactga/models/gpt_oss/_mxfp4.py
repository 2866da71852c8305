"""MXFP4 dequantisation of the released gpt-oss expert weights.

The released files hold each expert projection as ``{name}_blocks`` (uint8, ``[E, out, G,
16]``: two 4-bit E2M1 values per byte, the low nibble first) and ``{name}_scales`` (uint8,
``[E, out, G]``: one E8M0 exponent, biased by 127, per block of 32 values along ``in``). A
value is ``E2M1[nibble] * 2 ** (scale - 127)``. The result here is ``[E, out, in]``
(``nn.Linear``'s layout per expert, torchtune's stacked layout), computed as transformers'
``convert_moe_packed_tensors`` computes it (the E2M1 table in the target dtype, then
``ldexp``), so the values are bit-identical to those transformers loads; transformers then
transposes to its ``[E, in, out]``.
"""

from __future__ import annotations

import torch

# The 16 E2M1 values, indexed by the 4-bit code (sign bit highest).
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
_SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[..., out, G, 16]`` blocks and ``[..., out, G]`` scales to ``[..., out, G * 32]`` in
    ``dtype``.

    Raises:
        ValueError: the shapes do not match or a tensor is not uint8.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: "
            "the blocks are the scales' shape plus 16 bytes"
        )
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(*scales.shape, 32, dtype=dtype, device=blocks.device)
    # One expert (leading slice) at a time: the index and value temporaries of a whole
    # 120B layer's projection at once would be tens of GB.
    per_expert = blocks.dim() > 3
    for out_slice, block_slice, scale_slice in zip(
        _slices(out, per_expert),
        _slices(blocks, per_expert),
        _slices(scales, per_expert),
        strict=True,
    ):
        out_slice[..., 0::2] = table[(block_slice & 0x0F).int()]  # the low nibble first
        out_slice[..., 1::2] = table[(block_slice >> 4).int()]
        exponents = scale_slice.to(torch.int32) - _SCALE_BIAS
        torch.ldexp(out_slice, exponents.unsqueeze(-1), out=out_slice)
    return out.flatten(-2)


def _slices(tensor: torch.Tensor, per_expert: bool) -> tuple[torch.Tensor, ...]:
    """Views along the leading dimension (the experts), or the tensor itself."""
    return tensor.unbind(0) if per_expert else (tensor,)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., out, in]`` float weights to MXFP4 blocks and scales, rounding each value to the
    nearest E2M1 value at its block's scale (the scale: the power of two that puts the block's
    largest magnitude at or below 6). For tests and tools; the inverse of
    :func:`dequantize_mxfp4` up to that rounding.
    """
    *prefix, in_dim = weight.shape
    if in_dim % 32:
        raise ValueError(
            f"MXFP4 blocks hold 32 values; the input dimension {in_dim} is not a multiple"
        )
    groups = weight.float().reshape(*prefix, in_dim // 32, 32)
    largest = groups.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-_SCALE_BIAS, 127).to(torch.int32)
    scaled = groups / torch.exp2(exponents.float()).unsqueeze(-1)  # exact: a power of two
    table = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - table).abs().argmin(dim=-1)
    codes = torch.where(scaled < 0, codes + 8, codes).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    scales = (exponents + _SCALE_BIAS).to(torch.uint8)
    return blocks, scales
