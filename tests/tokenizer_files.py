"""Tiny tokenizer folders laid out as Qwen3's, Gemma 3's and gpt-oss's releases, written on demand.

Shared by tests/test_tokenizers_qwen3_gemma3.py and tests/test_tokenizer_gpt_oss.py (our
tokenizers against transformers' from the same files) and tests/test_recipe_model_families.py
(the families trained through ``tune run`` with their own tokenizers). Nothing here is a test.

For Qwen3 a byte-level BPE trained here with ``tokenizers`` (``vocab.json``, ``merges.txt``,
``tokenizer.json``, and a ``tokenizer_config.json`` with Qwen3's added tokens and chat template);
for Gemma 3 a SentencePiece BPE trained here (``tokenizer.model`` with Gemma 3's special pieces
at their ids), the ``tokenizer.json`` transformers converts it to (as Gemma 3's release ships
both), and a ``tokenizer_config.json`` with Gemma 3's chat template. exactga's tokenizers read
the ``tokenizer.json``; transformers reads the folder.

The chat templates in tests/assets/tokenizers/ are the released ones, copied byte for byte:

- ``qwen3_chat_template.jinja``: Qwen3's first release (``Qwen/Qwen3-0.6B``'s
  ``tokenizer_config.json``, as huggingface/huggingface.js's packages/jinja/test/e2e.test.js
  holds it at fe42e68).
- ``qwen3_chat_template_2.jinja``: Qwen3's later revision, which reads non-string contents as
  empty (``Qwen/Qwen3-8B``'s ``tokenizer_config.json`` on main, as guidance-ai/guidance's
  guidance/chat.py holds it at 5413339); it renders text conversations as the first.
- ``gemma3_chat_template.jinja``: Gemma 3's (``_CHAT_TEMPLATE`` of transformers'
  models/gemma3/convert_gemma3_weights.py, which wrote the released ``tokenizer_config.json``;
  the same as the ``google/gemma-3-270m-it`` template huggingface.js's
  packages/ollama-utils/src/chat-template-automap.ts holds at fe42e68).
- ``gpt_oss_chat_template.jinja``: gpt-oss's (``openai/gpt-oss-20b``'s ``chat_template.jinja`` at
  the Hub commit cbf31f6, "Update chat_template.jinja (#94)" of 2025-08-08, as
  EchoCog/gpt-oss-20b's clone of the Hub repository holds it; byte for byte llama.cpp's
  models/templates/openai-gpt-oss-120b.jinja, its copy of the 120B's, at 1eeb523). The revision
  before it (#82) wrote no blank line after the developer message's instructions.

For gpt-oss a byte-level BPE trained here with o200k's pre-tokenizer, its ``tokenizer.json`` with
the harmony tokens at their ids (the release's ``tokenizer_config.json`` adds nothing the tests
read: transformers loads the file with the release's bos, eos and pad tokens).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).parent / "assets" / "tokenizers"
QWEN3_CHAT_TEMPLATES = ("qwen3_chat_template.jinja", "qwen3_chat_template_2.jinja")

# Qwen3's added tokens and their ids (its tokenizer_config.json's added_tokens_decoder).
QWEN3_SPECIAL_TOKENS: dict[str, int] = {
    content: 151643 + index
    for index, content in enumerate(
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ]
    )
}
# The added tokens Qwen3 marks ``"special": false`` (from <tool_call> on): text markers that
# transformers' decode keeps even with skip_special_tokens=True.
QWEN3_TEXT_MARKER_TOKENS = frozenset(list(QWEN3_SPECIAL_TOKENS)[14:])

# Training text for the tiny tokenizers: the chat words, so they get merges, and unicode.
CORPUS = (
    "system user assistant model You are a helpful assistant. What is six times seven? "
    "Six sevens are forty-two, so the answer is 42. Let me think step by step. "
    "The quick brown fox jumps over the lazy dog; what does the fox say?\n"
    "Grüße aus Köln, naïve café, déjà vu. 你好，世界。 こんにちは 🙂👍 \t tabs\n\n"
    "Instruction: Answer the question. Input: the weather in Paris. Output: sunny.\n"
) * 30


def qwen3_added_tokens() -> dict[int, dict[str, Any]]:
    """Qwen3's ``added_tokens_decoder``: ids 151643-151668, the first 14 special, the text
    markers (tool calls, fill-in-the-middle, tool responses, thinking) not."""
    return {
        token_id: {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content not in QWEN3_TEXT_MARKER_TOKENS,
        }
        for content, token_id in QWEN3_SPECIAL_TOKENS.items()
    }


def train_byte_level_bpe(text: str) -> Any:
    """A byte-level BPE with Qwen2/Qwen3's normalizer, pre-tokenizer and decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from torchtune.models.qwen2._tokenizer import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    return tokenizer


