"""One GA parity run: its model, what it did, and its weights and scores on the way to rank 0.

Every report (the fine-tuning, KD and DPO one in recipes/ga_parity.py, and GRPO's in
exactga.parity.grpo) builds a run's model from the shared initial state with :func:`build_model`
or :func:`build_sharded_model`, its frozen reference once per layout with :class:`FrozenModels`,
and reseeds before it (:func:`reseed`). A run's windows are tallied as they step
(:class:`RunTally`), on the rank that ran them and, for a sharded run, summed over its ranks;
its trained weights are gathered as full tensors (:func:`trained_weights`) to be scored where it
trained (exactga.parity.scoring), and only the scores travel to rank 0
(:func:`gather_summaries`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torchtune import training
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from exactga.model_build.frozen import build_frozen_model
from exactga.model_build.trained import init_rope
from exactga.parity.scoring import ParityRun, RunSummary
from exactga.qat.fake_quant import prepare_for_qat
from exactga.runtime import distributed
from exactga.runtime.document_attention import instantiate_model

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from exactga.accumulation.normalization import Window
    from exactga.runtime.precision import Precision

_NO_MICRO_BATCH = 2**62  # the fewest units of a rank that ran none, larger than any count


@dataclass
class RunTally:
    """What one run did on this rank, window by window, for its :class:`ParityRun`; a sharded
    run's counts are then summed over its ranks (:meth:`reduce`)."""

    losses: list[float] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    num_micro_batches: int = 0
    num_positions: int = 0
    num_sample_positions: int = 0
    fewest_units: int | None = None  # in one micro-batch
    most_units: int = 0
    units_name: str = "loss_tokens"
    # A loss of several terms (the router's balance term, RPO's NLL): each window's term means,
    # the token loss's first, which sum to its loss; empty for a single-mean loss.
    term_losses: list[tuple[float, ...]] = field(default_factory=list)
    term_names: tuple[str, ...] = ()

    def add(self, window: Window) -> None:
        """After the window's step: its exact loss over every rank of the run, and each term's
        (one all-reduce when sharded, so every rank calls it), and what this rank ran, padding
        and ``token_budget``'s fillers included."""
        self.units.append(window.num_global_units)
        skipped = window.should_skip_step()  # the same on every rank: no collective then
        if window.term_names:
            self.term_names = window.term_names
            terms = (
                window.global_term_means()
                if not skipped
                else (float("nan"),) * (1 + len(window.term_names))
            )
            self.term_losses.append(terms)
            self.losses.append(sum(terms))
        else:
            self.losses.append(float("nan") if skipped else window.global_mean_loss())
        self.num_micro_batches += sum(1 for _ in window.micro_batches_to_run())
        work = window.work()
        self.num_positions += work.num_positions
        self.num_sample_positions += work.num_sample_positions or 0
        counts = [mb.num_units for mb in window.micro_batches]
        if counts:
            fewest = min(counts)
            if self.fewest_units is None or fewest < self.fewest_units:
                self.fewest_units = fewest
            self.most_units = max(self.most_units, *counts)
        self.units_name = window.units_name

    def reduce(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """The counts summed, and the units per micro-batch bounded, over ``group``: two
        all-reduces per run (the fewest negated, so that a max finds it)."""
        counts = [self.num_micro_batches, self.num_positions, self.num_sample_positions]
        summed = torch.tensor(counts, device=device)
        fewest = self.fewest_units if self.fewest_units is not None else _NO_MICRO_BATCH
        bounds = torch.tensor([-fewest, self.most_units], device=device)
        dist.all_reduce(summed, group=group)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
        self.num_micro_batches, self.num_positions, self.num_sample_positions = summed.tolist()
        fewest, self.most_units = -int(bounds[0]), int(bounds[1])
        self.fewest_units = None if fewest == _NO_MICRO_BATCH else fewest

    def run(
        self,
        mode: str,
        micro_batching: str,
        split: str,
        weights: dict[str, torch.Tensor],
        variant: str = "",
    ) -> ParityRun:
        return ParityRun(
            mode=mode,
            micro_batching=micro_batching,
            split=split,
            losses=self.losses,
            units=self.units,
            weights=weights,
            num_micro_batches=int(self.num_micro_batches),
            num_positions=int(self.num_positions),
            num_sample_positions=int(self.num_sample_positions),
            units_per_micro_batch=(self.fewest_units or 0, self.most_units),
            units_name=self.units_name,
            term_losses=self.term_losses,
            term_names=self.term_names,
            variant=variant,
        )


def build_model(
    cfg_model: DictConfig,
    precision: Precision,
    device: torch.device,
    *,
    is_lora: bool,
    quantizer: Any = None,
) -> nn.Module:
    """A run's model on one device, uninitialised: the adapters alone trainable for LoRA,
    trainable weights cast as ``precision`` keeps them (fp32 master weights); a QAT config's
    ``quantizer`` fake-quantises its linears as the QAT recipes do (exactga.qat.fake_quant)."""
    with training.set_default_dtype(precision.compute_dtype), device:
        model = instantiate_model(cfg_model)
    if quantizer is not None:  # before the adapters are made trainable: QATLoRALinear's new ones
        model = prepare_for_qat(model, quantizer, lora=is_lora)
    if is_lora:
        set_trainable_params(model, get_adapter_params(model))
    precision.cast_trainable(model)
    return model


def build_sharded_model(
    cfg_model: DictConfig,
    state: dict[str, Any],
    precision: Precision,
    device: torch.device,
    dp_mesh: DeviceMesh,
    *,
    is_lora: bool,
    quantizer: Any = None,
) -> nn.Module:
    """A run's model built on the meta device, sharded with FSDP2 over ``dp_mesh`` as the
    distributed recipes shard it (a bf16 policy over fp32 master weights), then loaded with
    ``state``, the runs' shared initial state; fake-quantised by ``quantizer`` before sharding,
    as the QAT recipes do."""
    with training.set_default_dtype(precision.compute_dtype), torch.device("meta"):
        model = instantiate_model(cfg_model)
    if quantizer is not None:  # swaps modules: before FSDP wraps them
        model = prepare_for_qat(model, quantizer, lora=is_lora)
    if is_lora:
        set_trainable_params(model, get_adapter_params(model))
    precision.cast_trainable(model)
    precision.shard_model(
        model=model,
        shard_conditions=[partial(training.get_shard_conditions, names_to_match=None)],
        cpu_offload=False,
        reshard_after_forward=True,
        dp_mesh=dp_mesh,
    )
    init_rope(model, precision.compute_dtype, device)  # not in the state dict
    training.load_from_full_model_state_dict(model, state, device, strict=True)
    training.validate_no_params_on_meta_device(model)
    return model


class FrozenModels:
    """A frozen model with ``state`` (a reference), built on first use once per layout and
    dtype: on one device for the ``BxG`` runs, sharded over ``dp_mesh`` like the policy for the
    ``BxGxN`` runs (``exactga.model_build.frozen.build_frozen_model``, the recipes' rule)."""

    def __init__(
        self,
        cfg_model: DictConfig,
        state: dict[str, Any],
        device: torch.device,
        dp_mesh: DeviceMesh | None,
    ) -> None:
        self._cfg_model, self._state, self._device, self._dp_mesh = (
            cfg_model,
            state,
            device,
            dp_mesh,
        )
        self._built: dict[tuple[bool, torch.dtype], nn.Module] = {}

    def get(self, *, sharded: bool, dtype: torch.dtype) -> nn.Module:
        key = (sharded, dtype)
        if key not in self._built:
            self._built[key] = build_frozen_model(
                self._cfg_model,
                self._state,
                dtype=dtype,
                device=self._device,
                dp_mesh=self._dp_mesh if sharded else None,
            )
        return self._built[key]


def trained_weights(
    model: nn.Module, *, adapters_only: bool, keep: bool
) -> dict[str, torch.Tensor]:
    """The trained tensors (the adapters only, for LoRA) as full fp32 CPU tensors, or nothing
    where not ``keep``. A sharded model's are gathered from every rank (a collective, so every
    rank calls this; the recipe keeps them on rank 0 only)."""
    weights = {}
    for name, param in model.named_parameters():
        if adapters_only and not param.requires_grad:
            continue
        full = distributed.full_tensor(param.detach())
        if keep:
            weights[name] = full.float().cpu().clone()
    return weights


def gather_summaries(local: dict[int, RunSummary]) -> dict[int, RunSummary]:
    """Every rank's scores, by run, on rank 0 (empty elsewhere): numbers only, no weights."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    merged: dict[int, RunSummary] = {}
    for part in parts or []:
        merged.update(part)
    return merged


def reseed(seed: int) -> None:
    """Seed every generator with ``seed`` itself before a run. torchtune's set_seed would add
    the rank, and every rank must draw the same initial adapters (and a run's randomness must
    not depend on the rank that trains it)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
