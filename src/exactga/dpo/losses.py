"""Preference losses beyond torchtune 0.6.1's ``DPOLoss`` and ``RSOLoss``: SimPO, ORPO, IPO.

Each is a ``loss`` ``_component_`` with one loss per pair, as torchtune's are (the DPO recipes
average them over the window's pairs themselves; see [pairs as loss units] in
exactga.dpo.preference). Their keys are the ones users know: torchtune 0.4's ``SimPOLoss``
(``beta``, ``gamma``, ``label_smoothing``) and ``IPOLoss`` (``tau``), and TRL's ORPO ``beta``.
What each loss needs of the step beyond its keys it declares as class attributes, read by
:meth:`exactga.dpo.terms.DpoTerms.for_loss`:

- ``reference_free``: the loss takes the policy's two log-probs only, and the recipes build and
  run no reference model at all (SimPO, ORPO);
- ``sequence_log_prob``: the log-prob the loss is defined on when the config leaves
  ``sequence_log_prob`` null, the mean over a response's tokens (SimPO, ORPO, IPO; see
  [length-normalised log-probs are per pair] in exactga.dpo.preference) or their sum (stock);
- ``nll_weight``: the weight of an NLL term on the chosen responses that the loss holds (ORPO's
  is 1), a mean over the window's chosen tokens (see [chosen tokens as the NLL's units]).

A loss without these attributes (torchtune's ``DPOLoss``, ``RSOLoss``) is a reference-based loss
on summed log-probs with no NLL term.

Note [preference loss units]
Every loss here is a function of one pair's log-probs, so pairs are its units, exactly as for
DPO. ORPO adds ``-log p`` of the chosen responses as a second term; its per-pair part uses each
response's *mean* log-prob, but the NLL is a cross-entropy over the chosen tokens (TRL's ORPO
takes it over the micro-batch's chosen tokens), so its units are the window's chosen tokens
after the shift and it is weighted by them on its own, as RPO's is: the window loss is
``(1/T) sum_t -log p(t) + (1/P) sum_p l_p``. Weighting the NLL by pairs instead (a mean of each
pair's token mean) would be another loss, in which a short chosen response's tokens weigh more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PairLosses = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Bradley-Terry's ``-log sigmoid(logits)``, conservative with ``label_smoothing`` (cDPO)."""
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


class SimPOLoss(nn.Module):
    """SimPO (Meng et al. 2024), reference-free: per pair
    ``-log sigmoid(beta * (lp_c - lp_r) - gamma)`` on length-normalised log-probs ``lp``
    (each response's mean token log-prob), with torchtune 0.4's keys and defaults.

    Args:
        beta: the reward's scale (2.0 to 2.5 in the paper).
        gamma: the target reward margin.
        label_smoothing: conservative loss's label noise; 0 is SimPO.
    """

    reference_free = True
    sequence_log_prob = "mean"

    def __init__(self, beta: float = 2.0, gamma: float = 0.5, label_smoothing: float = 0.0):
        super().__init__()
        self.beta, self.gamma, self.label_smoothing = beta, gamma, label_smoothing

    def forward(
        self, policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor
    ) -> PairLosses:
        """One loss per pair, and the pairs' rewards ``beta * lp`` (detached)."""
        margin = policy_chosen_logps - policy_rejected_logps
        losses = _sigmoid_loss(self.beta * margin - self.gamma, self.label_smoothing)
        chosen_rewards = self.beta * policy_chosen_logps.detach()
        rejected_rewards = self.beta * policy_rejected_logps.detach()
        return losses, chosen_rewards, rejected_rewards


class ORPOLoss(nn.Module):
    """ORPO's odds-ratio term (Hong et al. 2024), reference-free: per pair
    ``-beta * log sigmoid(log odds(y_c) - log odds(y_r))`` with
    ``log odds(y) = lp - log(1 - exp(lp))`` on length-normalised log-probs ``lp``. The recipes add
    ORPO's NLL on the chosen responses with weight ``nll_weight`` = 1, a mean over the window's
    chosen tokens (see [preference loss units]); ``beta`` is TRL's (the paper's lambda).

    Args:
        beta: the odds-ratio term's weight.
    """

    reference_free = True
    sequence_log_prob = "mean"
    nll_weight = 1.0

    def __init__(self, beta: float = 0.1):
        super().__init__()
        self.beta = beta

    def forward(
        self, policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor
    ) -> PairLosses:
        """One odds-ratio loss per pair, and the pairs' rewards ``beta * lp`` (detached)."""
        # log(1 - p) as log(-expm1(lp)): exact where p is near 1, and lp < 0 for any response.
        log_odds = (policy_chosen_logps - policy_rejected_logps) - (
            torch.log(-torch.expm1(policy_chosen_logps))
            - torch.log(-torch.expm1(policy_rejected_logps))
        )
        losses = -self.beta * F.logsigmoid(log_odds)
        chosen_rewards = self.beta * policy_chosen_logps.detach()
        rejected_rewards = self.beta * policy_rejected_logps.detach()
        return losses, chosen_rewards, rejected_rewards


class IPOLoss(nn.Module):
    """IPO (Azar et al. 2023): per pair ``(h - 1 / (2 tau))^2`` with
    ``h = (lp_c - lp_r) - (ref_c - ref_r)``, on length-normalised log-probs unless
    ``sequence_log_prob`` says otherwise (as TRL's ``loss_type: ipo``); torchtune 0.4's key.

    Args:
        tau: the regularisation towards the reference (TRL's ``beta`` for IPO).
    """

    sequence_log_prob = "mean"

    def __init__(self, tau: float = 0.1):
        super().__init__()
        self.tau = tau

    def forward(
        self,
        policy_chosen_logps: torch.Tensor,
        policy_rejected_logps: torch.Tensor,
        reference_chosen_logps: torch.Tensor,
        reference_rejected_logps: torch.Tensor,
    ) -> PairLosses:
        """One loss per pair, and the pairs' rewards ``tau * (lp - ref)`` (detached)."""
        logits = (policy_chosen_logps - policy_rejected_logps) - (
            reference_chosen_logps - reference_rejected_logps
        )
        losses = (logits - 1 / (2 * self.tau)) ** 2
        chosen_rewards = self.tau * (policy_chosen_logps - reference_chosen_logps).detach()
        rejected_rewards = self.tau * (policy_rejected_logps - reference_rejected_logps).detach()
        return losses, chosen_rewards, rejected_rewards


def is_reference_free(loss_fn: nn.Module) -> bool:
    """Whether ``loss_fn`` takes the policy's log-probs alone (no reference model at all)."""
    return bool(getattr(loss_fn, "reference_free", False))
