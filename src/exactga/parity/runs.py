"""What one GA parity run did, and its weights and scores on the way to rank 0.

A run's windows are tallied as they step (:class:`RunTally`), on the rank that ran them and, for
a sharded run, summed over its ranks; its trained weights are gathered as full tensors
(:func:`trained_weights`) to be scored where it trained (exactga.parity.scoring), and only the
scores travel to rank 0 (:func:`gather_summaries`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from exactga import distributed
from exactga.parity.scoring import ParityRun, RunSummary

if TYPE_CHECKING:
    from exactga.normalization import Window

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

    def add(self, window: Window) -> None:
        """After the window's step: its exact loss over every rank of the run (one
        all-reduce when sharded, so every rank calls it) and what this rank ran, padding and
        ``token_budget``'s fillers included."""
        self.units.append(window.num_global_units)
        self.losses.append(float("nan") if window.should_skip_step() else window.global_mean_loss())
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
        self, mode: str, micro_batching: str, split: str, weights: dict[str, torch.Tensor]
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
        )


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
