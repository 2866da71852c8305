"""The values a config knob may take: one enum per knob with a fixed set of values.

The bottom of exactga: it imports nothing from it (nor torch), so ``exactga.config.schemas`` can
declare each knob's type and default without importing the runtime, and the runtime modules
(normalization, micro-batching, precision, distributed, training) import the same enums. After
``exactga.config.validation.validate_config`` the config holds members of these enums, not strings,
so a recipe hands ``cfg.loss_normalization`` to the library as it is.

A member is a ``str`` equal to its config spelling (``NormMode.EXACT == "exact"``), prints as
it (``f"{NormMode.EXACT}"`` is ``exact``) and is named by it too: OmegaConf writes an enum
member by its name when it prints or saves a config (``torchtune_config.yaml``), so the names
are the config spellings and that file reads back. The upper-case aliases are the names code
uses; they are the same members (``NormMode.EXACT is NormMode.exact``).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar


class Option(str, Enum):
    """A knob's value; see the module docstring."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class NormMode(Option):
    """``loss_normalization``: how micro-batch losses are weighted; see [baseline modes] in
    exactga.accumulation.normalization."""

    exact = "exact"
    post_scale = "post_scale"
    naive = "naive"
    EXACT, POST_SCALE, NAIVE = exact, post_scale, naive


class MicroBatching(Option):
    """``micro_batching``: how a window's samples are split; see [micro-batching modes] in
    exactga.data.micro_batching."""

    fixed = "fixed"
    by_length = "by_length"
    token_budget = "token_budget"
    packed = "packed"
    FIXED, BY_LENGTH, TOKEN_BUDGET, PACKED = fixed, by_length, token_budget, packed


class RankBalancing(Option):
    """``rank_balancing``: how a window's samples are dealt to the data-parallel ranks; see
    [balanced ranks are exact] in exactga.data.rank_balancing."""

    none = "none"
    by_tokens = "by_tokens"
    NONE, BY_TOKENS = none, by_tokens


class MasterWeights(Option):
    """``master_weights``: the precision of trainable weights, gradients and optimizer state
    under ``dtype: bf16``. See [fp32 master weights] in exactga.runtime.precision."""

    fp32 = "fp32"
    none = "none"
    FP32, NONE = fp32, none


class NonFinitePolicy(Option):
    """``nonfinite_loss``: what a step whose loss is NaN or inf does. See [non-finite loss] in
    exactga.accumulation.step."""

    skip = "skip"
    stop = "stop"
    SKIP, STOP = skip, stop


class SequenceLogProb(Option):
    """``sequence_log_prob``: a DPO response's log-prob from its tokens', their sum (stock) or
    their mean (length-normalised, as IPO and SimPO take it); see [length-normalised log-probs
    are per pair] in exactga.dpo.preference."""

    sum = "sum"
    mean = "mean"
    SUM, MEAN = sum, mean


class GradientSync(Option):
    """``gradient_sync``: when FSDP reduces gradients under accumulation; see [gradient sync
    policy] in exactga.runtime.distributed."""

    every_micro_batch = "every_micro_batch"
    once_per_window = "once_per_window"
    EVERY_MICRO_BATCH, ONCE_PER_WINDOW = every_micro_batch, once_per_window


# ``loss_aggregation``: what the GRPO policy loss is a mean over, by veRL's names (its
# ``loss_agg_mode``); see [policy aggregations] in exactga.grpo.policy. The names contain hyphens,
# so the enum is built from a list; exactga's earlier names stay as aliases (the same members):
# token_mean is token-mean, sequence_mean is seq-mean-token-mean, constant is
# seq-mean-token-sum-norm. Upper-case names are the code's, as for the other options.
LossAggregation = Option(
    "LossAggregation",
    [
        ("token-mean", "token-mean"),
        ("seq-mean-token-sum", "seq-mean-token-sum"),
        ("seq-mean-token-mean", "seq-mean-token-mean"),
        ("seq-mean-token-sum-norm", "seq-mean-token-sum-norm"),
        ("token-sum", "token-sum"),
        ("token_mean", "token-mean"),
        ("sequence_mean", "seq-mean-token-mean"),
        ("constant", "seq-mean-token-sum-norm"),
        ("TOKEN_MEAN", "token-mean"),
        ("SEQ_MEAN_TOKEN_SUM", "seq-mean-token-sum"),
        ("SEQ_MEAN_TOKEN_MEAN", "seq-mean-token-mean"),
        ("SEQ_MEAN_TOKEN_SUM_NORM", "seq-mean-token-sum-norm"),
        ("TOKEN_SUM", "token-sum"),
        ("SEQUENCE_MEAN", "seq-mean-token-mean"),
        ("CONSTANT", "seq-mean-token-sum-norm"),
    ],
    module=__name__,
)
LossAggregation.__doc__ = (
    "``loss_aggregation``: what the GRPO policy loss is a mean over; see [policy aggregations] "
    "in exactga.grpo.policy."
)


class KLEstimator(Option):
    """``loss.kl_estimator``: which per-token estimate of ``KL(policy || reference)`` a GRPO
    loss takes, from the sampled token's log-ratio ``x = logp - ref_logp`` (Schulman's k1, k2,
    k3); see exactga.grpo.losses."""

    k1 = "k1"  # x: unbiased, may be negative
    k2 = "k2"  # x^2 / 2: biased; its gradient is the reverse KL's
    k3 = "k3"  # exp(-x) + x - 1: unbiased, never negative (torchtune's GRPOLoss)
    K1, K2, K3 = k1, k2, k3


class RouterBalanceObjective(Option):
    """``router_balance``: which tokens a mixture-of-experts router's load-balancing term
    balances over; see [router balance as a loss term] in exactga.sft.router_balance."""

    micro_batch = "micro_batch"
    global_batch = "global_batch"
    MICRO_BATCH, GLOBAL_BATCH = micro_batch, global_batch


# Precisions the recipes train in (``dtype``, torchtune's names); fp16 needs loss scaling, which
# they lack. Strings, not an enum: torchtune's ``training.get_dtype`` reads them.
PRECISIONS = ("bf16", "fp32", "fp64")

OptionT = TypeVar("OptionT", bound=Option)


def bad_value(key: str, value: object, choices: tuple[object, ...] | list[object]) -> ValueError:
    """The one message for a config value outside its choices: the key, the value, the
    choices (as a config spells them: ``True``, ``auto``)."""
    listed = ", ".join(map(str, choices))
    return ValueError(f"config key '{key}'={value!r}: choose one of {listed}.")


def as_option(option: type[OptionT], value: object, key: str) -> OptionT:
    """``value`` (a member of ``option`` or its config spelling) as the member.

    ``validate_config`` checks every knob with it; library entry points that also take the
    config spelling (``Precision.from_config``, ``LossNormalizer``) convert with it.

    Raises:
        ValueError: ``value`` is neither, naming ``key`` and the choices (:func:`bad_value`).
    """
    if isinstance(value, option):
        return value
    if isinstance(value, str) and not isinstance(value, Enum):
        for member in option:
            if member.value == value:
                return member
        if value in option.__members__:  # an alias's name (a former spelling of a value)
            return option.__members__[value]
    raise bad_value(key, value, [member.value for member in option])
