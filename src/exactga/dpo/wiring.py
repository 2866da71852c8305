"""What a preference recipe's step reads, wired in one call (:func:`preference_run`): the
reference (as given, or its log-probs computed once), KTO's reference point over each whole
window, the normaliser over the terms' units and the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from exactga.accumulation.normalization import LossNormalizer
from exactga.dpo.kto import KtoReferencePoint
from exactga.dpo.log_probs import Reference
from exactga.dpo.metrics import PreferenceMetrics
from exactga.dpo.preference import collate_pairs
from exactga.dpo.reference_logprobs import with_precomputed_reference
from exactga.dpo.terms import DpoTerms
from exactga.runtime.precision import Precision
from exactga.runtime.runtime import Runtime

if TYPE_CHECKING:
    from exactga.dpo.schema import (
        FullDpoDistributedConfig,
        LoraDpoDistributedConfig,
        LoraDpoSingleDeviceConfig,
    )

    # The typed settings of the three DPO recipes.
    DpoSettings = LoraDpoSingleDeviceConfig | LoraDpoDistributedConfig | FullDpoDistributedConfig


def reference_point_for(
    terms: DpoTerms, model: nn.Module, reference: Any, precision: Precision | None = None
) -> Any:
    """KTO's reference point of each window (exactga.dpo.kto.KtoReferencePoint), a window
    statistic the normaliser computes before the window's backward passes; None for a loss
    over pairs."""
    if not terms.unpaired:
        return None
    return KtoReferencePoint(model, reference, precision)


def reference_for_run(
    reference: Any,
    dataset: Any,
    cfg: DpoSettings,
    *,
    pad_id: int,
    device: torch.device,
    dp_group: dist.ProcessGroup | None = None,
) -> tuple[Any, Any]:
    """What the loss step reads the reference from, and the dataset to load: ``reference``
    and ``dataset`` as they are, or with the config's ``precompute_reference_logprobs`` a
    table of every pair's reference log-probs, computed once over ``cfg.batch_size`` pairs at
    a time, and the dataset its pairs are looked up from (see [precomputed reference] in
    exactga.dpo.reference_logprobs). The caller drops its other handles on the reference
    model, so that the table frees it."""
    if reference is None or not cfg.precompute_reference_logprobs:
        return reference, dataset  # a reference-free loss has nothing to precompute
    return with_precomputed_reference(
        reference,
        dataset,
        collate=partial(collate_pairs, padding_idx=pad_id),
        batch_size=cfg.batch_size,
        device=device,
        dp_group=dp_group,
    )


@dataclass
class PreferenceRun:
    """What a preference recipe's step reads, wired in one place (:func:`preference_run`):
    a recipe copy that rewires one of these by hand would train a different loss silently."""

    reference: Any  # what the loss reads reference log-probs from; None when reference-free
    reference_point: Any  # KTO's window statistic (exactga.dpo.kto), None for a loss over pairs
    normalizer: LossNormalizer  # each term weighed by its own units over the window and ranks
    metrics: PreferenceMetrics
    dataset: Any  # the dataset to load: with a precomputed reference, the table's lookup rows


def preference_run(
    cfg: DpoSettings,
    loss_fn: nn.Module,
    terms: DpoTerms,
    dataset: Any,
    *,
    model: nn.Module,
    reference: Reference | None,
    pad_id: int,
    runtime: Runtime,
) -> PreferenceRun:
    """The reference (``reference`` as given, or its log-probs computed once with
    ``precompute_reference_logprobs``), KTO's reference point over each whole window, the
    normaliser over ``terms``' units (counted over ``runtime``'s count group) and the
    metrics, for ``loss_fn`` on ``dataset``.

    ``reference`` is None for a reference-free loss (``terms.reference_free``): the recipe
    then builds no reference model at all. The caller drops its own handles on the reference
    model, so that a precomputed table frees it.
    """
    reference, dataset = reference_for_run(
        reference, dataset, cfg, pad_id=pad_id, device=runtime.device, dp_group=runtime.dp_group
    )
    reference_point = reference_point_for(terms, model, reference, runtime.precision)
    normalizer = LossNormalizer(
        loss_fn,
        mode=cfg.loss_normalization,
        dp_group=runtime.count_group,
        units=terms.units(),
        statistics=[reference_point] if reference_point else [],  # computed before backward
    )
    metrics = PreferenceMetrics(runtime.device, terms, reference_point)
    return PreferenceRun(reference, reference_point, normalizer, metrics, dataset)
