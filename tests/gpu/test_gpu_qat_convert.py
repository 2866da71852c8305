"""The convert step of QAT on CUDA (docs/qat.md): a tiny fake-quantised model converted by
torchao's two QAT quantizers as stock's ``tune run quantize`` converts it, run on the GPU.

In-process, no launch: the CPU tests (tests/test_recipe_qat.py) convert the QAT recipes' saved
weights (int8 activations with int4 weights in fp32; int4 weight-only in bf16, which torch's CPU
int4 kernel runs); here both run on the device where the released models are served, the int4
weight-only linears through tinygemm's CUDA kernel (bf16 only, as on CPU).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]


def _converted_logits(quantizer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from torchtune import training
    from torchtune.models.llama3_2 import llama3_2

    torch.manual_seed(0)
    with training.set_default_dtype(dtype), torch.device("cuda"):
        model = llama3_2(
            vocab_size=2048,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            embed_dim=256,
            intermediate_dim=512,
            max_seq_len=128,
        )
    prepared = quantizer.prepare(model)
    tokens = torch.randint(0, 2000, (2, 24), device="cuda")
    with torch.no_grad():
        fake_quantised = prepared(tokens).float()
        converted = quantizer.convert(prepared)
        quantised = converted(tokens).float()
    kinds = {type(m).__name__ for m in converted.modules()}
    return {"fake_quantised": fake_quantised, "quantised": quantised, "kinds": kinds}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_int4_weight_only_converts_and_runs_on_cuda() -> None:
    from torchtune.training.quantization import Int4WeightOnlyQATQuantizer

    out = _converted_logits(
        Int4WeightOnlyQATQuantizer(groupsize=32, inner_k_tiles=2), torch.bfloat16
    )
    assert "WeightOnlyInt4Linear" in out["kinds"], out["kinds"]
    assert torch.isfinite(out["quantised"]).all()
    gap = _relative(out["quantised"], out["fake_quantised"])
    print(f"int4 weight-only on CUDA: converted vs fake-quantised {gap:.1e}")
    assert gap <= 2e-2  # bf16 logits


def test_int8_activation_int4_weight_converts_and_runs_on_cuda() -> None:
    from torchtune.training.quantization import Int8DynActInt4WeightQATQuantizer

    out = _converted_logits(Int8DynActInt4WeightQATQuantizer(groupsize=32), torch.float32)
    assert "Int8DynActInt4WeightLinear" in out["kinds"], out["kinds"]
    gap = _relative(out["quantised"], out["fake_quantised"])
    print(f"int8 activations, int4 weights on CUDA: converted vs fake-quantised {gap:.1e}")
    assert gap <= 1e-4
