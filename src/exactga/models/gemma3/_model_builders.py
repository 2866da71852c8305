"""Sized builders of the released Gemma 3 text decoders, their LoRA and QLoRA twins.

The sizes are those of Google's Hugging Face checkpoints (``config.json``; 4B, 12B and 27B are
``Gemma3ForConditionalGeneration`` checkpoints, whose ``text_config`` is quoted). Shared by
every size: ``head_dim`` 256 (27B: 128), ``rms_norm_eps`` 1e-6, ``rope_theta`` 1,000,000,
``rope_local_base_freq`` 10,000, ``sliding_window_pattern`` 6, no soft-capping, tied output.

Vocabulary: 1B's checkpoint has 262,144 embedding rows. The 4B/12B/27B ``text_config`` gives
``vocab_size`` 262,208 (or leaves it to ``Gemma3TextConfig``'s default, 262,208): their
embedding tables have 64 more rows, among them ``image_token_index`` 262,144. The tokenizer's
262,144 ids are the same for every size; the builders take each checkpoint's row count so that
its embedding loads with ``strict=True``.

Parameters (text decoder; the Gemma 3 report's embedding + non-embedding counts): 1B 302M +
698M, 4B 675M + 3,209M, 12B 1,012M + 10,759M, 27B 1,416M + 25,600M (the 4B+ multimodal totals
add a 417M vision encoder, not built here).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from exactga.models.gemma3._component_builders import gemma3, lora_gemma3

# google/gemma-3-1b-pt config.json (Gemma3ForCausalLM): vocab_size 262144, hidden_size 1152,
# intermediate_size 6912, num_hidden_layers 26, num_attention_heads 4, num_key_value_heads 1,
# head_dim 256, query_pre_attn_scalar 256, sliding_window 512, sliding_window_pattern 6,
# rope_theta 1e6, rope_local_base_freq 1e4, rope_scaling null, max_position_embeddings 32768.
_GEMMA3_1B = dict(
    vocab_size=262_144,
    num_layers=26,
    num_heads=4,
    head_dim=256,
    num_kv_heads=1,
    embed_dim=1152,
    intermediate_dim=6912,
    max_seq_len=32_768,
    query_pre_attn_scalar=256,
    sliding_window=512,
    rope_scaling_factor=None,
)
# google/gemma-3-4b-pt text_config: vocab_size 262208, hidden_size 2560, intermediate_size
# 10240, num_hidden_layers 34, num_attention_heads 8, num_key_value_heads 4, head_dim 256,
# query_pre_attn_scalar 256, sliding_window 1024, rope_scaling {"rope_type": "linear",
# "factor": 8.0}, max_position_embeddings 131072.
_GEMMA3_4B = dict(
    vocab_size=262_208,
    num_layers=34,
    num_heads=8,
    head_dim=256,
    num_kv_heads=4,
    embed_dim=2560,
    intermediate_dim=10_240,
    max_seq_len=131_072,
    query_pre_attn_scalar=256,
    sliding_window=1024,
    rope_scaling_factor=8.0,
)
# google/gemma-3-12b-pt text_config: vocab_size 262208, hidden_size 3840, intermediate_size
# 15360, num_hidden_layers 48, num_attention_heads 16, num_key_value_heads 8, head_dim 256,
# query_pre_attn_scalar 256, sliding_window 1024, rope_scaling linear 8.0,
# max_position_embeddings 131072.
_GEMMA3_12B = dict(
    vocab_size=262_208,
    num_layers=48,
    num_heads=16,
    head_dim=256,
    num_kv_heads=8,
    embed_dim=3840,
    intermediate_dim=15_360,
    max_seq_len=131_072,
    query_pre_attn_scalar=256,
    sliding_window=1024,
    rope_scaling_factor=8.0,
)
# google/gemma-3-27b-pt text_config: vocab_size 262208, hidden_size 5376, intermediate_size
# 21504, num_hidden_layers 62, num_attention_heads 32, num_key_value_heads 16, head_dim 128,
# query_pre_attn_scalar 168 (= hidden_size / num_attention_heads, not head_dim),
# sliding_window 1024, rope_scaling linear 8.0, max_position_embeddings 131072.
_GEMMA3_27B = dict(
    vocab_size=262_208,
    num_layers=62,
    num_heads=32,
    head_dim=128,
    num_kv_heads=16,
    embed_dim=5376,
    intermediate_dim=21_504,
    max_seq_len=131_072,
    query_pre_attn_scalar=168,
    sliding_window=1024,
    rope_scaling_factor=8.0,
)
_SHARED = dict(
    norm_eps=1e-6,
    rope_base=1_000_000.0,
    local_rope_base=10_000.0,
    sliding_window_pattern=6,
)

# Each sized builder's component-builder arguments, as qwen3's BUILDER_ARGUMENTS: the shape of a
# released size without building it (a benchmark cuts its depth, say).
BUILDER_ARGUMENTS: dict[str, dict[str, Any]] = {
    "gemma3_1b": {**_GEMMA3_1B, **_SHARED},
    "gemma3_4b": {**_GEMMA3_4B, **_SHARED},
    "gemma3_12b": {**_GEMMA3_12B, **_SHARED},
    "gemma3_27b": {**_GEMMA3_27B, **_SHARED},
}

_QLORA_DOC = """
Builder for the Gemma 3 {size} text decoder with QLoRA: the base weights of the attention and
MLP linears are NF4 (https://arxiv.org/abs/2305.14314). Arguments as ``lora_gemma3_{size}``.
"""


def gemma3_1b() -> TransformerDecoder:
    """Gemma 3 1B (``google/gemma-3-1b-pt``/``-it``): 26 layers, window 512, no RoPE scaling."""
    return gemma3(**_GEMMA3_1B, **_SHARED)


def gemma3_4b() -> TransformerDecoder:
    """Gemma 3 4B's text decoder (``google/gemma-3-4b-pt``/``-it``): 34 layers, window 1024,
    global RoPE scaled linearly by 8."""
    return gemma3(**_GEMMA3_4B, **_SHARED)


def gemma3_12b() -> TransformerDecoder:
    """Gemma 3 12B's text decoder (``google/gemma-3-12b-pt``/``-it``): 48 layers, window 1024,
    global RoPE scaled linearly by 8."""
    return gemma3(**_GEMMA3_12B, **_SHARED)


def gemma3_27b() -> TransformerDecoder:
    """Gemma 3 27B's text decoder (``google/gemma-3-27b-pt``/``-it``): 62 layers, head_dim 128,
    query_pre_attn_scalar 168, window 1024, global RoPE scaled linearly by 8."""
    return gemma3(**_GEMMA3_27B, **_SHARED)


def lora_gemma3_1b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`gemma3_1b` with LoRA; arguments as ``lora_gemma3``'s LoRA arguments."""
    return lora_gemma3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **_GEMMA3_1B,
        **_SHARED,
    )


