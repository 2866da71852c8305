"""The optimizer a recipe steps, inside backward or after it, behind one interface.

:func:`build_optimizer` returns the config's optimizer, or with ``optimizer_in_bwd`` an
:class:`OptimizerInBackward` holding one optimizer per parameter. Both are a
``torch.optim.Optimizer`` to the recipe: the same loop, checkpoints and learning-rate scheduler
serve either, and no recipe branches on the key. See [optimizer in backward].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.optim import Optimizer
from torchtune import config, training

# Note [optimizer in backward]
# With ``optimizer_in_bwd`` every parameter has an optimizer of its own, which a
# post-accumulate-grad hook steps, and whose gradient it frees, as soon as backward has
# written that gradient: the full set of gradients never exists, which saves their memory.
# It stays exact because each micro-batch's loss is scaled before backward (see [loss scaled
# before backward] in exactga.accumulation.normalization): the gradient a hook sees is already the
# window's. That holds for a window of one micro-batch only, and leaves no gradients to clip or
# to scale afterwards, so ``exactga.config.schemas`` refuses the key with
# ``gradient_accumulation_steps`` > 1, with ``clip_grad_norm`` and with the baseline
# normalisations (which scale gradients after backward).
# ``OptimizerInBackward`` gives the per-parameter optimizers the optimizer's interface
# (torchtitan's ``OptimizersInBackwardContainer`` is the model):
# - ``step()`` and ``zero_grad()`` do nothing: the hooks did both inside backward.
#   ``train_window`` still calls ``step()`` (so a learning-rate scheduler sees the optimizer
#   step before it does), and nothing after backward touches the gradients.
# - ``param_groups`` are the per-parameter optimizers' own groups, so a learning-rate
#   scheduler built on it sets every parameter's lr, its first lr included. torchtune's
#   ``OptimizerInBackwardWrapper`` drove the first parameter's optimizer and copied its lr to
#   the others only from the scheduler's next step on, so without a fix the first step
#   trained all but one parameter at the config's lr rather than the warm-up's first.
# - ``state_dict()`` is ``{parameter name: its optimizer's state dict}``, the format of
#   torchtune's wrapper, and ``optim_map`` the wrapper's attribute that torchtune's
#   ``CheckpointClient`` reads; checkpoints written before this class load unchanged. Those
#   carry the scheduler's ``initial_lr`` in the first parameter's groups only (the scheduler
#   was built on that optimizer), so loading copies it to the others, or a resumed scheduler
#   would find none there.


class OptimizerInBackward(Optimizer):
    """One optimizer per parameter of ``model``, each stepped by a hook inside backward, with
    the interface of one optimizer over all of them. See [optimizer in backward].

    It subclasses ``Optimizer`` for its interface and so that torch's learning-rate schedulers
    take it (they check the type); it does not call ``Optimizer.__init__``, since it holds no
    parameters or state of its own.

    Args:
        model: the model; every parameter gets an optimizer, those that require a gradient a
            hook (as torchtune's ``register_optim_in_bwd_hooks``).
        make_optimizer: builds the optimizer of a list of parameters (one parameter here).
    """

    def __init__(
        self, model: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], Optimizer]
    ) -> None:
        optim_dict = {param: make_optimizer([param]) for param in model.parameters()}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
        # By parameter name, in the model's order: the keys of the saved state.
        self.optim_map: dict[str, Optimizer] = {
            name: optim_dict[param] for name, param in model.named_parameters()
        }

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every per-parameter optimizer's groups, read anew each time (loading a state
        replaces an optimizer's groups)."""
        return [group for opt in self.optim_map.values() for group in opt.param_groups]

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Nothing to do: each parameter's optimizer stepped inside backward."""
        assert closure is None, "an optimizer in backward takes no closure"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each hook freed its gradient after stepping."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{parameter name: its optimizer's state dict}`` (torchtune's format)."""
        return {name: opt.state_dict() for name, opt in self.optim_map.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict`, this class's or torchtune's wrapper's.

        Raises:
            RuntimeError: ``state_dict`` names a parameter the model lacks, or lacks one.
        """
        _check_names(self, state_dict.keys())
        for name, state in state_dict.items():
            self.optim_map[name].load_state_dict(state)
        share_initial_lr(self)

    def __repr__(self) -> str:
        first = next(iter(self.optim_map.values()), None)
        return f"{type(self).__name__}({len(self.optim_map)} x {type(first).__name__})"


def build_optimizer(
    cfg_optimizer: DictConfig,
    model: nn.Module,
    *,
    in_backward: bool = False,
    state: Mapping[str, Any] | None = None,
    sharded: bool = False,
    device: torch.device | None = None,
) -> Optimizer:
    """The config's optimizer over all of ``model``'s parameters (as stock passes them: frozen
    ones never get a gradient); with ``in_backward`` (``optimizer_in_bwd``) one per parameter,
    stepped inside backward, behind the same interface (see [optimizer in backward]). With
    ``state`` (a resume) its state is loaded: a full state sharded into an FSDP2 ``model``'s
    optimizer on ``device`` when ``sharded`` (every rank calls this)."""
    if in_backward:
        optimizer = OptimizerInBackward(
            model, lambda params: config.instantiate(cfg_optimizer, params)
        )
    else:
        optimizer = config.instantiate(cfg_optimizer, model.parameters())
    if state and sharded:
        assert device is not None, "a sharded optimizer's state is loaded onto a device"
        load_full_optimizer_state(model, optimizer, state, device)
    elif state:
        optimizer.load_state_dict(state)
    return optimizer


def steps_in_backward(optimizer: Optimizer | None) -> bool:
    """Whether ``optimizer`` has already stepped when backward returns."""
    return isinstance(optimizer, OptimizerInBackward)


def load_full_optimizer_state(
    model: nn.Module, optimizer: Optimizer, state: Mapping[str, Any], device: torch.device
) -> None:
    """Shard a full optimizer state (a one-device run's, or torchtune's epoch checkpoint's)
    into ``optimizer``; every rank calls this.
    torchtune's ``load_from_full_optimizer_state_dict``, also for an
    :class:`OptimizerInBackward`."""
    if not isinstance(optimizer, OptimizerInBackward):
        training.load_from_full_optimizer_state_dict(model, optimizer, state, device)
        return
    _check_names(optimizer, state.keys())
    for name, param_state in state.items():
        training.load_from_full_optimizer_state_dict(
            model, optimizer.optim_map[name], param_state, device
        )
    share_initial_lr(optimizer)


def _check_names(optimizer: OptimizerInBackward, names: Iterable[str]) -> None:
    names = set(names)
    if unexpected := sorted(names - optimizer.optim_map.keys()):
        raise RuntimeError(f"optimizer state for parameters the model lacks: {unexpected}")
    if missing := sorted(optimizer.optim_map.keys() - names):
        raise RuntimeError(f"no optimizer state for parameters {missing}")


def share_initial_lr(optimizer: OptimizerInBackward) -> None:
    """Give every group the ``initial_lr`` some group has; see [optimizer in backward]."""
    groups = optimizer.param_groups
    initial_lr = next((g["initial_lr"] for g in groups if "initial_lr" in g), None)
    if initial_lr is not None:
        for group in groups:
            group.setdefault("initial_lr", initial_lr)
