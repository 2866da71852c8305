"""gpt-oss models (20B, 120B) in torchtune's builder style, with their Hugging Face format
(docs/models.md).

``gpt_oss``/``lora_gpt_oss`` take every shape argument; the sized builders (``gpt_oss_20b``,
``gpt_oss_120b`` and their ``lora_`` twins) the released configs. ``GPT_OSS_FORMAT`` converts
weights to and from Hugging Face's names and layouts, the released MXFP4 experts included.
``gpt_oss_tokenizer`` reads the released ``tokenizer.json`` with the harmony chat format.
"""

from exactga.models.gpt_oss._component_builders import (
    gpt_oss,
    gpt_oss_layer_types,
    lora_gpt_oss,
)
from exactga.models.gpt_oss._convert_weights import GPT_OSS_FORMAT
from exactga.models.gpt_oss._model_builders import (
    BUILDER_ARGUMENTS,
    gpt_oss_20b,
    gpt_oss_120b,
    lora_gpt_oss_20b,
    lora_gpt_oss_120b,
)
from exactga.models.gpt_oss._mxfp4 import dequantize_mxfp4, quantize_mxfp4
from exactga.models.gpt_oss._tokenizer import (
    GptOssTokenizer,
    HarmonyToMessages,
    gpt_oss_tokenizer,
    harmony_messages,
)

__all__ = [
    "BUILDER_ARGUMENTS",
    "GPT_OSS_FORMAT",
    "GptOssTokenizer",
    "HarmonyToMessages",
    "dequantize_mxfp4",
    "gpt_oss",
    "gpt_oss_120b",
    "gpt_oss_20b",
    "gpt_oss_layer_types",
    "gpt_oss_tokenizer",
    "harmony_messages",
    "lora_gpt_oss",
    "lora_gpt_oss_120b",
    "lora_gpt_oss_20b",
    "quantize_mxfp4",
]
