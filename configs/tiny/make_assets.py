"""Regenerate the tiny default data assets in ``configs/tiny/``.

Run from the repository root::

    python configs/tiny/make_assets.py

It writes two files next to this script:

* ``data.json`` -- an Alpaca-format instruction dataset (a JSON list of objects with
  ``instruction``, ``input`` and ``output`` strings) built from the docstrings of the Python
  standard library (PSF licence). Nothing is downloaded.
* ``tokenizer.model`` -- a 2000-piece SentencePiece BPE model trained on the text of
  ``data.json`` (unk=0, bos=1, eos=2, no pad piece, byte fallback on, Llama-2-style
  identity normalisation so text round-trips exactly).

The output is deterministic for a given Python version (docstrings change between CPython
releases) and ``sentencepiece`` version; the committed assets were made with CPython 3.11.7
and sentencepiece 0.2.x.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
DATA_PATH = HERE / "data.json"
TOKENIZER_PATH = HERE / "tokenizer.model"

VOCAB_SIZE = 2000
MIN_DOC_CHARS = 40
MAX_OUTPUT_CHARS = 1200
# Rows whose prompt alone overflows a 256-token window: the full docstring goes in ``input``
# and the answer is a one-sentence summary.
LONG_INPUT_MIN_CHARS = 1200
LONG_INPUT_MAX_CHARS = 4000

# Pure-Python or C stdlib modules that import without side effects on any platform.
_MODULE_NAMES = """
    abc argparse array ast asyncio base64 binascii bisect bz2 calendar cmath codecs codeop
    collections colorsys concurrent.futures configparser contextlib copy csv dataclasses
    datetime decimal difflib dis email.message email.utils enum filecmp fnmatch fractions
    ftplib functools gettext glob graphlib gzip hashlib heapq hmac html html.parser
    http.client http.cookies imaplib inspect io ipaddress itertools json keyword linecache
    logging lzma mailbox math mimetypes numbers operator os.path pathlib pickle
    plistlib pprint queue quopri random re reprlib sched secrets selectors shlex shutil
    smtplib socket sqlite3 statistics string struct subprocess tarfile tempfile textwrap
    threading time tokenize tomllib traceback types typing unicodedata urllib.parse
    urllib.request uuid warnings weakref xml.dom.minidom xml.etree.ElementTree zipfile zlib
    zoneinfo
"""
MODULES: tuple[str, ...] = tuple(_MODULE_NAMES.split())

FUNCTION_PROMPTS: tuple[str, ...] = (
    "Explain what the Python function `{name}` does.",
    "What does `{name}` do in Python?",
    "Describe the behaviour of `{name}` from the `{module}` module.",
    "I am reading code that calls `{name}`. What is it for?",
    "Write the documentation for the standard-library function `{name}`.",
)
CLASS_PROMPTS: tuple[str, ...] = (
    "Explain what the Python class `{name}` represents.",
    "Describe the purpose of the `{name}` class from the `{module}` module.",
    "What is `{name}` used for?",
    "Write a short documentation entry for the standard-library class `{name}`.",
)
SUMMARY_PROMPT = "Summarise the following documentation of `{name}` in one sentence."


@dataclass(frozen=True)
class DocEntry:
    """One documented standard-library object."""

    module: str
    name: str  # fully qualified, e.g. ``json.dumps`` or ``pathlib.Path.exists``
    is_class: bool
    signature: str
    doc: str  # cleaned docstring, paragraphs separated by blank lines


def stable_hash(text: str) -> int:
    """A process-independent hash (``hash()`` is salted per interpreter)."""
    return zlib.crc32(text.encode("utf-8"))


def clean_doc(raw: str) -> str:
    """Dedent a docstring and collapse whitespace inside each paragraph."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(raw))
    cleaned = (" ".join(p.split()) for p in paragraphs)
    return "\n\n".join(p for p in cleaned if p)


def cap_text(text: str, limit: int) -> str:
    """Keep whole paragraphs up to ``limit`` chars; cut an overlong first one at a word."""
    kept: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        extra = len(para) + (2 if kept else 0)
        if size + extra > limit:
            break
        kept.append(para)
        size += extra
    if kept:
        return "\n\n".join(kept)
    head = text[:limit]
    return head.rsplit(" ", 1)[0] if " " in head else head


def first_sentence(text: str) -> str:
    """The first sentence of the first paragraph."""
    para = text.split("\n\n", 1)[0]
    match = re.match(r"(.+?[.!?])(\s|$)", para)
    return match.group(1) if match else para


def signature_of(obj: object) -> str:
    """``name(params)`` if inspect can tell, else "", with memory addresses removed."""
    try:
        text = f"{obj.__name__}{inspect.signature(obj)}"  # type: ignore[attr-defined, arg-type]
    except (TypeError, ValueError, AttributeError):
        return ""
    # Default values like ``<object object at 0x7f...>`` would change on every run.
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def defined_in(obj: object, module: ModuleType) -> bool:
    """True if ``obj`` belongs to ``module`` (or its C accelerator ``_module``)."""
    owner = getattr(obj, "__module__", None)
    short = module.__name__.rsplit(".", 1)[-1]
    return owner in {module.__name__, f"_{short}"} or (
        module.__name__ == "os.path" and owner == "posixpath"
    )


