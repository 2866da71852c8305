"""The GA parity report: its split parsing, and through ``tune run`` the numbers it shows and
that it is drawn. Splits across ranks: tests/test_ga_parity_distributed.py."""

from __future__ import annotations

import json

import pytest
from recipe_utils import SMALL_MODEL, output_of, read_scalars, run_tune

from exactga.parity.scoring import Split, parse_splits

PARITY_RECIPE = "recipes/ga_parity.py"
CONFIGS = {
    "full": "configs/tiny/ga_parity_full.yaml",
    "lora": "configs/tiny/ga_parity_lora.yaml",
}
MODES = ("naive", "post_scale", "exact")
SPLITS = ("1x8", "2x4")


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_report_separates_the_modes_and_draws_them(tmp_path, kind):
    args = [
        PARITY_RECIPE,
        "--config",
        CONFIGS[kind],
        f"output_dir={tmp_path}",
        *(f"{key}={value}" for key, value in SMALL_MODEL.items()),
        "parity.num_steps=4",
        f"parity.splits=[{','.join(SPLITS)}]",
    ]
    proc = run_tune(args)
    assert proc.returncode == 0, output_of(proc)[-4000:]

    report_dir = tmp_path / "parity"
    summary = json.loads((report_dir / "summary.json").read_text())
    by_mode = {mode: [r for r in summary["runs"] if r["mode"] == mode] for mode in MODES}
    assert {r["split"] for r in summary["runs"]} == set(SPLITS)

    worst_exact_l2 = max(r["relative_l2"] for r in by_mode["exact"])
    worst_exact_gap = max(r["max_loss_gap"] for r in by_mode["exact"])
    assert worst_exact_l2 <= summary["noise_floor"]  # exact sits at the fp32 floor
    for naive in by_mode["naive"]:  # naive is orders of magnitude away, in weights and loss
        assert naive["relative_l2"] > 100 * worst_exact_l2
        assert naive["max_loss_gap"] > 10 * max(worst_exact_gap, 1e-7)
    for stock in by_mode["post_scale"]:  # train_on_input: stock's count is off too
        assert stock["relative_l2"] > 10 * worst_exact_l2

    report = (report_dir / "report.md").read_text()
    assert "**Verdict:** EXACT" in report
    assert report.count("| exact |") == len(SPLITS)
    png = (report_dir / "parity.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    for mode in MODES:  # one TensorBoard run per mode and split, each with every step's loss
        for split in SPLITS:
            assert len(read_scalars(report_dir / "tensorboard" / f"{mode}_{split}")["loss"]) == 4


def test_splits_parse_with_and_without_ranks():
    assert parse_splits(["1x8", "2X4", " 2x2x2 ", "8x1x1"], world_size=2) == [
        Split(1, 8),
        Split(2, 4),
        Split(2, 2, 2),
        Split(8, 1, 1),
    ]
    assert [str(s) for s in parse_splits(["1x8x1", "1x4x2"], world_size=2)] == ["1x8", "1x4x2"]
    assert Split.parse("1x4x2").global_batch == 8


@pytest.mark.parametrize(
    ("splits", "world_size", "message"),
    [
        (["1x8", "2x4y"], 1, "'2x4y' is not 'BxG' or 'BxGxN'"),
        (["8"], 1, "'8' is not 'BxG' or 'BxGxN'"),
        (["1x2x2x2"], 8, "is not 'BxG' or 'BxGxN'"),
        (["0x8"], 1, "needs every number >= 1"),
        ([], 1, "is empty"),
        (["1x8", "1x8x1"], 1, "lists 1x8 twice"),
        (["1x8", "1x4x2"], 1, "runs in one process; launch it with 'tune run --nproc_per_node 2"),
        (["1x8", "1x2x4"], 2, "this launch has 2 processes.*\\(BxGx2\\)"),
        (["1x8", "1x8x2"], 2, "same global batch \\(B\\*G\\*N\\), got \\[8, 16\\]"),
    ],
)
def test_bad_splits_name_the_key(splits, world_size, message):
    with pytest.raises(ValueError, match=f"config key 'parity.splits'.*{message}"):
        parse_splits(splits, world_size)
