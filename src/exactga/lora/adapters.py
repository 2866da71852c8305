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

# Note [DoRA in PEFT]
# torchtune's HF checkpointer writes the PEFT adapter with ``tune_to_peft_adapter_weights``,
# which renames each DoRA ``magnitude`` to PEFT's ``lora_magnitude_vector`` and permutes the
# rows of q_proj's and k_proj's ``lora_B`` from torchtune's rotary order into Hugging Face's,
# but leaves those projections' magnitudes (one value per output row, so per the same rows) in
# torchtune's order; and the adapter config it writes has no ``use_dora``, so PEFT builds plain
# LoRA and drops the magnitudes. On the tiny DoRA run PEFT's merged projections were then
# 2.1e-2 to 3.3e-2 off the run's, and q_proj still 1.2e-1 off with ``use_dora`` alone. Here
# the config says ``use_dora`` when the adapters have magnitudes, and those of q_proj and
# k_proj get lora_B's row permutation in the file torchtune wrote, before the adapter folder
# appears. LoRA adapters (no magnitudes) are left exactly as torchtune writes them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from safetensors.torch import load_file, save_file
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

from exactga.config.schemas import check_lora_model
from exactga.models.model_state import load_model_state, state_dict_name, state_dict_shapes
from exactga.models.moe.experts import LoRAStackedLinear
from exactga.run.checkpointing import (
    ADAPTER_SUBDIR,
    PEFT_ADAPTER_FILES,
    move_peft_adapter_to_own_folder,
)

# How a state dict reaches the model: ``nn.Module.load_state_dict(strict=False)`` on one
# device, torchtune's ``load_from_full_model_state_dict`` under FSDP. Returns missing and
# unexpected keys.
LoadStateDict = Callable[[nn.Module, Mapping[str, Any]], Any]


def _builder_argument(cfg_model: DictConfig, name: str) -> Any:
    """``name`` as the section's builder is called with it: the section's value, else the
    builder's own default (its signature's, not restated here); None where the builder takes
    no such argument."""
    if name in cfg_model:
        return cfg_model[name]
    from torchtune.config._utils import _get_component_from_path

    builder = _get_component_from_path(str(cfg_model._component_))
    parameter = inspect.signature(builder).parameters.get(name)
    return None if parameter is None else parameter.default


