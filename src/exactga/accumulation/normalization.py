"""Exact loss normalisation for gradient accumulation and data parallelism.

This module is the one place where exactga decides how much each micro-batch weighs. Every
recipe goes through it; nothing about counts or loss scaling is written in a recipe.

The loss of one optimizer step is the sum of per-unit losses over the whole accumulation
window, on every data-parallel rank, divided by the number of units in that window. A unit is
what the loss averages over: a loss token after the shift by default, see
``exactga.accumulation.loss_units`` ([loss units], [shifted token count]); a loss that is a sum of
terms over units of their own weighs each term by its own ([loss terms over their own units]).
Windows come shaped by the recipes' loader (``exactga.data.loader`` reads
``gradient_accumulation_steps``, ``micro_batching``, ``drop_partial_window``) or, for GRPO, from a
step's rollouts (``exactga.grpo.windows.ppo_epoch_windows``); this module counts and weighs what it
is given and has no say in a window's size. The notes below are referred to from the code (and from
the recipes) by name.

Note [loss scaled before backward]
Backward is linear, so scaling each micro-batch's mean loss by
``dp_size * batch_units / window_units`` before ``backward()`` leaves exactly the gradient of
the window loss in ``.grad``: no gradient-scaling pass afterwards (a read and write of every
gradient). ``dp_size`` undoes the averaging that FSDP/DDP apply across data-parallel ranks:
it is the size of the group the units are counted over, which holds every rank with other
tokens (data and context parallel, never tensor parallel; see [mesh axes and the loss count] in
exactga.runtime.distributed).
With one micro-batch on one rank the factor is exactly 1 and no op is applied at all.

Note [empty windows]
A micro-batch with no unit (loss token) has a mean loss of 0/0. It contributes nothing to the window
gradient, so on one rank it is skipped outright. A window with no loss token on any rank
carries no learning signal; stepping an optimizer on zero gradients would still move weights
(momentum, weight decay), so the step is skipped and counted instead. Every rank reaches the
same decision: a rank with a token of its own knows N > 0, one without waits for N.

Note [baseline modes]
``post_scale`` reproduces stock torchtune 0.6.1 (loss times the token count taken before the
shift, gradients scaled by the inverse window count after the last backward) and ``naive``
the mean of micro-batch means divided by ga (the pre-fix Hugging Face Trainer). They exist so
benchmarks and the parity report can compare against them, never as training choices. Stock's
knowledge-distillation recipes keep the gradient pass but backpropagate each micro-batch's mean
loss unscaled; a window whose ``post_scale_weights_by_count`` is False reproduces that (set by
``exactga.kd.distillation``; see [stock kd weighting] there).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torchtune.training import scale_grads

from exactga.accumulation.loss_units import LossUnits, ShiftedTokens, count_terms, term_names
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.accumulation.window_statistics import WindowStatistic
from exactga.config.options import NormMode, as_option
from exactga.data.micro_batching import SampleWindow, WindowWork, filler_micro_batch

__all__ = ["LossNormalizer", "MicroBatch", "NormMode", "Window", "gradient_scaling_pass"]

# ---------------------------------------------------------------------------------------------
# Windows: ga micro-batches, counted on the host, reduced once over the data-parallel group.


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch, still on the host, with its loss-token counts."""

    batch: dict[str, torch.Tensor]
    num_units: int  # what the loss divides by; see [loss units]
    num_unshifted_tokens: int  # stock torchtune's count, only for post_scale
    # Further terms' units, if the loss declares any; see [loss terms over their own units].
    num_term_units: tuple[int, ...] = ()


@dataclass(frozen=True)
class WindowCounts:
    """What one rank contributes to a window's one collective; see [one collective per window]."""

    num_units: int  # loss units (tokens after the shift by default)
    num_micro_batches: int  # micro-batches it planned (fillers excluded)
    num_positions: int  # positions those micro-batches process, padding included
    num_term_units: tuple[int, ...] = ()  # further terms' units, one column each

    def as_list(self) -> list[int]:
        return [self.num_units, self.num_micro_batches, self.num_positions, *self.num_term_units]


