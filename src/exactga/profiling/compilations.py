"""What ``torch.compile`` did over a run: graphs, recompilations and graph breaks.

Read from dynamo's own books, never from the device, so reading them costs no sync:

- ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``: the graphs dynamo captured (each
  is compiled once by the backend: a graph break splits a frame into several);
- ``torch._dynamo.utils.get_compilation_metrics()``: one record per frame compilation; a
  record with a ``recompile_reason`` is a recompilation (a frame compiled before, whose guards
  failed: a new shape, a size dynamo had specialised). torch keeps the last 64 records only,
  so the meter reads the new ones at every optimizer step;
- ``counters["graph_break"]`` and ``counters["unimplemented"]``: the graph breaks by reason
  (dynamo files a break under one or the other depending on where tracing stopped), counted
  once per compilation that met them, not per call.

All are counts since the meter started (the run's start), so that an earlier compilation in
the same process (a test's) is not the run's. See docs/profiling.md, "torch.compile".
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

from torch._dynamo.utils import counters, get_compilation_metrics

# dynamo's categories of the reasons it could not trace through; see the module docstring.
_BREAK_CATEGORIES = ("graph_break", "unimplemented")
NUM_REASONS_SHOWN = 3  # the end-of-run line names the first few reasons
# A recompile reason starts with the compile id whose guard failed ("1/0: "): dropped, so that
# the same reason in several frames (each layer's forward, its attention) is counted as one.
_COMPILE_ID = re.compile(r"^\d+/\d+: ")


@dataclasses.dataclass(frozen=True)
class CompileCounts:
    """Compilation work between two points of a run."""

    graphs: int
    recompilations: int
    graph_breaks: int


class CompilationMeter:
    """Counts what ``torch.compile`` does from the moment it is made.

    ``step`` after each optimizer step (reads the compilation records torch has added since,
    host-only Python), ``metrics`` at each logged step, ``summary`` at the end.
    """

    def __init__(self) -> None:
        self._graphs_at_start = _unique_graphs()
        self._breaks_at_start = _break_reasons()
        self._last_record = _newest_record()
        self._recompile_reasons: list[str] = []
        self._records_missed = False  # more than torch keeps came between two reads
        self._after_step_1: CompileCounts | None = None

    def counts(self) -> CompileCounts:
        """The counts since the meter started."""
        self._read_new_records()
        return CompileCounts(
            graphs=_unique_graphs() - self._graphs_at_start,
            recompilations=len(self._recompile_reasons),
            graph_breaks=sum(self._new_breaks().values()),
        )

    def step(self, step: int) -> None:
        """An optimizer step closed; the counts after step 1 are the baseline of a settled run."""
        counts = self.counts()
        if step == 1:
            self._after_step_1 = counts

    def metrics(self) -> dict[str, float]:
        """``compile/graphs``, ``compile/recompilations``, ``compile/graph_breaks`` so far."""
        counts = self.counts()
        return {
            "compile/graphs": float(counts.graphs),
            "compile/recompilations": float(counts.recompilations),
            "compile/graph_breaks": float(counts.graph_breaks),
        }

    def summary(self) -> str:
        """The end-of-run line: the graphs and recompilations, in all and after step 1, and the
        graph breaks with their first few reasons."""
        counts = self.counts()
        first = self._after_step_1 or counts
        at_least = "at least " if self._records_missed else ""
        line = (
            f"exactga: torch.compile: {_count(counts.graphs, 'graph')} "
            f"({counts.graphs - first.graphs} after step 1), {at_least}"
            f"{_count(counts.recompilations, 'recompilation')} "
            f"({counts.recompilations - first.recompilations} after step 1), "
            f"{_count(counts.graph_breaks, 'graph break')}"
        )
        breaks = self._new_breaks()
        if breaks:
            line += f" ({_first_reasons(breaks)})"
        if self._recompile_reasons:
            reasons = collections.Counter(self._recompile_reasons)
            line += f"; recompiled for: {_first_reasons(reasons)}"
        return line + "."

    def _new_breaks(self) -> collections.Counter[str]:
        return _break_reasons() - self._breaks_at_start

    def _read_new_records(self) -> None:
        """Add the recompilations among the compilation records torch added since the last
        read (the records are appended; the last one read marks where the new ones start)."""
        records = list(get_compilation_metrics())
        seen = next(
            (i for i in range(len(records) - 1, -1, -1) if records[i] is self._last_record),
            None,
        )
        if seen is None and self._last_record is not None and records:
            self._records_missed = True  # the last one read was dropped: some were lost
        new = records[(seen + 1) if seen is not None else 0 :]
        self._recompile_reasons += [
            _COMPILE_ID.sub("", r.recompile_reason) for r in new if r.recompile_reason
        ]
        if records:
            self._last_record = records[-1]


def _unique_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _newest_record() -> Any:
    records = get_compilation_metrics()
    return records[-1] if records else None


def _break_reasons() -> collections.Counter[str]:
    """Every graph break dynamo met in this process, by reason (its first line)."""
    reasons: collections.Counter[str] = collections.Counter()
    for category in _BREAK_CATEGORIES:
        for message, number in counters[category].items():
            reasons[_first_line(message)] += number
    return reasons


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0].strip() if message.strip() else "(no reason given)"


def _first_reasons(reasons: collections.Counter[str]) -> str:
    """The most frequent reasons, each with its count: ``"reason" x3; ...``."""
    shown = [f'"{reason}" x{number}' for reason, number in reasons.most_common(NUM_REASONS_SHOWN)]
    more = len(reasons) - NUM_REASONS_SHOWN
    return "; ".join(shown) + (f"; {more} more" if more > 0 else "")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")
