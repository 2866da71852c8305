"""The GRPO policy losses, as ``loss`` components: each completion token's loss.

A config names one under ``loss: _component_:`` (stock's ``torchtune.dev.grpo.loss.*`` names,
which the pip package lacks, stand for :class:`PPOClipLoss`; see :func:`build_policy_loss`):

- :class:`PPOClipLoss`: the clipped surrogate of PPO and GRPO, with DAPO's asymmetric clipping
  (``epsilon_low``, ``epsilon_high``; "clip-higher" is ``epsilon_high > epsilon_low``);
- :class:`GSPOLoss`: GSPO's sequence-level importance ratio and clipping;
- :class:`CISPOLoss`: CISPO's clipped, detached importance weights on every token's log-prob.

Each adds ``kl_coeff`` times a KL estimator to the reference (``kl_estimator``: k1, k2, k3)
to every token's loss, or with ``kl_in_reward`` leaves it out of the loss: the step then takes
it off each completion's reward before the advantages (exactga.grpo.rollout_step). What a loss
returns is a loss per completion token; the aggregation over tokens and completions, and with it
the units the normaliser counts, is ``loss_aggregation``'s (see [policy aggregations] in
exactga.grpo.policy). See [policy losses are local to a completion].

Note [policy losses are local to a completion]
Exact accumulation needs each unit's loss to depend on that unit alone (see [loss units] in
exactga.accumulation.loss_units). Every loss here is a function of one completion's tokens: the
PPO-clip and CISPO token losses of the token's own log-probs and its completion's advantage, the
GSPO ratio ``s_c = exp(mean_t (logp_ct - old_ct))`` of its completion's tokens, which a
micro-batch always holds whole (micro-batches are cut between rollouts). So a micro-batch's
token losses are those of the full batch, whatever the split, and the aggregation's units carry
the rest. GSPO's token form ``s_ct = sg(s_c) * exp(logp_ct - sg(logp_ct))`` has the value
``s_c`` at every token and the gradient ``s_c grad logp_ct``; averaged over a completion's tokens
(``seq-mean-token-mean``, GSPO's own aggregation) it is exactly ``grad s_c``, and under another
aggregation each token weighs its share as it does for the other losses.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from exactga.config.options import KLEstimator
from exactga.grpo.schema import STOCK_LOSSES


def kl_estimate(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: KLEstimator | str
) -> torch.Tensor:
    """Each token's estimate of the KL of the policy to the reference; see :class:`KLEstimator`."""
    estimator = KLEstimator(estimator)
    log_ratio = log_probs - ref_log_probs
    if estimator is KLEstimator.K1:
        return log_ratio
    if estimator is KLEstimator.K2:
        return 0.5 * log_ratio.square()
    return torch.exp(-log_ratio) + log_ratio - 1.0


