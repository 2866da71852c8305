"""Qwen3 MoE models (30B-A3B, 235B-A22B) in torchtune's builder style, with their Hugging Face
format (docs/moe.md).

``qwen3_moe``/``lora_qwen3_moe`` take every shape argument; the sized builders
(``qwen3_moe_30b_a3b``, ``lora_qwen3_moe_30b_a3b``, ``qlora_qwen3_moe_30b_a3b``, ...) the released
configs. ``QWEN3_MOE_FORMAT`` converts weights and adapters to and from Hugging Face's and PEFT's
names and layouts.
"""

from exactga.models.qwen3_moe._component_builders import (
    is_sparse_layer,
    lora_qwen3_moe,
    qwen3_moe,
)
from exactga.models.qwen3_moe._convert_weights import QWEN3_MOE_FORMAT
from exactga.models.qwen3_moe._model_builders import (
    BUILDER_ARGUMENTS,
    lora_qwen3_moe_30b_a3b,
    lora_qwen3_moe_235b_a22b,
    qlora_qwen3_moe_30b_a3b,
    qlora_qwen3_moe_235b_a22b,
    qwen3_moe_30b_a3b,
    qwen3_moe_235b_a22b,
)

__all__ = [
    "BUILDER_ARGUMENTS",
    "QWEN3_MOE_FORMAT",
    "is_sparse_layer",
    "lora_qwen3_moe",
    "lora_qwen3_moe_235b_a22b",
    "lora_qwen3_moe_30b_a3b",
    "qlora_qwen3_moe_235b_a22b",
    "qlora_qwen3_moe_30b_a3b",
    "qwen3_moe",
    "qwen3_moe_235b_a22b",
    "qwen3_moe_30b_a3b",
]
