"""Qwen3's and Gemma 3's tokenizers encode as ``transformers`` does from the same files.

Each module fixture writes a tiny tokenizer folder laid out as the released model's
(tests/tokenizer_files.py): for Qwen3 a byte-level BPE trained here with ``tokenizers``
(``vocab.json``, ``merges.txt``, ``tokenizer.json``, and a ``tokenizer_config.json`` with
Qwen3's added tokens and chat template); for Gemma 3 a SentencePiece BPE trained here
(``tokenizer.model`` with Gemma 3's special pieces at their ids, the ``tokenizer.json``
transformers converts it to, and a ``tokenizer_config.json`` with Gemma 3's chat template). The
chat templates are the released ones (tests/assets/tokenizers/*.jinja; Qwen3's tests run with
both released revisions of its template). Our tokenizers read the ``tokenizer.json``.

``transformers.AutoTokenizer`` loads each folder, and the tests compare token ids:
``apply_chat_template(messages)`` (no generation prompt, Qwen3's default ``enable_thinking``)
against ``tokenize_messages`` (add_end_tokens=True), the generation prompt
(``add_generation_prompt=True``) against ``add_end_tokens=False`` with a final empty assistant
message, and ``encode``/``decode`` on plain text. The masks are checked against the turns read
back from transformers' own tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizer_files import (
    QWEN3_CHAT_TEMPLATES,
    QWEN3_SPECIAL_TOKENS,
    write_gemma3_folder,
    write_qwen3_folder,
)
from torchtune.data import Message
from torchtune.datasets import alpaca_dataset, chat_dataset, preference_dataset

from exactga.models.gemma3._tokenizer import Gemma3Tokenizer, gemma3_tokenizer
from exactga.models.qwen3._tokenizer import (
    Qwen3Tokenizer,
    qwen3_tokenizer,
    render_qwen3_turns,
    split_thinking,
)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
sentencepiece = pytest.importorskip("sentencepiece")

IGNORE = -100  # torchtune's CROSS_ENTROPY_IGNORE_IDX

# Plain texts for encode: unicode (decomposed too), emoji, digits, whitespace runs, and
# special tokens written in the text.
TEXTS = [
    "Hello world!",
    "Grüße aus Köln — naïve cafe\u0301 (decomposed é), déjà vu.",
    "你好，世界。こんにちは 🙂👍🏽 ∑ x² ≤ 10³",
    "  leading spaces,\ttabs,\n\n\nnewlines   and trailing spaces   ",
    "digits 1234567890 and 3.14159; it's, we'll, they've",
]
QWEN3_TEXTS_WITH_TOKENS = [
    "<think>\nreasoning\n</think>\n\nanswer<|im_end|>\n<tool_call>x</tool_call>",
    "<|im_start|>user\nHi<|im_end|><|endoftext|>",
]

SYSTEM = "You are a helpful assistant."
QUESTION = "What is six times seven?"
THOUGHT = "<think>\nSix sevens are forty-two.\n</think>\n\n"
ANSWER = "The answer is 42."
FOLLOW_UP = "And what does the fox say?"
FOLLOW_UP_ANSWER = "Nobody knows; 你好 🙂."


def conversation(*turns: tuple[str, str], train_on_input: bool = False) -> list[Message]:
    """torchtune messages, masked as torchtune's message transforms mask them."""
    return [
        Message(role=role, content=content, masked=role != "assistant" and not train_on_input)
        for role, content in turns
    ]


SINGLE_TURN = [("system", SYSTEM), ("user", QUESTION), ("assistant", THOUGHT + ANSWER)]
TWO_TURNS = [
    *SINGLE_TURN,
    ("user", FOLLOW_UP),
    ("assistant", "<think>\nIt is a riddle.\n</think>\n\n" + FOLLOW_UP_ANSWER),
]
TWO_TURNS_NO_THINKING = [
    ("system", SYSTEM),
    ("user", QUESTION),
    ("assistant", ANSWER),
    ("user", FOLLOW_UP),
    ("assistant", FOLLOW_UP_ANSWER),
]


