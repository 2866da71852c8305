"""Checks on the shipped per-model LoRA and QLoRA configs in configs/.

Fast and offline, as tests/test_model_configs.py: models are built on the meta device, tokenizers
are only resolved to their builder function, and no recipe is run.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torchao.dtypes.nf4tensor import NF4Tensor
from torchtune import config
from torchtune.config._utils import _get_component_from_path
from torchtune.modules.peft import get_adapter_params
from unit_utils import assert_matches_stock_config, config_header, load_config

RECIPE = "recipes/lora_finetune.py"

# config (relative to configs/, no suffix) -> (output tag, min params, max params), base model
MODEL_CONFIGS = {
    "llama3_2/1B_lora_single_device": ("llama3_2_1B", 1.0e9, 1.6e9),
    "llama3_2/3B_lora_single_device": ("llama3_2_3B", 2.8e9, 3.6e9),
    "llama3_1/8B_lora_single_device": ("llama3_1_8B", 7.5e9, 8.5e9),
    "qwen2_5/0.5B_lora_single_device": ("qwen2_5_0_5B", 0.4e9, 0.65e9),
    "qwen2_5/1.5B_lora_single_device": ("qwen2_5_1_5B", 1.3e9, 1.8e9),
    "qwen2_5/7B_lora_single_device": ("qwen2_5_7B", 7.0e9, 8.0e9),
    "llama3_2/1B_qlora_single_device": ("llama3_2_1B", 1.0e9, 1.6e9),
    "llama3_2/3B_qlora_single_device": ("llama3_2_3B", 2.8e9, 3.6e9),
    "llama3_1/8B_qlora_single_device": ("llama3_1_8B", 7.5e9, 8.5e9),
}
NAMES = list(MODEL_CONFIGS)


@pytest.mark.parametrize("name", NAMES)
def test_header_has_download_and_launch_commands(name: str) -> None:
    header = config_header(name)
    assert "tune download" in header
    launch = f"tune run {RECIPE} --config configs/{name}.yaml"
    assert launch in header
    assert any(
        line.strip().startswith(f"#   {launch} ") and "=" in line for line in header.splitlines()
    )


@pytest.fixture
def nf4_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """QLoRA's base weights quantized once per shape: each layer's weight still becomes an
    NF4Tensor of its own (a detached copy, so the parameter count stays per layer), but the
    quantization, whose meta kernels cost about 0.1 s a call on CPU whatever the size (over 500
    calls for these configs, a minute of CPU), runs once for each distinct shape. On the meta
    device there is no data, so a weight's NF4Tensor depends on its shape alone."""
    from torchao.dtypes import nf4tensor
    from torchtune.modules.low_precision import nf4_linear
    from torchtune.modules.peft import lora

    quantized: dict[tuple, torch.Tensor] = {}

    def to_nf4(tensor: torch.Tensor, block_size: int = 64, scaler_block_size: int = 256):
        if not tensor.is_meta:
            return nf4tensor.to_nf4(tensor, block_size, scaler_block_size)
        key = (tuple(tensor.shape), tensor.dtype, block_size, scaler_block_size)
        if key not in quantized:
            quantized[key] = nf4tensor.to_nf4(tensor, block_size, scaler_block_size)
        return quantized[key].detach()

    monkeypatch.setattr(lora, "to_nf4", to_nf4)
    monkeypatch.setattr(nf4_linear, "to_nf4", to_nf4)


@pytest.mark.parametrize("name", NAMES)
def test_model_builds_on_meta_with_adapters(name: str, nf4_once_per_shape: None) -> None:
    """Base size in range; only the adapters would train (a small fraction of the weights)."""
    _, lo, hi = MODEL_CONFIGS[name]
    cfg = load_config(name)
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    adapters = get_adapter_params(model)
    n_adapter = sum(p.numel() for p in adapters.values())
    n_params = sum(p.numel() for p in model.parameters()) - n_adapter
    assert lo <= n_params <= hi, f"{cfg.model._component_}: {n_params:,} params"
    assert 0 < n_adapter < 0.05 * n_params
    assert all(".lora_" in key for key in adapters)
    if "qlora" in name:
        assert "qlora" in cfg.model._component_
        assert any(isinstance(p, NF4Tensor) for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_component_paths_resolve(name: str) -> None:
    cfg = load_config(name)
    assert callable(_get_component_from_path(cfg.tokenizer._component_))
    for key in ("dataset", "loss", "checkpointer", "metric_logger", "profiler", "optimizer"):
        assert callable(_get_component_from_path(cfg[key]._component_)), key


@pytest.mark.parametrize("name", NAMES)
def test_exactga_settings(name: str) -> None:
    tag, _, _ = MODEL_CONFIGS[name]
    cfg = load_config(name)
    assert cfg.loss_normalization == "exact"
    assert cfg.drop_partial_window is False
    kind = "qlora" if "qlora" in name else "lora"
    assert cfg.output_dir == f"/tmp/exactga/{tag}/{kind}_single_device"
    assert cfg.metric_logger._component_ == "torchtune.training.metric_logging.TensorBoardLogger"
    assert OmegaConf.to_container(cfg.metric_logger)["log_dir"] == "${output_dir}/logs"
    assert cfg.model.lora_dropout == 0.0  # dropout masks would differ between splits


@pytest.mark.parametrize("name", NAMES)
def test_matches_stock_config(name: str) -> None:
    """Apart from the documented changes, each config equals torchtune 0.6.1's stock one."""
    assert_matches_stock_config(name)
