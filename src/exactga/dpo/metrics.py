"""Stock's DPO metrics, as exact window values (:class:`PreferenceMetrics`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from exactga.accumulation.normalization import Window
from exactga.dpo.terms import DpoTerms


class PreferenceMetrics:
    """Stock's DPO metrics, each the mean over the window's pairs on every rank (stock logs the
    last micro-batch's means). Sums per pair are kept on the device, read only when logged.

    With an NLL term (``terms.rpo_alpha``) also the two terms of the loss: ``dpo_loss``, the
    mean per-pair loss, and ``chosen_nll``, the mean NLL over the window's chosen tokens (not
    weighted by ``rpo_alpha``), so ``loss = dpo_loss + rpo_alpha * chosen_nll``. For KTO
    (``terms.unpaired``) ``kl`` alone, the window's reference point (``reference_point``).

    Args:
        device: where the metrics' all-reduce runs (the data-parallel backend's device).
        terms: the step's loss terms (:class:`DpoTerms`); stock DPO's by default.
        reference_point: KTO's (exactga.dpo.kto.KtoReferencePoint), for ``kl``.
    """

    NAMES = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "log_probs/chosen",
        "log_probs/rejected",
    )
    TERM_NAMES = ("dpo_loss", "chosen_nll")

    def __init__(
        self,
        device: torch.device | str = "cpu",
        terms: DpoTerms | None = None,
        reference_point: Any = None,
    ) -> None:
        self.device = torch.device(device)
        self.has_terms = terms is not None and terms.has_nll
        self.names = self.NAMES + (self.TERM_NAMES if self.has_terms else ())
        self.reference_point = reference_point  # KTO's: its one metric, already global
        self._sums: torch.Tensor | None = None
        self._term_sums: torch.Tensor | None = None

    def record(
        self,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
        chosen_log_probs: torch.Tensor,
        rejected_log_probs: torch.Tensor,
    ) -> None:
        """Add one micro-batch's per-pair values (detached, no host read)."""
        per_pair = torch.stack(
            [
                chosen_rewards,
                rejected_rewards,
                (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
                chosen_rewards - rejected_rewards,
                chosen_log_probs,
                rejected_log_probs,
            ]
        ).detach()
        sums = per_pair.double().sum(dim=1)
        self._sums = sums if self._sums is None else self._sums + sums

    @property
    def recorded_sums(self) -> torch.Tensor | None:
        """The per-pair sums recorded since the window opened, in ``NAMES``' order (fp64, on
        the device); None before any pair (a validation batch's, read by
        exactga.dpo.validation)."""
        return self._sums

    def record_terms(self, pair_losses: torch.Tensor, chosen_nll_sum: torch.Tensor) -> None:
        """Add one micro-batch's per-pair losses and its chosen tokens' summed NLL."""
        sums = torch.stack([pair_losses.double().sum(), chosen_nll_sum.double()]).detach()
        self._term_sums = sums if self._term_sums is None else self._term_sums + sums

    def track(self, windows: Iterable[Window]) -> Iterator[Window]:
        """The windows, with the record cleared as each one opens."""
        for window in windows:
            self._sums = None
            self._term_sums = None
            yield window

    def window_metrics(self, window: Window) -> dict[str, float]:
        """Each metric's mean over the window's pairs on every rank (``chosen_nll``: over its
        chosen tokens): one all-reduce of six numbers, eight with the terms, under data
        parallelism (call on every rank, on logged steps only); nothing for a skipped window."""
        if window.should_skip_step():
            return {}
        if self.reference_point is not None:  # computed over every rank before the backward
            return {"kl": float(self.reference_point.value)}
        sums = torch.zeros(len(self.NAMES), dtype=torch.float64, device=self.device)
        if self._sums is not None:
            sums = self._sums.to(self.device, copy=True)  # reduced in place below
        if self.has_terms:
            term_sums = torch.zeros(2, dtype=torch.float64, device=self.device)
            if self._term_sums is not None:
                term_sums = self._term_sums.to(self.device)
            sums = torch.cat([sums, term_sums])
        if window.dp_group is not None and window.dp_size > 1:
            dist.all_reduce(sums, group=window.dp_group)
        means = (sums / window.num_global_units).tolist()
        if self.has_terms:  # chosen_nll: over the chosen tokens
            means[-1] = float(sums[-1]) / window.num_global_term_units[1]
        return dict(zip(self.names, means, strict=True))
