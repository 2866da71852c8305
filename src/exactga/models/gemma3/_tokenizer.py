"""Gemma 3's tokenizer and chat format, token for token what ``transformers`` makes of Gemma 3's
files.

The SentencePiece model (``tokenizer.model``), ``encode`` and ``decode`` are torchtune 0.6.1's
:class:`~torchtune.models.gemma._tokenizer.GemmaTokenizer`. Gemma 3's ids: ``<pad>`` 0, ``<eos>``
1, ``<bos>`` 2, ``<unk>`` 3, ``<start_of_turn>`` 105, ``<end_of_turn>`` 106 (Gemma 1 and 2 had
the turn tokens at 106 and 107); the tokenizer reads the turn tokens' ids from the model file.
The chat format is Gemma 3's ``chat_template``::

    <bos><start_of_turn>user\\n{system}\\n\\n{user}<end_of_turn>\\n
    <start_of_turn>model\\n{assistant}<end_of_turn>\\n

- Gemma 3 has no system role: a leading system message is written, followed by a blank line,
  at the start of the first user turn (it must be followed by a user message).
- The assistant's role is written ``model``.
- User and assistant contents are stripped of surrounding whitespace, as the template's
  ``| trim`` does; the system text is not.
- Gemma 3 has no tool role: ``ipython`` messages are refused.

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

from collections.abc import MutableMapping, Sequence
from typing import Any

from torchtune.data import Message, PromptTemplateInterface
from torchtune.data._prompt_templates import _get_prompt_template, _TemplateType
from torchtune.models.gemma._tokenizer import GemmaTokenizer

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
# Gemma 3's names for torchtune's roles; the system role has none (it is folded, see above).
TURN_ROLES = {"user": "user", "assistant": "model"}
SYSTEM_SEPARATOR = "\n\n"

# One turn: its token ids and, per token, whether it is masked out of the loss.
Turn = tuple[list[int], list[bool]]


class Gemma3Tokenizer(GemmaTokenizer):
    """Gemma 3's tokenizer: torchtune's Gemma SentencePiece tokenizer with Gemma 3's turns.

    Args:
        path: ``tokenizer.model``.
        max_seq_len: truncate ``tokenize_messages``' output to its first this many tokens (the
            last kept token replaced by ``eos_id`` and masked, as torchtune does); None: never.
        prompt_template: a torchtune prompt template applied to the messages first (adds plain
            text around them).

    Raises:
        ValueError: the model file has no ``<start_of_turn>``/``<end_of_turn>`` piece.
    """

    def __init__(
        self,
        path: str,
        max_seq_len: int | None = None,
        prompt_template: PromptTemplateInterface | None = None,
    ) -> None:
        super().__init__(path=path, max_seq_len=max_seq_len, prompt_template=prompt_template)
        self.start_of_turn_id = self._piece_id(START_OF_TURN)
        self.end_of_turn_id = self._piece_id(END_OF_TURN)
        # A chat model ends its turn with <end_of_turn>; <eos> ends a document.
        self.stop_tokens = [self.eos_id, self.end_of_turn_id]

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
            if self.max_seq_len is not None and len(tokens) >= self.max_seq_len:
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

    def _piece_id(self, piece: str) -> int:
        model = self._spm_model.spm_model
        piece_id = model.piece_to_id(piece)
        if piece_id == model.unk_id() or model.id_to_piece(piece_id) != piece:
            raise ValueError(f"{piece} is not a piece of this SentencePiece model.")
        return piece_id

    def _truncate(
        self, tokens: list[int], mask: list[bool], add_end_tokens: bool
    ) -> tuple[list[int], list[bool]]:
        if self.max_seq_len is None or len(tokens) <= self.max_seq_len:
            return tokens, mask
        tokens, mask = tokens[: self.max_seq_len], mask[: self.max_seq_len]
        if add_end_tokens:
            # As torchtune's truncate: a cut sequence still ends in eos, masked because the
            # data does not end there and the model must not learn to stop mid-answer.
            tokens[-1], mask[-1] = self.eos_id, True
        return tokens, mask


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


def message_text(message: Message) -> str:
    """A message's text.

    Raises:
        RuntimeError: the message holds non-text content (images), which this text tokenizer
            cannot encode.
    """
    parts = []
    for item in message.content:
        if item["type"] != "text":
            raise RuntimeError(f"Unsupported message content type: {item['type']}")
        parts.append(item["content"])
    return "".join(parts)


def gemma3_tokenizer(
    path: str,
    max_seq_len: int | None = None,
    prompt_template: _TemplateType | None = None,
) -> Gemma3Tokenizer:
    """Gemma 3's tokenizer, for configs.

    Args:
        path: ``tokenizer.model``.
        max_seq_len: truncate tokenized conversations to this many tokens; None: never.
        prompt_template: a dotpath of a torchtune prompt template class, or a role to
            ``(prepend, append)`` mapping; None: none.

    Returns:
        The tokenizer.
    """
    return Gemma3Tokenizer(
        path=path,
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
