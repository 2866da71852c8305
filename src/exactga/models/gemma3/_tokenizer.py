"""Gemma 3's tokenizer and chat format, token for token what ``transformers`` makes of Gemma 3's
files.

Gemma 3's ``tokenizer.json`` is read by Hugging Face's ``tokenizers`` as the release ships it
behind torchtune's tokenizer interface (:class:`~exactga.models.hf_tokenizer.HFModelTokenizer`).
Gemma 3's ids: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, ``<start_of_turn>`` 105,
``<end_of_turn>`` 106 (Gemma 1 and 2 had the turn tokens at 106 and 107); the tokenizer reads
them from the file. Encoding and decoding are SentencePiece's on Gemma's ``tokenizer.model``
(torchtune's Gemma tokenizer, which exactga's read before): a text that writes ``<pad>``,
``<eos>``, ``<bos>`` or ``<unk>`` (SentencePiece's control tokens) is encoded as that text, not
as the token (transformers encodes the token there: a dataset quoting ``<eos>`` would train an
end of sequence mid-answer); the other added tokens (``<start_of_turn>``, ...) written in a text
are the token, in both. ``decode`` drops ``<pad>``, ``<eos>`` and ``<bos>`` and writes every
other token out; ``skip_special_tokens=True`` also drops the tokens the file marks special, as
transformers. (SentencePiece decodes ``<unk>`` as `` ⁇ ``, this decode as ``<unk>``.)
The chat format is Gemma 3's ``chat_template``::

    <bos><start_of_turn>user\\n{system}\\n\\n{user}<end_of_turn>\\n
    <start_of_turn>model\\n{assistant}<end_of_turn>\\n

- Gemma 3 has no system role: a leading system message is written, followed by a blank line,
  at the start of the first user turn (it must be followed by a user message).
- The assistant's role is written ``model``.
- User and assistant contents are stripped of surrounding whitespace, as the template's
  ``| trim`` does; the system text is not.
- Gemma 3 has no tool role: ``ipython`` messages are refused.

tests/test_tokenizers_qwen3_gemma3.py holds the ids to ``apply_chat_template``'s with Gemma 3's
released template.

Masks follow torchtune: every token of a turn (``<start_of_turn>role\\n``, the content,
``<end_of_turn>\\n``) carries its message's ``masked``, ``<bos>`` the first message's; in the
first user turn the tokens of the header and the folded system text carry the system message's.
With ``train_on_input=False`` exactly the model turns are trained. With ``add_end_tokens=True``
(training) a conversation ends with ``<end_of_turn>\\n`` as the chat template's output does (no
``<eos>``: the model ends a turn with ``<end_of_turn>``, which is why both are ``stop_tokens``);
with ``add_end_tokens=False`` (inference) a final model message is left open, so a final
``Message("assistant", "")`` leaves exactly the generation prompt ``<start_of_turn>model\\n``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchtune.data import Message, PromptTemplateInterface
from torchtune.data._prompt_templates import _get_prompt_template, _TemplateType

from exactga.models.hf_tokenizer import HFModelTokenizer, message_text

BOS = "<bos>"
EOS = "<eos>"
PAD = "<pad>"
# SentencePiece's control and unknown pieces: text that writes them is encoded as text.
CONTROL_TOKENS = (PAD, EOS, BOS, "<unk>")
START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
# Gemma 3's names for torchtune's roles; the system role has none (it is folded, see above).
TURN_ROLES = {"user": "user", "assistant": "model"}
SYSTEM_SEPARATOR = "\n\n"

# One turn: its token ids and, per token, whether it is masked out of the loss.
Turn = tuple[list[int], list[bool]]


class Gemma3Tokenizer(HFModelTokenizer):
    """Gemma 3's tokenizer: its ``tokenizer.json`` with Gemma 3's turns.

    Args:
        path: ``tokenizer.json`` of a Gemma 3 release.
        max_seq_len: truncate ``tokenize_messages``' output to its first this many tokens (the
            last kept token replaced by ``eos_id`` and masked, as torchtune does); None: never.
        prompt_template: a torchtune prompt template applied to the messages first (adds plain
            text around them).

    Raises:
        ValueError: the file is not a ``tokenizer.json`` with Gemma 3's tokens.
    """

    def __init__(
        self,
        path: str,
        max_seq_len: int | None = None,
        prompt_template: PromptTemplateInterface | None = None,
    ) -> None:
        # A chat model ends its turn with <end_of_turn>; <eos> ends a document.
        super().__init__(
            path,
            builder="gemma3_tokenizer",
            bos_token=BOS,
            eos_token=EOS,
            pad_token=PAD,
            stop_tokens=[EOS, END_OF_TURN],
            max_seq_len=max_seq_len,
            prompt_template=prompt_template,
            tokens_read_as_text=CONTROL_TOKENS,
        )
        self.start_of_turn_id = self.token_id(START_OF_TURN)
        self.end_of_turn_id = self.token_id(END_OF_TURN)
        self._control_ids = {self.pad_id, self.eos_id, self.bos_id}

    @property
    def vocab_size(self) -> int:
        """The SentencePiece vocabulary's size, as torchtune's Gemma tokenizer: the tokens the
        file adds beyond it (the multimodal ``<image_soft_token>``) are no text piece."""
        return self.tokenizer.get_vocab_size(with_added_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Token ids to text: without ``<pad>``, ``<eos>`` and ``<bos>``, other tokens written
        out (SentencePiece's decode); ``skip_special_tokens`` drops every special token."""
        kept = [t for t in token_ids if t not in self._control_ids]
        return super().decode(kept, skip_special_tokens=skip_special_tokens)

    def tokenize_messages(
        self, messages: Sequence[Message], *, add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        """Encode a conversation in Gemma 3's chat format.

        Args:
            messages: torchtune messages (an optional leading system message, then user and
                assistant messages), text only.
            add_end_tokens: end a final assistant message with ``<end_of_turn>\\n`` (training);
                False leaves it open for generation to continue (inference).

        Returns:
            The token ids and, per token, whether it is masked out of the loss.

        Raises:
            RuntimeError: a message holds non-text content.
            ValueError: the roles do not fit Gemma 3's format (see the module's docstring).
        """
        if self.prompt_template is not None:
            messages = self.prompt_template(list(messages))
        system, turns = split_system_message(messages)
        tokens: list[int] = [self.bos_id]
        mask: list[bool] = [messages[0].masked if messages else True]
        for index, message in enumerate(turns):
            is_last = index == len(turns) - 1
            turn_tokens, turn_mask = self._turn(
                message,
                system=system if index == 0 else None,
                close=add_end_tokens or not is_last or message.role != "assistant",
            )
            tokens.extend(turn_tokens)
            mask.extend(turn_mask)
            if self.reached_right_truncation(len(tokens)):
                break  # the rest would be cut off anyway
        return self.truncate(tokens, mask, add_end_tokens)

    def _turn(self, message: Message, *, system: Message | None, close: bool) -> Turn:
        header = TURN_ROLES[message.role] + "\n"
        if system is not None:
            header += message_text(system) + SYSTEM_SEPARATOR
        # Header and content are encoded together, as transformers encodes the text between
        # two turn tokens; a piece that spans them both belongs to the content.
        ids = self._encode_text(header + message_text(message).strip())
        header_length = _common_prefix_length(self._encode_text(header), ids)
        header_masked = message.masked if system is None else system.masked
        tokens = [self.start_of_turn_id, *ids]
        mask = [header_masked] * (1 + header_length) + [message.masked] * (len(ids) - header_length)
        if close:
            end = [self.end_of_turn_id, *self._encode_text("\n")]
            tokens.extend(end)
            mask.extend([message.masked] * len(end))
        return tokens, mask

    def _encode_text(self, text: str) -> list[int]:
        return self.encode(text, add_bos=False, add_eos=False)


def split_system_message(messages: Sequence[Message]) -> tuple[Message | None, list[Message]]:
    """A conversation's leading system message (None without one) and its other messages.

    Raises:
        ValueError: a system message elsewhere than first, a leading system message not
            followed by a user message, or a role Gemma 3 has no turn for (``ipython``).
    """
    system = messages[0] if messages and messages[0].role == "system" else None
    turns = list(messages[1:] if system is not None else messages)
    if system is not None and (not turns or turns[0].role != "user"):
        raise ValueError(
            "Gemma 3 writes the system message into the first user turn: a user message "
            "must follow it."
        )
    for message in turns:
        if message.role not in TURN_ROLES:
            raise ValueError(
                f"Gemma 3's chat format has no {message.role!r} turn (a system message can "
                "only come first; there is no tool role)."
            )
    return system, turns


def gemma3_tokenizer(
    path: str,
    max_seq_len: int | None = None,
    prompt_template: _TemplateType | None = None,
) -> Gemma3Tokenizer:
    """Gemma 3's tokenizer, for configs.

    Args:
        path: ``tokenizer.json`` of a Gemma 3 release (``tune download`` puts it next to
            ``tokenizer.model``, which is refused: ``tokenizers`` reads the former).
        max_seq_len: truncate tokenized conversations to this many tokens; None: never.
        prompt_template: a dotpath of a torchtune prompt template class, or a role to
            ``(prepend, append)`` mapping; None: none.

    Returns:
        The tokenizer.

    Raises:
        ValueError: ``path`` is not a Gemma 3 ``tokenizer.json``.
    """
    return Gemma3Tokenizer(
        path,
        max_seq_len=max_seq_len,
        prompt_template=None if prompt_template is None else _get_prompt_template(prompt_template),
    )


def _common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):  # up to the shorter's end
        if a != b:
            break
        length += 1
    return length
