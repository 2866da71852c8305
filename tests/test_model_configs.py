"""Checks on the shipped per-model configs in configs/.

Fast and offline: models are built on the meta device (no weights, no memory), tokenizers
are only resolved to their builder function (the tokenizer files are not present), and no
recipe is run.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config
from torchtune.config._utils import _get_component_from_path
from unit_utils import assert_matches_stock_config, config_header, load_config

RECIPE = "recipes/full_finetune.py"

# config (relative to configs/, no suffix) -> (output tag, min params, max params)
MODEL_CONFIGS = {
    "llama3_2/1B_full_single_device": ("llama3_2_1B", 1.0e9, 1.6e9),  # 1.24e9
    "llama3_2/3B_full_single_device": ("llama3_2_3B", 2.8e9, 3.6e9),  # 3.21e9
    "llama3_1/8B_full_single_device": ("llama3_1_8B", 7.5e9, 8.5e9),  # 8.03e9
    "qwen2_5/0.5B_full_single_device": ("qwen2_5_0_5B", 0.4e9, 0.65e9),  # 0.49e9
    "qwen2_5/1.5B_full_single_device": ("qwen2_5_1_5B", 1.3e9, 1.8e9),  # 1.54e9
    "qwen2_5/7B_full_single_device": ("qwen2_5_7B", 7.0e9, 8.0e9),  # 7.62e9
}
NAMES = list(MODEL_CONFIGS)


@pytest.mark.parametrize("name", NAMES)
def test_header_has_download_and_launch_commands(name: str) -> None:
    header = config_header(name)
    assert "tune download" in header
    launch = f"tune run {RECIPE} --config configs/{name}.yaml"
    assert launch in header
    # ... plus at least one override example on top of the plain launch command.
    assert any(
        line.strip().startswith(f"#   {launch} ") and "=" in line for line in header.splitlines()
    )
    if "bitsandbytes" in load_config(name).optimizer._component_:
        assert "pip install bitsandbytes" in header


@pytest.mark.parametrize("name", NAMES)
def test_model_param_count(name: str) -> None:
    _, lo, hi = MODEL_CONFIGS[name]
    cfg = load_config(name)
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    assert lo <= n_params <= hi, f"{cfg.model._component_}: {n_params:,} params"


@pytest.mark.parametrize("name", NAMES)
def test_component_paths_resolve(name: str) -> None:
    """Tokenizer (not instantiated: its files are absent) and other builders are importable."""
    cfg = load_config(name)
    tokenizer = _get_component_from_path(cfg.tokenizer._component_)
    assert callable(tokenizer)
    for key in ("dataset", "loss", "checkpointer", "metric_logger", "profiler"):
        assert callable(_get_component_from_path(cfg[key]._component_)), key


@pytest.mark.parametrize("name", NAMES)
def test_exactga_settings(name: str) -> None:
    tag, _, _ = MODEL_CONFIGS[name]
    cfg = load_config(name)
    assert cfg.loss_normalization == "exact"
    assert cfg.drop_partial_window is False
    assert cfg.output_dir == f"/tmp/exactga/{tag}/full_single_device"
    assert cfg.metric_logger._component_ == "torchtune.training.metric_logging.TensorBoardLogger"
    assert OmegaConf.to_container(cfg.metric_logger)["log_dir"] == "${output_dir}/logs"
    # The stock recipe rejects optimizer_in_bwd together with gradient accumulation.
    assert not (cfg.optimizer_in_bwd and cfg.gradient_accumulation_steps > 1)


@pytest.mark.parametrize("name", NAMES)
def test_matches_stock_config(name: str) -> None:
    """Apart from the documented changes, each config equals torchtune 0.6.1's stock one."""
    assert_matches_stock_config(name)
