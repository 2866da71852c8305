"""Strict recipe configs: torchtune's YAML and ``_component_`` sections, typed and closed.

A recipe declares its keys once, with their defaults, as a dataclass (see
:mod:`exactga.config.schemas`). :func:`validate_config` merges the user's config onto it in
OmegaConf struct mode, so a misspelt or unknown key fails at start-up with the key's name instead
of being silently ignored by ``cfg.get(key, default)``; then it checks the values that have a fixed
set of choices or a minimum, and the schema's flag combinations. All of it runs before the resolved
config is printed and before any model is built.

A knob typed with an enum of :mod:`exactga.config.options` comes back as its member
(``cfg.loss_normalization is NormMode.EXACT``), so recipes hand it to the library as it is; a
value outside the enum fails here, in the one message style
(:func:`exactga.config.options.bad_value`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
import warnings
import zipfile
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from exactga.config.components import check_component_keys
from exactga.config.options import Option, as_option, bad_value


def validate_config(
    cfg: DictConfig, schema: type, recipe_name: str, check_files: bool = False
) -> DictConfig:
    """Return ``cfg`` with the schema's defaults filled in and its enum-typed knobs as members
    of their enum (see :mod:`exactga.config.options`), or raise naming the bad key.

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
    cfg = _nulled_sections(cfg, schema)
    _reject_unknown_keys(cfg, base, recipe_name)
    # Before the merge, which would reject a bad enum value in OmegaConf's words instead.
    _check_choices(cfg, schema)
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
    if hasattr(schema, "check_flags"):
        schema.check_flags(merged)
    check_component_keys(merged, skip=_sections_checked_elsewhere(schema))
    if check_files:
        check_input_files(merged)
    # Sections are handed to torchtune, which may add keys (e.g. the profiler's _component_).
    OmegaConf.set_struct(merged, False)
    return merged


Settings = TypeVar("Settings")

# Note [typed settings]
# A recipe validates its DictConfig once (``validate_config``), then reads the rest of the run
# from the schema's dataclass: ``typed_settings`` builds it from the validated config, each key
# once, with its one default from the schema. Below the recipe every reader takes these settings
# or a section of them (``ModelSettings.from_settings(settings, device)``, ...), never a
# DictConfig; the only configs that travel are the ``_component_`` sections (typed ``Any`` in
# the schemas), which stay DictConfig nodes of the validated config for ``config.instantiate``,
# interpolations and all. Sections with a schema of their own (``profiler``, ``parity``) are
# dataclasses too. torchtune's own code that takes a whole config (its ``CheckpointClient``, a
# metric logger's ``log_config``) gets the validated DictConfig from ``torchtune_config``.
# tests/test_typed_settings.py checks both halves.

_TORCHTUNE_CONFIG = "_torchtune_config"


def typed_settings(cfg: DictConfig, schema: type[Settings]) -> Settings:
    """The validated ``cfg`` as an instance of ``schema`` (see [typed settings]): scalars and
    enum members as they are, typed lists as lists, sections with a schema as their dataclass,
    and the ``Any`` fields (the ``_component_`` sections) as the validated config's nodes."""
    settings = schema(**_typed_values(cfg, schema))
    settings.__dict__[_TORCHTUNE_CONFIG] = cfg  # for torchtune's own code only
    return settings