def make_entry(module: str, qualname: str, obj: object) -> DocEntry | None:
    """A DocEntry for ``obj``, or None if it has no usable docstring."""
    raw = obj.__doc__ if isinstance(obj.__doc__, str) else None
    if not raw:
        return None
    doc = clean_doc(raw)
    if len(doc) < MIN_DOC_CHARS:
        return None
    return DocEntry(module, qualname, inspect.isclass(obj), signature_of(obj), doc)


def class_members(module: str, cls: type) -> list[DocEntry]:
    """Public methods defined directly on ``cls``."""
    entries = []
    for attr in sorted(vars(cls)):
        if attr.startswith("_"):
            continue
        member = vars(cls)[attr]
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isroutine(member) or isinstance(member, property):
            entry = make_entry(module, f"{module}.{cls.__name__}.{attr}", member)
            if entry is not None:
                entries.append(entry)
    return entries


def module_entries(name: str) -> list[DocEntry]:
    """Documented public functions, classes and methods of one module."""
    module = importlib.import_module(name)
    entries = []
    for attr in sorted(dir(module)):
        obj = getattr(module, attr)
        if attr.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
            continue
        if not defined_in(obj, module):
            continue
        entry = make_entry(name, f"{name}.{attr}", obj)
        if entry is not None:
            entries.append(entry)
        if inspect.isclass(obj):
            entries.extend(class_members(name, obj))
    return entries


def collect_entries() -> list[DocEntry]:
    """All entries, sorted by name, with repeated docstrings dropped."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entries = [e for m in MODULES for e in module_entries(m)]
    seen_names: set[str] = set()
    seen_docs: set[str] = set()
    unique = []
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.name in seen_names or entry.doc in seen_docs:
            continue
        seen_names.add(entry.name)
        seen_docs.add(entry.doc)
        unique.append(entry)
    return unique


def explain_row(entry: DocEntry) -> dict[str, str]:
    """A question about one object, answered with its (capped) docstring."""
    prompts = CLASS_PROMPTS if entry.is_class else FUNCTION_PROMPTS
    choice = stable_hash(entry.name)
    template = prompts[choice % len(prompts)]
    # Half the rows show the signature as input, half leave it empty.
    show_signature = (choice >> 8) % 2 == 0
    return {
        "instruction": template.format(name=entry.name, module=entry.module),
        "input": entry.signature if show_signature else "",
        "output": cap_text(entry.doc, MAX_OUTPUT_CHARS),
    }


def summary_row(entry: DocEntry) -> dict[str, str]:
    """A long docstring as input; a one-sentence summary as output."""
    return {
        "instruction": SUMMARY_PROMPT.format(name=entry.name),
        "input": cap_text(entry.doc, LONG_INPUT_MAX_CHARS),
        "output": first_sentence(entry.doc),
    }


def build_rows(entries: list[DocEntry]) -> list[dict[str, str]]:
    """Explain rows for every entry, plus summary rows for some of the longest docstrings."""
    rows = [explain_row(e) for e in entries]
    long_docs = [e for e in entries if len(e.doc) >= LONG_INPUT_MIN_CHARS]
    rows.extend(summary_row(e) for e in long_docs)
    return rows


def write_data(rows: list[dict[str, str]], path: Path) -> None:
    """Write the rows as pretty-printed UTF-8 JSON."""
    path.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def train_tokenizer(rows: list[dict[str, str]], path: Path) -> None:
    """Train a deterministic SentencePiece BPE model on every line of the dataset's text."""
    import sentencepiece as spm

    lines = [
        line
        for row in rows
        for field in ("instruction", "input", "output")
        for line in row[field].splitlines()
        if line.strip()
    ]
    # Train from an iterator into memory: a file-based run records its (temporary) input and
    # output paths in the model's trainer spec, which would make the bytes differ per run.
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        character_coverage=1.0,
        # Same text handling as the Llama 2 tokenizer: no normalisation, whitespace kept
        # as-is, digits split, and newlines/rare characters encoded as byte pieces.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        shuffle_input_sentence=False,
        num_threads=1,
        max_sentence_length=16384,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())


def main() -> None:
    """Regenerate ``data.json`` and ``tokenizer.model``."""
    rows = build_rows(collect_entries())
    write_data(rows, DATA_PATH)
    train_tokenizer(rows, TOKENIZER_PATH)
    print(f"wrote {len(rows)} rows to {DATA_PATH}")
    print(f"wrote {VOCAB_SIZE}-piece tokenizer to {TOKENIZER_PATH}")


if __name__ == "__main__":
    main()
