"""Regenerate ``configs/tiny/preference_data.json``, the tiny preference (DPO) data.

Run from the repository root::

    python configs/tiny/make_preference_data.py           # write the file
    python configs/tiny/make_preference_data.py --stats   # measure the shipped file

It reads ``data.json`` next to this script (Alpaca rows made from CPython docstrings by
``make_assets.py``; PSF licence) and writes ``NUM_PAIRS`` pairs in the format of torchtune's
``preference_dataset`` (``ChosenRejectedToMessages``): columns ``chosen`` and ``rejected``, each a
user message (the row's instruction, then its input) and an assistant message. The chosen answer
is the row's output; the rejected one is plausible but wrong, chosen per row by a CRC32 of the
instruction: another object's docstring of a clearly different length, or, where that is
clearly shorter, the right answer cut to its first sentence.

A pair is kept only if both sides, tokenised with the tiny tokenizer (``prompt_template=None``),
are ``MIN_TOKENS`` to ``MAX_TOKENS`` long, so nothing is truncated at ``max_seq_len: 512`` and
every response has a label after the shift. The ``NUM_LONGEST`` pairs with the longest side are
taken, then the first others in CRC32 order of the instruction. The lengths keep data.json's
shape: a median near 70 tokens and a long tail up to 512, which is what makes padding to the
longest of a batch expensive. Nothing is downloaded, and the output is byte-for-byte
deterministic for a given data.json and tokenizer.

``--stats`` loads the written file through ``torchtune.datasets.preference_dataset`` at
``max_seq_len=512`` and prints the token-length table and the padding of random batches that
configs/tiny/ASSETS.md quotes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The directory of this script is on sys.path when it runs: one hash and one sentence cut for
# both generators.
from make_assets import first_sentence, stable_hash

HERE = Path(__file__).resolve().parent
SOURCE_PATH = HERE / "data.json"
OUTPUT_PATH = HERE / "preference_data.json"
TOKENIZER_PATH = HERE / "tokenizer.model"

NUM_PAIRS = 300
MIN_TOKENS = 29
MAX_TOKENS = 512  # the max_seq_len the file is meant for: no pair is truncated there
# A rejected answer's length differs from the chosen one's by at least this factor (in
# characters), so the two sides of a pair are clearly different sequences.
LENGTH_RATIO = 1.5
TOKEN_RATIO = 1.2  # and by this factor in tokens, prompt included
MAX_CANDIDATES = 20  # rejected answers tried per row before the row is skipped
NUM_LONGEST = 6  # pairs taken for their length, so that the tail reaches MAX_TOKENS

# --stats: batches of these many pairs, each drawn this many times with this seed.
STATS_BATCH_PAIRS = (1, 2, 4, 8)
STATS_NUM_BATCHES = 2000
STATS_SEED = 0


def prompt_of(row: dict[str, str]) -> str:
    """The user message: the instruction, then the input (a signature or a docstring)."""
    return f"{row['instruction']}\n\n{row['input']}" if row["input"] else row["instruction"]


def clearly_different(chosen: str, rejected: str) -> bool:
    shorter, longer = sorted((len(chosen), len(rejected)))
    return rejected != chosen and longer >= LENGTH_RATIO * shorter


def rejected_candidates(index: int, rows: list[dict[str, str]]) -> Iterator[str]:
    """Wrong answers for ``rows[index]``, the preferred first.

    Half the rows (by hash) prefer the right answer cut to its first sentence, where that is
    clearly shorter; the others, and those the cut does not fit, take other rows' outputs,
    from a hashed offset on, that are clearly longer or shorter than their own.
    """
    chosen = rows[index]["output"]
    choice = stable_hash(rows[index]["instruction"])
    cut = first_sentence(chosen)
    start = index + 1 + (choice >> 1) % (len(rows) - 1)
    others = (rows[(start + step) % len(rows)]["output"] for step in range(len(rows) - 1))
    others = (text for text in others if clearly_different(chosen, text))
    if choice % 2 == 1:
        yield from itertools.islice(others, 1)
    if clearly_different(chosen, cut):
        yield cut
    yield from others


def pair_of(row: dict[str, str], rejected: str) -> dict[str, list[dict[str, str]]]:
    user = {"role": "user", "content": prompt_of(row)}
    return {
        "chosen": [user, {"role": "assistant", "content": row["output"]}],
        "rejected": [user, {"role": "assistant", "content": rejected}],
    }


def load_tokenizer(max_seq_len: int | None) -> Any:
    from torchtune.models.llama2 import llama2_tokenizer

    return llama2_tokenizer(path=str(TOKENIZER_PATH), max_seq_len=max_seq_len, prompt_template=None)


def num_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of one side as ``PreferenceDataset`` tokenises it (bos, prompt, answer, eos)."""
    from torchtune.data import Message

    masked = [Message(m["role"], m["content"], masked=m["role"] != "assistant") for m in messages]
    tokens, _ = tokenizer.tokenize_messages(masked)
    return len(tokens)


def pair_lengths(tokenizer: Any, pair: dict[str, list[dict[str, str]]]) -> tuple[int, int]:
    """(shorter, longer) side of ``pair``, in tokens."""
    shorter, longer = sorted(num_tokens(tokenizer, messages) for messages in pair.values())
    return shorter, longer


