"""gpt-oss's tokenizer and harmony chat format, token for token what ``transformers`` makes of the
released files.

gpt-oss's ``tokenizer.json`` (o200k_harmony: o200k's byte-level BPE and the harmony tokens
199998-200018) is read by Hugging Face's ``tokenizers`` as the release ships it, behind
torchtune's tokenizer interface (:class:`~exactga.models.hf_tokenizer.HFModelTokenizer`). The
chat format is harmony (github.com/openai/harmony, docs/format.md) as the released chat template
(``chat_template.jinja`` of ``openai/gpt-oss-20b`` and ``-120b``) renders it. Every message is
``<|start|>{header}<|message|>{content}`` and an end marker::

    <|start|>system<|message|>{model identity}\\nKnowledge cutoff: 2024-06\\n
        Current date: {date}\\n\\nReasoning: {effort}\\n\\n# Valid channels: analysis,
        commentary, final. Channel must be included for every message.<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system prompt}\\n\\n<|end|>
    <|start|>user<|message|>{user}<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant<|channel|>final<|message|>{answer}<|return|>

- The harmony **system** message is no dataset's: the tokenizer writes it at the start of every
  conversation from its arguments (``model_identity``, ``current_date``, ``reasoning_effort``),
  as the template writes it from its keyword arguments.
- torchtune's **system** message (or a ``developer`` one: ``OpenAIToMessages`` passes that role
  through) is harmony's developer message, under ``# Instructions``; it must come first, and an
  empty one is left out, as in the template.
- An **assistant** message's text is the ``final`` channel. Its chain of thought, the
  ``analysis`` channel, is a content part of type ``"analysis"`` (``{"type": "analysis",
  "content": ...}``) in the same message, written as an analysis message before the final one:
  one torchtune message per assistant turn, as torchtune's datasets validate conversations.
  ``harmony_messages`` (and the dataset transform ``HarmonyToMessages``) makes it from a chat
  row's ``thinking`` field, the template's name for it.
- A final message ends with ``<|end|>``, the conversation's last with ``<|return|>`` (what the
  model emits when it is done: the template trains it). Tool calls (``ipython``) are not
  supported yet and are refused.

Each message is rendered to its text, harmony tokens written out, and encoded in one piece, as
``apply_chat_template`` encodes its rendered string (every message starts and ends at a special
token, so the pieces are the whole string's). tests/test_tokenizer_gpt_oss.py holds the ids to
``apply_chat_template``'s with the released template.

Masks follow torchtune: every token of a message (header, content, end marker) carries the
message's ``masked``; the system message the tokenizer writes carries the first message's. With
``train_on_input=False`` exactly the assistant messages are trained, analysis and final, each
from its ``<|start|>`` to its end marker. With ``add_end_tokens=False`` (inference) a final
assistant message is left open: ``Message("assistant", "")`` leaves the generation prompt
``<|start|>assistant``, from which the model writes its channels.

Analysis channels (``analysis_channels``):

- ``"verbatim"`` (the default): training is on what the data holds. Every analysis part is
  kept, in every turn, so every assistant turn trains its reasoning and its answer. A
  conversation with one assistant turn encodes exactly as the released template.
- ``"chat_template"``: as the released template, the analysis of every assistant message but
  the conversation's last is dropped; harmony drops earlier chains of thought from the history
  at inference, so the training context is what the model sees there. Any conversation then
  encodes exactly as ``apply_chat_template``.

The default is ``"verbatim"`` for the reason Qwen3's tokenizer's is: a rewrite hidden in the
tokenizer would train other tokens than the dataset holds, and it would train earlier turns to
answer without reasoning. ``"chat_template"`` is the explicit choice (or split a multi-turn
conversation into one row per assistant turn, which both modes encode as the template).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torchtune.data import Message, PromptTemplateInterface
from torchtune.data._prompt_templates import _get_prompt_template, _TemplateType
from torchtune.modules.transforms import Transform

from exactga.models.hf_tokenizer import (
    HFModelTokenizer,
    TruncationType,
    check_choice,
    message_text,
)

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
RETURN = "<|return|>"
CALL = "<|call|>"
ENDOFTEXT = "<|endoftext|>"

MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
VALID_CHANNELS = (
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)
# The roles whose first message is harmony's developer message.
INSTRUCTION_ROLES = ("system", "developer")
# The content type of an assistant message's chain of thought.
ANALYSIS = "analysis"

ReasoningEffort = Literal["low", "medium", "high"]
AnalysisChannels = Literal["verbatim", "chat_template"]


class GptOssTokenizer(HFModelTokenizer):
    """gpt-oss's tokenizer: its ``tokenizer.json`` with the harmony chat format.

    Args:
        path: ``tokenizer.json`` of a gpt-oss release.
        max_seq_len: truncate ``tokenize_messages``' output to this many tokens; None: never.
        prompt_template: a torchtune prompt template applied to the messages first (adds plain
            text around them).
        truncation_type: ``"right"`` keeps the start (the last kept token replaced by ``eos_id``,
            masked, as torchtune does) or ``"left"`` keeps the end of a too long sequence.
        reasoning_effort: ``"low"``, ``"medium"`` (the template's default) or ``"high"``,
            written into the system message.
        model_identity: the system message's first line (the template's ``model_identity``).
        current_date: the system message's ``Current date:`` (``YYYY-MM-DD``); None: the day
            the tokenizer is built, as the template writes the day it renders. Set it for a
            dataset that encodes the same on every day.
        analysis_channels: ``"verbatim"`` or ``"chat_template"``: see the module's docstring.

    ``eos_id`` is ``<|return|>`` 200002 (the end of a completion), ``pad_id`` ``<|endoftext|>``
    199999, ``bos_id`` None (the chat format writes no ``<|startoftext|>``); generation stops at
    harmony's stop tokens ``<|return|>`` and ``<|call|>`` (a tool call), or ``<|endoftext|>``.
    """

    def __init__(
        self,
        path: str,
        max_seq_len: int | None = None,
        *,
        prompt_template: PromptTemplateInterface | None = None,
        truncation_type: TruncationType = "right",
        reasoning_effort: ReasoningEffort = "medium",
        model_identity: str = MODEL_IDENTITY,
        current_date: str | None = None,
        analysis_channels: AnalysisChannels = "verbatim",
    ) -> None:
        check_choice("reasoning_effort", reasoning_effort, ReasoningEffort)
        check_choice("analysis_channels", analysis_channels, AnalysisChannels)
        super().__init__(
            path,
            builder="gpt_oss_tokenizer",
            bos_token=None,
            eos_token=RETURN,
            pad_token=ENDOFTEXT,
            stop_tokens=[RETURN, CALL, ENDOFTEXT],
            max_seq_len=max_seq_len,
            prompt_template=prompt_template,
            truncation_type=truncation_type,
        )
        for token in (START, END, MESSAGE, CHANNEL):
            self.token_id(token)  # refuse a tokenizer.json without the harmony tokens
        self.analysis_channels: AnalysisChannels = analysis_channels
        if current_date is None:
            current_date = datetime.date.today().isoformat()
        self.system_message = harmony_system_message(
            model_identity=model_identity,
            current_date=current_date,
            reasoning_effort=reasoning_effort,
        )

    def tokenize_messages(
        self, messages: Sequence[Message], *, add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Encode a conversation in the harmony format.

        Args:
            messages: torchtune messages (a leading system or developer message, then user and
                assistant messages, an assistant's analysis in ``"analysis"`` parts), text only.
            add_end_tokens: end the last assistant message with ``<|return|>`` (training);
                False leaves it open for generation to continue (inference).

        Returns:
            The token ids and, per token, whether it is masked out of the loss.

        Raises:
            RuntimeError: a message holds non-text content.
            ValueError: a message has no place in the harmony format (see the module's
                docstring).
        """
        if self.prompt_template is not None:
            messages = self.prompt_template(list(messages))
        texts = render_harmony_messages(
            messages, analysis_channels=self.analysis_channels, add_end_tokens=add_end_tokens
        )
        tokens = self.encode(self.system_message, add_bos=False, add_eos=False)
        mask = [messages[0].masked if messages else True] * len(tokens)
        for message, text in zip(messages, texts, strict=True):
            ids = self.encode(text, add_bos=False, add_eos=False)
            tokens.extend(ids)
            mask.extend([message.masked] * len(ids))
            if self.reached_right_truncation(len(tokens)):
                break  # the rest would be cut off anyway
        return self.truncate(tokens, mask, add_end_tokens)


