"""The released Qwen3 MoE sizes: plain, LoRA (``lora_``) and QLoRA (``qlora_``) builders.

Both sizes share, from their Hugging Face ``config.json``: ``vocab_size`` 151936, ``head_dim``
128, ``num_key_value_heads`` 4, ``num_experts`` 128, ``num_experts_per_tok`` 8,
``norm_topk_prob`` true, ``decoder_sparse_step`` 1, ``mlp_only_layers`` [] (every layer
sparse), ``rope_theta`` 1000000, ``rms_norm_eps`` 1e-6, ``max_position_embeddings`` 40960,
``tie_word_embeddings`` false. ``intermediate_size`` is in the files but no layer uses it.

QLoRA here quantises the adapted attention projections only; the experts, nearly all of the
parameters, stay in the model's dtype (see :func:`~exactga.models.qwen3_moe.lora_qwen3_moe`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from exactga.models.qwen3_moe._component_builders import lora_qwen3_moe, qwen3_moe

# config.json values common to both sizes, in the component builders' names.
_SHARED = {
    "vocab_size": 151936,
    "num_kv_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "max_seq_len": 40960,
    "attn_dropout": 0.0,
    "norm_eps": 1e-6,
    "rope_base": 1_000_000.0,
    "tie_word_embeddings": False,
}
# Qwen/Qwen3-30B-A3B: hidden_size 2048, intermediate_size 6144, moe_intermediate_size 768,
# num_hidden_layers 48, num_attention_heads 32. 30.53e9 parameters, 3.3e9 active per token.
_SIZE_30B_A3B = {
    "embed_dim": 2048,
    "intermediate_dim": 6144,
    "moe_intermediate_dim": 768,
    "num_layers": 48,
    "num_heads": 32,
}
# Qwen/Qwen3-235B-A22B: hidden_size 4096, intermediate_size 12288, moe_intermediate_size 1536,
# num_hidden_layers 94, num_attention_heads 64. 235.09e9 parameters, 22e9 active per token.
_SIZE_235B_A22B = {
    "embed_dim": 4096,
    "intermediate_dim": 12288,
    "moe_intermediate_dim": 1536,
    "num_layers": 94,
    "num_heads": 64,
}

# Each sized builder's component-builder arguments (a sized builder itself takes none).
BUILDER_ARGUMENTS: dict[str, dict[str, Any]] = {
    "qwen3_moe_30b_a3b": {**_SHARED, **_SIZE_30B_A3B},
    "qwen3_moe_235b_a22b": {**_SHARED, **_SIZE_235B_A22B},
}


def qwen3_moe_30b_a3b() -> TransformerDecoder:
    """Qwen3-30B-A3B (base or post-trained: one architecture)."""
    return qwen3_moe(**_SHARED, **_SIZE_30B_A3B)


def qwen3_moe_235b_a22b() -> TransformerDecoder:
    """Qwen3-235B-A22B (base or post-trained)."""
    return qwen3_moe(**_SHARED, **_SIZE_235B_A22B)


def lora_qwen3_moe_30b_a3b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    apply_lora_to_router: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3_moe_30b_a3b` with adapters; arguments as :func:`lora_qwen3_moe`'s."""
    # locals(): exactly the arguments above, which lora_qwen3_moe takes by the same names.
    return lora_qwen3_moe(**locals(), **_SHARED, **_SIZE_30B_A3B)


def lora_qwen3_moe_235b_a22b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    apply_lora_to_router: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3_moe_235b_a22b` with adapters; arguments as :func:`lora_qwen3_moe`'s."""
    # locals(): exactly the arguments above, which lora_qwen3_moe takes by the same names.
    return lora_qwen3_moe(**locals(), **_SHARED, **_SIZE_235B_A22B)


def _qlora_twin(lora_builder: Callable[..., TransformerDecoder], size: str) -> partial:
    """``lora_builder`` with ``quantize_base=True``, documented, as torchtune's ``qlora_``."""
    twin = partial(lora_builder, quantize_base=True)
    twin.__doc__ = (
        f"Qwen3-{size} with QLoRA: :func:`{lora_builder.__name__}` with ``quantize_base=True`` "
        "(the adapted attention projections' frozen weights in NF4; the experts are not "
        "quantised)."
    )
    return twin


qlora_qwen3_moe_30b_a3b = _qlora_twin(lora_qwen3_moe_30b_a3b, "30B-A3B")
qlora_qwen3_moe_235b_a22b = _qlora_twin(lora_qwen3_moe_235b_a22b, "235B-A22B")
