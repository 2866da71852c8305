"""recipes/full_finetune.py run through the real ``tune run`` on CPU.

Tier (b) of docs/contributing.md point 9: a tiny model on the shipped data, in a subprocess,
offline. The recipe is never imported; everything is read back from what a run writes (checkpoints
and TensorBoard events).

Run the parity tests with ``-rP`` to see the measured distances, which docs/ quotes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torchtune
from many_runs import launch_runs, run_of
from omegaconf import OmegaConf
from recipe_utils import (
    EMPTY_WINDOW_RUN,
    INITIAL,
    RECIPE,
    REPO_ROOT,
    TINY_CONFIG,
    TRAINED,
    load_weights,
    read_scalars,
    relative_l2,
    rows_with_an_empty_window,
    tiny_args,
)

# Every run of the module is made by one fixture (``runs``), so its tests are one xdist group.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("full_single_device")]

STOCK_CONFIG = (
    Path(torchtune.__file__).resolve().parent.parent
    / "recipes/configs/llama3_2/1B_full_single_device.yaml"
)

# Steps of 8 sequences; no clipping, which would make the update depend on the norm of
# the full gradient only up to rounding anyway, but keeps the comparison about the loss alone.
# Warm-up is dropped so that the first step's learning rate is not zero. Two steps already make
# the optimizer state and the second step's weights count; SGD's splits sit at ~3e-7 from the
# first steps on (4 steps measured ~3e-7; 2 steps 2.5e-7 to 3.5e-7, 2026-11-29), so SGD runs 2,
# and the negative control with it (naive 1x8 1.5e-1 from 8x1 after 2). Fewer steps raise the
# AdamW floor: its first updates divide tiny gradients by their own magnitude, so their rounding
# weighs more against the distance travelled (3 steps measured ~9e-6, 4 up to 5.8e-6, 6 up to
# 4.7e-6, 12 ~3e-7): AdamW runs 6.
PARITY_STEPS = {"sgd": 2, "adamw": 6}
SPLITS = [(8, 1), (1, 8), (2, 4)]  # batch_size x gradient_accumulation_steps
OPTIMIZERS = {
    # The tiny config's AdamW has weight_decay, which SGD would also accept; removed so that
    # SGD is plain gradient descent. The lr is large so the update dwarfs fp32 rounding.
    "sgd": ["optimizer._component_=torch.optim.SGD", "optimizer.lr=0.5", "~optimizer.weight_decay"],
    "adamw": [],  # the tiny config's AdamW(lr=1e-3, weight_decay=0.01)
}
PARITY_TOLERANCE = 1e-5


def _train_args(
    output_dir: Path,
    batch_size: int,
    ga: int,
    optimizer: str,
    extra: list[str],
    **overrides: object,
) -> list[str]:
    """The ``tune run`` arguments of ``optimizer``'s PARITY_STEPS steps with this split."""
    args = tiny_args(
        output_dir,
        batch_size=batch_size,
        gradient_accumulation_steps=ga,
        max_steps_per_epoch=PARITY_STEPS[optimizer],
        clip_grad_norm="null",
        lr_scheduler__num_warmup_steps=0,
        **overrides,
    )
    return args + extra


PARITY_CASES = [(opt, toi) for opt in OPTIMIZERS for toi in (True, False)]
# The negative control's runs: the mean of micro-batch means, SGD, every first label kept.
NAIVE_EXTRA = [
    *OPTIMIZERS["sgd"],
    "loss_normalization=naive",
    "micro_batching=fixed",
    "dataset.train_on_input=True",
]
NAIVE_SPLITS = [(8, 1), (1, 8)]


def _case_id(optimizer: str, train_on_input: bool) -> str:
    return f"{optimizer}-{'train_on_input' if train_on_input else 'masked_input'}"


# The stock llama3_2/1B model at the small sizes, for test_stock_torchtune_config_runs_unchanged.
STOCK_MODEL = {
    "_component_": "torchtune.models.llama3_2.llama3_2",
    "vocab_size": 2048,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "intermediate_dim": 128,
    "max_seq_len": 512,
}
# test_bad_config_fails_naming_the_key's cases: id -> (override, words of the message).
BAD_CONFIGS = {
    "misspelt_key": (
        "gradient_acumulation_steps=2",
        [
            "unknown config key 'gradient_acumulation_steps'",
            "Did you mean 'gradient_accumulation_steps'?",
        ],
    ),
    "bad_mode": ("loss_normalization=bogus", ["config key 'loss_normalization'='bogus'", "exact"]),
}


