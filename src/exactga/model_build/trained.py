"""The trained model of a run, built in the one order every recipe uses.

Built on the device (one device) or on the meta device (distributed); the adapters alone made
trainable for LoRA; trainable weights cast as the precision policy keeps them; compiled;
activation checkpointing; tensor and data parallelism (FSDP2, torchtune's sharding with the
precision policy's mixed precision); RoPE buffers initialised; weights loaded (a full state, or a
base plus adapters to go on from or drawn from the seed alone); checked; activation offloading.
A step in another order changes numbers (a cast after sharding, an adapter drawn from a
different RNG state) or memory, which is why no recipe spells the sequence out.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtune import config, modules, training
from torchtune.config._utils import _get_component_from_path
from torchtune.modules import TiedLinear
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.training import FullModelHFCheckpointer
from torchtune.training.activations import apply_selective_activation_checkpointing

from exactga.config.schemas import SingleDeviceRecipeConfig
from exactga.lora.adapters import LoraSettings, load_lora_weights
from exactga.model_build.compiling import compile_layers
from exactga.models.hf_config import (
    CONFIG_JSON,
    missing_arguments_message,
    resolve_model_section,
)
from exactga.models.model_state import load_model_state
from exactga.models.moe import moe_blocks, router_recording_context_fn
from exactga.qat.fake_quant import prepare_for_qat
from exactga.run.resume import ResumePoint, checkpointer_source
from exactga.runtime import distributed
from exactga.runtime.document_attention import instantiate_model
from exactga.runtime.precision import Precision
from exactga.runtime.runtime import parameters_offloaded_to_cpu

# Each model section and the checkpointers that read its weights; the first fills what the
# section leaves out, every one is compared (a DPO reference, a PPO value model).
MODEL_SECTIONS = (
    ("model", ("checkpointer", "ref_checkpointer")),
    ("teacher_model", ("teacher_checkpointer",)),
    ("policy_model", ("checkpointer", "ref_policy_checkpointer")),
    ("reward_and_value_model", ("reward_checkpointer", "value_checkpointer")),
)


def models_from_folders(cfg: DictConfig) -> DictConfig:
    """Each model section of ``cfg`` checked against its Hugging Face checkpointer's
    ``config.json`` and completed from it, before anything is built or written (see
    ``exactga.models.hf_config``): what a section leaves out is the folder's, what it gives
    must be the folder's. The filled arguments are written into ``cfg`` (so
    ``resolved_config.yaml`` shows the model that trains) and logged.

    Raises:
        ValueError: a value the section builds otherwise than the folder's ``config.json``
            (naming the key, both values and the fix), or a builder argument nobody gives.
    """
    # Runs inside validated_config, on the validated DictConfig; a section the recipe's schema
    # lacks (``teacher_model`` outside KD) selects as None.
    for name, checkpointer_keys in MODEL_SECTIONS:
        if "_component_" not in (OmegaConf.select(cfg, name) or {}):
            continue
        model = OmegaConf.to_container(cfg[name], resolve=True)
        without_config = None
        for index, key in enumerate(checkpointer_keys):
            folder = _hf_checkpoint_dir(OmegaConf.select(cfg, key))
            if folder is None:
                continue
            if not (folder / CONFIG_JSON).is_file():
                without_config = without_config or str(folder)
                continue
            model, filled = resolve_model_section(name, model, folder, fill=index == 0)
            if filled:
                with open_dict(cfg[name]):
                    for arg, value in filled.items():
                        cfg[name][arg] = value
                shown = ", ".join(f"{arg}={value}" for arg, value in filled.items())
                distributed.log_rank_zero(f"{name}: from {folder / CONFIG_JSON}: {shown}")
        message = missing_arguments_message(name, model, without_config)
        if message is not None:
            raise ValueError(message)
    return cfg


def _hf_checkpoint_dir(cfg_checkpointer: DictConfig | None) -> Path | None:
    """The folder a Hugging Face checkpointer reads (``None`` for another checkpointer, such
    as the tiny configs' seeded one, which writes its folder from the model section)."""
    if not cfg_checkpointer or "_component_" not in cfg_checkpointer:
        return None
    try:
        component = _get_component_from_path(cfg_checkpointer._component_)
    except Exception:  # noqa: BLE001 - instantiating the checkpointer names the bad path
        return None
    if not (isinstance(component, type) and issubclass(component, FullModelHFCheckpointer)):
        return None
    if cfg_checkpointer.get("checkpoint_dir") is None:
        return None
    return Path(cfg_checkpointer.checkpoint_dir)


@dataclass(frozen=True)
class ModelSettings:
    """The keys that decide how the model is built; ``from_settings`` reads them once from the
    recipe's typed settings (a key its schema lacks, a sharding key on one device, is off)."""

    compile: bool = False
    activation_checkpointing: bool = False
    activation_offloading: bool = False
    ac_mode: str | None = None  # torchtune's selective activation checkpointing
    ac_option: int | None = None
    custom_sharded_layers: list[str] | None = None
    fsdp_cpu_offload: bool = False
    fsdp_reshard_after_forward: bool = True

    @classmethod
    def from_settings(
        cls, settings: SingleDeviceRecipeConfig, device: torch.device
    ) -> ModelSettings:
        # The distributed schemas' keys: absent from a single-device recipe's settings.
        sharding = {
            name: getattr(settings, name)
            for name in (
                "ac_mode",
                "ac_option",
                "custom_sharded_layers",
                "fsdp_reshard_after_forward",
            )
            if hasattr(settings, name)
        }
        return cls(
            compile=settings.compile,
            activation_checkpointing=settings.enable_activation_checkpointing,
            activation_offloading=settings.enable_activation_offloading,
            ac_mode=sharding.get("ac_mode"),
            ac_option=sharding.get("ac_option"),
            custom_sharded_layers=sharding.get("custom_sharded_layers"),
            fsdp_cpu_offload=parameters_offloaded_to_cpu(settings, device),
            fsdp_reshard_after_forward="fsdp_reshard_after_forward" not in sharding
            or bool(sharding["fsdp_reshard_after_forward"]),
        )


@dataclass(frozen=True)
class FullWeights:
    """Every weight of the model, from ``source`` (a checkpoint folder, for messages)."""

    state: dict[str, Any]
    source: str


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA/DoRA/QLoRA model's base weights, and the adapters to go on from (``None``: fresh
    ones drawn from ``seed`` alone; see [adapter init] in exactga.lora.adapters)."""

    lora: LoraSettings
    base_state: dict[str, Any]
    base_source: str
    adapters: dict[str, Any] | None
    seed: int

    @classmethod
    def at_start(
        cls,
        lora: LoraSettings,
        resume: ResumePoint,
        ckpt_dict: dict[str, Any],
        cfg_checkpointer: DictConfig,
        seed: int,
    ) -> AdapterWeights:
        """What a LoRA run loads at start-up: the checkpointer's base, and the adapters of the
        step or epoch checkpoint it resumes from (``None`` on a fresh start)."""
        base_source = checkpointer_source(cfg_checkpointer)
        adapters = resume.adapter_weights(ckpt_dict)
        return cls(lora, ckpt_dict[training.MODEL_KEY], base_source, adapters, seed)


@dataclass(frozen=True)
class Parallelism:
    """How the model is spread over ranks: FSDP2 over ``dp_mesh`` (2-D: HSDP, replicas of
    shards; see [mesh axes and the loss count] in exactga.runtime.distributed); with ``tp_mesh``,
    torchtune's tensor-parallel ``tp_plan`` first (full-weight models only)."""

    dp_mesh: DeviceMesh
    tp_mesh: DeviceMesh | None = None
    tp_plan: Any = None


