"""The GA parity report's outputs: tables, a verdict, a figure, TensorBoard runs, JSON.

Used by ``recipes/ga_parity.py``; the scores come from :mod:`exactga.parity.scoring`. The
figure needs matplotlib (``pip install exactga[parity]``); without it the report is written
without the figure, and says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from exactga.parity.scoring import (
    MODE_LABELS,
    PRECISION_FLOOR_FACTOR,
    ROUTER_TERM_OFF,
    ParityRun,
    PrecisionView,
    RunSummary,
    sorted_runs,
    split_legend,
    verdict,
)

if TYPE_CHECKING:
    from exactga.parity.grpo_report import PolicyObjective
    from exactga.parity.preference import Preference


def markdown_table(
    summaries: list[RunSummary], reference: ParityRun, precision: PrecisionView, what: str
) -> str:
    """Every run's distance to the full batch; below fp32 also to the fp32 full batch, next to
    it, with the full batch's own as the first row (see [parity floor below fp32])."""
    floor = precision.floor
    legend = split_legend(summaries)
    if not precision.below_fp32:
        lines = [
            f"| mode | micro_batching | split ({legend}) | relative L2 of {what} "
            "to full batch | max loss gap |",
            "|---|---|---|---|---|",
        ]
    else:
        lines = [
            f"| mode | micro_batching | split ({legend}) | relative L2 of {what} to "
            f"{precision.dtype} full batch (what the split costs) | to fp32 full batch (what "
            "split and precision cost) | max loss gap |",
            "|---|---|---|---|---|---|",
            f"| full batch | fixed | {reference.split} | (reference) "
            f"| {precision.reference_to_fp32:.3e} (what the precision costs) | |",
        ]
    for s in sorted_runs(summaries):
        flag = "" if s.relative_l2 <= floor else " (above floor)"
        to_fp32 = ""
        if precision.below_fp32 and s.relative_l2_to_fp32 is not None:
            to_fp32 = f"| {s.relative_l2_to_fp32:.3e} "
        elif precision.below_fp32:  # a run without the router term: no fp32 twin
            to_fp32 = "| "
        lines.append(
            f"| {s.mode}{f' ({s.variant})' if s.variant else ''} | {s.micro_batching} "
            f"| {s.split} | {s.relative_l2:.3e}{flag} {to_fp32}| {s.max_loss_gap:.3e} |"
        )
    return "\n".join(lines)


def precision_section(precision: PrecisionView, what: str) -> str:
    """Below fp32: what was trained, and how the two distances and the floor read."""
    name = precision.dtype
    return (
        f"**Precision:** {precision.describe()}. The full batch was also trained in fp32, "
        f"from the same initial weights cast to fp32 and on the same data: the {name} full "
        f"batch lands {precision.reference_to_fp32:.2e} from it (relative L2 of the {what}), "
        f"what {name} costs on this config. Each run's first distance is to the {name} full "
        f"batch, what its split costs at this precision; the second to the fp32 full batch, "
        f"what split and precision cost together. Two {name} runs of the same objective differ "
        f"by their rounding, so the floor is {PRECISION_FLOOR_FACTOR:g}x the full batch's own "
        f"distance to fp32 ({precision.floor:.2e}; at least the fp32 floor "
        f"{precision.noise_floor:.0e}): below it the split costs less than the precision."
    )


@dataclasses.dataclass(frozen=True)
class DataShape:
    """What decides whether stock torchtune's weighting (``post_scale``) differs from exact,
    measured on the samples the full-batch run trained on (see :func:`stock_gap_section`)."""

    num_rows: int
    num_live_first_labels: int  # rows whose first label is a loss token (counted only by stock)
    min_row_tokens: int  # loss tokens of a row after the shift
    max_row_tokens: int
    train_on_input: bool | None  # the dataset's setting, None when it has none

    @classmethod
    def of_labels(cls, labels: list, ignore_index: int, train_on_input: bool | None) -> DataShape:
        """From the label batches (before the shift, padded with ``ignore_index``)."""
        live = sum(int((batch[:, 0] != ignore_index).sum()) for batch in labels)
        per_row = [n for b in labels for n in (b[:, 1:] != ignore_index).sum(dim=1).tolist()]
        return cls(
            num_rows=len(per_row),
            num_live_first_labels=live,
            min_row_tokens=min(per_row, default=0),
            max_row_tokens=max(per_row, default=0),
            train_on_input=train_on_input,
        )


