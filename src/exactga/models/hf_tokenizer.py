"""A released ``tokenizer.json`` behind torchtune's tokenizer interface.

Hugging Face's ``tokenizers`` reads the file as the model's authors ship it (normaliser,
pre-tokenizer, BPE merges, the added tokens and which of them are special) and encodes as
``transformers`` encodes from it. :class:`HFModelTokenizer` puts torchtune's interface around it
(torchtune's ``ModelTokenizer`` and ``Transform``): ``encode``/``decode`` with torchtune's
arguments, the model transform ``__call__``, ``bos_id``, ``eos_id``, ``pad_id``,
``stop_tokens``, ``special_tokens``, ``vocab_size`` and ``max_seq_len``, and torchtune's
truncation. A family's subclass adds its chat format (``tokenize_messages``).
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from tokenizers import Tokenizer
from torchtune.data import Message, PromptTemplateInterface
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import ModelTokenizer

TruncationType = Literal["right", "left"]


def load_tokenizer_json(
    path: str, builder: str, tokens_read_as_text: Sequence[str] = ()
) -> Tokenizer:
    """The tokenizer a Hugging Face ``tokenizer.json`` describes, never truncating or padding.

    Args:
        path: the file.
        builder: the config's tokenizer builder, for the message.
        tokens_read_as_text: added tokens that text holding them encodes as text, not as the
            token (they keep their ids in the vocabulary; see :class:`HFModelTokenizer`).

    Raises:
        ValueError: ``path`` is not a ``tokenizer.json``.
    """
    try:
        if tokens_read_as_text:
            tokenizer = Tokenizer.from_str(json.dumps(_reading_as_text(path, tokens_read_as_text)))
        else:
            tokenizer = Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
        folder = os.path.dirname(path) or "."
        raise ValueError(
            f"tokenizer.path={path!r} is no tokenizer.json ({error}): {builder} reads Hugging "
            f"Face's tokenizer.json, which the release ships in the same folder; set "
            f"tokenizer.path to {folder}/tokenizer.json."
        ) from None
    # A file may carry transformers' batch settings; torchtune's recipes truncate and pad.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _reading_as_text(path: str, tokens: Sequence[str]) -> dict[str, Any]:
    """The ``tokenizer.json`` at ``path`` with ``tokens`` left to the BPE model: not matched as
    added tokens in a text, and no merge building them from their characters (SentencePiece's
    segmentation never yields its control pieces; a converted file may hold merges to them)."""
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in tokens]
    # A merge is "left right" (older files) or [left, right].
    merges = spec["model"].get("merges", [])
    built = ["".join(m.split(" ", 1) if isinstance(m, str) else m) for m in merges]
    spec["model"]["merges"] = [m for m, b in zip(merges, built, strict=True) if b not in tokens]
    return spec


class HFModelTokenizer(ModelTokenizer, Transform):
    """A ``tokenizer.json`` with torchtune's tokenizer interface; subclasses add the chat format.

    Args:
        path: the model's ``tokenizer.json``.
        builder: the config builder's name, for messages.
        bos_token, eos_token, pad_token: the added tokens torchtune's ``bos_id``, ``eos_id``
            and ``pad_id`` name (None: the model has none).
        stop_tokens: the tokens generation stops at.
        max_seq_len: truncate ``tokenize_messages``' output to this many tokens; None: never.
        prompt_template: a torchtune prompt template applied to the messages first.
        truncation_type: ``"right"`` keeps the start (the last kept token replaced by
            ``eos_id``, masked, as torchtune does), ``"left"`` keeps the end.
        tokens_read_as_text: added tokens that ``encode`` reads as text where the text writes
            them (SentencePiece's control tokens: its ``tokenizer.model`` encodes ``"<eos>"``
            in a text as the five characters); every other added token written in a text is
            that token, as transformers encodes.

    Raises:
        ValueError: the file is not a ``tokenizer.json``, lacks one of the named tokens, or
            ``truncation_type`` is neither choice.
    """

    def __init__(
        self,
        path: str,
        *,
        builder: str,
        bos_token: str | None,
        eos_token: str,
        pad_token: str,
        stop_tokens: Sequence[str],
        max_seq_len: int | None = None,
        prompt_template: PromptTemplateInterface | None = None,
        truncation_type: TruncationType = "right",
        tokens_read_as_text: Sequence[str] = (),
    ) -> None:
        check_choice("truncation_type", truncation_type, TruncationType)
        self.path = path
        self.builder = builder
        self.tokenizer = load_tokenizer_json(path, builder, tokens_read_as_text)
        added = {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        added |= {token: self.token_id(token) for token in tokens_read_as_text}
        self.special_tokens: dict[str, int] = dict(sorted(added.items(), key=lambda kv: kv[1]))
        self.bos_id = None if bos_token is None else self.token_id(bos_token)
        self.eos_id = self.token_id(eos_token)
        self.pad_id = self.token_id(pad_token)
        self.stop_tokens = [self.token_id(token) for token in stop_tokens]
        self.max_seq_len = max_seq_len
        self.prompt_template = prompt_template
        self.truncation_type: TruncationType = truncation_type

    @property
    def vocab_size(self) -> int:
        """One past the largest id the file names (model vocabulary and added tokens): a
        reward reads a sampled completion without the ids above
        (exactga.grpo.rollouts.completion_text)."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def token_id(self, token: str) -> int:
        """The id of one of the file's tokens.

        Raises:
            ValueError: the file has no such token (not this family's tokenizer.json).
        """
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"tokenizer.path={self.path!r} has no token {token!r}: {self.builder} needs "
                "the tokenizer.json of its own family's release."
            )
        return token_id

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Text to token ids as transformers encodes it, added tokens written in the text
        included; ``bos_id`` and ``eos_id`` around it as torchtune's tokenizers add them."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Token ids to text; ``skip_special_tokens`` drops the tokens the file marks special."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

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

    def tokenize_messages(
        self, messages: Sequence[Message], *, add_end_tokens: bool = True
    ) -> tuple[list[int], list[bool]]:
        raise NotImplementedError  # the family's chat format

    def reached_right_truncation(self, length: int) -> bool:
        """Whether ``length`` tokens already fill what right truncation keeps."""
        return (
            self.max_seq_len is not None
            and self.truncation_type == "right"
            and length >= self.max_seq_len
        )

    def truncate(
        self, tokens: list[int], mask: list[bool], add_end_tokens: bool
    ) -> tuple[list[int], list[bool]]:
        """``tokens`` and ``mask`` cut to ``max_seq_len`` on the ``truncation_type`` side."""
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


def message_text(message: Message) -> str:
    """A message's text.

    Raises:
        RuntimeError: the message holds non-text content (images), which these text
            tokenizers cannot encode.
    """
    parts = []
    for item in message.content:
        if item["type"] != "text":
            raise RuntimeError(f"Unsupported message content type: {item['type']}")
        parts.append(item["content"])
    return "".join(parts)


def check_choice(name: str, value: str, choices: Any) -> None:
    """Refuse a ``value`` outside the ``Literal`` ``choices``, naming ``name``."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: one of {', '.join(map(repr, allowed))}.")