@dataclass
class BuiltModel:
    """The model, and the context its forwards run in (activation offloading, or nothing)."""

    model: nn.Module
    activations_ctx: contextlib.AbstractContextManager[Any]


def build_model(
    cfg_model: DictConfig,
    weights: FullWeights | AdapterWeights,
    *,
    precision: Precision,
    device: torch.device,
    settings: ModelSettings,
    parallelism: Parallelism | None = None,
    notes: tuple[object, ...] = (),
    quantizer: Any = None,
) -> BuiltModel:
    """Build ``cfg_model`` with ``weights`` as a recipe trains it: on ``device`` alone, or with
    ``parallelism`` built on the meta device and sharded. ``notes`` (the attention kernels,
    the thread count: what else decides the run's numbers) are logged after the model.
    ``quantizer`` (a torchao QAT quantizer, ``exactga.qat.fake_quant``) fake-quantises the linears
    where stock's QAT recipes do: a LoRA model's right after it is built, before the adapters
    are made trainable; a full model's after activation checkpointing, before sharding."""
    start = time.perf_counter()
    lora = isinstance(weights, AdapterWeights)
    on = torch.device("meta") if parallelism is not None else device
    with training.set_default_dtype(precision.compute_dtype), on:
        model = instantiate_model(cfg_model)
        if quantizer is not None and lora:  # QATLoRALinear's new adapters: trainable below
            prepare_for_qat(model, quantizer, lora=True)
    adapter_params = get_adapter_params(model) if lora else None
    if adapter_params is not None:
        set_trainable_params(model, adapter_params)
    precision.cast_trainable(model)  # fp32 master weights (or adapters), if asked for
    if settings.compile:
        compile_layers(model, verbose=distributed.is_rank_zero())
    if parallelism is not None and parallelism.tp_mesh is not None:
        model = _tensor_parallel(model, parallelism)
    _checkpoint_activations(model, settings)
    if quantizer is not None and not lora:  # swaps nn.Linear modules: before FSDP wraps them
        model = prepare_for_qat(model, quantizer, lora=False)
    if parallelism is not None:
        _shard(model, precision, settings, parallelism.dp_mesh, lora=lora)
        init_rope(model, precision.compute_dtype, device)
    _load(model, weights, precision, device, settings, sharded=parallelism is not None)
    if parallelism is not None:
        training.validate_no_params_on_meta_device(model)
    else:
        trainable = adapter_params.items() if adapter_params else model.named_parameters()
        training.validate_expected_param_dtype(trainable, dtype=precision.param_dtype)
    activations_ctx = training.get_act_offloading_ctx_manager(model, settings.activation_offloading)
    _log_built(model, precision, device, parallelism, lora, time.perf_counter() - start, notes)
    return BuiltModel(model, activations_ctx)


