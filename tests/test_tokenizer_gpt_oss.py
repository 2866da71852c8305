"""gpt-oss's tokenizer and harmony chat format encode as ``transformers`` does from the same files.

The module fixture writes a tiny ``tokenizer.json`` laid out as the release's
(tests/tokenizer_files.py: a byte-level BPE trained here with o200k's pre-tokenizer, and the
harmony tokens 199998-200018 at their released ids, all special). transformers reads it with
``PreTrainedTokenizerFast(tokenizer_file=...)`` and renders conversations with the released chat
template (tests/assets/tokenizers/gpt_oss_chat_template.jinja, where it comes from is in
tests/tokenizer_files.py), the template's ``Current date`` pinned by patching the clock its
``strftime_now`` reads. The tests compare token ids: ``apply_chat_template(messages)`` against
``tokenize_messages`` (add_end_tokens=True), the generation prompt against
``add_end_tokens=False`` with a final empty assistant message, ``encode``/``decode`` on plain
text; the masks against the messages read back from transformers' own tokens.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizer_files import (
    ASSETS,
    GPT_OSS_SPECIAL_TOKENS,
    write_gpt_oss_folder,
    write_qwen3_folder,
)
from torchtune.data import Message
from torchtune.datasets import SFTDataset, alpaca_dataset, chat_dataset, instruct_dataset

from exactga.models.gpt_oss import (
    GptOssTokenizer,
    HarmonyToMessages,
    gpt_oss_tokenizer,
    harmony_messages,
)

transformers = pytest.importorskip("transformers")

IGNORE = -100  # torchtune's CROSS_ENTROPY_IGNORE_IDX
DATE = datetime.datetime(2025, 6, 28)
TEMPLATE = (ASSETS / "gpt_oss_chat_template.jinja").read_text()

INSTRUCTIONS = "Answer briefly."
QUESTION = "What is six times seven?"
THOUGHT = "Six sevens are forty-two."
ANSWER = "The answer is 42."
FOLLOW_UP = "And what does the fox say?"
FOLLOW_UP_THOUGHT = "It is a riddle; 你好 🙂."
FOLLOW_UP_ANSWER = "Nobody knows."

# Chat rows in the released template's form (an assistant's chain of thought in ``thinking``).
SINGLE_TURN = [
    {"role": "system", "content": INSTRUCTIONS},
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "thinking": THOUGHT, "content": ANSWER},
]
TWO_TURNS = [
    *SINGLE_TURN,
    {"role": "user", "content": FOLLOW_UP},
    {"role": "assistant", "thinking": FOLLOW_UP_THOUGHT, "content": FOLLOW_UP_ANSWER},
]
TEXTS = [
    "Hello world!",
    "Grüße aus Köln — naïve cafe\u0301, déjà vu. 你好，世界。🙂👍🏽",
    "  leading spaces,\ttabs,\n\n\nnewlines   and trailing   ",
    "digits 1234567890 and 3.14159; it's, WE'LL, they've",
    "<|start|>user<|message|>Hi<|end|><|return|><|endoftext|>",
]


class _PinnedClock(datetime.datetime):
    """The clock the chat template's ``strftime_now`` reads, pinned to ``DATE``."""

    @classmethod
    def now(cls, tz: datetime.tzinfo | None = None) -> datetime.datetime:
        return DATE


@pytest.fixture(autouse=True)
def pinned_date(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_utils, "datetime", _PinnedClock)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt_oss_folder(tmp_path_factory.mktemp("gpt_oss_tokenizer"))


@pytest.fixture(scope="module")
def hf_gpt_oss(folder: Path) -> Any:
    """transformers' tokenizer from the file, with the release's tokenizer_config tokens."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
    )


def make(folder: Path, **kwargs: Any) -> GptOssTokenizer:
    return gpt_oss_tokenizer(
        str(folder / "tokenizer.json"), current_date=DATE.date().isoformat(), **kwargs
    )


@pytest.fixture(scope="module")
def gpt_oss(folder: Path) -> GptOssTokenizer:
    return make(folder)


@pytest.fixture(scope="module")
def gpt_oss_as_template(folder: Path) -> GptOssTokenizer:
    return make(folder, analysis_channels="chat_template")


def hf_chat_ids(hf: Any, rows: Sequence[dict[str, Any]], **flags: Any) -> list[int]:
    return hf.apply_chat_template(
        list(rows), chat_template=TEMPLATE, tokenize=True, return_dict=False, **flags
    )


def hf_chat_text(hf: Any, rows: Sequence[dict[str, Any]], **flags: Any) -> str:
    return hf.apply_chat_template(list(rows), chat_template=TEMPLATE, tokenize=False, **flags)


def expected_mask(ids: Sequence[int], hf: Any) -> list[bool]:
    """Per token of transformers' ids, whether it lies outside an assistant message: the ids are
    split at each ``<|start|>`` and each message's role read from its decoded header."""
    start = GPT_OSS_SPECIAL_TOKENS["<|start|>"]
    starts = [i for i, token in enumerate(ids) if token == start] + [len(ids)]
    assert starts[0] == 0
    mask = []
    for begin, end in zip(starts, starts[1:], strict=False):
        header = hf.decode(ids[begin + 1 : end]).split("<|", 1)[0]
        mask += [header != "assistant"] * (end - begin)
    return mask


