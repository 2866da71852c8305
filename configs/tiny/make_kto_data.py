"""Regenerate ``configs/tiny/kto_data.json``, the tiny unpaired (KTO) data.

Run from the repository root::

    python configs/tiny/make_kto_data.py

It reads ``preference_data.json`` next to this script (see ``make_preference_data.py``) and
writes TRL's unpaired format, one row per example with a string ``prompt``, a string
``completion`` and a boolean ``label``: from each of the first ``NUM_PAIRS`` pairs its chosen
answer as a desirable row, and its rejected answer as an undesirable row for two pairs in three,
so the data hold more desirable than undesirable examples, as KTO's usually do. Rows keep the
pairs' order, so a prompt's rows are neighbours (exactga.dpo.kto mismatches a row with the next
row whose prompt differs). Deterministic, nothing downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

NUM_PAIRS = 60
HERE = Path(__file__).resolve().parent


def rows() -> list[dict]:
    pairs = json.loads((HERE / "preference_data.json").read_text())[:NUM_PAIRS]
    out = []
    for index, pair in enumerate(pairs):
        prompt = pair["chosen"][0]["content"]
        out.append({"prompt": prompt, "completion": pair["chosen"][1]["content"], "label": True})
        if index % 3:
            completion = pair["rejected"][1]["content"]
            out.append({"prompt": prompt, "completion": completion, "label": False})
    return out


if __name__ == "__main__":
    text = "[\n" + ",\n".join(json.dumps(row) for row in rows()) + "\n]\n"
    (HERE / "kto_data.json").write_text(text)
