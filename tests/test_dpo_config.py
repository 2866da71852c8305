"""The DPO recipes' configs: stock and shipped ones accepted, bad settings named (in-process),
and bad input through ``tune run`` as one message without a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from recipe_utils import REPO_ROOT, run_recipe
from test_bad_input_launch import assert_fails_naming
from tiny_runs import recipe_script
from unit_utils import stock_configs

from exactga.config.options import NormMode
from exactga.config.validation import validate_config
from exactga.dpo.schema import (
    PAIR_COLLATE,
    FullDpoDistributedConfig,
    LoraDpoDistributedConfig,
    LoraDpoSingleDeviceConfig,
)

SCHEMAS = {
    "lora_dpo_single_device": LoraDpoSingleDeviceConfig,
    "lora_dpo_distributed": LoraDpoDistributedConfig,
    "full_dpo_distributed": FullDpoDistributedConfig,
}
STOCK = [(recipe, path) for recipe in SCHEMAS for path in stock_configs(recipe)]
PAIRS = REPO_ROOT / "configs/tiny/preference_data.json"


def _tiny(recipe: str, **overrides: object):
    cfg = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / f"{recipe}.yaml")
    return OmegaConf.merge(cfg, OmegaConf.create(overrides))


@pytest.mark.parametrize("recipe, path", STOCK, ids=lambda v: getattr(v, "stem", v))
def test_every_stock_dpo_config_is_accepted_unchanged(recipe: str, path: Path) -> None:
    cfg = validate_config(OmegaConf.load(path), SCHEMAS[recipe], recipe)
    assert cfg.collate_fn == PAIR_COLLATE and cfg.loss_normalization is NormMode.EXACT


@pytest.mark.parametrize("recipe", SCHEMAS)
def test_every_shipped_dpo_config_is_known_to_its_recipe(recipe: str, monkeypatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    path = REPO_ROOT / "configs" / "tiny" / f"{recipe}.yaml"
    validate_config(OmegaConf.load(path), SCHEMAS[recipe], recipe, check_files=True)
    assert recipe_script(recipe) in "\n".join(path.read_text().splitlines()[:12])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"loss_normalization": "post_scale"}, "config key 'loss_normalization': post_scale"),
        ({"collate_fn": "torchtune.data.padded_collate_sft"}, "config key 'collate_fn'"),
        ({"tensor_parallel_dim": 2}, "config key 'tensor_parallel_dim'"),
    ],
)
def test_settings_dpo_cannot_take_are_named(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_config(_tiny("full_dpo_distributed", **overrides), FullDpoDistributedConfig, "r")


def test_full_dpo_without_a_reference_checkpointer_names_the_key() -> None:
    cfg = _tiny("full_dpo_distributed")
    del cfg["ref_checkpointer"]
    with pytest.raises(ValueError, match="ref_checkpointer"):
        validate_config(cfg, FullDpoDistributedConfig, "full_dpo_distributed")


@pytest.mark.slow
def test_a_pair_without_a_rejected_answer_fails_naming_its_row(tmp_path: Path) -> None:
    rows = json.loads(PAIRS.read_text())[:12]
    del rows[7]["rejected"]
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(rows))
    out = tmp_path / "run"
    args = [
        "recipes/lora_dpo.py",
        *("--config", "configs/tiny/lora_dpo_single_device.yaml"),
        f"dataset.data_files={data}",
        f"output_dir={out}",
    ]
    proc = run_recipe(args)
    names = ["dataset row 7 (0-based)", str(data), "'rejected'"]
    assert_fails_naming(proc, out, names, before_config=False)
