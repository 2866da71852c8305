"""Overlay the logged ``loss`` of several runs in one figure and print them side by side.

Usage (each RUN is a run's TensorBoard log folder, e.g. ``outputs/x/logs``)::

    python tools/compare_loss_curves.py --out docs/images/curves.png \\
        --label before RUN_A --label after RUN_B

Prints the loss at the first and last step and every tenth one, for each run, and the largest
per-step difference between the first run and each other. Needs matplotlib.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def read_losses(log_dir: Path) -> list[float]:
    """The ``loss`` scalars under ``log_dir`` (TensorBoard events), in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    points: list[tuple[int, float]] = []
    for events in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0, "scalars": 0})
        accumulator.Reload()
        tags = accumulator.Tags()
        if "loss" in tags.get("tensors", []):
            points += [
                (e.step, float(make_ndarray(e.tensor_proto).reshape(-1)[0]))
                for e in accumulator.Tensors("loss")
            ]
        if "loss" in tags.get("scalars", []):
            points += [(e.step, float(e.value)) for e in accumulator.Scalars("loss")]
    if not points:
        raise SystemExit(f"no 'loss' scalars under {log_dir}")
    return [value for _, value in sorted(points)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", nargs=2, action="append", metavar=("NAME", "LOG_DIR"))
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="loss per optimizer step")
    args = parser.parse_args()
    runs = {name: read_losses(Path(log_dir)) for name, log_dir in args.label}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for name, losses in runs.items():
        ax.plot(range(1, len(losses) + 1), losses, marker=".", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)

    names = list(runs)
    num_steps = max(len(losses) for losses in runs.values())
    shown = sorted({1, num_steps, *range(10, num_steps + 1, 10)})
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for step in shown:
        cells = [f"{runs[n][step - 1]:.4f}" if step <= len(runs[n]) else "" for n in names]
        print(f"| {step} | " + " | ".join(cells) + " |")
    first = runs[names[0]]
    for name in names[1:]:
        gap = max(abs(a - b) for a, b in zip(first, runs[name], strict=False))
        print(f"largest per-step difference, {names[0]} vs {name}: {gap:.4f}")
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
