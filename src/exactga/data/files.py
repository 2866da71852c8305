"""A local data file that cannot be read, or holds no rows, fails naming the file and its fault.

``datasets.load_dataset`` (which every torchtune dataset builder and exactga's prompt dataset
call) reports such a file as ``DatasetGenerationError: An error occurred while generating the
dataset`` over a traceback, an empty JSON file as a bare ``StopIteration``, one without rows as
``ValueError: Instruction "train" corresponds to no data!``, none naming the file; and it logs
its own "Failed to load JSON from file" line first. :func:`read_data_files` builds a dataset so
that each of these is one ``ValueError`` naming the config key, the file and the fault. See
[data file faults]. It also builds it without ``datasets``' progress bars ("Generating train
split"), which a local file passes in a blink, on every rank.

Note [data file faults]
A good file must cost nothing extra, and a large JSON file costs as much to parse twice as to
load, so a file is read whole only after ``datasets`` failed on it, to say where: the first
JSON error's line and column (a file starting with ``[`` is one JSON document, else JSON Lines,
one object a line), the first CSV row with more fields than the header, no rows at all. Before
the load only what is cheap: an empty file (its size), a Parquet file's footer (its row count
and whether it is Parquet at all). A failure the reading cannot explain is raised as it came,
traceback and all: it may be a bug, not the file. Rows that lack a column the builder reads are
exactga.data.loader's check (see [checked rows] there), and the prompt dataset's own.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

Built = TypeVar("Built")

# ``datasets``' builders of local files, by ``source``; their loggers log a failure before
# raising it, which the message replaces.
LOCAL_SOURCES = ("json", "csv", "parquet", "text", "arrow")
# A file this small is read whole to see whether it holds only whitespace.
_SMALL_FILE_BYTES = 1 << 16


def read_data_files(build: Callable[[], Built], section: Any, key: str = "dataset") -> Built:
    """``build()``, a dataset builder reading the local files of config ``section`` (its
    ``source`` and ``data_files``), with a file it cannot read, or without rows, reported as
    one ``ValueError`` naming ``key``, the file and the fault. See [data file faults].

    Raises:
        ValueError: a file is empty, not valid in its format, or holds no rows.
    """
    source = _get(section, "source")
    files = local_data_files(source, _get(section, "data_files"))
    if not files:
        return build()
    for path in files:
        problem = _problem_before_loading(source, path)
        if problem is not None:
            raise ValueError(_message(key, path, problem))
    with _quiet_logger(f"datasets.packaged_modules.{source}.{source}"), _no_progress_bars():
        try:
            return build()
        except Exception as err:  # datasets' own, wrapped or not; a bare StopIteration too
            for path in files:
                problem = _problem_when_read(source, path)
                if problem is not None:
                    raise ValueError(_message(key, path, problem)) from err
            raise


def local_data_files(source: Any, data_files: Any) -> list[Path]:
    """The local files of ``data_files`` (a path, a list, or a mapping of splits to either)
    for a ``source`` of :data:`LOCAL_SOURCES`; globs and URLs are ``datasets``' to expand."""
    if source not in LOCAL_SOURCES or not data_files:
        return []
    if OmegaConf.is_config(data_files):
        data_files = OmegaConf.to_container(data_files, resolve=True)
    if isinstance(data_files, dict):
        data_files = [f for value in data_files.values() for f in _as_list(value)]
    return [
        Path(str(path))
        for path in _as_list(data_files)
        if "://" not in str(path)
        and not any(char in str(path) for char in "*?[")
        and Path(str(path)).is_file()  # a missing one is config validation's message
    ]


def _message(key: str, path: Path, problem: str) -> str:
    return (
        f"config key '{key}.data_files': {path} {problem}; fix the file or point data_files at "
        "another."
    )


def _get(section: Any, name: str) -> Any:
    return section.get(name) if hasattr(section, "get") else None


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]


def _problem_before_loading(source: str, path: Path) -> str | None:
    """What a glance shows: an empty file, or a Parquet file without rows or not Parquet."""
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    if source == "parquet":
        return _parquet_problem(path)
    small_text = source in ("json", "csv", "text") and size <= _SMALL_FILE_BYTES
    if small_text and not path.read_bytes().strip():
        return "holds only whitespace, no rows"
    return None


def _parquet_problem(path: Path) -> str | None:
    import pyarrow
    import pyarrow.parquet

    try:
        metadata = pyarrow.parquet.read_metadata(path)
    except (pyarrow.ArrowException, OSError) as err:
        return f"is not a Parquet file ({_first_line(err)})"
    return "holds no rows" if metadata.num_rows == 0 else None


def _problem_when_read(source: str, path: Path) -> str | None:
    """What is wrong with a file ``datasets`` failed on, read whole; None if nothing is."""
    if source not in ("json", "csv", "text"):
        return None  # binary: Parquet's footer was read before the load; Arrow is not read
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        return f"is not UTF-8 text (byte {err.start}: {err.reason})"
    if not text.strip():
        return "holds only whitespace, no rows"
    if source == "json":
        return _json_problem(text)
    if source == "csv":
        return _csv_problem(text)
    return None


def _json_problem(text: str) -> str | None:
    """The first error of a JSON document (``[...]`` or one object), else of JSON Lines."""
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            return f"is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
        if not rows:
            return "holds no rows (an empty JSON list)"
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if bad is not None:
            return f"is a JSON list whose item {bad} (0-based) is not an object (a row)"
        return None
    with contextlib.suppress(json.JSONDecodeError):
        json.loads(text)
        return None  # one object: one row, or the document a builder's ``field`` names
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return (
                f"is not valid JSON Lines (line {number}, column {err.colno}: {err.msg}; each "
                "line must be one JSON object)"
            )
        if not isinstance(row, dict):
            return f"is not valid JSON Lines (line {number} is not a JSON object, a row)"
    return None


def _csv_problem(text: str) -> str | None:
    """No header, no rows, or the first row with more fields than the header."""
    rows = csv.reader(io.StringIO(text))
    header = next(rows, None)
    if not header:
        return "has no header line"
    num_rows = 0
    try:
        for row in rows:
            num_rows += 1
            if len(row) > len(header):
                return (
                    f"is not valid CSV (line {rows.line_num}: {len(row)} fields, the header "
                    f"has {len(header)})"
                )
    except csv.Error as err:
        return f"is not valid CSV (line {rows.line_num}: {err})"
    return "holds a header and no rows" if num_rows == 0 else None


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Without ``datasets``' progress bars ("Generating train split: 100 examples", and the
    builders' "Map" or "Filter"): on a local file they pass in a blink and tell the user nothing
    to act on, and under torchrun each rank prints them. Not when the user asked for them
    (``HF_DATASETS_DISABLE_PROGRESS_BARS=0``); the switch is back as it was afterwards."""
    from datasets import config as datasets_config
    from datasets.utils.tqdm import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    if are_progress_bars_disabled() or datasets_config.HF_DATASETS_DISABLE_PROGRESS_BARS is False:
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """``datasets``' builder logs its failure before raising it, which the message replaces."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
