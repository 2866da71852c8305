"""Preference data: the shipped pairs, and bad preference rows named by row.

The shipped file, configs/tiny/preference_data.json (made by configs/tiny/make_preference_data.py,
described in configs/tiny/ASSETS.md), is loaded as a DPO recipe loads it: torchtune 0.6.1's
``preference_dataset`` with the tiny tokenizer, wrapped by
:func:`exactga.data.loader.checked_dataset`. Bad rows are small JSON files through the same path,
or hand-made samples of a dataset that is no ``PreferenceDataset``, where only the per-sample
checks apply (exactga.data.rows). The SFT side of these checks is tests/test_bad_input.py's.
"""

from __future__ import annotations

import json
import pickle
import random
import statistics
from pathlib import Path

import pytest
from recipe_utils import REPO_ROOT
from torch.utils.data import Dataset
from torchtune.datasets import ConcatDataset, preference_dataset
from torchtune.models.llama2 import llama2_tokenizer

from exactga.data.loader import checked_dataset

SHIPPED = REPO_ROOT / "configs/tiny/preference_data.json"
TOKENIZER = REPO_ROOT / "configs/tiny/tokenizer.model"
VOCAB_SIZE = 2048  # the tiny model's embedding rows; the tokenizer has 2000 pieces
MAX_SEQ_LEN = 512  # what the shipped file is made for


def tokenizer(max_seq_len: int):
    return llama2_tokenizer(str(TOKENIZER), max_seq_len=max_seq_len, prompt_template=None)


def pair(prompt: str, chosen: str, rejected: str, rejected_prompt: str | None = None) -> dict:
    return {
        "chosen": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": chosen},
        ],
        "rejected": [
            {"role": "user", "content": rejected_prompt or prompt},
            {"role": "assistant", "content": rejected},
        ],
    }


GOOD = pair("Say hi.", "Hi there, how are you?", "Go away.")
LONG_PROMPT = "Explain this, please. " * 40  # about 200 tokens