def build_loss(cfg_loss: DictConfig, model: nn.Module, *, compile_loss: bool) -> nn.Module:
    """The config's token loss, compiled when asked (the fused loss's chunks too, see [fused
    loss under compile]); a chunked loss (``num_output_chunks``) has ``model`` return its
    logits in as many chunks, which is what that loss takes."""
    loss_fn = config.instantiate(cfg_loss)
    if compile_loss:
        # Work a loss does outside its forward (the fused loss's, inside the model's forward)
        # is compiled by the loss itself when asked.
        if hasattr(loss_fn, "compile_chunks"):
            loss_fn.compile_chunks()
        loss_fn = training.compile_loss(loss_fn, verbose=distributed.is_rank_zero())
    if hasattr(loss_fn, "num_output_chunks"):
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    return loss_fn


def _tensor_parallel(model: nn.Module, parallelism: Parallelism) -> nn.Module:
    if isinstance(getattr(model, "output", None), TiedLinear):
        # torchtune 0.6.1's TP plans shard the output as a Linear; a tied output then
        # multiplies a plain tensor by a DTensor deep inside the first forward.
        raise ValueError(
            "config keys 'tensor_parallel_dim' and 'model.tie_word_embeddings': tensor "
            "parallelism needs an untied output projection (tie_word_embeddings: False)."
        )
    model = training.prepare_mha_for_tp(model, parallelism.tp_mesh)
    parallelize_module(model, parallelism.tp_mesh, parallelize_plan=parallelism.tp_plan)
    return model


def _checkpoint_activations(model: nn.Module, settings: ModelSettings) -> None:
    # As in torchtune: ``ac_mode`` selects selective AC only when full AC is off.
    if not settings.activation_checkpointing and settings.ac_mode is not None:
        apply_selective_activation_checkpointing(model, settings.ac_mode, settings.ac_option)
    if settings.activation_checkpointing and settings.ac_mode is None:
        training.set_activation_checkpointing(
            model,
            auto_wrap_policy={modules.TransformerSelfAttentionLayer},
            **_moe_checkpointing(model),
        )