@dataclass(frozen=True)
class LoraSettings:
    """The adapters' shape, as the ``model`` section of a LoRA config gives it."""

    rank: int
    alpha: float
    attn_modules: tuple[str, ...]
    apply_to_mlp: bool
    apply_to_output: bool
    apply_to_router: bool = False  # a mixture of experts' router gates (``mlp.router.gate``)

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
            # A builder that takes no such argument puts no adapter on the output.
            apply_to_output=bool(_builder_argument(cfg_model, "apply_lora_to_output")),
            apply_to_router=bool(_builder_argument(cfg_model, "apply_lora_to_router")),
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
    # torchtune's check knows a key as an adapter's by its module's name; the router's adapted
    # linear is named ``gate`` (``layers.N.mlp.router.gate.lora_a.weight``).
    router = ["gate"] if settings.apply_to_router else []
    validate_missing_and_unexpected_for_lora(
        lora_attn_modules=[*settings.attn_modules, *router],
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
        name = state_dict_name(module_name)
        if isinstance(module, LoRAStackedLinear):  # a mixture-of-experts layer's experts
            for part, init in (("lora_a", _lora_a_init_params), ("lora_b", _lora_b_init_params)):
                _, out_dim, in_dim = getattr(module, part).weight.shape
                drawn = [_drawn(init, out_dim, in_dim, dtype) for _ in range(module.num_experts)]
                out[f"{name}.{part}.weight"] = torch.stack(drawn)  # expert by expert, in order
            continue
        if not isinstance(module, (LoRALinear, DoRALinear)):
            continue
        for part, init in (("lora_a", _lora_a_init_params), ("lora_b", _lora_b_init_params)):
            out_dim, in_dim = getattr(module, part).weight.shape
            out[f"{name}.{part}.weight"] = _drawn(init, out_dim, in_dim, dtype)
        if isinstance(module, DoRALinear):
            out[f"{name}.magnitude"] = torch.ones(module.out_dim, dtype=dtype)


def _drawn(
    init: Callable[[nn.Linear], None], out_dim: int, in_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """One adapter factor as torchtune's ``LoRALinear`` draws it, on the CPU in fp32 at least
    (see [adapter init]), then in ``dtype``."""
    draw_dtype = torch.promote_types(dtype, torch.float32)
    linear = nn.Linear(in_dim, out_dim, bias=False, device="meta", dtype=draw_dtype)
    linear = linear.to_empty(device="cpu")
    init(linear)
    return linear.weight.detach().to(dtype)


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
    adapters = get_adapter_state_dict(state_dict)
    adapter_config = settings.adapter_config()
    if any(key.endswith(".magnitude") for key in adapters):
        adapter_config["use_dora"] = True  # see [DoRA in PEFT]
    weights: dict[str, Any] = {
        training.ADAPTER_KEY: adapters,
        training.ADAPTER_CONFIG: adapter_config,
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
    use_dora = ckpt_dict[training.ADAPTER_CONFIG].get("use_dora", False)
    if training_state is not None:
        ckpt_dict.update(training_state)
    epoch_dir = Path(checkpointer._output_dir) / f"epoch_{epoch}"
    with _adapter_logged_where_it_ends(epoch_dir):
        checkpointer.save_checkpoint(
            ckpt_dict,
            epoch=epoch,
            intermediate_checkpoint=training_state is not None,
            adapter_only=adapter_only,
        )
    # An exactga family's format writes PEFT's order itself; only torchtune's file is fixed.
    if getattr(checkpointer, "hf_format", None) is None:
        hf_config = getattr(checkpointer, "_config", None)
        if _rotates_halves(checkpointer):  # see [Qwen2 adapters in PEFT]
            _rewrite_peft_adapter(epoch_dir, hf_config, peft_lora_b_unpermuted)
        elif use_dora:
            _rewrite_peft_adapter(epoch_dir, hf_config, peft_magnitudes_in_hf_order)
    move_peft_adapter_to_own_folder(epoch_dir, base_model_of(checkpointer))


@contextlib.contextmanager
def _adapter_logged_where_it_ends(epoch_dir: Path) -> Iterator[None]:
    """torchtune logs the PEFT files it writes as ``epoch_N/adapter_model.safetensors``; they
    move to ``epoch_N/adapter/`` right after (see [adapter folder]), so its lines name that."""
    logger = logging.getLogger("torchtune.utils._logging")  # every torchtune module's logger
    moved = {
        str(epoch_dir / name): str(epoch_dir / ADAPTER_SUBDIR / name) for name in PEFT_ADAPTER_FILES
    }

    def rewrite(record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            for written, final in moved.items():
                if record.msg.endswith(written):
                    record.msg = record.msg[: -len(written)] + final
        return True

    logger.addFilter(rewrite)
    try:
        yield
    finally:
        logger.removeFilter(rewrite)


# Note [Qwen2 adapters in PEFT]
# torchtune 0.6.1's HF checkpointer writes every model type's PEFT adapter (but Phi's and the
# vision model's) with ``tune_to_peft_adapter_weights``, which permutes the rows of q_proj's and
# k_proj's ``lora_B`` from torchtune's interleaved rotary order into Hugging Face's halves. Qwen2
# has no such permutation: torchtune builds it with the halves' rotary embedding and converts its
# base weights unpermuted. So a stock Qwen2/2.5 adapter loads in PEFT with those rows scrambled
# (tests/test_qwen2_peft_adapter.py: PEFT's logits 0.87 off the trained LoRA model's, 0.025 for
# DoRA, relative L2; under 1e-5 once fixed). The file torchtune wrote is put back in the base
# weights' order here; its DoRA magnitudes were never permuted, so they stay as they are.
_HALVES_MODEL_TYPES = ("QWEN2",)


def _rotates_halves(checkpointer: Any) -> bool:
    """torchtune's checkpointer, for a model whose q/k rows are in Hugging Face's order."""
    model_type = getattr(checkpointer, "_model_type", None)
    return getattr(model_type, "name", None) in _HALVES_MODEL_TYPES


def peft_lora_b_unpermuted(
    weights: Mapping[str, torch.Tensor], *, num_heads: int, num_kv_heads: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """``weights``, a PEFT adapter as ``tune_to_peft_adapter_weights`` returns it, with the
    permutation that function applied to q_proj's and k_proj's ``lora_B`` rows undone. See
    [Qwen2 adapters in PEFT]."""
    heads = {"q_proj": num_heads, "k_proj": num_kv_heads}
    restored = dict(weights)
    for key, value in weights.items():
        projection = key.removesuffix(".lora_B.weight").rsplit(".", 1)[-1]
        if key.endswith(".lora_B.weight") and projection in heads:
            n, rank = heads[projection], value.shape[-1]
            # torchtune's (n, head_dim/2, 2) -> (n, 2, head_dim/2), read backwards.
            restored[key] = value.view(n, 2, head_dim // 2, rank).transpose(1, 2).reshape(-1, rank)
    return restored


def peft_magnitudes_in_hf_order(
    weights: Mapping[str, torch.Tensor], *, num_heads: int, num_kv_heads: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """``weights``, a PEFT adapter as ``tune_to_peft_adapter_weights`` returns it, with the DoRA
    magnitudes of q_proj and k_proj in Hugging Face's rotary row order: the permutation that
    function applies to those projections' ``lora_B`` rows. See [DoRA in PEFT]."""
    heads = {"q_proj": num_heads, "k_proj": num_kv_heads}
    suffix = ".lora_magnitude_vector"
    permuted = dict(weights)
    for key, magnitude in weights.items():
        projection = key.removesuffix(suffix).rsplit(".", 1)[-1]
        if key.endswith(suffix) and projection in heads:
            n = heads[projection]
            # torchtune's _permute_lora_matrix on a matrix of one column.
            permuted[key] = magnitude.view(n, head_dim // 2, 2).transpose(1, 2).reshape(-1)
    return permuted


def _rewrite_peft_adapter(
    epoch_dir: Path,
    hf_config: Mapping[str, Any] | None,
    fix: Callable[..., dict[str, torch.Tensor]],
) -> None:
    """Rewrite the PEFT adapter file torchtune wrote into ``epoch_dir`` (if it wrote one: only
    its HF checkpointer does) with ``fix`` (:func:`peft_magnitudes_in_hf_order` or
    :func:`peft_lora_b_unpermuted`), reading the head counts from the same Hugging Face
    ``config.json`` values torchtune used for ``lora_B``."""
    safetensors_path = epoch_dir / "adapter_model.safetensors"
    bin_path = epoch_dir / "adapter_model.bin"
    if hf_config is None or not (safetensors_path.is_file() or bin_path.is_file()):
        return
    num_heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim", None) or hf_config["hidden_size"] // num_heads
    heads = {
        "num_heads": num_heads,
        "num_kv_heads": hf_config["num_key_value_heads"],
        "head_dim": head_dim,
    }
    # Written beside and renamed over, so the file is torchtune's or the fixed one, never half.
    if safetensors_path.is_file():
        fixed = fix(load_file(safetensors_path), **heads)
        staging = safetensors_path.with_name(f".{safetensors_path.name}.tmp")
        save_file(fixed, staging, metadata={"format": "pt"})  # torchtune's metadata
        os.replace(staging, safetensors_path)
    else:
        weights = torch.load(bin_path, map_location="cpu", weights_only=True)
        staging = bin_path.with_name(f".{bin_path.name}.tmp")
        torch.save(fix(weights, **heads), staging)
        os.replace(staging, bin_path)


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
