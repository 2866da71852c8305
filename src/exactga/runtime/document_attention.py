"""Per-document attention for packed rows: each document's span attends causally within itself,
and the positions across documents, which a block-causal mask would only mask, are never
computed.

A packed row (exactga.data.packing) holds whole documents; a dense ``[b, s, s]`` block-causal
mask makes every layer compute all ``s * s`` scores and throw away those across documents, so
a row of documents of lengths ``l_i`` costs ``(sum l_i)^2`` where its documents need only
``sum l_i^2``. Where flex attention runs (CUDA) a ``BlockMask`` already skips the masked
blocks; elsewhere (a CPU, where flex attention has no backward) packed rows carry
:class:`DocumentLengths` instead of a mask, and attention runs on each document's span alone:
SDPA with ``is_causal`` for torchtune's ``MultiHeadAttention`` (Llama, Qwen2, Qwen3, Qwen3 MoE,
wrapped by :func:`accept_document_lengths` when a model is built), the window narrowed within
the span for Gemma 3's and gpt-oss's sliding layers, and gpt-oss's sink column per span
(exactga.models.gemma3._attention takes the lengths itself).

Note [packed rows under compile]
The per-document loop runs over Python integers: dynamo would specialise on them (a
recompilation for every new row) and cannot trace it as it stands, so it is left out of the graph
(``torch.compiler.disable``), which breaks each compiled layer's graph around its attention. Nor
can the lengths enter a compiled layer as they are: a tensor subclass is no input AOT autograd
takes. So once the model's layers are compiled (torchtune's ``compile_model`` compiles each
layer; ``compile: True``), the model turns a row's lengths into the dense block-causal mask
before its first layer (:func:`block_causal_mask`, tensor operations only: no host read): the
layers see one plain ``[b, s, s]`` mask of one shape, and each is one graph that never
recompiles for a new row. The mask computes the scores across documents and masks them, as
``DENSE_PACKED_MASK`` does (exact, the same tests): a compiled row pays a dense row's attention,
and docs/micro_batching.md measures what that costs against the eager loop.

Note [per-document attention is exact]
Under the block-causal mask a query's softmax runs over the keys of its own document up to
itself; on its span alone, causal, it runs over the same keys, so every output is the same sum
of the same terms, up to the kernels' floating-point rounding (fp32: a few ulps; the tests in
tests/test_document_attention.py compare logits and every gradient). The padding at a row's
end is one more document (exactga.data.packing), attended within itself as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchtune import config

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DocumentLengths(torch.Tensor):
    """A packed row's document lengths, ``[b, n_docs]`` integers summing to the row's length,
    passed as the model's ``mask``: each document attends causally within itself alone. A
    tensor, so it travels with the batch (``batch_to_device``) as a mask does."""

    @staticmethod
    def of(seq_lens: list[int]) -> DocumentLengths:
        """One row's lengths as ``[1, n_docs]``."""
        return torch.tensor([seq_lens], dtype=torch.long).as_subclass(DocumentLengths)


@torch.compiler.disable  # the spans are Python ints: traced, every row would recompile
def attend_per_document(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: DocumentLengths,
    attend: Attend,
) -> torch.Tensor:
    """``attend(q, k, v)`` on each document's span of each row (``[b, n_h, s, h_d]`` heads, keys
    as many as queries), the outputs joined along the sequence; ``attend`` attends causally
    within the span it is given. See [per-document attention is exact]."""
    if q.shape[2] != k.shape[2]:
        raise ValueError("per-document attention needs as many keys as queries (no KV-cache)")
    rows = []
    for r, row_lengths in enumerate(lengths.as_subclass(torch.Tensor).tolist()):
        if sum(row_lengths) != q.shape[2]:
            raise ValueError(f"document lengths {row_lengths} do not fill a row of {q.shape[2]}")
        spans, start = [], 0
        for length in row_lengths:
            at = (slice(r, r + 1), slice(None), slice(start, start + length))
            spans.append(attend(q[at], k[at], v[at]))
            start += length
        rows.append(torch.cat(spans, dim=2))
    return torch.cat(rows, dim=0)


AttentionCall = Callable[..., torch.Tensor]


def _with_document_lengths(attention_call: AttentionCall) -> AttentionCall:
    """torchtune's ``_attention_call(q, k, v, mask, dropout_p, is_causal)`` that runs per
    document when ``mask`` is :class:`DocumentLengths`, and as before on any other mask."""

    def call(q, k, v, mask, dropout_p, is_causal):
        if isinstance(mask, DocumentLengths):
            return attend_per_document(
                q,
                k,
                v,
                mask,
                lambda q, k, v: attention_call(
                    q, k, v, mask=None, dropout_p=dropout_p, is_causal=True
                ),
            )
        return attention_call(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

    call.accepts_document_lengths = True
    return call


def block_causal_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[b, s, s]`` booleans, True where position ``i`` may attend to ``j``: both in one
    document of the row's ``lengths`` (``[b, n_docs]``) and ``j <= i``; made on the lengths'
    device by tensor operations (torchtune's ``create_block_causal_mask`` reads them on the
    host)."""
    lengths = lengths.as_subclass(torch.Tensor)
    positions = torch.arange(seq_len, device=lengths.device)
    ends = lengths.cumsum(dim=-1)  # [b, n_docs]: the position after each document
    document = (positions[None, :, None] >= ends[:, None, :]).sum(dim=-1)  # [b, s]
    same_document = document[:, :, None] == document[:, None, :]
    return same_document & (positions[:, None] >= positions[None, :])


def _dense_mask_for_compiled_layers(model: nn.Module, args: tuple, kwargs: dict):
    """The model's forward pre-hook: a packed row's :class:`DocumentLengths` becomes its dense
    block-causal mask when the model's layers are compiled ([packed rows under compile])."""
    mask = kwargs.get("mask")
    if not isinstance(mask, DocumentLengths) or not _has_compiled_modules(model):
        return None
    tokens = kwargs["tokens"] if "tokens" in kwargs else args[0]
    return args, {**kwargs, "mask": block_causal_mask(mask, tokens.shape[1])}


def _has_compiled_modules(model: nn.Module) -> bool:
    """Whether ``nn.Module.compile`` has compiled any of ``model``'s modules (torchtune's
    ``compile_model`` compiles each layer, after the model is built)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def accept_document_lengths(model: nn.Module) -> nn.Module:
    """``model`` with every attention module that calls torchtune's ``_attention_call``
    (``MultiHeadAttention`` and its subclasses) taking :class:`DocumentLengths` for a mask,
    and the model turning them into a dense mask for compiled layers ([packed rows under
    compile]); once per module, however often it is called. Returns ``model``."""
    for module in model.modules():
        call = getattr(module, "_attention_call", None)
        if call is not None and not getattr(call, "accepts_document_lengths", False):
            module._attention_call = _with_document_lengths(call)
    if not getattr(model, "_dense_mask_for_compiled_layers", False):
        model.register_forward_pre_hook(_dense_mask_for_compiled_layers, with_kwargs=True)
        model._dense_mask_for_compiled_layers = True
    return model


def instantiate_model(cfg_model: Any) -> nn.Module:
    """The model of a ``model`` ``_component_`` section, its attention taking packed rows'
    :class:`DocumentLengths`: every place that builds a model builds it here, so none can
    forget the wrap and meet a packed row with a mask its attention cannot read."""
    return accept_document_lengths(config.instantiate(cfg_model))
