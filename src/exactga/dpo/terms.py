"""What a DPO step's loss is made of beyond the per-pair loss, in one object: the settings the
units, the loss step and the metrics read (:class:`DpoTerms`), so they cannot disagree. See
[chosen tokens as the NLL's units] and [length-normalised log-probs are per pair] in
exactga.dpo.preference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.config.options import SequenceLogProb, as_option
from exactga.dpo.kto import KtoExamples
from exactga.dpo.losses import is_reference_free
from exactga.dpo.preference import PairsAndChosenTokens, PreferencePairs


@dataclass(frozen=True)
class DpoTerms:
    """What a DPO step's loss is made of beyond the per-pair loss (``loss``): the settings the
    units, the loss step and the metrics read, in one object so they cannot disagree. The
    recipes pass the config's keys (their defaults are in exactga.dpo.schema).

    Args:
        rpo_alpha: the weight of the chosen responses' NLL, a mean over their tokens; 0 adds
            no term (stock DPO). See [chosen tokens as the NLL's units].
        sequence_log_prob: each response's log-prob as the ``sum`` of its tokens' (stock) or
            their ``mean``. See [length-normalised log-probs are per pair].

    Raises:
        ValueError: naming the key, for a negative or non-finite ``rpo_alpha`` or another
            ``sequence_log_prob``.
    """

    rpo_alpha: float
    sequence_log_prob: SequenceLogProb
    # The loss takes the policy's log-probs alone: no reference is built or run (SimPO, ORPO).
    reference_free: bool = False
    # The loss trains unpaired examples against the window's reference point (KTO).
    unpaired: bool = False

    @classmethod
    def for_loss(
        cls,
        loss_fn: nn.Module,
        *,
        rpo_alpha: float = 0.0,
        sequence_log_prob: SequenceLogProb | str | None = None,
    ) -> DpoTerms:
        """The terms of ``loss_fn``'s step from the config's keys and what the loss declares
        (``reference_free``, ``sequence_log_prob``, ``nll_weight``; see exactga.dpo.losses): a
        null ``sequence_log_prob`` is the loss's own (the sum for torchtune's losses), and ORPO's
        NLL term is its ``nll_weight``.

        Raises:
            ValueError: naming ``rpo_alpha``, for a loss that holds an NLL term of its own.
        """
        own_nll = float(getattr(loss_fn, "nll_weight", 0.0))
        if own_nll and rpo_alpha:
            raise ValueError(
                f"config key 'rpo_alpha'={rpo_alpha}: {type(loss_fn).__name__} holds its own NLL "
                f"term on the chosen responses (weight {own_nll}); set rpo_alpha: 0."
            )
        if sequence_log_prob is None:
            sequence_log_prob = getattr(loss_fn, "sequence_log_prob", SequenceLogProb.SUM)
        unpaired = bool(getattr(loss_fn, "unpaired", False))
        if unpaired and (rpo_alpha or sequence_log_prob == SequenceLogProb.MEAN):
            raise ValueError(
                f"config keys 'rpo_alpha' and 'sequence_log_prob': {type(loss_fn).__name__} "
                "trains unpaired examples on summed log-probs; leave both out."
            )
        return cls(
            rpo_alpha=own_nll or rpo_alpha,
            sequence_log_prob=sequence_log_prob,
            reference_free=is_reference_free(loss_fn),
            unpaired=unpaired,
        )

    def __post_init__(self) -> None:
        if not math.isfinite(self.rpo_alpha) or self.rpo_alpha < 0:
            raise ValueError(
                f"rpo_alpha must be at least 0 (0: no NLL term), got {self.rpo_alpha}."
            )
        value = as_option(SequenceLogProb, self.sequence_log_prob, "sequence_log_prob")
        object.__setattr__(self, "sequence_log_prob", value)

    @property
    def has_nll(self) -> bool:
        return self.rpo_alpha > 0

    def units(self, ignore_index: int = IGNORE_INDEX) -> PreferencePairs:
        """What the step's loss is a mean over: pairs, and with an NLL term its chosen tokens
        too. Without one, exactly the units of stock-weighted DPO (:class:`PreferencePairs`);
        KTO's examples for an unpaired loss."""
        if self.unpaired:
            return KtoExamples(ignore_index)
        if self.has_nll:
            return PairsAndChosenTokens(ignore_index)
        return PreferencePairs(ignore_index)


# Stock DPO: the per-pair loss on summed log-probs, nothing added.
DPO = DpoTerms(rpo_alpha=0.0, sequence_log_prob=SequenceLogProb.SUM)
