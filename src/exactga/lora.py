"""LoRA, DoRA and QLoRA adapters: their first values, how they are loaded, what is saved.

Both LoRA recipes (one device, and FSDP over N ranks) call these, so that a run moved from one
GPU to two starts from the same adapters and writes the same files. See [adapter init].

# Note [adapter init]
# torchtune draws a LoRA module's ``lora_a`` when the module is built, from the global RNG:
# on one device that is after every earlier module's draws, so the adapters depend on the
# model's layout; under FSDP the model is built on the meta device and torchtune draws each
# *shard* after sharding, from each rank's own generator, so the adapters depend on the number
# of ranks too. Here the full adapter tensors are drawn on the host from the run's ``seed``
# alone, module by module in ``named_modules()`` order, with torchtune's own initialisers
# (Kaiming-uniform ``lora_a``, zero ``lora_b``), and loaded like any state dict; the global
# RNG is left as it was. A run starts from the same adapters on one device and on N ranks.
# They are drawn in fp32 (or fp64) and then cast: torch draws another stream for a bf16
# tensor, so a bf16 run would start from adapters unrelated to the fp32 run's, and no
# comparison of the precisions (docs/precision.md) would mean anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import training
from torchtune.modules.peft import (
    DoRALinear,
    LoRALinear,
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    validate_missing_and_unexpected_for_lora,
)
from torchtune.modules.peft.lora import _lora_a_init_params, _lora_b_init_params

from exactga.checkpointing import move_peft_adapter_to_own_folder
from exactga.model_state import load_model_state, state_dict_name, state_dict_shapes
from exactga.schemas import check_lora_model

# How a state dict reaches the model: ``nn.Module.load_state_dict(strict=False)`` on one
# device, torchtune's ``load_from_full_model_state_dict`` under FSDP. Returns missing and
# unexpected keys.
LoadStateDict = Callable[[nn.Module, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class LoraSettings:
    """The adapters' shape, as the ``model`` section of a LoRA config gives it."""

    rank: int
    alpha: float
    attn_modules: tuple[str, ...]
    apply_to_mlp: bool
    apply_to_output: bool

    @classmethod
    def from_config(cls, cfg_model: DictConfig) -> LoraSettings:
        """Read the section, or say which keys a LoRA builder would have.

        Raises:
            ValueError: the section is not a LoRA/QLoRA builder's.
        """
        check_lora_model(cfg_model)
        return cls(
            rank=cfg_model.lora_rank,
            alpha=cfg_model.lora_alpha,
            attn_modules=tuple(cfg_model.lora_attn_modules),
            apply_to_mlp=cfg_model.apply_lora_to_mlp,
            apply_to_output=cfg_model.get("apply_lora_to_output", False),
        )

    def adapter_config(self) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` content, as stock torchtune writes it."""
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": get_lora_module_names(
                list(self.attn_modules), self.apply_to_mlp, self.apply_to_output
            ),
            "peft_type": "LORA",
        }


def load_lora_weights(
    model: nn.Module,
    settings: LoraSettings,
    *,
    base_state: Mapping[str, Any],
    base_source: str,
    adapters: Mapping[str, Any] | None,
    load: LoadStateDict,
    seed: int,
    dtype: torch.dtype,
) -> None:
    """Load the frozen base, then the adapters to go on from or fresh ones ([adapter init]).

    The order matters for DoRA: its magnitudes start as the norms of the loaded base weights,
    and a resumed run's trained magnitudes must overwrite those.

    Raises:
        ValueError: base weights of another model, or adapters that do not fit the model.
    """
    base_missing, base_unexpected = load_model_state(
        model, base_state, base_source, load=load, strict=False
    )
    if adapters is None:
        initialize_adapters(model, dtype=dtype, seed=seed, load=load)
    for module in model.modules():
        if hasattr(module, "initialize_dora_magnitude"):
            module.initialize_dora_magnitude()
    lora_missing = lora_unexpected = None
    if adapters is not None:
        lora_missing, lora_unexpected = load(model, adapters)
    validate_missing_and_unexpected_for_lora(
        lora_attn_modules=list(settings.attn_modules),
        apply_lora_to_mlp=settings.apply_to_mlp,
        apply_lora_to_output=settings.apply_to_output,
        base_missing=base_missing,
        base_unexpected=base_unexpected,
        lora_missing=lora_missing,
        lora_unexpected=lora_unexpected,
    )


def initialize_adapters(
    model: nn.Module, *, dtype: torch.dtype, seed: int, load: LoadStateDict
) -> None:
    """Give every LoRA/DoRA adapter its first value, from ``seed`` alone ([adapter init]).

    The drawn tensors are keyed as ``model.state_dict()`` keys them (see [state-dict keys]);
    DoRA magnitudes get a placeholder, set from the base weights afterwards.

    Raises:
        ValueError: a drawn adapter has no parameter of that name to land in.
    """
    drawn: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _draw_adapters(model, dtype, drawn)
    _check_keys_exist(drawn, state_dict_shapes(model).keys())
    load(model, drawn)


def _draw_adapters(model: nn.Module, dtype: torch.dtype, out: dict[str, torch.Tensor]) -> None:
    for module_name, module in model.named_modules():
        if not isinstance(module, (LoRALinear, DoRALinear)):
            continue
        name = state_dict_name(module_name)
        for part, init in (("lora_a", _lora_a_init_params), ("lora_b", _lora_b_init_params)):
            shape = getattr(module, part).weight.shape
            draw_dtype = torch.promote_types(dtype, torch.float32)  # see [adapter init]
            linear = nn.Linear(shape[1], shape[0], bias=False, device="meta", dtype=draw_dtype)
            linear = linear.to_empty(device="cpu")
            init(linear)
            out[f"{name}.{part}.weight"] = linear.weight.detach().to(dtype)
        if isinstance(module, DoRALinear):
            out[f"{name}.magnitude"] = torch.ones(module.out_dim, dtype=dtype)


def _check_keys_exist(drawn: Mapping[str, torch.Tensor], model_keys: Any) -> None:
    known = set(model_keys)
    missing = [key for key in drawn if key not in known]
    if missing:
        raise ValueError(
            f"initial LoRA adapter '{missing[0]}' has no parameter of that name in the model's "
            f"state dict ({len(missing)} such keys); the model section's LoRA builder and its "
            "wrappers disagree. Please report this with your config."
        )


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable adapter tensors, keyed as the state dict keys them, for step checkpoints.

    Read from the parameters rather than ``state_dict()``, which for QLoRA would dequantize
    every frozen NF4 weight just to drop it.
    """
    return {
        state_dict_name(name): param.detach() for name, param in get_adapter_params(model).items()
    }


def epoch_checkpoint_weights(
    state_dict: dict[str, Any], settings: LoraSettings, merge: bool
) -> dict[str, Any]:
    """What stock hands its checkpointer at an epoch's end, from a host ``state_dict``.

    The adapters and the adapter config, and with ``merge`` (stock: unless
    ``save_adapter_weights_only``) the full weights with the adapters merged in. Merging adds
    each adapter into its base weight *in place* (torchtune's ``get_merged_lora_ckpt``), so
    those base weights are copied first: a host state dict can share storage with the model
    (on CPU, or gathered from one rank), whose frozen base would otherwise silently take the
    adapters in (stock 0.6.1's bug on CPU).
    """
    weights: dict[str, Any] = {
        training.ADAPTER_KEY: get_adapter_state_dict(state_dict),
        training.ADAPTER_CONFIG: settings.adapter_config(),
    }
    if merge:
        weights[training.MODEL_KEY] = get_merged_lora_ckpt(
            _with_merge_targets_copied(state_dict), rank=settings.rank, alpha=settings.alpha
        )
    return weights


def save_epoch_checkpoint(
    checkpointer: Any,
    state_dict: dict[str, Any],
    settings: LoraSettings,
    *,
    epoch: int,
    adapter_only: bool,
    training_state: dict[str, Any] | None = None,
) -> None:
    """Write an epoch's checkpoint through torchtune's ``checkpointer``: the adapters, merged
    weights unless ``adapter_only``, and ``training_state`` (recipe and optimizer state) when
    training goes on; then the PEFT adapter moves to ``epoch_N/adapter/``, see [adapter
    folder]. Every recipe that trains adapters saves through this call (on rank 0)."""
    ckpt_dict = epoch_checkpoint_weights(state_dict, settings, merge=not adapter_only)
    if training_state is not None:
        ckpt_dict.update(training_state)
    checkpointer.save_checkpoint(
        ckpt_dict,
        epoch=epoch,
        intermediate_checkpoint=training_state is not None,
        adapter_only=adapter_only,
    )
    epoch_dir = Path(checkpointer._output_dir) / f"epoch_{epoch}"
    move_peft_adapter_to_own_folder(epoch_dir, base_model_of(checkpointer))


def base_model_of(checkpointer: Any) -> str | None:
    """What ``adapter_config.json`` names as the base: the hub repository torchtune recorded
    (``repo_id``), else the checkpoint folder when it is a Hugging Face model folder."""
    repo_id = getattr(checkpointer, "repo_id", None)
    if repo_id:
        return str(repo_id)
    checkpoint_dir = Path(checkpointer._checkpoint_dir).resolve()
    return str(checkpoint_dir) if (checkpoint_dir / "config.json").is_file() else None


def _with_merge_targets_copied(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``state_dict`` whose weights that merging writes into are copies."""
    copied = dict(state_dict)
    for key in state_dict:
        if key.endswith(".lora_a.weight"):
            target = key[: -len(".lora_a.weight")] + ".weight"
            copied[target] = state_dict[target].to("cpu", copy=True)
    return copied
