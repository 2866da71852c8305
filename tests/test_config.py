"""Strict configs: every stock and shipped config is accepted, bad input names its key."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tiny_runs import recipe_script
from unit_utils import CONFIGS, stock_configs, tiny_config

from exactga.config.schemas import FullFinetuneSingleDeviceConfig
from exactga.config.validation import validate_config

RECIPE = "full_finetune_single_device"


def shipped_configs(suffix: str) -> list[Path]:
    return sorted(CONFIGS.rglob(f"*{suffix}.yaml"))


def validate(cfg) -> object:
    return validate_config(cfg, FullFinetuneSingleDeviceConfig, RECIPE)


@pytest.mark.parametrize("path", stock_configs(RECIPE), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_stock_torchtune_config_is_accepted_unchanged(path: Path) -> None:
    cfg = validate(OmegaConf.load(path))
    assert cfg.loss_normalization == "exact"  # our keys get their defaults


@pytest.mark.parametrize(
    "path", shipped_configs("full_single_device"), ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_every_shipped_config_is_known_to_its_recipe(path: Path) -> None:
    validate(OmegaConf.load(path))
    first_lines = path.read_text().splitlines()[:25]
    assert any(f"tune run {recipe_script(RECIPE)}" in line for line in first_lines)


def tiny_cfg(**overrides: object):
    return tiny_config("full_single_device", **overrides)


def test_misspelt_key_is_named_with_a_suggestion() -> None:
    with pytest.raises(
        ValueError, match="'gradient_acumulation_steps'.*'gradient_accumulation_steps'"
    ):
        validate(tiny_cfg(gradient_acumulation_steps=4))


def test_unknown_key_is_named() -> None:
    with pytest.raises(ValueError, match="unknown config key 'warp_drive'"):
        validate(tiny_cfg(warp_drive=True))


def test_wrong_type_names_the_key() -> None:
    with pytest.raises(ValueError, match="config key 'batch_size'"):
        validate(tiny_cfg(batch_size="eight"))


@pytest.mark.parametrize("key", ["batch_size", "gradient_accumulation_steps", "epochs"])
def test_counts_below_one_name_the_key(key: str) -> None:
    with pytest.raises(ValueError, match=f"config key '{key}' must be at least 1"):
        validate(tiny_cfg(**{key: 0}))


def test_an_optional_section_nulled_on_the_command_line_is_null() -> None:
    """torchtune's CLI reads ``lr_scheduler=null`` as ``lr_scheduler._component_=null``."""
    from torchtune.config._utils import _merge_yaml_and_cli_args

    yaml = tiny_cfg()
    assert yaml.lr_scheduler is not None
    cli = _merge_yaml_and_cli_args(*_parsed(yaml, ["lr_scheduler=null"]))
    assert cli.lr_scheduler._component_ is None  # what the recipe receives
    assert validate(cli).lr_scheduler is None
    required = _merge_yaml_and_cli_args(*_parsed(yaml, ["optimizer=null"]))
    with pytest.raises(ValueError, match=r"config key 'optimizer._component_' is null"):
        validate(required)


def _parsed(yaml, overrides: list[str]):
    """The (namespace, overrides) torchtune's parser gives ``_merge_yaml_and_cli_args``."""
    from argparse import Namespace

    return Namespace(**OmegaConf.to_container(yaml)), overrides


def test_missing_required_key_is_named() -> None:
    cfg = tiny_cfg()
    del cfg["batch_size"]
    with pytest.raises(ValueError, match="missing required keys: batch_size"):
        validate(cfg)


def test_sections_stay_open_for_torchtune() -> None:
    """torchtune writes into a section after the recipe has validated the config: it adds the
    profiler's ``_component_`` when a config leaves it out. A new key, since struct mode lets
    one change a key that exists already."""
    cfg = tiny_cfg()
    del cfg.profiler["_component_"]
    cfg = validate(cfg)
    cfg.profiler["_component_"] = "torchtune.training.setup_torch_profiler"  # torchtune does this
    assert cfg.profiler._component_ == "torchtune.training.setup_torch_profiler"


DISTRIBUTED = "full_finetune_distributed"


@pytest.mark.parametrize(
    "path", stock_configs(DISTRIBUTED), ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_every_stock_distributed_config_is_accepted_unchanged(path: Path) -> None:
    from exactga.config.schemas import FullFinetuneDistributedConfig

    cfg = validate_config(OmegaConf.load(path), FullFinetuneDistributedConfig, DISTRIBUTED)
    assert cfg.gradient_sync == "every_micro_batch"  # stock behaviour unless asked
    assert cfg.loss_normalization == "exact"


def test_shipped_distributed_config_is_known_to_its_recipe() -> None:
    from exactga.config.schemas import FullFinetuneDistributedConfig

    path = CONFIGS / "tiny" / "full_distributed.yaml"
    validate_config(OmegaConf.load(path), FullFinetuneDistributedConfig, DISTRIBUTED)
    first_lines = path.read_text().splitlines()[:25]
    assert any(recipe_script(DISTRIBUTED) in line for line in first_lines)


def test_resume_from_checkpoint_takes_stocks_two_values_and_auto(tmp_path: Path) -> None:
    """``auto`` goes on where there is a checkpoint and starts where there is none; recipes then
    see stock's True or False. Any other value names the key and its choices."""
    from exactga.run.checkpointing import step_checkpointer_for
    from exactga.run.resume import validate_run_config

    def resolved(value: object) -> object:
        cfg = tiny_cfg(output_dir=str(tmp_path), resume_from_checkpoint=value)
        return validate_run_config(
            cfg, FullFinetuneSingleDeviceConfig, RECIPE
        ).resume_from_checkpoint

    assert resolved(False) is False
    assert resolved("auto") is False  # nothing to go on from: start
    step_checkpointer_for(str(tmp_path), keep_last_n=2).save(
        3, model_state={}, optimizer_state=None, trainer_state={}, rank_state={}
    )
    assert resolved("auto") is True and resolved(True) is True
    with pytest.raises(ValueError, match="'resume_from_checkpoint'='sometimes': choose one of"):
        resolved("sometimes")
