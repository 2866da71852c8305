"""Frozen models: a distillation teacher, a preference-optimisation or RL reference model.

One rule for all of them, single device or sharded with FSDP2: :func:`freeze_model` once at
setup, and every forward inside :func:`frozen_forward`. See [frozen forwards run under no_grad].
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

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