def _moe_checkpointing(model: nn.Module) -> dict[str, Any]:
    """For a model with mixture-of-experts layers, the checkpoint wrapper whose recomputation
    records router statistics as the forward did (see [router recording under activation
    checkpointing] in exactga.models.moe.block); nothing for other models."""
    if not moe_blocks(model):
        return {}
    context_fn = router_recording_context_fn(model)
    return {"checkpoint_wrapper_fn": partial(checkpoint_wrapper, context_fn=context_fn)}


def _shard(
    model: nn.Module,
    precision: Precision,
    settings: ModelSettings,
    dp_mesh: DeviceMesh,
    *,
    lora: bool,
) -> None:
    """torchtune's sharding with the precision policy's mixed precision. A full-weight model on
    one data-parallel rank is left whole, as stock leaves it; LoRA models are always sharded
    (stock's LoRA-aware units: each layer one unit, only the adapters' gradients reduced)."""
    if not lora and dp_mesh.size() == 1:
        return
    precision.shard_model(
        model=model,
        shard_conditions=[
            partial(training.get_shard_conditions, names_to_match=settings.custom_sharded_layers)
        ],
        cpu_offload=settings.fsdp_cpu_offload,
        reshard_after_forward=settings.fsdp_reshard_after_forward,
        dp_mesh=dp_mesh,
    )


def init_rope(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """RoPE buffers of a model built on the meta device, made on ``device`` in ``dtype``."""
    with training.set_default_dtype(dtype), device:
        for module in model.modules():
            if hasattr(module, "rope_init"):  # RoPE buffers are not in the state dict
                module.rope_init()


def _load(
    model: nn.Module,
    weights: FullWeights | AdapterWeights,
    precision: Precision,
    device: torch.device,
    settings: ModelSettings,
    *,
    sharded: bool,
) -> None:
    if isinstance(weights, FullWeights):
        load = None  # the model's own load_state_dict
        if sharded:
            load = partial(
                training.load_from_full_model_state_dict,
                device=device,
                strict=True,
                cpu_offload=settings.fsdp_cpu_offload,
            )
        load_model_state(model, weights.state, weights.source, **({"load": load} if load else {}))
        return
    if sharded:
        load = partial(
            training.load_from_full_model_state_dict,
            device=device,
            cpu_offload=settings.fsdp_cpu_offload,
        )
    else:
        load = partial(nn.Module.load_state_dict, strict=False)
    # The base, then the adapters to go on from or fresh ones drawn from the seed alone, the
    # same on any number of ranks; see [adapter init] in exactga.lora.adapters.
    load_lora_weights(
        model,
        weights.lora,
        base_state=weights.base_state,
        base_source=weights.base_source,
        adapters=weights.adapters,
        load=load,
        seed=weights.seed,
        dtype=precision.param_dtype,
    )


def _log_built(
    model: nn.Module,
    precision: Precision,
    device: torch.device,
    parallelism: Parallelism | None,
    lora: bool,
    seconds: float,
    notes: tuple[object, ...],
) -> None:
    trainable = ""
    if lora:
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sharded = " (sharded count)" if parallelism is not None else ""
        trainable = f"; {count:,} trainable adapter parameters{sharded}"
    if parallelism is None:
        distributed.log_rank_zero(f"Model is initialized with {precision.describe()}{trainable}.")
    else:
        tp = parallelism.tp_mesh.size() if parallelism.tp_mesh is not None else 1
        mesh = parallelism.dp_mesh
        fsdp = " x ".join(
            f"{name}={size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True)
        )
        distributed.log_rank_zero(
            f"Model built, sharded over {fsdp} x tp={tp} and loaded in "
            f"{seconds:.2f} s, {precision.describe()}{trainable}."
        )
    for note in notes:
        distributed.log_rank_zero(str(note))
    if distributed.is_rank_zero() and device.type != "cpu":
        training.log_memory_stats(distributed.memory_stats(device))
    distributed.barrier()
