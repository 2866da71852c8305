"""Gemma 3 text decoders (Hugging Face ``Gemma3ForCausalLM``): the component builders, the
released sizes with their LoRA and QLoRA twins, and the Hugging Face format
(:data:`~exactga.models.gemma3._convert_weights.GEMMA3_FORMAT`)."""

from exactga.models.gemma3._component_builders import gemma3, lora_gemma3
from exactga.models.gemma3._convert_weights import GEMMA3_FORMAT
from exactga.models.gemma3._model_builders import (
    BUILDER_ARGUMENTS,
    gemma3_1b,
    gemma3_4b,
    gemma3_12b,
    gemma3_27b,
    lora_gemma3_1b,
    lora_gemma3_4b,
    lora_gemma3_12b,
    lora_gemma3_27b,
    qlora_gemma3_1b,
    qlora_gemma3_4b,
    qlora_gemma3_12b,
    qlora_gemma3_27b,
)
from exactga.models.gemma3._tokenizer import Gemma3Tokenizer, gemma3_tokenizer

__all__ = [
    "BUILDER_ARGUMENTS",
    "GEMMA3_FORMAT",
    "Gemma3Tokenizer",
    "gemma3_tokenizer",
    "gemma3",
    "gemma3_1b",
    "gemma3_4b",
    "gemma3_12b",
    "gemma3_27b",
    "lora_gemma3",
    "lora_gemma3_1b",
    "lora_gemma3_4b",
    "lora_gemma3_12b",
    "lora_gemma3_27b",
    "qlora_gemma3_1b",
    "qlora_gemma3_4b",
    "qlora_gemma3_12b",
    "qlora_gemma3_27b",
]
