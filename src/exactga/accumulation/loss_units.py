"""Loss units: what a loss is a mean over, counted on the host for every micro-batch.

The normaliser (``exactga.accumulation.normalization``) weighs micro-batch ``m`` of a window by
``u_m / U``, where ``u_m`` are the units its loss averages over and ``U`` their number over the
window and every data-parallel rank; this module says what a unit is. Supervised fine-tuning and
distillation average over loss tokens, counted after the one-position shift
(:class:`ShiftedTokens`, the default); a preference loss averages over pairs, a policy loss
over completion tokens or completions. A recipe with another loss hands the normaliser another
:class:`LossUnits`; the window, the collective and the scaling stay the same code. A loss that is
a sum of terms, each a mean over units of its own (DPO over pairs plus an NLL over the chosen
responses' tokens), declares the further units too (:class:`TermUnits`; see [loss terms over
their own units]).

Note [loss units]
A loss that is a mean over units, ``L_m = (1/u_m) sum_{i in m} l_i``, gives the window loss
``sum_m u_m L_m / U = (1/U) sum_i l_i``: the full-batch mean over the window's units, whatever
the split, if each ``L_m`` is scaled by ``dp_size * u_m / U`` before backward (see [loss scaled
before backward] in exactga.accumulation.normalization). Three things are unit-specific, and they
are what
:class:`LossUnits` asks for: the host count ``u_m`` (exactly what the loss divides by: for
tokens, counted after the shift), the batch as the loss step needs it (for tokens, the index of
the scored positions), and how a micro-batch with no unit still runs under FSDP with weight 0
(for tokens, one planted label; see [empty micro-batches under FSDP]) or is emptied to serve as
another rank's filler.

Note [loss terms over their own units]
A loss may be a sum of terms, each a mean over units of its own: ``L_m = sum_k L_mk`` with
``L_mk = (1/u_mk) sum_{i in m} l_ik`` over the ``u_mk`` units of kind ``k`` in micro-batch ``m``
(RPO: the DPO loss over pairs plus ``alpha`` times an NLL over the chosen responses' tokens).
The window loss is then ``sum_k (1/U_k) sum_i l_ik``, one denominator per kind, and each term
must be weighted on its own, by ``dp_size * u_mk / U_k``: one factor for the whole micro-batch
cannot do it unless every micro-batch holds the same share of every kind of unit (a micro-batch
of two short pairs holds a third of the window's pairs but a tenth of its chosen tokens). The
per-micro-batch token mean that TRL's ``rpo_alpha`` takes is this mistake for the NLL term:
each micro-batch's chosen tokens weigh ``1/(ga * u_mk)`` instead of ``1/U_k``. The further
counts are counted on the host with the first and travel as further columns of the window's
one collective ([one collective per window] in exactga.accumulation.normalization), and
``Window.scale`` weighs a vector of term means, the first unit's term first. The first unit stays
the one that decides everything else (empty micro-batches and windows, fillers, the logged unit
count), so a further unit must be present wherever the first is, or its term must still be finite:
a term with no unit in a micro-batch that runs weighs exactly 0, and 0 times NaN is NaN.

Note [shifted token count]
A causal LM predicts label t+1 at position t, so the loss sees ``labels[:, 1:]`` (torchtune
pads the last column with the ignore index). The token count must be taken on those shifted
labels: counted before the shift it also includes each row's first label, which the loss never
sees. Stock torchtune 0.6.1 counts before the shift, so its normaliser disagrees with the
loss's own denominator whenever a first label is not masked (``train_on_input: True``, text
completion) and accumulation is then not exact.

Note [empty micro-batches under FSDP]
Under FSDP every data-parallel rank must run the same forwards and backwards, or the ranks'
all-gathers and reduce-scatters pair up wrongly and hang. So with dp_size > 1 an empty
micro-batch still runs, with weight exactly 0. Its mean loss would be 0/0 = NaN (the loss
divides by its own token count) and NaN * 0 is NaN, in the loss and in every gradient. So one
dummy label is planted on the host copy of its labels (``labels[0, 1] = 0``, the first
position the loss scores): the loss is then a finite mean over that one token, while the
micro-batch's recorded count stays 0, so its factor is exactly 0 and its gradient exactly
zero. Nothing else reads the planted label.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX

from exactga.runtime.context_parallel import (
    INPUT_POS,
    SEQUENCE_DIM,
    SHIFTED_LABELS,
    check_shardable,
    positions_of,
    shard,
    shard_positions,
)

Batch = dict[str, torch.Tensor]

IGNORE_INDEX = CROSS_ENTROPY_IGNORE_IDX  # -100, torchtune's and torch's default


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Labels as the loss sees them: ``labels[:, 1:]`` plus one ignored column at the end.

    Keeping the sequence length lets the model's logits be used unsliced. Pair of
    :func:`count_loss_tokens`; see [shifted token count].
    """
    pad = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat((labels[..., 1:], pad), dim=-1)


