"""``cudnn_attention``: exactga's recipes switch cuDNN's fused attention off unless asked.

See [cuDNN attention and variable shapes] in ``exactga.runtime.kernels``; the cost it avoids was
measured on an H100 (docs/gpu_report_round_two.md). The switch is torch's process-wide flag,
which exists on CPU builds too, so what a recipe asks for is checked here without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from exactga.config.schemas import FullFinetuneSingleDeviceConfig
from exactga.config.validation import validate_config
from exactga.runtime.kernels import choose_attention_kernels


@pytest.fixture(autouse=True)
def restore_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("allowed", [True, False])
def test_the_choice_sets_torchs_flag_and_says_so(allowed):
    torch.backends.cuda.enable_cudnn_sdp(not allowed)
    line = choose_attention_kernels(allowed, torch.device("cuda"))
    assert torch.backends.cuda.cudnn_sdp_enabled() is allowed
    assert f"cudnn_attention: {allowed}" in line


def test_on_cpu_the_flag_is_still_set_and_the_line_says_cpu():
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert "CPU" in choose_attention_kernels(False, torch.device("cpu"))
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_recipes_default_to_cudnn_attention_off():
    cfg = OmegaConf.load("configs/tiny/full_single_device.yaml")
    assert "cudnn_attention" not in cfg  # the default, not the file, decides
    validated = validate_config(cfg, FullFinetuneSingleDeviceConfig, "full_finetune_single_device")
    assert validated.cudnn_attention is False
