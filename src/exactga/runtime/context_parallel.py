"""A micro-batch under context parallelism (CP): every sequence of it sharded over the
``cp`` ranks of a device mesh, attention computed by torch's ring attention.

What is sharded, and in which order, is written here once, for both sides: the host's count
(``ContextParallelTokens`` in exactga.accumulation.loss_units, the normaliser's units: this
rank's loss tokens, the labels shifted before the sequence is cut) and the device's cut
(:func:`sharded_micro_batch`, around a micro-batch's forward and backward: torch's
``context_parallel``). Without a cp mesh both are the plain path, untouched.

Along the sequence (dim 1) three tensors are sharded: ``tokens``, ``input_pos`` (the positions
RoPE reads: a shard no longer starts at 0, so they are made explicit) and the labels *after* the
one-position shift (:data:`SHIFTED_LABELS`): shifted after the
cut, a chunk's last position would lose the label of the next chunk's first token. The order is
torch's head-tail load balance: the sequence cut in ``2 * cp`` equal chunks, rank ``r`` holding
chunks ``r`` and ``2 * cp - 1 - r``, so every rank has as much of the causal triangle's work.

What CP cannot do is refused before a micro-batch runs: a ``mask`` (packed rows' block-causal
masks, their :class:`~exactga.runtime.document_attention.DocumentLengths`, any custom mask;
ring attention is causal only), and a sequence length that is not a multiple of ``2 * cp``
(torch then silently drops the load balance). The output projection and its cross-entropy, tied
or chunked, fused or not, are per token: they run on each rank's shard as they are.
torch's ring attention has SDPA's flash, efficient and cuDNN kernels only: CUDA (on CPU, torch
2.13 raises "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered").

Note [loss tokens under context parallelism]
Each cp rank's loss is the mean over the loss tokens of its shard, ``L_r = (1/u_r) sum_{i in r}
l_i``, and ``u_r`` is what the rank counts on the host: the shifted labels of its shard
(``ContextParallelTokens`` in exactga.accumulation.loss_units). The shards partition the
micro-batch's positions, so summed over the cp ranks the counts give the micro-batch's count,
and summed over dp x cp ranks the window's: the same ``U`` as without CP. Counted over the
flattened dp x cp group, each rank is one more "data-parallel" rank of [loss units]
(exactga.accumulation.loss_units): scaled by ``dp * cp * u_r / U`` before backward and averaged
over dp x cp by the gradient reduction, the window's gradient is that of ``(1/U) sum_i l_i``
over every token of every rank, as without CP. A shard without a loss token (a prompt that
fills it) counts 0 and weighs exactly 0; its loss is kept finite by one label planted inside
the shard, as [empty micro-batches under FSDP] does for a micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel

Batch = dict[str, torch.Tensor]

SEQUENCE_DIM = 1
INPUT_POS = "input_pos"
# The labels shifted before the sequence is cut travel under this key (the loss step's
# ``pop_scored_labels`` in exactga.accumulation.loss_units takes them as they are).
SHIFTED_LABELS = "shifted_labels"
# What is cut along the sequence, in this order (torch's context manager reads the sequence
# length off the first).
SHARDED_KEYS = ("tokens", INPUT_POS, SHIFTED_LABELS)


def shard_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions of the full sequence that rank ``cp_rank`` of ``cp_size`` holds, in its
    order: torch's head-tail load balance (chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp``)."""
    check_sequence_length(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    tail = torch.arange(seq_len - (cp_rank + 1) * chunk, seq_len - cp_rank * chunk)
    return torch.cat((head, tail))


def shard(tensor: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``tensor``'s shard on rank ``cp_rank``, cut along the sequence (dim 1), as torch's
    ``context_parallel`` cuts a buffer."""
    positions = shard_positions(tensor.shape[SEQUENCE_DIM], cp_size, cp_rank)
    return tensor.index_select(SEQUENCE_DIM, positions.to(tensor.device))


def check_sequence_length(seq_len: int, cp_size: int) -> None:
    """Refuse a length torch's load balance cannot cut evenly (it would silently drop it)."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"context parallelism over {cp_size} ranks cuts each sequence in {2 * cp_size} "
            f"equal chunks, but a micro-batch has sequences of {seq_len} positions: pad them to "
            f"a multiple of {2 * cp_size}."
        )


def check_shardable(batch: Batch, cp_size: int) -> None:
    """Refuse a micro-batch ring attention cannot compute: one with a mask (packed rows'
    block-causal masks or document lengths, a custom mask); ring attention is causal only."""
    if batch.get("mask") is not None:
        raise ValueError(
            "context parallelism runs causal attention only: a micro-batch carries a 'mask' "
            "(packed rows' documents, or a custom mask). Turn packing off (dataset.packed: "
            "False) or context parallelism off (context_parallel_dim: 1)."
        )
    check_sequence_length(batch["tokens"].shape[SEQUENCE_DIM], cp_size)


def positions_of(tokens: torch.Tensor) -> torch.Tensor:
    """``0 .. s-1`` for every row of ``tokens``: what RoPE uses without ``input_pos``."""
    return torch.arange(tokens.shape[SEQUENCE_DIM]).expand(tokens.shape[0], -1).contiguous()


@contextlib.contextmanager
def sharded_micro_batch(cp_mesh: DeviceMesh | None, batch: Batch) -> Iterator[None]:
    """Around one micro-batch's forward and backward (the batch on the device): its sequences
    cut to this rank's shard, in place, and SDPA replaced by torch's ring attention over
    ``cp_mesh``; the full sequences are back afterwards. A no-op without a cp mesh (or with one
    rank). The batch must have been prepared by ``ContextParallelTokens``."""
    if cp_mesh is None or cp_mesh.size() == 1:
        if SHIFTED_LABELS in batch:  # its loss positions index a shard, not the sequence
            raise ValueError(
                "a micro-batch counted by its context-parallel shard runs without a cp mesh: "
                "pass the normaliser's mesh to the step (StepContext.cp_mesh) too."
            )
        yield
        return
    if SHIFTED_LABELS not in batch:
        raise ValueError(
            "a micro-batch under context parallelism was not counted by its shards: build the "
            "normaliser's units with exactga.accumulation.loss_units.context_parallel_units."
        )
    check_shardable(batch, cp_mesh.size())
    buffers = [batch[key] for key in SHARDED_KEYS]
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[SEQUENCE_DIM] * 3):
        yield