def stock_gap_section(data: DataShape) -> str:
    """When stock's ``post_scale`` differs from exact, and whether this config's data does it.

    See docs/math.md §3: stock weights micro-batch k's tokens by ``(b_k / a_k) / B`` (``a_k``
    loss tokens after the label shift, ``b_k`` before it), so it is exact unless first labels
    are live (``b_k > a_k``) *and* the micro-batches hold different numbers of loss tokens.
    """
    setting = ""
    if data.train_on_input is not None:
        setting = f" (`train_on_input: {data.train_on_input}`)"
    live = data.num_live_first_labels
    varies = data.min_row_tokens != data.max_row_tokens
    if live and varies:
        here = "so stock's gap shows in the `post_scale` rows above"
    else:
        here = "so the `post_scale` rows should sit with exact's, at rounding"
    return "\n\n".join(
        [
            "## Where stock torchtune's gap comes from",
            "Stock torchtune 0.6.1 (`post_scale`) multiplies each micro-batch's mean loss by its "
            "token count taken *before* the label shift, which includes every row's first label, "
            "a token the loss never sees. It differs from exact only when both hold: first labels "
            "are live (`train_on_input: True`, or text-completion data whose labels copy the "
            "tokens) and the micro-batches hold different numbers of loss tokens (samples of "
            "different lengths). With `train_on_input: False` the prompt, first label included, "
            "is masked, so stock is exact up to rounding however long the prompts; the naive "
            "mean of means differs whenever the micro-batches' loss-token counts differ, and "
            "masked prompts of different lengths make them differ more. See docs/math.md §3.",
            f"**This config's data**{setting}: the full batch's {data.num_rows} rows hold "
            f"{data.min_row_tokens} to {data.max_row_tokens} loss tokens each, and {live} of "
            f"them a live first label; {here}.",
        ]
    )


def micro_batching_section(
    summaries: list[RunSummary],
    reference: ParityRun,
    micro_batch_tokens: int | None,
    what: str,
) -> str | None:
    """Exact mode's micro-batchings side by side, split by split: where each lands and what it
    processed. ``None`` unless exact mode ran under two or more micro-batchings."""
    exact = sorted_runs([s for s in summaries if s.mode == "exact"])
    if len({s.micro_batching for s in exact}) < 2:
        return None
    fixed = {s.split: s for s in exact if s.micro_batching == "fixed"}
    num_steps = max(len(reference.losses), 1)
    reference_padding = 1 - reference.num_sample_positions / reference.num_positions
    lines = [
        f"| split ({split_legend(exact)}) | micro_batching | relative L2 of {what} "
        "| micro-batches per step | positions processed | vs fixed | padding |",
        "|---|---|---|---|---|---|---|",
        f"| {reference.split} (full batch) | fixed | (reference) "
        f"| {reference.num_micro_batches / num_steps:.1f} | {reference.num_positions:,} | "
        f"| {100 * reference_padding:.1f}% |",
    ]
    splits = list(dict.fromkeys(s.split for s in exact))  # as listed
    for split in splits:
        for run in [s for s in exact if s.split == split]:
            name = run.micro_batching
            if name in ("token_budget", "packed"):
                name = f"{name} ({micro_batch_tokens})"
            versus = ""
            if split in fixed and run.micro_batching != "fixed":
                versus = f"{100 * (run.num_positions / fixed[split].num_positions - 1):+.1f}%"
            lines.append(
                f"| {split} | {name} | {run.relative_l2:.3e} | {run.micro_batches_per_step:.1f} "
                f"| {run.num_positions:,} | {versus} | {100 * run.padding_fraction:.1f}% |"
            )
    return "\n\n".join(
        [
            "## Micro-batching (exact mode)",
            "The same samples and optimizer steps, each window's samples grouped into "
            "micro-batches as listed: `fixed` cuts every B samples in the loader's order, "
            "`by_length` sorts them longest first and then cuts every B, `token_budget` sorts "
            "them and cuts at the budget of padded positions whatever B (so splits over the "
            "same number of ranks share its micro-batches). Positions are those the model "
            "processed over all steps and ranks, padding included; padding is their share "
            "that was padding. The verdict above covers every row; the micro-batches and "
            "positions are what the grouping changes.",
            "\n".join(lines),
        ]
    )


