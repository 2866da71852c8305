"""How one accumulation window's samples are cut into micro-batches (``micro_batching``).

The data loader hands out windows of samples (``batch_size x gradient_accumulation_steps`` of
them on each rank), not pre-padded micro-batches; :class:`WindowCollator` decides the split and
collates each micro-batch with the config's ``collate_fn``. The loss normaliser then counts each
micro-batch's loss tokens on the host exactly as before. See [regrouping is exact].

Note [regrouping is exact]
With exact normalisation each micro-batch's mean loss is weighted by its share of the window's
loss tokens, so the window's gradient is the sum of every token's gradient over the window's
token count, whichever micro-batch a sample sits in. The split is then free to choose, and it
matters for speed: a micro-batch is padded to its longest row, so on variable-length data
random groups of ``batch_size`` pay for many padded positions. Sorting the window's samples by
length before cutting it keeps similar lengths together. The window, and so the optimizer step,
is the same set of samples as the loader's order gives; only floating-point rounding differs
(summation order), at the floor of the precision in use. The baselines (``post_scale``,
``naive``) weight micro-batches by something else than their token share, so for them the split
changes the step: they accept only ``fixed``.

Note [micro-batching modes]
- ``fixed``: micro-batches of ``batch_size`` samples in the loader's order (stock torchtune).
- ``by_length``: the window's samples sorted by length, longest first (a stable sort, so ties
  keep the loader's order and the split is deterministic), then cut into micro-batches of
  ``batch_size``. Longest first makes the first micro-batch of every window its largest, so a
  setting that does not fit fails at the first window holding a long sample (not whenever a
  random group happens to collect several), and under data parallelism every rank runs its long
  micro-batches at the same time.
- ``token_budget``: the same order, cut greedily into micro-batches of as many samples as fit
  ``micro_batch_tokens`` padded positions (samples x longest sample); a sample longer than the
  budget gets a micro-batch of its own. Memory per micro-batch is then flat, and a large
  ``batch_size`` with ``gradient_accumulation_steps: 1`` is split automatically.
- ``packed``: the window's samples placed first-fit decreasing into rows of
  ``micro_batch_tokens`` positions, each row one micro-batch of whole samples, packed with a
  document mask (exactga.data.packing, see [packed rows are exact]): no padding but each row's
  unfilled end, and one micro-batch shape. A sample longer than a row gets a row of its own.
With ``pad_to_multiple_of`` the padded modes round each micro-batch's sequence length up to a
multiple of it, which bounds the number of shapes a run compiles or plans kernels for.
An epoch's last window may hold fewer samples; it keeps whole micro-batches of ``batch_size``
in the loader's order (the samples stock torchtune's ``drop_last`` loader would give) before
any regrouping, so every mode steps on the same samples.

A preference pair is one sample of two rows (its chosen and its rejected sequence, collated as
rows of one micro-batch padded to the longest of all; see exactga.dpo.preference). Its length is
its longer side, which is what the padding of a micro-batch depends on, and its cost in the
budget is both rows: ``micro_batch_tokens`` bounds the ``2B x L`` positions the model runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from exactga.config.options import MicroBatching, as_option
from exactga.config.schemas import SingleDeviceRecipeConfig

Sample = Mapping[str, Any]
Collate = Callable[[list[Any]], dict[str, Any]]


@dataclass(frozen=True)
class MicroBatchingSettings:
    """The split of a window: its mode, micro-batch size and, for ``token_budget``, the budget."""

    mode: MicroBatching = MicroBatching.FIXED
    batch_size: int = 1
    micro_batch_tokens: int | None = None
    pad_to_multiple_of: int | None = None  # sequence lengths rounded up to a multiple of it

    def __post_init__(self) -> None:
        assert self.batch_size >= 1, f"batch_size must be positive, got {self.batch_size}"
        if self.by_budget:
            assert self.micro_batch_tokens, f"{self.mode} needs micro_batch_tokens"

    @property
    def by_budget(self) -> bool:
        """Whether the lengths decide how many micro-batches a window has (so ranks may differ)."""
        return self.mode in (MicroBatching.TOKEN_BUDGET, MicroBatching.PACKED)

    @classmethod
    def from_settings(
        cls, settings: SingleDeviceRecipeConfig, batch_size: int | None = None
    ) -> MicroBatchingSettings:
        """From a recipe's typed settings (``micro_batching``, ``micro_batch_tokens``,
        ``pad_to_multiple_of``; ``batch_size`` unless given): the one reader of these keys."""
        return cls(
            mode=as_option(MicroBatching, settings.micro_batching, "micro_batching"),
            batch_size=int(settings.batch_size if batch_size is None else batch_size),
            micro_batch_tokens=settings.micro_batch_tokens,
            pad_to_multiple_of=settings.pad_to_multiple_of,
        )


def plan_micro_batches(
    lengths: Sequence[int],
    settings: MicroBatchingSettings,
    rows_per_sample: int = 1,
    positions: Sequence[int] | None = None,
) -> list[list[int]]:
    """The micro-batches of a window whose samples have these ``lengths``, as sample indices.

    ``len(lengths)`` is a multiple of ``settings.batch_size`` (see :func:`whole_micro_batches`).
    A sample collates to ``rows_per_sample`` rows of its length (2 for a preference pair), or,
    packed, to its ``positions`` (a pair's two sides; default: ``lengths``).
    See [micro-batching modes].
    """
    indices = list(range(len(lengths)))
    if settings.mode is MicroBatching.FIXED:
        return _cut(indices, settings.batch_size)
    if settings.mode is MicroBatching.PACKED:
        assert settings.micro_batch_tokens is not None
        sizes = lengths if positions is None else positions
        return first_fit_decreasing(sizes, settings.micro_batch_tokens)
    longest_first = sorted(indices, key=lambda i: -lengths[i])  # stable: ties keep loader order
    if settings.mode is MicroBatching.BY_LENGTH:
        return _cut(longest_first, settings.batch_size)
    assert settings.micro_batch_tokens is not None
    return _fill_budget(longest_first, lengths, settings.micro_batch_tokens // rows_per_sample)


def _cut(indices: list[int], size: int) -> list[list[int]]:
    return [indices[start : start + size] for start in range(0, len(indices), size)]


def _fill_budget(longest_first: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Greedy packing of samples sorted longest first: a micro-batch's padded size is its
    sample count times its first (longest) sample's length."""
    groups: list[list[int]] = []
    for index in longest_first:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of at most ``capacity`` positions holding items of these ``sizes``, as item
    indices: items largest first (a stable sort, so ties keep their order), each into the
    first row with room for it; an item larger than ``capacity`` gets a row of its own. Rows
    come in the order they were opened, so the first holds the window's longest sample."""
    assert capacity >= 1, f"capacity must be positive, got {capacity}"
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        size = sizes[index]
        row = next((r for r, free in enumerate(room) if size <= free), None)
        if row is None:
            rows.append([index])
            room.append(max(capacity - size, 0))
        else:
            rows[row].append(index)
            room[row] -= size
    return rows


def whole_micro_batches(num_samples: int, batch_size: int) -> int:
    """How many of a window's ``num_samples`` samples are trained: whole micro-batches of
    ``batch_size`` (an epoch's last window may be short; see [micro-batching modes])."""
    return num_samples - num_samples % batch_size


def padded_positions(
    lengths: Sequence[int], groups: list[list[int]], rows_per_sample: int = 1
) -> int:
    """Positions the model processes for these micro-batches (each padded to its longest)."""
    return rows_per_sample * sum(len(group) * max(lengths[i] for i in group) for group in groups)


# Each preference pair's index in the dataset (added by exactga.dpo.reference_logprobs.IndexedPairs
# and stacked one entry per pair by the DPO collate), for the reference log-prob lookup.
PAIR_INDEX = "pair_index"


def is_pair(sample: Sample) -> bool:
    """Whether a sample is a preference pair (torchtune's ``PreferenceDataset`` layout)."""
    return "chosen_input_ids" in sample


def sample_length(sample: Sample) -> int:
    """The length a sample is padded by: its positions, or a pair's longer side."""
    if is_pair(sample):
        return max(len(sample["chosen_input_ids"]), len(sample["rejected_input_ids"]))
    return len(sample["tokens"])


def sample_positions(sample: Sample) -> int:
    """Positions one sample takes before padding (a pair's two sequences together)."""
    if is_pair(sample):
        return len(sample["chosen_input_ids"]) + len(sample["rejected_input_ids"])
    return len(sample["tokens"])


@dataclass
class SampleWindow:
    """One accumulation window on this rank, split and collated, still on the host.

    ``num_sample_positions`` are the samples' own positions, ``num_fixed_positions`` those the
    ``fixed`` split would process: with the positions actually processed they give the padding
    metrics. ``is_partial`` marks an epoch's last, short window. ``by_budget`` says the number of
    micro-batches depends on the lengths (``token_budget``, ``packed``), so ranks may plan
    different counts.
    """

    micro_batches: list[dict[str, Any]]
    num_samples: int
    num_sample_positions: int
    num_fixed_positions: int
    is_partial: bool
    by_budget: bool = False
    # The samples' own positions in each micro-batch, in order: one rank skips micro-batches
    # without a loss token, whose samples then count neither as processed nor as padding.
    micro_batch_sample_positions: tuple[int, ...] = ()


class WindowCollator:
    """The data loader's ``collate_fn``: a window's samples in, a :class:`SampleWindow` out.

    Runs where the loader collates (in its worker processes, if any), so the split costs the
    training loop nothing.

    Args:
        settings: the split; see [micro-batching modes].
        window_size: samples in a full window on this rank (``batch_size x ga``).
        collate: the config's ``collate_fn`` with its padding arguments bound.
    """

    def __init__(self, settings: MicroBatchingSettings, window_size: int, collate: Collate):
        self.settings = settings
        self.window_size = window_size
        self.collate = collate

    def __call__(self, samples: list[Any]) -> SampleWindow:
        num_kept = whole_micro_batches(len(samples), self.settings.batch_size)
        samples = samples[:num_kept]
        lengths = [sample_length(sample) for sample in samples]
        positions = [sample_positions(sample) for sample in samples]
        rows = 2 if samples and is_pair(samples[0]) else 1
        groups = plan_micro_batches(lengths, self.settings, rows, positions)
        fixed = _cut(list(range(num_kept)), self.settings.batch_size)
        return SampleWindow(
            micro_batches=[self.collate([samples[i] for i in group]) for group in groups],
            num_samples=num_kept,
            num_sample_positions=sum(positions),
            num_fixed_positions=padded_positions(lengths, fixed, rows),
            is_partial=num_kept < self.window_size,
            by_budget=self.settings.by_budget,
            micro_batch_sample_positions=tuple(sum(positions[i] for i in g) for g in groups),
        )


def filler_micro_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A one-sample slice of ``batch`` to run as a zero-weight micro-batch.

    Under data parallelism a rank with fewer ``token_budget`` micro-batches than another runs
    fillers so that every rank runs as many forwards and backwards; the normaliser masks its
    labels and weighs it 0 (see [empty micro-batches under FSDP]). A batch whose entries do not
    all share the sample dimension (some packed layouts) is used whole.
    """
    num_rows = len(batch["tokens"])
    if all(isinstance(v, torch.Tensor) and v.dim() and len(v) == num_rows for v in batch.values()):
        return {key: value[-1:] for key, value in batch.items()}
    return dict(batch)


@dataclass(frozen=True)
class WindowWork:
    """What one optimizer step processed on this rank, for the throughput and padding metrics.

    ``num_positions`` are processed positions (padding and fillers included); the samples' own
    positions and those the ``fixed`` split would have processed are ``None`` where unknown
    (micro-batches collated outside exactga's loader).
    """

    num_positions: int
    num_loss_tokens: int = 0  # the window's loss units on this rank (pairs for DPO)
    num_sample_positions: int | None = None
    num_fixed_positions: int | None = None
    positions_per_rank: tuple[int, ...] = ()
    units_name: str = "loss_tokens"  # what num_loss_tokens counts, as its metric is named
    shapes: tuple[tuple[int, ...], ...] = ()  # of the micro-batches run, fillers included


class PaddingMeter:
    """Sums :class:`WindowWork` over a logging interval and over the run, and counts the
    distinct micro-batch shapes of each epoch (each new one is a new compilation under
    ``compile``, and new kernel plans on a GPU)."""

    def __init__(self) -> None:
        self.interval = _PaddingTotals()
        self.run = _PaddingTotals()
        self.epoch_shapes: set[tuple[int, ...]] = set()
        self.most_shapes_in_an_epoch = 0

    def open_epoch(self) -> None:
        """Count shapes afresh: the next steps are a new epoch's."""
        self.epoch_shapes = set()

    def add(self, work: WindowWork) -> None:
        self.interval.add(work)
        self.run.add(work)
        self.epoch_shapes.update(work.shapes)
        self.most_shapes_in_an_epoch = max(self.most_shapes_in_an_epoch, len(self.epoch_shapes))

    def read_interval(self, elapsed_s: float) -> dict[str, float]:
        """``throughput/padding_fraction``, ``throughput/loss_tokens_per_second`` (or
        ``pairs_per_second``: the loss units) and, under data parallelism,
        ``throughput/rank_imbalance`` since the last read; then resets. Also
        ``throughput/micro_batch_shapes``: the distinct shapes so far in this epoch."""
        totals, self.interval = self.interval, _PaddingTotals()
        rate = f"throughput/{totals.units_name}_per_second"
        metrics = {rate: totals.num_loss_tokens / elapsed_s}
        if totals.known and totals.num_positions:
            metrics["throughput/padding_fraction"] = totals.padding_fraction
        if self.epoch_shapes:
            metrics["throughput/micro_batch_shapes"] = float(len(self.epoch_shapes))
        if totals.imbalance:
            metrics["throughput/rank_imbalance"] = max(totals.imbalance)
        return metrics

    def summary(self, mode: str) -> str | None:
        """One line for the end of the run: padding, and the positions saved against fixed."""
        totals = self.run
        if not totals.known or not totals.num_positions:
            return None
        line = (
            f"exactga: padding was {100 * totals.padding_fraction:.1f}% of the "
            f"{totals.num_positions:,} positions processed on this rank (micro_batching: {mode})"
        )
        if mode != MicroBatching.FIXED.value and totals.num_fixed_positions:
            saved = 1 - totals.num_positions / totals.num_fixed_positions
            line += (
                f"; fixed micro-batches would have processed {totals.num_fixed_positions:,} "
                f"({100 * saved:.1f}% saved)"
            )
        line += "."
        most = self.most_shapes_in_an_epoch
        if most:
            shapes = "one shape" if most == 1 else f"{most} distinct shapes"
            line += f" Micro-batches took {shapes} in an epoch (the most of any epoch)."
        return line


@dataclass
class _PaddingTotals:
    num_positions: int = 0
    num_loss_tokens: int = 0
    num_sample_positions: int = 0
    num_fixed_positions: int = 0
    known: bool = True  # every window said its sample positions
    units_name: str = "loss_tokens"
    imbalance: list[float] = dataclasses.field(default_factory=list)  # max/mean per step

    def add(self, work: WindowWork) -> None:
        self.num_positions += work.num_positions
        self.num_loss_tokens += work.num_loss_tokens
        self.units_name = work.units_name
        if work.num_sample_positions is None or work.num_fixed_positions is None:
            self.known = False
        else:
            self.num_sample_positions += work.num_sample_positions
            self.num_fixed_positions += work.num_fixed_positions
        ranks = work.positions_per_rank
        if len(ranks) > 1 and sum(ranks):
            self.imbalance.append(max(ranks) * len(ranks) / sum(ranks))

    @property
    def padding_fraction(self) -> float:
        return 1 - self.num_sample_positions / self.num_positions
