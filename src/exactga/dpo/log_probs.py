"""Each response's log-prob at its response positions, under the policy or the reference.

A DPO loss compares four summed log-probs per pair (the policy's and the reference's, chosen and
rejected). :func:`sequence_log_probs` takes them from the response positions alone, each term
in fp32 at least and the sums in fp64 (see [pairs as loss units] in exactga.dpo.preference); a
``Reference`` gives the reference's, from the policy with its adapters off (LoRA DPO,
:func:`lora_reference`) or a frozen model (full DPO, :func:`frozen_model_reference`), or a
precomputed table stands in for it (exactga.dpo.reference_logprobs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchtune.modules.peft import disable_adapter

from exactga.accumulation.forward import token_log_probs
from exactga.accumulation.loss_units import Batch
from exactga.data.packing import PACKED_SEQUENCES
from exactga.dpo.preference import split_pairs
from exactga.model_build.frozen import frozen_forward
from exactga.runtime.precision import Precision

# (inputs on the device, response positions, their labels) -> (chosen, rejected) log-probs.
Reference = Callable[[Batch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def sequence_log_probs(
    model: nn.Module,
    inputs: Batch,
    positions: torch.Tensor,
    targets: torch.Tensor,
    precision: Precision | None = None,
    activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
) -> torch.Tensor:
    """Each row's summed ``log p(label)`` over its response positions, shape ``(2B,)``: each
    term in fp32 at least, the sums in fp64.

    ``positions`` are flat indices into the ``(2B, L)`` batch (``LOSS_POSITIONS``), ``targets``
    the shifted labels there. The projection runs only at ``positions`` where the model allows
    it; otherwise the full logits are cut after the forward. See [pairs as loss units].
    """
    inputs = dict(inputs)
    sequences = inputs.pop(PACKED_SEQUENCES, None)
    num_rows, seq_len = inputs["tokens"].shape
    token_log_probs_ = token_log_probs(
        model, inputs, positions, targets, precision, activations_ctx
    ).double()
    # Scattered to a dense (2B, L) grid and summed per row: index_copy with distinct indices is
    # deterministic on every device, where an index_add into rows would use atomics on CUDA.
    grid = token_log_probs_.new_zeros(num_rows * seq_len).index_copy(0, positions, token_log_probs_)
    if sequences is not None:  # one packed row: each sequence sums its own positions
        return torch.where(sequences, grid.view(1, -1), 0.0).sum(dim=1)
    return grid.view(num_rows, seq_len).sum(dim=1)


def lora_reference(model: nn.Module, precision: Precision | None = None) -> Reference:
    """The reference of LoRA DPO: the policy with its adapters off, without a graph."""

    def reference(inputs: Batch, positions: torch.Tensor, targets: torch.Tensor):
        with frozen_forward(), disable_adapter(model):
            return split_pairs(sequence_log_probs(model, inputs, positions, targets, precision))

    return reference


def frozen_model_reference(ref_model: nn.Module, precision: Precision | None = None) -> Reference:
    """The reference of full DPO: a separate model, frozen at setup with
    ``exactga.model_build.frozen.freeze_model`` (and sharded like the policy under FSDP)."""

    def reference(inputs: Batch, positions: torch.Tensor, targets: torch.Tensor):
        with frozen_forward():
            return split_pairs(sequence_log_probs(ref_model, inputs, positions, targets, precision))

    return reference