def write_qwen3_folder(folder: Path, chat_template: str = QWEN3_CHAT_TEMPLATES[0]) -> Path:
    """Qwen3's tokenizer files for a tiny BPE: vocab.json and merges.txt, tokenizer.json (what
    our tokenizer reads) and tokenizer_config.json (transformers reads the last two), its chat
    template the asset ``chat_template``."""
    bpe = train_byte_level_bpe(CORPUS)
    bpe.model.save(str(folder))  # vocab.json, merges.txt
    added = qwen3_added_tokens()
    spec = json.loads(bpe.to_str())
    # tokenizers numbers an added token missing from the model's vocab after the vocab (here
    # ~600), so the added tokens also go into tokenizer.json's vocab to keep Qwen3's ids.
    spec["model"]["vocab"].update({entry["content"]: i for i, entry in added.items()})
    spec["added_tokens"] = [{"id": i, **entry} for i, entry in added.items()]
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): entry for i, entry in added.items()},
        "bos_token": None,
        "chat_template": (ASSETS / chat_template).read_text(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


# Gemma 3's first pieces: the meta pieces, then <mask>, [multimodal], 99 unused, the turn
# tokens at 105 and 106, and newline runs from 107.
GEMMA3_PIECES = [
    "<mask>",
    "[multimodal]",
    *(f"<unused{i}>" for i in range(99)),
    "<start_of_turn>",
    "<end_of_turn>",
    "\n",
    "\n\n",
    "\n\n\n",
]


def train_sentencepiece_bpe(text: str) -> bytes:
    """A SentencePiece BPE set up as Gemma's: byte fallback, digits split, whitespace kept
    as written (no normalisation, no dummy prefix), Gemma 3's ids for its special pieces."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.split("\n\n")),
        model_writer=model,
        model_type="bpe",
        vocab_size=800,
        hard_vocab_limit=False,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=GEMMA3_PIECES,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    return model.getvalue()


def write_gemma3_folder(folder: Path) -> Path:
    """Gemma 3's tokenizer files for a tiny model: tokenizer.model, tokenizer_config.json, and
    the tokenizer.json transformers converts the SentencePiece model to (what our tokenizer
    reads; transformers then reads it too, as from Gemma 3's release)."""
    (folder / "tokenizer.model").write_bytes(train_sentencepiece_bpe(CORPUS))
    special = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>"}
    special |= {105: "<start_of_turn>", 106: "<end_of_turn>"}
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, content in special.items()
        },
        "bos_token": "<bos>",
        "chat_template": (ASSETS / "gemma3_chat_template.jinja").read_text(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "spaces_between_special_tokens": False,
        "tokenizer_class": "GemmaTokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(str(folder))
    converted.backend_tokenizer.save(str(folder / "tokenizer.json"))
    return folder


# gpt-oss's added tokens and their ids (o200k_harmony: openai/harmony's
# src/tiktoken_ext/public_encodings.rs; the release's tokenizer.json holds 199998-200018).
GPT_OSS_SPECIAL_TOKENS: dict[str, int] = {
    "<|startoftext|>": 199998,
    "<|endoftext|>": 199999,
    "<|reserved_200000|>": 200000,
    "<|reserved_200001|>": 200001,
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|reserved_200004|>": 200004,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|reserved_200009|>": 200009,
    "<|reserved_200010|>": 200010,
    "<|reserved_200011|>": 200011,
    "<|call|>": 200012,
    **{f"<|reserved_{i}|>": i for i in range(200013, 200018)},
    "<|endofprompt|>": 200018,
}
# o200k's pre-tokenizer pattern (tiktoken's o200k_base, which o200k_harmony keeps).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def write_gpt_oss_folder(folder: Path) -> Path:
    """gpt-oss's tokenizer.json for a tiny byte-level BPE with o200k's pre-tokenizer (no
    normalizer) and the harmony tokens at their ids, all special, as the release's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(CORPUS.splitlines(), trainer)
    spec = json.loads(bpe.to_str())
    # The added tokens also go into the model's vocab to keep their ids (see write_qwen3_folder).
    spec["model"]["vocab"].update(GPT_OSS_SPECIAL_TOKENS)
    spec["added_tokens"] = [
        {
            "id": token_id,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for content, token_id in GPT_OSS_SPECIAL_TOKENS.items()
    ]
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return folder