def hf_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The chat-template form of torchtune messages (ipython: role tool; tool calls as
    ``tool_calls`` whose JSON is the message's content)."""
    converted = []
    for message in messages:
        if message.role == "ipython":
            converted.append({"role": "tool", "content": message.text_content})
        elif message.ipython:
            call = json.loads(message.text_content)
            converted.append(
                {"role": "assistant", "content": "", "tool_calls": [{"function": call}]}
            )
        else:
            converted.append({"role": message.role, "content": message.text_content})
    return converted


def hf_chat_ids(hf_tokenizer: Any, messages: Sequence[Message], **flags: Any) -> list[int]:
    """``apply_chat_template(messages, tokenize=True, **flags)``'s token ids."""
    return hf_tokenizer.apply_chat_template(
        hf_messages(messages), tokenize=True, return_dict=False, **flags
    )


def expected_mask(ids: Sequence[int], hf_tokenizer: Any, turn_start: str) -> list[bool]:
    """Per token of transformers' ids, whether it lies outside an assistant turn: the ids are
    split at each ``turn_start`` token and each turn's role read from its decoded text."""
    start_id = hf_tokenizer.convert_tokens_to_ids(turn_start)
    starts = [i for i, token in enumerate(ids) if token == start_id] + [len(ids)]
    mask = [True] * starts[0]  # before the first turn (Gemma's <bos>)
    for begin, end in zip(starts, starts[1:], strict=False):
        role = hf_tokenizer.decode(ids[begin + 1 : end]).split("\n", 1)[0]
        mask += [role not in ("assistant", "model")] * (end - begin)
    return mask


# ---------------------------------------------------------------------------------------------
# Qwen3


@pytest.fixture(scope="module")
def qwen3_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Qwen3 tokenizer folder per released chat template."""
    return {
        template: write_qwen3_folder(tmp_path_factory.mktemp("qwen3_tokenizer"), template)
        for template in QWEN3_CHAT_TEMPLATES
    }


@pytest.fixture(scope="module", params=QWEN3_CHAT_TEMPLATES)
def qwen3_folder(qwen3_folders: dict[str, Path], request: pytest.FixtureRequest) -> Path:
    return qwen3_folders[request.param]


@pytest.fixture(scope="module")
def hf_qwen3(qwen3_folder: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_folder))


def make_qwen3(folder: Path, **kwargs: Any) -> Qwen3Tokenizer:
    return qwen3_tokenizer(str(folder / "tokenizer.json"), **kwargs)


@pytest.fixture(scope="module")
def qwen3(qwen3_folder: Path) -> Qwen3Tokenizer:
    return make_qwen3(qwen3_folder)


@pytest.fixture(scope="module")
def qwen3_as_template(qwen3_folder: Path) -> Qwen3Tokenizer:
    return make_qwen3(qwen3_folder, think_blocks="chat_template")


def test_qwen3_special_token_ids_are_transformers(qwen3: Qwen3Tokenizer, hf_qwen3: Any) -> None:
    for token, token_id in QWEN3_SPECIAL_TOKENS.items():
        assert hf_qwen3.convert_tokens_to_ids(token) == token_id, token
    assert QWEN3_SPECIAL_TOKENS["<think>"] == 151667 and QWEN3_SPECIAL_TOKENS["</think>"] == 151668
    assert (qwen3.eos_id, qwen3.pad_id) == (hf_qwen3.eos_token_id, hf_qwen3.pad_token_id)
    assert (qwen3.eos_id, qwen3.pad_id) == (151645, 151643)
    assert qwen3.stop_tokens == [151645, 151643]
    assert qwen3.bos_id is None and hf_qwen3.bos_token_id is None


@pytest.fixture(scope="module")
def torchtune_qwen(qwen3_folder: Path) -> Any:
    """torchtune's byte-level BPE from vocab.json and merges.txt with Qwen3's added tokens
    (what exactga's Qwen3 tokenizer encoded with before it read tokenizer.json)."""
    from torchtune.models.qwen2_5._tokenizer import Qwen2_5Tokenizer

    vocab, merges = str(qwen3_folder / "vocab.json"), str(qwen3_folder / "merges.txt")
    return Qwen2_5Tokenizer(vocab, merges, special_tokens=QWEN3_SPECIAL_TOKENS)


@pytest.mark.parametrize("text", TEXTS + QWEN3_TEXTS_WITH_TOKENS)
def test_qwen3_encode_and_decode_are_transformers(
    qwen3: Qwen3Tokenizer, hf_qwen3: Any, torchtune_qwen: Any, text: str
) -> None:
    ids = qwen3.encode(text, add_bos=False, add_eos=False)
    assert ids == hf_qwen3.encode(text)  # Qwen adds no bos/eos in transformers either
    assert ids == torchtune_qwen.encode(text, add_bos=False, add_eos=False)
    assert qwen3.encode(text) == ids + [qwen3.eos_id]  # torchtune's default add_eos=True
    for skip in (False, True):
        assert qwen3.decode(ids, skip_special_tokens=skip) == hf_qwen3.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("think_blocks", ["verbatim", "chat_template"])
def test_qwen3_single_turn_with_thinking_is_the_chat_template(
    qwen3_folder: Path, hf_qwen3: Any, think_blocks: str
) -> None:
    """System, user, assistant with a ``<think>`` block: both modes are the chat template's
    output (the last turn keeps its thinking there)."""
    tokenizer = make_qwen3(qwen3_folder, think_blocks=think_blocks)
    messages = conversation(*SINGLE_TURN)
    tokens, mask = tokenizer.tokenize_messages(messages)
    hf_ids = hf_chat_ids(hf_qwen3, messages)
    assert tokens == hf_ids
    assert mask == expected_mask(hf_ids, hf_qwen3, "<|im_start|>")
    assert tokenizer.think_start_id in tokens and tokenizer.think_end_id in tokens


def test_qwen3_two_turns_as_chat_template_is_the_chat_template(
    qwen3_as_template: Qwen3Tokenizer, hf_qwen3: Any
) -> None:
    """think_blocks="chat_template": the first turn's thinking is dropped, the last kept."""
    messages = conversation(*TWO_TURNS)
    tokens, mask = qwen3_as_template.tokenize_messages(messages)
    hf_ids = hf_chat_ids(hf_qwen3, messages)
    assert tokens == hf_ids
    assert mask == expected_mask(hf_ids, hf_qwen3, "<|im_start|>")
    assert tokens.count(qwen3_as_template.think_start_id) == 1


def test_qwen3_two_turns_verbatim_keeps_every_thought(qwen3: Qwen3Tokenizer, hf_qwen3: Any) -> None:
    """think_blocks="verbatim" (default): every turn as written. That is the chat template's
    rendering of each exchange on its own (where each assistant turn is the last and keeps its
    thinking), concatenated; the chat template of the whole conversation differs exactly by the
    first turn's thought."""
    messages = conversation(*TWO_TURNS)
    tokens, mask = qwen3.tokenize_messages(messages)
    hf_ids = hf_chat_ids(hf_qwen3, messages[:3]) + hf_chat_ids(hf_qwen3, messages[3:])
    assert tokens == hf_ids
    assert mask == expected_mask(hf_ids, hf_qwen3, "<|im_start|>")
    assert tokens.count(qwen3.think_start_id) == 2
    whole = hf_qwen3.apply_chat_template(hf_messages(messages), tokenize=False)
    assert qwen3.decode(tokens).replace(THOUGHT, "", 1) == whole


def test_qwen3_final_turn_without_thinking(
    qwen3: Qwen3Tokenizer, qwen3_as_template: Qwen3Tokenizer, hf_qwen3: Any
) -> None:
    """Qwen3's chat template gives the final assistant turn an empty think block; the
    "chat_template" mode does too, "verbatim" writes only what the data holds."""
    messages = conversation(*TWO_TURNS_NO_THINKING)
    hf_ids = hf_chat_ids(hf_qwen3, messages)
    assert qwen3_as_template.tokenize_messages(messages)[0] == hf_ids
    hf_text = hf_qwen3.apply_chat_template(hf_messages(messages), tokenize=False)
    assert hf_text.count("<think>\n\n</think>\n\n") == 1
    verbatim = hf_qwen3.encode(hf_text.replace("<think>\n\n</think>\n\n", ""))
    assert qwen3.tokenize_messages(messages)[0] == verbatim


def test_qwen3_tool_calls_are_the_chat_template(
    qwen3_as_template: Qwen3Tokenizer, hf_qwen3: Any
) -> None:
    """A tool call (ipython assistant message) and a run of two tool results (one user turn)."""
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    messages = [
        Message("system", SYSTEM, masked=True),
        Message("user", "What is the weather in Paris?", masked=True),
        Message("assistant", call, ipython=True),
        Message("ipython", '{"weather": "sunny"}', masked=True),
        Message("ipython", '{"temperature": 21}', masked=True),
        Message("assistant", THOUGHT + "It is sunny, 21 degrees."),
    ]
    tokens, mask = qwen3_as_template.tokenize_messages(messages)
    hf_ids = hf_chat_ids(hf_qwen3, messages)
    assert tokens == hf_ids
    assert mask == expected_mask(hf_ids, hf_qwen3, "<|im_start|>")


@pytest.mark.parametrize(
    ("think_blocks", "flags"), [("verbatim", {}), ("chat_template", {"enable_thinking": False})]
)
def test_qwen3_generation_prompt(
    qwen3_folder: Path, hf_qwen3: Any, think_blocks: str, flags: dict[str, Any]
) -> None:
    """add_end_tokens=False (``inference=True``) with a final empty assistant message is the
    generation prompt; in "chat_template" mode the non-thinking one."""
    tokenizer = make_qwen3(qwen3_folder, think_blocks=think_blocks)
    prompt = conversation(*SINGLE_TURN[:2])
    expected = hf_chat_ids(hf_qwen3, prompt, add_generation_prompt=True, **flags)
    open_turn = [*prompt, Message("assistant", "")]
    assert tokenizer.tokenize_messages(open_turn, add_end_tokens=False)[0] == expected
    assert tokenizer({"messages": open_turn}, inference=True)["tokens"] == expected


def test_qwen3_truncation(qwen3_folder: Path, qwen3: Qwen3Tokenizer) -> None:
    messages = conversation(*TWO_TURNS)
    full, full_mask = qwen3.tokenize_messages(messages)
    right = make_qwen3(qwen3_folder, max_seq_len=20)
    tokens, mask = right.tokenize_messages(messages)
    assert tokens == full[:19] + [right.eos_id] and mask == full_mask[:19] + [True]
    left = make_qwen3(qwen3_folder, max_seq_len=20, truncation_type="left")
    assert left.tokenize_messages(messages) == (full[-20:], full_mask[-20:])
    with pytest.raises(ValueError, match="truncation_type"):
        make_qwen3(qwen3_folder, truncation_type="middle")


def test_qwen3_builder_options(qwen3_folder: Path, qwen3: Qwen3Tokenizer) -> None:
    """The added tokens are tokenizer.json's; a prompt template adds text around the messages;
    ChatML around ChatML and unknown choices are refused."""
    assert qwen3.special_tokens == QWEN3_SPECIAL_TOKENS
    assert qwen3.vocab_size == max(QWEN3_SPECIAL_TOKENS.values()) + 1
    templated = make_qwen3(qwen3_folder, prompt_template={"user": ("Q: ", "\n")})
    messages = conversation(*SINGLE_TURN)
    assert "<|im_start|>user\nQ: " + QUESTION + "\n<|im_end|>" in templated.decode(
        templated.tokenize_messages(messages)[0]
    )
    with pytest.raises(ValueError, match="ChatML"):
        make_qwen3(qwen3_folder, prompt_template="torchtune.data.ChatMLTemplate")
    with pytest.raises(ValueError, match="think_blocks"):
        make_qwen3(qwen3_folder, think_blocks="strip")
    with pytest.raises(ValueError, match="no role"):
        render_qwen3_turns([Message("tool", "{}")])  # type: ignore[arg-type]


def test_the_builders_name_the_tokenizer_json_to_read(
    qwen3_folder: Path, gemma3_folder: Path
) -> None:
    """torchtune's Qwen2.5 keys (vocab.json and merges.txt), Gemma's tokenizer.model and another
    family's tokenizer.json are refused, each in one message naming the file to read."""
    fix = f"set tokenizer.path to {qwen3_folder}/tokenizer.json"
    with pytest.raises(ValueError, match=f"{fix} and drop tokenizer.merges_file"):
        qwen3_tokenizer(str(qwen3_folder / "vocab.json"), merges_file=str(qwen3_folder / "m.txt"))
    with pytest.raises(ValueError, match=f"no tokenizer.json .*{fix}"):
        qwen3_tokenizer(str(qwen3_folder / "vocab.json"))
    fix = f"set tokenizer.path to {gemma3_folder}/tokenizer.json"
    with pytest.raises(ValueError, match=f"no tokenizer.json .*{fix}"):
        gemma3_tokenizer(str(gemma3_folder / "tokenizer.model"))
    with pytest.raises(ValueError, match="has no token '<|im_end|>'"):
        qwen3_tokenizer(str(gemma3_folder / "tokenizer.json"))


def test_split_thinking_is_the_chat_templates_split() -> None:
    assert split_thinking(THOUGHT + ANSWER) == ("Six sevens are forty-two.", ANSWER)
    assert split_thinking("no thinking") == ("", "no thinking")
    # Qwen3 emits no <think> when its prompt already ends with one.
    assert split_thinking("just thought\n</think>\n\nanswer") == ("just thought", "answer")


# ---------------------------------------------------------------------------------------------
# Gemma 3


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma3_folder(tmp_path_factory.mktemp("gemma3_tokenizer"))


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_folder: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(gemma3_folder))


@pytest.fixture(scope="module")
def gemma3(gemma3_folder: Path) -> Gemma3Tokenizer:
    return gemma3_tokenizer(str(gemma3_folder / "tokenizer.json"))


GEMMA3_SINGLE_TURN = [("system", SYSTEM), ("user", QUESTION), ("assistant", ANSWER)]
GEMMA3_TWO_TURNS = [
    *GEMMA3_SINGLE_TURN,
    ("user", FOLLOW_UP),
    ("assistant", FOLLOW_UP_ANSWER),
]
# Contents with surrounding whitespace, which Gemma 3's template trims (not the system's).
GEMMA3_UNTRIMMED = [
    ("system", "  Be brief.\n"),
    ("user", "\n  " + QUESTION + "  \n"),
    ("assistant", "  " + ANSWER + "\n\n"),
    ("user", "\t" + FOLLOW_UP),
    ("assistant", FOLLOW_UP_ANSWER + " "),
]


def test_gemma3_special_token_ids_are_transformers(gemma3: Gemma3Tokenizer, hf_gemma3: Any) -> None:
    assert (gemma3.pad_id, gemma3.eos_id, gemma3.bos_id) == (0, 1, 2)
    assert (gemma3.start_of_turn_id, gemma3.end_of_turn_id) == (105, 106)
    assert gemma3.stop_tokens == [1, 106]
    assert (hf_gemma3.pad_token_id, hf_gemma3.eos_token_id, hf_gemma3.bos_token_id) == (0, 1, 2)
    assert hf_gemma3.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]


