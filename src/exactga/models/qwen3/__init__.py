"""Qwen3 dense models (0.6B to 32B) in torchtune's builder style, with their Hugging Face format.

``qwen3``/``lora_qwen3`` take every shape argument; the sized builders (``qwen3_8b``,
``lora_qwen3_8b``, ``qlora_qwen3_8b``, ...) the released configs. ``QWEN3_FORMAT`` converts
weights and adapters to and from Hugging Face's and PEFT's names.
"""

from exactga.models.qwen3._component_builders import Qwen3Attention, lora_qwen3, qwen3
from exactga.models.qwen3._convert_weights import QWEN3_FORMAT
from exactga.models.qwen3._model_builders import (
    BUILDER_ARGUMENTS,
    lora_qwen3_0_6b,
    lora_qwen3_1_7b,
    lora_qwen3_4b,
    lora_qwen3_8b,
    lora_qwen3_14b,
    lora_qwen3_32b,
    qlora_qwen3_0_6b,
    qlora_qwen3_1_7b,
    qlora_qwen3_4b,
    qlora_qwen3_8b,
    qlora_qwen3_14b,
    qlora_qwen3_32b,
    qwen3_0_6b,
    qwen3_1_7b,
    qwen3_4b,
    qwen3_8b,
    qwen3_14b,
    qwen3_32b,
)
from exactga.models.qwen3._tokenizer import Qwen3Tokenizer, qwen3_tokenizer

__all__ = [
    "BUILDER_ARGUMENTS",
    "QWEN3_FORMAT",
    "Qwen3Attention",
    "Qwen3Tokenizer",
    "lora_qwen3",
    "lora_qwen3_0_6b",
    "lora_qwen3_14b",
    "lora_qwen3_1_7b",
    "lora_qwen3_32b",
    "lora_qwen3_4b",
    "lora_qwen3_8b",
    "qlora_qwen3_0_6b",
    "qlora_qwen3_14b",
    "qlora_qwen3_1_7b",
    "qlora_qwen3_32b",
    "qlora_qwen3_4b",
    "qlora_qwen3_8b",
    "qwen3",
    "qwen3_0_6b",
    "qwen3_14b",
    "qwen3_1_7b",
    "qwen3_32b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_tokenizer",
]
