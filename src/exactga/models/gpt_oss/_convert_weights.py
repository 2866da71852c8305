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
from exactga.models.hf_format import (
    PEFT_PREFIX,
    HFFormat,
    StateDict,
    builder_arguments,
    peft_adapter,
)

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
_EXPERT_ADAPTER = re.compile(r"layers\.(\d+)\.mlp\.experts\.(w[123]\.lora_[ab]\.weight)")
_ROUTER_ADAPTER = re.compile(r"layers\.(\d+)\.mlp\.router\.gate\.(lora_[ab]\.weight|magnitude)")
# PEFT's LoRA linears in transformers' model, and the parameters it targets for the rest.
_PEFT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head")
# gate_up_proj first: PEFT wraps it innermost (its keys under experts.base_layer).
_PEFT_EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
_PEFT_ROUTER_TARGET = "mlp.router.weight"
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
    """torchtune's gpt-oss adapter in PEFT's names and layouts, every adapter of it.

    The attention and output adapters are PEFT LoRA linears (``target_modules``). The experts'
    and the router's weights are no ``nn.Linear`` in transformers' ``GptOssForCausalLM``, so
    PEFT targets the parameters themselves (``target_parameters``, :func:`peft_config`):

    - ``experts.down_proj`` ``[E, I, D]``: ``w2``'s pairs, PEFT's ``lora_A`` ``[E r, I]``
      (rows expert-major) and ``lora_B`` ``[D, r E]`` (columns rank-major);
    - ``experts.gate_up_proj`` ``[E, D, 2I]``, gate and up interleaved: ``w1``'s and ``w3``'s
      pairs as one adapter of rank ``2r`` whose ``lora_A`` stacks both ``A`` and whose
      ``lora_B`` is block-diagonal (gate rows from ``w1``'s ``B``, up rows from ``w3``'s), the
      same update exactly; ``alpha`` doubles with the rank (``rank_pattern``/
      ``alpha_pattern``), so the scale stays ``alpha / r``. PEFT wraps the module once per
      parameter, the first named innermost: ``gate_up_proj``'s keys are under
      ``experts.base_layer``;
    - ``router.weight`` ``[E, D]``: the gate's pair as it is.

    A DoRA router adapter (a magnitude) has no PEFT form on a parameter: it is left out with
    a warning (``adapter_model.pt`` and the merged weights hold it).
    """
    experts: dict[str, dict[str, torch.Tensor]] = {}
    routers: dict[str, dict[str, torch.Tensor]] = {}
    rest: StateDict = {}
    for key, value in adapter_state_dict.items():
        if match := _EXPERT_ADAPTER.fullmatch(key):
            experts.setdefault(match.group(1), {})[match.group(2)] = value
        elif match := _ROUTER_ADAPTER.fullmatch(key):
            routers.setdefault(match.group(1), {})[match.group(2)] = value
        else:
            rest[key] = value
    converted = peft_adapter(rest, _weight_to_hf)
    for layer, factors in experts.items():
        converted.update(_experts_to_peft(layer, factors))
    dora_routers = [layer for layer, factors in routers.items() if "magnitude" in factors]
    if dora_routers:
        warnings.warn(
            f"the PEFT adapter file leaves out the DoRA router adapters of layers {dora_routers}: "
            "PEFT has no DoRA on a parameter (target_parameters); adapter_model.pt (torchtune's "
            "format) and the merged model weights hold them.",
            stacklevel=2,
        )
    for layer, factors in routers.items():
        if layer not in dora_routers:
            prefix = f"{PEFT_PREFIX}model.layers.{layer}.mlp.router"
            converted[f"{prefix}.lora_A.weight"] = factors["lora_a.weight"]
            converted[f"{prefix}.lora_B.weight"] = factors["lora_b.weight"]
    return converted


def _experts_to_peft(layer: str, factors: dict[str, torch.Tensor]) -> StateDict:
    """One layer's stacked expert pairs (``w1.lora_a.weight`` ``[E, r, D]``, ``w1.lora_b.weight``
    ``[E, I, r]``, ...) as PEFT's 3-d parameter adapters; see :func:`adapter_to_peft`."""
    try:
        a1, b1 = factors["w1.lora_a.weight"], factors["w1.lora_b.weight"]
        a3, b3 = factors["w3.lora_a.weight"], factors["w3.lora_b.weight"]
        a2, b2 = factors["w2.lora_a.weight"], factors["w2.lora_b.weight"]
    except KeyError as missing:
        raise ValueError(f"layer {layer}'s expert adapters lack {missing}") from None
    num_experts, inner, rank = b1.shape
    # gate_up: rank 2r, B [2I, 2r, E] block-diagonal, gate rows even and up rows odd.
    gate_up_b = b1.new_zeros(2 * inner, 2 * rank, num_experts)
    gate_up_b[0::2, :rank] = b1.permute(1, 2, 0)
    gate_up_b[1::2, rank:] = b3.permute(1, 2, 0)
    prefix = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts"
    return {
        f"{prefix}.base_layer.lora_A.weight": torch.cat((a1, a3), dim=1).flatten(0, 1),
        f"{prefix}.base_layer.lora_B.weight": gate_up_b.flatten(1, 2),
        f"{prefix}.lora_A.weight": a2.flatten(0, 1).contiguous(),
        f"{prefix}.lora_B.weight": b2.permute(1, 2, 0).flatten(1, 2).contiguous(),
    }


def peft_config(adapter_config: dict[str, Any], adapter_state_dict: StateDict) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for a gpt-oss adapter: the attention and output modules
    (``target_modules``; torchtune's names of the experts' linears, which transformers' model has
    not, dropped), and the experts' and router's parameters the adapter adapts
    (``target_parameters``, ``gate_up_proj`` of rank and alpha doubled); see
    :func:`adapter_to_peft`."""
    keys = list(adapter_state_dict)
    rank, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    config = {
        **adapter_config,
        "target_modules": [m for m in adapter_config["target_modules"] if m in _PEFT_MODULES],
    }
    targets = []
    if any(_EXPERT_ADAPTER.fullmatch(key) for key in keys):
        targets += _PEFT_EXPERT_TARGETS
        config["rank_pattern"] = {"gate_up_proj": 2 * rank}
        config["alpha_pattern"] = {"gate_up_proj": 2 * alpha}
    routers = [m.group(2) for key in keys if (m := _ROUTER_ADAPTER.fullmatch(key))]
    if routers and "magnitude" not in routers:
        targets.append(_PEFT_ROUTER_TARGET)
    if targets:
        config["target_parameters"] = targets
    return config


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
    peft_config=peft_config,
)
