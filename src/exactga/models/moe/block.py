"""A mixture-of-experts MLP block, and how a training step reads its router statistics.

:class:`MoEBlock` takes the place of a transformer layer's MLP (``layer.mlp``): the router
picks ``top_k`` experts per token, :class:`~exactga.models.moe.experts.GroupedExperts` runs
them, and an optional shared expert (an MLP every token goes through, as DeepSeek's and Qwen2
MoE's) is added. No token is dropped.

Recording (off by default, so inference and evaluation pay nothing): inside
:func:`recording_router_stats`, each block keeps the
:class:`~exactga.models.moe.router.RouterStats` of its last forward in ``last_router_stats``,
over the tokens of the mask given there::

    with recording_router_stats(model, token_mask=tokens != pad_id) as blocks:
        logits = model(tokens)
    stats = [block.last_router_stats for block in blocks]  # one per MoE layer, in order

The mask travels by context rather than as a forward argument because torchtune's
``TransformerDecoder`` and ``TransformerSelfAttentionLayer`` pass nothing of the kind to the
MLP, and a context leaves their signatures (and every recipe's forward call) as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from exactga.models.moe.experts import GroupedExperts
from exactga.models.moe.router import RouterStats, TopKRouter, router_stats


class MoEBlock(nn.Module):
    """Routed experts plus an optional shared expert, on ``[batch, seq, dim]`` tokens.

    Args:
        router: picks each token's experts and their weights.
        experts: the routed experts.
        shared_expert: an MLP every token goes through, its output added (``None``: none, as
            Qwen3 MoE).

    Attributes:
        last_router_stats: the statistics of the last forward inside
            :func:`recording_router_stats`; ``None`` otherwise.
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: GroupedExperts,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if router.num_experts != experts.num_experts:
            raise ValueError(
                f"the router routes to {router.num_experts} experts, but there are "
                f"{experts.num_experts}"
            )
        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.record_router_stats = False
        self.keep_router_logits = False
        self.token_mask: torch.Tensor | None = None
        self.last_router_stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x`` (``[batch, seq, dim]``), same shape."""
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        routing = self.router(tokens)
        output = self.experts(tokens, routing.expert_indices, routing.expert_weights)
        if self.shared_expert is not None:
            output = output + self.shared_expert(tokens)
        if self.record_router_stats:
            self.last_router_stats = router_stats(
                routing, self._flat_token_mask(batch, seq), keep_logits=self.keep_router_logits
            )
        return output.view(batch, seq, dim)

    def _flat_token_mask(self, batch: int, seq: int) -> torch.Tensor | None:
        if self.token_mask is None:
            return None
        if tuple(self.token_mask.shape) != (batch, seq):
            raise ValueError(
                f"recording_router_stats(token_mask=...) has shape "
                f"{tuple(self.token_mask.shape)}, but the tokens are [{batch}, {seq}]"
            )
        return self.token_mask.reshape(-1).to(torch.bool)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks in registration order (layer order for torchtune's decoder)."""
    return [module for module in model.modules() if isinstance(module, MoEBlock)]


@contextmanager
def recording_router_stats(
    model: nn.Module, token_mask: torch.Tensor | None = None, *, keep_logits: bool = False
) -> Iterator[list[MoEBlock]]:
    """Record every MoE block's :class:`RouterStats` for the forwards inside the context.

    Args:
        model: a model with :class:`MoEBlock` layers.
        token_mask: ``[batch, seq]``, true for the tokens to count (the non-padding ones: see
            [router statistics are sums] in exactga.models.moe.router); ``None`` counts all.
        keep_logits: also keep each layer's router logits of the counted tokens.

    Yields:
        The blocks (see :func:`moe_blocks`); after each forward, each block's
        ``last_router_stats``. They stay readable after the context; recording stops.

    The loss terms' fields keep their autograd graph, so a loss built from them inside or after
    the context trains the router.
    """
    blocks = moe_blocks(model)
    for block in blocks:
        block.record_router_stats, block.keep_router_logits = True, keep_logits
        block.token_mask, block.last_router_stats = token_mask, None
    try:
        yield blocks
    finally:
        for block in blocks:
            block.record_router_stats, block.keep_router_logits = False, False
            block.token_mask = None


# Note [router recording under activation checkpointing]
# Activation checkpointing runs a layer's forward again inside the backward, after
# recording_router_stats has exited. A block that recorded in the forward but not in the
# recomputation saves fewer tensors (torch raises CheckpointError), and one that recorded with
# another token mask would give the balance term the gradient of other tokens. So the
# checkpoint's context_fn snapshots every block's recording settings when the layer's forward
# runs and the recomputation runs under that snapshot; afterwards each block gets back its
# settings and its last_router_stats (which the recomputation would otherwise overwrite).

_RecordingState = tuple[bool, bool, "torch.Tensor | None", "RouterStats | None"]


def _recording_state(block: MoEBlock) -> _RecordingState:
    return (
        block.record_router_stats,
        block.keep_router_logits,
        block.token_mask,
        block.last_router_stats,
    )


def _set_recording_state(block: MoEBlock, state: _RecordingState) -> None:
    (
        block.record_router_stats,
        block.keep_router_logits,
        block.token_mask,
        block.last_router_stats,
    ) = state


@contextmanager
def _replaying(blocks: list[MoEBlock], snapshot: list[_RecordingState]) -> Iterator[None]:
    """The recomputation under the forward's recording settings; see the Note above."""
    current = [_recording_state(block) for block in blocks]
    for block, state in zip(blocks, snapshot, strict=True):
        _set_recording_state(block, state)
    try:
        yield
    finally:
        for block, state in zip(blocks, current, strict=True):
            _set_recording_state(block, state)


def router_recording_context_fn(
    model: nn.Module,
) -> Callable[[], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]]:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) on ``model``'s layers: the
    recomputation records as the forward did; see [router recording under activation
    checkpointing]."""
    blocks = moe_blocks(model)

    def context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        snapshot = [_recording_state(block) for block in blocks]
        return contextlib.nullcontext(), _replaying(blocks, snapshot)

    return context_fn
