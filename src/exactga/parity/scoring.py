"""Scoring a GA parity run: the splits it trains, and how far each lands from the full batch.

Distances are relative L2, ``||w - w_ref|| / ||w_ref - w_0||`` over every compared tensor
(:func:`relative_l2`): the difference between two trained models against how far training moved
the reference, so it does not depend on the learning rate or on the weights' scale. The test
suite measures its parity bounds with the same function.

A run is scored (:func:`summarize`) as soon as it has trained, on the rank that trained it, so
only its numbers travel to rank 0 and no rank holds more than three sets of trained weights (the
full-batch run's, below fp32 the fp32 full-batch run's, and the current run's).

Note [parity floor below fp32]
In fp32 an exact split differs from the full batch only in the order of its sums: about 1e-6
after 12 steps on the tiny configs, so ``parity.noise_floor`` (1e-5) separates it from any
weighting error (stock's ``post_scale`` lands 2e-3 to 1e-2 away there). In bf16 every run
carries its own rounding, and two runs of the same objective land 2.4e-3 (SGD) to 1.3e-2
(AdamW) apart (docs/precision.md): a fixed fp32 floor would call every bf16 run inexact, and a
fixed bf16 floor would hold for one optimizer, learning rate and length only. So below fp32 the
report also trains the full batch in fp32, from the same initial weights cast to fp32 and on the
same data, and takes the bf16 full batch's relative L2 to it, ``d``, as the size of bf16's
rounding on *this* config and run length. An exact split and the bf16 full batch are two
roundings of the same trajectory; were they independent, they would land ``sqrt(2) d`` apart.
The floor is ``2 d`` (:data:`PRECISION_FLOOR_FACTOR`; at least ``parity.noise_floor``): an
exact split under it costs less than the precision does. A weighting error larger than the
precision's rounding still shows above it (naive, 0.05 to 0.2, always does); one smaller
(``post_scale`` on a short run) may not, and that is the answer to "what does the split cost
in bf16": less than bf16 itself. Measured on the tiny config: docs/ga_parity.md, "Precision".

Which runs train is :func:`plan_runs`: every normalisation mode under ``fixed`` micro-batches,
and ``exact`` also under every other listed ``micro_batching`` (see [regrouping is exact] in
:mod:`exactga.data.micro_batching`: the baselines weight micro-batches by their split, so regrouping
would change what they optimise, and only ``fixed`` is theirs). A DPO config's ``naive`` also
trains under ``token_budget``, to show what that does to stock's weighting (see [stock dpo
weighting] in :mod:`exactga.parity.preference`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from exactga.config.options import MicroBatching, NormMode

MODE_ORDER = ("naive", "post_scale", "exact")
MODE_LABELS = {
    "naive": "naive (mean of means)",
    "post_scale": "post_scale (stock)",
    "exact": "exact",
}
MICRO_BATCHING_ORDER = tuple(m.value for m in MicroBatching)  # fixed, by_length, token_budget
SPLITS_KEY = "parity.splits"
# Below fp32, the verdict's floor over the full batch's distance to fp32; see
# [parity floor below fp32].
PRECISION_FLOOR_FACTOR = 2.0
# The variant of the runs trained without the router's balance term beside those with it;
# see [router term in the parity report] in exactga.parity.report.
ROUTER_TERM_OFF = "no router term"


@dataclass(frozen=True)
class Split:
    """``batch_size x gradient_accumulation_steps x data-parallel ranks``.

    Written ``"BxG"`` (one device) or ``"BxGxN"`` (N ranks) in config; its global batch, the
    sequences of one optimizer step over every rank, is ``B * G * N``.
    """

    batch_size: int
    ga: int
    num_ranks: int = 1

    @classmethod
    def parse(cls, text: str) -> Split:
        """Read ``"BxG"`` or ``"BxGxN"``, naming ``parity.splits`` if it is neither."""
        try:
            numbers = [int(part) for part in str(text).strip().lower().split("x")]
        except ValueError:
            numbers = []
        if len(numbers) not in (2, 3):
            raise ValueError(
                f"config key '{SPLITS_KEY}': {text!r} is not 'BxG' or 'BxGxN' (batch size x "
                "accumulation steps, optionally x data-parallel ranks)."
            )
        if min(numbers) < 1:
            raise ValueError(f"config key '{SPLITS_KEY}': {text!r} needs every number >= 1.")
        return cls(*numbers)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.ga * self.num_ranks

    def __str__(self) -> str:
        if self.num_ranks == 1:
            return f"{self.batch_size}x{self.ga}"
        return f"{self.batch_size}x{self.ga}x{self.num_ranks}"


def parse_splits(texts: Iterable[str], world_size: int) -> list[Split]:
    """The ``parity.splits`` of a launch with ``world_size`` processes, checked.

    A split runs on one device (``N = 1``) or data-parallel over every process of the launch
    (``N = world_size``): anything else would leave ranks idle inside a collective.

    Raises:
        ValueError: naming ``parity.splits``, for an empty list, a split listed twice, an
            ``N`` that is neither 1 nor the number of processes, or different global batches.
    """
    splits = [Split.parse(text) for text in texts]
    if not splits:
        raise ValueError(f"config key '{SPLITS_KEY}' is empty; list at least one split.")
    duplicates = sorted({str(s) for s in splits if splits.count(s) > 1})
    if duplicates:
        raise ValueError(f"config key '{SPLITS_KEY}' lists {', '.join(duplicates)} twice.")
    for split in splits:
        if split.num_ranks in (1, world_size):
            continue
        if world_size == 1:
            raise ValueError(
                f"config key '{SPLITS_KEY}': {split} trains over {split.num_ranks} data-parallel "
                "ranks, but the recipe runs in one process; launch it with "
                f"'tune run --nproc_per_node {split.num_ranks} recipes/ga_parity.py ...'."
            )
        raise ValueError(
            f"config key '{SPLITS_KEY}': {split} trains over {split.num_ranks} data-parallel "
            f"ranks, but this launch has {world_size} processes; a split runs on one device "
            f"(BxG) or over all of them (BxGx{world_size})."
        )
    global_batches = {s.global_batch for s in splits}
    if len(global_batches) != 1:
        raise ValueError(
            f"config key '{SPLITS_KEY}': every split must hold the same global batch "
            f"(B*G*N), got {sorted(global_batches)}."
        )
    return splits


def plan_runs(
    modes: Iterable[NormMode],
    micro_batchings: Iterable[MicroBatching],
    splits: Iterable[Split],
    reference: Split,
    baseline_micro_batchings: Iterable[MicroBatching] = (MicroBatching.FIXED,),
) -> list[tuple[NormMode, MicroBatching, Split]]:
    """The runs besides the full-batch ``reference``, as (mode, micro_batching, split).

    Baselines train ``fixed``, and each listed ``micro_batching`` that is also among
    ``baseline_micro_batchings`` (for DPO ``token_budget``; see
    GaParityConfig.baseline_micro_batchings) on one device; ``exact`` each listed
    ``micro_batching``; every split each. The reference split under
    ``fixed`` is the reference itself and is not trained again; under ``by_length`` or
    ``token_budget`` it is a run of its own (``token_budget`` cuts the one large micro-batch by
    the budget).
    """
    micro_batchings = list(micro_batchings)
    splits = list(splits)
    regrouping = [m for m in baseline_micro_batchings if m is not MicroBatching.FIXED]
    baselines = [MicroBatching.FIXED, *(m for m in micro_batchings if m in regrouping)]
    plan = []
    for mode in modes:
        listed = micro_batchings if mode is NormMode.EXACT else baselines
        for micro_batching in listed:
            for split in splits:
                if split == reference and micro_batching is MicroBatching.FIXED:
                    continue
                # Across ranks token_budget runs fillers, which weigh 0 only under exact.
                regrouped_baseline = mode is not NormMode.EXACT and micro_batching in regrouping
                if regrouped_baseline and split.num_ranks > 1:
                    continue
                plan.append((mode, micro_batching, split))
    return plan


@dataclass
class ParityRun:
    """One trained run: its per-step window losses and loss units (loss tokens, or pairs for
    DPO), its final weights, and what it processed, summed over its steps and ranks:
    micro-batches (fillers included), positions (padding and fillers included), the samples'
    own positions, and the fewest and most units a micro-batch held (fillers excluded).

    ``weights`` is empty on the ranks that did not gather a sharded run's weights.
    """

    mode: str
    micro_batching: str
    split: str
    losses: list[float]
    units: list[int]
    weights: dict[str, torch.Tensor]
    num_micro_batches: int
    num_positions: int
    num_sample_positions: int
    units_per_micro_batch: tuple[int, int] = (0, 0)
    units_name: str = "loss_tokens"  # as the window names them: loss_tokens, pairs
    # A loss of several terms: each step's term means (the token loss's first), their units'
    # names after the first (router_micro_batches, chosen_tokens); empty for one mean.
    term_losses: list[tuple[float, ...]] = field(default_factory=list)
    term_names: tuple[str, ...] = ()
    # What sets the run apart beyond mode, micro-batching and split: ROUTER_TERM_OFF for the
    # runs trained without the router's balance term beside those with it; "" otherwise.
    variant: str = ""


@dataclass(frozen=True)
class RunSummary:
    """What the report shows of one run; small enough to send between ranks."""

    mode: str
    micro_batching: str
    split: str
    relative_l2: float
    max_loss_gap: float
    losses: tuple[float, ...]
    num_micro_batches: int
    num_positions: int
    num_sample_positions: int
    relative_l2_to_fp32: float | None = None  # below fp32: to the fp32 full batch
    units_per_micro_batch: tuple[int, int] = (0, 0)  # the fewest and most (ParityRun's)
    term_names: tuple[str, ...] = ()  # ParityRun's
    term_losses: tuple[tuple[float, ...], ...] = ()  # ParityRun's, per step
    max_term_gaps: tuple[float, ...] = ()  # each term's max_loss_gap, the token loss's first
    variant: str = ""  # ParityRun's

    @property
    def label(self) -> str:
        """``mode/micro_batching``, e.g. ``exact/by_length``, and the variant, if any: a run
        is this and its split."""
        label = f"{self.mode}/{self.micro_batching}"
        return f"{label} ({self.variant})" if self.variant else label

    @property
    def micro_batches_per_step(self) -> float:
        """Forwards and backwards one rank runs per optimizer step, on average."""
        num_ranks = Split.parse(self.split).num_ranks
        return self.num_micro_batches / (max(len(self.losses), 1) * num_ranks)

    @property
    def padding_fraction(self) -> float:
        """Share of the processed positions that were padding (or fillers)."""
        return 1 - self.num_sample_positions / self.num_positions if self.num_positions else 0.0


def relative_l2(
    weights: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    initial: Mapping[str, torch.Tensor],
) -> float:
    """``||w - w_ref|| / ||w_ref - w_init||`` over all tensors, in float64.

    Raises:
        ValueError: the runs hold different tensors, or the reference did not move.
    """
    if weights.keys() != reference.keys() or reference.keys() - initial.keys():
        raise ValueError("the runs compare different tensors")
    diff_sq = moved_sq = 0.0
    for name, ref in reference.items():
        ref = ref.double()
        diff_sq += float(((weights[name].double() - ref) ** 2).sum())
        moved_sq += float(((ref - initial[name].double()) ** 2).sum())
    if moved_sq == 0.0:
        raise ValueError("the reference run did not move the weights; raise the learning rate.")
    return math.sqrt(diff_sq / moved_sq)


def max_loss_gap(losses: list[float], reference: list[float]) -> float:
    """Largest absolute difference of the logged window losses, step by step.

    A skipped window (no loss token) has a NaN loss in every run and no gap.
    """
    gaps = [
        abs(a - b)
        for a, b in zip(losses, reference, strict=True)
        if not (math.isnan(a) or math.isnan(b))
    ]
    return max(gaps, default=0.0)


@dataclass(frozen=True)
class PrecisionView:
    """What the runs trained in, and the floor that sets for the verdict.

    ``reference_to_fp32`` is the relative L2 of the full-batch run to the fp32 full-batch run
    (both from the same initial weights), what the precision costs; ``None`` when the runs are
    fp32 or wider and no fp32 reference was trained. See [parity floor below fp32].
    """

    dtype: str
    master_weights: str
    noise_floor: float
    reference_to_fp32: float | None = None

    @property
    def below_fp32(self) -> bool:
        return self.reference_to_fp32 is not None

    @property
    def floor(self) -> float:
        """Relative L2 to the same-precision full batch an exact run may land at."""
        if self.reference_to_fp32 is None:
            return self.noise_floor
        return max(self.noise_floor, PRECISION_FLOOR_FACTOR * self.reference_to_fp32)

    @property
    def floor_name(self) -> str:
        return f"{self.dtype} floor" if self.below_fp32 else "fp32 floor"

    def describe(self) -> str:
        """For the report: ``dtype`` and what ``master_weights`` made of it."""
        if not self.below_fp32:
            return f"`dtype: {self.dtype}`"
        kept = (
            f"trainable weights, gradients and optimizer state in fp32, compute in {self.dtype}"
            if self.master_weights == "fp32"
            else f"everything in {self.dtype}"
        )
        return f"`dtype: {self.dtype}`, `master_weights: {self.master_weights}` ({kept})"


def summarize(
    run: ParityRun,
    reference: ParityRun,
    initial: dict[str, torch.Tensor],
    fp32_reference: ParityRun | None = None,
    compared_steps: int | None = None,
) -> RunSummary:
    """Score ``run`` against the full-batch ``reference``, and the fp32 full batch
    ``fp32_reference`` where there is one, all started from ``initial``. The runs' loss units
    are checked equal over every step, or over the first ``compared_steps`` (GRPO's first
    rollout step: see [grpo parity] in exactga.parity.grpo)."""
    # Equal counts per step mean every split saw the same global batches as the reference;
    # a difference is a bug in how the data was split, not a numerical effect.
    assert run.units[:compared_steps] == reference.units[:compared_steps], (
        f"{run.mode}/{run.micro_batching} {run.split} saw {run.units_name} {run.units} per "
        f"step, the full batch {reference.units}: the runs did not train on the same global "
        "batches."
    )
    return RunSummary(
        mode=run.mode,
        micro_batching=run.micro_batching,
        split=run.split,
        relative_l2=relative_l2(run.weights, reference.weights, initial),
        max_loss_gap=max_loss_gap(run.losses, reference.losses),
        losses=tuple(run.losses),
        num_micro_batches=run.num_micro_batches,
        num_positions=run.num_positions,
        num_sample_positions=run.num_sample_positions,
        relative_l2_to_fp32=(
            relative_l2(run.weights, fp32_reference.weights, initial)
            if fp32_reference is not None
            else None
        ),
        units_per_micro_batch=run.units_per_micro_batch,
        term_names=run.term_names,
        term_losses=tuple(run.term_losses),
        max_term_gaps=term_gaps(run, reference),
        variant=run.variant,
    )


def term_gaps(run: ParityRun, reference: ParityRun) -> tuple[float, ...]:
    """Each term's :func:`max_loss_gap` to the reference's same term, the token loss's first;
    empty unless both trained the same terms."""
    if not run.term_losses or run.term_names != reference.term_names:
        return ()
    by_term = list(zip(*run.term_losses, strict=True))
    reference_by_term = list(zip(*reference.term_losses, strict=True))
    return tuple(
        max_loss_gap(list(ours), list(theirs))
        for ours, theirs in zip(by_term, reference_by_term, strict=True)
    )


def split_legend(summaries: Iterable[RunSummary]) -> str:
    """How the splits read: with a ranks factor only when some split has one (``BxGxN``)."""
    if any(s.split.count("x") == 2 for s in summaries):
        return "bsz x ga x ranks"
    return "bsz x ga"


def verdict(summaries: list[RunSummary], precision: PrecisionView) -> str:
    """One line: is every exact-mode run, under every micro-batching, within the floor of
    ``precision`` (see [parity floor below fp32]), and how far are the others."""
    exact = [s for s in summaries if s.mode == "exact"]
    if any(s.variant == ROUTER_TERM_OFF for s in exact):
        # The router's balance term depends on the split by definition; the verdict is on the
        # token loss, trained alone (see [router term in the parity report]).
        exact = [s for s in exact if s.variant == ROUTER_TERM_OFF]
        summaries = [s for s in summaries if s.mode != "exact" or s in exact]
    if not exact:
        return "No exact-mode run was requested, so no verdict on exactness."
    worst = max(exact, key=lambda s: s.relative_l2)
    micro_batchings = ", ".join(
        m for m in MICRO_BATCHING_ORDER if any(s.micro_batching == m for s in exact)
    )
    scope = f"every exact-mode run ({micro_batchings} micro-batches)"
    if any(s.variant == ROUTER_TERM_OFF for s in exact):
        scope = f"every exact-mode run without the router's balance term ({micro_batchings})"
    others = [s for s in summaries if s.mode != "exact"]
    contrast = ""
    if others:
        far = max(others, key=lambda s: s.relative_l2)
        contrast = (
            f"; {far.label} {far.split} is {far.relative_l2:.2e} "
            f"({far.relative_l2 / max(worst.relative_l2, 1e-30):.0f}x further)"
        )
    floor, name = precision.floor, precision.floor_name
    bound = f"{floor:.0e}"
    if precision.below_fp32:
        bound = (
            f"{floor:.2e}, {PRECISION_FLOOR_FACTOR:g}x the {precision.dtype} full batch's own "
            f"distance to the fp32 full batch, {precision.reference_to_fp32:.2e}"
        )
    full_batch = "the full-batch run"
    if precision.below_fp32:
        full_batch = f"the {precision.dtype} full-batch run"
    if worst.relative_l2 <= floor:
        tail = ": the split costs less than the precision" if precision.below_fp32 else ""
        return (
            f"EXACT: {scope} is within the {name} of {full_batch} (worst relative L2 "
            f"{worst.relative_l2:.2e}, {worst.label} {worst.split}, <= {bound}){tail}"
            f"{contrast}."
        )
    return (
        f"NOT EXACT: {worst.label} {worst.split} is {worst.relative_l2:.2e} from {full_batch}, "
        f"above the {name} {bound}{contrast}. Check the loss, the dataset's masking and the "
        "config."
    )


def sorted_runs(summaries: list[RunSummary]) -> list[RunSummary]:
    """By mode, then micro-batching; stable, so the splits stay as listed."""
    return sorted(
        summaries,
        key=lambda s: (
            MODE_ORDER.index(s.mode),
            MICRO_BATCHING_ORDER.index(s.micro_batching),
            s.variant,
        ),
    )