def plot(
    path: Path,
    reference: ParityRun,
    summaries: list[RunSummary],
    precision: PrecisionView,
    what: str,
    fp32_reference: ParityRun | None = None,
) -> None:
    """Loss curves per mode and micro-batching (top row), their gap to the full batch (middle),
    L2 bars (bottom). Below fp32 the fp32 full batch's loss curve is drawn too, and each bar
    (to the same-precision full batch: what the split costs) gets a marker for its distance to
    the fp32 full batch and a line for the full batch's own (what the precision costs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = sorted_runs(summaries)
    legend = split_legend(summaries)
    labels = list(dict.fromkeys(s.label for s in summaries))  # naive/fixed, ..., exact/...
    full_batch = f"{precision.dtype} full batch" if precision.below_fp32 else "full batch"
    fig = plt.figure(figsize=(4.5 * max(len(labels), 2), 12), layout="constrained")
    grid = fig.add_gridspec(3, len(labels))
    steps = list(range(1, len(reference.losses) + 1))
    gap_axes = []
    for column, label in enumerate(labels):
        runs = [s for s in summaries if s.label == label]
        mode, micro_batching = runs[0].mode, runs[0].micro_batching
        ax = fig.add_subplot(grid[0, column])
        ax.plot(steps, reference.losses, color="black", linewidth=2.5, label=full_batch)
        if fp32_reference is not None:
            ax.plot(
                steps, fp32_reference.losses, color="grey", linewidth=1.5, label="fp32 full batch"
            )
        for run in runs:
            ax.plot(steps, run.losses, linestyle="--", marker=".", label=run.split)
        ax.set_title(f"{MODE_LABELS.get(mode, mode)}, {micro_batching}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("window loss")
        ax.legend(title=legend, fontsize="small")
        ax.grid(alpha=0.3)
        gap_ax = fig.add_subplot(grid[1, column], sharey=gap_axes[0] if gap_axes else None)
        gap_axes.append(gap_ax)
        for run in runs:
            # Equal losses are drawn at 1e-12 so the log axis can show them.
            gaps = [
                max(abs(a - b), 1e-12) for a, b in zip(run.losses, reference.losses, strict=True)
            ]
            gap_ax.plot(steps, gaps, marker=".", label=run.split)
        gap_ax.set_yscale("log")
        gap_ax.set_xlabel("optimizer step")
        gap_ax.set_ylabel(f"|loss - {full_batch} loss| (log)")
        gap_ax.set_title(f"{label}: loss-curve gap")
        gap_ax.legend(title=legend, fontsize="small")
        gap_ax.grid(alpha=0.3)
    ax = fig.add_subplot(grid[2, :])
    colors = [f"C{labels.index(s.label)}" for s in summaries]
    values = [max(s.relative_l2, 1e-12) for s in summaries]
    ax.bar(range(len(values)), values, color=colors)
    floor_label = f"{precision.floor_name} ({precision.floor:.1e})"
    extra_handles = [ax.axhline(precision.floor, color="red", linestyle=":")]
    extra_labels = [floor_label]
    if precision.below_fp32:
        extra_handles.append(
            ax.axhline(precision.reference_to_fp32, color="black", linestyle="--", linewidth=1)
        )
        extra_labels.append(
            f"{full_batch} to fp32 full batch ({precision.reference_to_fp32:.1e}): "
            "what the precision costs"
        )
        to_fp32 = [max(s.relative_l2_to_fp32 or 0.0, 1e-12) for s in summaries]
        extra_handles.append(
            ax.scatter(range(len(to_fp32)), to_fp32, marker="D", color="black", zorder=3, s=24)
        )
        extra_labels.append("each run to fp32 full batch")
    ax.set_yscale("log")
    ticks = [f"{s.label}\n{s.split}" for s in summaries]
    ax.set_xticks(range(len(values)), ticks, fontsize="x-small")
    ax.set_ylabel(f"relative L2 of {what}\nto the {full_batch} run (bars, log)")
    ax.set_xlabel(f"normalisation mode / micro-batching and split ({legend})")
    title = f"Distance to the {full_batch} run after {len(steps)} steps"
    if precision.below_fp32:
        title += f" ({precision.describe().replace('`', '')})"
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i, _ in enumerate(labels)]
    ax.legend([*handles, *extra_handles], [*labels, *extra_labels], fontsize="small")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tensorboard(log_root: Path, summaries: list[RunSummary]) -> None:
    """One TensorBoard run per mode, micro-batching and split, with its losses, in
    ``<log_root>/<mode>/<micro_batching>/<split>`` (TensorBoard names it
    ``exact/by_length/2x4``).

    Written after training, from the recorded losses, so that rank 0 writes every run whichever
    rank trained it.
    """
    from torchtune.training.metric_logging import TensorBoardLogger

    for summary in summaries:
        logger = TensorBoardLogger(
            str(log_root / summary.mode / summary.micro_batching / summary.split),
            organize_logs=False,
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


@dataclasses.dataclass(frozen=True)
class FakeQuantisation:
    """A QAT config's fake quantisation (``quantizer``), which every run trained under, for the
    report to say (docs/qat.md)."""

    quantizer: str  # the quantizer's class
    groupsize: int | None
    after_n_steps: int | None  # fake_quant_after_n_steps; None: on from the first step

    def describe(self) -> str:
        when = (
            "from the first step"
            if self.after_n_steps is None
            else f"after {self.after_n_steps} steps without it"
        )
        return (
            f"**Fake quantisation: {self.quantizer}** (group size {self.groupsize}), as "
            f"recipes/qat_distributed.py and recipes/qat_lora_finetune_distributed.py train, "
            f"{when}, in every run. Fake quantisation rounds to a grid: once a split's weights "
            "differ from the full batch's by rounding, a value on a grid boundary may round to "
            "the neighbouring point, and from that step on the split parts by more than the "
            'floor (docs/qat.md, "What is exact").'
        )


@dataclasses.dataclass(frozen=True)
class Distillation:
    """What a knowledge-distillation config trains (``teacher_model`` set): the mix every run
    optimised, for the report to say."""

    kd_ratio: float
    loss: str  # the class loss's component
    kd_loss: str
    teacher: str  # the teacher's builder

    def describe(self) -> str:
        r = self.kd_ratio
        return (
            f"**Objective: knowledge distillation.** Every run distils the frozen teacher "
            f"(`{self.teacher}`) into the student: loss = {1 - r:g} x `{self.loss}` + {r:g} x "
            f"`{self.kd_loss}` (`kd_ratio: {r:g}`), with the loss step of "
            "recipes/knowledge_distillation.py. `post_scale` is stock torchtune "
            "0.6.1's KD recipe's weighting (see [stock kd weighting] in exactga.kd.distillation)."
        )


def stock_kd_gap_section(data: DataShape) -> str:
    """When stock's KD weighting (``post_scale`` under KD) differs from exact, and whether this
    config's data makes it. See [stock kd weighting] in exactga.kd.distillation."""
    varies = data.min_row_tokens != data.max_row_tokens
    if varies:
        here = "so stock's gap shows in the `post_scale` rows above"
    else:
        here = (
            "so the `post_scale` rows differ from exact's by the gradient's scale alone, which "
            "Adam all but ignores and SGD does not"
        )
    return "\n\n".join(
        [
            "## Where stock torchtune's gap comes from",
            "Stock torchtune 0.6.1's KD recipe (`post_scale`) backpropagates each micro-batch's "
            "*mean* mix unscaled, then multiplies the gradients by one over the window's token "
            "count taken before the label shift. Its step is the sum of the micro-batch means "
            "over that count: every micro-batch weighs the same whatever its number of loss "
            "tokens, and even the full batch's gradient is its mean divided by the count (a "
            "step that many times smaller under SGD; Adam's normalisation leaves only its "
            "epsilon to see it). So, unlike stock fine-tuning, it differs from exact whenever "
            "the micro-batches hold different numbers of loss tokens, live first labels or not.",
            f"**This config's data**: the full batch's {data.num_rows} rows hold "
            f"{data.min_row_tokens} to {data.max_row_tokens} loss tokens each; {here}.",
        ]
    )


