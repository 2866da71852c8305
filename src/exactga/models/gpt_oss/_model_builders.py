"""The released gpt-oss sizes: plain and LoRA (``lora_``) builders.

Both sizes share, from their Hugging Face ``config.json`` (openai/gpt-oss-20b, -120b):
``vocab_size`` 201088, ``hidden_size`` 2880, ``intermediate_size`` 2880, ``head_dim`` 64,
``num_attention_heads`` 64, ``num_key_value_heads`` 8, ``experts_per_token`` 4,
``sliding_window`` 128 on even layers, ``rope_theta`` 150000 with YaRN (``factor`` 32,
``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` false, ``original_max_position_embeddings``
4096), ``max_position_embeddings`` 131072, ``rms_norm_eps`` 1e-5, ``swiglu_limit`` 7.0,
``tie_word_embeddings`` false. 20B: 24 layers of 32 experts; 120B: 36 layers of 128.
"""

from __future__ import annotations

from typing import Any

from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from exactga.models.gpt_oss._component_builders import gpt_oss, lora_gpt_oss

_SHARED = {
    "vocab_size": 201088,
    "embed_dim": 2880,
    "intermediate_dim": 2880,
    "head_dim": 64,
    "num_heads": 64,
    "num_kv_heads": 8,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "max_seq_len": 131072,
    "norm_eps": 1e-5,
    "rope_base": 150_000.0,
    "rope_scaling_factor": 32.0,
    "rope_original_max_seq_len": 4096,
    "rope_beta_fast": 32.0,
    "rope_beta_slow": 1.0,
    "rope_truncate": False,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}

# Each sized builder's component-builder arguments (a sized builder itself takes none).
BUILDER_ARGUMENTS: dict[str, dict[str, Any]] = {
    "gpt_oss_20b": {**_SHARED, "num_layers": 24, "num_experts": 32},
    "gpt_oss_120b": {**_SHARED, "num_layers": 36, "num_experts": 128},
}


def gpt_oss_20b() -> TransformerDecoder:
    """gpt-oss-20b (21e9 parameters, 3.6e9 active per token)."""
    return gpt_oss(**BUILDER_ARGUMENTS["gpt_oss_20b"])


def gpt_oss_120b() -> TransformerDecoder:
    """gpt-oss-120b (117e9 parameters, 5.1e9 active per token)."""
    return gpt_oss(**BUILDER_ARGUMENTS["gpt_oss_120b"])


def lora_gpt_oss_20b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    apply_lora_to_router: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
) -> TransformerDecoder:
    """:func:`gpt_oss_20b` with adapters; arguments as :func:`lora_gpt_oss`'s."""
    # locals(): exactly the arguments above, which lora_gpt_oss takes by the same names.
    return lora_gpt_oss(**locals(), **BUILDER_ARGUMENTS["gpt_oss_20b"])


def lora_gpt_oss_120b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    apply_lora_to_router: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
) -> TransformerDecoder:
    """:func:`gpt_oss_120b` with adapters; arguments as :func:`lora_gpt_oss`'s."""
    # locals(): exactly the arguments above, which lora_gpt_oss takes by the same names.
    return lora_gpt_oss(**locals(), **BUILDER_ARGUMENTS["gpt_oss_120b"])