def trained_text(tokenizer: GptOssTokenizer, tokens: Sequence[int], mask: Sequence[bool]) -> str:
    return tokenizer.decode([t for t, masked in zip(tokens, mask, strict=True) if not masked])


def test_harmony_token_ids_are_the_releases(gpt_oss: GptOssTokenizer, hf_gpt_oss: Any) -> None:
    assert gpt_oss.special_tokens == GPT_OSS_SPECIAL_TOKENS
    for token, token_id in GPT_OSS_SPECIAL_TOKENS.items():
        assert hf_gpt_oss.convert_tokens_to_ids(token) == token_id, token
    harmony = ["<|return|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
    assert [gpt_oss.token_id(t) for t in harmony] == [
        200002,
        200005,
        200006,
        200007,
        200008,
        200012,
    ]
    assert (gpt_oss.eos_id, gpt_oss.pad_id) == (hf_gpt_oss.eos_token_id, hf_gpt_oss.pad_token_id)
    assert (gpt_oss.eos_id, gpt_oss.pad_id, gpt_oss.bos_id) == (200002, 199999, None)
    assert gpt_oss.stop_tokens == [200002, 200012, 199999]
    assert gpt_oss.vocab_size == 200019


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_are_transformers(
    gpt_oss: GptOssTokenizer, hf_gpt_oss: Any, text: str
) -> None:
    ids = gpt_oss.encode(text, add_bos=False, add_eos=False)
    assert ids == hf_gpt_oss.encode(text)  # gpt-oss's tokenizer.json adds no bos/eos either
    assert gpt_oss.encode(text) == ids + [gpt_oss.eos_id]  # torchtune's default add_eos=True
    for skip in (False, True):
        assert gpt_oss.decode(ids, skip_special_tokens=skip) == hf_gpt_oss.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("instruction_role", ["system", "developer"])
@pytest.mark.parametrize("analysis_channels", ["verbatim", "chat_template"])
def test_single_turn_with_analysis_is_the_chat_template(
    folder: Path, hf_gpt_oss: Any, instruction_role: str, analysis_channels: str
) -> None:
    """System (the tokenizer's), developer (torchtune's system message, or a developer one),
    user, assistant analysis and final: both modes are the template's tokens."""
    tokenizer = make(folder, analysis_channels=analysis_channels)
    rows = [{**SINGLE_TURN[0], "role": instruction_role}, *SINGLE_TURN[1:]]
    tokens, mask = tokenizer.tokenize_messages(harmony_messages(rows))
    hf_ids = hf_chat_ids(hf_gpt_oss, rows)
    assert tokens == hf_ids
    assert mask == expected_mask(hf_ids, hf_gpt_oss)
    assert tokenizer.decode(tokens).startswith(
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message.<|end|><|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n<|end|>"
    )


def test_the_loss_trains_the_assistant_messages(gpt_oss: GptOssTokenizer) -> None:
    """train_on_input=False: each assistant message is trained from its <|start|> to its end
    marker (analysis and final); system, developer and user messages are masked."""
    tokens, mask = gpt_oss.tokenize_messages(harmony_messages(TWO_TURNS))
    assert trained_text(gpt_oss, tokens, mask) == (
        f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|end|>"
        f"<|start|>assistant<|channel|>analysis<|message|>{FOLLOW_UP_THOUGHT}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{FOLLOW_UP_ANSWER}<|return|>"
    )
    assert tokens[-1] == gpt_oss.eos_id and not mask[-1]  # the model learns to stop
    everything = gpt_oss.tokenize_messages(harmony_messages(TWO_TURNS, train_on_input=True))
    assert everything[0] == tokens and not any(everything[1])


def test_two_turns_as_chat_template_is_the_chat_template(
    gpt_oss_as_template: GptOssTokenizer, hf_gpt_oss: Any
) -> None:
    """analysis_channels="chat_template": the first turn's analysis is dropped, the last turn's
    kept, the first final ends with <|end|> and the last with <|return|>."""
    tokens, mask = gpt_oss_as_template.tokenize_messages(harmony_messages(TWO_TURNS))
    hf_ids = hf_chat_ids(hf_gpt_oss, TWO_TURNS, reasoning_effort="medium")
    assert tokens == hf_ids
    assert mask == expected_mask(hf_ids, hf_gpt_oss)
    text = gpt_oss_as_template.decode(tokens)
    assert THOUGHT not in text and FOLLOW_UP_THOUGHT in text


def test_two_turns_verbatim_keeps_every_analysis(gpt_oss: GptOssTokenizer, hf_gpt_oss: Any) -> None:
    """analysis_channels="verbatim" (default): the template's conversation with the first
    turn's analysis message where the data has it, before the first final."""
    tokens, mask = gpt_oss.tokenize_messages(harmony_messages(TWO_TURNS))
    first_final = f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|end|>"
    analysis = f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    whole = hf_chat_text(hf_gpt_oss, TWO_TURNS)
    assert whole.count(first_final) == 1 and THOUGHT not in whole
    hf_ids = hf_gpt_oss.encode(whole.replace(first_final, analysis + first_final))
    assert tokens == hf_ids
    assert mask == expected_mask(hf_ids, hf_gpt_oss)


def test_conversation_without_analysis_and_reasoning_effort(folder: Path, hf_gpt_oss: Any) -> None:
    """No thinking anywhere, no developer message, reasoning effort and identity set."""
    rows = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": FOLLOW_UP},
        {"role": "assistant", "content": FOLLOW_UP_ANSWER},
    ]
    identity = "You are a careful assistant."
    tokenizer = make(folder, reasoning_effort="high", model_identity=identity)
    tokens, mask = tokenizer.tokenize_messages(harmony_messages(rows))
    hf_ids = hf_chat_ids(hf_gpt_oss, rows, reasoning_effort="high", model_identity=identity)
    assert tokens == hf_ids
    assert mask == expected_mask(hf_ids, hf_gpt_oss)