# Note [router term in the parity report]
# With router_aux_loss_coef > 0 every run adds the router's balance term, as the fine-tuning
# recipes do, and the normaliser weighs it per micro-batch (see [router balance as a loss term]
# in exactga.sft.router_balance). That term depends on the split by definition: micro_batch
# balances each micro-batch on its rank, global_batch each micro-batch over the ranks, so a
# split of smaller micro-batches optimises another objective, and its weights leave the full
# batch's by more than the floor however exact the token loss is. So the report also trains
# the full batch and the exact/fixed splits with the token loss alone (ROUTER_TERM_OFF), and
# shows, split by split: the window's mean balance term beside the full batch's, each term's
# largest per-step gap (the token loss's and the router term's), and the weights gap with the
# term beside the one without it. The verdict is on the runs without it: the token loss's
# exactness, which the router term cannot show.


@dataclasses.dataclass(frozen=True)
class RouterTerm:
    """A mixture-of-experts config's router balance term, which every run added."""

    coef: float  # router_aux_loss_coef
    objective: str  # router_balance: micro_batch | global_batch

    def describe(self) -> str:
        return (
            f"**Router balance term:** every run adds the router's load-balancing loss x "
            f"{self.coef:g} (`router_aux_loss_coef`), balanced per micro-batch "
            f"(`router_balance: {self.objective}`), as the fine-tuning recipes do. It depends on "
            "the split by definition, so exact splits with it land above the floor; the full "
            "batch and the exact/fixed splits were also trained without it, and the verdict is "
            "on those (see the router section below)."
        )

    def as_json(self) -> dict[str, float | str]:
        return {"router_aux_loss_coef": self.coef, "router_balance": self.objective}


