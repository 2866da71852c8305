"""Strict config for the distributed LoRA recipe: every stock config of torchtune 0.6.1's
``lora_finetune_distributed`` and our tiny one are accepted; bad input names its key."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tiny_runs import recipe_script
from unit_utils import CONFIGS, stock_configs, tiny_config

from exactga.config.schemas import LoraFinetuneDistributedConfig
from exactga.config.validation import validate_config

RECIPE = "lora_finetune_distributed"
TINY = CONFIGS / "tiny" / "lora_distributed.yaml"


def validate(cfg) -> object:
    return validate_config(cfg, LoraFinetuneDistributedConfig, RECIPE)


def test_stock_registry_lists_the_configs() -> None:
    assert len(stock_configs(RECIPE)) >= 36  # 36 in torchtune 0.6.1: LoRA, QLoRA, DoRA


@pytest.mark.parametrize("path", stock_configs(RECIPE), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_stock_config_is_accepted_unchanged(path: Path) -> None:
    cfg = validate(OmegaConf.load(path))
    assert cfg.gradient_sync == "every_micro_batch"  # stock behaviour unless asked
    assert cfg.loss_normalization == "exact"
    for key in ("lora_rank", "lora_alpha", "lora_attn_modules", "apply_lora_to_mlp"):
        assert key in cfg.model, key  # what the recipe reads from the model section


def test_tiny_config_is_known_to_its_recipe() -> None:
    cfg = validate(OmegaConf.load(TINY))
    assert cfg.device == "cpu" and cfg.loss_normalization == "exact"
    header = "\n".join(TINY.read_text().splitlines()[:25])
    assert f"tune run --nproc_per_node 2 {recipe_script(RECIPE)}" in header  # one node
    assert "--nnodes 2" in header and "--rdzv_endpoint" in header  # several


def tiny_cfg(**overrides: object):
    return tiny_config("lora_distributed", **overrides)


def test_misspelt_key_is_named_with_a_suggestion() -> None:
    with pytest.raises(ValueError, match="'gradient_synk'.*'gradient_sync'"):
        validate(tiny_cfg(gradient_synk="once_per_window"))


@pytest.mark.parametrize("key", ["optimizer_in_bwd", "tensor_parallel_dim"])
def test_full_finetune_only_keys_are_rejected(key: str) -> None:
    """Stock's distributed LoRA recipe has neither; ours says so instead of ignoring them."""
    with pytest.raises(ValueError, match=f"unknown config key '{key}'"):
        validate(tiny_cfg(**{key: 1}))


def test_wrong_type_names_the_key() -> None:
    with pytest.raises(ValueError, match="config key 'fsdp_cpu_offload'"):
        validate(tiny_cfg(fsdp_cpu_offload="sometimes"))