def _stock_config_args(root: Path) -> list[str]:
    """torchtune 0.6.1's own llama3_2/1B config file, only overridden from the command line,
    with a small initial checkpoint written here."""
    from exactga.models.random_init_checkpointer import write_initial_checkpoint

    checkpoint_dir = root / "base"
    write_initial_checkpoint(OmegaConf.create(STOCK_MODEL), checkpoint_dir, "model.safetensors", 0)
    overrides = {
        **{f"model.{key}": value for key, value in STOCK_MODEL.items()},
        "tokenizer._component_": "torchtune.models.llama2.llama2_tokenizer",
        "tokenizer.path": REPO_ROOT / "configs/tiny/tokenizer.model",
        "tokenizer.max_seq_len": 256,
        "dataset.source": "json",
        "dataset.data_files": REPO_ROOT / "configs/tiny/data.json",
        "dataset.split": "train",
        "checkpointer.checkpoint_dir": checkpoint_dir,
        "optimizer._component_": "torch.optim.AdamW",
        "device": "cpu",
        "dtype": "fp32",
        "output_dir": root / "out",
        "max_steps_per_epoch": 2,
    }
    return [RECIPE, "--config", str(STOCK_CONFIG), *(f"{k}={v}" for k, v in overrides.items())]


def _launch_all(root: Path) -> None:
    """Every run of the module, one after another, each forked from the tests' server
    (tests/many_runs.py: still the recipe as ``tune run`` starts it), a failing run (the bad
    configs must fail) failing no other, each keeping its own status and output: every split of
    every parity case, the negative control's two runs, then the single runs of the tests
    below, each in ``root / <name>`` (its output directory ``root / <name> / out``)."""
    runs = []
    for optimizer, train_on_input in PARITY_CASES:
        for bs, ga in SPLITS:
            out = root / _case_id(optimizer, train_on_input) / f"{bs}x{ga}"
            extra = OPTIMIZERS[optimizer]
            args = _train_args(
                out, bs, ga, optimizer, extra, dataset__train_on_input=train_on_input
            )
            runs.append(run_of(args, out)[1])
    for bs, ga in NAIVE_SPLITS:
        out = root / "naive" / f"{bs}x{ga}"
        runs.append(run_of(_train_args(out, bs, ga, "sgd", NAIVE_EXTRA), out)[1])

    data = root / "empty_window.json"
    data.write_text(json.dumps(rows_with_an_empty_window()))
    single = {
        "empty_window": tiny_args(
            root / "empty_window" / "out", dataset__data_files=data, **EMPTY_WINDOW_RUN
        ),
        # The tiny default itself (full size), two steps.
        "default": [
            RECIPE,
            "--config",
            TINY_CONFIG,
            f"output_dir={root / 'default' / 'out'}",
            "max_steps_per_epoch=2",
        ],
        "stock_config": _stock_config_args(root / "stock_config"),
        **{
            f"bad_config_{case}": [*tiny_args(root / f"bad_config_{case}" / "out"), override]
            for case, (override, _) in BAD_CONFIGS.items()
        },
        "traceback_switch": [
            *tiny_args(root / "traceback_switch" / "out"),
            "tokenizer.path=missing/tokenizer.model",
        ],
    }
    for name, args in single.items():
        nproc, run = run_of(args, root / name)
        assert nproc == 0
        env = {"EXACTGA_TRACEBACK": "1"} if name == "traceback_switch" else None
        runs.append(run._replace(env=env))
    launch_runs(runs, nproc=0)


@pytest.fixture(scope="module")
def runs(run_once):
    """``runs(name, ok=True)``: the folder of the run ``name`` (a parity run's is
    ``<case id>/<bs>x<ga>``) and its output, with its status checked: 0, or with ``ok=False``
    not 0."""
    root = run_once("full_single_device_runs", _launch_all)

    def get(name: str, ok: bool = True) -> tuple[Path, str]:
        folder = root / name
        output = (folder / "output.txt").read_text()
        status = (folder / "returncode").read_text()
        assert (status == "0") == ok, f"{name}: status {status}\n{output[-4000:]}"
        return folder, output

    return get


@pytest.fixture(scope="module")
def parity_runs(runs):
    """``case id -> {(bs, ga): folder}``, every run checked to have succeeded."""

    def get(case_id: str, splits=SPLITS) -> dict[tuple[int, int], Path]:
        return {(bs, ga): runs(f"{case_id}/{bs}x{ga}")[0] for bs, ga in splits}

    return get