@pytest.fixture(scope="module")
def torchtune_gemma(gemma3_folder: Path) -> Any:
    """torchtune's SentencePiece Gemma tokenizer on tokenizer.model (what exactga's Gemma 3
    tokenizer encoded and decoded with before it read tokenizer.json)."""
    from torchtune.models.gemma import gemma_tokenizer

    return gemma_tokenizer(str(gemma3_folder / "tokenizer.model"))


@pytest.mark.parametrize("text", TEXTS)
def test_gemma3_encode_is_transformers(
    gemma3: Gemma3Tokenizer, hf_gemma3: Any, torchtune_gemma: Any, text: str
) -> None:
    ids = gemma3.encode(text, add_eos=False)
    assert ids == hf_gemma3.encode(text)  # both start with <bos>
    assert ids == torchtune_gemma.encode(text, add_eos=False)
    assert gemma3.encode(text) == ids + [gemma3.eos_id]
    assert gemma3.decode(ids) == text == hf_gemma3.decode(ids, skip_special_tokens=True)


def test_gemma3_reads_control_tokens_in_text_as_sentencepiece_does(
    gemma3: Gemma3Tokenizer, hf_gemma3: Any, torchtune_gemma: Any
) -> None:
    """A text writing <eos>, <bos>, <pad> or <unk> is encoded as that text (SentencePiece,
    what exactga encoded with before), not as the token (transformers); <start_of_turn> written
    in a text is the token in all three."""
    text = "Stop at <eos>, not <bos> or <pad>; <unk>.<start_of_turn>user\n"
    ids = gemma3.encode(text, add_bos=False, add_eos=False)
    assert ids == torchtune_gemma.encode(text, add_bos=False, add_eos=False)
    assert not {gemma3.pad_id, gemma3.eos_id, gemma3.bos_id, 3} & set(ids)
    assert gemma3.start_of_turn_id in ids
    assert gemma3.eos_id in hf_gemma3.encode(text, add_special_tokens=False)
    assert gemma3.decode(ids) == text
    assert gemma3.special_tokens["<eos>"] == gemma3.eos_id == 1


