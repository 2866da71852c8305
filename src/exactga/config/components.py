"""Every ``_component_`` section's keys, checked against what its component takes, at start-up.

torchtune calls a section's component with the section's keys as keyword arguments only when
the recipe builds it, after the output folder has its first files (``resolved_config.yaml``,
``base_model/``, a TensorBoard run); a misspelt key then ends in the component's own
``TypeError`` traceback. :func:`check_component_keys` finds each section of the config (a list,
``dataset`` or ``rewards``, included) and its nested sections, imports the component (its module
only: nothing is built, nothing downloaded) and reads its signature (a class's ``__init__``):

- a key it does not take fails naming the key, with the did-you-mean of the top level;
- a component that does not import fails naming ``<section>._component_``;
- an argument it needs that neither the section nor the recipe gives (see ``_SUPPLIED``) fails
  naming it; not for model sections, whose shape arguments may come from elsewhere, nor for
  nested sections, which the component builds itself.

A component that takes ``**kwargs`` takes any key, except torchtune's dataset builders' (and
exactga's) ``**load_dataset_kwargs``, which reach ``datasets.load_dataset``: they may be its
named parameters or the settings of the ``datasets`` builder that reads the ``source`` (``json``:
``field``; ``csv``: ``sep``, ...; for a Hub ``source`` the settings of any of ``datasets``'
file builders, since which one reads it is decided at download). A torchtune or exactga
component whose body never reads its ``**kwargs`` takes none (torchtune's ``DiskLogger`` would
drop ``log_dirr`` silently); a class that passes them to ``super().__init__`` takes its
parent's (exactga's ``FullModelHFCheckpointer``). A component of the user's own that takes
``**kwargs`` takes any key.

Sections a schema types itself (``profiler``, ``parity``) and those a schema names in
``checks_own_components`` (GRPO's ``loss``, whose stock names do not import) are not read here.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

# What a recipe gives a top-level section's component besides the section's keys: how many
# leading positional arguments, and which keywords (see each ``config.instantiate`` call).
_SUPPLIED: dict[str, tuple[int, tuple[str, ...]]] = {
    "optimizer": (1, ()),  # the parameters
    "lr_scheduler": (1, ("num_training_steps", "last_epoch")),  # the optimizer first
    "dataset": (1, ()),  # the tokenizer
    "dataset_val": (1, ()),
    "tokenizer": (0, ()),
    "loss": (0, ()),
    "kd_loss": (0, ()),
    "metric_logger": (0, ()),
    "quantizer": (0, ()),
    "tensor_parallel_plan": (0, ()),
}
# The sections a recipe passes ``should_load_recipe_state`` to: ``checkpointer``,
# ``ref_checkpointer``, ``teacher_checkpointer``, ``value_checkpointer``, ...
_CHECKPOINTER_KEYWORDS = ("should_load_recipe_state",)
# ``**kwargs`` by these names reach ``datasets.load_dataset``.
_LOAD_DATASET_KWARGS = ("load_dataset_kwargs",)
# Components whose ``**kwargs`` are another component's arguments, passed on unchanged.
_FORWARDED_TO = {
    "exactga.models.random_init_checkpointer.initialized_hf_checkpointer": (
        "exactga.models.checkpointer.FullModelHFCheckpointer"
    ),
    "exactga.dpo.kto.kto_dataset": "exactga.dpo.kto.KtoDataset",
}
_SHOWN_ARGUMENTS = 12
# Where a **kwargs the body never reads is a key dropped silently, not a choice.
_OWN_LIBRARIES = ("torchtune.", "exactga.")


def check_component_keys(cfg: DictConfig, skip: tuple[str, ...] = ()) -> None:
    """Every ``_component_`` section of ``cfg`` outside ``skip`` (top-level keys) takes its keys
    and is given every argument it needs; see the module's docstring.

    Raises:
        ValueError: naming the first key at fault (``optimizer.lrr``, ``dataset[1].source``).
    """
    for key in cfg:
        if key in skip or OmegaConf.is_interpolation(cfg, key):
            continue
        for path, section, top in _sections(cfg[key], str(key), str(key)):
            _check_section(path, section, top=top)


def _sections(node: Any, path: str, top: bool | str) -> Iterator[tuple[str, DictConfig, bool]]:
    """``(path, section, is a recipe's own section)`` for every component section in ``node``;
    interpolated values (``model: ${model}``) are checked where they are defined."""
    if isinstance(node, ListConfig):
        for index in range(len(node)):
            if not OmegaConf.is_interpolation(node, index):
                yield from _sections(node[index], f"{path}[{index}]", top)
        return
    if not isinstance(node, DictConfig):
        return
    if isinstance(node.get("_component_"), str):
        yield path, node, bool(top)
        top = False  # below a component: it builds what it nests itself
    for key in node:
        if key != "_component_" and not OmegaConf.is_interpolation(node, key):
            yield from _sections(node[key], f"{path}.{key}", top)


def _check_section(path: str, section: DictConfig, top: bool) -> None:
    name = str(section._component_)
    component = _import_component(f"{path}._component_", name)
    if component is None:
        return
    try:
        signature = inspect.signature(component)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to read
        return
    keys = [str(key) for key in section if key != "_component_"]
    accepted = _accepted_keys(component, signature, section)
    if accepted is not None:
        for key in keys:
            if key not in accepted:
                raise ValueError(_unknown_key_message(path, key, name, accepted))
    if top and not _is_model_section(path):
        _check_required(path, name, signature, keys)


def _import_component(key: str, name: str) -> Callable[..., Any] | None:
    """The object ``name`` names, found as torchtune finds it (a module's attribute, or an
    attribute's: ``module.Class.from_config``); None when its top package or a package its
    module needs is not installed, or its module fails on import (instantiation says why).

    Raises:
        ValueError: naming ``key``, for a path that names nothing, with the closest name.
    """
    from torchtune.config._errors import InstantiationError
    from torchtune.config._utils import _get_component_from_path

    if importlib.util.find_spec(name.split(".")[0]) is None:
        return None  # an optional package (bitsandbytes): instantiation names it
    try:
        return _get_component_from_path(name)
    except InstantiationError as err:
        cause = err.__cause__
        missing = isinstance(cause, ModuleNotFoundError) and cause.name
        if not isinstance(cause, AttributeError) and not (missing and name.startswith(missing)):
            return None  # a dependency of the module, or the module's own error
    except ValueError:
        pass  # an empty part: "torch..AdamW"
    raise ValueError(_unresolved_message(key, name))


def _unresolved_message(key: str, name: str) -> str:
    """Where ``name`` stops naming something, with the closest name there."""
    parts = name.split(".")
    try:
        found: Any = importlib.import_module(parts[0])
    except ImportError:
        return f"config key '{key}': no module '{parts[0]}' (from '{name}'); check the path."
    for index, part in enumerate(parts[1:], start=1):
        parent = ".".join(parts[:index])
        if hasattr(found, part):
            found = getattr(found, part)
            continue
        try:
            found = importlib.import_module(f"{parent}.{part}")
            continue
        except ImportError:
            pass
        names = [n for n in dir(found) if not n.startswith("_")]
        close = difflib.get_close_matches(part, names, n=1)
        hint = f" Did you mean '{parent}.{close[0]}'?" if close else ""
        return f"config key '{key}': {parent} has no '{part}'.{hint}"
    return f"config key '{key}': '{name}' names nothing importable; check the path."


def _accepted_keys(
    component: Callable[..., Any], signature: inspect.Signature, section: DictConfig
) -> set[str] | None:
    """The keys a component takes; None for any (``**kwargs`` that go elsewhere)."""
    named = {
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    var_keyword = [p for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]
    if not var_keyword or _ignores(component, var_keyword[0].name):
        return named  # torchtune's DiskLogger and TensorBoardLogger drop their **kwargs
    if var_keyword[0].name in _LOAD_DATASET_KWARGS:
        return named | _load_dataset_keys(section.get("source"))
    target = _forwarded_to(component, var_keyword[0].name)
    if target is None:
        return None
    passed_on = _accepted_keys(target, inspect.signature(target), section)
    return None if passed_on is None else named | passed_on


def _forwarded_to(component: Callable[..., Any], var_keyword: str) -> Callable[..., Any] | None:
    """What a component passes its ``**kwargs`` on to, where that is known: the parent class
    of a class whose ``__init__`` calls ``super().__init__(..., **kwargs)``, or see
    :data:`_FORWARDED_TO`."""
    name = f"{component.__module__}.{component.__qualname__}"
    if name in _FORWARDED_TO:
        module, _, attribute = _FORWARDED_TO[name].rpartition(".")
        return getattr(importlib.import_module(module), attribute)
    if inspect.isclass(component) and _passes_to_super(component, var_keyword):
        parents = [c for c in component.__mro__[1:] if "__init__" in vars(c)]
        return parents[0] if parents and parents[0] is not object else None
    return None


def _function_body(component: Callable[..., Any]) -> list[ast.stmt] | None:
    function = component.__init__ if inspect.isclass(component) else component
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None  # no source to read
    return tree.body[0].body if tree.body and hasattr(tree.body[0], "body") else None


@functools.cache
def _passes_to_super(component: type, var_keyword: str) -> bool:
    for statement in _function_body(component) or []:
        for node in ast.walk(statement):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__init__"
                and isinstance(node.func.value, ast.Call)
                and getattr(node.func.value.func, "id", None) == "super"
                and any(
                    k.arg is None and getattr(k.value, "id", None) == var_keyword
                    for k in node.keywords
                )
            ):
                return True
    return False


@functools.cache
def _ignores(component: Callable[..., Any], var_keyword: str) -> bool:
    """Whether ``component``, torchtune's or exactga's, never reads its ``**var_keyword`` in
    its body (a class's ``__init__``): then a key it gets there is dropped without a word. A
    component of the user's own that takes ``**kwargs`` and drops them means to."""
    if not str(component.__module__).startswith(_OWN_LIBRARIES):
        return False
    body = _function_body(component)
    if body is None:
        return False  # no source to read: count the keys as taken
    return not any(
        isinstance(node, ast.Name) and node.id == var_keyword
        for statement in body
        for node in ast.walk(statement)
    )


def _load_dataset_keys(source: Any) -> set[str]:
    """What ``datasets.load_dataset(source, **kwargs)`` takes: its named parameters and the
    settings of the builder that reads ``source`` (any file builder's for a Hub source)."""
    return _load_dataset_parameters() | _builder_settings(
        str(source) if source in _file_builders() else None
    )


@functools.cache
def _load_dataset_parameters() -> frozenset[str]:
    import datasets

    parameters = inspect.signature(datasets.load_dataset).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not p.VAR_KEYWORD) - {"path"}


@functools.cache
def _file_builders() -> dict[str, str]:
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return {name: module for name, (module, _) in _PACKAGED_DATASETS_MODULES.items()}


@functools.cache
def _builder_settings(source: str | None) -> frozenset[str]:
    """The fields of the ``BuilderConfig`` of ``datasets``' builder ``source`` (all of them
    for None); a builder whose optional dependency is missing counts none."""
    settings: set[str] = set()
    for name, module_name in _file_builders().items():
        if source is not None and name != source:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for value in vars(module).values():
            config = isinstance(value, type) and value.__name__.endswith("Config")
            if config and dataclasses.is_dataclass(value):
                settings.update(f.name for f in dataclasses.fields(value))
    return frozenset(settings)


def _unknown_key_message(path: str, key: str, name: str, accepted: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(accepted), n=1)
    if close:
        hint = f" Did you mean '{path}.{close[0]}'?"
    else:
        shown = sorted(accepted)[:_SHOWN_ARGUMENTS]
        more = len(accepted) - len(shown)
        hint = f" It takes {', '.join(shown)}{f' and {more} more' if more > 0 else ''}."
    return f"config key '{path}.{key}': not an argument of {name}.{hint}"


def _is_model_section(path: str) -> bool:
    """``model``, ``teacher_model``, ``policy_model``, ...: a builder's shape arguments may
    come from elsewhere (the checkpoint's folder), so only their names are checked."""
    return path.split("[")[0].endswith("model")


def _check_required(path: str, name: str, signature: inspect.Signature, keys: list[str]) -> None:
    top = path.split("[")[0]
    if top in _SUPPLIED:
        positional, keywords = _SUPPLIED[top]
    elif top.endswith("checkpointer"):
        positional, keywords = 0, _CHECKPOINTER_KEYWORDS
    else:
        return  # a section of the user's own recipe: what it passes is not known here
    parameters = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    parameters = [p for p in parameters if p.kind is not p.VAR_POSITIONAL]
    for index, parameter in enumerate(parameters):
        given_by_recipe = (
            index < positional and parameter.kind is not parameter.KEYWORD_ONLY
        ) or parameter.name in keywords
        needed = parameter.default is parameter.empty and not given_by_recipe
        if needed and parameter.name not in keys:
            raise ValueError(
                f"config key '{path}.{parameter.name}' is missing: {name} needs it "
                f"(add {path}.{parameter.name}=<value>)."
            )


__all__ = ["check_component_keys"]
