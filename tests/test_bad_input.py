"""Bad input fails with a message naming the key, file or row (issue #7).

Dataset rows: real torchtune 0.6.1 datasets (``alpaca_dataset``, ShareGPT ``chat_dataset``)
built from small bad JSON files and the shipped tokenizer, wrapped by
:func:`exactga.data.loader.checked_dataset` as the recipes do. Config: unknown keys, counts below 1
and type errors are tested against ``validate_config`` in tests/test_config.py and through
``tune run`` in tests/test_recipe_full_single_device.py; ``optimizer_in_bwd`` with
accumulation in the distributed recipe in tests/test_recipe_full_distributed_extra.py. Every
bad input here, and the config ones, through a real ``tune run`` launch (one message, no
traceback): tests/test_bad_input_launch.py.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from recipe_utils import REPO_ROOT
from torch.utils.data import Dataset
from torchtune.datasets import ConcatDataset, alpaca_dataset, chat_dataset
from torchtune.models.llama2 import llama2_tokenizer

from exactga.data.loader import checked_dataset

TOKENIZER = REPO_ROOT / "configs/tiny/tokenizer.model"
VOCAB_SIZE = 2048  # the tiny model's embedding rows; the tokenizer has 2000 pieces
GOOD = {"instruction": "Say hi.", "input": "", "output": "Hi there."}


@pytest.fixture(scope="module")
def tokenizer():
    return llama2_tokenizer(str(TOKENIZER), max_seq_len=256, prompt_template=None)


def write_rows(tmp_path: Path, rows: list[dict], name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


def alpaca(tokenizer, path: Path, **kwargs):
    return alpaca_dataset(tokenizer, source="json", data_files=str(path), split="train", **kwargs)


def checked_alpaca(tokenizer, path: Path, vocab_size: int = VOCAB_SIZE, **kwargs):
    ds = alpaca(tokenizer, path, **kwargs)
    return checked_dataset(ds, vocab_size=vocab_size, source=f"dataset (json: {path})")


def read_all(ds) -> None:
    for index in range(len(ds)):
        ds[index]


def test_row_missing_a_column_is_named(tokenizer, tmp_path):
    # The other rows have the column, so the JSON loader gives this row a null; torchtune
    # would fail on it with "content must be of type List[Dict[str, Any]], got None".
    path = write_rows(tmp_path, [GOOD, GOOD, {"instruction": "Say hi.", "input": ""}, GOOD])
    with pytest.raises(ValueError) as err:
        checked_alpaca(tokenizer, path)
    assert str(err.value) == (
        f"dataset row 2 (0-based) of dataset (json: {path}): missing column 'output' "
        "(absent or null)."
    )


def test_column_missing_from_every_row_is_named(tokenizer, tmp_path):
    path = write_rows(tmp_path, [{"instruction": "Say hi.", "answer": "Hi."}] * 2)
    with pytest.raises(ValueError) as err:
        checked_alpaca(tokenizer, path)
    assert str(err.value) == (
        f"dataset (json: {path}): missing column 'output' in every row; its columns are "
        "instruction, answer."
    )


def test_renamed_column_is_named_with_its_column_map_key(tokenizer, tmp_path):
    path = write_rows(tmp_path, [GOOD])
    with pytest.raises(ValueError, match=r"missing column 'answer' \(column_map 'output'\)"):
        checked_alpaca(tokenizer, path, column_map={"output": "answer"})


@pytest.mark.parametrize(
    ("column", "value", "shown"),
    [
        ("output", 5, "int 5"),
        ("output", ["Hi", "there"], "list ['Hi', 'there']"),
        # torchtune formats these into the prompt with str.format: it would train on "7".
        ("instruction", 7, "int 7"),
        ("input", {"lang": "en"}, "dict {'lang': 'en'}"),
    ],
    ids=["output_int", "output_list", "instruction_int_stringified", "input_dict_stringified"],
)
def test_wrong_type_is_named(tokenizer, tmp_path, column, value, shown):
    path = write_rows(tmp_path, [GOOD, {**GOOD, column: value}, GOOD])
    with pytest.raises(ValueError) as err:
        checked_alpaca(tokenizer, path)
    assert str(err.value) == (
        f"dataset row 1 (0-based) of dataset (json: {path}): column '{column}' must be a "
        f"string, got {shown}."
    )


def test_input_may_be_left_out(tokenizer, tmp_path):
    path = write_rows(tmp_path, [GOOD, {"instruction": "Say hi.", "output": "Hi."}])
    read_all(checked_alpaca(tokenizer, path))


def sharegpt(tokenizer, path: Path):
    """torchtune's ``chat_dataset`` over ShareGPT-style conversations in a JSON file."""
    return chat_dataset(
        tokenizer,
        source="json",
        data_files=str(path),
        split="train",
        conversation_column="conversations",
        conversation_style="sharegpt",
    )


def chat_rows(bad_turn: dict) -> list[dict]:
    human = {"from": "human", "value": "Say hi."}
    return [
        {"conversations": [human, {"from": "gpt", "value": "Hi there."}]},
        {"conversations": [human, bad_turn]},
    ]


