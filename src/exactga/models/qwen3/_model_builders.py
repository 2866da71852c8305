"""The released Qwen3 dense sizes: plain, LoRA (``lora_``) and QLoRA (``qlora_``) builders.

Every size shares, from its Hugging Face ``config.json``: ``vocab_size`` 151936, ``head_dim``
128, ``num_key_value_heads`` 8, ``rope_theta`` 1000000, ``rms_norm_eps`` 1e-6,
``max_position_embeddings`` 40960, ``hidden_act`` silu, ``attention_bias`` false, no sliding
window. The sizes' own values are in a comment above each builder. Parameter counts below count
a tied embedding once (it is one tensor); Qwen's model cards count the same way, but a count
that adds an ``lm_head`` of its own to a tied size gets 0.75B for 0.6B and 2.03B for 1.7B.

A tied size (0.6B, 1.7B, 4B) has no output linear, so its LoRA builder refuses
``apply_lora_to_output=True`` (it keeps the argument, so configs that spell out ``False`` work,
as torchtune's tied Qwen2.5 builders do).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torchtune.modules import TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from exactga.models.qwen3._component_builders import lora_qwen3, qwen3

# config.json values common to every size, in the component builders' names.
_SHARED = {
    "vocab_size": 151936,
    "num_kv_heads": 8,
    "head_dim": 128,
    "max_seq_len": 40960,
    "attn_dropout": 0.0,
    "norm_eps": 1e-6,
    "rope_base": 1_000_000.0,
}
# Each size's own config.json values, in the component builders' names.
# Qwen/Qwen3-0.6B: hidden_size 1024, intermediate_size 3072, num_hidden_layers 28,
# num_attention_heads 16, tie_word_embeddings true. 0.596e9 parameters.
_SIZE_0_6B = {
    "embed_dim": 1024,
    "intermediate_dim": 3072,
    "num_layers": 28,
    "num_heads": 16,
    "tie_word_embeddings": True,
}
# Qwen/Qwen3-1.7B: hidden_size 2048, intermediate_size 6144, num_hidden_layers 28,
# num_attention_heads 16, tie_word_embeddings true. 1.72e9 parameters.
_SIZE_1_7B = {
    "embed_dim": 2048,
    "intermediate_dim": 6144,
    "num_layers": 28,
    "num_heads": 16,
    "tie_word_embeddings": True,
}
# Qwen/Qwen3-4B: hidden_size 2560, intermediate_size 9728, num_hidden_layers 36,
# num_attention_heads 32, tie_word_embeddings true. 4.02e9 parameters.
_SIZE_4B = {
    "embed_dim": 2560,
    "intermediate_dim": 9728,
    "num_layers": 36,
    "num_heads": 32,
    "tie_word_embeddings": True,
}
# Qwen/Qwen3-8B: hidden_size 4096, intermediate_size 12288, num_hidden_layers 36,
# num_attention_heads 32, tie_word_embeddings false. 8.19e9 parameters.
_SIZE_8B = {
    "embed_dim": 4096,
    "intermediate_dim": 12288,
    "num_layers": 36,
    "num_heads": 32,
    "tie_word_embeddings": False,
}
# Qwen/Qwen3-14B: hidden_size 5120, intermediate_size 17408, num_hidden_layers 40,
# num_attention_heads 40, tie_word_embeddings false. 14.77e9 parameters.
_SIZE_14B = {
    "embed_dim": 5120,
    "intermediate_dim": 17408,
    "num_layers": 40,
    "num_heads": 40,
    "tie_word_embeddings": False,
}
# Qwen/Qwen3-32B: hidden_size 5120, intermediate_size 25600, num_hidden_layers 64,
# num_attention_heads 64, tie_word_embeddings false. 32.76e9 parameters.
_SIZE_32B = {
    "embed_dim": 5120,
    "intermediate_dim": 25600,
    "num_layers": 64,
    "num_heads": 64,
    "tie_word_embeddings": False,
}

# Each sized builder's component-builder arguments (for hf_config, say: a sized builder itself
# takes none).
BUILDER_ARGUMENTS: dict[str, dict[str, Any]] = {
    "qwen3_0_6b": {**_SHARED, **_SIZE_0_6B},
    "qwen3_1_7b": {**_SHARED, **_SIZE_1_7B},
    "qwen3_4b": {**_SHARED, **_SIZE_4B},
    "qwen3_8b": {**_SHARED, **_SIZE_8B},
    "qwen3_14b": {**_SHARED, **_SIZE_14B},
    "qwen3_32b": {**_SHARED, **_SIZE_32B},
}


def qwen3_0_6b() -> TransformerDecoder:
    """Qwen3 0.6B (base or post-trained: one architecture), tied embeddings."""
    return qwen3(**_SHARED, **_SIZE_0_6B)


def qwen3_1_7b() -> TransformerDecoder:
    """Qwen3 1.7B (base or post-trained), tied embeddings."""
    return qwen3(**_SHARED, **_SIZE_1_7B)


def qwen3_4b() -> TransformerDecoder:
    """Qwen3 4B (base or post-trained), tied embeddings."""
    return qwen3(**_SHARED, **_SIZE_4B)


def qwen3_8b() -> TransformerDecoder:
    """Qwen3 8B (base or post-trained)."""
    return qwen3(**_SHARED, **_SIZE_8B)


def qwen3_14b() -> TransformerDecoder:
    """Qwen3 14B (base or post-trained)."""
    return qwen3(**_SHARED, **_SIZE_14B)


def qwen3_32b() -> TransformerDecoder:
    """Qwen3 32B (the released checkpoint is post-trained)."""
    return qwen3(**_SHARED, **_SIZE_32B)


def lora_qwen3_0_6b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3_0_6b` with adapters; arguments as :func:`lora_qwen3`'s.

    Raises:
        ValueError: ``apply_lora_to_output=True``: the output projection is the embedding.
    """
    # locals(): exactly the arguments above, which lora_qwen3 takes by the same names.
    return lora_qwen3(**locals(), **_SHARED, **_SIZE_0_6B)


