"""Gemma 3's Hugging Face format (:data:`GEMMA3_FORMAT`): ``Gemma3ForCausalLM`` weights, PEFT
adapters and ``config.json``, to and from the builders of this package.

Only names change; no tensor is permuted. torchtune's Gemma/Gemma 2 conversions permute the rows
of q/k for torchtune's interleaved RoPE; these builders use Hugging Face's rotate-half RoPE
instead (see ``_positional_embeddings``), because Gemma 3 normalises q and k per head *before*
RoPE: an interleaved RoPE would need the permutation on ``q_norm``/``k_norm`` and on every LoRA
``lora_b`` as well, and every permuted tensor is one more place for a layout bug. With HF's
layout the parity is exact by construction and an adapter's tensors are PEFT's as they are.

Key names, HF (``model.layers.N.``) -> torchtune (``layers.N.``):
``self_attn.{q,k,v}_proj`` -> ``attn.{q,k,v}_proj``, ``self_attn.o_proj`` -> ``attn.output_proj``,
``self_attn.{q,k}_norm.weight`` -> ``attn.{q,k}_norm.scale``, ``mlp.gate_proj/up_proj/
down_proj`` -> ``mlp.w1/w3/w2``, and the four norms ``input_layernorm`` -> ``sa_norm``,
``post_attention_layernorm`` -> ``sa_scale``, ``pre_feedforward_layernorm`` -> ``mlp_norm``,
``post_feedforward_layernorm`` -> ``mlp_scale`` (torchtune's layer applies ``mlp_norm`` before the
MLP and ``mlp_scale`` after it; torchtune 0.6.1's Gemma 2 table pairs them the other way round,
which is why it is not reused). ``lm_head.weight`` is the embedding (tied) and is not written.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch

from exactga.models.gemma3._component_builders import gemma3, gemma3_layer_types
from exactga.models.hf_format import HFFormat, peft_adapter

StateDict = dict[str, torch.Tensor]

ARCHITECTURE = "Gemma3ForCausalLM"
HF_MODEL_TYPE = "gemma3_text"

# HF module path inside a decoder layer -> torchtune's; parameters named "weight" in HF are
# "scale" in torchtune's norms.
_LAYER_MODULES = {
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.k_proj": "attn.k_proj",
    "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.output_proj",
    "mlp.gate_proj": "mlp.w1",
    "mlp.up_proj": "mlp.w3",
    "mlp.down_proj": "mlp.w2",
}
_LAYER_NORMS = {
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "input_layernorm": "sa_norm",
    "post_attention_layernorm": "sa_scale",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "mlp_scale",
}
_LAYER_KEYS = {
    **{f"{hf}.weight": f"{tune}.weight" for hf, tune in _LAYER_MODULES.items()},
    **{f"{hf}.weight": f"{tune}.scale" for hf, tune in _LAYER_NORMS.items()},
}
_TOP_KEYS = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
}
_TIED_OUTPUT = "lm_head.weight"

# A multimodal (Gemma3ForConditionalGeneration) checkpoint holds the text decoder under another
# prefix: "language_model.model." in Google's 4B/12B/27B files, "model.language_model." as
# transformers >= 4.52 saves one. Its vision tower and projector are no part of the decoder.
_MULTIMODAL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_NOT_THE_DECODER = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TUNE_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


def _text_decoder_key(key: str) -> str | None:
    """``key`` as a ``Gemma3ForCausalLM`` key; ``None`` for a tensor that is not the decoder's
    (a multimodal checkpoint's vision tower, a stale rotary ``inv_freq``)."""
    if _NOT_THE_DECODER.match(key) or key.endswith("rotary_emb.inv_freq"):
        return None
    for prefix, causal_lm_prefix in _MULTIMODAL_PREFIXES.items():
        if key.startswith(prefix):
            return causal_lm_prefix + key[len(prefix) :]
    return key


def _unexpected(key: str, direction: str) -> ValueError:
    return ValueError(
        f"Gemma 3 {direction}: unexpected key {key!r}; is this a Gemma 3 text decoder's "
        "checkpoint (Gemma3ForCausalLM, or a Gemma3ForConditionalGeneration's language model)?"
    )


def _is_tied(config: Mapping[str, Any]) -> bool:
    text_config = config.get("text_config") or config  # a multimodal config nests it
    return bool(text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", True)))


def gemma3_hf_to_tune(state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """HF ``Gemma3ForCausalLM`` weights (or a ``Gemma3ForConditionalGeneration``'s text
    decoder) in the names :func:`~exactga.models.gemma3.gemma3` loads with ``strict=True``.

    Raises:
        ValueError: on a key that is not a Gemma 3 text decoder's, or on an untied
            ``lm_head.weight`` (``tie_word_embeddings: false``), which these builders cannot hold.
    """
    converted: StateDict = {}
    for key, value in state_dict.items():
        hf_key = _text_decoder_key(key)
        if hf_key is None:
            continue
        if hf_key == _TIED_OUTPUT:
            if not _is_tied(config):
                raise ValueError(
                    "Gemma 3 checkpoint with tie_word_embeddings false: its lm_head.weight is "
                    "not the embedding, and the gemma3 builders tie the output to it."
                )
            continue  # the output is the embedding
        converted[_hf_to_tune_key(hf_key)] = value
    return converted


def _hf_to_tune_key(key: str) -> str:
    if key in _TOP_KEYS:
        return _TOP_KEYS[key]
    match = _HF_LAYER_KEY.match(key)
    if match is None or match.group(2) not in _LAYER_KEYS:
        raise _unexpected(key, "HF -> torchtune")
    return f"layers.{match.group(1)}.{_LAYER_KEYS[match.group(2)]}"


_TOP_KEYS_TO_HF = {tune: hf for hf, tune in _TOP_KEYS.items()}
_LAYER_KEYS_TO_HF = {tune: hf for hf, tune in _LAYER_KEYS.items()}


def gemma3_tune_to_hf(state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """The inverse of :func:`gemma3_hf_to_tune` for a ``Gemma3ForCausalLM``: no
    ``lm_head.weight`` (tied: transformers ties it to ``model.embed_tokens.weight`` on load)."""
    return {_tune_to_hf_key(key): value for key, value in state_dict.items()}


def _tune_to_hf_key(key: str) -> str:
    if key in _TOP_KEYS_TO_HF:
        return _TOP_KEYS_TO_HF[key]
    match = _TUNE_LAYER_KEY.match(key)
    if match is None or match.group(2) not in _LAYER_KEYS_TO_HF:
        raise _unexpected(key, "torchtune -> HF")
    return f"model.layers.{match.group(1)}.{_LAYER_KEYS_TO_HF[match.group(2)]}"


def gemma3_adapter_to_peft(adapter: StateDict, config: Mapping[str, Any]) -> StateDict:
    """A torchtune LoRA/DoRA adapter in PEFT's names for a ``Gemma3ForCausalLM``; tensors as
    they are: no RoPE permutation (module docstring)."""
    return peft_adapter(adapter, _tune_to_hf_key)


_LORA_ARGUMENTS = {
    "lora_attn_modules",
    "apply_lora_to_mlp",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "use_dora",
    "quantize_base",
}


def _builder_arguments(builder_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``builder_kwargs`` over :func:`gemma3`'s defaults; LoRA arguments are ignored (the
    base model's config is the same)."""
    parameters = inspect.signature(gemma3).parameters
    unknown = set(builder_kwargs) - set(parameters) - _LORA_ARGUMENTS
    if unknown:
        raise ValueError(f"gemma3 takes no argument(s) {sorted(unknown)}")
    arguments = {
        name: p.default
        for name, p in parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    arguments.update({k: v for k, v in builder_kwargs.items() if k in parameters})
    missing = set(parameters) - set(arguments)
    if missing:
        raise ValueError(f"gemma3 needs argument(s) {sorted(missing)} to describe its config")
    return arguments


def gemma3_hf_config(builder_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of a ``Gemma3ForCausalLM`` equal to ``gemma3(**builder_kwargs)``.

    RoPE is written in the form of Google's released configs (``rope_theta``,
    ``rope_local_base_freq``, ``rope_scaling``), which transformers 5 reads into its
    ``rope_parameters`` per layer kind and transformers 4.50+ reads as it is; ``layer_types``
    names every layer's kind (``sliding_window_pattern`` is kept beside it when the layers follow
    the pattern, for transformers releases before ``layer_types``).
    """
    args = _builder_arguments(builder_kwargs)
    layer_types = gemma3_layer_types(
        args["num_layers"], args["sliding_window_pattern"], args["layer_types"]
    )
    scaling = args["rope_scaling_factor"]
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "vocab_size": args["vocab_size"],
        "hidden_size": args["embed_dim"],
        "intermediate_size": args["intermediate_dim"],
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": args["num_heads"],
        "num_key_value_heads": args["num_kv_heads"],
        "head_dim": args["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": args["max_seq_len"],
        "rms_norm_eps": args["norm_eps"],
        "rope_theta": args["rope_base"],
        "rope_local_base_freq": args["local_rope_base"],
        "rope_scaling": None if scaling is None else {"rope_type": "linear", "factor": scaling},
        "sliding_window": args["sliding_window"],
        "layer_types": layer_types,
        "query_pre_attn_scalar": args["query_pre_attn_scalar"] or args["head_dim"],
        "attn_logit_softcapping": args["attn_logit_softcapping"],
        "final_logit_softcapping": args["final_logit_softcapping"],
        "attention_bias": False,
        "attention_dropout": args["attn_dropout"],
        "tie_word_embeddings": True,
        "use_bidirectional_attention": False,
        # Gemma's tokenizer: <pad> 0, <eos> 1, <bos> 2.
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "torch_dtype": "float32",
    }
    if args["layer_types"] is None:
        config["sliding_window_pattern"] = args["sliding_window_pattern"]
    return config


def gemma3_saved_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of the text decoder a save writes: a multimodal release's
    (``Gemma3ForConditionalGeneration``: 4B, 12B, 27B) ``text_config`` as a
    ``Gemma3ForCausalLM``'s, whose missing fields transformers fills with the same defaults it
    gives the nested config; a text-only config as it is."""
    if "text_config" not in config:
        return dict(config)
    text = dict(config["text_config"])
    text["architectures"] = [ARCHITECTURE]
    text["model_type"] = HF_MODEL_TYPE
    for key in ("torch_dtype", "dtype", "transformers_version"):
        if key in config and key not in text:
            text[key] = config[key]
    return text


GEMMA3_FORMAT = HFFormat(
    architecture=ARCHITECTURE,
    hf_model_type=HF_MODEL_TYPE,
    hf_to_tune=gemma3_hf_to_tune,
    tune_to_hf=gemma3_tune_to_hf,
    adapter_to_peft=gemma3_adapter_to_peft,
    hf_config=gemma3_hf_config,
    saved_config=gemma3_saved_config,
)
