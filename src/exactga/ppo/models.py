"""PPO's two trained models as one module: what the optimizer, the step and the checkpoints see."""

from __future__ import annotations

from torch import nn


class PolicyAndValue(nn.Module):
    """The policy and the value model, trained together (stock: one optimizer over the policy's
    parameters, then the value model's). Its state dict holds each under its part name, which
    step checkpoints store whole; an epoch checkpoint writes each part through its own
    checkpointer (``RunCheckpoints.parts``), as stock does. It is never called: the loss step
    runs each part itself."""

    def __init__(self, policy: nn.Module, value: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.value = value

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("PolicyAndValue holds two models; call .policy or .value")
