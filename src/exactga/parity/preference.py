"""The GA parity report on a DPO config: its pairs, its reference, and what its baseline means.

A config whose ``loss`` weighs pairs (torchtune's ``DPOLoss`` or ``RSOLoss``; see
``GaParityConfig.is_preference``) trains every run as the DPO recipes do: windows of preference
pairs collated by ``exactga.dpo.preference.collate_pairs``, counted in pairs by ``PreferencePairs``
through the one normaliser, and the loss step ``exactga.dpo.loss.dpo_micro_batch_loss`` (see [pairs
as loss units] in exactga.dpo.preference). LoRA DPO's reference is each run's policy with its
adapters off; full DPO's is a frozen copy of ``model`` with the weights of ``ref_checkpointer``,
built once in ``dtype`` on one device and once sharded like the policy for the ``BxGxN`` runs
(``exactga.parity.runs.FrozenModels``), so every run
(the fp32 full batch too, below fp32) scores its pairs against the same reference log-probs.

Note [stock dpo weighting]
Stock torchtune 0.6.1's DPO recipes divide each micro-batch's mean loss over its pairs by
``gradient_accumulation_steps``: the ``naive`` mode. With ``B_m`` pairs in micro-batch ``m`` of
``M`` and ``P = sum_m B_m``, naive steps on the gradient of ``sum_m mean_m / M``, exact on that of
``sum_m B_m mean_m / P``: the same whenever every ``B_m`` is ``P / M``. A pair is one unit whatever
its length, so ``fixed`` and ``by_length`` micro-batches of a full window, ``batch_size`` pairs
each, leave stock's DPO exact up to rounding however the pairs' lengths differ (lengths are what
move stock fine-tuning's token weighting). It is not exact where micro-batches hold different
numbers of pairs: ``token_budget``'s, cut by padded positions (one long pair alone, several short
ones together), and stock's own epoch-end partial window, whose ``k < ga`` micro-batches it divides
by ``ga`` and carries into the next epoch's first step. The report trains full windows only, so it
cannot show the second; for a DPO config ``naive`` also trains under ``token_budget``
(``GaParityConfig.baseline_micro_batchings``), which shows the first, on one device only: across
ranks ``token_budget`` runs zero-weight fillers where a rank has fewer micro-batches, and only
exact's weighting leaves them at zero (naive would weigh one as much as a micro-batch of pairs).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from exactga.accumulation.loss_units import Batch
from exactga.config.schemas import TrainingRunConfig
from exactga.data.rows import is_preference_sample
from exactga.dpo.log_probs import frozen_model_reference, lora_reference
from exactga.dpo.loss import dpo_micro_batch_loss
from exactga.dpo.schema import PAIR_COLLATE, loss_is_reference_free
from exactga.dpo.terms import DpoTerms
from exactga.dpo.wiring import reference_point_for
from exactga.parity.schema import GaParityConfig
from exactga.parity.scoring import ParityRun, RunSummary, sorted_runs
from exactga.runtime.distributed import is_rank_zero
from exactga.runtime.precision import Precision


def collate_fn_for(collate_fn: str | None, is_preference: bool) -> str:
    """The config's ``collate_fn``, or where it is null the default of the recipe it is for:
    torchtune's ``padded_collate_sft``, or ``collate_pairs`` for DPO.

    Raises:
        ValueError: naming ``collate_fn``, for a DPO config's collate that does not stack pairs.
    """
    if collate_fn is None:
        return PAIR_COLLATE if is_preference else TrainingRunConfig.collate_fn
    if is_preference and not collate_fn.endswith("collate_pairs"):
        raise ValueError(
            f"config key 'collate_fn'={collate_fn}: DPO micro-batches stack each pair's chosen "
            f"and rejected rows; use {PAIR_COLLATE}, or remove the key."
        )
    return collate_fn


def check_preference_keys(cfg: GaParityConfig, *, is_preference: bool, is_lora: bool) -> None:
    """``ref_checkpointer`` is full DPO's and needed there unless the loss is reference-free
    (SimPO, ORPO); a DPO config distils no teacher.

    Raises:
        ValueError: naming the keys.
    """
    if is_preference and cfg.teacher_model is not None:
        raise ValueError(
            "config keys 'teacher_model' and 'loss': the report trains a distillation or a "
            "preference loss, not both; remove teacher_model or use a token loss."
        )
    reference_free = is_preference and loss_is_reference_free(cfg)
    if is_preference and not is_lora and not reference_free and cfg.ref_checkpointer is None:
        raise ValueError(
            "config key 'ref_checkpointer' is needed for full DPO: the reference's weights "
            "(as recipes/full_dpo_distributed.py reads them; LoRA DPO needs none)."
        )
    unread = is_lora or not is_preference or reference_free
    if cfg.ref_checkpointer is not None and unread and is_rank_zero():
        why = "LoRA DPO's reference is the base model" if is_preference else "no preference loss"
        why = "the loss is reference-free" if reference_free else why
        warnings.warn(f"config key 'ref_checkpointer' ignored: {why}.", stacklevel=2)


def check_pairs(dataset: Any, is_preference: bool, loss_name: str) -> None:
    """The dataset gives preference pairs exactly when the loss weighs them.

    Raises:
        ValueError: naming ``loss`` and ``dataset``.
    """
    if len(dataset) == 0 or is_preference_sample(dataset[0]) == is_preference:
        return
    if is_preference:
        raise ValueError(
            f"config keys 'loss' and 'dataset': {loss_name} weighs preference pairs, but the "
            "dataset gives single sequences; use a preference dataset (e.g. "
            "torchtune.datasets.preference_dataset)."
        )
    raise ValueError(
        f"config keys 'loss' and 'dataset': the dataset gives preference pairs, but {loss_name} "
        "is a token loss; train pairs with torchtune.rlhf.loss.DPOLoss (or RSOLoss)."
    )


class PreferenceStep(NamedTuple):
    """The DPO recipes' loss step for one run, and the window statistics it reads (KTO's
    reference point; none for a loss over pairs), for the run's normaliser."""

    loss_step: Callable[[Batch], torch.Tensor]
    statistics: tuple[Any, ...]