def lora_qwen3_1_7b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3_1_7b` with adapters; arguments as :func:`lora_qwen3`'s.

    Raises:
        ValueError: ``apply_lora_to_output=True``: the output projection is the embedding.
    """
    # locals(): exactly the arguments above, which lora_qwen3 takes by the same names.
    return lora_qwen3(**locals(), **_SHARED, **_SIZE_1_7B)


def lora_qwen3_4b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3_4b` with adapters; arguments as :func:`lora_qwen3`'s.

    Raises:
        ValueError: ``apply_lora_to_output=True``: the output projection is the embedding.
    """
    # locals(): exactly the arguments above, which lora_qwen3 takes by the same names.
    return lora_qwen3(**locals(), **_SHARED, **_SIZE_4B)


def lora_qwen3_8b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3_8b` with adapters; arguments as :func:`lora_qwen3`'s."""
    # locals(): exactly the arguments above, which lora_qwen3 takes by the same names.
    return lora_qwen3(**locals(), **_SHARED, **_SIZE_8B)


def lora_qwen3_14b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3_14b` with adapters; arguments as :func:`lora_qwen3`'s."""
    # locals(): exactly the arguments above, which lora_qwen3 takes by the same names.
    return lora_qwen3(**locals(), **_SHARED, **_SIZE_14B)


def lora_qwen3_32b(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3_32b` with adapters; arguments as :func:`lora_qwen3`'s."""
    # locals(): exactly the arguments above, which lora_qwen3 takes by the same names.
    return lora_qwen3(**locals(), **_SHARED, **_SIZE_32B)


def _qlora_twin(lora_builder: Callable[..., TransformerDecoder], size: str) -> partial:
    """``lora_builder`` with ``quantize_base=True``, documented, as torchtune's ``qlora_``."""
    twin = partial(lora_builder, quantize_base=True)
    twin.__doc__ = (
        f"Qwen3 {size} with QLoRA: :func:`lora_qwen3_{size.lower().replace('.', '_')}` with "
        "``quantize_base=True`` (the adapted linears' frozen weights in NF4)."
    )
    return twin


qlora_qwen3_0_6b = _qlora_twin(lora_qwen3_0_6b, "0.6B")
qlora_qwen3_1_7b = _qlora_twin(lora_qwen3_1_7b, "1.7B")
qlora_qwen3_4b = _qlora_twin(lora_qwen3_4b, "4B")
qlora_qwen3_8b = _qlora_twin(lora_qwen3_8b, "8B")
qlora_qwen3_14b = _qlora_twin(lora_qwen3_14b, "14B")
qlora_qwen3_32b = _qlora_twin(lora_qwen3_32b, "32B")
