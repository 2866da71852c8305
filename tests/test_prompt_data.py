"""Prompt data for GRPO: the shipped arithmetic task, and bad prompt rows named by row.

The shipped file, configs/tiny/arithmetic_data.json (made by configs/tiny/make_arithmetic_data.py,
described in configs/tiny/ASSETS.md), is loaded as the GRPO recipe loads it:
``exactga.grpo.prompts.prompt_dataset`` with the tiny tokenizer. Bad rows are small JSON files
through the same builder.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
from recipe_utils import REPO_ROOT
from torchtune.models.llama2 import llama2_tokenizer

from exactga.grpo.prompts import prompt_dataset

TINY = REPO_ROOT / "configs/tiny"
SHIPPED = TINY / "arithmetic_data.json"
BOS, EOS = 1, 2


def tokenizer(max_seq_len: int | None = 512):
    return llama2_tokenizer(
        str(TINY / "tokenizer.model"), max_seq_len=max_seq_len, prompt_template=None
    )


def write_rows(tmp_path: Path, rows: list[dict], name: str = "prompts.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


def prompts(path: Path, max_seq_len: int | None = 512, **kwargs):
    return prompt_dataset(
        tokenizer(max_seq_len), source="json", data_files=str(path), split="train", **kwargs
    )


def read_all(ds) -> list[dict]:
    return [ds[index] for index in range(len(ds))]


@pytest.fixture(scope="module")
def shipped() -> list[dict]:
    return read_all(prompts(SHIPPED))


def test_the_shipped_task_is_short_arithmetic_with_right_answers(shipped):
    """ASSETS.md's figures: 500 distinct questions, half sums, half differences, each answer
    the question's value, 0..99, prompts of 7 to 9 tokens."""
    assert len(shipped) == 500
    questions = [item["prompt"] for item in shipped]
    assert len(set(questions)) == 500
    assert sum(" + " in q for q in questions) == sum(" - " in q for q in questions) == 250
    for item in shipped:
        left, operation, right, equals = item["prompt"].split()
        assert equals == "="
        value = int(left) + int(right) if operation == "+" else int(left) - int(right)
        assert item["answer"] == str(value)
        assert 0 <= value <= 99
    assert {len(item["prompt_tokens"]) for item in shipped} == {7, 8, 9}


def test_an_item_is_its_prompt_tokens_with_bos_and_without_eos(shipped):
    """Generation continues the prompt: bos first, no eos, and the tokens are the text's."""
    tok = tokenizer()
    for index, item in enumerate(shipped):
        assert set(item) == {"prompt_tokens", "prompt", "answer", "index"}
        assert item["index"] == index
        tokens = item["prompt_tokens"]
        assert tokens[0] == BOS and EOS not in tokens
        assert tokens == tok.encode(item["prompt"], add_bos=True, add_eos=False)
        assert tok.decode(tokens) == item["prompt"]


def test_the_generator_writes_the_shipped_file(tmp_path, monkeypatch):
    """make_arithmetic_data.py is deterministic and its output is what is shipped."""
    monkeypatch.syspath_prepend(str(TINY))  # the script imports make_assets beside it
    monkeypatch.delitem(sys.modules, "make_arithmetic_data", raising=False)
    generator = importlib.import_module("make_arithmetic_data")
    path = tmp_path / "arithmetic_data.json"
    generator.write_rows(generator.build_rows(), path)
    assert path.read_bytes() == SHIPPED.read_bytes()


def test_the_column_map_names_the_columns(tmp_path):
    path = write_rows(tmp_path, [{"problem": "1 + 1 =", "solution": "2"}])
    column_map = {"question": "problem", "answer": "solution"}
    (item,) = read_all(prompts(path, column_map=column_map))
    assert (item["prompt"], item["answer"], item["index"]) == ("1 + 1 =", "2", 0)

    with pytest.raises(ValueError) as err:
        prompts(path, column_map={"question": "problem"})
    assert str(err.value) == (
        f"dataset (json: {path}) has no column 'answer' (the answer); its columns are problem, "
        "solution. Name them with config key 'dataset.column_map'."
    )
    with pytest.raises(ValueError, match=r"^config key 'dataset.column_map' maps prompt; "):
        prompts(path, column_map={"prompt": "problem"})


def test_a_number_as_answer_is_its_text(tmp_path):
    path = write_rows(tmp_path, [{"question": "2 + 5 =", "answer": 7}])
    assert prompts(path)[0]["answer"] == "7"


GOOD = {"question": "1 + 2 =", "answer": "3"}


@pytest.mark.parametrize(
    ("bad_row", "problem"),
    [
        ({"answer": "3"}, "its question must be a string, got nothing."),
        ({**GOOD, "answer": None}, "its answer must be a string or a number, got nothing."),
        ({**GOOD, "question": "  "}, "its question is empty."),
        ({**GOOD, "answer": ""}, "its answer is empty."),
    ],
    ids=["no question", "null answer", "blank question", "empty answer"],
)
def test_a_bad_row_is_named_when_the_dataset_is_built(tmp_path, bad_row, problem):
    path = write_rows(tmp_path, [GOOD, GOOD, bad_row, GOOD])
    with pytest.raises(ValueError) as err:
        prompts(path)
    assert str(err.value) == f"dataset row 2 (0-based) of dataset (json: {path}): {problem}"


def test_a_question_that_is_no_string_is_named(tmp_path):
    # A type that differs from the other rows' fails in the JSON loader, which names its row;
    # in every row it loads, and is ours to name.
    path = write_rows(tmp_path, [{"question": ["1 + 2 ="], "answer": "3"}])
    with pytest.raises(ValueError) as err:
        prompts(path)
    assert str(err.value) == (
        f"dataset row 0 (0-based) of dataset (json: {path}): its question must be a string, "
        "got a list, ['1 + 2 =']."
    )


def test_a_prompt_that_fills_the_context_is_named(tmp_path):
    path = write_rows(tmp_path, [{"question": "1 + 2 =", "answer": "3"}] * 2)
    ds = prompts(path, max_seq_len=7)  # "1 + 2 =" is 7 tokens with bos
    with pytest.raises(ValueError) as err:
        ds[1]
    assert str(err.value) == (
        f"dataset row 1 (0-based) of dataset (json: {path}): its prompt is 7 tokens, leaving no "
        "room for a completion within tokenizer.max_seq_len=7; shorten the question, raise "
        "max_seq_len, or drop the row."
    )
    assert len(prompts(path, max_seq_len=8)[1]["prompt_tokens"]) == 7
