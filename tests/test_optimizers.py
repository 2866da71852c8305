"""Unit tier: ``optimizer_in_bwd`` behind the optimizer's interface
(``exactga.accumulation.optimizers``).

An ``OptimizerInBackward`` must train exactly what the optimizer it stands for trains, through
the same loop (``train_window``) and the same learning-rate scheduler, and its state must go to
a checkpoint and back, including the checkpoints torchtune's ``OptimizerInBackwardWrapper``
wrote before it existed. See [optimizer in backward] in ``exactga.accumulation.optimizers``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from grouping import GroupingNormalizer
from omegaconf import OmegaConf
from torch import nn
from torchtune import training
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup, get_lr
from unit_utils import make_rows, micro_batch_loss, split, tiny_model

from exactga.accumulation.optimizers import OptimizerInBackward, build_optimizer, steps_in_backward
from exactga.accumulation.step import train_window
from exactga.parity.scoring import relative_l2
from exactga.runtime.precision import Precision

CPU = torch.device("cpu")
ADAMW = OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 1e-2, "weight_decay": 0.01})
NUM_STEPS = 4
WARMUP = 2  # the first step's lr is 0, the case torchtune's wrapper got wrong


class NoProfiler:
    """What ``train_window`` asks of the profiler, doing nothing."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def sample_gradient_pass(self, model: nn.Module) -> None:
        pass


def windows() -> list:
    """``NUM_STEPS`` windows of one micro-batch of two rows (ga 1: what optimizer_in_bwd
    allows)."""
    rows = make_rows(0)
    return list(GroupingNormalizer(nn.CrossEntropyLoss(), 1).windows(split(rows, 2)))[:NUM_STEPS]


def training_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=ADAMW.lr, weight_decay=ADAMW.weight_decay)


def scheduler_on(optimizer: torch.optim.Optimizer, last_epoch: int = -1):
    return get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=WARMUP, num_training_steps=NUM_STEPS, last_epoch=last_epoch
    )


def train(model: nn.Module, optimizer, lr_scheduler, steps: list) -> list[float]:
    """The recipes' step: ``train_window``, then the scheduler; the lr of each step."""
    loss_fn = nn.CrossEntropyLoss()
    lrs = []
    for window in steps:
        lrs.append(lr_scheduler.get_last_lr()[0])
        outcome = train_window(
            window,
            model=model,
            loss_step=lambda batch: micro_batch_loss(model, loss_fn, batch),
            optimizer=optimizer,
            profiler=NoProfiler(),
            device=CPU,
            step=1,
        )
        assert not outcome.skipped and not outcome.nonfinite
        lr_scheduler.step()
    return lrs


def assert_same_weights(model: nn.Module, reference: nn.Module) -> None:
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(param, ref), name


def test_build_optimizer_returns_the_config_optimizer_or_one_per_parameter() -> None:
    model = tiny_model()
    plain = build_optimizer(ADAMW, model, in_backward=False)
    in_backward = build_optimizer(ADAMW, model, in_backward=True)
    assert type(plain) is torch.optim.AdamW and not steps_in_backward(plain)
    assert isinstance(in_backward, OptimizerInBackward) and steps_in_backward(in_backward)
    names = [name for name, _ in model.named_parameters()]  # the tied embedding once
    assert list(in_backward.optim_map) == names
    assert all(type(opt) is torch.optim.AdamW for opt in in_backward.optim_map.values())
    assert len(in_backward.param_groups) == len(names)


def test_a_step_in_backward_is_the_optimizer_step() -> None:
    """ga 1, AdamW under a warm-up and cosine schedule: the same lr at every step and the same
    weights after it, bit for bit, as the optimizer stepped after backward."""
    model, reference = tiny_model(), tiny_model()
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(ADAMW, model, in_backward=True)
    ref_optimizer = build_optimizer(ADAMW, reference, in_backward=False)
    optimizer.zero_grad()  # the recipes' call before training: a no-op here
    lr_scheduler, ref_scheduler = scheduler_on(optimizer), scheduler_on(ref_optimizer)
    lrs = []
    for window, ref_window in zip(windows(), windows(), strict=True):
        assert get_lr(optimizer) == get_lr(ref_optimizer)  # what the recipes log
        lrs += train(model, optimizer, lr_scheduler, [window])
        assert lrs[-1:] == train(reference, ref_optimizer, ref_scheduler, [ref_window])
        assert_same_weights(model, reference)
        # The hooks stepped and freed every gradient inside backward.
        assert all(p.grad is None for p in model.parameters())
    assert lrs[0] == 0.0 and min(lrs[1:]) > 0.0  # the warm-up's first lr, then the schedule's
    assert not any(torch.equal(p, p0) for p, p0 in zip(model.parameters(), initial, strict=True))


