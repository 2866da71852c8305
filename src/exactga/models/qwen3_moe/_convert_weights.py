"""Qwen3 MoE's Hugging Face format (:data:`QWEN3_MOE_FORMAT`): weights both ways, PEFT adapter
names, and the ``config.json`` of a model :func:`~exactga.models.qwen3_moe.qwen3_moe` builds.

Attention, norms, embeddings and a dense layer's MLP are named as dense Qwen3's. The experts
differ in layout (see [Qwen3 MoE expert layouts]): the files hold one weight per expert and
projection, ``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight``, which are stacked
into torchtune's ``layers.{i}.mlp.experts.{w1,w3,w2}.weight`` (``[E, out, in]``) on reading and
split again on writing; the router ``model.layers.{i}.mlp.gate.weight`` is
``layers.{i}.mlp.router.gate.weight``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from exactga.models.hf_format import HFFormat, StateDict, builder_arguments
from exactga.models.qwen3._convert_weights import QWEN3_FORMAT, decoder_config_fields
from exactga.models.qwen3_moe._component_builders import qwen3_moe

# HF per-expert projection -> torchtune's stacked projection, and back.
_EXPERT_FROM_HF = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_TO_HF = {tune: hf for hf, tune in _EXPERT_FROM_HF.items()}
_HF_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight")
# transformers 5's in-memory fused layout, read too (a state dict saved with torch.save).
_HF_FUSED_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_HF_ROUTER_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")
_TUNE_EXPERTS_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.(w[123])\.weight")
_TUNE_ROUTER_KEY = re.compile(r"layers\.(\d+)\.mlp\.router\.gate\.weight")
# Adapter keys PEFT cannot load into transformers 5's Qwen3MoeForCausalLM; see [Qwen3 MoE
# adapters in PEFT].
_TUNE_ADAPTER_WITHOUT_PEFT = re.compile(r"layers\.\d+\.mlp\.(experts\.w[123]|router\.gate)\..+")


def _num_experts(config: Mapping[str, Any], experts: dict[int, torch.Tensor]) -> int:
    """The config's expert count (``num_local_experts`` is how transformers 5 writes it),
    else the highest expert index read plus one."""
    for name in ("num_experts", "num_local_experts"):
        if config.get(name):
            return int(config[name])
    return max(experts) + 1


def _stack_experts(
    layer: str, projection: str, experts: dict[int, torch.Tensor], num_experts: int
) -> torch.Tensor:
    """One layer's per-expert weights of one projection as ``[E, out, in]``."""
    missing = [index for index in range(num_experts) if index not in experts]
    if missing:
        raise ValueError(
            f"'model.layers.{layer}.mlp.experts.{missing[0]}.{projection}.weight' is missing "
            f"from the Hugging Face Qwen3 MoE checkpoint (it has experts {sorted(experts)})"
        )
    extra = [index for index in experts if index >= num_experts]
    if extra:
        raise ValueError(
            f"'model.layers.{layer}.mlp.experts.{extra[0]}.{projection}.weight': expert "
            f"{extra[0]} of a Qwen3 MoE checkpoint whose config.json has {num_experts} experts"
        )
    return torch.stack([experts[index] for index in range(num_experts)])