@pytest.mark.parametrize("train_on_input", [True, False], ids=["train_on_input", "masked_input"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_accumulation_splits_match_full_batch(parity_runs, optimizer, train_on_input):
    """8x1, 1x8 and 2x4 train to the same weights (relative L2 <= 1e-5)."""
    runs = parity_runs(_case_id(optimizer, train_on_input))
    reference = runs[SPLITS[0]]
    w_init = load_weights(reference / INITIAL)
    w_ref = load_weights(reference / TRAINED)
    ref_scalars = read_scalars(reference / "logs")
    assert len(ref_scalars["loss"]) == PARITY_STEPS[optimizer]

    for (bs, ga), run_dir in runs.items():
        if run_dir == reference:
            continue
        # Same windows: the sampler's order depends on the seed and epoch only, so every split
        # sees the same 8 sequences per step and hence the same loss-token counts.
        scalars = read_scalars(run_dir / "logs")
        assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]
        assert load_weights(run_dir / INITIAL).keys() == w_init.keys()
        rel = relative_l2(load_weights(run_dir / TRAINED), w_ref, w_init)
        print(
            f"{optimizer} train_on_input={train_on_input} {bs}x{ga} vs 8x1: "
            f"relative L2 {rel:.3e}; losses {scalars['loss']} vs {ref_scalars['loss']}"
        )
        assert rel <= PARITY_TOLERANCE, f"{bs}x{ga} differs from 8x1 by {rel:.3e}"


def test_naive_normalization_breaks_parity(parity_runs):
    """Negative control: the check above has teeth. The mean of micro-batch means (naive)
    weighs short sequences up, so 1x8 moves away from 8x1 by far more than the tolerance."""
    runs = parity_runs("naive", NAIVE_SPLITS)
    full, accumulated = runs[(8, 1)], runs[(1, 8)]
    rel = relative_l2(
        load_weights(accumulated / TRAINED),
        load_weights(full / TRAINED),
        load_weights(full / INITIAL),
    )
    print(f"naive sgd train_on_input=True 1x8 vs 8x1: relative L2 {rel:.3e}")
    assert rel > 1e-4


def test_windows_without_loss_tokens_are_skipped(runs):
    """Prompts longer than max_seq_len leave every label masked; such a window skips its step."""
    folder, out = runs("empty_window")
    assert "no loss token in this accumulation window" in out
    scalars = read_scalars(folder / "out/logs")
    assert scalars["skipped_steps"][-1] >= 1
    assert scalars["loss_tokens"][0] == 0
    assert all(n > 0 for n in scalars["loss_tokens"][1:])
    for name, tensor in load_weights(folder / "out" / TRAINED).items():
        assert torch.isfinite(tensor).all(), f"{name} is not finite"


def test_default_run_writes_checkpoint_and_metrics(runs):
    """The tiny default itself (full size), two steps: artefacts and metric names."""
    out_dir = runs("default")[0] / "out"
    assert (out_dir / TRAINED).is_file()
    assert (out_dir / "epoch_0/config.json").is_file()

    scalars = read_scalars(out_dir / "logs")
    for name in ("loss", "lr", "tokens_per_second_per_gpu", "loss_tokens", "skipped_steps"):
        assert len(scalars.get(name, [])) == 2, f"metric {name!r}: {scalars.get(name)}"
    assert all(math.isfinite(v) for v in scalars["loss"])
    # A fresh model predicts about uniformly over the 2048-token vocabulary.
    assert 5 < scalars["loss"][0] < 9, scalars["loss"]
    assert scalars["skipped_steps"] == [0, 0]


def test_stock_torchtune_config_runs_unchanged(runs):
    """torchtune 0.6.1's own llama3_2/1B config file, only overridden from the command line."""
    out_dir = runs("stock_config")[0] / "out"
    assert (out_dir / TRAINED).is_file()
    # The file itself was not touched and still steps the optimizer inside backward.
    assert OmegaConf.load(STOCK_CONFIG).optimizer_in_bwd is True


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_fails_naming_the_key(runs, case):
    """One message, no traceback (see [user errors] in exactga.launch.cli), before the resolved
    config is printed."""
    folder, out = runs(f"bad_config_{case}", ok=False)
    assert (folder / "returncode").read_text() == "1", out[-4000:]
    for text in BAD_CONFIGS[case][1]:
        assert text in out, out[-4000:]
    assert "Traceback" not in out and "EXACTGA_TRACEBACK=1 shows it" in out, out[-4000:]
    assert "Running FullFinetuneRecipeSingleDevice with resolved config" not in out
    assert "(the full resolved config: " not in out  # exactga's summary of it
    assert not (folder / "out" / TRAINED).exists()


def test_the_traceback_switch_shows_a_user_error_traceback(runs):
    _, out = runs("traceback_switch", ok=False)
    assert "Traceback" in out and "config key 'tokenizer.path': no file at" in out, out[-4000:]
