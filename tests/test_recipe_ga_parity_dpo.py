"""The GA parity report on a DPO config: its keys, and through one ``tune run`` that exact splits
land at the fp32 floor under every micro-batching, that stock DPO's weighting (``naive``) lands
there too while every micro-batch holds as many pairs and far off where they do not
(``token_budget``), and that the report counts pairs. See [stock dpo weighting] in
exactga.parity.preference; the SFT report: tests/test_recipe_ga_parity.py."""

from __future__ import annotations

import json
import warnings

import pytest
from omegaconf import OmegaConf
from recipe_utils import SMALL_MODEL, output_of, run_recipe
from run_hooks import NO_FIGURE

from exactga.accumulation.normalization import NormMode
from exactga.config.validation import validate_config
from exactga.data.micro_batching import MicroBatching
from exactga.dpo.schema import PAIR_COLLATE
from exactga.parity.preference import check_preference_keys, collate_fn_for
from exactga.parity.schema import GaParityConfig
from exactga.parity.scoring import Split, plan_runs

PARITY_RECIPE = "recipes/ga_parity.py"
DPO_CONFIG = "configs/tiny/ga_parity_dpo.yaml"
SPLITS = ("1x8", "2x4")
MICRO_BATCHINGS = ("fixed", "by_length", "token_budget")  # the shipped config lists all three
# The runs of one group: naive (stock DPO's weighting) under fixed and token_budget, exact
# under each micro-batching; no post_scale.
RUNS = {("naive", mb, split) for mb in ("fixed", "token_budget") for split in SPLITS}
RUNS |= {("exact", mb, split) for mb in MICRO_BATCHINGS for split in SPLITS}
# Fixed bounds, never the report's own floor (only checked to be the config's), measured with
# ``pytest tests/test_recipe_ga_parity_dpo.py -p no:xdist -m slow -rP`` (2 steps of 8 pairs,
# what a split's parity needs, SGD, fp32, relative L2 of the adapters to the full batch): exact
# 3.6e-7 to 4.1e-7 under every micro-batching (the config's 4 steps: 1.04e-6 to 1.14e-6), fp32's
# rounding of other summation orders, bounded about 7x above; naive under token_budget (1 to 3
# pairs a micro-batch) 0.61 (4 steps: 1.04), bounded 6x below.
DPO_EXACT_BOUND = 3e-6
DPO_NAIVE_UNEQUAL_MIN = 1e-1


@pytest.fixture(scope="module")
def dpo_report(run_once):
    """``report.md`` and ``summary.json`` of one LoRA DPO launch (2 steps, 11 runs), as
    (text, dict)."""

    def make(out):
        overrides = {
            **SMALL_MODEL,
            "output_dir": out,
            "parity.splits": f"[{','.join(SPLITS)}]",
            "parity.num_steps": 2,
        }
        args = [PARITY_RECIPE, "--config", DPO_CONFIG, *(f"{k}={v}" for k, v in overrides.items())]
        # The numbers only: the figure is tests/test_recipe_ga_parity.py's (tests/run_hooks.py).
        proc = run_recipe(args, extra_env={NO_FIGURE: "1"})
        (out / "launch.log").write_text(output_of(proc))
        assert proc.returncode == 0, output_of(proc)[-4000:]

    report_dir = run_once("ga_parity_dpo", make) / "parity"
    summary = json.loads((report_dir / "summary.json").read_text())
    return (report_dir / "report.md").read_text(), summary


@pytest.mark.slow
@pytest.mark.xdist_group("ga_parity_dpo")
def test_dpo_exact_lands_at_the_floor_and_naive_only_where_pairs_are_unequal(dpo_report):
    report, summary = dpo_report
    runs = {(r["mode"], r["micro_batching"], r["split"]): r for r in summary["runs"]}
    assert set(runs) == RUNS
    for run in summary["runs"]:
        print(
            f"{run['mode']}/{run['micro_batching']} {run['split']}: {run['relative_l2']:.3e} "
            f"({run['units_per_micro_batch']} pairs a micro-batch)"
        )
    assert summary["noise_floor"] == summary["floor"] == 1e-5  # the config's, in fp32
    worst_exact = max(r["relative_l2"] for r in summary["runs"] if r["mode"] == "exact")
    assert worst_exact <= DPO_EXACT_BOUND
    for split in SPLITS:
        batch_size = Split.parse(split).batch_size
        naive, exact = runs["naive", "fixed", split], runs["exact", "fixed", split]
        # Every fixed micro-batch of a full window holds batch_size pairs, so stock's 1/G is
        # exact's B/(B*G), the same float: the same run, to the bit.
        assert naive["units_per_micro_batch"] == [batch_size, batch_size]
        assert naive["relative_l2"] == exact["relative_l2"]
        # token_budget's micro-batches hold unequal numbers of pairs: stock's weighting is off.
        unequal = runs["naive", "token_budget", split]
        fewest, most = unequal["units_per_micro_batch"]
        assert fewest < most
        assert unequal["relative_l2"] > DPO_NAIVE_UNEQUAL_MIN
        assert unequal["relative_l2"] > 100 * worst_exact
    assert "**Verdict:** EXACT: every exact-mode run (fixed, by_length, token_budget" in report


