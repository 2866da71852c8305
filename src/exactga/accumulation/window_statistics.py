"""Statistics of a whole accumulation window over every rank, computed before its backward passes.

Some losses are not a mean of per-unit losses that each depend on their own unit alone: they
read a statistic of the batch (KTO's reference point, a KL estimate over the batch; a batch
mean baseline; a normalising constant). Under accumulation and data parallelism that statistic
must be the full batch's, or each micro-batch and rank trains against its own and the step
depends on the split. A :class:`WindowStatistic` says how one micro-batch contributes; the window
sums the contributions of every micro-batch on every rank under ``no_grad`` before the first
backward, reduces them in one all-reduce, and hands the sums to the statistic, which the loss
step then reads as a constant. See [window statistics].

Note [window statistics]
A loss ``L = (1/U) sum_i l_i(theta; s)`` whose per-unit losses read a statistic ``s`` of the
whole batch, with ``s`` detached (a constant of the step), is again a mean over units once ``s``
is fixed: so the step is the full-batch step, whatever the split, if every micro-batch on every
rank reads the same ``s``, the one the full batch would compute at the step's weights. The
weights do not move inside a window (the optimizer steps after the last backward), so a pass
over the window's micro-batches before the first backward sees exactly the full batch's
weights; a statistic that is a function of sums over the window's units, ``s = f(sum_i c_i)``,
is then exact from one SUM all-reduce of the per-rank sums. The pass runs the micro-batches the
window runs (:meth:`~exactga.accumulation.normalization.Window.micro_batches_to_run`), so under
FSDP every rank runs as many forwards (its fillers too), and a micro-batch with no unit (a
filler, an empty one) contributes exactly nothing. Its cost is one no-grad forward per
micro-batch, and nothing at all for a loss that declares no statistic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torchtune import utils

from exactga.accumulation.loss_units import Batch


class Window(Protocol):
    """What a statistic and its pass read of a window: exactga.accumulation.normalization's
    ``Window``, named here by its parts because that module imports this one."""

    dp_group: dist.ProcessGroup | None
    dp_size: int

    @property
    def num_global_units(self) -> int: ...

    def micro_batches_to_run(self) -> Iterable[_MicroBatch]: ...


class _MicroBatch(Protocol):
    batch: Batch
    num_units: int


class WindowStatistic(Protocol):
    """A statistic of the whole window over every rank; see [window statistics].

    ``size`` sums make it up; :meth:`contribution` gives one micro-batch's, and :meth:`update`
    receives the window's, before the window's first backward. The loss step reads the value
    the statistic keeps (a detached tensor on the device).
    """

    size: int

    def contribution(self, batch: Batch) -> torch.Tensor:
        """This micro-batch's sums, shape ``(size,)``, computed under no_grad. ``batch`` is a
        copy of the micro-batch on the device, as the loss step will get it; it may be
        changed."""
        ...

    def update(self, sums: torch.Tensor, window: Window) -> None:
        """Take the window's sums over every micro-batch and rank, ``(size,)`` fp64."""
        ...


def compute_window_statistics(
    window: Window, statistics: Sequence[WindowStatistic], device: torch.device
) -> None:
    """Sum every statistic's contributions over the micro-batches this rank runs, reduce them
    over the data-parallel group in one all-reduce, and hand each its window's sums. Call on
    every rank, before the window's first backward; see [window statistics]."""
    if not statistics:
        return
    sizes = [statistic.size for statistic in statistics]
    sums = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
    with torch.no_grad():
        for micro_batch in window.micro_batches_to_run():
            parts = []
            for statistic in statistics:
                batch = dict(micro_batch.batch)  # the window's own dict stays for the loss step
                utils.batch_to_device(batch, device)
                parts.append(statistic.contribution(batch).double().reshape(-1))
            # A filler or empty micro-batch runs its forwards (under FSDP every rank's
            # collectives must pair up) and adds nothing.
            if micro_batch.num_units > 0:
                sums += torch.cat(parts).to(device)
    if window.dp_group is not None and window.dp_size > 1:
        dist.all_reduce(sums, group=window.dp_group)
    for statistic, part in zip(statistics, sums.split(sizes), strict=True):
        statistic.update(part, window)