def test_the_scheduler_sets_every_parameters_lr_from_the_first_step_on() -> None:
    """A scheduler built on it drives every per-parameter optimizer, its first lr (0 under
    the warm-up) included; see [optimizer in backward]."""
    model = tiny_model()
    optimizer = build_optimizer(ADAMW, model, in_backward=True)
    lr_scheduler = scheduler_on(optimizer)
    assert lr_scheduler.get_last_lr()[0] == 0.0
    for _ in range(NUM_STEPS):
        expected = lr_scheduler.get_last_lr()[0]
        lrs = {g["lr"] for opt in optimizer.optim_map.values() for g in opt.param_groups}
        assert lrs == {expected}
        optimizer.step()  # a no-op, called as train_window calls it
        lr_scheduler.step()


def test_the_state_round_trips_and_training_goes_on_the_same() -> None:
    model, resumed_model = tiny_model(), tiny_model(seed=1)
    optimizer = build_optimizer(ADAMW, model, in_backward=True)
    lr_scheduler = scheduler_on(optimizer)
    first, rest = windows()[:2], windows()[2:]
    train(model, optimizer, lr_scheduler, first)
    state = copy.deepcopy(optimizer.state_dict())  # as from disk: no tensor shared
    assert list(state) == list(optimizer.optim_map)  # {parameter name: its optimizer's state}

    resumed_model.load_state_dict(model.state_dict())
    resumed = build_optimizer(ADAMW, resumed_model, in_backward=True)
    resumed.load_state_dict(state)
    _assert_same_state(resumed.state_dict(), state)
    resumed_scheduler = scheduler_on(resumed, last_epoch=len(first) - 1)

    lrs = train(model, optimizer, lr_scheduler, rest)
    assert train(resumed_model, resumed, resumed_scheduler, rest) == lrs
    assert_same_weights(resumed_model, model)


def test_a_checkpoint_of_torchtunes_wrapper_loads_and_resumes_the_same() -> None:
    """What the recipes saved before this class: torchtune's ``OptimizerInBackwardWrapper``
    state, written under a scheduler built on the first parameter's optimizer (so ``initial_lr``
    is in that optimizer's groups only). It loads, a scheduler resumes on it, and training goes
    on exactly as the old code went on."""
    old_model, model = tiny_model(), tiny_model(seed=1)
    optim_dict = {p: training_optimizer([p]) for p in old_model.parameters()}
    training.register_optim_in_bwd_hooks(model=old_model, optim_dict=optim_dict)
    wrapper = training.create_optim_in_bwd_wrapper(model=old_model, optim_dict=optim_dict)
    first_optimizer = next(iter(wrapper.optim_map.values()))
    old_scheduler = scheduler_on(first_optimizer)
    wrapper.set_lr_scheduler(old_scheduler)  # the old recipes, with their first-lr fix:
    for opt in wrapper.optim_map.values():
        opt.param_groups[0]["lr"] = old_scheduler.get_last_lr()[0]
    first, rest = windows()[:2], windows()[2:]
    train(old_model, None, old_scheduler, first)  # None: its hooks step, as train_window had it
    state = copy.deepcopy(wrapper.state_dict())
    assert sum("initial_lr" in s["param_groups"][0] for s in state.values()) == 1

    model.load_state_dict(old_model.state_dict())
    optimizer = build_optimizer(ADAMW, model, in_backward=True)
    optimizer.load_state_dict(state)
    lr_scheduler = scheduler_on(optimizer, last_epoch=len(first) - 1)  # needs every initial_lr

    train(old_model, None, old_scheduler, rest)
    train(model, optimizer, lr_scheduler, rest)
    assert_same_weights(model, old_model)


def test_a_state_for_another_model_is_refused_naming_the_parameters() -> None:
    optimizer = build_optimizer(ADAMW, tiny_model(), in_backward=True)
    state = optimizer.state_dict()
    name = next(iter(state))
    with pytest.raises(RuntimeError, match=f"no optimizer state for parameters.*{name}"):
        optimizer.load_state_dict({k: v for k, v in state.items() if k != name})
    with pytest.raises(RuntimeError, match="parameters the model lacks.*'extra'"):
        optimizer.load_state_dict({**state, "extra": state[name]})