def test_generation_prompt(gpt_oss: GptOssTokenizer, hf_gpt_oss: Any) -> None:
    """add_end_tokens=False (``inference=True``) with a final empty assistant message is the
    template's generation prompt, ``<|start|>assistant``; earlier turns keep no analysis."""
    prompt = TWO_TURNS[:2]
    expected = hf_chat_ids(hf_gpt_oss, prompt, add_generation_prompt=True)
    open_turn = [*harmony_messages(prompt), Message("assistant", "")]
    assert gpt_oss.tokenize_messages(open_turn, add_end_tokens=False)[0] == expected
    assert gpt_oss({"messages": open_turn}, inference=True)["tokens"] == expected
    assert gpt_oss.decode(expected).endswith("<|end|><|start|>assistant")
    history = [*TWO_TURNS[:3], TWO_TURNS[3]]
    expected = hf_chat_ids(hf_gpt_oss, history, add_generation_prompt=True)
    as_template = make(Path(gpt_oss.path).parent, analysis_channels="chat_template")
    open_turn = [*harmony_messages(history), Message("assistant", "")]
    assert as_template.tokenize_messages(open_turn, add_end_tokens=False)[0] == expected


def test_current_date_defaults_to_today(folder: Path) -> None:
    tokenizer = gpt_oss_tokenizer(str(folder / "tokenizer.json"))
    assert f"Current date: {datetime.date.today().isoformat()}\n" in tokenizer.system_message


def test_truncation(folder: Path, gpt_oss: GptOssTokenizer) -> None:
    messages = harmony_messages(TWO_TURNS)
    full, full_mask = gpt_oss.tokenize_messages(messages)
    right = make(folder, max_seq_len=40)
    tokens, mask = right.tokenize_messages(messages)
    assert tokens == full[:39] + [right.eos_id] and mask == full_mask[:39] + [True]
    left = make(folder, max_seq_len=40, truncation_type="left")
    assert left.tokenize_messages(messages) == (full[-40:], full_mask[-40:])


def test_refused(folder: Path, gpt_oss: GptOssTokenizer, tmp_path: Path) -> None:
    """What the harmony format here has no place for, unknown choices, another family's file."""
    user, answer = Message("user", QUESTION, masked=True), Message("assistant", ANSWER)
    late_system = [user, Message("system", INSTRUCTIONS, masked=True), answer]
    with pytest.raises(ValueError, match="comes first"):
        gpt_oss.tokenize_messages(late_system)
    with pytest.raises(ValueError, match="Tool calls"):
        gpt_oss.tokenize_messages([user, Message("assistant", "{}", ipython=True)])
    with pytest.raises(ValueError, match="no 'ipython' messages"):
        gpt_oss.tokenize_messages([user, Message("ipython", "{}")])
    with pytest.raises(ValueError, match="reasoning_effort"):
        make(folder, reasoning_effort="max")
    with pytest.raises(ValueError, match="analysis_channels"):
        make(folder, analysis_channels="strip")
    qwen3 = write_qwen3_folder(tmp_path)
    with pytest.raises(ValueError, match="has no token '<|return|>'"):
        gpt_oss_tokenizer(str(qwen3 / "tokenizer.json"))
    with pytest.raises(ValueError, match=f"set tokenizer.path to {folder}/tokenizer.json"):
        gpt_oss_tokenizer(str(folder / "tokenizer_config.json"))