def harmony_system_message(
    *, model_identity: str, current_date: str, reasoning_effort: ReasoningEffort
) -> str:
    """The system message the released template writes when no tools are given."""
    body = (
        f"{model_identity}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {current_date}"
        f"\n\nReasoning: {reasoning_effort}\n\n{VALID_CHANNELS}"
    )
    return f"{START}system{MESSAGE}{body}{END}"


def render_harmony_messages(
    messages: Sequence[Message],
    *,
    analysis_channels: AnalysisChannels = "verbatim",
    add_end_tokens: bool = True,
) -> list[str]:
    """Each message's part of the conversation in the harmony format, harmony tokens written
    out (the tokenizer's system message goes before them); an empty string for a message the
    format leaves out.

    Args:
        messages: torchtune messages, text only.
        analysis_channels: ``"verbatim"`` or ``"chat_template"``: see the module's docstring.
        add_end_tokens: close a last assistant message with ``<|return|>``; False leaves it
            open (inference).

    Returns:
        One string per message, in order.

    Raises:
        ValueError: a system or developer message after the first, a tool call or a role the
            format has no place for.
    """
    check_choice("analysis_channels", analysis_channels, AnalysisChannels)
    texts = []
    for index, message in enumerate(messages):
        is_last = index == len(messages) - 1
        if message.role in INSTRUCTION_ROLES:
            if index > 0:
                raise ValueError(
                    f"A {message.role} message at index {index}: harmony has one developer "
                    "message (torchtune's system message), and it comes first."
                )
            text = _developer_message(message_text(message))
        elif message.role == "user":
            text = f"{START}user{MESSAGE}{message_text(message)}{END}"
        elif message.role == "assistant":
            keep_analysis = analysis_channels == "verbatim" or is_last
            text = _assistant_messages(message, keep_analysis, is_last, add_end_tokens)
        else:
            raise ValueError(
                f"The harmony format here has no {message.role!r} messages (tool results are "
                "not supported yet)."
            )
        texts.append(text)
    return texts


