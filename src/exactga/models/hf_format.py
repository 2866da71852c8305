"""How a model family's weights are named and laid out in Hugging Face's files, both ways.

torchtune 0.6.1's ``FullModelHFCheckpointer`` picks its conversion with a fixed ``ModelType``
enum, which has no member for the families exactga adds. Each family package here describes its
format once (an :class:`HFFormat`), and :mod:`exactga.models.checkpointer` and the seeded initial
checkpoint (``exactga.models.random_init_checkpointer``) look it up by the checkpointer's
``model_type`` name, so reading, writing and the first checkpoint of a tiny test model can never
disagree on a key.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

StateDict = dict[str, torch.Tensor]
# (state dict, the checkpoint's config.json as a dict) -> converted state dict
Conversion = Callable[[StateDict, Mapping[str, Any]], StateDict]


@dataclass(frozen=True)
class HFFormat:
    """One family's Hugging Face format.

    Args:
        architecture: ``config.json``'s ``architectures[0]``, e.g. ``"Qwen3ForCausalLM"``.
        hf_model_type: ``config.json``'s ``model_type``, e.g. ``"qwen3"``.
        hf_to_tune: HF names and layout to torchtune's (what ``model.load_state_dict`` takes).
        tune_to_hf: the inverse, for saving; ``hf_to_tune(tune_to_hf(sd, c), c)`` equals ``sd``.
        adapter_to_peft: a LoRA adapter state dict (torchtune's keys) to PEFT's keys and
            layout, so ``PeftModel.from_pretrained`` loads the saved adapter.
        hf_config: the keyword arguments of the family's component builder to the
            ``config.json`` fields a model built with them has (for seeded test checkpoints).
        saved_config: the ``config.json`` of the weights a save writes, from the one read: the
            same for most families; a multimodal release's text config when only its text
            decoder is trained (Gemma 3 4B and up).
        peft_config: PEFT's ``adapter_config.json`` for an adapter (torchtune's keys), from the
            one torchtune's ``tune_to_peft_adapter_config`` writes: the same for most families;
            gpt-oss's adds the 3-d expert parameters PEFT targets (``target_parameters``).
    """

    architecture: str
    hf_model_type: str
    hf_to_tune: Conversion
    tune_to_hf: Conversion
    adapter_to_peft: Conversion
    hf_config: Callable[[Mapping[str, Any]], dict[str, Any]]
    saved_config: Callable[[Mapping[str, Any]], dict[str, Any]] = dict
    peft_config: Callable[[dict[str, Any], StateDict], dict[str, Any]] = lambda config, _: config


# torchtune adapter parameter -> PEFT's (PEFT drops its adapter name, "default", on save and keeps
# a DoRA magnitude without ".weight"); and what PeftModel puts before the wrapped model's names.
_PEFT_PARAMETERS = {
    "lora_a.weight": "lora_A.weight",
    "lora_b.weight": "lora_B.weight",
    "magnitude": "lora_magnitude_vector",
}
PEFT_PREFIX = "base_model.model."


def peft_adapter(adapter: StateDict, weight_to_hf: Callable[[str], str]) -> StateDict:
    """A torchtune LoRA/DoRA adapter (``layers.0.attn.q_proj.lora_a.weight``, ...,
    ``...magnitude``) in PEFT's names (``base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight``, ..., ``...lora_magnitude_vector``), for a family whose HF rows are in
    torchtune's order (no RoPE permutation: tensors as they are).

    ``weight_to_hf`` is the family's HF name of a torchtune weight: the adapted linear's own
    weight names its module in both formats. It raises ``ValueError`` for a module the family's
    model has not; so does this for a key that is no adapter parameter.
    """
    converted: StateDict = {}
    for key, value in adapter.items():
        parameter = next((p for p in _PEFT_PARAMETERS if key.endswith("." + p)), None)
        if parameter is None:
            raise ValueError(f"'{key}' is no LoRA/DoRA adapter parameter")
        module = key[: -len(parameter) - 1]
        hf_module = weight_to_hf(f"{module}.weight").removesuffix(".weight")
        converted[f"{PEFT_PREFIX}{hf_module}.{_PEFT_PARAMETERS[parameter]}"] = value
    return converted


# checkpointer.model_type -> "module:attribute" of its HFFormat; imported on first use so that
# naming a checkpointer loads only the family it converts.
FORMATS = {
    "QWEN3": "exactga.models.qwen3._convert_weights:QWEN3_FORMAT",
    "GEMMA3": "exactga.models.gemma3._convert_weights:GEMMA3_FORMAT",
    "QWEN3_MOE": "exactga.models.qwen3_moe._convert_weights:QWEN3_MOE_FORMAT",
    "GPT_OSS": "exactga.models.gpt_oss._convert_weights:GPT_OSS_FORMAT",
}


def hf_format(model_type: str) -> HFFormat | None:
    """The format of ``model_type`` if exactga adds that family, else ``None`` (a stock type)."""
    where = FORMATS.get(model_type)
    if where is None:
        return None
    module, attribute = where.split(":")
    return getattr(importlib.import_module(module), attribute)


def builder_arguments(
    builder: Callable[..., Any], given: Mapping[str, Any], family: str
) -> dict[str, Any]:
    """``given`` (a builder's keyword arguments, some left out) with ``builder``'s own defaults
    for what it leaves out, so a ``config.json`` derived from them describes the model the
    builder builds. A LoRA builder's extra arguments pass through (the base is the same model).

    Raises:
        ValueError: an argument ``builder`` requires is missing, naming the family and it.
    """
    parameters = inspect.signature(builder).parameters.values()
    required = [p.name for p in parameters if p.default is inspect.Parameter.empty]
    missing = [name for name in required if given.get(name) is None]
    if missing:
        raise ValueError(f"the {family} config.json needs the builder arguments {missing}")
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return {**defaults, **given}