def test_prompt_template_keeps_the_channels(folder: Path) -> None:
    """A torchtune prompt template adds text around contents and keeps eot (the channel)."""
    templated = make(folder, prompt_template={"user": ("Q: ", "\n")})
    text = templated.decode(templated.tokenize_messages(harmony_messages(SINGLE_TURN))[0])
    assert f"<|start|>user<|message|>Q: {QUESTION}\n<|end|>" in text
    assert f"<|channel|>analysis<|message|>{THOUGHT}<|end|>" in text


# ---------------------------------------------------------------------------------------------
# torchtune's stock dataset builders


def labels(tokens: Sequence[int], mask: Sequence[bool]) -> list[int]:
    """torchtune's labels: the tokens, the masked ones ignored."""
    return [IGNORE if masked else token for token, masked in zip(tokens, mask, strict=True)]


def write_json(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text(json.dumps(rows))
    return str(path)


def without_thinking(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": row["role"], "content": row["content"]} for row in rows]


def test_chat_dataset_rows_are_the_chat_template(
    gpt_oss: GptOssTokenizer, hf_gpt_oss: Any, tmp_path: Path
) -> None:
    """chat_dataset's openai style (which reads role and content: no analysis)."""
    rows = [{"messages": without_thinking(c)} for c in (SINGLE_TURN, TWO_TURNS, TWO_TURNS[1:])]
    data = chat_dataset(
        gpt_oss,
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
        hf_ids = hf_chat_ids(hf_gpt_oss, row["messages"])
        assert data[index]["tokens"] == hf_ids
        assert data[index]["labels"] == labels(hf_ids, expected_mask(hf_ids, hf_gpt_oss))


def test_sft_dataset_with_harmony_rows_is_the_chat_template(
    gpt_oss_as_template: GptOssTokenizer, hf_gpt_oss: Any, tmp_path: Path
) -> None:
    """SFTDataset with HarmonyToMessages keeps the rows' ``thinking`` as analysis messages."""
    rows = [{"messages": c} for c in (SINGLE_TURN, TWO_TURNS)]
    data = SFTDataset(
        source="json",
        data_files=write_json(tmp_path / "harmony.json", rows),
        split="train",
        cache_dir=str(tmp_path / "cache"),
        message_transform=HarmonyToMessages(),
        model_transform=gpt_oss_as_template,
    )
    assert len(data) == 2
    for index, row in enumerate(rows):
        hf_ids = hf_chat_ids(hf_gpt_oss, row["messages"])
        assert data[index]["tokens"] == hf_ids
        assert data[index]["labels"] == labels(hf_ids, expected_mask(hf_ids, hf_gpt_oss))


def test_alpaca_dataset_trains_on_the_response(
    gpt_oss: GptOssTokenizer, hf_gpt_oss: Any, tmp_path: Path
) -> None:
    rows = [
        {"instruction": "Answer the question.", "input": QUESTION, "output": ANSWER},
        {"instruction": "Say hello.", "input": "", "output": "Grüße! 你好 🙂"},
    ]
    data = alpaca_dataset(
        gpt_oss,
        source="json",
        data_files=write_json(tmp_path / "alpaca.json", rows),
        train_on_input=False,
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(data) == 2
    for index, row in enumerate(rows):
        sample = data[index]
        assert sample["labels"] == labels(
            sample["tokens"], expected_mask(sample["tokens"], hf_gpt_oss)
        )
        trained = hf_gpt_oss.decode([t for t in sample["labels"] if t != IGNORE])
        assert trained == f"<|start|>assistant<|channel|>final<|message|>{row['output']}<|return|>"


def test_instruct_dataset_is_the_chat_template(
    gpt_oss: GptOssTokenizer, hf_gpt_oss: Any, tmp_path: Path
) -> None:
    rows = [{"input": QUESTION, "output": ANSWER}, {"input": FOLLOW_UP, "output": "Grüße 🙂"}]
    data = instruct_dataset(
        gpt_oss,
        source="json",
        data_files=write_json(tmp_path / "instruct.json", rows),
        train_on_input=False,
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    assert len(data) == 2
    for index, row in enumerate(rows):
        chat = [{"role": "user", "content": row["input"]}]
        hf_ids = hf_chat_ids(hf_gpt_oss, [*chat, {"role": "assistant", "content": row["output"]}])
        assert data[index]["tokens"] == hf_ids
        assert data[index]["labels"] == labels(hf_ids, expected_mask(hf_ids, hf_gpt_oss))
