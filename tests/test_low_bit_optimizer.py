"""torchao's 8-bit AdamW from a config section, on LoRA adapters, as the LoRA recipes build it.

It runs on CPU (torchao 0.15 compiles its step on first use, hence the slow mark); the recipes
instantiate ``cfg.optimizer`` with the trainable parameters exactly as done here.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.modules.peft import get_adapter_params, set_trainable_params

OPTIMIZER_SECTION = {"_component_": "torchao.optim.AdamW8bit", "lr": 1e-2, "weight_decay": 0.01}


@pytest.mark.slow
def test_adamw8bit_from_config_trains_lora_adapters_with_8bit_state() -> None:
    torch.manual_seed(0)
    model = lora_llama3_2(
        lora_attn_modules=["q_proj", "v_proj"],
        vocab_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=256,
        max_seq_len=32,
        intermediate_dim=128,
        lora_rank=16,
        lora_alpha=32,
    )
    adapters = get_adapter_params(model)
    set_trainable_params(model, adapters)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = config.instantiate(OmegaConf.create(OPTIMIZER_SECTION), trainable)
    before = {name: p.detach().clone() for name, p in adapters.items()}
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        logits = model(tokens)
        torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1)
        ).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    lora_b = [name for name in adapters if "lora_b" in name]
    assert lora_b and all(not torch.equal(adapters[n], before[n]) for n in lora_b)
    assert all(torch.isfinite(p).all() for p in trainable)
    # torchao quantises the moments of tensors of at least 4096 elements (q_proj's 256 x 16 B).
    (q_proj_b,) = [n for n in lora_b if "q_proj" in n]
    state = optimizer.state[adapters[q_proj_b]]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit"  # really 8-bit moments
