"""Regenerate ``configs/tiny/arithmetic_data.json``, the tiny GRPO task's prompts.

Run from the repository root::

    python configs/tiny/make_arithmetic_data.py           # write the file
    python configs/tiny/make_arithmetic_data.py --stats   # measure the shipped file

The task is short integer arithmetic with one verifiable answer: ``{"question": "3 + 4 =",
"answer": "7"}``. For every ``0 <= a, b < MAX_OPERAND`` the sum ``a + b =`` (answer ``a + b``)
and the difference that undoes it, ``(a + b) - b =`` (answer ``a``, never negative), are
candidates; the first ``NUM_PER_OPERATION`` of each operation in CRC32 order of the question are
kept, and the file lists them all in that order. Operands stay small so that a prompt is
at most 9 tokens with the tiny tokenizer (digits are split, one piece each) and an answer at most
two digits: a completion of 8 to 16 tokens has room for it. Nothing is downloaded and nothing
is random: the output is byte-for-byte deterministic.

``--stats`` loads the written file through ``exactga.grpo.prompts.prompt_dataset`` with the tiny
tokenizer and prints what configs/tiny/ASSETS.md quotes: rows per operation, prompt lengths in
tokens, and how answers are spread.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

# The directory of this script is on sys.path when it runs: one hash for every generator.
from make_assets import stable_hash

HERE = Path(__file__).resolve().parent
OUTPUT_PATH = HERE / "arithmetic_data.json"
TOKENIZER_PATH = HERE / "tokenizer.model"

MAX_OPERAND = 20  # a, b in 0..19: prompts of at most 9 tokens, answers of at most 2 digits
NUM_PER_OPERATION = 250  # of 400 sums and 400 differences


def candidates() -> dict[str, list[dict[str, str]]]:
    """Every question of each operation, with its answer."""
    pairs = [(a, b) for a in range(MAX_OPERAND) for b in range(MAX_OPERAND)]
    # Each difference undoes a sum, (a + b) - b = a: as many as the sums, never negative.
    return {
        "+": [{"question": f"{a} + {b} =", "answer": str(a + b)} for a, b in pairs],
        "-": [{"question": f"{a + b} - {b} =", "answer": str(a)} for a, b in pairs],
    }


def build_rows() -> list[dict[str, str]]:
    """``NUM_PER_OPERATION`` rows of each operation, all in CRC32 order of the question."""
    kept = []
    for rows in candidates().values():
        ordered = sorted(rows, key=lambda row: (stable_hash(row["question"]), row["question"]))
        kept.extend(ordered[:NUM_PER_OPERATION])
    return sorted(kept, key=lambda row: (stable_hash(row["question"]), row["question"]))


def write_rows(rows: list[dict[str, str]], path: Path) -> None:
    """One row per line: diffable, and smaller than an indented file."""
    lines = ",\n".join(json.dumps(row) for row in rows)
    path.write_text(f"[\n{lines}\n]\n", encoding="utf-8")


def measure(path: Path) -> None:
    """Print ASSETS.md's numbers, from ``path`` as a recipe would load it."""
    from torchtune.models.llama2 import llama2_tokenizer

    from exactga.grpo.prompts import prompt_dataset

    tokenizer = llama2_tokenizer(str(TOKENIZER_PATH), max_seq_len=None, prompt_template=None)
    dataset = prompt_dataset(tokenizer, source="json", data_files=str(path), split="train")
    items = [dataset[i] for i in range(len(dataset))]
    operations = collections.Counter(item["prompt"].split()[1] for item in items)
    lengths = [len(item["prompt_tokens"]) for item in items]
    answers = [int(item["answer"]) for item in items]
    print(f"{len(items)} rows: " + ", ".join(f"{n} '{op}'" for op, n in sorted(operations.items())))
    print(
        f"prompt tokens (bos included): min {min(lengths)}, median "
        f"{statistics.median(lengths)}, max {max(lengths)}"
    )
    print(
        f"answers: {min(answers)}..{max(answers)}, median {statistics.median(answers)}; "
        f"{sum(a < 10 for a in answers)} of one digit, {answers.count(0)} zeros"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stats", action="store_true", help="measure the written file")
    if parser.parse_args().stats:
        measure(OUTPUT_PATH)
        return
    rows = build_rows()
    write_rows(rows, OUTPUT_PATH)
    print(f"wrote {len(rows)} rows to {OUTPUT_PATH}")


if __name__ == "__main__":
    main()
