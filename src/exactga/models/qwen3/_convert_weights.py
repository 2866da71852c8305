"""Qwen3's Hugging Face format (:data:`QWEN3_FORMAT`): weight names both ways, PEFT adapter
names, and the ``config.json`` of a model :func:`~exactga.models.qwen3.qwen3` builds.

Only names change, never a tensor: Qwen3's RoPE is the rotate-half layout in both libraries
(``Qwen2RotaryPositionalEmbeddings``), so q/k rows stay in Hugging Face's order. That is also
why the adapters are renamed only: torchtune 0.6.1's ``tune_to_peft_adapter_weights`` permutes
the rows of q_proj's and k_proj's ``lora_B`` from Llama's interleaved RoPE order into HF's,
which for a rotate-half model (its own checkpointer does it for Qwen2 too) scrambles the heads'
dimensions, and PEFT would load an adapter that is not the one trained.

A tied model (``tie_word_embeddings``) has no ``lm_head.weight`` in its HF files and no
``output.weight`` in torchtune's state dict (``TiedLinear`` holds no parameter), as torchtune's
Qwen2 conversion has it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from exactga.models.hf_format import HFFormat, StateDict, builder_arguments, peft_adapter
from exactga.models.qwen3._component_builders import qwen3, resolved_head_dim

# Weights outside the layers: HF name -> torchtune name.
_GLOBAL_FROM_HF = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
# Weights of layer i, below "model.layers.{i}." in HF and "layers.{i}." in torchtune.
_LAYER_FROM_HF = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm.scale",
    "self_attn.k_norm.weight": "attn.k_norm.scale",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}
_GLOBAL_TO_HF = {tune: hf for hf, tune in _GLOBAL_FROM_HF.items()}
_LAYER_TO_HF = {tune: hf for hf, tune in _LAYER_FROM_HF.items()}
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TUNE_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
# Buffers some HF checkpoints hold that torchtune recomputes (RoPE's inverse frequencies).
_HF_KEYS_TO_SKIP = re.compile(r".*\.rotary_emb\.inv_freq")
_HF_OUTPUT_KEY = "lm_head.weight"


def _hf_key_to_tune(key: str) -> str:
    """torchtune's name of HF weight ``key``; ``ValueError`` for a name Qwen3 has not."""
    if key in _GLOBAL_FROM_HF:
        return _GLOBAL_FROM_HF[key]
    match = _HF_LAYER_KEY.fullmatch(key)
    if match and match.group(2) in _LAYER_FROM_HF:
        return f"layers.{match.group(1)}.{_LAYER_FROM_HF[match.group(2)]}"
    raise ValueError(f"'{key}' is no weight of a Hugging Face Qwen3 checkpoint")


def _tune_key_to_hf(key: str) -> str:
    """HF's name of torchtune weight ``key``; ``ValueError`` for a name :func:`qwen3` has not
    (an unmerged adapter's, say)."""
    if key in _GLOBAL_TO_HF:
        return _GLOBAL_TO_HF[key]
    match = _TUNE_LAYER_KEY.fullmatch(key)
    if match and match.group(2) in _LAYER_TO_HF:
        return f"model.layers.{match.group(1)}.{_LAYER_TO_HF[match.group(2)]}"
    raise ValueError(f"'{key}' is no weight of torchtune's Qwen3 model (exactga.models.qwen3)")


def _is_tied(config: Mapping[str, Any]) -> bool:
    # Qwen3Config's default; the released config.json files all spell it out.
    return bool(config.get("tie_word_embeddings", False))


def hf_to_tune(state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """A Hugging Face Qwen3 state dict in torchtune's names, for :func:`qwen3`'s model.

    Args:
        state_dict: the weights, every checkpoint file's merged.
        config: the checkpoint's ``config.json``; ``tie_word_embeddings`` is read.

    Returns:
        The same tensors under torchtune's names; a tied model's ``lm_head.weight``, if the
        files hold one, is left out (the embedding is the output projection).

    Raises:
        ValueError: a key that is no Qwen3 weight.
    """
    tied = _is_tied(config)
    converted = {}
    for key, value in state_dict.items():
        if _HF_KEYS_TO_SKIP.fullmatch(key) or (tied and key == _HF_OUTPUT_KEY):
            continue
        converted[_hf_key_to_tune(key)] = value
    return converted


def tune_to_hf(state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """torchtune's Qwen3 state dict in Hugging Face's names: the inverse of :func:`hf_to_tune`.

    Args:
        state_dict: :func:`qwen3`'s weights (a LoRA model's merged: no adapter keys).
        config: the model's ``config.json``; the names do not depend on it (a tied model's
            state dict already has no ``output.weight``).

    Raises:
        ValueError: a key :func:`qwen3`'s model has not.
    """
    del config  # one layout for every Qwen3 config
    return {_tune_key_to_hf(key): value for key, value in state_dict.items()}


def adapter_to_peft(adapter_state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """torchtune's Qwen3 adapter (``get_adapter_state_dict``'s keys) in PEFT's names, the file
    ``PeftModel.from_pretrained`` loads. Tensors are unchanged: see the module docstring.

    Args:
        adapter_state_dict: ``lora_a``/``lora_b`` weights and DoRA ``magnitude`` vectors.
        config: the model's ``config.json``; the names do not depend on it.

    Raises:
        ValueError: a key that is no adapter parameter of a Qwen3 linear.
    """
    del config  # rotate-half RoPE: no row permutation for any head layout
    return peft_adapter(adapter_state_dict, _tune_key_to_hf)


def hf_config(builder_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of the model ``qwen3(**builder_kwargs)`` builds, as transformers'
    ``Qwen3Config`` reads it (a LoRA builder's extra arguments are ignored: the base is the
    same model).

    Args:
        builder_kwargs: :func:`~exactga.models.qwen3.qwen3`'s arguments; the optional ones may
            be left out (its defaults).

    Raises:
        ValueError: a required argument of :func:`qwen3` is missing.
    """
    kwargs = builder_arguments(qwen3, builder_kwargs, "Qwen3")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": kwargs["intermediate_dim"],
        **decoder_config_fields(kwargs),
    }


def decoder_config_fields(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` fields of a Qwen3 decoder that do not depend on its MLPs (sizes,
    attention, norms, RoPE), from the builder's arguments with its defaults filled in; the
    dense and the mixture-of-experts families add their own."""
    num_heads = kwargs["num_heads"]
    return {
        "vocab_size": kwargs["vocab_size"],
        "hidden_size": kwargs["embed_dim"],
        "num_hidden_layers": kwargs["num_layers"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": kwargs["num_kv_heads"] or num_heads,
        # Always written: Qwen3Config's default is 128, not hidden_size // num_attention_heads.
        "head_dim": resolved_head_dim(kwargs["embed_dim"], num_heads, kwargs["head_dim"]),
        "hidden_act": "silu",
        "max_position_embeddings": kwargs["max_seq_len"],
        "rms_norm_eps": kwargs["norm_eps"],
        # The released files' spelling; transformers 5 moves it into rope_parameters.
        "rope_theta": kwargs["rope_base"],
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": kwargs["attn_dropout"],
        "tie_word_embeddings": bool(kwargs["tie_word_embeddings"]),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": kwargs["num_layers"],
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


QWEN3_FORMAT = HFFormat(
    architecture="Qwen3ForCausalLM",
    hf_model_type="qwen3",
    hf_to_tune=hf_to_tune,
    tune_to_hf=tune_to_hf,
    adapter_to_peft=adapter_to_peft,
    hf_config=hf_config,
)
