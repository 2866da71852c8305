"""The GA parity report: splits, distances to the full-batch run, a figure, a table, a verdict.

Used by ``recipes/ga_parity.py``. Distances are relative L2: ``||w - w_full|| / ||w_full - w_0||``
over every compared tensor, so they measure the difference against how far training moved the
weights, whatever the learning rate or the weights' scale.

A run is scored (:func:`summarize`) as soon as it has trained, on the rank that trained it, so
only its numbers travel to rank 0 and no rank holds more than two sets of trained weights (the
full-batch run's and the current run's).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

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
    weights: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
) -> float:
    """``||w - w_ref|| / ||w_ref - w_init||`` over all tensors, in float64."""
    assert weights.keys() == reference.keys(), "the runs compare different tensors"
    diff_sq = moved_sq = 0.0
    for name, ref in reference.items():
        ref = ref.double()
        diff_sq += float(((weights[name].double() - ref) ** 2).sum())
        moved_sq += float(((ref - initial[name].double()) ** 2).sum())
    if moved_sq == 0.0:
        raise ValueError("the full-batch run did not move the weights; raise the learning rate.")
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


def _sorted(summaries: list[RunSummary]) -> list[RunSummary]:
    return sorted(summaries, key=lambda s: MODE_ORDER.index(s.mode))  # stable: splits as listed


def markdown_table(summaries: list[RunSummary], noise_floor: float, what: str) -> str:
    lines = [
        f"| mode | split ({split_legend(summaries)}) | relative L2 of {what} to full batch "
        "| max loss gap |",
        "|---|---|---|---|",
    ]
    for s in _sorted(summaries):
        flag = "" if s.relative_l2 <= noise_floor else " (above floor)"
        row = f"| {s.mode} | {s.split} | {s.relative_l2:.3e}{flag} | {s.max_loss_gap:.3e} |"
        lines.append(row)
    return "\n".join(lines)


def plot(
    path: Path,
    reference: ParityRun,
    summaries: list[RunSummary],
    noise_floor: float,
    what: str,
) -> None:
    """Loss curves per mode (top row), their gap to the full batch (middle), L2 bars (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = _sorted(summaries)
    legend = split_legend(summaries)
    modes = [m for m in MODE_ORDER if any(s.mode == m for s in summaries)]
    fig = plt.figure(figsize=(5 * max(len(modes), 2), 12), layout="constrained")
    grid = fig.add_gridspec(3, len(modes))
    steps = list(range(1, len(reference.losses) + 1))
    gap_axes = []
    for column, mode in enumerate(modes):
        mode_runs = [s for s in summaries if s.mode == mode]
        ax = fig.add_subplot(grid[0, column])
        ax.plot(steps, reference.losses, color="black", linewidth=2.5, label="full batch")
        for run in mode_runs:
            ax.plot(steps, run.losses, linestyle="--", marker=".", label=run.split)
        ax.set_title(MODE_LABELS.get(mode, mode))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("window loss")
        ax.legend(title=legend, fontsize="small")
        ax.grid(alpha=0.3)
        gap_ax = fig.add_subplot(grid[1, column], sharey=gap_axes[0] if gap_axes else None)
        gap_axes.append(gap_ax)
        for run in mode_runs:
            # Equal losses are drawn at 1e-12 so the log axis can show them.
            gaps = [
                max(abs(a - b), 1e-12) for a, b in zip(run.losses, reference.losses, strict=True)
            ]
            gap_ax.plot(steps, gaps, marker=".", label=run.split)
        gap_ax.set_yscale("log")
        gap_ax.set_xlabel("optimizer step")
        gap_ax.set_ylabel("|loss - full-batch loss| (log)")
        gap_ax.set_title(f"{mode}: loss-curve gap")
        gap_ax.legend(title=legend, fontsize="small")
        gap_ax.grid(alpha=0.3)
    ax = fig.add_subplot(grid[2, :])
    labels = [f"{s.mode}\n{s.split}" for s in summaries]
    colors = [f"C{MODE_ORDER.index(s.mode)}" for s in summaries]
    values = [max(s.relative_l2, 1e-12) for s in summaries]
    ax.bar(range(len(values)), values, color=colors)
    ax.axhline(noise_floor, color="red", linestyle=":", label=f"fp32 floor ({noise_floor:.0e})")
    ax.set_yscale("log")
    ax.set_xticks(range(len(values)), labels, fontsize="small")
    ax.set_ylabel(f"relative L2 of {what}\nto the full-batch run (log)")
    ax.set_xlabel(f"normalisation mode and split ({legend})")
    ax.set_title(f"Distance to the full-batch run after {len(steps)} steps")
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i, _ in enumerate(MODE_ORDER)]
    ax.legend(
        [*handles, ax.get_lines()[0]],
        [*(MODE_LABELS[m] for m in MODE_ORDER), f"fp32 floor ({noise_floor:.0e})"],
        fontsize="small",
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tensorboard(log_root: Path, summaries: list[RunSummary]) -> None:
    """One TensorBoard run per mode and split, ``<log_root>/<mode>_<split>``, with its losses.

    Written after training, from the recorded losses, so that rank 0 writes every run whichever
    rank trained it.
    """
    from torchtune.training.metric_logging import TensorBoardLogger

    for summary in summaries:
        logger = TensorBoardLogger(
            str(log_root / f"{summary.mode}_{summary.split}"), organize_logs=False
        )
        for step, loss in enumerate(summary.losses, start=1):
            logger.log("loss", loss, step)
        logger.close()


def write_report(
    out_dir: Path,
    *,
    reference: ParityRun,
    summaries: list[RunSummary],
    noise_floor: float,
    what: str = "weights",
) -> Path:
    """Write ``report.md``, ``parity.png``, ``summary.json`` and ``tensorboard/`` into ``out_dir``.

    Returns the report's path.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tensorboard(out_dir / "tensorboard", summaries)
    plot(out_dir / "parity.png", reference, summaries, noise_floor, what)
    where = ""
    if split_legend(summaries).endswith("ranks"):
        where = " A split BxGxN trains data-parallel over N ranks (FSDP2), BxG on one device."
    text = "\n\n".join(
        [
            "# GA parity report",
            f"Full-batch reference: {reference.split} on one device, {len(reference.losses)} "
            f"optimizer steps.{where} Relative L2 = ||w - w_full|| / ||w_full - w_0|| over the "
            f"{what}; max loss gap = largest per-step difference of the logged window loss.",
            markdown_table(summaries, noise_floor, what),
            f"**Verdict:** {verdict(summaries, noise_floor)}",
            "![parity](parity.png)",
        ]
    )
    report = out_dir / "report.md"
    report.write_text(text + "\n")
    numbers = {
        "reference": reference.split,
        "reference_losses": reference.losses,
        "noise_floor": noise_floor,
        "runs": [dataclasses.asdict(summary) for summary in _sorted(summaries)],
    }
    (out_dir / "summary.json").write_text(json.dumps(numbers, indent=2) + "\n")
    return report
