"""The GA parity report's outputs: a table, a verdict, a figure, TensorBoard runs, JSON.

Used by ``recipes/ga_parity.py``; the scores come from :mod:`exactga.parity.scoring`. The
figure needs matplotlib (``pip install exactga[parity]``); without it the report is written
without the figure, and says so.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

from exactga.parity.scoring import (
    MODE_LABELS,
    MODE_ORDER,
    ParityRun,
    RunSummary,
    sorted_by_mode,
    split_legend,
    verdict,
)


def markdown_table(summaries: list[RunSummary], noise_floor: float, what: str) -> str:
    lines = [
        f"| mode | split ({split_legend(summaries)}) | relative L2 of {what} to full batch "
        "| max loss gap |",
        "|---|---|---|---|",
    ]
    for s in sorted_by_mode(summaries):
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

    summaries = sorted_by_mode(summaries)
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


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


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
    figure = "![parity](parity.png)"
    if _has_matplotlib():
        plot(out_dir / "parity.png", reference, summaries, noise_floor, what)
    else:
        figure = "(No figure: matplotlib is not installed; `pip install exactga[parity]`.)"
        warnings.warn(f"parity report without its figure: {figure}", stacklevel=2)
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
            figure,
        ]
    )
    report = out_dir / "report.md"
    report.write_text(text + "\n")
    numbers = {
        "reference": reference.split,
        "reference_losses": reference.losses,
        "noise_floor": noise_floor,
        "runs": [dataclasses.asdict(summary) for summary in sorted_by_mode(summaries)],
    }
    (out_dir / "summary.json").write_text(json.dumps(numbers, indent=2) + "\n")
    return report
