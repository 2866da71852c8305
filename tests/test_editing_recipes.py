"""The three copy-and-edit examples of docs/editing_recipes.md, through ``tune cp``, ``tune run``.

Each copies the shipped full fine-tuning recipe with ``tune cp`` into a folder outside the
repository, changes one line of its loop as the page shows, and runs it there:

1. a loss term (an L2 penalty on the weights) added to every micro-batch's loss counts exactly
   once per step: with SGD it lands on the stock recipe's weights under SGD's own weight decay;
2. a clipping of one's own (by value) bounds every weight's move per step;
3. a metric of one's own is logged on logged steps, beside the step's.
The first and third share one launch; three launches in all, on the small model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_utils import (
    INITIAL,
    SMALL_MODEL,
    TRAINED,
    load_weights,
    output_of,
    read_scalars,
    relative_l2,
    run_tune,
    tune_env,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("editing_recipes")]

STEPS = 4
WEIGHT_DECAY = 0.01
CLIP_VALUE = 1e-4
LR = 1.0  # SGD, constant: a clipped step moves a weight by at most LR * CLIP_VALUE
# The launch settings every run shares: plain SGD at a constant rate, no norm clipping (the
# copy's clipping would see the penalty's gradient, SGD applies its weight decay after it).
COMMON = {
    **SMALL_MODEL,
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": LR,
    "lr_scheduler": "null",
    "clip_grad_norm": "null",
    "max_steps_per_epoch": STEPS,
    "log_every_n_steps": 2,
}

# The loop's lines the edits replace, as recipes/full_finetune_single_device.py has them.
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


def _tune_cp(*args: str) -> None:
    import subprocess

    from recipe_utils import TUNE

    proc = subprocess.run(
        [str(TUNE), "cp", *args], env=tune_env(), capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, output_of(proc)


def _edited(source: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        assert old in source, f"the loop no longer has {old!r}: update docs/editing_recipes.md"
        source = source.replace(old, new, 1)
    return source


def _run(folder: Path, recipe: str, name: str, **overrides: object) -> Path:
    """Launch ``recipe`` (a file in ``folder``, or an exactga name) on the copied config."""
    output_dir = folder / "outputs" / name
    settings = {**COMMON, **overrides, "output_dir": output_dir}
    args = [recipe, "--config", "my_config.yaml", *(f"{k}={v}" for k, v in settings.items())]
    proc = run_tune(args, cwd=folder)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    return output_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("my_project")
    _tune_cp("exactga/full_finetune_single_device", str(folder / "stock_copy.py"))
    _tune_cp("exactga/tiny/full_single_device", str(folder / "my_config.yaml"))
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
    return {
        "stock": _run(folder, "stock_copy.py", "stock", **{"optimizer.weight_decay": WEIGHT_DECAY}),
        # Another split of the same global batch: the term must not care.
        "in_loss": _run(
            folder,
            "weight_decay_in_loss.py",
            "in_loss",
            **{"optimizer.weight_decay": 0, "batch_size": 2, "gradient_accumulation_steps": 4},
        ),
        "clipped": _run(folder, "clip_by_value.py", "clipped", **{"optimizer.weight_decay": 0}),
    }


def test_a_loss_term_added_in_the_loop_counts_once_per_step_whatever_the_split(runs) -> None:
    initial = load_weights(runs["stock"] / INITIAL)
    stock = load_weights(runs["stock"] / TRAINED)
    in_loss = load_weights(runs["in_loss"] / TRAINED)
    assert relative_l2(in_loss, stock, initial) < 1e-5  # fp32: SGD's decay vs the term's gradient


def test_a_metric_of_ones_own_is_logged_on_logged_steps(runs) -> None:
    scalars = read_scalars(runs["in_loss"] / "logs")
    assert len(scalars["loss"]) == STEPS // 2  # logged every 2nd step
    # by_length cuts a window of 8 samples into gradient_accumulation_steps micro-batches
    assert scalars["my/micro_batches"] == [4.0] * (STEPS // 2)


def test_a_clipping_of_ones_own_bounds_every_weights_move(runs) -> None:
    initial = load_weights(runs["clipped"] / INITIAL)
    trained = load_weights(runs["clipped"] / TRAINED)
    moves = [(trained[name].double() - initial[name].double()).abs().max() for name in initial]
    largest = max(float(move) for move in moves)
    assert largest <= STEPS * LR * CLIP_VALUE * (1 + 1e-3)
    assert largest >= LR * CLIP_VALUE / 2  # it trained, and the clip bound some weight
