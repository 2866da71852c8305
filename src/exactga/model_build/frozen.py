"""Frozen models: a distillation teacher, a preference-optimisation or RL reference model.

One rule for all of them, single device or sharded with FSDP2: :func:`freeze_model` once at
setup, and every forward inside :func:`frozen_forward`. See [frozen forwards run under no_grad].
The distributed DPO and GRPO recipes build their reference with :func:`build_frozen_model`, so
the two cannot shard or load it differently.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtune import training

from exactga.model_build.compiling import compile_layers
from exactga.model_build.trained import init_rope
from exactga.runtime.document_attention import instantiate_model

# Note [frozen forwards run under no_grad]
# A frozen model's forward must build no autograd graph and keep no activations: its outputs
# are only read by the trained model's loss. Both ``torch.no_grad()`` and
# ``torch.inference_mode()`` give that, and both free each activation as soon as the next layer
# has read it (benchmarks/frozen_forward_memory.py measures the same peak for the two, and the
# saved activations a graph would keep). They differ in what the tensors made inside are:
# inference tensors carry no version counter and may never enter autograd later. FSDP2 creates
# its unsharded parameters inside the forward that first needs them and wraps their use in
# ``torch.autograd._unsafe_preserve_version_counter``; on one rank (torch 2.13) those parameters
# are inference tensors when that forward runs in inference mode, and the first micro-batch
# fails with "Inference tensors do not track version counter" (issue #22; two ranks happened to
# take another path). A teacher shared with activation checkpointing or ``torch.compile`` meets
# the same class of trouble. ``no_grad`` costs nothing measurable here and has none of it, so
# every frozen forward, sharded or not, runs under it: one rule, not one per wrapper.


def freeze_model(model: nn.Module) -> nn.Module:
    """Eval mode, no parameter requires grad: the model is never trained. (Eval mode does not
    turn off SDPA's own dropout, see pytorch/pytorch#124464; torchtune's builders set none.)"""
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def frozen_forward() -> contextlib.AbstractContextManager[None]:
    """The context every forward of a frozen model runs in; see [frozen forwards run under
    no_grad]."""
    return torch.no_grad()


def build_frozen_model(
    cfg_model: DictConfig,
    state_dict: dict[str, Any],
    *,
    dtype: torch.dtype,
    device: torch.device,
    dp_mesh: DeviceMesh | None,
    custom_sharded_layers: list[str] | None = None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    compile_model: bool = False,
    verbose: bool = False,
) -> nn.Module:
    """``cfg_model`` frozen (:func:`freeze_model`) with the full ``state_dict``: built on the
    meta device, sharded like the trained model with torchtune's ``shard_model`` over
    ``dp_mesh`` when it spans more than one rank (no trainable parameter, so no precision
    policy), then loaded shard by shard in ``dtype``."""
    with training.set_default_dtype(dtype), torch.device("meta"):
        model = instantiate_model(cfg_model)
    freeze_model(model)
    if compile_model:
        compile_layers(model, verbose=verbose)
    if dp_mesh is not None and dp_mesh.size() > 1:
        training.shard_model(
            model=model,
            shard_conditions=[
                partial(training.get_shard_conditions, names_to_match=custom_sharded_layers)
            ],
            cpu_offload=cpu_offload,
            reshard_after_forward=reshard_after_forward,
            dp_mesh=dp_mesh,
        )
    init_rope(model, dtype, device)  # not in the state dict
    training.load_from_full_model_state_dict(
        model, state_dict, device, strict=True, cpu_offload=cpu_offload
    )
    training.validate_no_params_on_meta_device(model)
    return model