@pytest.mark.slow
@pytest.mark.xdist_group("ga_parity_dpo")
def test_dpo_report_says_what_it_trained_and_counts_pairs(dpo_report):
    report, summary = dpo_report
    assert summary["units"] == "pairs"
    assert summary["preference"] == {
        "loss": "DPOLoss",
        "reference": "the policy with its adapters off",
        "units": "pairs",
    }
    assert summary["data"] is None and summary["distillation"] is None
    assert "**Objective: direct preference optimisation.**" in report.split("| mode |")[0]
    assert "| post_scale |" not in report
    gap = report.split("## Where stock DPO's gap comes from")[1].split("## Micro-batching")[0]
    assert "**This config's runs** (8 pairs a step): naive's gap shows where" in gap
    assert "- `naive/fixed` 2x4: 2 pairs per micro-batch; relative L2" in gap
    assert "- `naive/token_budget` 1x8: " in gap and "pairs per micro-batch, unequal;" in gap


# --- the keys, without a launch ---------------------------------------------------------------


def _dpo_config(path: str = DPO_CONFIG, **overrides: object):
    cfg = OmegaConf.load(path)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_the_shipped_dpo_parity_config_holds_only_keys_the_report_reads():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = validate_config(_dpo_config(), GaParityConfig, "ga_parity")
    assert GaParityConfig.is_preference(cfg)
    assert GaParityConfig.modes_for(cfg) == [NormMode.NAIVE, NormMode.EXACT]
    assert collate_fn_for(cfg.collate_fn, is_preference=True) == PAIR_COLLATE


def test_a_dpo_config_defaults_to_naive_and_exact_and_refuses_post_scale():
    cfg = validate_config(_dpo_config(**{"parity.modes": None}), GaParityConfig, "ga_parity")
    assert GaParityConfig.modes_for(cfg) == [NormMode.NAIVE, NormMode.EXACT]
    with pytest.raises(ValueError, match="config key 'parity.modes': post_scale is a token"):
        validate_config(
            _dpo_config(**{"parity.modes": ["naive", "post_scale"]}), GaParityConfig, "ga_parity"
        )
    sft = _dpo_config("configs/tiny/ga_parity_lora.yaml", **{"parity.modes": None})
    sft = validate_config(sft, GaParityConfig, "ga_parity")
    assert not GaParityConfig.is_preference(sft)
    assert GaParityConfig.modes_for(sft) == [NormMode.NAIVE, NormMode.POST_SCALE, NormMode.EXACT]


def test_a_dpo_configs_naive_runs_token_budget_too_and_nothing_else_regrouped():
    cfg = validate_config(_dpo_config(), GaParityConfig, "ga_parity")
    baselines = GaParityConfig.baseline_micro_batchings(cfg)
    modes = [NormMode.NAIVE, NormMode.EXACT]
    splits = [Split(2, 4), Split(2, 2, 2)]
    plan = plan_runs(modes, list(MicroBatching), splits, Split(8, 1), baselines)
    # Across ranks token_budget's fillers would weigh as much as any micro-batch under naive.
    assert [(mode.value, mb.value, str(split)) for mode, mb, split in plan] == [
        ("naive", "fixed", "2x4"),
        ("naive", "fixed", "2x2x2"),
        ("naive", "token_budget", "2x4"),
        ("exact", "fixed", "2x4"),
        ("exact", "fixed", "2x2x2"),
        ("exact", "by_length", "2x4"),
        ("exact", "by_length", "2x2x2"),
        ("exact", "token_budget", "2x4"),
        ("exact", "token_budget", "2x2x2"),
        ("exact", "packed", "2x4"),
        ("exact", "packed", "2x2x2"),
    ]
    # Without exact, by_length runs nowhere and says so; token_budget still runs naive.
    with pytest.warns(UserWarning, match="'parity.micro_batching': by_length is ignored"):
        validate_config(_dpo_config(**{"parity.modes": ["naive"]}), GaParityConfig, "ga_parity")


@pytest.mark.parametrize(
    "training_config",
    ["configs/tiny/lora_dpo_single_device.yaml", "configs/tiny/full_dpo_distributed.yaml"],
)
def test_the_dpo_training_configs_run_with_their_unread_keys_named(training_config):
    with pytest.warns(UserWarning, match="config keys ignored by ga_parity: .*batch_size"):
        cfg = validate_config(_dpo_config(training_config), GaParityConfig, "ga_parity")
    assert GaParityConfig.is_preference(cfg)
    is_lora = "lora" in training_config
    assert (cfg.ref_checkpointer is None) == is_lora
    check_preference_keys(cfg, is_preference=True, is_lora=is_lora)


def test_full_dpo_needs_its_reference_and_pairs_need_a_pair_collate():
    cfg = validate_config(_dpo_config(), GaParityConfig, "ga_parity")
    with pytest.raises(ValueError, match="config key 'ref_checkpointer' is needed for full DPO"):
        check_preference_keys(cfg, is_preference=True, is_lora=False)
    sft_collate = "torchtune.data.padded_collate_sft"
    with pytest.raises(ValueError, match=f"config key 'collate_fn'={sft_collate}: DPO micro"):
        collate_fn_for(sft_collate, is_preference=True)
