"""Scoring a GA parity run: the splits it trains, and how far each lands from the full batch.

Distances are relative L2, ``||w - w_ref|| / ||w_ref - w_0||`` over every compared tensor
(:func:`relative_l2`): the difference between two trained models against how far training moved
the reference, so it does not depend on the learning rate or on the weights' scale. The test
suite measures its parity bounds with the same function.

A run is scored (:func:`summarize`) as soon as it has trained, on the rank that trained it, so
only its numbers travel to rank 0 and no rank holds more than two sets of trained weights (the
full-batch run's and the current run's).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

MODE_ORDER = ("naive", "post_scale", "exact")
MODE_LABELS = {
    "naive": "naive (mean of means)",
    "post_scale": "post_scale (stock)",
    "exact": "exact",
}
SPLITS_KEY = "parity.splits"


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


@dataclass
class ParityRun:
    """One trained run: its per-step window losses and loss-token counts, its final weights.

    ``weights`` is empty on the ranks that did not gather a sharded run's weights.
    """

    mode: str
    split: str
    losses: list[float]
    loss_tokens: list[int]
    weights: dict[str, torch.Tensor]


@dataclass(frozen=True)
class RunSummary:
    """What the report shows of one run; small enough to send between ranks."""

    mode: str
    split: str
    relative_l2: float
    max_loss_gap: float
    losses: tuple[float, ...]


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


def summarize(run: ParityRun, reference: ParityRun, initial: dict[str, torch.Tensor]) -> RunSummary:
    """Score ``run`` against the full-batch ``reference``, both started from ``initial``."""
    # Equal counts per step mean every split saw the same global batches as the reference;
    # a difference is a bug in how the data was split, not a numerical effect.
    assert run.loss_tokens == reference.loss_tokens, (
        f"{run.mode} {run.split} saw loss tokens {run.loss_tokens} per step, the full batch "
        f"{reference.loss_tokens}: the runs did not train on the same global batches."
    )
    return RunSummary(
        mode=run.mode,
        split=run.split,
        relative_l2=relative_l2(run.weights, reference.weights, initial),
        max_loss_gap=max_loss_gap(run.losses, reference.losses),
        losses=tuple(run.losses),
    )


def split_legend(summaries: Iterable[RunSummary]) -> str:
    """How the splits read: with a ranks factor only when some split has one (``BxGxN``)."""
    if any(s.split.count("x") == 2 for s in summaries):
        return "bsz x ga x ranks"
    return "bsz x ga"


def verdict(summaries: list[RunSummary], noise_floor: float) -> str:
    """One line: is every exact-mode split within the fp32 floor, and how far are the others."""
    exact = [s for s in summaries if s.mode == "exact"]
    if not exact:
        return "No exact-mode run was requested, so no verdict on exactness."
    worst = max(s.relative_l2 for s in exact)
    others = [s for s in summaries if s.mode != "exact"]
    contrast = ""
    if others:
        far = max(others, key=lambda s: s.relative_l2)
        contrast = (
            f"; {far.mode} {far.split} is {far.relative_l2:.2e} "
            f"({far.relative_l2 / max(worst, 1e-30):.0f}x further)"
        )
    if worst <= noise_floor:
        return (
            f"EXACT: every exact-mode split is within the fp32 floor of the full-batch run "
            f"(worst relative L2 {worst:.2e} <= {noise_floor:.0e}){contrast}."
        )
    return (
        f"NOT EXACT: an exact-mode split is {worst:.2e} from the full-batch run, above the fp32 "
        f"floor {noise_floor:.0e}{contrast}. Check the loss, the dataset's masking and the config."
    )


def sorted_by_mode(summaries: list[RunSummary]) -> list[RunSummary]:
    return sorted(summaries, key=lambda s: MODE_ORDER.index(s.mode))  # stable: splits as listed
