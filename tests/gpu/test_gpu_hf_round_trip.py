"""The Hugging Face round trip on CUDA (issue #30): runs trained on the GPU write folders that
transformers and PEFT load as the fine-tuned model, the adapter applied once.

The CPU test (tests/test_hf_round_trip.py, issue #23) with ``device=cuda``: a tiny Llama made
with transformers is fine-tuned through ``tune run`` with torchtune's HF checkpointer (full and
LoRA on one device, LoRA and distillation under torchrun on one NCCL rank), then loaded with
``AutoModelForCausalLM.from_pretrained(epoch_0)`` and ``PeftModel.from_pretrained(base,
epoch_0/adapter)`` and run on the GPU beside torchtune's own model of the same files. fp32 on
the GPU (no TF32: torch's default for fp32 matmuls) keeps the bound of the CPU test, 1e-4.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import test_hf_round_trip as cpu_test
import torch
from recipe_utils import output_of, run_tune

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu_hf_round_trip")]

NAMES = ["full_single_device", "lora_single_device", "kd_distributed_1_rank"]


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    return cpu_test.make_hf_base(tmp_path_factory.mktemp("hf_base"))


@pytest.fixture(scope="module")
def runs(hf_base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_hf_round_trip")

    def launch(name: str) -> Path:
        out = root / name
        proc = run_tune([*cpu_test._args(name, hf_base, out), "device=cuda"], timeout=900)
        assert proc.returncode == 0, output_of(proc)[-4000:]
        return out

    with ThreadPoolExecutor(max_workers=len(NAMES)) as pool:
        return dict(zip(NAMES, pool.map(launch, NAMES), strict=True))


@torch.no_grad()
def cuda_logits(model) -> torch.Tensor:
    model = model.cuda().eval()
    out = model(cpu_test._tokens().cuda())
    return getattr(out, "logits", out).cpu()


@pytest.mark.parametrize("name", NAMES)
def test_a_gpu_run_loads_as_the_fine_tuned_model(runs, hf_base, name, record_property):
    out = runs[name]
    epoch = out / "epoch_0"
    tuned = cpu_test._torchtune_logits(name, hf_base, out)  # CPU, the reference
    tuned_cuda = cuda_logits(cpu_test._torchtune_model(name, hf_base, out))
    base = cuda_logits(transformers.AutoModelForCausalLM.from_pretrained(hf_base))
    merged = cuda_logits(transformers.AutoModelForCausalLM.from_pretrained(epoch))
    gaps = {"torchtune on cuda": cpu_test._rel(tuned_cuda, tuned)}
    gaps["from_pretrained(epoch_0)"] = cpu_test._rel(merged, tuned)
    if cpu_test.RUNS[name][3]:
        assert not (epoch / "adapter_config.json").exists()
        with_adapter = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(hf_base), epoch / "adapter"
        )
        gaps["PeftModel(base, epoch_0/adapter)"] = cpu_test._rel(cuda_logits(with_adapter), tuned)
    effect = cpu_test._rel(tuned, base)
    record_property("fine_tuning_moved_logits", f"{effect:.2e}")
    for way, gap in gaps.items():
        record_property(way.replace(" ", "_"), f"{gap:.2e}")
    assert effect >= cpu_test.MIN_ADAPTER_EFFECT
    for way, gap in gaps.items():
        assert gap <= cpu_test.BOUND, (way, gap)
