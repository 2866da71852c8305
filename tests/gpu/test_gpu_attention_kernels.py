"""``cudnn_attention`` on CUDA: with the default (False) no cuDNN attention kernel runs, and
the recipes' runs say which choice they made (issue #30; see [cuDNN attention and variable
shapes] in ``exactga.runtime.kernels``). The kernels that ran are read from torch's profiler, so the
test checks what the GPU did, not only the flag."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_runs import FULL_SINGLE, Launch, launch_all
from torch.profiler import ProfilerActivity, profile

from exactga.runtime.kernels import choose_attention_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_attention_kernels")]


def attention_kernel_names() -> list[str]:
    """The CUDA kernels of causal attention at three new sequence lengths, forward and back."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for length in (100, 130, 170):
            q, k, v = (
                torch.randn(4, 8, length, 64, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)
                for _ in range(3)
            )  # fmt: skip
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    return [event.key for event in prof.key_averages()]


@pytest.fixture
def restore_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_no_cudnn_attention_kernel_runs_by_default(restore_flag, record_property):
    choose_attention_kernels(False, torch.device("cuda"))
    names = attention_kernel_names()
    record_property("kernels", "; ".join(sorted(n for n in names if "attention" in n.lower())))
    assert names and not any("cudnn" in name.lower() for name in names)


@pytest.mark.slow
def test_runs_say_which_attention_kernels_they_allow(tmp_path):
    launches = {
        "default": Launch(FULL_SINGLE, {"max_steps_per_epoch": 1, "dtype": "bf16"}),
        "allowed": Launch(
            FULL_SINGLE, {"max_steps_per_epoch": 1, "dtype": "bf16", "cudnn_attention": True}
        ),
    }
    runs = launch_all(launches, tmp_path)
    assert "cuDNN's fused kernel off (cudnn_attention: False" in runs["default"].output
    assert "cuDNN's fused kernel allowed (cudnn_attention: True)" in runs["allowed"].output