def _mean_router_term(term_losses: tuple[tuple[float, ...], ...] | list) -> float:
    """The runs' mean balance term over its steps (the second term; skipped windows left out)."""
    values = [terms[1] for terms in term_losses if not math.isnan(terms[1])]
    return sum(values) / len(values) if values else math.nan


def router_section(router: RouterTerm, reference: ParityRun, summaries: list[RunSummary]) -> str:
    """Split by split, the router term's gap beside the token loss's, and the weights gap with
    the term beside the one without it; see [router term in the parity report]."""
    without = {s.split: s for s in summaries if s.variant == ROUTER_TERM_OFF}
    full = _mean_router_term(reference.term_losses)
    lines = [
        f"| mode | micro_batching | split ({split_legend(summaries)}) | mean router term "
        "| its max gap | token loss's max gap | relative L2 with the term | without it |",
        "|---|---|---|---|---|---|---|---|",
        f"| full batch | fixed | {reference.split} | {full:.4e} | | | (reference) | (reference) |",
    ]
    for s in sorted_runs([s for s in summaries if s.variant != ROUTER_TERM_OFF]):
        lm_gap, term_gap = s.max_term_gaps if len(s.max_term_gaps) == 2 else (math.nan,) * 2
        twin = without.get(s.split) if (s.mode, s.micro_batching) == ("exact", "fixed") else None
        alone = f"{twin.relative_l2:.3e}" if twin is not None else ""
        lines.append(
            f"| {s.mode} | {s.micro_batching} | {s.split} | {_mean_router_term(s.term_losses):.4e} "
            f"| {term_gap:.3e} | {lm_gap:.3e} | {s.relative_l2:.3e} | {alone} |"
        )
    return "\n\n".join(
        [
            "## Router term",
            "The window's mean balance term (x `router_aux_loss_coef`, as it enters the loss), "
            "averaged over the steps, for each run and the full batch; the largest per-step "
            "gap to the full batch of the router term and of the token loss (the two terms of "
            "the logged window loss); and the weights' distance to the full batch with the term "
            "and, for the exact/fixed splits, trained without it (to a full batch without it). "
            "The router term's gap is the split's by definition; without it an exact split "
            "lands at the floor.",
            "\n".join(lines),
        ]
    )