def pop_scored_labels(batch: Batch, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The labels the loss scores, taken out of ``batch``: its ``labels`` shifted here, or,
    under context parallelism, the shifted ones of this rank's shard (:data:`SHIFTED_LABELS`)."""
    labels = batch.pop("labels")
    shifted = batch.pop(SHIFTED_LABELS, None)
    return shift_labels(labels, ignore_index) if shifted is None else shifted


def count_loss_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Number of tokens the loss will see, counted on host labels after the shift.

    See [shifted token count]. Call it before the batch moves to the device: on a CPU tensor
    this is a host computation and never waits on an accelerator.
    """
    return int((labels[..., 1:] != ignore_index).sum())


# The host-side index of a micro-batch's loss positions travels in its batch under this key; see
# [logits only at loss positions] in ``exactga.accumulation.forward``.
LOSS_POSITIONS = "loss_positions"


def loss_positions(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Flat indices into ``labels.reshape(-1)`` of the positions the loss scores, after the
    shift: those ``count_loss_tokens`` counts, so ``len(result)`` equals it. Host-side."""
    scored = shift_labels(labels, ignore_index).reshape(-1) != ignore_index
    return scored.nonzero().squeeze(1)


def count_unshifted_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Stock torchtune's count, taken before the shift; used only by ``post_scale``."""
    return int((labels != ignore_index).sum())


def loss_ignore_index(loss_fn: nn.Module) -> int:
    """The label value ``loss_fn`` ignores (torchtune's and torch's losses expose it)."""
    return int(getattr(loss_fn, "ignore_index", IGNORE_INDEX))


# ---------------------------------------------------------------------------------------------
# Start-up check: the loss's own denominator equals our count.


def loss_denominator(loss_fn: nn.Module, shifted_labels: torch.Tensor) -> float:
    """The number of tokens ``loss_fn`` divides by on these labels, measured by probing it.

    With all-zero logits every counted token costs exactly ``log(2)`` over a two-way
    vocabulary, so ``loss = num_counted * log(2) / denominator`` whatever the loss does
    internally. The probe needs no model and costs one tiny loss call.
    """
    ignore_index = loss_ignore_index(loss_fn)
    probe_labels = torch.where(shifted_labels == ignore_index, ignore_index, 0).cpu()
    probe_logits = torch.zeros(*probe_labels.shape, 2)
    num_chunks = getattr(loss_fn, "num_output_chunks", None)
    if num_chunks is not None:
        loss = loss_fn(list(probe_logits.chunk(num_chunks, dim=1)), probe_labels)
    else:
        loss = loss_fn(probe_logits.reshape(-1, 2), probe_labels.reshape(-1))
    num_counted = int((probe_labels != ignore_index).sum())
    if loss.numel() != 1:
        raise ValueError(
            f"loss {type(loss_fn).__name__} returned {loss.numel()} values; exactga needs a "
            "mean-reduced scalar loss (set its reduction to 'mean')."
        )
    return num_counted * math.log(2.0) / float(loss)


def verify_loss_denominator(
    loss_fn: nn.Module, labels: torch.Tensor, num_tokens: int | None = None
) -> None:
    """Fail loudly if ``loss_fn`` does not divide by the host count of these labels.

    ``labels`` are a batch's labels as the dataloader gives them (before the shift). A dataset
    that masks with another value than the loss's ignore index, or a loss that sums or divides
    by something else, would silently break exact accumulation; this check runs once, on the
    first batch of a run.
    """
    ignore_index = loss_ignore_index(loss_fn)
    if num_tokens is None:
        num_tokens = count_loss_tokens(labels, ignore_index)
    if num_tokens == 0:
        return  # nothing to compare; the next non-empty batch is checked instead
    measured = loss_denominator(loss_fn, shift_labels(labels, ignore_index))
    if not math.isclose(measured, num_tokens, rel_tol=1e-5):
        raise ValueError(
            f"loss {type(loss_fn).__name__} divides the first batch by {measured:.1f} tokens, "
            f"but exactga counts {num_tokens} loss tokens (labels after the one-position "
            f"shift, ignore_index={ignore_index}). Check that the dataset masks labels with the "
            "loss's ignore_index, does not shift labels itself, and that the loss is a mean "
            "over non-ignored tokens."
        )


def masked_labels(
    batch: dict[str, torch.Tensor], ignore_index: int = IGNORE_INDEX
) -> dict[str, torch.Tensor]:
    """A copy of ``batch`` in which every label is ignored (a zero-weight filler's)."""
    return {**batch, "labels": torch.full_like(batch["labels"], ignore_index)}


def plant_dummy_label(
    batch: dict[str, torch.Tensor], ignore_index: int = IGNORE_INDEX
) -> dict[str, torch.Tensor]:
    """A copy of ``batch`` whose labels hold one live label, so its mean loss is finite.

    Only for micro-batches whose recorded count is 0, which therefore weigh exactly 0; see
    [empty micro-batches under FSDP]. The caller's labels are left untouched.
    """
    labels = batch["labels"]
    if labels.shape[-1] < 2:
        raise ValueError(
            "an empty micro-batch with sequences of length 1 has no position to score; "
            "sequences need at least two tokens."
        )
    labels = labels.clone()
    labels[..., 0, 1] = 0 if ignore_index != 0 else 1
    return {**batch, "labels": labels}


# ---------------------------------------------------------------------------------------------
# The interface the normaliser counts through, and its token implementation.


class LossUnits(Protocol):
    """What a micro-batch's loss is a mean over; see [loss units]."""

    name: str  # as the logged metrics name a window's units: loss_tokens, pairs

    def count(self, batch: Batch) -> int:
        """The units the loss will divide this host batch by (before it moves to a device)."""
        ...

    def prepare(self, batch: Batch, num_units: int, runs_empty: bool) -> Batch:
        """The batch as the loss step needs it. With ``runs_empty`` (``num_units == 0`` and the
        micro-batch must run anyway, under FSDP) its loss must still be finite: it weighs 0."""
        ...

    def emptied(self, batch: Batch) -> Batch:
        """A copy of ``batch`` with no unit: another rank's zero-weight filler."""
        ...


@runtime_checkable
class TermUnits(LossUnits, Protocol):
    """Units of a loss that is a sum of terms, each a mean over units of its own: the first
    term's are :class:`LossUnits`'; the further terms' are declared here. The loss step then
    returns the vector of its term means, in this order. See [loss terms over their own units].
    """

    term_names: tuple[str, ...]  # the further terms' units, as metrics name them

    def count_terms(self, batch: Batch) -> tuple[int, ...]:
        """Each further term's units in this host batch, in ``term_names``' order; called after
        :meth:`count` (which checks the batch), and all 0 for an emptied batch."""
        ...


def term_names(units: LossUnits) -> tuple[str, ...]:
    """The further units ``units`` declares (none for a single-mean loss, the usual case)."""
    return tuple(units.term_names) if isinstance(units, TermUnits) else ()


def count_terms(units: LossUnits, batch: Batch) -> tuple[int, ...]:
    """The further units of this host batch (none for a single-mean loss)."""
    return tuple(units.count_terms(batch)) if isinstance(units, TermUnits) else ()


class ShiftedTokens:
    """Loss tokens after the one-position shift (supervised fine-tuning, distillation).

    The first batch with a loss token is also checked against ``loss_fn``'s own denominator
    (:func:`verify_loss_denominator`), so a dataset or loss that counts otherwise fails at
    start-up instead of training on silently wrong weights.
    """

    name = "loss_tokens"

    def __init__(self, loss_fn: nn.Module) -> None:
        self.loss_fn = loss_fn
        self.ignore_index = loss_ignore_index(loss_fn)
        self._verified = False

    def count(self, batch: Batch) -> int:
        labels = batch["labels"]
        num_tokens = count_loss_tokens(labels, self.ignore_index)
        if not self._verified and num_tokens > 0:
            verify_loss_denominator(self.loss_fn, labels, num_tokens)
            self._verified = True
        return num_tokens

    def count_unshifted(self, batch: Batch) -> int:
        """Stock torchtune's count, for the ``post_scale`` baseline only."""
        return count_unshifted_tokens(batch["labels"], self.ignore_index)

    def prepare(self, batch: Batch, num_units: int, runs_empty: bool) -> Batch:
        if runs_empty:
            batch = plant_dummy_label(batch, self.ignore_index)
        return {**batch, LOSS_POSITIONS: loss_positions(batch["labels"], self.ignore_index)}

    def emptied(self, batch: Batch) -> Batch:
        return masked_labels(batch, self.ignore_index)


class ContextParallelTokens(ShiftedTokens):
    """Loss tokens after the shift on this cp rank's shard; see [loss tokens under context
    parallelism] in exactga.runtime.context_parallel. The batch it prepares keeps its full
    sequences (the device cuts them: ``sharded_micro_batch`` there) and adds the shifted labels,
    the positions, and the index of the loss positions within this rank's shard."""

    def __init__(self, loss_fn: nn.Module, cp_size: int, cp_rank: int) -> None:
        super().__init__(loss_fn)
        self.cp_size = cp_size
        self.cp_rank = cp_rank

    def count(self, batch: Batch) -> int:
        check_shardable(batch, self.cp_size)
        super().count(batch)  # checks the loss's denominator on the full labels, once
        return int((self._own_shifted_labels(batch["labels"]) != self.ignore_index).sum())

    def count_unshifted(self, batch: Batch) -> int:
        """Stock's count, before the shift, on this rank's shard (``post_scale`` only)."""
        own = shard(batch["labels"], self.cp_size, self.cp_rank)
        return count_unshifted_tokens(own, self.ignore_index)

    def prepare(self, batch: Batch, num_units: int, runs_empty: bool) -> Batch:
        shifted = shift_labels(batch["labels"], self.ignore_index)
        if runs_empty:  # this shard weighs 0; a label planted in it keeps its mean finite
            own_first = shard_positions(shifted.shape[SEQUENCE_DIM], self.cp_size, self.cp_rank)
            shifted[0, own_first[0]] = 0 if self.ignore_index != 0 else 1
        own_scored = shard(shifted, self.cp_size, self.cp_rank).reshape(-1) != self.ignore_index
        return {
            **batch,
            INPUT_POS: batch.get(INPUT_POS, positions_of(batch["tokens"])),
            SHIFTED_LABELS: shifted,
            LOSS_POSITIONS: own_scored.nonzero().squeeze(1),
        }

    def emptied(self, batch: Batch) -> Batch:
        unprepared = {k: v for k, v in batch.items() if k not in (SHIFTED_LABELS, LOSS_POSITIONS)}
        return masked_labels(unprepared, self.ignore_index)

    def _own_shifted_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shard(shift_labels(labels, self.ignore_index), self.cp_size, self.cp_rank)


def context_parallel_units(units: LossUnits, cp_mesh: DeviceMesh | None) -> LossUnits:
    """The normaliser's units for a run over ``cp_mesh``: ``units`` as they are without one, the
    same tokens counted on this rank's shard with one. Only plain loss tokens (supervised
    fine-tuning) are sharded; a loss over other units, or with further terms, is refused."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return units
    if type(units) is not ShiftedTokens:
        raise ValueError(
            f"context parallelism counts plain loss tokens (supervised fine-tuning); this "
            f"loss counts {type(units).__name__} ({units.name}), which it does not shard."
        )
    return ContextParallelTokens(units.loss_fn, cp_mesh.size(), cp_mesh.get_local_rank())


class FurtherUnits:
    """``base``'s units, and one further term's: what a copy declares to add a term over units
    of its own (``loss.with_term(name, mean)``; see [one return type for every loss step] in
    exactga.accumulation.micro_batch_loss and [loss terms over their own units]).

    Args:
        base: the units the recipe's normaliser counts (its first unit, and any further ones).
        name: the further term's units, as ``with_term`` and the metrics name them.
        count: the term's units in a host batch; it must give 0 on an emptied batch (every
            label ignored), as a count over labels does.
    """

    def __init__(self, base: LossUnits, name: str, count: Callable[[Batch], int]) -> None:
        self.base = base
        self.name = base.name
        self.term_names = (*term_names(base), name)
        self._count_term = count

    def count(self, batch: Batch) -> int:
        return self.base.count(batch)

    def count_terms(self, batch: Batch) -> tuple[int, ...]:
        return (*count_terms(self.base, batch), int(self._count_term(batch)))

    def prepare(self, batch: Batch, num_units: int, runs_empty: bool) -> Batch:
        return self.base.prepare(batch, num_units, runs_empty)

    def emptied(self, batch: Batch) -> Batch:
        return self.base.emptied(batch)


def with_further_units(base: LossUnits, name: str, count: Callable[[Batch], int]) -> FurtherUnits:
    """``base`` and a further term's units ``name``, counted on each host batch by ``count``:
    hand it to the normaliser as its ``units``, and add the term with
    ``loss.with_term(name, mean)``. See :class:`FurtherUnits`."""
    return FurtherUnits(base, name, count)
