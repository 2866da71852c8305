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
import inspect
import io
import json
import logging
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

Built = TypeVar("Built")

# ``datasets``' builders of local files, by ``source``; their loggers log a failure before
# raising it, which the message replaces.
LOCAL_SOURCES = ("json", "csv", "parquet", "text", "arrow")
# A file this small is read whole to see whether it holds only whitespace.
_SMALL_FILE_BYTES = 1 << 16
# A CSV file's last bytes read for a last row cut off.
_TAIL_BYTES = 1 << 16


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


def check_data_files(cfg: Any) -> None:
    """Read every local data file the config's ``dataset`` sections name (one section or a
    list) as their builders will, before the run writes anything: a file that is empty, cut
    off, not valid in its format, or without rows fails here as one ``ValueError`` naming the
    key and the file (see [data files at start-up]).

    Raises:
        ValueError: as :func:`read_data_files`.
    """
    cfg_dataset = _get(cfg, "dataset")
    if cfg_dataset is None:
        return
    listed = OmegaConf.is_list(cfg_dataset)
    for index, section in enumerate(cfg_dataset if listed else [cfg_dataset]):
        key = f"dataset[{index}]" if listed else "dataset"
        files = local_data_files(_get(section, "source"), _get(section, "data_files"))
        if files and _passes_its_keys_to_load_dataset(section):
            read_data_files(partial(_load_as_the_builder_does, section), section, key)


def _passes_its_keys_to_load_dataset(section: Any) -> bool:
    """Whether the section's builder hands the keys it does not name to
    ``datasets.load_dataset`` (torchtune's ``**load_dataset_kwargs``, exactga's prompt dataset
    too); a builder of the user's own reads its files its own way, so only when it builds."""
    from torchtune.config._utils import _get_component_from_path

    component = _get(section, "_component_")
    if not isinstance(component, str):
        return False
    try:
        parameters = inspect.signature(_get_component_from_path(component)).parameters
    except Exception:  # not importable, or no signature: instantiation says what is wrong
        return False
    return "load_dataset_kwargs" in parameters and "source" in parameters


# Note [data files at start-up]
# A data file is read before the output folder gets its first file by ``datasets.load_dataset``
# called as the section's builder will call it (torchtune's builders and exactga's prompt
# dataset pass their ``**load_dataset_kwargs`` and ``split`` on unchanged), so a good file, of
# any size, is parsed once: ``datasets`` writes its Arrow cache here, and the builder's own call
# when the recipe builds the dataset finds it (a memory-mapped read, no second parse). A builder
# that calls ``load_dataset`` otherwise costs a second parse, never another result. Only where
# the load fails is the file read again, whole, to say where (see [data file faults]). A builder
# without ``**load_dataset_kwargs`` (the user's own) is not called this way: its files are
# checked when it builds (exactga.data.loader wraps every builder in read_data_files). A CSV row
# with fewer fields than the header reads as empty fields, so a CSV file cut off in a row
# passes the load: its last line is read from the end (a few kilobytes) before it.


def _load_as_the_builder_does(section: Any) -> Any:
    """``datasets.load_dataset`` with the arguments the section's builder gives it: the section's
    keys the builder does not name (its ``**load_dataset_kwargs``) and its ``split``."""
    import datasets
    from torchtune.config._utils import _get_component_from_path

    kwargs = OmegaConf.to_container(section, resolve=True)
    assert isinstance(kwargs, dict)
    builder = _get_component_from_path(kwargs.pop("_component_"))
    parameters = inspect.signature(builder).parameters
    load_kwargs = {k: v for k, v in kwargs.items() if k not in parameters}
    split = kwargs.get("split", parameters["split"].default if "split" in parameters else None)
    if split is not None:
        load_kwargs["split"] = split
    return datasets.load_dataset(kwargs["source"], **load_kwargs)


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
    if source == "csv":
        return _csv_cut_in_a_row(path, size)
    return None


def _csv_cut_in_a_row(path: Path, size: int) -> str | None:
    """A CSV file that ends without a newline in a row with fewer fields than its header: cut
    off (pandas would read the missing fields as empty). Reads the header and the last bytes."""
    with path.open("rb") as f:
        header = f.readline()
        f.seek(max(0, size - _TAIL_BYTES))
        tail = f.read()
    if tail.endswith((b"\n", b"\r")) or b"\n" not in tail or b'"' in tail:
        return None  # ends a line; or the last line is long, or quoted: left to the load
    last_line = tail.rsplit(b"\n", 1)[1]
    try:
        header_fields = next(csv.reader([header.decode("utf-8")]), [])
        last_fields = next(csv.reader([last_line.decode("utf-8")]), [])
    except (UnicodeDecodeError, csv.Error):
        return None  # the load names what is wrong
    if 0 < len(last_fields) < len(header_fields):
        return (
            f"ends in the middle of a row (its last line has {len(last_fields)} fields, the "
            f"header {len(header_fields)}; cut off?)"
        )
    return None


def _parquet_problem(path: Path) -> str | None:
    import pyarrow
    import pyarrow.parquet

    try:
        metadata = pyarrow.parquet.read_metadata(path)
    except (pyarrow.ArrowException, OSError) as err:
        return f"is not a Parquet file ({_first_line(err)})"
    return "holds no rows" if metadata.num_rows == 0 else None


def _parquet_body_problem(path: Path) -> str | None:
    """A Parquet file whose footer reads but whose data does not (a damaged page)."""
    import pyarrow
    import pyarrow.parquet

    try:
        pyarrow.parquet.read_table(path)
    except (pyarrow.ArrowException, OSError) as err:
        return f"is a damaged Parquet file ({_first_line(err)})"
    return None


def _problem_when_read(source: str, path: Path) -> str | None:
    """What is wrong with a file ``datasets`` failed on, read whole; None if nothing is."""
    if source == "parquet":
        return _parquet_body_problem(path)
    if source not in ("json", "csv", "text"):
        return None  # Arrow is not read
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
    """No header, no rows, a quote left open, or the first row with more fields than the
    header (pandas' "Error tokenizing data"), by the line its row starts on."""
    rows = csv.reader(io.StringIO(text), strict=True)  # strict: a quote left open is an error
    num_rows, row_start = 0, 1
    try:
        header = next(rows, None)
        if not header:
            return "has no header line"
        row_start = rows.line_num + 1
        for row in rows:
            num_rows += 1
            if len(row) > len(header):
                return (
                    f"is not valid CSV (the row on line {row_start}: {len(row)} fields, the "
                    f"header has {len(header)})"
                )
            row_start = rows.line_num + 1
    except csv.Error as err:
        return f"is not valid CSV (the row on line {row_start}: {err}; a quote left open?)"
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
