"""What a loss step returns: one micro-batch's loss, as its main term and any further terms.

Every recipe's ``_loss_step`` (and the library's loss steps under it) returns a
:class:`MicroBatchLoss`, whatever the recipe and config, so the loop's edit point reads the same
everywhere and a term added there enters the step once; see [one return type for every loss step].

Note [one return type for every loss step]
A loss whose terms are means over units of their own (the router's balance term over
micro-batches, RPO's NLL over the chosen tokens, PPO's value term over the value positions; see
[loss terms over their own units] in exactga.accumulation.loss_units) used to come back as the
vector of its term means, and a plain loss as a scalar. ``loss_step(batch) + c`` then
broadcast ``c`` into every entry of the vector: each entry is weighed by its own units' share,
and the shares of each kind sum to 1 over the window, so ``c`` entered the step once per term
(twice with the router term on). Here the main term (the mean over the normaliser's first units,
what the doc's "mean loss" is) and the further terms are held apart: ``+``, ``-`` act on the main
term alone, ``*`` and ``/`` by a number scale every term (the whole loss), and a further term over
units of its own is added by name with :meth:`MicroBatchLoss.with_term`, after its units are
declared to the normaliser (:func:`exactga.accumulation.loss_units.with_further_units`).
``window.backward`` stacks the terms in the order the normaliser counts them: the same vector,
bit for bit, as the loss steps built before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["MicroBatchLoss"]

Scalar = torch.Tensor | float | int


@dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's loss: ``main``, a mean over the normaliser's units (loss tokens, pairs,
    completion tokens, ...), and ``terms``, further means each over units of its own, keyed by
    the name of those units (``TermUnits.term_names``: ``router_micro_batches``,
    ``chosen_tokens``, ``value_positions``). ``window.backward`` weighs each by its own units'
    share of the window; see [one return type for every loss step].

    ``loss + x`` adds ``x`` (a 0-d tensor or a number) to the main term only: a term that is the
    same for every micro-batch, or a mean over the micro-batch's main units, then enters the step
    exactly once. ``loss * k`` scales every term.
    """

    main: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.main, torch.Tensor) or self.main.numel() != 1:
            shape = tuple(self.main.shape) if isinstance(self.main, torch.Tensor) else "-"
            raise ValueError(
                f"a micro-batch's main loss is a 0-d tensor (a mean), got shape {shape}; add a "
                "term over units of its own with loss.with_term(name, mean)."
            )

    # -- edits ------------------------------------------------------------------------------
    def __add__(self, other: Scalar) -> MicroBatchLoss:
        return MicroBatchLoss(self.main + _scalar(other, "+"), self.terms)

    __radd__ = __add__

    def __sub__(self, other: Scalar) -> MicroBatchLoss:
        return MicroBatchLoss(self.main - _scalar(other, "-"), self.terms)

    def __rsub__(self, other: Scalar) -> MicroBatchLoss:
        return -self + other

    def __neg__(self) -> MicroBatchLoss:
        return self * -1

    def __mul__(self, factor: Scalar) -> MicroBatchLoss:
        factor = _scalar(factor, "*")
        return MicroBatchLoss(self.main * factor, {k: v * factor for k, v in self.terms.items()})

    __rmul__ = __mul__

    def __truediv__(self, divisor: Scalar) -> MicroBatchLoss:
        divisor = _scalar(divisor, "/")
        return MicroBatchLoss(self.main / divisor, {k: v / divisor for k, v in self.terms.items()})

    def with_term(self, units: str, mean: torch.Tensor) -> MicroBatchLoss:
        """This loss plus a term that is a mean over the micro-batch's ``units``: units the
        normaliser counts under that name (declared with
        ``exactga.accumulation.loss_units.with_further_units``). A term already there under
        that name is added to."""
        mean = _scalar(mean, "with_term")
        if not isinstance(mean, torch.Tensor):
            mean = self.main.new_tensor(mean)
        terms = dict(self.terms)
        terms[units] = terms[units] + mean if units in terms else mean
        return MicroBatchLoss(self.main, terms)

    # -- reading ----------------------------------------------------------------------------
    @property
    def total(self) -> torch.Tensor:
        """The sum of the micro-batch's term means (``main`` itself without further terms):
        its loss on its own, unweighted, as one value."""
        if not self.terms:
            return self.main
        return torch.stack([self.main.reshape(()), *self.terms.values()]).sum()

    def term_means(self, names: Sequence[str] = ()) -> torch.Tensor:
        """``main`` when the normaliser counts no further units, else the vector of term means
        in its order (``names``: the window's ``term_names``), for ``Window.scale``.

        Raises:
            ValueError: a term over units the normaliser does not count, or one it counts
                missing.
        """
        if set(names) != set(self.terms):
            unknown = sorted(set(self.terms) - set(names))
            missing = sorted(set(names) - set(self.terms))
            raise ValueError(
                f"the loss has terms over {unknown or 'no further'} units, the normaliser counts "
                f"{list(names) or 'no further'} units (missing: {missing or 'none'}). Declare a "
                "term's units where the normaliser is built (exactga.accumulation.loss_units."
                "with_further_units) and add the term with loss.with_term(units, mean)."
            )
        if not names:
            return self.main
        return torch.stack([self.main, *(self.terms[name] for name in names)])

    def detach(self) -> MicroBatchLoss:
        return MicroBatchLoss(self.main.detach(), {k: v.detach() for k, v in self.terms.items()})

    def backward(self) -> None:
        """Backward of :attr:`total`: the micro-batch on its own (tests, one-off checks). A
        recipe's loop hands the loss to ``window.backward``, which weighs each term."""
        self.total.backward()

    def __float__(self) -> float:
        return float(self.total)


def _scalar(value: Scalar, op: str) -> Scalar:
    """``value`` if it is a number or a 0-d tensor; a vector would broadcast into the terms."""
    if isinstance(value, MicroBatchLoss):
        raise TypeError(
            f"MicroBatchLoss {op} MicroBatchLoss: add a further term with loss.with_term(units, "
            "mean), or add its .main"
        )
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(
            f"MicroBatchLoss {op} a tensor of shape {tuple(value.shape)}: a term is one value "
            "(a mean), so reduce it first"
        )
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        return value.reshape(())
    return value


def as_micro_batch_loss(loss: torch.Tensor | MicroBatchLoss) -> MicroBatchLoss:
    """``loss`` as a :class:`MicroBatchLoss`: a 0-d tensor is its main term alone."""
    return loss if isinstance(loss, MicroBatchLoss) else MicroBatchLoss(loss)