def hf_to_tune(state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """A Hugging Face Qwen3 MoE state dict in torchtune's names and layout.

    Args:
        state_dict: the weights, every checkpoint file's merged: per-expert keys (what
            ``save_pretrained`` and the Hub's files hold) or transformers 5's fused
            ``experts.gate_up_proj`` / ``experts.down_proj``.
        config: the checkpoint's ``config.json``; ``tie_word_embeddings`` is read.

    Raises:
        ValueError: a key that is no Qwen3 MoE weight, or an expert missing from a layer.
    """
    converted: StateDict = {}
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    rest: StateDict = {}
    for key, value in state_dict.items():
        expert, fused, router = (
            pattern.fullmatch(key) for pattern in (_HF_EXPERT_KEY, _HF_FUSED_KEY, _HF_ROUTER_KEY)
        )
        if expert and expert.group(3) in _EXPERT_FROM_HF:
            layer, index, projection = expert.groups()
            per_expert.setdefault((layer, projection), {})[int(index)] = value
        elif fused:
            converted.update(_unfused_experts(*fused.groups(), value))
        elif router:
            converted[f"layers.{router.group(1)}.mlp.router.gate.weight"] = value
        else:
            rest[key] = value
    for (layer, projection), experts in per_expert.items():
        stacked = _stack_experts(layer, projection, experts, _num_experts(config, experts))
        converted[f"layers.{layer}.mlp.experts.{_EXPERT_FROM_HF[projection]}.weight"] = stacked
    # Everything else is named as in dense Qwen3, which raises for a key neither model has.
    converted.update(QWEN3_FORMAT.hf_to_tune(rest, config))
    return converted


def _unfused_experts(layer: str, name: str, value: torch.Tensor) -> StateDict:
    """transformers 5's in-memory expert parameters as torchtune's: ``gate_up_proj`` is
    ``[E, 2 * hidden, dim]``, gate rows first (its forward's ``.chunk(2, dim=-1)``)."""
    prefix = f"layers.{layer}.mlp.experts"
    if name == "down_proj":
        return {f"{prefix}.w2.weight": value}
    gate, up = value.chunk(2, dim=1)
    return {f"{prefix}.w1.weight": gate, f"{prefix}.w3.weight": up}


def tune_to_hf(state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """torchtune's Qwen3 MoE state dict in the Hugging Face files' names and layout (per-expert
    weights): the inverse of :func:`hf_to_tune` for per-expert files.

    Args:
        state_dict: :func:`qwen3_moe`'s weights (a LoRA model's merged: no adapter keys).
        config: the model's ``config.json``; the names do not depend on it.

    Raises:
        ValueError: a key :func:`qwen3_moe`'s model has not.
    """
    converted: StateDict = {}
    rest: StateDict = {}
    for key, value in state_dict.items():
        experts, router = _TUNE_EXPERTS_KEY.fullmatch(key), _TUNE_ROUTER_KEY.fullmatch(key)
        if experts:
            layer, projection = experts.groups()
            hf_projection = _EXPERT_TO_HF[projection]
            for index in range(value.shape[0]):
                # A copy: safetensors refuses tensors that share storage (slices of one stack).
                hf_key = f"model.layers.{layer}.mlp.experts.{index}.{hf_projection}.weight"
                converted[hf_key] = value[index].clone()
        elif router:
            converted[f"model.layers.{router.group(1)}.mlp.gate.weight"] = value
        else:
            rest[key] = value
    converted.update(QWEN3_FORMAT.tune_to_hf(rest, config))
    return converted


def adapter_to_peft(adapter_state_dict: StateDict, config: Mapping[str, Any]) -> StateDict:
    """torchtune's Qwen3 MoE adapter in PEFT's names: the attention, output and dense-MLP
    adapters, as dense Qwen3's. The experts' and routers' adapters are left out with a warning
    (see [Qwen3 MoE adapters in PEFT]); torchtune's ``adapter_model.pt`` and the merged weights
    hold them.

    Raises:
        ValueError: a key that is no adapter parameter of a Qwen3 MoE module.
    """
    left_out = [key for key in adapter_state_dict if _TUNE_ADAPTER_WITHOUT_PEFT.fullmatch(key)]
    if left_out:
        warnings.warn(
            f"the PEFT adapter file leaves out {len(left_out)} adapter tensors of the experts "
            f"or routers (e.g. '{left_out[0]}'): transformers 5's Qwen3MoeForCausalLM holds "
            "each layer's experts as fused 3-d parameters and its router as no nn.Linear, "
            "which PEFT's LoRA cannot target as torchtune trains them. adapter_model.pt "
            "(torchtune's format) and the merged model weights hold them.",
            stacklevel=2,
        )
    kept = {key: value for key, value in adapter_state_dict.items() if key not in left_out}
    return QWEN3_FORMAT.adapter_to_peft(kept, config)


def hf_config(builder_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of the model ``qwen3_moe(**builder_kwargs)`` builds, as transformers'
    ``Qwen3MoeConfig`` reads it (a LoRA builder's extra arguments are ignored).

    Raises:
        ValueError: a required argument of :func:`qwen3_moe` is missing.
    """
    kwargs = builder_arguments(qwen3_moe, builder_kwargs, "Qwen3 MoE")
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        # Unused when every layer is sparse; the released files hold 6144 (30B) / 12288 (235B).
        "intermediate_size": kwargs["intermediate_dim"] or 4 * kwargs["embed_dim"],
        "moe_intermediate_size": kwargs["moe_intermediate_dim"],
        "num_experts": kwargs["num_experts"],
        "num_experts_per_tok": kwargs["num_experts_per_tok"],
        # Always written: Qwen3MoeConfig's default is false, the released models' true.
        "norm_topk_prob": bool(kwargs["norm_topk_prob"]),
        "decoder_sparse_step": kwargs["decoder_sparse_step"],
        "mlp_only_layers": list(kwargs["mlp_only_layers"]),
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        **decoder_config_fields(kwargs),
    }


QWEN3_MOE_FORMAT = HFFormat(
    architecture="Qwen3MoeForCausalLM",
    hf_model_type="qwen3_moe",
    hf_to_tune=hf_to_tune,
    tune_to_hf=tune_to_hf,
    adapter_to_peft=adapter_to_peft,
    hf_config=hf_config,
)


# Note [Qwen3 MoE expert layouts]
# Three layouts of one layer's experts (E experts of hidden width I on a model of width D):
# - the files (the Hub's and what transformers 5.24's save_pretrained writes): per expert j,
#   mlp.experts.{j}.gate_proj.weight [I, D], up_proj.weight [I, D], down_proj.weight [D, I];
# - transformers 5's Qwen3MoeExperts in memory: mlp.experts.gate_up_proj [E, 2I, D] (gate rows
#   then up rows) and mlp.experts.down_proj [E, D, I], converted from and to the files by
#   transformers' own conversion mapping when it loads and saves;
# - torchtune's here: mlp.experts.w1.weight [E, I, D] (gate), w3.weight [E, I, D] (up),
#   w2.weight [E, D, I] (down), separate so each can take its own LoRA pair and so w1/w3 need no
#   split in the forward.
# The checkpointer reads and writes the files, so hf_to_tune stacks and tune_to_hf splits; reading
# also takes the fused in-memory names, for a state dict someone saved with torch.save.


# Note [Qwen3 MoE adapters in PEFT]
# PEFT's LoRA targets nn.Linear modules by name (target_modules), or parameters
# (target_parameters, PEFT 0.17+). In transformers 5's Qwen3MoeForCausalLM the experts are not
# Linear modules but two 3-d parameters per layer, gate_up_proj fused, and the router is a
# Qwen3MoeTopKRouter holding a bare weight. A target_parameters adapter is one low-rank pair
# per expert on the fused [2I, D] gate_up weight, while torchtune trains one pair on w1 and one
# on w3: representable (rank 2r with a block-diagonal factor), but only with a per-module rank
# in adapter_config.json, which the checkpointer writes from the recipe's adapter settings for
# every module alike. So the PEFT file holds the adapters PEFT can load as trained (attention,
# output, dense-layer MLP); the experts' and routers' adapters are in torchtune's
# adapter_model.pt and, merged, in the full weights, which transformers loads.
