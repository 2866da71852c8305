"""gpt-oss's Hugging Face format (:data:`GPT_OSS_FORMAT`): weights both ways, released MXFP4
experts dequantised on reading, PEFT adapter names, and the ``config.json`` of a model
:func:`~exactga.models.gpt_oss.gpt_oss` builds.

The experts, transformers' layout against torchtune's (``E`` experts, width ``D``, expert
width ``I``):

- ``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, D, 2I]`` (``x @ W``, the gate and up
  columns interleaved: gate ``0::2``, up ``1::2``) and ``gate_up_proj_bias`` ``[E, 2I]`` are
  torchtune's ``experts.w1``/``w3`` ``.weight`` ``[E, I, D]`` and ``.bias`` ``[E, I]``;
- ``down_proj`` ``[E, I, D]`` and ``down_proj_bias`` ``[E, D]`` are ``experts.w2`` ``.weight``
  ``[E, D, I]`` and ``.bias``;
- the released files hold ``gate_up_proj_blocks``/``_scales`` and ``down_proj_blocks``/
  ``_scales`` instead of the weights (MXFP4, ``[E, out, in / 32, 16]``; ``_mxfp4``); they are
  dequantised to the dtype of the file's biases (bf16 in the release). Every MXFP4 value
  ``E2M1 * 2^k`` is exact in bf16 and fp32 alike, so the model's dtype gets the same numbers.

A save writes transformers' dequantised layout and drops ``quantization_config`` from the
``config.json`` beside it, so ``from_pretrained`` reads the weights as they are.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from exactga.models.gpt_oss._component_builders import gpt_oss, gpt_oss_layer_types
from exactga.models.gpt_oss._mxfp4 import dequantize_mxfp4
from exactga.models.hf_format import HFFormat, StateDict, builder_arguments, peft_adapter

# Whole-name patterns: HF <-> torchtune, ``{}`` the layer index.
_LAYER_NAMES = {
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.q_proj.bias": "attn.q_proj.bias",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "self_attn.o_proj.bias": "attn.output_proj.bias",
    "self_attn.sinks": "attn.sinks",
    "mlp.router.weight": "mlp.router.gate.weight",
    "mlp.router.bias": "mlp.router.gate.bias",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}
_LAYER_TO_HF = {tune: hf for hf, tune in _LAYER_NAMES.items()}
_TOP_TO_HF = {tune: hf for hf, tune in _TOP_NAMES.items()}
_TUNE_ADAPTER_WITHOUT_PEFT = re.compile(r"layers\.\d+\.mlp\.(experts\.w[123]|router\.gate)\..+")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TUNE_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT_TENSORS = (
    "gate_up_proj",
    "gate_up_proj_bias",
    "down_proj",
    "down_proj_bias",
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "down_proj_blocks",
    "down_proj_scales",
)


def hf_to_tune(state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """A Hugging Face gpt-oss state dict (dequantised, or the released MXFP4 experts) in
    torchtune's names and layout.

    Raises:
        ValueError: a key that is no gpt-oss weight, or a layer's experts incomplete.
    """
    converted: StateDict = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if key in _TOP_NAMES:
            converted[_TOP_NAMES[key]] = value
            continue
        match = _HF_LAYER_KEY.fullmatch(key)
        name = match.group(2) if match else None
        if name in _LAYER_NAMES:
            converted[f"layers.{match.group(1)}.{_LAYER_NAMES[name]}"] = value
        elif name is not None and name.removeprefix("mlp.experts.") in _EXPERT_TENSORS:
            experts.setdefault(match.group(1), {})[name.removeprefix("mlp.experts.")] = value
        else:
            raise ValueError(f"'{key}' is no weight of a Hugging Face gpt-oss checkpoint")
    for layer, tensors in experts.items():
        converted.update(_experts_to_tune(layer, tensors))
    return converted


def _expert_weight(layer: str, tensors: dict[str, torch.Tensor], proj: str) -> torch.Tensor:
    """One projection's ``[E, out, in]`` weight (out interleaved for ``gate_up_proj``), from
    the dequantised ``[E, in, out]`` tensor or from MXFP4 blocks and scales."""
    if proj in tensors:
        return tensors[proj].transpose(1, 2)
    blocks, scales = tensors.get(f"{proj}_blocks"), tensors.get(f"{proj}_scales")
    if blocks is None or scales is None:
        raise ValueError(
            f"layer {layer}'s experts have no 'mlp.experts.{proj}' nor its MXFP4 "
            f"'{proj}_blocks' and '{proj}_scales' in the Hugging Face gpt-oss checkpoint"
        )
    bias = tensors.get(f"{proj}_bias")
    dtype = bias.dtype if bias is not None and bias.is_floating_point() else torch.bfloat16
    return dequantize_mxfp4(blocks, scales, dtype)


def _experts_to_tune(layer: str, tensors: dict[str, torch.Tensor]) -> StateDict:
    for bias in ("gate_up_proj_bias", "down_proj_bias"):
        if bias not in tensors:
            raise ValueError(f"'model.layers.{layer}.mlp.experts.{bias}' is missing")
    gate_up = _expert_weight(layer, tensors, "gate_up_proj")
    gate_up_bias = tensors["gate_up_proj_bias"]
    prefix = f"layers.{layer}.mlp.experts"
    return {
        # .contiguous(): strided views would keep the whole interleaved tensor alive.
        f"{prefix}.w1.weight": gate_up[:, 0::2].contiguous(),
        f"{prefix}.w3.weight": gate_up[:, 1::2].contiguous(),
        f"{prefix}.w1.bias": gate_up_bias[:, 0::2].contiguous(),
        f"{prefix}.w3.bias": gate_up_bias[:, 1::2].contiguous(),
        f"{prefix}.w2.weight": _expert_weight(layer, tensors, "down_proj").contiguous(),
        f"{prefix}.w2.bias": tensors["down_proj_bias"],
    }


def _interleaved(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """``gate`` and ``up`` alternating along ``dim`` (gate first)."""
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def tune_to_hf(state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """torchtune's gpt-oss state dict in transformers' dequantised layout: the inverse of
    :func:`hf_to_tune` for a dequantised folder.

    Raises:
        ValueError: a key :func:`gpt_oss`'s model has not.
    """
    converted: StateDict = {}
    experts: dict[str, StateDict] = {}
    for key, value in state_dict.items():
        if key in _TOP_TO_HF:
            converted[_TOP_TO_HF[key]] = value
            continue
        match = _TUNE_LAYER_KEY.fullmatch(key)
        name = match.group(2) if match else None
        if name in _LAYER_TO_HF:
            converted[f"model.layers.{match.group(1)}.{_LAYER_TO_HF[name]}"] = value
        elif name is not None and name.startswith("mlp.experts."):
            experts.setdefault(match.group(1), {})[name.removeprefix("mlp.experts.")] = value
        else:
            raise ValueError(f"'{key}' is no weight of exactga's gpt-oss model")
    for layer, tensors in experts.items():
        prefix = f"model.layers.{layer}.mlp.experts"
        try:
            gate_up = _interleaved(tensors["w1.weight"], tensors["w3.weight"], dim=1)
            converted[f"{prefix}.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
            converted[f"{prefix}.gate_up_proj_bias"] = _interleaved(
                tensors["w1.bias"], tensors["w3.bias"], dim=1
            )
            converted[f"{prefix}.down_proj"] = tensors["w2.weight"].transpose(1, 2).contiguous()
            converted[f"{prefix}.down_proj_bias"] = tensors["w2.bias"]
        except KeyError as missing:
            raise ValueError(f"layer {layer}'s experts lack {missing}") from None
    return converted


def _weight_to_hf(key: str) -> str:
    """The HF name of a torchtune attention/router/output weight (what PEFT wraps)."""
    if key in _TOP_TO_HF:
        return _TOP_TO_HF[key]
    match = _TUNE_LAYER_KEY.fullmatch(key)
    if match is None or match.group(2) not in _LAYER_TO_HF:
        raise ValueError(f"'{key}' is no linear of exactga's gpt-oss model that PEFT can adapt")
    return f"model.layers.{match.group(1)}.{_LAYER_TO_HF[match.group(2)]}"


def adapter_to_peft(adapter_state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """torchtune's gpt-oss adapter in PEFT's names: the attention and output adapters. The
    experts' stacked adapters and the router's are left out with a warning: transformers'
    ``GptOssForCausalLM`` holds the experts as 3-d parameters and its router as no
    ``nn.Linear``, which PEFT's LoRA cannot target as torchtune trains them; torchtune's
    ``adapter_model.pt`` and the merged full weights hold them."""
    left_out = [key for key in adapter_state_dict if _TUNE_ADAPTER_WITHOUT_PEFT.fullmatch(key)]
    if left_out:
        warnings.warn(
            f"the PEFT adapter file leaves out {len(left_out)} adapter tensors of the experts "
            f"or routers (e.g. '{left_out[0]}'), which PEFT cannot target in transformers' "
            "GptOssForCausalLM; adapter_model.pt (torchtune's format) and the merged model "
            "weights hold them.",
            stacklevel=2,
        )
    kept = {key: value for key, value in adapter_state_dict.items() if key not in left_out}
    return peft_adapter(kept, _weight_to_hf)


def hf_config(builder_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of the model ``gpt_oss(**builder_kwargs)`` builds, as transformers'
    ``GptOssConfig`` reads it (a LoRA builder's extra arguments are ignored)."""
    kwargs = builder_arguments(gpt_oss, builder_kwargs, "gpt-oss")
    layer_types = gpt_oss_layer_types(kwargs["num_layers"], kwargs["layer_types"])
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": kwargs["vocab_size"],
        "hidden_size": kwargs["embed_dim"],
        "intermediate_size": kwargs["intermediate_dim"],
        "num_hidden_layers": kwargs["num_layers"],
        "num_attention_heads": kwargs["num_heads"],
        "num_key_value_heads": kwargs["num_kv_heads"],
        "head_dim": kwargs["head_dim"],
        "num_local_experts": kwargs["num_experts"],
        "num_experts_per_tok": kwargs["num_experts_per_tok"],
        "sliding_window": kwargs["sliding_window"],
        "layer_types": layer_types,
        "max_position_embeddings": kwargs["max_seq_len"],
        "rms_norm_eps": kwargs["norm_eps"],
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": kwargs["rope_base"],
            "factor": kwargs["rope_scaling_factor"],
            "original_max_position_embeddings": kwargs["rope_original_max_seq_len"],
            "beta_fast": kwargs["rope_beta_fast"],
            "beta_slow": kwargs["rope_beta_slow"],
            "truncate": kwargs["rope_truncate"],
        },
        "swiglu_alpha": kwargs["swiglu_alpha"],
        "swiglu_limit": kwargs["swiglu_limit"],
        "attention_bias": True,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }


def saved_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of what a save writes: the weights are dequantised, so a released
    folder's ``quantization_config`` is dropped."""
    return {key: value for key, value in config.items() if key != "quantization_config"}


GPT_OSS_FORMAT = HFFormat(
    architecture="GptOssForCausalLM",
    hf_model_type="gpt_oss",
    hf_to_tune=hf_to_tune,
    tune_to_hf=tune_to_hf,
    adapter_to_peft=adapter_to_peft,
    hf_config=hf_config,
    saved_config=saved_config,
)
