"""The GA parity report: distances to the full-batch run, a figure, a table and a verdict.

Used by ``recipes/ga_parity.py``. Distances are relative L2: ``||w - w_full|| / ||w_full - w_0||``
over every compared tensor, so they measure the difference against how far training moved the
weights, whatever the learning rate or the weights' scale.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

MODE_ORDER = ("naive", "post_scale", "exact")
MODE_LABELS = {
    "naive": "naive (mean of means)",
    "post_scale": "post_scale (stock)",
    "exact": "exact",
}


@dataclass
class ParityRun:
    """One trained run: its mode, split, per-step window losses and final weights."""

    mode: str
    split: str
    losses: list[float]
    weights: dict[str, torch.Tensor]


@dataclass(frozen=True)
class RunSummary:
    mode: str
    split: str
    relative_l2: float
    max_loss_gap: float


def relative_l2(
    weights: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
) -> float:
    """``||w - w_ref|| / ||w_ref - w_init||`` over all tensors, in float64."""
    diff_sq = moved_sq = 0.0
    for name, ref in reference.items():
        ref = ref.double()
        diff_sq += float(((weights[name].double() - ref) ** 2).sum())
        moved_sq += float(((ref - initial[name].double()) ** 2).sum())
    if moved_sq == 0.0:
        raise ValueError("the full-batch run did not move the weights; raise the learning rate.")
    return math.sqrt(diff_sq / moved_sq)


def max_loss_gap(losses: list[float], reference: list[float]) -> float:
    """Largest absolute difference of the logged window losses, step by step."""
    gaps = [abs(a - b) for a, b in zip(losses, reference, strict=True) if not math.isnan(a)]
    return max(gaps, default=0.0)


def summarize(
    reference: ParityRun, runs: list[ParityRun], initial: dict[str, torch.Tensor]
) -> list[RunSummary]:
    return [
        RunSummary(
            mode=run.mode,
            split=run.split,
            relative_l2=relative_l2(run.weights, reference.weights, initial),
            max_loss_gap=max_loss_gap(run.losses, reference.losses),
        )
        for run in runs
    ]


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


def markdown_table(summaries: list[RunSummary], noise_floor: float, what: str) -> str:
    lines = [
        f"| mode | split (bsz x ga) | relative L2 of {what} to full batch | max loss gap |",
        "|---|---|---|---|",
    ]
    for s in sorted(summaries, key=lambda s: (MODE_ORDER.index(s.mode), s.split)):
        flag = "" if s.relative_l2 <= noise_floor else " (above floor)"
        row = f"| {s.mode} | {s.split} | {s.relative_l2:.3e}{flag} | {s.max_loss_gap:.3e} |"
        lines.append(row)
    return "\n".join(lines)


def plot(
    path: Path,
    reference: ParityRun,
    runs: list[ParityRun],
    summaries: list[RunSummary],
    noise_floor: float,
    what: str,
) -> None:
    """Loss curves per mode (top row) and log-scale L2 bars per mode and split (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODE_ORDER if any(r.mode == m for r in runs)]
    fig = plt.figure(figsize=(5 * max(len(modes), 2), 12), layout="constrained")
    grid = fig.add_gridspec(3, len(modes))
    steps = list(range(1, len(reference.losses) + 1))
    gap_axes = []
    for column, mode in enumerate(modes):
        mode_runs = [r for r in runs if r.mode == mode]
        ax = fig.add_subplot(grid[0, column])
        ax.plot(steps, reference.losses, color="black", linewidth=2.5, label="full batch")
        for run in mode_runs:
            ax.plot(steps, run.losses, linestyle="--", marker=".", label=run.split)
        ax.set_title(MODE_LABELS.get(mode, mode))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("window loss")
        ax.legend(title="bsz x ga", fontsize="small")
        ax.grid(alpha=0.3)
        gap_ax = fig.add_subplot(grid[1, column], sharey=gap_axes[0] if gap_axes else None)
        gap_axes.append(gap_ax)
        for run in mode_runs:
            gaps = [
                max(abs(a - b), 1e-12) for a, b in zip(run.losses, reference.losses, strict=True)
            ]
            gap_ax.plot(steps, gaps, marker=".", label=run.split)
        gap_ax.set_yscale("log")
        gap_ax.set_xlabel("optimizer step")
        gap_ax.set_ylabel("|loss - full-batch loss| (log)")
        gap_ax.set_title(f"{mode}: loss-curve gap")
        gap_ax.legend(title="bsz x ga", fontsize="small")
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
    ax.set_xlabel("normalisation mode and split")
    ax.set_title(f"Distance to the full-batch run after {len(steps)} steps")
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i, _ in enumerate(MODE_ORDER)]
    ax.legend(
        [*handles, ax.get_lines()[0]],
        [*(MODE_LABELS[m] for m in MODE_ORDER), f"fp32 floor ({noise_floor:.0e})"],
        fontsize="small",
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    out_dir: Path,
    *,
    reference: ParityRun,
    runs: list[ParityRun],
    initial_weights: dict[str, torch.Tensor],
    noise_floor: float,
    what: str = "weights",
) -> Path:
    """Write ``report.md``, ``parity.png`` and ``summary.json`` into ``out_dir``.

    Returns the report's path.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = summarize(reference, runs, initial_weights)
    plot(out_dir / "parity.png", reference, runs, summaries, noise_floor, what)
    text = "\n\n".join(
        [
            "# GA parity report",
            f"Full-batch reference: {reference.split}, {len(reference.losses)} optimizer steps. "
            f"Relative L2 = ||w - w_full|| / ||w_full - w_0|| over the {what}; max loss gap = "
            "largest per-step difference of the logged window loss.",
            markdown_table(summaries, noise_floor, what),
            f"**Verdict:** {verdict(summaries, noise_floor)}",
            "![parity](parity.png)",
        ]
    )
    report = out_dir / "report.md"
    report.write_text(text + "\n")
    numbers = {
        "reference": reference.split,
        "noise_floor": noise_floor,
        "runs": [dataclasses.asdict(summary) for summary in summaries],
    }
    (out_dir / "summary.json").write_text(json.dumps(numbers, indent=2) + "\n")
    return report