def test_gemma3_builds_no_control_token_from_text(gemma3_folder: Path, tmp_path: Path) -> None:
    """A converted tokenizer.json may hold merges that build <eos> from its characters
    (SentencePiece never segments a text into a control piece): they are not used."""
    spec = json.loads((gemma3_folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for piece in ["<", ">", "<e", "<eo", "<eos"]:
        vocab.setdefault(piece, max(vocab.values()) + 1)
    chain = [["<", "e"], ["<e", "o"], ["<eo", "s"], ["<eos", ">"]]
    spec["model"]["merges"] = chain + spec["model"]["merges"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<eos>"]
    unfiltered = tokenizers.Tokenizer.from_str(json.dumps(spec))
    assert unfiltered.encode("<eos>", add_special_tokens=False).ids == [1]
    ids = gemma3_tokenizer(str(tmp_path / "tokenizer.json")).encode("<eos>", False, False)
    assert 1 not in ids and len(ids) > 1


def test_gemma3_decode_and_vocab_size_are_sentencepieces(
    gemma3: Gemma3Tokenizer, torchtune_gemma: Any
) -> None:
    """decode drops <pad>, <eos> and <bos> and writes the turn tokens out, as SentencePiece's
    decode; vocab_size (which GRPO's rewards read) is the SentencePiece model's."""
    tokens = gemma3.tokenize_messages(conversation(*GEMMA3_TWO_TURNS))[0]
    tokens = [gemma3.pad_id, *tokens, gemma3.eos_id]
    assert gemma3.decode(tokens) == torchtune_gemma.decode(tokens)
    assert gemma3.decode(tokens).startswith("<start_of_turn>user\n" + SYSTEM)
    assert gemma3.vocab_size == torchtune_gemma.vocab_size


@pytest.mark.parametrize(
    "turns", [GEMMA3_SINGLE_TURN, GEMMA3_TWO_TURNS, GEMMA3_UNTRIMMED, GEMMA3_TWO_TURNS[1:]]
)
def test_gemma3_conversation_is_the_chat_template(
    gemma3: Gemma3Tokenizer, hf_gemma3: Any, turns: list[tuple[str, str]]
) -> None:
    messages = conversation(*turns)
    tokens, mask = gemma3.tokenize_messages(messages)
    hf_ids = hf_chat_ids(hf_gemma3, messages)
    assert tokens == hf_ids
    assert mask == expected_mask(hf_ids, hf_gemma3, "<start_of_turn>")


def test_gemma3_system_text_takes_the_system_messages_mask(gemma3: Gemma3Tokenizer) -> None:
    """train_on_input=True with a system prompt torchtune masks (``new_system_prompt``): the
    first user turn's header and folded system text stay masked, its own text is trained."""
    messages = conversation(*GEMMA3_SINGLE_TURN, train_on_input=True)
    messages[0].masked = True
    tokens, mask = gemma3.tokenize_messages(messages)
    first_end = tokens.index(gemma3.end_of_turn_id)
    first_turn = list(zip(tokens[:first_end], mask[:first_end], strict=True))
    masked_text = gemma3.decode([token for token, masked in first_turn if masked])
    trained_text = gemma3.decode([token for token, masked in first_turn if not masked])
    assert masked_text == "<start_of_turn>user\n" + SYSTEM + "\n\n"
    assert trained_text == QUESTION
    assert not any(mask[first_end:])


def test_gemma3_generation_prompt(gemma3: Gemma3Tokenizer, hf_gemma3: Any) -> None:
    prompt = conversation(*GEMMA3_SINGLE_TURN[:2])
    expected = hf_chat_ids(hf_gemma3, prompt, add_generation_prompt=True)
    open_turn = [*prompt, Message("assistant", "")]
    assert gemma3.tokenize_messages(open_turn, add_end_tokens=False)[0] == expected
    assert gemma3({"messages": open_turn}, inference=True)["tokens"] == expected


def test_gemma3_refuses_what_its_format_cannot_hold(gemma3: Gemma3Tokenizer) -> None:
    with pytest.raises(ValueError, match="user message must follow"):
        gemma3.tokenize_messages(conversation(("system", SYSTEM), ("assistant", ANSWER)))
    with pytest.raises(ValueError, match="'ipython'"):
        gemma3.tokenize_messages(conversation(("user", QUESTION), ("ipython", "{}")))


def test_gemma3_truncation(gemma3_folder: Path, gemma3: Gemma3Tokenizer) -> None:
    messages = conversation(*GEMMA3_TWO_TURNS)
    full, full_mask = gemma3.tokenize_messages(messages)
    short = gemma3_tokenizer(str(gemma3_folder / "tokenizer.json"), max_seq_len=15)
    tokens, mask = short.tokenize_messages(messages)
    assert tokens == full[:14] + [short.eos_id] and mask == full_mask[:14] + [True]


# ---------------------------------------------------------------------------------------------
# torchtune's stock dataset builders


def labels(tokens: Sequence[int], mask: Sequence[bool]) -> list[int]:
    """torchtune's labels: the tokens, the masked ones ignored."""
    return [IGNORE if masked else token for token, masked in zip(tokens, mask, strict=True)]


def write_json(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text(json.dumps(rows))
    return str(path)


def openai_rows() -> list[dict[str, Any]]:
    rows = []
    for turns in (SINGLE_TURN, TWO_TURNS_NO_THINKING, GEMMA3_UNTRIMMED):
        rows.append({"messages": [{"role": r, "content": c} for r, c in turns]})
    return rows


@pytest.fixture(params=["qwen3", "gemma3"])
def tokenizer_pair(request: pytest.FixtureRequest) -> tuple[Any, Any, str]:
    """(ours, transformers', turn start token) for each family."""
    if request.param == "qwen3":
        folder = request.getfixturevalue("qwen3_folders")[QWEN3_CHAT_TEMPLATES[0]]
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        return make_qwen3(folder), hf, "<|im_start|>"
    return (
        request.getfixturevalue("gemma3"),
        request.getfixturevalue("hf_gemma3"),
        "<start_of_turn>",
    )


def test_chat_dataset_rows_are_the_chat_template(tokenizer_pair: tuple, tmp_path: Path) -> None:
    ours, hf, turn_start = tokenizer_pair
    rows = openai_rows()
    data = chat_dataset(
        ours,
        source="json",
        data_files=write_json(tmp_path / "chat.json", rows),
        conversation_column="messages",
        conversation_style="openai",
        train_on_input=False,
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(data) == 3
    for index, row in enumerate(rows):
        sample = data[index]
        hf_ids = hf.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
        if isinstance(ours, Qwen3Tokenizer) and index > 0:
            # Verbatim: the last turn holds no thinking, where the template writes an empty one.
            text = hf.apply_chat_template(row["messages"], tokenize=False)
            hf_ids = hf.encode(text.replace("<think>\n\n</think>\n\n", ""))
        assert sample["tokens"] == hf_ids
        masked = expected_mask(hf_ids, hf, turn_start)
        assert sample["labels"] == labels(hf_ids, masked)


def test_alpaca_dataset_trains_on_the_response(tokenizer_pair: tuple, tmp_path: Path) -> None:
    ours, hf, turn_start = tokenizer_pair
    rows = [
        {
            "instruction": "Answer the question.",
            "input": "What is six times seven?",
            "output": ANSWER,
        },
        {"instruction": "Say hello.", "input": "", "output": "Grüße! 你好 🙂"},
        {"instruction": "Name the weather.", "input": "Paris", "output": "sunny"},
    ]
    data = alpaca_dataset(
        ours,
        source="json",
        data_files=write_json(tmp_path / "alpaca.json", rows),
        train_on_input=False,
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(data) == 3
    for index, row in enumerate(rows):
        sample = data[index]
        masked = expected_mask(sample["tokens"], hf, turn_start)
        assert sample["labels"] == labels(sample["tokens"], masked)
        trained = [t for t in sample["labels"] if t != IGNORE]
        assert row["output"] in hf.decode(trained)


def test_preference_dataset_accepts_the_tokenizers(tokenizer_pair: tuple, tmp_path: Path) -> None:
    ours, hf, turn_start = tokenizer_pair

    def pair(question: str, answer: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

    rows = [
        {"chosen": pair(QUESTION, ANSWER), "rejected": pair(QUESTION, "Forty-one.")},
        {"chosen": pair(FOLLOW_UP, FOLLOW_UP_ANSWER), "rejected": pair(FOLLOW_UP, "Woof.")},
        {"chosen": pair("Hi", "Grüße 🙂"), "rejected": pair("Hi", "…")},
    ]
    data = preference_dataset(
        ours,
        source="json",
        data_files=write_json(tmp_path / "pairs.json", rows),
        train_on_input=False,
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(data) == 3
    sample = data[0]
    for side in ("chosen", "rejected"):
        ids = sample[f"{side}_input_ids"]
        masked = expected_mask(ids, hf, turn_start)
        assert sample[f"{side}_labels"] == labels(ids, masked)


def test_the_grpo_prompt_set_accepts_the_tokenizers(tokenizer_pair: tuple, tmp_path: Path) -> None:
    """exactga's GRPO prompts (``exactga.grpo.prompts.prompt_dataset``) encode the question
    with the family's ``encode``, as transformers' tokenizer encodes it, and keep the answer."""
    from exactga.grpo.prompts import prompt_dataset

    ours, hf, _ = tokenizer_pair
    rows = [{"question": "14 - 4 =", "answer": "10"}, {"question": "6 * 7 =", "answer": "42"}]
    data = prompt_dataset(
        ours,
        source="json",
        data_files=write_json(tmp_path / "prompts.json", rows),
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(data) == 2
    for index, row in enumerate(rows):
        sample = data[index]
        prompt_ids = [t for t in sample["prompt_tokens"] if t not in (ours.bos_id, ours.eos_id)]
        assert hf.decode(prompt_ids).strip().endswith(row["question"])
        assert sample["answer"] == row["answer"]
