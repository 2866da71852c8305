"""Strict recipe configs: torchtune's YAML and ``_component_`` sections, typed and closed.

A recipe declares its keys once, with their defaults, as a dataclass (see
:mod:`exactga.schemas`). :func:`validate_config` merges the user's config onto it in OmegaConf
struct mode, so a misspelt or unknown key fails at start-up with the key's name instead of being
silently ignored by ``cfg.get(key, default)``.
"""

from __future__ import annotations

import difflib
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError


def validate_config(cfg: DictConfig, schema: type, recipe_name: str) -> DictConfig:
    """Return ``cfg`` with the schema's defaults filled in, or raise naming the bad key.

    Raises:
        ValueError: a key the recipe does not know, a value of the wrong type, a required key
            left out, or a count below its minimum.
    """
    base = OmegaConf.structured(schema)
    OmegaConf.set_struct(base, True)
    _reject_unknown_keys(cfg, base, recipe_name)
    try:
        merged = OmegaConf.merge(base, cfg)
    except ValidationError as err:
        msg = str(err.msg).splitlines()[0]
        raise ValueError(f"config key '{err.full_key}': {msg}") from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ValueError(f"config for {recipe_name} is missing required keys: {', '.join(missing)}")
    _check_minimums(merged)
    # Sections are handed to torchtune, which may add keys (e.g. the profiler's _component_).
    OmegaConf.set_struct(merged, False)
    return merged


def _reject_unknown_keys(cfg: DictConfig, base: DictConfig, recipe_name: str) -> None:
    known = list(base.keys())
    for key in cfg:
        if key not in known:
            raise ValueError(f"unknown config key '{key}' for {recipe_name}.{_suggest(key, known)}")


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
    for key in ("max_steps_per_epoch", "save_every_n_steps"):
        steps = cfg.get(key)
        if steps is not None and steps < 1:
            raise ValueError(f"config key '{key}' must be null or at least 1, got {steps}.")


__all__ = ["validate_config", "ConfigKeyError"]