def fits(lengths: tuple[int, int]) -> bool:
    """Both sides within the token bounds, and clearly different in length (a long prompt can
    hide a difference in the answers)."""
    shorter, longer = lengths
    return shorter >= MIN_TOKENS and longer <= MAX_TOKENS and longer >= TOKEN_RATIO * shorter


def first_fitting_pair(
    tokenizer: Any, index: int, rows: list[dict[str, str]]
) -> tuple[dict[str, Any], int] | None:
    """The pair of ``rows[index]`` with its first rejected answer that fits, and the length of
    its longer side; None if none of the first few fits."""
    for rejected in itertools.islice(rejected_candidates(index, rows), MAX_CANDIDATES):
        pair = pair_of(rows[index], rejected)
        lengths = pair_lengths(tokenizer, pair)
        if fits(lengths):
            return pair, lengths[1]
    return None


def build_pairs(rows: list[dict[str, str]]) -> list[dict[str, list[dict[str, str]]]]:
    """``NUM_PAIRS`` pairs: the ``NUM_LONGEST`` whose longer side is longest, so the tail
    reaches ``MAX_TOKENS``, and the first others in hash order of the instruction; all in
    that order."""
    tokenizer = load_tokenizer(max_seq_len=None)  # untruncated, to measure
    order = sorted(range(len(rows)), key=lambda i: (stable_hash(rows[i]["instruction"]), i))
    fitting = [(i, fit) for i in order if (fit := first_fitting_pair(tokenizer, i, rows))]
    if len(fitting) < NUM_PAIRS:
        raise RuntimeError(f"only {len(fitting)} rows of {SOURCE_PATH} make a pair that fits")
    longest = sorted(fitting, key=lambda item: (-item[1][1], item[0]))[:NUM_LONGEST]
    taken = {i for i, _ in longest}
    taken.update([i for i, _ in fitting if i not in taken][: NUM_PAIRS - NUM_LONGEST])
    return [pair for i, (pair, _) in fitting if i in taken]


def write_pairs(pairs: list[dict[str, Any]], path: Path) -> None:
    """One pair per line: diffable, and smaller than an indented file."""
    lines = ",\n".join(json.dumps(pair, ensure_ascii=False) for pair in pairs)
    path.write_text(f"[\n{lines}\n]\n", encoding="utf-8")


def measure(path: Path) -> None:
    """Print ASSETS.md's length table and padding, from ``path`` as a recipe would load it."""
    from torchtune.datasets import preference_dataset

    tokenizer = load_tokenizer(max_seq_len=MAX_TOKENS)
    dataset = preference_dataset(tokenizer, source="json", data_files=str(path), split="train")
    samples = [dataset[i] for i in range(len(dataset))]
    chosen = [len(s["chosen_input_ids"]) for s in samples]
    rejected = [len(s["rejected_input_ids"]) for s in samples]
    longer = [max(pair) for pair in zip(chosen, rejected, strict=True)]
    print(f"{len(samples)} pairs; tokens at max_seq_len={MAX_TOKENS}:")
    print("| | min | median | p90 | max |\n|---|---|---|---|---|")
    sides = (("chosen", chosen), ("rejected", rejected), ("either", chosen + rejected))
    for name, lengths in (*sides, ("longer of the pair", longer)):
        p90 = statistics.quantiles(lengths, n=10, method="inclusive")[-1]
        row = (min(lengths), statistics.median(lengths), round(p90), max(lengths))
        print(f"| {name} | " + " | ".join(str(v) for v in row) + " |")
    ratios = [max(pair) / min(pair) for pair in zip(chosen, rejected, strict=True)]
    print(
        f"longer/shorter side of a pair: min {min(ratios):.2f}, median "
        f"{statistics.median(ratios):.2f}, max {max(ratios):.2f}; sequences over 300 tokens: "
        f"{sum(n > 300 for n in chosen + rejected)}, over 450: "
        f"{sum(n > 450 for n in chosen + rejected)}"
    )
    # A micro-batch of B pairs is 2B rows padded to the longest of them (collate_pairs).
    for num_pairs in STATS_BATCH_PAIRS:
        rng = random.Random(STATS_SEED)
        padded = real = 0
        for _ in range(STATS_NUM_BATCHES):
            batch = rng.sample(range(len(samples)), num_pairs)
            lengths = [chosen[i] for i in batch] + [rejected[i] for i in batch]
            padded += max(lengths) * len(lengths)
            real += sum(lengths)
        print(
            f"padding of {STATS_NUM_BATCHES} random batches of {num_pairs} pairs "
            f"(seed {STATS_SEED}): {1 - real / padded:.1%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stats", action="store_true", help="measure the written file")
    if parser.parse_args().stats:
        measure(OUTPUT_PATH)
        return
    rows = json.loads(SOURCE_PATH.read_text(encoding="utf-8"))
    pairs = build_pairs(rows)
    write_pairs(pairs, OUTPUT_PATH)
    print(f"wrote {len(pairs)} pairs to {OUTPUT_PATH}")


if __name__ == "__main__":
    main()
