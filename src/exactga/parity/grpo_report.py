"""What the GA parity report says of a GRPO config: its splits, its objective per
``loss_aggregation``, and the index over the aggregations' reports (see [grpo parity] in
exactga.parity.grpo, which trains the runs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from exactga.parity.scoring import (
    SPLITS_KEY,
    ParityRun,
    RunSummary,
    Split,
    parse_splits,
    sorted_runs,
)


def grpo_splits(texts: list[str], world_size: int, grpo_samples: int) -> list[Split]:
    """``parity.splits`` of a GRPO config, checked (:func:`parse_splits`), each holding whole
    prompts per rank (see [grpo parity]).

    Raises:
        ValueError: naming ``parity.splits``.
    """
    splits = parse_splits(texts, world_size)
    for split in splits:
        if (split.batch_size * split.ga) % grpo_samples:
            raise ValueError(
                f"config key '{SPLITS_KEY}': {split} gives a rank {split.batch_size * split.ga} "
                f"completions a step, not a whole number of prompts of grpo_samples "
                f"{grpo_samples}; a GRPO split counts completions (B per micro-batch x G "
                "micro-batches x N ranks)."
            )
    return splits


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """What a GRPO config trains under one ``loss_aggregation``, for the report to say."""

    aggregation: str
    grpo_samples: int
    ppo_epochs: int
    rewards: tuple[str, ...]
    loss: str = "PPOClipLoss"  # the policy loss and its settings (PolicyLoss.describe)

    @property
    def units(self) -> str:
        return "completion tokens" if self.aggregation == "token-mean" else "completions"

    def describe(self) -> str:
        means = {
            "token-mean": "the per-token policy losses of every completion token of the step "
            "on every rank, summed, over their count (DAPO)",
            "seq-mean-token-mean": "each completion's token mean, averaged over the step's "
            "completions (the GRPO paper)",
            "seq-mean-token-sum": "each completion's token sum, averaged over the step's "
            "completions",
            "seq-mean-token-sum-norm": "each completion's token sum over "
            "max_generated_tokens, averaged over the step's completions (Dr. GRPO)",
            "token-sum": "the per-token losses summed over the step's completions on every "
            "rank (each completion's token sum times the step's completions, averaged)",
        }[self.aggregation]
        return (
            f"**Objective: GRPO, `{self.loss}`, `loss_aggregation: {self.aggregation}`**: "
            f"{means}. Every run "
            f"trains recipes/grpo_full_finetune_distributed.py's step: {self.grpo_samples} "
            f"completions per prompt scored by {', '.join(self.rewards)}, group-relative "
            f"advantages, {self.ppo_epochs} optimizer step(s) per rollout step. A split BxG(xN) "
            f"counts completions: B per micro-batch, G micro-batches (x N ranks). The loss units "
            f"are {self.units}: exact weighs each micro-batch's mean by its units over the "
            "window's on every rank; `naive` divides each micro-batch's own mean by G."
        )

    def baselines(self) -> str:
        return (
            "The baseline runs fixed micro-batches only. Every run samples the same completions "
            "at the first rollout step; after it each samples from its own policy (see below)."
        )

    def gap_section(self, reference: ParityRun, summaries: list[RunSummary]) -> str:
        """When naive differs from exact under this aggregation, and this config's units per
        micro-batch. See [grpo parity]."""
        naive = [s for s in sorted_runs(summaries) if s.mode == "naive"]
        lines = [
            f"- `{s.label}` {s.split}: {_bounds(s.units_per_micro_batch)} {self.units} per "
            f"micro-batch; relative L2 {s.relative_l2:.2e}"
            for s in naive
        ]
        return "\n\n".join(
            [
                "## Where the naive weighting's gap comes from",
                "`naive` (each micro-batch's own mean over its units, divided by the number of "
                "micro-batches: TRL's `grpo`/`bnpo`/`dr_grpo` and veRL's weighting before their "
                "fixes) agrees with exact only when every micro-batch of a window on every rank "
                f"holds as many {self.units}. Completions end at different lengths, so under "
                "`token-mean` it is off almost always; under the completion units fixed "
                "micro-batches hold as many completions and naive is exact up to rounding "
                "The first rollout step's completions are the same in every run; "
                "from the second on a run whose weights moved elsewhere samples other "
                "completions, so its loss curve compares different rollouts (see [grpo parity] "
                "in exactga.parity.grpo).",
                *(["\n".join(lines)] if lines else ["No naive run was requested."]),
            ]
        )

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "units": self.units}


def _bounds(bounds: tuple[int, int]) -> str:
    fewest, most = bounds
    return str(most) if fewest == most else f"{fewest} to {most}"


def write_index(
    report_dir: Path,
    outcomes: dict[str, dict[str, str]],
    *,
    num_completions: int,
    num_steps: int,
    ppo_epochs: int,
) -> Path:
    """``report.md`` and ``summary.json`` in ``report_dir``: each aggregation's verdict and
    table (``outcomes``: name -> report, verdict, table) with a link to its own report."""
    sections = [
        "# GA parity report: GRPO",
        f"Each policy loss x `loss_aggregation` is its own objective with its own full-batch "
        "reference "
        f"({num_completions} completions in one micro-batch on one device), {num_steps} rollout "
        f"steps of {ppo_epochs} optimizer step(s). A split BxG(xN) counts completions: B per "
        "micro-batch, G micro-batches (x N ranks).",
    ]
    for name, outcome in outcomes.items():
        title = f"loss_aggregation: {outcome.get('aggregation', name)}"
        if name != outcome.get("aggregation", name):  # parity.losses lists the losses
            title = f"{outcome['loss']}, {title}"
        sections += [
            f"## {title}",
            f"**Verdict:** {outcome['verdict']}",
            outcome["table"],
            f"Figure, TensorBoard runs and the naive gap: [{outcome['report']}]"
            f"({outcome['report']}).",
        ]
    path = report_dir / "report.md"
    path.write_text("\n\n".join(sections) + "\n")
    summary = {
        name: {
            "report": outcome["report"],
            "verdict": outcome["verdict"],
            "loss": outcome.get("loss"),
            "aggregation": outcome.get("aggregation", name),
            "summary": json.loads((report_dir / name / "summary.json").read_text()),
        }
        for name, outcome in outcomes.items()
    }
    (report_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return path