# Note [one collective per window]
# Each rank writes its WindowCounts into its own slot of a (world_size x 3) int64 tensor of
# zeros, and one asynchronous SUM all-reduce fills every slot on every rank: an all-gather that
# every backend runs, issued when the window is opened and read only when the first loss is
# scaled (by then the first forward has run). From it every rank knows the window's loss units
# (the sum), how many micro-batches the busiest rank runs (the max; ranks with fewer run
# zero-weight fillers, see [empty micro-batches under FSDP]), and how unequal the ranks'
# processed positions are. A few hundred bytes even on a thousand ranks. A loss whose terms
# are means over units of their own adds one column per further unit, summed the same way:
# still one collective (see [loss terms over their own units]).


class _PendingCounts:
    """The window's collective, possibly still in flight; see [one collective per window]."""

    def __init__(self, local: WindowCounts, group: dist.ProcessGroup | None) -> None:
        self._rows: list[list[int]] | None = None
        self.device = torch.device("cpu")
        if group is None:
            self._rows = [local.as_list()]
            return
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        self.device = torch.device(device)
        num_columns = len(local.as_list())
        slots = torch.zeros(dist.get_world_size(group), num_columns, dtype=torch.int64)
        slots[dist.get_rank(group)] = torch.tensor(local.as_list())
        self._tensor = slots.to(self.device)
        self._work = dist.all_reduce(self._tensor, group=group, async_op=True)

    def rows(self) -> list[list[int]]:
        """Every rank's counts (waits for the collective the first time)."""
        if self._rows is None:
            self._work.wait()
            self._rows = self._tensor.tolist()
        return self._rows

    def wait(self) -> int:
        """The window's loss units over every rank."""
        return sum(row[0] for row in self.rows())

    def term_units(self) -> tuple[int, ...]:
        """Each term's units over every rank, the first unit's first."""
        rows = self.rows()
        return (self.wait(), *(sum(row[c] for row in rows) for c in range(3, len(rows[0]))))

    def max_micro_batches(self) -> int:
        return max(row[1] for row in self.rows())

    def positions_per_rank(self) -> list[int]:
        return [row[2] for row in self.rows()]


