"""Checks on the shipped per-model configs in configs/.

Fast and offline: models are built on the meta device (no weights, no memory), tokenizers
are only resolved to their builder function (the tokenizer files are not present), and no
recipe is run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchtune
from omegaconf import DictConfig, OmegaConf
from torchtune import config
from torchtune.config._utils import _get_component_from_path

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/full_finetune_single_device.py"
STOCK_CONFIGS = Path(torchtune.__file__).resolve().parent.parent / "recipes" / "configs"

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

# Top-level keys our configs add or change relative to torchtune 0.6.1's stock config.
EXACTGA_KEYS = {"loss_normalization", "drop_partial_window"}
CHANGED_KEYS = {"output_dir", "metric_logger"}


def _path(name: str) -> Path:
    return REPO_ROOT / "configs" / f"{name}.yaml"


def _load(name: str) -> DictConfig:
    cfg = OmegaConf.load(_path(name))
    assert isinstance(cfg, DictConfig)
    return cfg


def _header(name: str) -> str:
    """The comment block the file opens with (leading '#' lines, blank lines allowed)."""
    header = []
    for line in _path(name).read_text().splitlines():
        if line.startswith("#"):
            header.append(line)
        elif line.strip():
            break
    return "\n".join(header)


@pytest.mark.parametrize("name", NAMES)
def test_header_has_download_and_launch_commands(name: str) -> None:
    header = _header(name)
    assert "tune download" in header
    launch = f"tune run {RECIPE} --config configs/{name}.yaml"
    assert launch in header
    # ... plus at least one override example on top of the plain launch command.
    assert any(
        line.strip().startswith(f"#   {launch} ") and "=" in line for line in header.splitlines()
    )
    if "bitsandbytes" in _load(name).optimizer._component_:
        assert "pip install bitsandbytes" in header


@pytest.mark.parametrize("name", NAMES)
def test_model_param_count(name: str) -> None:
    _, lo, hi = MODEL_CONFIGS[name]
    cfg = _load(name)
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    assert lo <= n_params <= hi, f"{cfg.model._component_}: {n_params:,} params"


@pytest.mark.parametrize("name", NAMES)
def test_component_paths_resolve(name: str) -> None:
    """Tokenizer (not instantiated: its files are absent) and other builders are importable."""
    cfg = _load(name)
    tokenizer = _get_component_from_path(cfg.tokenizer._component_)
    assert callable(tokenizer)
    for key in ("dataset", "loss", "checkpointer", "metric_logger", "profiler"):
        assert callable(_get_component_from_path(cfg[key]._component_)), key


@pytest.mark.parametrize("name", NAMES)
def test_exactga_settings(name: str) -> None:
    tag, _, _ = MODEL_CONFIGS[name]
    cfg = _load(name)
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
    stock_path = STOCK_CONFIGS / f"{name}.yaml"
    if not stock_path.is_file():
        pytest.skip(f"stock torchtune config not installed at {stock_path}")
    ours = OmegaConf.to_container(_load(name), resolve=False)
    stock = OmegaConf.to_container(OmegaConf.load(stock_path), resolve=False)
    assert set(ours) == set(stock) | EXACTGA_KEYS
    for key in stock:
        if key not in CHANGED_KEYS:
            assert ours[key] == stock[key], key
    ours_logger = {k: v for k, v in ours["metric_logger"].items() if k != "_component_"}
    stock_logger = {k: v for k, v in stock["metric_logger"].items() if k != "_component_"}
    assert ours_logger == stock_logger