def preference_loss_step(
    model: nn.Module,
    loss_fn: nn.Module,
    precision: Precision,
    ref_model: nn.Module | None = None,
    terms: DpoTerms | None = None,
) -> PreferenceStep:
    """The DPO recipes' loss step for ``model``: against the frozen ``ref_model`` (full DPO) or,
    without one, ``model`` with its adapters off (LoRA DPO); with no reference at all for a
    reference-free loss (``terms.reference_free``); KTO's against its window's reference point
    (see [kto reference point] in exactga.dpo.kto)."""
    if terms is not None and terms.reference_free:
        reference = None
    elif ref_model is None:
        reference = lora_reference(model, precision)
    else:
        reference = frozen_model_reference(ref_model, precision)
    reference_point = None if terms is None else reference_point_for(terms, model, reference)
    loss_step = partial(
        dpo_micro_batch_loss,
        model,
        loss_fn,
        reference=reference,
        terms=terms,
        precision=precision,
        reference_point=reference_point,
    )
    return PreferenceStep(loss_step, () if reference_point is None else (reference_point,))


# ---------------------------------------------------------------------------------------------
# What the report says of a DPO config.


@dataclasses.dataclass(frozen=True)
class Preference:
    """What a DPO config trains, for the report to say."""

    loss: str  # the loss's class, e.g. DPOLoss
    reference: str  # what the reference log-probs come from
    units: str = "pairs"  # what the loss is a mean over, as the window names them

    @classmethod
    def of(cls, loss_fn: nn.Module, is_lora: bool, terms: DpoTerms | None = None) -> Preference:
        reference = "the policy with its adapters off"
        if not is_lora:
            reference = "a frozen copy of `model` with the weights of `ref_checkpointer`"
        if terms is not None and terms.reference_free:
            reference = "none (a reference-free loss: no reference model is built or run)"
        units = "pairs" if terms is None else _units_of(terms)
        return cls(loss=type(loss_fn).__name__, reference=reference, units=units)

    def describe(self) -> str:
        return (
            f"**Objective: direct preference optimisation.** Every run trains `{self.loss}` on "
            f"preference data with the DPO recipes' loss step, the reference being "
            f"{self.reference}. The loss units are {self.units}: exact weighs each "
            "micro-batch's mean by its units over the window's; `naive` is stock torchtune "
            "0.6.1's DPO weighting (each micro-batch's mean divided by the number of "
            "micro-batches). There is no `post_scale`, a token weighting."
        )

    def baselines(self) -> str:
        """How the baselines train, in place of the fine-tuning report's sentence."""
        return (
            "The baseline runs fixed micro-batches, and token_budget ones too: their "
            "micro-batches hold different numbers of pairs, the one grouping where stock DPO's "
            "weighting is not exact (see below)."
        )

    def gap_section(self, reference: ParityRun, summaries: list[RunSummary]) -> str:
        """When stock's DPO weighting (``naive``) differs from exact, and the pairs per
        micro-batch of this config's naive runs. See [stock dpo weighting]."""
        naive = [s for s in sorted_runs(summaries) if s.mode == "naive"]
        unit = self.units.split(" and ")[0]  # pairs, or KTO's examples
        lines = [
            f"- `{s.label}` {s.split}: {_count(s.units_per_micro_batch, unit)} per micro-batch"
            f"{'' if _equal(s) else ', unequal'}; relative L2 {s.relative_l2:.2e}"
            for s in naive
        ]
        if not naive:
            here = "no naive run was requested."
        elif " and " in self.units:  # a term over the chosen tokens: RPO's, ORPO's NLL
            here = (
                "the loss has a term over the chosen tokens, whose number differs between "
                "micro-batches of as many pairs (the responses' lengths differ), so naive is "
                "off under every grouping; see [chosen tokens as the NLL's units] in "
                "exactga.dpo.preference."
            )
        elif all(_equal(s) for s in naive):
            here = f"every naive micro-batch held as many {unit}, so naive sits with exact."
        else:
            here = f"naive's gap shows where its micro-batches held unequal numbers of {unit}."
        pairs = reference.units[0] if reference.units else 0
        return "\n\n".join(
            [
                "## Where stock DPO's gap comes from",
                "Stock torchtune 0.6.1's DPO recipes (`naive`) divide each micro-batch's mean "
                "loss over its pairs by the number of micro-batches, where exact weighs it by its "
                "pairs over the window's. They agree whenever every micro-batch of a window holds "
                "as many pairs: `fixed` and `by_length` micro-batches of a full window do, so "
                "stock's DPO is exact there up to rounding, whatever the pairs' lengths. They "
                "differ when micro-batches hold different numbers of pairs: `token_budget`'s "
                "(cut by padded positions: one long pair alone, several short ones together), "
                "and stock's own epoch-end partial window, whose micro-batches it divides by "
                "`gradient_accumulation_steps` and carries into the next epoch's first step "
                "(the report trains full windows only, so it does not show that one). See "
                "[stock dpo weighting] in exactga.parity.preference.",
                f"**This config's runs** ({pairs} {unit} a step): {here}",
                *(["\n".join(lines)] if lines else []),
            ]
        )

    def as_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def _units_of(terms: DpoTerms) -> str:
    """The loss's units in words: pairs (and the chosen tokens of an NLL term), or examples."""
    units = terms.units()
    return " and ".join((units.name, *getattr(units, "term_names", ())))


def _equal(summary: RunSummary) -> bool:
    fewest, most = summary.units_per_micro_batch
    return fewest == most


def _count(bounds: tuple[int, int], unit: str = "pairs") -> str:
    fewest, most = bounds
    if fewest == most:
        return f"{most} {unit if most != 1 else unit.removesuffix('s')}"
    return f"{fewest} to {most} {unit}"
