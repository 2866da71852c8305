"""The three copy-and-edit examples of docs/editing_recipes.md, through ``tune cp``, ``tune run``.

Each copies a shipped recipe with ``tune cp`` into a folder outside the repository, changes one
line of its loop as the page shows, and runs it there:

1. a loss term (an L2 penalty on the weights) added to every micro-batch's loss counts exactly
   once per step: with SGD it lands on the stock recipe's weights under SGD's own weight decay;
2. a clipping of one's own (by value) bounds every weight's move per step;
3. a metric of one's own is logged on logged steps, beside the step's.
The first and third share one run. Three families, three runs each, on small models:
plain SFT (the penalty's run on another split of the same batch), a Qwen3 MoE model with the
router's balance term on (a further term over its own units), and LoRA DPO with ``rpo_alpha``
(an NLL term over the chosen tokens). Under those two terms the loss step used to return the
vector of the term means, which the added penalty broadcast into: it entered the step twice
(the SFT check there measures 2x the decay); see [one return type for every loss step] in
exactga.accumulation.micro_batch_loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dpo_utils import initial_adapters, trained_adapters
from omegaconf import OmegaConf
from recipe_utils import (
    INITIAL,
    SMALL_MODEL,
    TINY_QWEN3_MOE,
    TRAINED,
    load_weights,
    output_of,
    read_scalars,
    relative_l2,
    run_recipe,
    tune_in_process,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("editing_recipes")]

STEPS = 4
WEIGHT_DECAY = 0.01
CLIP_VALUE = 1e-4
LR = 1.0  # SGD, constant: a clipped step moves a weight by at most LR * CLIP_VALUE
# The launch settings every run shares: plain SGD at a constant rate, no norm clipping (the
# copy's clipping would see the penalty's gradient, SGD applies its weight decay after it).
COMMON = {
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": LR,
    "lr_scheduler": "null",
    "clip_grad_norm": "null",
    "max_steps_per_epoch": STEPS,
    "log_every_n_steps": 2,
}

# The loop's lines the edits replace, as recipes/full_finetune.py has them.
LOSS_LINE = "loss = self._loss_step(batch)  # forward and mean loss: edit here"
STEP_LINE = "outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)"
END_STEP_LINE = "steps.end_step(window, outcome)"
TRAIN_DEF = "def train(self) -> None:\n"

PENALTY = (
    "loss = self._loss_step(batch) + 0.5 * wd * sum(p.pow(2).sum() for p in "
    "self._model.parameters())"
)
OWN_METRIC = (
    'steps.end_step(window, outcome, metrics={"my/micro_batches": len(window.micro_batches)})'
)
CLIP = (
    "outcome = window.step(self._optimizer, clip=lambda params: "
    f"torch.nn.utils.clip_grad_value_(params, {CLIP_VALUE}))"
)


def _edited(source: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        assert old in source, f"the loop no longer has {old!r}: update docs/editing_recipes.md"
        source = source.replace(old, new, 1)
    return source


@dataclass(frozen=True)
class Family:
    """A shipped recipe and tiny config to copy, what the copied config changes, and the split
    of each run (the penalty's run may take another split of the same batch where the loss is
    split-invariant; the router's balance term is per micro-batch, so its runs share one)."""

    recipe: str
    config: str
    config_edits: dict[str, object] = field(default_factory=dict)
    overrides: dict[str, object] = field(default_factory=dict)
    stock_split: dict[str, object] = field(default_factory=dict)
    edited_split: dict[str, object] = field(default_factory=dict)
    adapters: bool = False  # LoRA: compare the adapters


TWO_BY_FOUR = {"batch_size": 2, "gradient_accumulation_steps": 4}
FAMILIES = {
    "sft": Family(
        "exactga/full_finetune_single_device",
        "exactga/tiny/full_single_device",
        overrides=SMALL_MODEL,
        edited_split=TWO_BY_FOUR,
    ),
    "moe_router": Family(
        "exactga/full_finetune_single_device",
        "exactga/tiny/full_single_device",
        config_edits={
            "model": TINY_QWEN3_MOE,
            "checkpointer.model_type": "QWEN3_MOE",
            "router_aux_loss_coef": 0.01,
        },
        stock_split=TWO_BY_FOUR,
        edited_split=TWO_BY_FOUR,
    ),
    "dpo_rpo": Family(
        "exactga/lora_dpo_single_device",
        "exactga/tiny/lora_dpo_single_device",
        overrides={**SMALL_MODEL, "rpo_alpha": 0.5},
        stock_split={"batch_size": 4, "gradient_accumulation_steps": 2},
        edited_split=TWO_BY_FOUR,
        adapters=True,
    ),
}


def _run(folder: Path, recipe: str, name: str, **overrides: object) -> Path:
    """Launch ``recipe`` (a file in ``folder``, or an exactga name) on the copied config."""
    output_dir = folder / "outputs" / name
    settings = {**COMMON, **overrides, "output_dir": output_dir}
    args = [recipe, "--config", "my_config.yaml", *(f"{k}={v}" for k, v in settings.items())]
    proc = run_recipe(args, cwd=folder)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    return output_dir


def _copy(family: Family, folder: Path) -> None:
    """The recipe and its config, copied as a user copies them (``tune cp``, by torchtune's own
    parser in this process: tests/test_registry.py checks what it copies), the config then
    edited."""
    tune_in_process("cp", family.recipe, str(folder / "stock_copy.py"))
    tune_in_process("cp", family.config, str(folder / "my_config.yaml"))
    if family.config_edits:
        cfg = OmegaConf.load(folder / "my_config.yaml")
        for key, value in family.config_edits.items():
            OmegaConf.update(cfg, key, value, merge=False)
        OmegaConf.save(cfg, folder / "my_config.yaml")


@pytest.fixture(scope="module", params=list(FAMILIES))
def runs(request, tmp_path_factory) -> dict[str, object]:
    family = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(f"my_project_{request.param}")
    _copy(family, folder)
    stock = (folder / "stock_copy.py").read_text()
    in_loss = _edited(
        stock,
        [
            (TRAIN_DEF, f"{TRAIN_DEF}        wd = {WEIGHT_DECAY}\n"),
            (LOSS_LINE, PENALTY),
            (END_STEP_LINE, OWN_METRIC),
        ],
    )
    (folder / "weight_decay_in_loss.py").write_text(in_loss)
    (folder / "clip_by_value.py").write_text(_edited(stock, [(STEP_LINE, CLIP)]))
    shared = family.overrides
    return {
        "family": family,
        "stock": _run(
            folder,
            "stock_copy.py",
            "stock",
            **shared,
            **family.stock_split,
            **{"optimizer.weight_decay": WEIGHT_DECAY},
        ),
        "in_loss": _run(
            folder,
            "weight_decay_in_loss.py",
            "in_loss",
            **shared,
            **family.edited_split,
            **{"optimizer.weight_decay": 0},
        ),
        "clipped": _run(
            folder, "clip_by_value.py", "clipped", **shared, **{"optimizer.weight_decay": 0}
        ),
    }


def _initial_and_trained(runs: dict[str, object], name: str) -> tuple[dict, dict]:
    """The weights a run started from and ended on (a LoRA run's adapters)."""
    output = runs[name]
    if runs["family"].adapters:
        return initial_adapters(), trained_adapters(output, 0)
    return load_weights(output / INITIAL), load_weights(output / TRAINED)


def test_a_loss_term_added_in_the_loop_counts_once_per_step(runs) -> None:
    """The edited copy's weights minus the shipped copy's: 0 to fp32 rounding where the term
    enters exactly once (1.000x SGD's decay): measured 2.1e-7 (SFT), 7.6e-7 (MoE), 5.6e-7 (DPO).
    Counted twice (the router's and RPO's vectors of term means, before) it was 6.2e-1 (MoE)
    and 1.2e-1 (DPO)."""
    initial, stock = _initial_and_trained(runs, "stock")
    _, in_loss = _initial_and_trained(runs, "in_loss")
    gap = relative_l2(in_loss, stock, initial)
    print(f"{runs['stock'].parent.parent.name}: in-loss vs SGD weight decay, relative L2 {gap:.2e}")
    assert gap < 1e-5  # fp32: SGD's decay vs the term's gradient


def test_a_metric_of_ones_own_is_logged_on_logged_steps(runs) -> None:
    scalars = read_scalars(runs["in_loss"] / "logs")
    assert len(scalars["loss"]) == STEPS // 2  # logged every 2nd step
    # by_length cuts a window of 8 samples (pairs) into gradient_accumulation_steps micro-batches
    assert scalars["my/micro_batches"] == [4.0] * (STEPS // 2)


def test_a_clipping_of_ones_own_bounds_every_weights_move(runs) -> None:
    initial, trained = _initial_and_trained(runs, "clipped")
    moves = [(trained[name].double() - initial[name].double()).abs().max() for name in initial]
    largest = max(float(move) for move in moves)
    assert largest <= STEPS * LR * CLIP_VALUE * (1 + 1e-3)
    assert largest >= LR * CLIP_VALUE / 2  # it trained, and the clip bound some weight
