"""Initial LoRA/DoRA adapters are keyed as the model's state dict keys them (issue #17).

Activation checkpointing wraps each layer, so ``named_modules()`` names differ from state-dict
keys; the drawn adapters must still land. See [state-dict keys] in exactga.models.model_state.
"""

from __future__ import annotations

import pytest
import torch
from torchtune import modules, training
from torchtune.models.llama3_2 import lora_llama3_2

from exactga.lora.adapters import _check_keys_exist, _draw_adapters
from exactga.models.model_state import state_dict_name


def _tiny_lora(use_dora: bool) -> torch.nn.Module:
    return lora_llama3_2(
        lora_attn_modules=["q_proj", "v_proj", "output_proj"],
        apply_lora_to_mlp=True,
        lora_rank=4,
        lora_alpha=8,
        vocab_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=32,
        intermediate_dim=64,
        max_seq_len=32,
        use_dora=use_dora,
    )


def _adapter_keys(state_dict_keys) -> set[str]:
    return {k for k in state_dict_keys if "lora_" in k or k.endswith(".magnitude")}


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation_ckpt"])
def test_drawn_adapters_are_the_state_dict_adapter_keys(use_dora, checkpointed):
    model = _tiny_lora(use_dora)
    if checkpointed:
        training.set_activation_checkpointing(
            model, auto_wrap_policy={modules.TransformerSelfAttentionLayer}
        )
        assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_modules())
    drawn: dict[str, torch.Tensor] = {}
    _draw_adapters(model, torch.float32, drawn)
    state_dict = model.state_dict()
    assert set(drawn) == _adapter_keys(state_dict)
    for key, tensor in drawn.items():
        assert tensor.shape == state_dict[key].shape, key


def test_a_drawn_adapter_with_no_parameter_is_named():
    drawn = {"layers.0.attn.q_proj.lora_a.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.q_proj\.lora_a\.weight'"):
        _check_keys_exist(drawn, ["layers.0.attn.q_proj.weight"])


@pytest.mark.parametrize(
    ("module_name", "key"),
    [
        ("layers.0._checkpoint_wrapped_module.attn", "layers.0.attn"),
        ("layers.1._orig_mod.mlp.w1", "layers.1.mlp.w1"),
        ("layers.2.attn.q_proj", "layers.2.attn.q_proj"),
    ],
)
def test_state_dict_name_drops_wrapper_prefixes(module_name, key):
    assert state_dict_name(module_name) == key