def _developer_message(instructions: str) -> str:
    # The template leaves the developer message out when there is no instruction (and no tool).
    if not instructions:
        return ""
    return f"{START}developer{MESSAGE}# Instructions\n\n{instructions}\n\n{END}"


def _assistant_messages(
    message: Message, keep_analysis: bool, is_last: bool, add_end_tokens: bool
) -> str:
    """An assistant message's analysis messages (if kept) and its final message."""
    if message.ipython:
        raise ValueError(
            "Tool calls (assistant messages with ipython=True) are not supported yet by the "
            "harmony format here."
        )
    analyses, final = split_analysis(message)
    text = "".join(
        f"{START}assistant{CHANNEL}analysis{MESSAGE}{analysis}{END}"
        for analysis in (analyses if keep_analysis else [])
    )
    if is_last and not add_end_tokens:
        # Left open for generation: without text, the generation prompt, from which the model
        # writes its channels; with text, the final message to continue.
        return text + f"{START}assistant" + (f"{CHANNEL}final{MESSAGE}{final}" if final else "")
    end = RETURN if is_last else END
    return text + f"{START}assistant{CHANNEL}final{MESSAGE}{final}{end}"


def split_analysis(message: Message) -> tuple[list[str], str]:
    """An assistant message's analysis parts and its text (the final channel's content).

    Raises:
        RuntimeError: a part is neither text nor analysis (images).
    """
    analyses = [part["content"] for part in message.content if part["type"] == ANALYSIS]
    text_parts = [part for part in message.content if part["type"] != ANALYSIS]
    return analyses, message_text(Message(message.role, text_parts))


def harmony_messages(
    rows: Sequence[Mapping[str, Any]], *, train_on_input: bool = False
) -> list[Message]:
    """torchtune messages from chat rows in the released template's form: ``role`` and
    ``content``, and an assistant's chain of thought in ``thinking``, which becomes the message's
    ``"analysis"`` part before its text. Masks as torchtune's ``OpenAIToMessages``: everything
    but the assistant's is masked unless ``train_on_input``."""
    messages = []
    for row in rows:
        content = [{"type": "text", "content": row["content"]}]
        if row["role"] == "assistant" and row.get("thinking"):
            content.insert(0, {"type": ANALYSIS, "content": row["thinking"]})
        masked = row["role"] != "assistant" and not train_on_input
        messages.append(Message(row["role"], content, masked=masked))
    return messages


class HarmonyToMessages(Transform):
    """A dataset's message transform for chat rows with ``thinking`` (``harmony_messages``), for
    torchtune's ``SFTDataset`` (``message_transform``), where ``chat_dataset``'s ``openai``
    style would drop the chain of thought.

    Args:
        train_on_input: train the non-assistant messages too.
        column: the column holding the rows.
    """

    def __init__(self, train_on_input: bool = False, column: str = "messages") -> None:
        self.train_on_input = train_on_input
        self.column = column

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        rows = sample[self.column]
        return {"messages": harmony_messages(rows, train_on_input=self.train_on_input)}


def gpt_oss_tokenizer(
    path: str,
    max_seq_len: int | None = None,
    prompt_template: _TemplateType | None = None,
    truncation_type: TruncationType = "right",
    reasoning_effort: ReasoningEffort = "medium",
    model_identity: str = MODEL_IDENTITY,
    current_date: str | None = None,
    analysis_channels: AnalysisChannels = "verbatim",
) -> GptOssTokenizer:
    """gpt-oss's tokenizer, for configs.

    Args:
        path: ``tokenizer.json`` of a gpt-oss release (``tune download openai/gpt-oss-20b``
            puts it next to the weights; ``original/`` holds no tokenizer).
        max_seq_len: truncate tokenized conversations to this many tokens; None: never.
        prompt_template: a dotpath of a torchtune prompt template class, or a role to
            ``(prepend, append)`` mapping; None: none.
        truncation_type: ``"right"`` or ``"left"`` (see :class:`GptOssTokenizer`).
        reasoning_effort, model_identity, current_date: the system message's (see
            :class:`GptOssTokenizer`).
        analysis_channels: ``"verbatim"`` (default) or ``"chat_template"``: see the module's
            docstring.

    Returns:
        The tokenizer.

    Raises:
        ValueError: ``path`` is not a gpt-oss ``tokenizer.json``, or an unknown choice.
    """
    return GptOssTokenizer(
        path,
        max_seq_len=max_seq_len,
        prompt_template=None if prompt_template is None else _get_prompt_template(prompt_template),
        truncation_type=truncation_type,
        reasoning_effort=reasoning_effort,
        model_identity=model_identity,
        current_date=current_date,
        analysis_channels=analysis_channels,
    )
