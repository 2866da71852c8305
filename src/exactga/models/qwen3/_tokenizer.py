"""Qwen3's tokenizer and chat format, token for token what ``transformers`` makes of Qwen3's files.

Qwen3's ``tokenizer.json`` is read by Hugging Face's ``tokenizers`` as the release ships it (the
byte-level BPE and the added tokens, ``<think>``/``</think>`` and the tool tokens included)
behind torchtune's tokenizer interface (:class:`~exactga.models.hf_tokenizer.HFModelTokenizer`).
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
tests/test_tokenizers_qwen3_gemma3.py holds the ids to ``apply_chat_template``'s with both
released revisions of Qwen3's template.

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

import os
from collections.abc import Sequence
from typing import Literal

from torchtune.data import ChatMLTemplate, Message, PromptTemplateInterface
from torchtune.data._prompt_templates import _get_prompt_template, _TemplateType

from exactga.models.hf_tokenizer import (
    HFModelTokenizer,
    TruncationType,
    check_choice,
    message_text,
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
NEWLINE = "\n"

ThinkBlocks = Literal["verbatim", "chat_template"]


class Qwen3Tokenizer(HFModelTokenizer):
    """Qwen3's tokenizer: its ``tokenizer.json`` with Qwen3's chat format.

    Args:
        path: ``tokenizer.json`` of a Qwen3 release.
        max_seq_len: truncate ``tokenize_messages``' output to this many tokens; None: never.
        prompt_template: a torchtune prompt template applied to the messages first (adds plain
            text around them); ChatML is refused, the chat format already is ChatML.
        truncation_type: ``"right"`` keeps the start (the last kept token replaced by ``eos_id``,
            masked, as torchtune does) or ``"left"`` keeps the end of a too long sequence.
        think_blocks: ``"verbatim"`` or ``"chat_template"``: see the module's docstring.

    ``eos_id`` is ``<|im_end|>`` (the instruct models' end of turn), ``pad_id``
    ``<|endoftext|>``, ``bos_id`` None; generation stops at either of the first two.
    ``decode(skip_special_tokens=True)`` drops the control tokens and keeps the text markers
    (``<think>``, ``<tool_call>``, ...), which Qwen3's file marks not special, as transformers.
    """

    def __init__(
        self,
        path: str,
        max_seq_len: int | None = None,
        *,
        prompt_template: PromptTemplateInterface | None = None,
        truncation_type: TruncationType = "right",
        think_blocks: ThinkBlocks = "verbatim",
    ) -> None:
        check_choice("think_blocks", think_blocks, ThinkBlocks)
        if isinstance(prompt_template, ChatMLTemplate):
            # ChatML around ChatML would wrap every message in two <|im_start|>...<|im_end|>.
            raise ValueError("Qwen3's chat format is ChatML already: use no ChatMLTemplate.")
        super().__init__(
            path,
            builder="qwen3_tokenizer",
            bos_token=None,
            eos_token=IM_END,
            pad_token=ENDOFTEXT,
            stop_tokens=[IM_END, ENDOFTEXT],
            max_seq_len=max_seq_len,
            prompt_template=prompt_template,
            truncation_type=truncation_type,
        )
        self.think_blocks: ThinkBlocks = think_blocks
        self.think_start_id = self.token_id(THINK_START)
        self.think_end_id = self.token_id(THINK_END)

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
            if self.reached_right_truncation(len(tokens)):
                break  # the rest would be cut off anyway
        return self.truncate(tokens, mask, add_end_tokens)


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
    check_choice("think_blocks", think_blocks, ThinkBlocks)
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


def qwen3_tokenizer(
    path: str,
    max_seq_len: int | None = None,
    prompt_template: _TemplateType | None = None,
    truncation_type: TruncationType = "right",
    think_blocks: ThinkBlocks = "verbatim",
    merges_file: str | None = None,
    special_tokens_path: str | None = None,
) -> Qwen3Tokenizer:
    """Qwen3's tokenizer, for configs.

    Args:
        path: ``tokenizer.json`` of a Qwen3 release (``tune download`` puts it next to the
            weights).
        max_seq_len: truncate tokenized conversations to this many tokens; None: never.
        prompt_template: a dotpath of a torchtune prompt template class, or a role to
            ``(prepend, append)`` mapping; None: none.
        truncation_type: ``"right"`` or ``"left"`` (see :class:`Qwen3Tokenizer`).
        think_blocks: ``"verbatim"`` (default) or ``"chat_template"``: see the module's
            docstring.
        merges_file, special_tokens_path: torchtune's Qwen2.5 keys (``path`` then names
            ``vocab.json``), refused: ``tokenizer.json`` holds the vocabulary, the merges and
            the added tokens in one file.

    Returns:
        The tokenizer.

    Raises:
        ValueError: torchtune's vocab.json/merges.txt keys, or a ``path`` that is not a Qwen3
            ``tokenizer.json``.
    """
    if merges_file is not None or special_tokens_path is not None:
        folder = os.path.dirname(path) or "."
        raise ValueError(
            "qwen3_tokenizer reads Qwen3's tokenizer.json (vocabulary, merges and added tokens "
            f"in one file, next to vocab.json in the release): set tokenizer.path to "
            f"{folder}/tokenizer.json and drop tokenizer.merges_file and "
            "tokenizer.special_tokens_path."
        )
    return Qwen3Tokenizer(
        path,
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