def write_report(
    out_dir: Path,
    *,
    reference: ParityRun,
    summaries: list[RunSummary],
    precision: PrecisionView,
    what: str = "weights",
    micro_batch_tokens: int | None = None,
    fp32_reference: ParityRun | None = None,
    data: DataShape | None = None,
    distillation: Distillation | None = None,
    preference: Preference | None = None,
    policy: PolicyObjective | None = None,
    router: RouterTerm | None = None,
    fake_quantisation: FakeQuantisation | None = None,
) -> Path:
    """Write ``report.md``, ``parity.png``, ``summary.json`` and ``tensorboard/`` into ``out_dir``.

    ``micro_batch_tokens`` is the budget of the ``token_budget`` runs, for the report to name;
    ``fp32_reference`` the fp32 full-batch run below fp32 (``precision.below_fp32``);
    ``data`` what the full batch's samples say about stock torchtune's gap; ``distillation``
    the KD mix every run trained, for a KD config; ``preference`` what a DPO config trained,
    ``policy`` what a GRPO config trained under one loss_aggregation (either's section on its
    baseline's gap then replaces ``data``'s); ``router`` a mixture-of-experts config's router
    term, which every run added (see [router term in the parity report]);
    ``fake_quantisation`` a QAT config's quantizer, which every run trained under.
    Returns the report's path.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tensorboard(out_dir / "tensorboard", summaries)
    figure = "![parity](parity.png)"
    if _has_matplotlib():
        plot(out_dir / "parity.png", reference, summaries, precision, what, fp32_reference)
    else:
        figure = "(No figure: matplotlib is not installed; `pip install exactga[parity]`.)"
        warnings.warn(f"parity report without its figure: {figure}", stacklevel=2)
    where = ""
    if split_legend(summaries).endswith("ranks"):
        where = " A split BxGxN trains data-parallel over N ranks (FSDP2), BxG on one device."
    comparison = micro_batching_section(summaries, reference, micro_batch_tokens, what)
    gap_section = stock_gap_section if distillation is None else stock_kd_gap_section
    gaps = [gap_section(data)] if data is not None else []
    baselines = "The baselines run fixed micro-batches only (regrouping changes what they "
    baselines += "optimise)."
    objective = [distillation.describe()] if distillation is not None else []
    objective += [router.describe()] if router is not None else []
    objective += [fake_quantisation.describe()] if fake_quantisation is not None else []
    for view in (preference, policy):
        if view is not None:
            objective, baselines = [view.describe()], view.baselines()
            gaps = [view.gap_section(reference, summaries)]
    text = "\n\n".join(
        [
            "# GA parity report",
            *objective,
            f"Full-batch reference: {reference.split} on one device, {len(reference.losses)} "
            f"optimizer steps.{where} Relative L2 = ||w - w_full|| / ||w_full - w_0|| over the "
            f"{what}; max loss gap = largest per-step difference of the logged window loss. "
            f"{baselines}",
            *([precision_section(precision, what)] if precision.below_fp32 else []),
            markdown_table(summaries, reference, precision, what),
            f"**Verdict:** {verdict(summaries, precision)}",
            *([router_section(router, reference, summaries)] if router is not None else []),
            *gaps,
            *([comparison] if comparison else []),
            figure,
        ]
    )
    report = out_dir / "report.md"
    report.write_text(text + "\n")
    numbers = {
        "reference": reference.split,
        "reference_losses": reference.losses,
        "reference_num_positions": reference.num_positions,
        "reference_num_sample_positions": reference.num_sample_positions,
        "dtype": precision.dtype,
        "master_weights": precision.master_weights,
        "noise_floor": precision.noise_floor,
        "floor": precision.floor,  # the verdict's: noise_floor, or below fp32 see the report
        # Below fp32: the full batch's relative L2 to the fp32 full batch, and its losses.
        "reference_relative_l2_to_fp32": precision.reference_to_fp32,
        "fp32_reference_losses": fp32_reference.losses if fp32_reference is not None else None,
        "micro_batch_tokens": micro_batch_tokens,
        "data": dataclasses.asdict(data) if data is not None else None,
        # A KD config's mix (kd_ratio, losses, teacher); None for the causal-LM loss alone.
        "distillation": dataclasses.asdict(distillation) if distillation is not None else None,
        # A DPO config's loss and reference; None for a token loss. Counts are in `units`.
        "preference": preference.as_json() if preference is not None else None,
        # A GRPO config's aggregation, samples and rewards; None otherwise.
        "policy": policy.as_json() if policy is not None else None,
        # A mixture-of-experts config's router term (coefficient, objective); None without.
        "router": router.as_json() if router is not None else None,
        # A QAT config's quantizer (class, group size, fake_quant_after_n_steps); None without.
        "fake_quantisation": (
            dataclasses.asdict(fake_quantisation) if fake_quantisation is not None else None
        ),
        "reference_term_losses": reference.term_losses,
        # What units_per_micro_batch counts: loss_tokens, pairs, completion_tokens, completions.
        "units": reference.units_name,
        "runs": [
            {**dataclasses.asdict(s), "padding_fraction": s.padding_fraction}
            for s in sorted_runs(summaries)
        ],
    }
    (out_dir / "summary.json").write_text(json.dumps(numbers, indent=2) + "\n")
    return report