def _typed_values(cfg: DictConfig, schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    values = {}
    for f in dataclasses.fields(schema):
        if not f.init:
            continue
        value = cfg[f.name]  # every field is there: the config was merged onto the schema
        section = _dataclass_of(hints[f.name])
        if section is not None and isinstance(value, DictConfig):
            value = section(**_typed_values(value, section))
        elif hints[f.name] is not Any and isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        values[f.name] = value
    return values


def torchtune_config(settings: Any) -> DictConfig:
    """The validated DictConfig that ``settings`` was read from, for torchtune's own code that
    takes a whole config (``CheckpointClient``, a metric logger's ``log_config``); exactga's
    readers take the settings (see [typed settings])."""
    return settings.__dict__[_TORCHTUNE_CONFIG]


def _sections_checked_elsewhere(schema: type) -> tuple[str, ...]:
    """The sections the schema types itself (``profiler``, ``parity``) or names in
    ``checks_own_components`` (GRPO's ``loss``): their keys are not a component's arguments."""
    hints = typing.get_type_hints(schema)
    typed = [f.name for f in dataclasses.fields(schema) if _dataclass_of(hints[f.name])]
    return (*typed, *getattr(schema, "checks_own_components", ()))


def _nulled_sections(cfg: DictConfig, schema: type) -> DictConfig:
    """``cfg`` with every optional section whose ``_component_`` is null set to null.

    torchtune's command line reads ``key=value`` on a section as ``key._component_=value``, so
    ``lr_scheduler=null`` leaves the section with a null component, which instantiation would
    fail on with a traceback: a user who wrote it meant no scheduler. A section the recipe needs
    (no null default) fails naming its key instead.

    Raises:
        ValueError: naming the key, for a required section with a null component.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(schema)}
    nulled = [
        key
        for key, value in cfg.items()
        if isinstance(value, DictConfig) and "_component_" in value and value._component_ is None
    ]
    if not nulled:
        return cfg
    cfg = cfg.copy()
    for key in nulled:
        if key in defaults and defaults[key] is None:
            cfg[key] = None
            continue
        raise ValueError(
            f"config key '{key}._component_' is null (from '{key}=null' on the command line?): "
            f"this recipe needs one; name its component, e.g. {key}._component_=<path>."
        )
    return cfg


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
    found = _dataclass_of(typing.get_type_hints(schema).get(section))
    return [] if found is None else [f.name for f in dataclasses.fields(found)]


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
        if cfg.get(key) is not None and cfg[key] < minimum:  # null where a schema allows it
            raise ValueError(f"config key '{key}' must be at least {minimum}, got {cfg[key]}.")
    for key in (
        "max_steps_per_epoch",
        "save_every_n_steps",
        "micro_batch_tokens",
        "pad_to_multiple_of",
        "run_val_every_n_steps",
        "batch_size_val",
        "max_val_batches",
    ):
        steps = cfg.get(key)
        if steps is not None and steps < 1:
            raise ValueError(f"config key '{key}' must be null or at least 1, got {steps}.")


def _check_choices(cfg: DictConfig, schema: type, prefix: str = "") -> None:
    """Every key of ``cfg`` the schema types with an enum of exactga.config.options, or declares
    with ``choices``, holds one of its values (a list: each item). Keys left out take the schema's
    default, which is one."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in cfg:
            continue
        value = cfg.get(f.name)
        option, nullable = _option_of(hints[f.name])
        if option is not None:
            for item in value if OmegaConf.is_list(value) else [value]:
                if not (item is None and nullable):
                    as_option(option, item, f"{prefix}{f.name}")
            continue
        choices = f.metadata.get("choices")
        if choices is not None:
            for item in value if OmegaConf.is_list(value) else [value]:
                if item not in choices:
                    raise bad_value(f"{prefix}{f.name}", item, choices)
            continue
        section = _dataclass_of(hints[f.name])
        if section is not None and isinstance(value, DictConfig):
            _check_choices(value, section, prefix=f"{prefix}{f.name}.")


def _option_of(hint: Any) -> tuple[type[Option] | None, bool]:
    """The enum a field's type names (``X``, ``Optional[X]``, ``list[X]``), and whether it may
    be null."""
    args = typing.get_args(hint)
    nullable = type(None) in args
    for candidate in (hint, *args, *(a for arg in args for a in typing.get_args(arg))):
        if isinstance(candidate, type) and issubclass(candidate, Option):
            return candidate, nullable
    return None, nullable


def _dataclass_of(hint: Any) -> type | None:
    for candidate in (hint, *typing.get_args(hint)):  # Optional[X] is Union[X, None]
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


__all__ = ["validate_config", "typed_settings", "torchtune_config", "ConfigKeyError"]


# Dataset sources whose ``data_files`` are local files (Hugging Face ``load_dataset`` builders).
_LOCAL_SOURCES = ("json", "csv", "parquet", "text", "arrow")


def check_input_files(cfg: DictConfig) -> None:
    """Fail naming the config key when a file the run reads is missing.

    The tokenizer, local dataset files, the checkpointer's weights (torchtune's own
    checkpointers; exactga's ``initialized_hf_checkpointer`` writes its own); whether there is
    something to resume from is ``exactga.run.resume.validate_run_config``'s check. Otherwise
    sentencepiece fails with
    ``NOT_FOUND``, ``datasets`` and torchtune's checkpointers with their own
    ``FileNotFoundError`` or ``ValueError``, none naming the key, and only after the config is
    printed. Relative paths resolve against the working directory, which the message names (the
    shipped tiny configs name their files as ``${exactga_file:...}``, which works from any
    folder; see exactga.launch.registry).
    """
    tokenizer = cfg.get("tokenizer")
    if tokenizer is not None and tokenizer.get("path"):
        _check_file("tokenizer.path", tokenizer.path)
    for name in ("dataset", "dataset_val"):  # the training set, and a validation set
        if cfg.get(name) is not None:
            _check_dataset_files(name, cfg[name])
    if cfg.get("checkpointer") is not None:
        _check_checkpointer_files(
            cfg.checkpointer, resuming=cfg.get("resume_from_checkpoint") is True
        )


def _check_dataset_files(name: str, cfg_dataset: Any) -> None:
    """The local data files of the dataset section ``name`` (or of each section of a list)."""
    sections = cfg_dataset if OmegaConf.is_list(cfg_dataset) else [cfg_dataset]
    for index, section in enumerate(sections):
        key = name if not OmegaConf.is_list(cfg_dataset) else f"{name}[{index}]"
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


def _relative_to(path: Any) -> str:
    """Where a relative path resolves, for messages; empty for an absolute one."""
    if os.path.isabs(str(path)):
        return ""
    return f" (relative to the working directory {os.getcwd()})"


def _check_file(key: str, path: Any) -> None:
    if "://" in str(path) or os.path.exists(str(path)):
        return
    where = _relative_to(path)
    raise ValueError(
        f"config key '{key}': no file at '{path}'{where}. Fix the path, or launch from the "
        "folder it is relative to (exactga's own files can be named from any folder as "
        "${exactga_file:configs/tiny/...}, as the shipped tiny configs do)."
    )


# torchtune's checkpointers that read ``checkpoint_files`` from ``checkpoint_dir``; the HF one
# also reads the model's ``config.json`` there.
_FILE_CHECKPOINTERS = (
    "FullModelHFCheckpointer",
    "FullModelMetaCheckpointer",
    "FullModelTorchTuneCheckpointer",
)


def _check_checkpointer_files(section: DictConfig, resuming: bool) -> None:
    """The checkpointer's folder and the weight files it names exist, and its output folder is
    not inside it (torchtune refuses that only once the config is printed, with a traceback).

    On a resume from torchtune's epoch checkpoint the weights come from ``output_dir`` instead,
    as torchtune decides; only the folder is checked then.
    """
    _check_model_type_is_readable(section)
    component = str(section.get("_component_", "")).rsplit(".", 1)[-1]
    if component == "initialized_hf_checkpointer":
        _check_written_initial_weights(section)
        return
    if component not in _FILE_CHECKPOINTERS:
        return  # the distributed one, or a user's own
    checkpoint_dir = str(section.get("checkpoint_dir"))
    if not os.path.isdir(checkpoint_dir):
        raise ValueError(
            f"config key 'checkpointer.checkpoint_dir': no folder at '{checkpoint_dir}'"
            f"{_relative_to(checkpoint_dir)}. It must hold the model's weights "
            "(checkpointer.checkpoint_files), as 'tune download <model> --output-dir <folder>' "
            "writes them."
        )
    output_dir = section.get("output_dir")
    if output_dir is not None:
        ckpt, out = os.path.realpath(checkpoint_dir), os.path.realpath(str(output_dir))
        if out == ckpt or out.startswith(ckpt + os.sep):
            raise ValueError(
                f"config keys 'checkpointer.output_dir' ({output_dir}) and "
                f"'checkpointer.checkpoint_dir' ({checkpoint_dir}): the output folder may not be "
                "the checkpoint folder or inside it; pick another output_dir."
            )
    if component == "FullModelHFCheckpointer" and not os.path.isfile(
        os.path.join(checkpoint_dir, "config.json")
    ):
        raise ValueError(
            f"config key 'checkpointer.checkpoint_dir': no config.json in '{checkpoint_dir}'"
            f"{_relative_to(checkpoint_dir)}, which FullModelHFCheckpointer reads the model's "
            "settings from. Point it at the model's whole Hugging Face folder."
        )
    files = section.get("checkpoint_files")
    if resuming or files is None:
        return
    if OmegaConf.is_dict(files):  # {filename_format, max_filename}: torchtune expands it
        from torchtune.training import FormattedCheckpointFiles

        try:
            names = FormattedCheckpointFiles.from_dict(dict(files)).build_checkpoint_filenames()
        except ValueError as err:
            raise ValueError(f"config key 'checkpointer.checkpoint_files': {err}") from None
    else:
        names = [str(name) for name in _as_list(files)]
    missing = [name for name in names if not os.path.isfile(os.path.join(checkpoint_dir, name))]
    for name in names:
        if name not in missing and name.endswith(".safetensors"):
            _check_safetensors_size(os.path.join(checkpoint_dir, name))
        elif name not in missing and name.endswith((".bin", ".pt", ".pth")):
            _check_torch_archive(os.path.join(checkpoint_dir, name))
    if missing:
        present = sorted(os.listdir(checkpoint_dir))
        shown = ", ".join(present[:6]) + (
            f" and {len(present) - 6} more" if len(present) > 6 else ""
        )
        raise ValueError(
            f"config key 'checkpointer.checkpoint_files': no file '{missing[0]}'"
            f"{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''} in "
            f"checkpointer.checkpoint_dir '{checkpoint_dir}'{_relative_to(checkpoint_dir)}; it "
            f"holds {shown or 'nothing'}."
        )


# The model types exactga's checkpointer adds (exactga.models.hf_format.FORMATS; a test keeps the
# two lists equal): torchtune 0.6.1's own checkpointers fail on them with a bare KeyError.
EXACTGA_MODEL_TYPES = ("QWEN3", "GEMMA3", "QWEN3_MOE", "GPT_OSS")


def _check_model_type_is_readable(section: DictConfig) -> None:
    component = str(section.get("_component_", ""))
    model_type = section.get("model_type")
    if component.startswith("torchtune.") and model_type in EXACTGA_MODEL_TYPES:
        raise ValueError(
            f"config key 'checkpointer.model_type'={model_type!r}: torchtune 0.6.1's "
            f"{component.rsplit('.', 1)[-1]} has no such model type. Set "
            "checkpointer._component_ to exactga.models.checkpointer.FullModelHFCheckpointer "
            "(the same arguments), which reads and writes it."
        )


def _check_torch_archive(path: str) -> None:
    """A ``torch.save`` file in the zip format (every one since torch 1.6) ends with the zip's
    central directory, so a copy cut short lacks it: found from the file's last bytes, without
    reading the weights. Older (pickle) files start otherwise and are left to torch."""
    with open(path, "rb") as f:
        is_zip = f.read(2) == b"PK"
    if is_zip and not zipfile.is_zipfile(path):
        raise ValueError(
            f"config key 'checkpointer.checkpoint_files': {path} ({os.path.getsize(path)} "
            "bytes) is a torch checkpoint without its end (truncated?). Download or copy it "
            "again."
        )


def _check_written_initial_weights(section: DictConfig) -> None:
    """exactga's ``initialized_hf_checkpointer`` writes its weights on first use; a later run
    reads them back, so a file cut short since (a full disk, a copy) is named here too."""
    checkpoint_dir = str(section.get("checkpoint_dir"))
    remedy = (
        f"Delete '{checkpoint_dir}' to have the initial weights written again (from "
        "checkpointer.init_seed), or copy it again."
    )
    for name in _as_list(section.get("checkpoint_files") or []):
        path = os.path.join(checkpoint_dir, str(name))
        if os.path.isfile(path) and path.endswith(".safetensors"):
            _check_safetensors_size(path, remedy)


def _check_safetensors_size(path: str, remedy: str = "Download or copy it again.") -> None:
    """A safetensors file holds at least what its header says: catches a download or copy cut
    short from the header alone (8 bytes, then JSON), without reading the weights."""
    size = os.path.getsize(path)
    needed = None
    try:
        with open(path, "rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
            if 0 < header_bytes <= size - 8:
                header = json.loads(f.read(header_bytes))
                ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
                needed = 8 + header_bytes + max(ends, default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        pass  # an unreadable header: needed stays None
    if needed is None:
        raise ValueError(
            f"config key 'checkpointer.checkpoint_files': {path} is not a readable safetensors "
            f"file (damaged, or not safetensors?). {remedy}"
        )
    if size < needed:
        raise ValueError(
            f"config key 'checkpointer.checkpoint_files': {path} has {size} bytes, its header "
            f"needs {needed} (truncated?). {remedy}"
        )