def write_rows(tmp_path: Path, rows: list[dict], name: str = "pairs.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


def preference(path: Path, max_seq_len: int = MAX_SEQ_LEN, **kwargs):
    return preference_dataset(
        tokenizer(max_seq_len), source="json", data_files=str(path), split="train", **kwargs
    )


def checked(path: Path, max_seq_len: int = MAX_SEQ_LEN, vocab_size: int = VOCAB_SIZE, **kwargs):
    ds = preference(path, max_seq_len, **kwargs)
    return checked_dataset(ds, vocab_size=vocab_size, source=f"dataset (json: {path})")


def read_all(ds) -> list[dict]:
    return [ds[index] for index in range(len(ds))]


@pytest.fixture(scope="module")
def shipped() -> list[dict]:
    return read_all(checked(SHIPPED))


def padding_fraction(chosen: list[int], rejected: list[int], num_pairs: int) -> float:
    """Padding of random micro-batches of ``num_pairs`` pairs, stacked as ``2B`` rows padded
    to the longest (exactga.dpo.preference.collate_pairs)."""
    rng = random.Random(0)
    padded = real = 0
    for _ in range(500):
        batch = rng.sample(range(len(chosen)), num_pairs)
        lengths = [chosen[i] for i in batch] + [rejected[i] for i in batch]
        padded += max(lengths) * len(lengths)
        real += sum(lengths)
    return 1 - real / padded


def test_the_shipped_pairs_load_and_vary_in_length(shipped):
    """ASSETS.md's targets: 300 pairs, 29 to 512 tokens a sequence, a median near 73, a tail
    near 512, sides of a pair clearly apart, and most of a batch of 8 pairs padding."""
    assert SHIPPED.stat().st_size < 1_000_000
    assert len(shipped) == 300
    chosen = [len(sample["chosen_input_ids"]) for sample in shipped]
    rejected = [len(sample["rejected_input_ids"]) for sample in shipped]
    lengths = chosen + rejected
    assert min(lengths) >= 25
    # A side cut at max_seq_len would be exactly max_seq_len long: none is cut.
    assert max(lengths) < MAX_SEQ_LEN
    assert sum(length >= 450 for length in lengths) >= 3
    assert 60 <= statistics.median(lengths) <= 90
    assert min(max(c, r) / min(c, r) for c, r in zip(chosen, rejected, strict=True)) >= 1.15
    assert 0.6 <= padding_fraction(chosen, rejected, num_pairs=8) <= 0.8


def num_masked(labels: list[int]) -> int:
    """Leading -100 labels: the prompt."""
    return next(i for i, label in enumerate(labels) if label != -100)


def test_the_shipped_pairs_share_a_prompt_and_differ_in_the_answer(shipped):
    """Both sides of a pair hold the same masked prompt, then different answers, each ending
    on a trained eos."""
    for sample in shipped:
        chosen, rejected = sample["chosen_input_ids"], sample["rejected_input_ids"]
        num_prompt = num_masked(sample["chosen_labels"])
        assert num_prompt == num_masked(sample["rejected_labels"])
        assert chosen[:num_prompt] == rejected[:num_prompt]
        assert chosen[num_prompt:] != rejected[num_prompt:]
        assert chosen[-1] == rejected[-1] == 2 == sample["chosen_labels"][-1]


def test_a_good_file_passes_unchanged(tmp_path):
    path = write_rows(tmp_path, [GOOD, pair("Name a colour.", "Blue.", "I cannot do that.")])
    raw = read_all(preference(path))
    ds = checked(path)
    assert read_all(ds) == raw
    assert ds.packed is False
    assert pickle.loads(pickle.dumps(ds))[1] == raw[1]  # what a DataLoader worker gets


def test_a_row_without_rejected_is_named_at_start_up(tmp_path):
    # The other rows have the column, so the JSON loader gives this row a null; torchtune
    # would fail on it only when the row is read: "'NoneType' object is not iterable".
    path = write_rows(tmp_path, [GOOD, GOOD, {"chosen": GOOD["chosen"]}, GOOD])
    with pytest.raises(ValueError) as err:
        checked(path)
    assert str(err.value) == (
        f"dataset row 2 (0-based) of dataset (json: {path}): missing column 'rejected' (absent "
        "or null)."
    )


def test_a_rejected_that_is_no_conversation_is_named_at_start_up(tmp_path):
    path = write_rows(tmp_path, [GOOD, {**GOOD, "rejected": "Go away."}])
    with pytest.raises(ValueError) as err:
        checked(path)
    assert str(err.value) == (
        f"dataset row 1 (0-based) of dataset (json: {path}): column 'rejected' must be a list, "
        "got str 'Go away.'."
    )


def test_the_column_map_names_the_columns_checked(tmp_path):
    renamed = [{"good": row["chosen"], "bad": row["rejected"]} for row in (GOOD, GOOD)]
    column_map = {"chosen": "good", "rejected": "bad"}
    read_all(checked(write_rows(tmp_path, renamed), column_map=column_map))

    del renamed[1]["bad"]
    path = write_rows(tmp_path, renamed, name="one_missing.json")
    with pytest.raises(ValueError, match=r"^dataset row 1 \(0-based\) .*: missing column 'bad' "):
        checked(path, column_map=column_map)

    path = write_rows(tmp_path, [GOOD], name="unmapped.json")
    with pytest.raises(ValueError) as err:
        checked(path, column_map=column_map)
    assert str(err.value) == (
        f"dataset (json: {path}): missing column 'good' (column_map 'chosen') in every row; its "
        "columns are chosen, rejected."
    )


@pytest.mark.parametrize("side", ["chosen", "rejected"])
def test_a_response_that_is_all_prompt_is_named(tmp_path, side):
    """At max_seq_len 64 a 200-token prompt leaves no response: every label is -100."""
    long_pair = (
        pair(LONG_PROMPT, "Fine.", "No.")
        if side == "chosen"
        else pair("Say hi.", "Hi.", "No.", rejected_prompt=LONG_PROMPT)
    )
    path = write_rows(tmp_path, [GOOD, GOOD, long_pair])
    ds = checked(path, max_seq_len=64)  # the columns are fine: nothing fails at start-up
    read_all(checked(path))  # at 512 the row is fine
    ds[1]
    with pytest.raises(ValueError) as err:
        ds[2]
    assert str(err.value) == (
        f"dataset row 2 (0-based) of dataset (json: {path}): its {side} response has no label "
        "after the shift (the prompt fills tokenizer.max_seq_len=64, or the response is "
        "empty); shorten the prompt, raise max_seq_len, or drop the row."
    )


def test_a_row_of_a_list_of_datasets_is_named_within_its_dataset(tmp_path):
    """``dataset: [a, b]``: row 1 of b, and b's own tokenizer's max_seq_len."""
    good = write_rows(tmp_path, [GOOD, GOOD], name="good.json")
    bad = write_rows(tmp_path, [GOOD, pair(LONG_PROMPT, "Fine.", "No.")], name="bad.json")
    ds = ConcatDataset([preference(good), preference(bad, max_seq_len=48)])
    ds = checked_dataset(ds, VOCAB_SIZE, source="dataset")
    ds[2]
    with pytest.raises(ValueError) as err:
        ds[3]
    assert str(err.value).startswith(
        "dataset row 1 (0-based) of dataset[1]: its chosen response has no label after the "
        "shift (the prompt fills tokenizer.max_seq_len=48,"
    )


def test_a_token_id_beyond_the_vocabulary_is_named(tmp_path):
    """The shipped tokenizer (2000 pieces) with a model of 1000 embedding rows."""
    rows = json.loads(SHIPPED.read_text())[:3]
    path = write_rows(tmp_path, rows)
    ds = checked(path, vocab_size=1000)
    highest = max(preference(path)[0]["chosen_input_ids"])
    assert highest >= 1000
    with pytest.raises(ValueError) as err:
        ds[0]
    assert str(err.value) == (
        f"dataset row 0 (0-based) of dataset (json: {path}): in its chosen side, token id "
        f"{highest} (its largest) is beyond the model's vocabulary (vocab_size 1000). The "
        "tokenizer (config key 'tokenizer') does not match the model (config key "
        f"'model.vocab_size'): use the model's own tokenizer, or a vocab_size at least "
        f"{highest + 1}."
    )


class ListDataset(Dataset):
    """Samples as given: no PreferenceDataset, so only the per-sample checks apply."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def pair_sample(**sides) -> dict:
    """A tokenized pair, good unless ``sides`` replaces one of its four lists."""
    good = {
        "chosen_input_ids": [1, 5, 6, 2],
        "chosen_labels": [-100, -100, 6, 2],
        "rejected_input_ids": [1, 5, 7, 8, 2],
        "rejected_labels": [-100, -100, 7, 8, 2],
    }
    return {**good, **sides}


@pytest.mark.parametrize(
    ("sample", "problem"),
    [
        (
            pair_sample(rejected_input_ids=[1, 5, 2048, 8, 2]),
            "in its rejected side, token id 2048 (its largest) is beyond the model's vocabulary "
            "(vocab_size 2048).",
        ),
        (
            pair_sample(chosen_input_ids=[1, -3, 6, 2]),
            "in its chosen side, token id -3 is negative;",
        ),
        (
            pair_sample(rejected_labels=[-100, 7, 8, 2]),
            "in its rejected side, 5 tokens but 4 labels;",
        ),
        (
            # The one label is at position 0, which no position predicts: none after the shift.
            pair_sample(chosen_labels=[1, -100, -100, -100]),
            "its chosen response has no label after the shift (the prompt fills the "
            "tokenizer's max_seq_len, or the response is empty);",
        ),
        (
            {"chosen_input_ids": [1, 2], "chosen_labels": [-100, 2]},
            "a preference sample must hold 'chosen_input_ids', 'chosen_labels', "
            "'rejected_input_ids', 'rejected_labels', got chosen_input_ids, chosen_labels.",
        ),
        (
            {"input_ids": [1, 2]},
            "a sample must hold 'tokens' and 'labels', got input_ids. (A preference sample "
            "holds 'chosen_input_ids', 'chosen_labels', 'rejected_input_ids' and "
            "'rejected_labels' instead.)",
        ),
    ],
    ids=[
        "id_beyond_vocab",
        "negative_id",
        "length_mismatch",
        "label_only_before_shift",
        "half_a_pair",
        "neither_layout",
    ],
)
def test_bad_samples_of_any_dataset_are_named(sample, problem):
    ds = checked_dataset(ListDataset([pair_sample(), sample]), VOCAB_SIZE, source="my dataset")
    ds[0]
    with pytest.raises(ValueError) as err:
        ds[1]
    assert str(err.value).startswith(f"dataset row 1 (0-based) of my dataset: {problem}")
