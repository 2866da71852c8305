"""A Qwen2/2.5 LoRA (and DoRA) adapter saved through torchtune's own HF checkpointer loads in
PEFT as the adapter trained: see [Qwen2 adapters in PEFT] in exactga.lora.adapters.

torchtune 0.6.1 permutes q_proj's and k_proj's ``lora_B`` rows for Llama's rotary layout for
every model type, Qwen2 included, whose rows are already in Hugging Face's order. In-process:
a tiny Qwen2 made with transformers, torchtune's ``lora_qwen2`` on its weights with random
adapters, saved by ``save_epoch_checkpoint`` (what both LoRA recipes call), loaded by PEFT.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchtune import training
from torchtune.models.qwen2 import lora_qwen2
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune
from torchtune.modules.peft import get_adapter_state_dict

from exactga.lora.adapters import LoraSettings, save_epoch_checkpoint

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HF_CONFIG = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
MODULES = ("q_proj", "k_proj", "v_proj", "output_proj")
BOUND = 1e-5  # relative L2 of the logits, fp32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _lora_model(hf_folder: Path, use_dora: bool) -> torch.nn.Module:
    """torchtune's Qwen2 LoRA model on the HF weights, every adapter random and nonzero."""
    model = lora_qwen2(
        lora_attn_modules=list(MODULES),
        apply_lora_to_mlp=True,
        vocab_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=32,
        intermediate_dim=64,
        max_seq_len=64,
        norm_eps=1e-6,
        rope_base=1_000_000.0,
        lora_rank=4,
        lora_alpha=8,
        use_dora=use_dora,
    ).eval()
    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(hf_folder),
        checkpoint_files=["model.safetensors"],
        model_type="QWEN2",
        output_dir=str(hf_folder.parent / "unused"),
    )
    base = checkpointer.load_checkpoint()[training.MODEL_KEY]
    model.load_state_dict(base, strict=False)
    for module in model.modules():
        if hasattr(module, "initialize_dora_magnitude"):  # ||W|| per row, from the base
            module.initialize_dora_magnitude()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name or name.endswith("magnitude"):
                param.copy_(param + 0.3 * torch.randn(param.shape, generator=generator))
    return model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_a_qwen2_adapter_saved_by_torchtunes_checkpointer_loads_in_peft(tmp_path, use_dora):
    torch.manual_seed(0)
    hf_model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**HF_CONFIG)).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    ours = _lora_model(tmp_path / "hf", use_dora)
    assert set(qwen2_hf_to_tune(hf_model.state_dict(), 4, 2, 32)) <= set(ours.state_dict())

    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(tmp_path / "hf"),
        checkpoint_files=["model.safetensors"],
        model_type="QWEN2",
        output_dir=str(tmp_path / "out"),
    )
    settings = LoraSettings(
        rank=4, alpha=8, attn_modules=MODULES, apply_to_mlp=True, apply_to_output=False
    )
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    save_epoch_checkpoint(checkpointer, state, settings, epoch=0, adapter_only=True)

    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    base = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "out" / "epoch_0" / "adapter").eval()
    with torch.no_grad():
        expected, base_logits = ours(tokens), hf_model(tokens).logits
        got = loaded(tokens).logits
    assert _rel(expected, base_logits) > 1e-2  # the adapter moves the logits
    assert _rel(got, expected) < BOUND
    assert get_adapter_state_dict(state)  # adapters were in what was saved
