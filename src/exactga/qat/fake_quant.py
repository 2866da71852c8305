"""Quantisation-aware training: torchao's fake quantisation put into the model, and switched on
at a step, as torchtune 0.6.1's ``qat_distributed`` and ``qat_lora_finetune_distributed`` do.

QAT changes the forward only: each quantised linear rounds its weight (and, for
``Int8DynActInt4WeightQATQuantizer``, its input activations) to the target grid and back, with
a straight-through gradient. The loss is still a sum of token losses, so exact accumulation
carries over unchanged (docs/qat.md). ``exactga.model_build.trained.build_model`` calls
:func:`prepare_for_qat` at stock's point of the build; recipes call :class:`FakeQuantSchedule`
at each window.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config
from torchtune.modules.peft import DoRALinear
from torchtune.training import quantization

from exactga.runtime.distributed import log_rank_zero


def quantizer_from_config(cfg_quantizer: DictConfig, dtype: torch.dtype) -> Any:
    """The config's torchao QAT quantizer, its linears built in ``dtype`` (stock's
    ``quantizer.precision = dtype``).

    Raises:
        ValueError: naming ``quantizer`` when it is not a QAT quantizer (a post-training one
            such as ``Int8DynActInt4WeightQuantizer`` is for ``tune run quantize``).
    """
    quantizer = config.instantiate(cfg_quantizer)
    quantizer.precision = dtype
    mode = quantization.get_quantizer_mode(quantizer)
    if mode is None or "qat" not in mode:
        raise ValueError(
            f"config key 'quantizer' ({cfg_quantizer.get('_component_')}): quantizer mode "
            f"'{mode}' is not supported for finetuning; use a QAT quantizer such as "
            "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer."
        )
    return quantizer


def prepare_for_qat(model: nn.Module, quantizer: Any, *, lora: bool) -> nn.Module:
    """``model`` with fake-quantised linears; on the meta device, before sharding and loading.

    A full model goes through ``quantizer.prepare`` (each ``nn.Linear`` swapped for torchao's
    fake-quantised linear, same parameter names); a LoRA model has its ``LoRALinear``s swapped
    for torchtune's ``QATLoRALinear`` (the frozen base weight fake-quantised, the adapters not),
    as stock does. Either way the state dict keeps its keys, so checkpoints load and save as
    without QAT.

    Raises:
        ValueError: for DoRA (stock: "QAT is currently not compatible with DoRA"), or when no
            linear can be fake-quantised (``quantizer.groupsize`` divides no input width).
    """
    if lora:
        if any(isinstance(m, DoRALinear) for m in model.modules()):
            raise ValueError(
                "config keys 'model.use_dora' and 'quantizer': QAT does not work with DoRA."
            )
        quantization.swap_lora_linear_with_qat(
            model,
            _bc_fake_quantize_config(quantizer.get_activation_fake_quantize_config()),
            _bc_fake_quantize_config(quantizer.get_weight_fake_quantize_config()),
        )
    else:
        model = quantizer.prepare(model)
    if not fake_quantizers(model):
        raise ValueError(
            f"config key 'quantizer.groupsize' ({getattr(quantizer, 'groupsize', None)}) "
            "divides the input width of no linear layer, so nothing would be fake-quantised; "
            "pick a group size that divides the model's widths."
        )
    return model


# Note [QAT LoRA under torchao 0.15]
# torchtune 0.6.1's ``QATLoRALinear`` asserts that its configs are torchao's
# ``FakeQuantizeConfig``; torchao 0.15 renamed the class ``IntxFakeQuantizeConfig`` and keeps
# ``FakeQuantizeConfig`` as an empty subclass "for BC", while the quantizers now return the new
# class, so stock's swap fails with a bare ``AssertionError``. The same object re-classed as the
# BC subclass (no field or method of its own) passes the check and fake-quantises identically.
def _bc_fake_quantize_config(fq_config: Any) -> Any:
    if fq_config is None:
        return None
    from torchao.quantization.qat.api import FakeQuantizeConfig

    if isinstance(fq_config, FakeQuantizeConfig):
        return fq_config
    bc_config = copy.copy(fq_config)
    bc_config.__class__ = FakeQuantizeConfig  # see [QAT LoRA under torchao 0.15]
    return bc_config


def fake_quantizers(model: nn.Module) -> list[nn.Module]:
    """torchao's fake quantizers in ``model`` (weights' and activations')."""
    from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase

    return [m for m in model.modules() if isinstance(m, FakeQuantizerBase)]


# Note [switching fake quantisation]
# Stock switches with ``training.quantization._get_(dis|en)able_fake_quant(mode)``, which call
# each torchao QAT linear's ``enable_fake_quant``; that sets ``enabled`` on its activation and
# weight fake quantizers. Under torchao 0.15 the int4 weight-only linear has no activation
# fake quantizer (``None``) and its ``enable_fake_quant`` raises ``AttributeError``. Setting
# ``enabled`` on every fake quantizer directly is what stock's call does for 8da4w, works for
# 4w, and reaches ``QATLoRALinear``'s quantizers too.
def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    """Turn every fake quantizer of ``model`` on or off; see [switching fake quantisation]."""
    for fake_quantizer in fake_quantizers(model):
        fake_quantizer.enabled = enabled


class FakeQuantSchedule:
    """Fake quantisation off for the first ``after_n_steps`` optimizer steps, then on
    (``fake_quant_after_n_steps``; ``None``: on from the start, as the model is prepared).

    Stock disables it at global step 0 and enables it at step ``n``, checked before each
    micro-batch; :meth:`before_window` sets the state from the step count instead, which is the
    same on a fresh run and also right after a resume between the two (stock's resume would
    keep it on).
    """

    def __init__(self, model: nn.Module, after_n_steps: int | None) -> None:
        self.model = model
        self.after_n_steps = after_n_steps
        self._enabled: bool | None = None  # unknown until the first window

    def before_window(self, steps_done: int) -> None:
        """Set fake quantisation for the optimizer step after ``steps_done`` steps."""
        if self.after_n_steps is None:
            return
        enabled = steps_done >= self.after_n_steps
        if enabled == self._enabled:
            return
        if enabled:
            log_rank_zero(f"Step {steps_done}: Enabling fake quant")
        else:
            log_rank_zero(
                f"Step {steps_done}: Disabling fake quant, will re-enable in step "
                f"{self.after_n_steps}"
            )
        set_fake_quant(self.model, enabled)
        self._enabled = enabled
