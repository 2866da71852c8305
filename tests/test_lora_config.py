"""Strict config for the LoRA recipe: every stock and shipped LoRA/QLoRA config is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tiny_runs import recipe_script
from unit_utils import CONFIGS, stock_configs, tiny_config

from exactga.config.schemas import LoraFinetuneSingleDeviceConfig
from exactga.config.validation import validate_config

RECIPE = "lora_finetune_single_device"


def shipped_configs() -> list[Path]:
    """This recipe's configs; the distillation configs (``*_KD_lora_*``) are another recipe's."""
    found = {
        *CONFIGS.rglob("*_lora_single_device.yaml"),
        *CONFIGS.rglob("*qlora_single_device.yaml"),
        CONFIGS / "tiny/lora_single_device.yaml",
    }
    return sorted(path for path in found if "_KD_" not in path.name)


def validate(cfg) -> object:
    return validate_config(cfg, LoraFinetuneSingleDeviceConfig, RECIPE)


def _id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def test_stock_registry_lists_the_lora_configs() -> None:
    assert len(stock_configs(RECIPE)) >= 40  # 41 in torchtune 0.6.1, LoRA, QLoRA, DoRA and QDoRA


@pytest.mark.parametrize("path", stock_configs(RECIPE), ids=_id)
def test_every_stock_torchtune_config_is_accepted_unchanged(path: Path) -> None:
    cfg = validate(OmegaConf.load(path))
    assert cfg.loss_normalization == "exact"  # our keys get their defaults
    assert cfg.drop_partial_window is False
    for key in ("lora_rank", "lora_alpha", "lora_attn_modules", "apply_lora_to_mlp"):
        assert key in cfg.model, key  # what the recipe reads from the model section


@pytest.mark.parametrize("path", shipped_configs(), ids=_id)
def test_every_shipped_config_is_known_to_its_recipe(path: Path) -> None:
    cfg = validate(OmegaConf.load(path))
    first_lines = path.read_text().splitlines()[:25]
    launch = f"tune run {recipe_script(RECIPE)} --config configs/{path.parent.name}/{path.name}"
    assert any(launch in line for line in first_lines), launch
    assert cfg.loss_normalization == "exact"


def test_shipped_configs_cover_the_issue_list() -> None:
    names = {_id(p) for p in shipped_configs()}
    assert names >= {
        "tiny/lora_single_device",
        "tiny/qlora_single_device",
        "llama3_2/1B_lora_single_device",
        "llama3_2/3B_lora_single_device",
        "llama3_1/8B_lora_single_device",
        "qwen2_5/0.5B_lora_single_device",
        "qwen2_5/1.5B_lora_single_device",
        "qwen2_5/7B_lora_single_device",
        "llama3_2/1B_qlora_single_device",
        "llama3_2/3B_qlora_single_device",
        "llama3_1/8B_qlora_single_device",
    }


def tiny_cfg(**overrides: object):
    return tiny_config("lora_single_device", **overrides)


def test_misspelt_key_is_named_with_a_suggestion() -> None:
    with pytest.raises(ValueError, match="'save_adapter_weight_only'.*'save_adapter_weights_only'"):
        validate(tiny_cfg(save_adapter_weight_only=True))


def test_full_finetune_only_key_is_rejected() -> None:
    """Stock's LoRA recipe has no optimizer_in_bwd; ours says so instead of ignoring it."""
    with pytest.raises(ValueError, match="unknown config key 'optimizer_in_bwd'"):
        validate(tiny_cfg(optimizer_in_bwd=True))


def test_wrong_type_names_the_key() -> None:
    with pytest.raises(ValueError, match="config key 'save_adapter_weights_only'"):
        validate(tiny_cfg(save_adapter_weights_only="sometimes"))
