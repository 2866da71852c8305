"""Loading weights into a model, and saying plainly when they are another model's.

Also the one rule that turns a module's name into its state-dict key; see [state-dict keys].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def load_model_state(
    model: torch.nn.Module,
    state_dict: Mapping[str, Any],
    source: str,
    load: Callable[[torch.nn.Module, Mapping[str, Any]], Any] | None = None,
    strict: bool = True,
) -> Any:
    """Load ``state_dict`` into ``model``, or say plainly that it is another model's checkpoint.

    Args:
        model: the model built from the ``model`` config section.
        state_dict: weights read from ``source``.
        source: the file or config key the weights came from, for the message.
        load: how to load (e.g. torchtune's ``load_from_full_model_state_dict`` under FSDP);
            ``model.load_state_dict`` by default.
        strict: require the key sets to match exactly.
    """
    _check_shapes(model, state_dict, source)
    try:
        if load is not None:
            return load(model, state_dict)
        return model.load_state_dict(state_dict, strict=strict)
    except RuntimeError as err:
        # torchtune's and torch's messages list the missing and unexpected keys on later lines.
        detail = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        if len(detail) > 1500:
            detail = detail[:1500] + " ..."
        raise ValueError(
            f"{source} does not fit config key 'model' ({type(model).__name__}): {detail} "
            "Is the checkpoint for another model or size?"
        ) from err


# Note [state-dict keys]
# ``named_modules()`` names a module by the attribute path that reaches it, wrappers
# included: activation checkpointing puts every wrapped layer behind
# ``_checkpoint_wrapped_module.`` and ``torch.compile(module)`` behind ``_orig_mod.``. Those
# wrappers strip their prefix from ``state_dict()`` keys, and torchtune's sharded loading
# looks each full tensor up by state-dict key, so a name taken from ``named_modules()``
# finds nothing there under activation checkpointing (torchtune then fails with
# "'NoneType' object has no attribute 'dtype'"). Module names are therefore turned into
# state-dict keys by dropping the wrapper prefixes, and checked against the real keys.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def state_dict_name(module_name: str) -> str:
    """The state-dict key prefix of a module named ``module_name`` by ``named_modules()``.

    See [state-dict keys].
    """
    for prefix in _WRAPPER_PREFIXES:
        module_name = module_name.replace(prefix, "")
    return module_name


def state_dict_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The model's state-dict keys and the shapes of their tensors, without ``state_dict()``.

    Parameters and buffers are read instead: QLoRA's state-dict hook would dequantize every
    NF4 weight just to be looked at. DTensor shapes are global shapes. See [state-dict keys].
    """
    return {
        state_dict_name(name): tuple(tensor.shape)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }


def _check_shapes(model: torch.nn.Module, state_dict: Mapping[str, Any], source: str) -> None:
    """Name the first weight whose shape differs: the usual sign of another model's weights."""
    expected = state_dict_shapes(model)
    for key, value in state_dict.items():
        if key not in expected or not hasattr(value, "shape"):
            continue
        want = expected[key]
        if tuple(value.shape) != want:
            raise ValueError(
                f"{source} does not fit config key 'model': weight '{key}' has shape "
                f"{tuple(value.shape)} in the checkpoint and {want} in the model. Is the "
                "checkpoint for another model or size?"
            )