def row_of(positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The row of each flat position of a ``(rows, seq_len)`` batch."""
    return torch.div(positions, seq_len, rounding_mode="floor")


@dataclasses.dataclass
class PolicyTokens:
    """One micro-batch's completion tokens as a loss sees them, each a 1-d tensor over the
    tokens (fp64): ``log_probs`` under the policy (with gradient), the generating policy's
    ``old_log_probs`` and the reference's ``ref_log_probs``, each token's completion's
    ``advantages``; and where the tokens sit, flat ``positions`` of a ``(num_rows, seq_len)``
    batch, so that a loss can take a completion's sum or mean."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    advantages: torch.Tensor
    positions: torch.Tensor
    num_rows: int
    seq_len: int

    @property
    def rows(self) -> torch.Tensor:
        """Each token's completion (row of the batch)."""
        return row_of(self.positions, self.seq_len)

    def row_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Each completion's sum of per-token ``values``, ``(num_rows,)``: through a dense
        ``(rows, seq_len)`` grid, since ``index_copy`` with distinct indices is deterministic on
        every device, where an ``index_add`` into rows would use atomics on CUDA."""
        grid = values.new_zeros(self.num_rows * self.seq_len).index_copy(0, self.positions, values)
        return grid.view(self.num_rows, self.seq_len).sum(dim=1)

    def row_counts(self) -> torch.Tensor:
        """Each completion's number of completion tokens, ``(num_rows,)``."""
        return self.row_sums(torch.ones_like(self.log_probs, dtype=torch.float64))

    def row_means(self, values: torch.Tensor) -> torch.Tensor:
        """Each completion's mean of per-token ``values``, ``(num_rows,)``."""
        return self.row_sums(values) / self.row_counts()


class PolicyLoss:
    """What the policy losses share: the KL term and its settings.

    Args:
        kl_coeff: the KL term's weight (0: none).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (:class:`KLEstimator`).
        kl_in_reward: take ``kl_coeff`` times the completion's summed KL off its reward before
            the advantages (the generating policy's log-probs against the reference's, no
            gradient) instead of adding it to each token's loss.
    """

    def __init__(
        self,
        *,
        kl_coeff: float = 0.0,
        kl_estimator: KLEstimator | str = KLEstimator.K3,
        kl_in_reward: bool = False,
    ) -> None:
        self.kl_coeff = float(kl_coeff)
        self.kl_estimator = KLEstimator(kl_estimator)
        self.kl_in_reward = bool(kl_in_reward)
        if self.kl_coeff < 0:
            raise ValueError(f"config key 'loss.kl_coeff'={kl_coeff}: must be at least 0.")

    def token_losses(self, tokens: PolicyTokens) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's loss, and which tokens the clipping cut (for ``policy/clip_fraction``)."""
        losses, clipped = self.surrogate(tokens)
        if self.kl_coeff and not self.kl_in_reward:
            kl = kl_estimate(tokens.log_probs, tokens.ref_log_probs, self.kl_estimator)
            losses = losses + self.kl_coeff * kl
        return losses, clipped

    def surrogate(self, tokens: PolicyTokens) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def describe(self) -> str:
        """The loss and its settings, as a report names it."""
        settings = ", ".join(f"{k}={v}" for k, v in self.settings().items())
        return f"{type(self).__name__}({settings})"

    def settings(self) -> dict[str, Any]:
        names = inspect.signature(type(self)).parameters
        return {name: getattr(self, name) for name in names}


def _check_clip(name: str, value: float) -> float:
    if not value >= 0.0:
        raise ValueError(f"config key 'loss.{name}'={value}: must be at least 0.")
    return float(value)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``-min(r A, clip(r, 1 - low, 1 + high) A)``, and where the clipped term is the one
    taken with the ratio outside the range (the gradient is then 0)."""
    clipped_ratio = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    losses = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    cut = ((ratio > 1.0 + high) & (advantages > 0)) | ((ratio < 1.0 - low) & (advantages < 0))
    return losses, cut


class PPOClipLoss(PolicyLoss):
    """PPO's clipped surrogate per token, ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``
    with ``r = exp(logp - old_logp)`` (torchtune's ``GRPOLoss``; DAPO's clip-higher with
    ``epsilon_high > epsilon_low``), plus the KL term (:class:`PolicyLoss`).

    Args:
        epsilon: the clip range on both sides, where ``epsilon_low``/``epsilon_high`` are unset.
        epsilon_low, epsilon_high: the range below and above 1 (DAPO: 0.2 and 0.28).
        kl_coeff, kl_estimator, kl_in_reward: see :class:`PolicyLoss` (stock's default 0.1, k3).
    """

    def __init__(
        self,
        *,
        epsilon: float = 0.1,
        epsilon_low: float | None = None,
        epsilon_high: float | None = None,
        kl_coeff: float = 0.1,
        kl_estimator: KLEstimator | str = KLEstimator.K3,
        kl_in_reward: bool = False,
    ) -> None:
        super().__init__(kl_coeff=kl_coeff, kl_estimator=kl_estimator, kl_in_reward=kl_in_reward)
        self.epsilon = _check_clip("epsilon", epsilon)
        low = epsilon if epsilon_low is None else epsilon_low
        high = epsilon if epsilon_high is None else epsilon_high
        self.epsilon_low = _check_clip("epsilon_low", low)
        self.epsilon_high = _check_clip("epsilon_high", high)

    def surrogate(self, tokens: PolicyTokens) -> tuple[torch.Tensor, torch.Tensor]:
        ratio = torch.exp(tokens.log_probs - tokens.old_log_probs)
        return _clipped_surrogate(ratio, tokens.advantages, self.epsilon_low, self.epsilon_high)


class GSPOLoss(PolicyLoss):
    """GSPO: the clipped surrogate of the sequence-level ratio ``s_c = exp(mean_t (logp_ct -
    old_ct))``, one per completion, with its completion's advantage; see [policy losses are
    local to a completion] for its token form. Its own aggregation is ``seq-mean-token-mean``
    (each completion's loss then is ``-min(s_c A_c, clip(s_c) A_c)``).

    Args:
        epsilon_low, epsilon_high: the range of ``s_c`` below and above 1 (the paper's 3e-4 and
            4e-4: a sequence ratio moves far less than a token's).
        kl_coeff, kl_estimator, kl_in_reward: see :class:`PolicyLoss` (default: no KL term).
    """

    def __init__(
        self,
        *,
        epsilon_low: float = 3e-4,
        epsilon_high: float = 4e-4,
        kl_coeff: float = 0.0,
        kl_estimator: KLEstimator | str = KLEstimator.K3,
        kl_in_reward: bool = False,
    ) -> None:
        super().__init__(kl_coeff=kl_coeff, kl_estimator=kl_estimator, kl_in_reward=kl_in_reward)
        self.epsilon_low = _check_clip("epsilon_low", epsilon_low)
        self.epsilon_high = _check_clip("epsilon_high", epsilon_high)

    def surrogate(self, tokens: PolicyTokens) -> tuple[torch.Tensor, torch.Tensor]:
        sequence_log_ratio = tokens.row_means(tokens.log_probs - tokens.old_log_probs)
        log_ratio = (
            sequence_log_ratio.detach().index_select(0, tokens.rows)
            + tokens.log_probs
            - tokens.log_probs.detach()
        )
        return _clipped_surrogate(
            torch.exp(log_ratio), tokens.advantages, self.epsilon_low, self.epsilon_high
        )


class CISPOLoss(PolicyLoss):
    """CISPO: ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp`` on every token, ``r`` the
    token's ratio to the generating policy: the weight is clipped, never the token's gradient.

    Args:
        epsilon_low, epsilon_high: the weight's range (MiniMax-M1 sets no lower bound: a low of
            1 floors the weight at 0, the default; ``epsilon_high`` is the one to tune).
        kl_coeff, kl_estimator, kl_in_reward: see :class:`PolicyLoss` (default: no KL term).
    """

    def __init__(
        self,
        *,
        epsilon_low: float = 1.0,
        epsilon_high: float = 0.28,
        kl_coeff: float = 0.0,
        kl_estimator: KLEstimator | str = KLEstimator.K3,
        kl_in_reward: bool = False,
    ) -> None:
        super().__init__(kl_coeff=kl_coeff, kl_estimator=kl_estimator, kl_in_reward=kl_in_reward)
        self.epsilon_low = _check_clip("epsilon_low", epsilon_low)
        self.epsilon_high = _check_clip("epsilon_high", epsilon_high)

    def surrogate(self, tokens: PolicyTokens) -> tuple[torch.Tensor, torch.Tensor]:
        ratio = torch.exp(tokens.log_probs - tokens.old_log_probs).detach()
        weight = torch.clamp(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
        cut = (ratio > 1.0 + self.epsilon_high) | (ratio < 1.0 - self.epsilon_low)
        return -weight * tokens.advantages * tokens.log_probs, cut


POLICY_LOSSES: dict[str, type[PolicyLoss]] = {
    f"{__name__}.{cls.__name__}": cls for cls in (PPOClipLoss, GSPOLoss, CISPOLoss)
}


def policy_loss_class(component: str | None) -> type[PolicyLoss]:
    """The class a ``loss._component_`` names (stock's names, or none: :class:`PPOClipLoss`).

    Raises:
        ValueError: another component, naming the key and the choices.
    """
    if component is None or component in STOCK_LOSSES:
        return PPOClipLoss
    if component in POLICY_LOSSES:
        return POLICY_LOSSES[component]
    choices = ", ".join([*POLICY_LOSSES, *STOCK_LOSSES])
    raise ValueError(f"config key 'loss._component_'={component!r}: choose one of {choices}.")


def build_policy_loss(section: Mapping[str, Any] | None) -> PolicyLoss:
    """The policy loss a config's ``loss`` section names, with its settings.

    Raises:
        ValueError: an unknown component or a setting it does not take, named.
    """
    section = dict(section or {})
    cls = policy_loss_class(section.pop("_component_", None))
    accepted = inspect.signature(cls).parameters
    for key in section:
        if key not in accepted:
            raise ValueError(
                f"config key 'loss.{key}': {cls.__name__} takes {', '.join(accepted)} "
                "(exactga.grpo.losses; see docs/grpo.md)."
            )
    return cls(**section)