@dataclass
class Window:
    """The micro-batches of one optimizer step and everything needed to weight them.

    Created by :meth:`LossNormalizer.windows`, which has already issued the window's collective;
    the first call that needs the global count waits for it, so the reduction overlaps whatever
    the recipe does before (the first forward).
    """

    micro_batches: list[MicroBatch]
    mode: NormMode
    dp_size: int
    _pending: _PendingCounts
    _losses: list[torch.Tensor] = field(default_factory=list)
    # Each micro-batch's units: an int, or one per term (see [loss terms over their own units]).
    _loss_units: list[int | tuple[int, ...]] = field(default_factory=list)
    dp_group: dist.ProcessGroup | None = None
    # A zero-weight micro-batch to run when another rank runs more micro-batches than this one.
    filler: MicroBatch | None = None
    # The samples' own positions and those the ``fixed`` split would process (padding metrics).
    num_sample_positions: int = 0
    num_fixed_positions: int = 0
    micro_batch_sample_positions: tuple[int, ...] = ()
    # post_scale only: multiply each mean loss by its unshifted count (stock's fine-tuning
    # recipes) or leave it as it is (stock's KD recipes); see [baseline modes].
    post_scale_weights_by_count: bool = True
    # Whether ranks may plan different micro-batch counts (``token_budget``). Otherwise the
    # counts are equal by construction and the collective is not waited for to know it.
    counts_may_differ: bool = False
    # What the units are, as metrics name them (``LossUnits.name``).
    units_name: str = "loss_tokens"
    # The further terms' units (``TermUnits.term_names``); empty for a single-mean loss.
    term_names: tuple[str, ...] = ()
    # Statistics of the whole window the loss reads, computed before its first backward (KTO's
    # reference point); see [window statistics] in exactga.accumulation.window_statistics.
    statistics: tuple[WindowStatistic, ...] = ()

    @property
    def num_local_units(self) -> int:
        return sum(mb.num_units for mb in self.micro_batches)

    @property
    def num_input_tokens(self) -> int:
        """Positions the model processes on this rank, padding and fillers included."""
        own = self.micro_batches if self.dp_size > 1 else self.nonempty_micro_batches()
        positions = sum(mb.batch["tokens"].numel() for mb in own)
        num_fillers = self.num_filler_micro_batches()
        if num_fillers:
            assert self.filler is not None, "a rank with fewer micro-batches needs a filler"
            positions += num_fillers * self.filler.batch["tokens"].numel()
        return positions

    @property
    def num_global_units(self) -> int:
        """Loss units of the window over every data-parallel rank (waits for the reduction)."""
        return self._pending.wait()

    @property
    def num_global_term_units(self) -> tuple[int, ...]:
        """Each term's units of the window over every rank, the first unit's first (waits for
        the reduction); ``(num_global_units,)`` for a single-mean loss."""
        return self._pending.term_units()

    def positions_per_rank(self) -> list[int]:
        """Positions each rank's planned micro-batches process (fillers excluded)."""
        return self._pending.positions_per_rank()

    def work(self) -> WindowWork:
        """What this step processed, for the throughput and padding metrics; call it after
        the step (it reads the collective's result)."""
        known = self.num_sample_positions > 0
        return WindowWork(
            num_positions=self.num_input_tokens,
            num_loss_tokens=self.num_local_units,
            num_sample_positions=self._processed_sample_positions() if known else None,
            num_fixed_positions=self.num_fixed_positions if known else None,
            positions_per_rank=tuple(self.positions_per_rank()) if self.dp_size > 1 else (),
            units_name=self.units_name,
            shapes=self._shapes_run(),
        )

    def _shapes_run(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of the micro-batches this rank ran (a filler's too), for the metrics."""
        own = self.micro_batches if self.dp_size > 1 else list(self.nonempty_micro_batches())
        shapes = [tuple(mb.batch["tokens"].shape) for mb in own]
        if self.num_filler_micro_batches():
            assert self.filler is not None, "a rank with fewer micro-batches needs a filler"
            shapes.append(tuple(self.filler.batch["tokens"].shape))
        return tuple(shapes)

    def _processed_sample_positions(self) -> int:
        """The samples' own positions in the micro-batches this rank runs: on one rank the
        empty ones are skipped (see [empty windows]), and their samples with them."""
        per_micro_batch = self.micro_batch_sample_positions
        if self.dp_size > 1 or len(per_micro_batch) != len(self.micro_batches):
            return self.num_sample_positions
        return sum(
            positions
            for positions, mb in zip(per_micro_batch, self.micro_batches, strict=True)
            if mb.num_units > 0
        )

    def should_skip_step(self) -> bool:
        """True when no rank has a loss token in this window; see [empty windows].

        Only waits for the reduction when this rank has no token itself: otherwise the
        answer is already known to be False.
        """
        return self.num_local_units == 0 and self.num_global_units == 0

    def nonempty_micro_batches(self) -> Iterator[MicroBatch]:
        """The micro-batches that carry loss units; see [empty windows]."""
        return (mb for mb in self.micro_batches if mb.num_units > 0)

    def num_filler_micro_batches(self) -> int:
        """Zero-weight micro-batches this rank runs so that every rank runs as many as the
        busiest (only ``token_budget`` plans unequal counts); see [one collective per window]."""
        if self.dp_size == 1 or not self.counts_may_differ:
            return 0
        return self._pending.max_micro_batches() - len(self.micro_batches)

    def micro_batches_to_run(self) -> Iterator[MicroBatch]:
        """The micro-batches a recipe must forward and backward on this rank, lazily.

        On one data-parallel rank, the non-empty ones; with several, all of them and then any
        fillers, so that every rank runs the same collectives (empty ones carry a planted label
        and weigh exactly 0). See [empty micro-batches under FSDP]. The filler count is read
        only after this rank's own micro-batches, when the collective has long completed.
        """
        if self.dp_size == 1:
            yield from self.nonempty_micro_batches()
            return
        yield from self.micro_batches
        num_fillers = self.num_filler_micro_batches()
        if num_fillers:
            assert self.filler is not None, "a rank with fewer micro-batches needs a filler"
        for _ in range(num_fillers):  # a fresh dict each: a loss step pops its labels
            yield replace(self.filler, batch=dict(self.filler.batch))

    def scale(self, loss: torch.Tensor | MicroBatchLoss, micro_batch: MicroBatch) -> torch.Tensor:
        """The micro-batch's mean loss weighted for backward; see [loss scaled before backward].

        Also keeps a detached reference to the loss for :meth:`local_mean_loss`; nothing is
        read back to the host here. ``loss`` is what a loss step returns, a
        :class:`MicroBatchLoss` (see [one return type for every loss step]), or its mean as a
        tensor; under units with further terms, the vector of the term means, handed to
        :meth:`scale_terms`.
        """
        if isinstance(loss, MicroBatchLoss):
            loss = loss.term_means(self.term_names)
        if self.term_names:
            return self.scale_terms(loss, micro_batch)
        self._losses.append(loss.detach())
        self._loss_units.append(micro_batch.num_units)
        factor = self._loss_factor(micro_batch)
        return loss if factor == 1.0 else loss * factor

    def _loss_factor(self, micro_batch: MicroBatch) -> float:
        if self.mode is NormMode.EXACT:
            return self.dp_size * micro_batch.num_units / self.num_global_units
        if self.mode is NormMode.POST_SCALE:
            by_count = self.post_scale_weights_by_count
            return float(micro_batch.num_unshifted_tokens) if by_count else 1.0
        return 1.0 / len(self.micro_batches)

    def scale_terms(self, term_means: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
        """The micro-batch's loss for backward from its term means, ``(K,)``, the first unit's
        term first: each weighted by ``dp_size * u_mk / U_k``, its own units over the window's
        (``naive``: each by one over the micro-batches). See [loss terms over their own units].
        """
        units = (micro_batch.num_units, *micro_batch.num_term_units)
        assert term_means.shape == (len(units),), (
            f"a loss over {len(units)} kinds of units returns {len(units)} term means, got "
            f"shape {tuple(term_means.shape)}"
        )
        self._losses.append(term_means.detach())
        self._loss_units.append(units)
        if self.mode is NormMode.EXACT:
            totals = self.num_global_term_units
            # A term with no unit here weighs exactly 0 (its mean is finite, see the note).
            factors = [
                self.dp_size * num / total if num else 0.0
                for num, total in zip(units, totals, strict=True)
            ]
        else:
            factors = [1.0 / len(self.micro_batches)] * len(units)
        return (term_means * term_means.new_tensor(factors)).sum()

    def finish_gradients(self, model: nn.Module) -> None:
        """Post-backward gradient work; a no-op except in the ``post_scale`` baseline."""
        if self.mode is NormMode.POST_SCALE:
            num_unshifted = sum(mb.num_unshifted_tokens for mb in self.micro_batches)
            if self.dp_group is not None:  # stock reduces its count over the ranks, then scales
                device = self._pending.device
                count = torch.tensor([num_unshifted], dtype=torch.int64, device=device)
                dist.all_reduce(count, group=self.dp_group)
                num_unshifted = int(count.item())
            gradient_scaling_pass(model, self.dp_size / num_unshifted)

    def local_mean_loss(self) -> float:
        """The exact window loss on this rank: the unit-loss sum over its loss units.

        Reads one value back from the device; call it only on steps that are logged.
        """
        if not self._losses:
            return float("nan")
        if self.term_names:
            sums, units = self._term_sums()
            return _sum_of_means(sums.tolist(), units)
        weights = torch.tensor(self._loss_units, dtype=torch.float32)
        losses = torch.stack([loss.float() for loss in self._losses]).cpu()
        return float((losses * weights).sum() / weights.sum())

    def global_mean_loss(self) -> float:
        """The exact window loss over every data-parallel rank (what the step optimised).

        One all-reduce of one number over the data-parallel group, so call it on every rank,
        and only on logged steps. Without a group, or on a group of one rank, it is
        :meth:`local_mean_loss`, so a one-rank distributed run logs exactly the single-device loss.
        """
        if self.dp_group is None or self.dp_size == 1:
            return self.local_mean_loss()
        if self.term_names:  # one all-reduce of the K term sums
            summed = self._term_sums()[0].to(self._pending.device)
            dist.all_reduce(summed, group=self.dp_group)
            return _sum_of_means(summed.tolist(), self.num_global_term_units)
        local_sum = torch.zeros((), dtype=torch.float64)
        if self._losses:
            weights = torch.tensor(self._loss_units, dtype=torch.float64)
            losses = torch.stack([loss.double() for loss in self._losses]).cpu()
            local_sum = (losses * weights).sum()
        summed = local_sum.to(self._pending.device)
        dist.all_reduce(summed, group=self.dp_group)
        return float(summed) / self.num_global_units

    def global_term_means(self) -> tuple[float, ...]:
        """Each term's mean over the window on every data-parallel rank, the first unit's
        first; their sum is :meth:`global_mean_loss` (a term with no unit: 0). Empty for a
        single-mean loss. One all-reduce when sharded, so call it on every rank."""
        if not self.term_names:
            return ()
        sums, units = self._term_sums()
        if self.dp_group is not None and self.dp_size > 1:
            summed = sums.to(self._pending.device)
            dist.all_reduce(summed, group=self.dp_group)
            sums, units = summed.cpu(), list(self.num_global_term_units)
        return tuple(
            float(total) / num if num else 0.0
            for total, num in zip(sums.tolist(), units, strict=True)
        )

    def _term_sums(self) -> tuple[torch.Tensor, list[int]]:
        """This rank's sum of each term over its units, ``sum_m u_mk L_mk`` (fp64, host), and
        its units of each kind: what the window loss divides per term."""
        num_terms = 1 + len(self.term_names)
        if not self._losses:
            return torch.zeros(num_terms, dtype=torch.float64), [0] * num_terms
        weights = torch.tensor(self._loss_units, dtype=torch.float64)  # (M, K)
        losses = torch.stack([loss.double() for loss in self._losses]).cpu()
        # A term with no unit in a micro-batch weighs 0 there, whatever its finite mean.
        return (losses * weights).sum(dim=0), weights.sum(dim=0).long().tolist()


def _sum_of_means(sums: list[float], units: Iterable[int]) -> float:
    """The window loss from each term's sum over its units: the sum of the terms' means (a term
    with no unit adds nothing)."""
    return sum(total / num for total, num in zip(sums, units, strict=True) if num)


def gradient_scaling_pass(model: nn.Module, factor: float) -> None:
    """The pass over every gradient that stock torchtune runs each step, exactly as it runs it.

    exact mode never calls this; ``post_scale`` does, and the profiler times it (with factor 1,
    which leaves every gradient bit-identical) to report what exact mode saves.
    """
    scale_grads(model, torch.tensor(factor))


class LossNormalizer:
    """Counts each window's units and weights each micro-batch's loss.

    Args:
        loss_fn: the recipe's loss; with ``units`` left out, its loss tokens after the shift
            are the units (:class:`exactga.accumulation.loss_units.ShiftedTokens`).
        mode: ``exact`` for training; see [baseline modes] for the others.
        dp_group: the group units are counted over (``Runtime.count_group``: [mesh axes and
            the loss count] in exactga.runtime.distributed), or ``None`` on one device.
        units: what the loss is a mean over; see [loss units].
        statistics: statistics of each whole window that the loss reads, computed over every
            micro-batch and rank before the window's first backward; see [window statistics]
            in exactga.accumulation.window_statistics.
    """

    def __init__(
        self,
        loss_fn: nn.Module,
        *,
        mode: NormMode | str = NormMode.EXACT,
        dp_group: dist.ProcessGroup | None = None,
        units: LossUnits | None = None,
        statistics: Sequence[WindowStatistic] = (),
    ) -> None:
        self.loss_fn = loss_fn
        self.statistics = tuple(statistics)
        self.units = ShiftedTokens(loss_fn) if units is None else units
        self.mode = as_option(NormMode, mode, "loss_normalization")
        if self.mode is NormMode.POST_SCALE and not isinstance(self.units, ShiftedTokens):
            raise ValueError("loss_normalization 'post_scale' is stock's token weighting only.")
        self.dp_group = dp_group
        self.dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        self._term_names = term_names(self.units)  # see [loss terms over their own units]

    def windows(
        self, sample_windows: Iterable[SampleWindow], max_windows: int | None = None
    ) -> Iterator[Window]:
        """One epoch of windows, each counted on the host with its collective issued.

        ``sample_windows`` is the recipes' loader (``exactga.data.loader``), which alone decides
        what a window holds. Call once per epoch: a window never spans epochs.
        """
        iterator = iter(sample_windows)
        num_yielded = 0
        while max_windows is None or num_yielded < max_windows:
            sample_window = next(iterator, None)
            if sample_window is None:
                return
            if not isinstance(sample_window, SampleWindow):
                raise TypeError(
                    "LossNormalizer.windows takes windows of samples (exactga.data.loader), "
                    f"not {type(sample_window).__name__}; build the loader with "
                    "exactga.data.loader.build_dataloader."
                )
            yield self._open_window(sample_window)
            num_yielded += 1
        # Stopped by max_windows: one more fetch lets a stateful loader that is at its end see
        # StopIteration, so a checkpoint taken now records a finished epoch and a resumed run
        # does not start with an empty one. An epoch cut short loses nothing: it ends here.
        next(iterator, None)

    def _count(self, batch: dict[str, torch.Tensor]) -> MicroBatch:
        num_units = self.units.count(batch)
        unshifted = (
            self.units.count_unshifted(batch) if self.mode is NormMode.POST_SCALE else num_units
        )
        num_term_units = count_terms(self.units, batch)
        runs_empty = num_units == 0 and self.dp_size > 1
        batch = self.units.prepare(batch, num_units, runs_empty)
        return MicroBatch(
            batch=batch,
            num_units=num_units,
            num_unshifted_tokens=unshifted,
            num_term_units=num_term_units,
        )

    def _open_window(self, sample_window: SampleWindow) -> Window:
        micro_batches = [self._count(batch) for batch in sample_window.micro_batches]
        local = WindowCounts(
            num_units=sum(mb.num_units for mb in micro_batches),
            num_micro_batches=len(micro_batches),
            num_positions=sum(mb.batch["tokens"].numel() for mb in micro_batches),
            num_term_units=tuple(
                sum(mb.num_term_units[k] for mb in micro_batches)
                for k in range(len(self._term_names))
            ),
        )
        filler = None
        if self.dp_size > 1 and sample_window.by_budget and micro_batches:
            filler = self._count(self.units.emptied(filler_micro_batch(micro_batches[-1].batch)))
        return Window(
            micro_batches,
            self.mode,
            self.dp_size,
            _PendingCounts(local, self.dp_group),
            dp_group=self.dp_group,
            filler=filler,
            num_sample_positions=sample_window.num_sample_positions,
            micro_batch_sample_positions=sample_window.micro_batch_sample_positions,
            num_fixed_positions=sample_window.num_fixed_positions,
            counts_may_differ=sample_window.by_budget,
            units_name=self.units.name,
            term_names=self._term_names,
            statistics=self.statistics,
        )


def warn_skipped_step(step: int) -> None:
    """Tell the user a window had no loss token; see [empty windows]."""
    warnings.warn(
        f"step {step}: no loss token in this accumulation window on any rank (every label is "
        "masked, e.g. prompts filling max_seq_len with train_on_input False); the optimizer "
        "step is skipped and counted in the 'skipped_steps' metric.",
        stacklevel=2,
    )
