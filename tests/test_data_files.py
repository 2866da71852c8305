"""A data file that cannot be read, holds no rows, or lacks a column its builder reads: one
message naming the config key, the file and the fault, for every dataset builder the recipes
accept (issue #43; see [data file faults] in exactga.data.files and [checked rows] in
exactga.data.loader). Built as the recipes build them: ``load_dataset`` on a config section,
or ``config.instantiate`` for GRPO's prompts. Through ``tune run``:
tests/test_bad_input_launch.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow
import pyarrow.parquet
import pytest
from omegaconf import OmegaConf
from recipe_utils import REPO_ROOT
from torchtune import config
from torchtune.models.llama2 import llama2_tokenizer

from exactga.data.files import read_data_files
from exactga.data.loader import load_dataset

TOKENIZER = REPO_ROOT / "configs/tiny/tokenizer.model"
VOCAB_SIZE = 2048
ALPACA = {"instruction": "Say hi.", "input": "", "output": "Hi there."}
CHAT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hi."}]}
PAIR = {
    "chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi."}],
    "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No."}],
}
# Every builder the recipes accept: its section (less source and data_files) and a good row.
BUILDERS = {
    "alpaca": ({"_component_": "torchtune.datasets.alpaca_dataset"}, ALPACA),
    "instruct": (
        {
            "_component_": "torchtune.datasets.instruct_dataset",
            "column_map": {"input": "q", "output": "a"},
        },
        {"q": "Say hi.", "a": "Hi."},
    ),
    "chat": (
        {
            "_component_": "torchtune.datasets.chat_dataset",
            "conversation_column": "conversations",
            "conversation_style": "sharegpt",
        },
        CHAT,
    ),
    "preference": ({"_component_": "torchtune.datasets.preference_dataset"}, PAIR),
    "text_completion": (
        {"_component_": "torchtune.datasets.text_completion_dataset"},
        {"text": "Once upon a time."},
    ),
    "grpo_prompts": (
        {"_component_": "exactga.grpo.prompts.prompt_dataset"},
        {"question": "1 + 1 =", "answer": "2"},
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    return llama2_tokenizer(str(TOKENIZER), max_seq_len=256, prompt_template=None)


def build(tokenizer, builder: str, path: Path, source: str = "json"):
    section, _ = BUILDERS[builder]
    cfg = OmegaConf.create({**section, "source": source, "data_files": str(path), "split": "train"})
    if builder == "grpo_prompts":  # the GRPO recipe instantiates it itself
        return config.instantiate(cfg, tokenizer)
    return load_dataset(cfg, tokenizer, VOCAB_SIZE)


def expect(tokenizer, builder: str, path: Path, fault: str, source: str = "json") -> None:
    with pytest.raises(ValueError) as err:
        build(tokenizer, builder, path, source)
    assert str(err.value) == (
        f"config key 'dataset.data_files': {path} {fault}; fix the file or point data_files "
        "at another."
    )


def rows_as_json(rows: list[dict]) -> str:
    return "[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n"


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_invalid_json_is_named_with_its_line_and_column_for_every_builder(
    tokenizer, tmp_path, builder
):
    _, row = BUILDERS[builder]
    good = tmp_path / "good.json"
    good.write_text(rows_as_json([row] * 3))
    assert len(build(tokenizer, builder, good)) == 3
    text = rows_as_json([row] * 3).splitlines()
    text[2] = text[2].removesuffix(",")  # the second row's comma forgotten
    bad = tmp_path / "bad.json"
    bad.write_text("\n".join(text))
    expect(tokenizer, builder, bad, "is not valid JSON (line 4, column 1: Expecting ',' delimiter)")


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_an_empty_file_is_named_for_every_builder(tokenizer, tmp_path, builder):
    empty = tmp_path / "train.json"
    empty.write_text("")
    expect(tokenizer, builder, empty, "is empty (0 bytes)")


# (file name, source, content, fault)
FORMAT_CASES = [
    ("blank.json", "json", "\n  \n", "holds only whitespace, no rows"),
    ("none.json", "json", "[]\n", "holds no rows (an empty JSON list)"),
    ("items.json", "json", f"[{json.dumps(ALPACA)}, 2]", "is a JSON list whose item 1 (0-based)"),
    (
        "bad.jsonl",
        "json",
        json.dumps(ALPACA) + "\n" + json.dumps(ALPACA)[:-1] + "\n",
        "is not valid JSON Lines (line 2, column 62: Expecting ',' delimiter; each line must "
        "be one JSON object)",
    ),
    (
        "list_line.jsonl",
        "json",
        json.dumps(ALPACA) + "\n[1]\n",
        "is not valid JSON Lines (line 2 is not a JSON object, a row)",
    ),
    (
        "bad.csv",
        "csv",
        "instruction,input,output\nSay hi.,,Hi.\nSay hi.,,Hi.,extra,fields\n",
        "is not valid CSV (the row on line 3: 5 fields, the header has 3)",
    ),
    (  # pandas' "EOF inside string": Python's csv reads it only in strict mode
        "open_quote.csv",
        "csv",
        'instruction,input,output\nSay hi.,,Hi.\n"Say hi.,,Hi.\nSay hi.,,Hi.\n',
        "is not valid CSV (the row on line 3: unexpected end of data; a quote left open?)",
    ),
    ("header.csv", "csv", "instruction,input,output\n", "holds a header and no rows"),
    (
        "latin1.json",
        "json",
        b'[{"instruction": "caf\xe9"}]',
        "is not UTF-8 text (byte 21: invalid continuation byte)",
    ),
]


@pytest.mark.parametrize(
    ("name", "source", "content", "fault"), FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES]
)
def test_a_file_datasets_cannot_read_is_named(tokenizer, tmp_path, name, source, content, fault):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ValueError) as err:
        build(tokenizer, "alpaca", path, source)
    assert str(err.value).startswith(f"config key 'dataset.data_files': {path} {fault}")


def test_parquet_that_is_not_parquet_or_has_no_rows_is_named(tokenizer, tmp_path):
    not_parquet = tmp_path / "train.parquet"
    not_parquet.write_text("instruction,input,output\n")
    expect(
        tokenizer,
        "alpaca",
        not_parquet,
        "is not a Parquet file (Parquet magic bytes not found in footer. Either the file is "
        "corrupted or this is not a parquet file.)",
        source="parquet",
    )
    no_rows = tmp_path / "none.parquet"
    columns = {name: pyarrow.array([], pyarrow.string()) for name in ALPACA}
    pyarrow.parquet.write_table(pyarrow.table(columns), no_rows)
    expect(tokenizer, "alpaca", no_rows, "holds no rows", source="parquet")
    good = tmp_path / "good.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([ALPACA] * 2), good)
    assert len(build(tokenizer, "alpaca", good, source="parquet")) == 2


def test_csv_rows_without_a_column_the_builder_reads_are_named(tokenizer, tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("instruction,answer\nSay hi.,Hi.\n")
    with pytest.raises(ValueError, match="missing column 'output' in every row; its columns"):
        build(tokenizer, "alpaca", path, source="csv")


@pytest.mark.parametrize(
    ("builder", "row", "missing"),
    [
        ("preference", {"chosen": PAIR["chosen"]}, "missing column 'rejected' in every row"),
        ("text_completion", {"body": "Once."}, "missing column 'text' in every row"),
        ("grpo_prompts", {"question": "1 + 1 ="}, "has no column 'answer' (the answer)"),
    ],
)
def test_a_file_without_a_column_its_builder_reads_is_named(
    tokenizer, tmp_path, builder, row, missing
):
    path = tmp_path / "train.json"
    path.write_text(rows_as_json([row] * 2))
    with pytest.raises(ValueError) as err:
        build(tokenizer, builder, path)
    assert missing in str(err.value) and str(path) in str(err.value)


def test_a_list_of_datasets_names_the_section(tokenizer, tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(rows_as_json([ALPACA]))
    bad.write_text("")
    sections = [
        {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json", "data_files": str(f)}
        for f in (good, bad)
    ]
    with pytest.raises(ValueError, match=rf"^config key 'dataset\[1\].data_files': {bad} is empty"):
        load_dataset(OmegaConf.create(sections), tokenizer, VOCAB_SIZE)


def test_the_builders_own_log_line_is_not_printed(tmp_path, caplog):
    """datasets logs "Failed to load JSON from file" before raising; the message replaces it."""
    from datasets import load_dataset as hf_load_dataset

    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    section = {"source": "json", "data_files": str(path), "split": "train"}
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="line 2, column 7"):
        read_data_files(lambda: hf_load_dataset(**{**section, "path": "json"}), section)
    assert not [r for r in caplog.records if r.name.startswith("datasets")]


def test_a_failure_the_file_does_not_explain_is_raised_as_it_came(tmp_path):
    path = tmp_path / "good.json"
    path.write_text(rows_as_json([ALPACA]))

    def broken() -> None:
        raise KeyError("not the file's fault")

    with pytest.raises(KeyError, match="not the file's fault"):
        read_data_files(broken, {"source": "json", "data_files": str(path)})


def test_a_good_file_loads_without_progress_bars_and_leaves_the_switch_as_it_was(tmp_path, capfd):
    """datasets prints "Generating train split" as it first reads a file: nothing a user can
    act on, once per rank under torchrun. Our loading turns its bars off, and back on after."""
    from datasets import load_dataset as hf_load_dataset
    from datasets.utils.tqdm import are_progress_bars_disabled

    path = tmp_path / "good.json"
    path.write_text(rows_as_json([ALPACA] * 3))
    section = {"source": "json", "data_files": str(path), "split": "train"}

    def build():
        return hf_load_dataset(
            "json", data_files=str(path), split="train", cache_dir=str(tmp_path / "c1")
        )

    assert not are_progress_bars_disabled()
    assert len(read_data_files(build, section)) == 3
    assert "Generating" not in capfd.readouterr().err
    assert not are_progress_bars_disabled()
    # Without it, the line is there: the check can fail.
    hf_load_dataset("json", data_files=str(path), cache_dir=str(tmp_path / "c2"))  # a first read
    assert "Generating train split" in capfd.readouterr().err
