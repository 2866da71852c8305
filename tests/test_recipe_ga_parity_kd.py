"""The GA parity report on a knowledge-distillation config: its KD keys, and through one
``tune run`` that the report trains the KD mix, says so, lands exact splits at the fp32 floor
and stock torchtune's KD weighting (``post_scale``) above it. See [stock kd weighting] in
exactga.kd.distillation; the SFT report: tests/test_recipe_ga_parity.py."""

from __future__ import annotations

import json
import warnings

import pytest
from kd_utils import SMALL_TEACHER
from omegaconf import OmegaConf
from recipe_utils import SMALL_MODEL, output_of, run_recipe
from run_hooks import NO_FIGURE

from exactga.config.validation import validate_config
from exactga.parity.schema import GaParityConfig

PARITY_RECIPE = "recipes/ga_parity.py"
KD_CONFIG = "configs/tiny/ga_parity_kd.yaml"
SPLITS = ("1x8", "2x4")
MODES = ("naive", "post_scale", "exact")
MICRO_BATCHINGS = ("fixed", "by_length")
KD_RATIO = 0.75  # not the default, so the report's figure shows the key was read
# Fixed bounds, never the report's own floor (only checked to be the config's), measured with
# ``pytest tests/test_recipe_ga_parity_kd.py -p no:xdist -m slow -rP`` (4 steps, fp32, relative
# L2 to the full batch): exact 1.3e-6 to 2.1e-6, fp32's rounding of other summation orders, bounded
# about 2.4x above; stock's post_scale 4.4e-1 to 7.1e-1, bounded about 4x below.
KD_EXACT_BOUND = 5e-6
KD_STOCK_MIN = 1e-1


@pytest.fixture(scope="module")
def kd_report(run_once):
    """``report.md`` and ``summary.json`` of one KD launch (4 steps, 9 runs), as (text, dict)."""

    def make(out):
        overrides = {
            **SMALL_MODEL,
            **SMALL_TEACHER,
            "output_dir": out,
            "kd_ratio": KD_RATIO,
            "parity.num_steps": 4,
            "parity.splits": f"[{','.join(SPLITS)}]",
            "parity.modes": f"[{','.join(MODES)}]",
            "parity.micro_batching": f"[{','.join(MICRO_BATCHINGS)}]",
        }
        args = [PARITY_RECIPE, "--config", KD_CONFIG, *(f"{k}={v}" for k, v in overrides.items())]
        # The numbers only: the figure is tests/test_recipe_ga_parity.py's (tests/run_hooks.py).
        proc = run_recipe(args, extra_env={NO_FIGURE: "1"})
        assert proc.returncode == 0, output_of(proc)[-4000:]

    report_dir = run_once("ga_parity_kd", make) / "parity"
    summary = json.loads((report_dir / "summary.json").read_text())
    return (report_dir / "report.md").read_text(), summary


@pytest.mark.xdist_group("ga_parity_kd")
@pytest.mark.slow
def test_kd_report_lands_exact_splits_at_the_floor_and_stocks_above(kd_report):
    report, summary = kd_report
    runs = {(r["mode"], r["micro_batching"], r["split"]): r for r in summary["runs"]}
    expected = {(m, "fixed", s) for m in MODES for s in SPLITS}
    expected |= {("exact", "by_length", s) for s in SPLITS}
    assert set(runs) == expected
    exact = [r for r in summary["runs"] if r["mode"] == "exact"]
    worst_exact = max(r["relative_l2"] for r in exact)
    for run in summary["runs"]:
        print(f"{run['mode']}/{run['micro_batching']} {run['split']}: {run['relative_l2']:.3e}")
    assert summary["noise_floor"] == summary["floor"] == 1e-5  # the config's, in fp32
    assert worst_exact <= KD_EXACT_BOUND
    for split in SPLITS:  # stock's KD weighting: every micro-batch's mean weighs the same
        stock = runs["post_scale", "fixed", split]
        assert stock["relative_l2"] > KD_STOCK_MIN
        assert stock["relative_l2"] > 100 * worst_exact
    assert "**Verdict:** EXACT: every exact-mode run (fixed, by_length" in report


@pytest.mark.xdist_group("ga_parity_kd")
@pytest.mark.slow
def test_kd_report_says_it_distilled_and_with_which_mix(kd_report):
    report, summary = kd_report
    assert summary["distillation"] == {
        "kd_ratio": KD_RATIO,
        "loss": "CEWithChunkedOutputLoss",
        "kd_loss": "ForwardKLWithChunkedOutputLoss",
        "teacher": "torchtune.models.llama3_2.llama3_2",
    }
    header = report.split("| mode |")[0]
    assert "**Objective: knowledge distillation.**" in header
    assert "loss = 0.25 x `CEWithChunkedOutputLoss` + 0.75 x `ForwardKLWithChunkedOutputLoss`" in (
        header
    )
    assert "(`kd_ratio: 0.75`)" in header
    gap = report.split("## Where stock torchtune's gap comes from")[1]
    assert "Stock torchtune 0.6.1's KD recipe (`post_scale`)" in gap
    assert "so stock's gap shows in the `post_scale` rows above" in gap


def _kd_config(**overrides: object):
    cfg = OmegaConf.load(KD_CONFIG)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_the_shipped_kd_parity_config_holds_only_keys_the_report_reads():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = validate_config(_kd_config(), GaParityConfig, "ga_parity")
    assert cfg.teacher_model is not None and cfg.kd_ratio == 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kd_loss": None}, "config key 'kd_loss' is needed with teacher_model"),
        ({"teacher_checkpointer": None}, "config key 'teacher_checkpointer' is needed"),
        ({"kd_ratio": 1.5}, "config key 'kd_ratio' must be in \\[0, 1\\], got 1.5"),
    ],
)
def test_bad_kd_keys_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_kd_config(**overrides), GaParityConfig, "ga_parity")


def test_kd_keys_without_a_teacher_are_named_as_ignored():
    cfg = _kd_config(teacher_model=None, teacher_checkpointer=None)
    with pytest.warns(UserWarning, match="config key 'kd_loss' ignored: without teacher_model"):
        validate_config(cfg, GaParityConfig, "ga_parity")
