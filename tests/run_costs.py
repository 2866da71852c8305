"""What the suite's forked runs cost, by test module: the lines tests/launcher.py writes.

Run the tests with ``EXACTGA_TEST_RUN_COST_LOG`` set to a file, then sum it::

    EXACTGA_TEST_RUN_COST_LOG=/tmp/costs.jsonl make test
    .venv/bin/python tests/run_costs.py /tmp/costs.jsonl

Each line is one rank of one run; the table's CPU seconds are the ranks' own (a fork's usage
starts at zero), so a machine's load inflates the wall column, not the CPU one.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def costs_by_module(lines: list[str]) -> dict[str, tuple[int, float, float]]:
    """Module: (ranks run, CPU seconds, wall seconds)."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])
    for line in lines:
        record = json.loads(line)
        module = (record["test"] or "?").split("::")[0]
        totals[module][0] += 1
        totals[module][1] += record["cpu_s"]
        totals[module][2] += record["wall_s"]
    return {module: tuple(values) for module, values in totals.items()}


def main(path: str) -> None:
    totals = costs_by_module(Path(path).read_text().splitlines())
    print(f"{'CPU s':>8} {'wall s':>8} {'ranks':>6}  module")
    for module, (ranks, cpu, wall) in sorted(totals.items(), key=lambda item: -item[1][1]):
        print(f"{cpu:8.1f} {wall:8.1f} {ranks:6d}  {module}")
    ranks = sum(values[0] for values in totals.values())
    cpu = sum(values[1] for values in totals.values())
    print(f"{cpu:8.1f} {'':>8} {ranks:6d}  all")


if __name__ == "__main__":
    main(sys.argv[1])
