"""Strict recipe configs: torchtune's YAML and ``_component_`` sections, typed and closed.

A recipe declares its keys once, with their defaults, as a dataclass (see
:mod:`exactga.schemas`). :func:`validate_config` merges the user's config onto it in OmegaConf
struct mode, so a misspelt or unknown key fails at start-up with the key's name instead of being
silently ignored by ``cfg.get(key, default)``; then it checks the values that have a fixed set
of choices or a minimum, and the schema's flag combinations. All of it runs before the resolved
config is printed and before any model is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
import warnings
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError


def validate_config(
    cfg: DictConfig, schema: type, recipe_name: str, check_files: bool = False
) -> DictConfig:
    """Return ``cfg`` with the schema's defaults filled in, or raise naming the bad key.

    ``check_files`` (the recipes set it) also checks that the local files the config names
    exist; see :func:`check_input_files`.

    Raises:
        ValueError: a key the recipe does not know, a value of the wrong type or not among
            its choices, a required key left out, a count below its minimum, or settings
            that cannot work together (``schema.check_flags``), or with ``check_files`` a
            missing tokenizer or data file.
    """
    base = OmegaConf.structured(schema)
    OmegaConf.set_struct(base, True)
    cfg = _drop_accepted_unread_keys(cfg, schema, recipe_name)
    _reject_unknown_keys(cfg, base, recipe_name)
    try:
        merged = OmegaConf.merge(base, cfg)
    except ConfigKeyError as err:  # an unknown key inside a section with a schema
        section, _, key = err.full_key.rpartition(".")
        known = _section_keys(schema, section)
        raise ValueError(
            f"unknown config key '{err.full_key}' for {recipe_name}.{_suggest(key, known)}"
        ) from None
    except ValidationError as err:
        msg = str(err.msg).splitlines()[0]
        raise ValueError(f"config key '{err.full_key}': {msg}") from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ValueError(f"config for {recipe_name} is missing required keys: {', '.join(missing)}")
    _check_minimums(merged)
    _check_choices(merged, schema)
    if hasattr(schema, "check_flags"):
        schema.check_flags(merged)
    if check_files:
        check_input_files(merged)
    # Sections are handed to torchtune, which may add keys (e.g. the profiler's _component_).
    OmegaConf.set_struct(merged, False)
    return merged


def _reject_unknown_keys(cfg: DictConfig, base: DictConfig, recipe_name: str) -> None:
    known = list(base.keys())
    for key in cfg:
        if key not in known:
            raise ValueError(f"unknown config key '{key}' for {recipe_name}.{_suggest(key, known)}")


def _drop_accepted_unread_keys(cfg: DictConfig, schema: type, recipe_name: str) -> DictConfig:
    """Without the keys ``schema.accepts_unread_keys_of`` knows and ``schema`` does not read,
    named in one warning (from rank 0): a setting is never ignored silently."""
    others = getattr(schema, "accepts_unread_keys_of", ())
    if not others:
        return cfg
    own = {f.name for f in dataclasses.fields(schema)}
    accepted = {f.name for other in others for f in dataclasses.fields(other)} - own
    unread = [key for key in cfg if key in accepted]
    if not unread:
        return cfg
    if int(os.environ.get("RANK", "0")) == 0:
        warnings.warn(
            f"config keys ignored by {recipe_name}: {', '.join(sorted(unread))}.", stacklevel=3
        )
    return OmegaConf.masked_copy(cfg, [key for key in cfg if key not in accepted])


def _section_keys(schema: type, section: str) -> list[str]:
    """The keys of a schema's section (``profiler``, ``parity``), for suggestions."""
    hint = typing.get_type_hints(schema).get(section)
    for candidate in (hint, *typing.get_args(hint)):  # Optional[X] is Union[X, None]
        if dataclasses.is_dataclass(candidate):
            return [f.name for f in dataclasses.fields(candidate)]
    return []


def _suggest(key: Any, known: list[str]) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


# Counts that must be positive; a zero or negative value would train on nothing or loop forever.
_MINIMUMS = {
    "batch_size": 1,
    "gradient_accumulation_steps": 1,
    "epochs": 1,
    "log_every_n_steps": 1,
    "keep_last_n_checkpoints": 2,  # a damaged latest checkpoint needs one to fall back to
}


def _check_minimums(cfg: DictConfig) -> None:
    for key, minimum in _MINIMUMS.items():
        if key in cfg and cfg[key] < minimum:
            raise ValueError(f"config key '{key}' must be at least {minimum}, got {cfg[key]}.")
    for key in ("max_steps_per_epoch", "save_every_n_steps", "micro_batch_tokens"):
        steps = cfg.get(key)
        if steps is not None and steps < 1:
            raise ValueError(f"config key '{key}' must be null or at least 1, got {steps}.")


def _check_choices(cfg: DictConfig, schema: type, prefix: str = "") -> None:
    """Every field declared with ``choices`` (a list field: each item) holds one of them."""
    for f in dataclasses.fields(schema):
        value = cfg.get(f.name)
        choices = f.metadata.get("choices")
        if choices is not None:
            for item in value if OmegaConf.is_list(value) else [value]:
                if item not in choices:
                    raise ValueError(
                        f"config key '{prefix}{f.name}'={item!r}: choose one of "
                        f"{', '.join(choices)}."
                    )
        elif isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            _check_choices(value, f.default_factory, prefix=f"{prefix}{f.name}.")


__all__ = ["validate_config", "ConfigKeyError"]


# Dataset sources whose ``data_files`` are local files (Hugging Face ``load_dataset`` builders).
_LOCAL_SOURCES = ("json", "csv", "parquet", "text", "arrow")


def check_input_files(cfg: DictConfig) -> None:
    """Fail naming the config key when the tokenizer's or a local dataset's file is missing.

    Otherwise sentencepiece fails with ``NOT_FOUND`` and ``datasets`` with its own
    ``FileNotFoundError``, neither naming the key, and only after the config is printed and
    the model built. Relative paths resolve against the working directory, which the message
    names (the shipped tiny configs' paths work from the repository root).
    """
    tokenizer = cfg.get("tokenizer")
    if tokenizer is not None and tokenizer.get("path"):
        _check_file("tokenizer.path", tokenizer.path)
    sections = cfg.dataset if OmegaConf.is_list(cfg.dataset) else [cfg.dataset]
    for index, section in enumerate(sections):
        key = "dataset" if not OmegaConf.is_list(cfg.dataset) else f"dataset[{index}]"
        if section.get("source") not in _LOCAL_SOURCES or not section.get("data_files"):
            continue
        files = section.data_files
        if OmegaConf.is_dict(files):
            files = [f for value in files.values() for f in _as_list(value)]
        for path in _as_list(files):
            if not any(char in str(path) for char in "*?["):  # a glob: datasets expands it
                _check_file(f"{key}.data_files", path)


def _as_list(value: Any) -> list[Any]:
    return list(value) if OmegaConf.is_list(value) or isinstance(value, list) else [value]


def _check_file(key: str, path: Any) -> None:
    if "://" in str(path) or os.path.exists(str(path)):
        return
    where = (
        "" if os.path.isabs(str(path)) else f" (relative to the working directory {os.getcwd()})"
    )
    raise ValueError(
        f"config key '{key}': no file at '{path}'{where}. Fix the path, or launch from the "
        "folder it is relative to (the shipped tiny configs' paths work from the repository "
        "root)."
    )