@pytest.mark.parametrize(
    ("bad_turn", "problem", "cause"),
    [
        ({"value": "Hi."}, "missing column or key 'from' (KeyError)", KeyError),
        (
            {"from": "gpt", "value": 5},
            "AssertionError: content must be of type List[Dict[str, Any]], got 5",
            AssertionError,
        ),
    ],
    ids=["turn_without_role", "turn_with_int_content"],
)
def test_failure_inside_a_transform_names_the_row(tokenizer, tmp_path, bad_turn, problem, cause):
    """A conversation's inside is not checked up front: the transform fails, by row."""
    path = write_rows(tmp_path, chat_rows(bad_turn))
    ds = checked_dataset(sharegpt(tokenizer, path), VOCAB_SIZE, source=f"dataset (json: {path})")
    ds[0]
    with pytest.raises(ValueError) as err:
        ds[1]
    assert str(err.value) == f"dataset row 1 (0-based) of dataset (json: {path}): {problem}"
    assert isinstance(err.value.__cause__, cause)


def test_conversation_missing_from_a_row_is_named(tokenizer, tmp_path):
    rows = [*chat_rows({"from": "gpt", "value": "Hi."}), {"dialog": "Hi."}]
    path = write_rows(tmp_path, rows)
    with pytest.raises(ValueError) as err:
        checked_dataset(sharegpt(tokenizer, path), vocab_size=VOCAB_SIZE, source="dataset")
    assert str(
        err.value
    ) == "dataset row 2 (0-based) of dataset: missing column 'conversations' " + (
        "(absent or null)."
    )


VOCAB_MESSAGE = (
    r"(dataset row|packed sample) 0 \(0-based\) of dataset \(json: .*\): token id (\d+) "
    r"\(its largest\) is beyond the model's vocabulary \(vocab_size 1000\)\. The tokenizer "
    r"\(config key 'tokenizer'\) does not match the model \(config key 'model\.vocab_size'\): "
    r"use the model's own tokenizer, or a vocab_size at least (\d+)\."
)


@pytest.mark.parametrize("packed", [False, True], ids=["sample", "packed"])
def test_token_id_beyond_the_vocabulary_is_named(tokenizer, tmp_path, packed):
    """The shipped tokenizer (2000 pieces) with a model of 1000 embedding rows."""
    rows = json.loads((REPO_ROOT / "configs/tiny/data.json").read_text())[:4]
    path = write_rows(tmp_path, rows)
    ds = checked_alpaca(tokenizer, path, vocab_size=1000, packed=packed)
    with pytest.raises(ValueError) as err:
        ds[0]
    match = re.fullmatch(VOCAB_MESSAGE, str(err.value))
    assert match, str(err.value)
    unit, highest, needed = match.groups()
    assert unit == ("packed sample" if packed else "dataset row")
    tokens = alpaca(tokenizer, path, packed=packed)[0]["tokens"]
    assert int(highest) == max(int(t) for t in tokens) >= 1000
    assert int(needed) == int(highest) + 1


def test_good_rows_pass_through_unchanged(tokenizer):
    path = REPO_ROOT / "configs/tiny/data.json"
    raw = alpaca(tokenizer, path)
    ds = checked_alpaca(tokenizer, path)
    assert len(ds) == len(raw)
    for index in (0, 1, len(raw) - 1):
        assert ds[index] == raw[index]
    # A DataLoader worker gets a pickled copy.
    assert pickle.loads(pickle.dumps(ds))[0] == raw[0]
    # Recipes read ``packed`` from a ConcatDataset through the wrapper.
    assert checked_dataset(ConcatDataset([raw]), VOCAB_SIZE, "datasets").packed is False


class ListDataset(Dataset):
    """Samples as given: a dataset that is no SFTDataset, so only the sample checks apply."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


@pytest.mark.parametrize(
    ("sample", "problem"),
    [
        ({"tokens": [1, 2]}, "a sample must hold 'tokens' and 'labels', got tokens."),
        (
            {"tokens": [1, 2, 3], "labels": [2, 3]},
            "3 tokens but 2 labels; the dataset's transform must give one label per token.",
        ),
        (
            {"tokens": torch.tensor([1, -1]), "labels": torch.tensor([1, -100])},
            "token id -1 is negative; the dataset's transform (config key 'tokenizer' or "
            "'dataset') produced an invalid id.",
        ),
    ],
    ids=["no_labels", "length_mismatch", "negative_id"],
)
def test_bad_samples_of_any_dataset_are_named(sample, problem):
    ds = checked_dataset(ListDataset([sample]), vocab_size=VOCAB_SIZE, source="my dataset")
    with pytest.raises(ValueError) as err:
        ds[0]
    assert str(err.value).startswith(f"dataset row 0 (0-based) of my dataset: {problem}")


def test_a_row_of_a_list_of_datasets_is_counted_within_its_dataset(tokenizer, tmp_path):
    """``dataset: [a, b]``: row 1 of b, not row 3 of the concatenation."""
    good = write_rows(tmp_path, chat_rows({"from": "gpt", "value": "Hi."}), name="good.json")
    bad = write_rows(tmp_path, chat_rows({"value": "Hi."}))
    ds = ConcatDataset([sharegpt(tokenizer, good), sharegpt(tokenizer, bad)])
    checked = checked_dataset(ds, VOCAB_SIZE, source="dataset")
    checked[2]
    with pytest.raises(ValueError, match=r"^dataset row 1 \(0-based\) of dataset\[1\]: missing"):
        checked[3]
