"""Prompts with reference answers, for reinforcement learning (GRPO).

An RL dataset holds no response to train on: each row is a question the policy answers and the
answer a reward checks (exactga.grpo.rewards). :func:`prompt_dataset` is a torchtune-style builder,
the tokenizer passed in by the recipe as for torchtune's datasets::

    dataset:
      _component_: exactga.grpo.prompts.prompt_dataset
      source: json
      data_files: configs/tiny/arithmetic_data.json
      split: train

    dataset = config.instantiate(cfg.dataset, tokenizer)

Each item is ``{"prompt_tokens": list[int], "prompt": str, "answer": str, "index": int}``:
the question tokenized with BOS and without EOS (the completion follows it), the question's
text and the answer as the rewards read them, and the row's index.

Every row's question and answer are checked once, when the dataset is built (two columns of
strings, so cheap even for many rows), and a bad row fails there with one message naming it,
counted from 0 as in exactga.data.loader (see [checked rows] there), instead of mid-epoch. A number
as answer (``"answer": 7`` in JSON) is taken as its text, ``"7"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from datasets import load_dataset
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtune import config

from exactga.data.files import read_data_files
from exactga.data.loader import build_prompt_loader
from exactga.generation.sampling import check_prompt

if TYPE_CHECKING:
    from exactga.grpo.schema import GrpoDistributedConfig

QUESTION = "question"
ANSWER = "answer"


class PromptDataset(Dataset):
    """Questions and their answers, the questions tokenized on access.

    Args:
        tokenizer: a torchtune ``ModelTokenizer`` (``encode(text, add_bos, add_eos)``); its
            ``max_seq_len``, when set, bounds a prompt's tokens.
        source: ``datasets.load_dataset``'s path, e.g. ``"json"``.
        column_map: the data's column names for ``question`` and ``answer``, e.g.
            ``{"question": "problem", "answer": "solution"}``; unmapped keys keep their names.
        filter_fn: keeps the rows it is true of (``datasets.Dataset.filter``), before the
            checks and the counting of rows.
        **load_dataset_kwargs: passed to ``datasets.load_dataset`` (``data_files``, ``split``).

    Raises:
        ValueError: a column that is missing, or a row whose question is missing, not a string
            or empty, or whose answer is missing or empty, naming the row and the data.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        source: str,
        column_map: Mapping[str, str] | None = None,
        filter_fn: Callable[[Mapping[str, Any]], bool] | None = None,
        **load_dataset_kwargs: Any,
    ) -> None:
        unknown = set(column_map or {}) - {QUESTION, ANSWER}
        if unknown:
            raise ValueError(
                f"config key 'dataset.column_map' maps {', '.join(sorted(unknown))}; it may map "
                f"only {QUESTION!r} and {ANSWER!r} to the data's column names."
            )
        columns = {QUESTION: QUESTION, ANSWER: ANSWER, **(column_map or {})}
        self._tokenizer = tokenizer
        data_files = load_dataset_kwargs.get("data_files")
        self._source = f"dataset ({source}: {data_files})" if data_files else f"dataset ({source})"
        data = read_data_files(  # a file that cannot be read, or has no rows, named
            lambda: load_dataset(source, **load_dataset_kwargs),
            {"source": source, **load_dataset_kwargs},
        )
        if filter_fn is not None:
            data = data.filter(filter_fn)
        missing = [key for key, column in columns.items() if column not in data.column_names]
        if missing:
            named = ", ".join(f"{columns[key]!r} (the {key})" for key in missing)
            raise ValueError(
                f"{self._source} has no column {named}; its columns are "
                f"{', '.join(data.column_names)}. Name them with config key "
                "'dataset.column_map'."
            )
        self._questions = [
            self._question(index, value) for index, value in enumerate(data[columns[QUESTION]])
        ]
        self._answers = [
            self._answer(index, value) for index, value in enumerate(data[columns[ANSWER]])
        ]

    def __len__(self) -> int:
        return len(self._questions)

    def __getitem__(self, index: int) -> dict[str, Any]:
        prompt = self._questions[index]
        tokens = self._tokenizer.encode(prompt, add_bos=True, add_eos=False)
        max_seq_len = getattr(self._tokenizer, "max_seq_len", None)
        if max_seq_len is not None and len(tokens) >= max_seq_len:
            raise ValueError(
                f"{self._where(index)}: its prompt is {len(tokens)} tokens, leaving no room for "
                f"a completion within tokenizer.max_seq_len={max_seq_len}; shorten the "
                "question, raise max_seq_len, or drop the row."
            )
        return {
            "prompt_tokens": tokens,
            "prompt": prompt,
            "answer": self._answers[index],
            "index": index,
        }

    def _where(self, index: int) -> str:
        return f"dataset row {index} (0-based) of {self._source}"

    def _question(self, index: int, value: Any) -> str:
        if not isinstance(value, str):
            got = "nothing" if value is None else f"a {type(value).__name__}, {value!r}"
            raise ValueError(f"{self._where(index)}: its question must be a string, got {got}.")
        if not value.strip():
            raise ValueError(f"{self._where(index)}: its question is empty.")
        return value

    def _answer(self, index: int, value: Any) -> str:
        # A number is its text: JSON answers are often written as numbers. A bool is not one.
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            got = "nothing" if value is None else f"a {type(value).__name__}, {value!r}"
            raise ValueError(
                f"{self._where(index)}: its answer must be a string or a number, got {got}."
            )
        if not value.strip():
            raise ValueError(f"{self._where(index)}: its answer is empty.")
        return value


def prompt_dataset(
    tokenizer: Any,
    *,
    source: str,
    column_map: Mapping[str, str] | None = None,
    filter_fn: Callable[[Mapping[str, Any]], bool] | None = None,
    **load_dataset_kwargs: Any,
) -> PromptDataset:
    """A :class:`PromptDataset`, the builder a config names (see the module docstring)."""
    return PromptDataset(
        tokenizer,
        source=source,
        column_map=column_map,
        filter_fn=filter_fn,
        **load_dataset_kwargs,
    )


def checked_prompt_loader(
    cfg: GrpoDistributedConfig,
    tokenizer: Any,
    model: nn.Module,
    *,
    num_replicas: int,
    rank: int,
    state_dict: Mapping[str, Any] | None,
) -> StatefulDataLoader:
    """The config's prompts, every one checked against ``model`` first (so that every rank
    fails alike at start-up, not one rank mid-run), dealt ``batch_size`` a step per rank out
    of one shuffled order: a step's prompts over every rank are the same on any number of
    ranks (``exactga.data.loader.build_prompt_loader``)."""
    dataset = config.instantiate(cfg.dataset, tokenizer)
    for prompt in dataset:
        check_prompt(
            model,
            prompt["prompt_tokens"],
            prompt_index=prompt["index"],
            max_generated_tokens=cfg.max_generated_tokens,
        )
    return build_prompt_loader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=cfg.shuffle,
        num_replicas=num_replicas,
        rank=rank,
        state_dict=state_dict,
    )