def lora_gemma3_4b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`gemma3_4b` with LoRA; arguments as ``lora_gemma3``'s LoRA arguments."""
    return lora_gemma3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **_GEMMA3_4B,
        **_SHARED,
    )


def lora_gemma3_12b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`gemma3_12b` with LoRA; arguments as ``lora_gemma3``'s LoRA arguments."""
    return lora_gemma3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **_GEMMA3_12B,
        **_SHARED,
    )


def lora_gemma3_27b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`gemma3_27b` with LoRA; arguments as ``lora_gemma3``'s LoRA arguments."""
    return lora_gemma3(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **_GEMMA3_27B,
        **_SHARED,
    )


qlora_gemma3_1b = partial(lora_gemma3_1b, quantize_base=True)
qlora_gemma3_1b.__doc__ = _QLORA_DOC.format(size="1b")
qlora_gemma3_4b = partial(lora_gemma3_4b, quantize_base=True)
qlora_gemma3_4b.__doc__ = _QLORA_DOC.format(size="4b")
qlora_gemma3_12b = partial(lora_gemma3_12b, quantize_base=True)
qlora_gemma3_12b.__doc__ = _QLORA_DOC.format(size="12b")
qlora_gemma3_27b = partial(lora_gemma3_27b, quantize_base=True)
qlora_gemma3_27b.__doc__ = _QLORA_DOC.format(size="27b")
