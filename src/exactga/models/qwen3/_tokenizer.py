"""Qwen3's tokenizer and chat format, token for token what ``transformers`` makes of Qwen3's files.

The byte-level BPE (``vocab.json``/``merges.txt``), ``encode`` and ``decode`` are torchtune
0.6.1's :class:`~torchtune.models.qwen2_5.Qwen2_5Tokenizer`, extended with the four added tokens
Qwen3 has beyond Qwen2.5 (``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``).
The chat format is ChatML as Qwen3's ``chat_template`` renders it::

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n{assistant}<|im_end|>\\n

Tool results (torchtune's ``ipython`` role, Hugging Face's ``tool``) go into one user turn per
run of consecutive results, each as ``\\n<tool_response>\\n{result}\\n</tool_response>``; an
assistant tool call (``Message(ipython=True)``, its content the call's JSON) is rendered
``<tool_call>\\n{call}\\n</tool_call>``. Each message is rendered to its text, special tokens
written out, and encoded in one piece, as ``apply_chat_template`` encodes its rendered string,
so a boundary between a role header and the content never splits differently than there.

Masks follow torchtune: every token of a message (its header, content and end tokens) carries
the message's ``masked``; with ``train_on_input=False`` exactly the assistant turns
``<|im_start|>assistant\\n...<|im_end|>\\n`` are trained. With ``add_end_tokens=True`` (training)
a conversation ends with ``<|im_end|>\\n`` as the chat template's output does, not with a bare
``<|im_end|>`` as torchtune's Qwen2.5 tokenizer's. With ``add_end_tokens=False`` (inference) a
final assistant message is left open: a final ``Message("assistant", "")`` then leaves exactly
the generation prompt ``<|im_start|>assistant\\n``.

Thinking blocks (``think_blocks``):

- ``"verbatim"`` (the default): training is on what is in the data. An assistant message whose
  content holds ``<think>...</think>`` keeps it as written, in every turn, tokenised with the
  ``<think>``/``</think>`` tokens, so a model can be trained to think; a message without one
  gets none. Write the block as Qwen3 does (``<think>\\nreasoning\\n</think>\\n\\nanswer``)
  and a conversation with one assistant turn encodes exactly as Qwen3's chat template.
- ``"chat_template"``: rewrite the assistant turns as Qwen3's chat template does, for users
  who want the training text to be what the model sees at inference: the thinking of every
  assistant turn before the last user query is dropped (at inference the history holds no
  earlier thinking); the turns after it are rendered ``<think>\\n{reasoning}\\n</think>\\n\\n
  {answer}`` with the newlines around reasoning and answer normalised; and the final assistant
  turn gets an empty ``<think>\\n\\n</think>\\n\\n`` when it has no thinking (what the template
  renders, and what its ``enable_thinking=False`` generation prompt ends with). Any
  conversation then encodes exactly as ``apply_chat_template`` (no ``tools`` argument).

The default is ``"verbatim"`` because a rewrite hidden in the tokenizer would make the trained
tokens differ from the dataset the user wrote; ``"chat_template"`` is the explicit choice.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Literal, get_args

from torchtune.data import ChatMLTemplate, Message, PromptTemplateInterface
from torchtune.data._prompt_templates import _get_prompt_template, _TemplateType
from torchtune.models.qwen2._tokenizer import (
    DEFAULT_QWEN2_TOKENIZER_BPE_CACHE_SIZE,
    ENDOFTEXT,
    IM_END,
    IM_START,
)
from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS, Qwen2_5Tokenizer
from torchtune.modules.transforms.tokenizers import parse_hf_tokenizer_json

# Qwen3's added tokens: Qwen2.5's, then four more (tokenizer_config.json's added_tokens_decoder).
QWEN3_SPECIAL_TOKENS: dict[str, int] = {
    **QWEN2_5_SPECIAL_TOKENS,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

# The added tokens Qwen3 marks ``"special": false``: text markers that transformers' decode keeps
# even with skip_special_tokens=True (encode splits them out like the special ones).
QWEN3_TEXT_MARKER_TOKENS: frozenset[str] = frozenset(
    {
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
    }
)

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
NEWLINE = "\n"

ThinkBlocks = Literal["verbatim", "chat_template"]
TruncationType = Literal["right", "left"]


class Qwen3Tokenizer(Qwen2_5Tokenizer):
    """Qwen3's tokenizer: torchtune's Qwen2.5 BPE with Qwen3's added tokens and chat format.

    Args:
        path: ``vocab.json``.
        merges_file: ``merges.txt``.
        special_tokens: added token to id; default Qwen3's (:data:`QWEN3_SPECIAL_TOKENS`).
        max_seq_len: truncate ``tokenize_messages``' output to this many tokens; None: never.
        prompt_template: a torchtune prompt template applied to the messages first (adds plain
            text around them); ChatML is refused, the chat format already is ChatML.
        truncation_type: ``"right"`` keeps the start (the last kept token replaced by ``eos_id``,
            masked, as torchtune does) or ``"left"`` keeps the end of a too long sequence.
        think_blocks: ``"verbatim"`` or ``"chat_template"``: see the module's docstring.
        errors, unk_token, bos_token, eos_token, pad_token, bpe_cache_size: as torchtune's
            :class:`~torchtune.models.qwen2_5.Qwen2_5Tokenizer`; ``eos_id`` is ``<|im_end|>``
            (the instruct models' end of turn), ``pad_id`` ``<|endoftext|>``.
    """

    def __init__(
        self,
        path: str,
        merges_file: str,
        special_tokens: Mapping[str, int] = QWEN3_SPECIAL_TOKENS,
        max_seq_len: int | None = None,
        *,
        prompt_template: PromptTemplateInterface | None = None,
        truncation_type: TruncationType = "right",
        think_blocks: ThinkBlocks = "verbatim",
        errors: str = "replace",
        unk_token: str | None = None,
        bos_token: str | None = None,
        eos_token: str = IM_END,
        pad_token: str | None = ENDOFTEXT,
        bpe_cache_size: int = DEFAULT_QWEN2_TOKENIZER_BPE_CACHE_SIZE,
    ) -> None:
        _check_choice("truncation_type", truncation_type, TruncationType)
        _check_choice("think_blocks", think_blocks, ThinkBlocks)
        if isinstance(prompt_template, ChatMLTemplate):
            # ChatML around ChatML would wrap every message in two <|im_start|>...<|im_end|>.
            raise ValueError("Qwen3's chat format is ChatML already: use no ChatMLTemplate.")
        super().__init__(
            path=path,
            merges_file=merges_file,
            special_tokens=dict(special_tokens),
            max_seq_len=max_seq_len,
            prompt_template=prompt_template,
            errors=errors,
            unk_token=unk_token,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            bpe_cache_size=bpe_cache_size,
        )
        self.truncation_type: TruncationType = truncation_type
        self.think_blocks: ThinkBlocks = think_blocks
        self.think_start_id = self.special_tokens[THINK_START]
        self.think_end_id = self.special_tokens[THINK_END]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Token ids to text. ``skip_special_tokens`` drops the control tokens only and keeps
        the text markers (``<think>``, ``<tool_call>``, ...), as transformers does for Qwen3."""
        if skip_special_tokens:
            token_ids = [t for t in token_ids if not self._is_control_token(t)]
        return super().decode(list(token_ids), skip_special_tokens=False)

    def tokenize_messages(
        self, messages: Sequence[Message], *, add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Encode a conversation in Qwen3's chat format.

        Args:
            messages: torchtune messages (system, user, assistant, ipython), text only.
            add_end_tokens: end a final assistant message with ``<|im_end|>\\n`` (training);
                False leaves it open for generation to continue (inference).

        Returns:
            The token ids and, per token, whether it is masked out of the loss (its message's
            ``masked``).

        Raises:
            RuntimeError: a message holds non-text content.
            ValueError: a message's role has no place in Qwen3's format.
        """
        if self.prompt_template is not None:
            messages = self.prompt_template(list(messages))
        texts = render_qwen3_turns(
            messages, think_blocks=self.think_blocks, add_end_tokens=add_end_tokens
        )
        tokens: list[int] = []
        mask: list[bool] = []
        for message, text in zip(messages, texts, strict=True):
            ids = self.encode(text, add_bos=False, add_eos=False)
            tokens.extend(ids)
            mask.extend([message.masked] * len(ids))
            if self._reached_right_truncation(len(tokens)):
                break  # the rest would be cut off anyway
        return self._truncate(tokens, mask, add_end_tokens)

    def __call__(
        self, sample: MutableMapping[str, Any], inference: bool = False
    ) -> MutableMapping[str, Any]:
        """torchtune's model transform: the sample's ``messages`` to ``tokens`` and ``mask``.

        Args:
            sample: a mapping with a ``messages`` list (removed from it).
            inference: leave a final assistant message open (no end tokens).

        Returns:
            The sample with ``tokens`` and ``mask``.
        """
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages, add_end_tokens=not inference)
        sample["tokens"] = tokens
        sample["mask"] = mask
        return sample

    def _is_control_token(self, token_id: int) -> bool:
        token = self._special_tokens_reversed.get(token_id)
        return token is not None and token not in QWEN3_TEXT_MARKER_TOKENS

    def _reached_right_truncation(self, length: int) -> bool:
        return (
            self.max_seq_len is not None
            and self.truncation_type == "right"
            and length >= self.max_seq_len
        )

    def _truncate(
        self, tokens: list[int], mask: list[bool], add_end_tokens: bool
    ) -> tuple[list[int], list[bool]]:
        if self.max_seq_len is None or len(tokens) <= self.max_seq_len:
            return tokens, mask
        if self.truncation_type == "left":
            return tokens[-self.max_seq_len :], mask[-self.max_seq_len :]
        tokens, mask = tokens[: self.max_seq_len], mask[: self.max_seq_len]
        if add_end_tokens:
            # As torchtune's truncate: a cut sequence still ends in eos, masked because the
            # data does not end there and the model must not learn to stop mid-answer.
            tokens[-1], mask[-1] = self.eos_id, True
        return tokens, mask


def render_qwen3_turns(
    messages: Sequence[Message],
    *,
    think_blocks: ThinkBlocks = "verbatim",
    add_end_tokens: bool = True,
) -> list[str]:
    """Each message's part of the conversation in Qwen3's chat format, special tokens written
    out (``"".join`` of the result is the whole rendered conversation).

    Args:
        messages: torchtune messages, text only.
        think_blocks: ``"verbatim"`` or ``"chat_template"``: see the module's docstring.
        add_end_tokens: close a final assistant message with ``<|im_end|>\\n``.

    Returns:
        One string per message, in order.
    """
    _check_choice("think_blocks", think_blocks, ThinkBlocks)
    last_query = last_user_query_index(messages)
    texts = []
    for index, message in enumerate(messages):
        is_last = index == len(messages) - 1
        if message.role in ("system", "user"):
            text = _turn(message.role, message_text(message))
        elif message.role == "ipython":
            text = _tool_response_part(messages, index)
        elif message.role == "assistant":
            body = _assistant_body(
                message,
                rewrite_thinking=think_blocks == "chat_template",
                after_last_query=index > last_query,
                is_last=is_last,
            )
            text = IM_START + "assistant\n" + body
            if add_end_tokens or not is_last:
                text += IM_END + "\n"
        else:
            raise ValueError(f"Qwen3's chat format has no role {message.role!r}.")
        texts.append(text)
    return texts


def last_user_query_index(messages: Sequence[Message]) -> int:
    """The index of the last user message that is a query, not tool results written as a user
    message; the last index if there is none (as Qwen3's chat template computes it)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.role == "user" and not _is_wrapped_tool_response(message_text(message)):
            return index
    return len(messages) - 1


def split_thinking(content: str) -> tuple[str, str]:
    """An assistant content's ``(reasoning, answer)`` as Qwen3's chat template splits it:
    reasoning between ``<think>`` and the first ``</think>`` with its outer newlines removed,
    answer after the last ``</think>`` without leading newlines; ``("", content)`` when there
    is no ``</think>``."""
    if THINK_END not in content:
        return "", content
    before_end = content.split(THINK_END, 1)[0].rstrip("\n")
    reasoning = before_end.rsplit(THINK_START, 1)[-1].lstrip("\n")
    answer = content.rsplit(THINK_END, 1)[-1].lstrip("\n")
    return reasoning, answer


def message_text(message: Message) -> str:
    """A message's text.

    Raises:
        RuntimeError: the message holds non-text content (images), which Qwen3 text models
            cannot take.
    """
    parts = []
    for item in message.content:
        if item["type"] != "text":
            raise RuntimeError(f"Unsupported message content type: {item['type']}")
        parts.append(item["content"])
    return "".join(parts)


def qwen3_tokenizer(
    path: str,
    merges_file: str,
    special_tokens_path: str | None = None,
    max_seq_len: int | None = None,
    prompt_template: _TemplateType | None = None,
    truncation_type: TruncationType = "right",
    think_blocks: ThinkBlocks = "verbatim",
) -> Qwen3Tokenizer:
    """Qwen3's tokenizer, for configs (torchtune's ``qwen2_5_tokenizer``'s arguments).

    Args:
        path: ``vocab.json``.
        merges_file: ``merges.txt``.
        special_tokens_path: a Hugging Face ``tokenizer.json`` whose ``added_tokens`` replace
            the built-in Qwen3 ones; None: :data:`QWEN3_SPECIAL_TOKENS`.
        max_seq_len: truncate tokenized conversations to this many tokens; None: never.
        prompt_template: a dotpath of a torchtune prompt template class, or a role to
            ``(prepend, append)`` mapping; None: none.
        truncation_type: ``"right"`` or ``"left"`` (see :class:`Qwen3Tokenizer`).
        think_blocks: ``"verbatim"`` (default) or ``"chat_template"``: see the module's
            docstring.

    Returns:
        The tokenizer.
    """
    special_tokens = (
        QWEN3_SPECIAL_TOKENS
        if special_tokens_path is None
        else parse_hf_tokenizer_json(special_tokens_path)
    )
    return Qwen3Tokenizer(
        path=path,
        merges_file=merges_file,
        special_tokens=special_tokens,
        max_seq_len=max_seq_len,
        prompt_template=None if prompt_template is None else _get_prompt_template(prompt_template),
        truncation_type=truncation_type,
        think_blocks=think_blocks,
    )


def _turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def _tool_response_part(messages: Sequence[Message], index: int) -> str:
    # One user turn holds a run of consecutive tool results, as in Qwen3's chat template.
    opens_run = index == 0 or messages[index - 1].role != "ipython"
    closes_run = index == len(messages) - 1 or messages[index + 1].role != "ipython"
    text = IM_START + "user" if opens_run else ""
    text += f"\n{TOOL_RESPONSE_START}\n{message_text(messages[index])}\n{TOOL_RESPONSE_END}"
    return text + (IM_END + "\n" if closes_run else "")


def _assistant_body(
    message: Message, *, rewrite_thinking: bool, after_last_query: bool, is_last: bool
) -> str:
    """What follows ``<|im_start|>assistant\\n``: the content, or a tool call."""
    content = message_text(message)
    call = f"{TOOL_CALL_START}\n{content}\n{TOOL_CALL_END}" if message.ipython else ""
    if not rewrite_thinking:
        return call or content
    # A tool call's content is the call's JSON: it has no text or thinking of its own, as a
    # chat-template message with tool_calls and empty content.
    reasoning, answer = ("", "") if message.ipython else split_thinking(content)
    if after_last_query and (is_last or reasoning):
        answer = think_block(reasoning) + answer.lstrip("\n")
    return answer + call


def think_block(reasoning: str) -> str:
    """``reasoning`` in the think block Qwen3's chat template writes; empty reasoning gives
    ``<think>\\n\\n</think>\\n\\n``."""
    return f"{THINK_START}\n{reasoning.strip(NEWLINE)}\n{THINK_END}\n\n"


def _is_wrapped_tool_response(text: str) -> bool:
    return text.startswith(TOOL_RESPONSE_START) and text.endswith(TOOL_RESPONSE_END)


def _check_choice(name: str, value: str, choices: Any) -> None:
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: one of {', '.join(map(repr, allowed))}.")