def _assert_same_state(state: dict, expected: dict) -> None:
    assert state.keys() == expected.keys()
    for name, param_state in expected.items():
        assert state[name]["param_groups"] == param_state["param_groups"], name
        for key, value in param_state["state"][0].items():
            assert torch.equal(state[name]["state"][0][key], value), (name, key)


@pytest.mark.parametrize("in_backward", [False, True], ids=["optimizer", "in_backward"])
def test_a_sharded_step_checkpoints_state_resumes_training_the_same(tmp_path, in_backward) -> None:
    """A sharded run's step checkpoint (torch.distributed.checkpoint's files, here of one
    process) read into a fresh model and optimizer, either kind, the scheduler's
    ``initial_lr`` included: training goes on bit for bit. See [resharded resume] in
    exactga.run.resume."""
    import torch.distributed.checkpoint as dcp

    from exactga.checkpoints.contents import load_sharded_train_state, sharded_train_state

    model, resumed_model = tiny_model(), tiny_model(seed=1)
    optimizer = build_optimizer(ADAMW, model, in_backward=in_backward)
    lr_scheduler = scheduler_on(optimizer)
    first, rest = windows()[:2], windows()[2:]
    train(model, optimizer, lr_scheduler, first)
    dcp.save(sharded_train_state(model, optimizer), checkpoint_id=tmp_path, no_dist=True)

    resumed = build_optimizer(ADAMW, resumed_model, in_backward=in_backward)
    load_sharded_train_state(resumed_model, resumed, tmp_path)
    assert_same_weights(resumed_model, model)
    resumed_scheduler = scheduler_on(resumed, last_epoch=len(first) - 1)

    lrs = train(model, optimizer, lr_scheduler, rest)
    assert train(resumed_model, resumed, resumed_scheduler, rest) == lrs
    assert_same_weights(resumed_model, model)


# The fused optimizer: the config's ``optimizer.fused`` (the llama3_2 configs set it) goes to
# torch as written, since ``build_optimizer`` instantiates the section as it is; under
# ``master_weights: fp32`` the parameters themselves are fp32 (cast in place, no copy beside
# them: exactga.runtime.precision), so a fused AdamW steps them in fp32.
FUSED_ADAMW = OmegaConf.merge(ADAMW, {"fused": True})


@pytest.mark.parametrize("in_backward", [False, True])
def test_the_fused_key_reaches_torchs_optimizer(in_backward: bool) -> None:
    optimizer = build_optimizer(FUSED_ADAMW, tiny_model(), in_backward=in_backward)
    optimizers = optimizer.optim_map.values() if in_backward else [optimizer]
    assert all(opt.defaults["fused"] is True for opt in optimizers)


def test_fp32_master_weights_are_what_a_fused_adamw_steps() -> None:
    model = tiny_model(torch.bfloat16)
    Precision.from_config(torch.bfloat16, "fp32", CPU).cast_trainable(model)
    optimizer = build_optimizer(FUSED_ADAMW, model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in params} == {torch.float32}
    before = [p.detach().clone() for p in params]
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()  # torch's fused CPU kernel on the fp32 weights
    assert all(not torch.equal(p, p0) for p, p0 in zip(params, before, strict=True))


def test_a_fused_adamw_trains_as_the_foreach_one_to_the_fp32_floor() -> None:
    """The same windows and schedule: the fused kernel orders its arithmetic its own way, so
    the weights agree to rounding (2.7e-7 relative L2 after 4 steps, torch 2.13 on CPU), not
    bit for bit."""
    model, reference = tiny_model(), tiny_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    fused = build_optimizer(FUSED_ADAMW, model)
    foreach = build_optimizer(OmegaConf.merge(ADAMW, {"foreach": True}), reference)
    assert fused.defaults["fused"] and foreach.defaults["foreach"]
    lrs = train(model, fused, scheduler_on(fused), windows())
    assert lrs == train(reference, foreach, scheduler_on(foreach), windows())
    distance = relative_l2(model.state_dict(), reference.state_dict(), initial)
    print(f"fused vs foreach AdamW after {NUM_STEPS} steps: relative L2 {distance:.2e}")
    assert distance < 1e-6
