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
Under ``torch.compile`` the per-document loop stays outside the graph (``torch.compiler.disable``:
its spans are Python integers, which traced would recompile every new row), so a compiled layer
breaks its graph around attention, once per layer; everything else in the layer is compiled, and
no row after the first few compiles anything new. The alternative, one graph per layer, is the
dense block-causal mask (``DENSE_PACKED_MASK``): flex attention has no backward on a CPU in
torch 2.13, so a mask is the only way attention enters a CPU graph, and it computes every score
across documents. Measured side by side (benchmarks/micro_batching.py, the tiny config, 8 x 8,
rows of 1024, inductor, 2026-11-29; docs/micro_batching.md "Compiled"): compiled with the loop
outside the graph, 0.95x the eager packed step time; compiled on one dense graph, 1.22x. The
breaks are the faster choice, so they stay. On CUDA packed rows carry flex attention's
``BlockMask``, which compiles into the layer's graph (see [flex attention inside a compiled
layer]).

Note [flex attention inside a compiled layer]
Flex attention is fast only compiled: uncompiled it computes every score of the row. torchtune
0.6.1 therefore compiles it on its own and hides the call from an enclosing compile
(``compile_friendly_flex_attention``, under ``torch.compiler.disable``), so with ``compile: True``
every layer of a packed row broke its graph around attention: two graphs and a return to Python
per layer, the host overhead compiling is meant to remove (flex attention's authors say as much
in pytorch/pytorch#149767). :func:`attend_flex` takes either road: while dynamo traces a layer
(``torch.compiler.is_compiling()``) it calls ``flex_attention`` itself, which enters the layer's
graph and is compiled with it; run eagerly it calls flex attention compiled on its own, as
torchtune does. A new row's ``BlockMask`` is a graph input like a tensor (its mask function's
captured document ids included), so a new row compiles nothing
(tests/test_document_attention.py: a layer of each attention that takes a ``BlockMask`` as one
graph, a second row of other documents without a recompilation). One break is left, under activation
checkpointing only: a sliding layer's window narrowed by ``create_block_mask`` (Gemma 3,
gpt-oss), which dynamo does not trace inside a checkpointed region.

Note [per-document attention is exact]
Under the block-causal mask a query's softmax runs over the keys of its own document up to
itself; on its span alone, causal, it runs over the same keys, so every output is the same sum
of the same terms, up to the kernels' floating-point rounding (fp32: a few ulps; the tests in
tests/test_document_attention.py compare logits and every gradient).

Note [padding is not attended]
The padding at a row's end (exactga.data.packing) is a span of negative length: its attention
output is zeros, where the dense mask attends it causally within itself. Nothing reads those
positions: no document attends them, their labels are ignored, the MoE router's statistics
leave out padding tokens, and a preference row's sequences leave them out. Everything a loss
or a gradient sees is the same, and the padding's own attention, up to a square of several
hundred positions on the last row of a window, is not computed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from torchtune import config

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def _flex_attention_compiled_alone() -> Callable:
    # Outside a compiled graph, as torchtune's flex_attention_compiled (dynamic=False: a packed
    # row has one shape).
    return torch.compile(flex_attention, dynamic=False)


def attend_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flex attention of ``[b, n_h, s, h_d]`` heads on ``block_mask``: inside the graph of a
    layer being compiled, or compiled on its own when run eagerly on CUDA (uncompiled
    elsewhere: a CPU runs flex attention's forward only). With ``return_lse`` also each row's
    log-sum-exp ``[b, n_h, s]`` (float32). See [flex attention inside a compiled layer]."""
    if torch.compiler.is_compiling():
        attend = flex_attention  # traced into the enclosing graph
    elif q.is_cuda:
        attend = _flex_attention_compiled_alone()
    else:
        attend = flex_attention
    aux = AuxRequest(lse=True) if return_lse else None
    result = attend(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_aux=aux
    )
    if return_lse:
        output, aux_output = result
        return output, aux_output.lse
    return result


class DocumentLengths(torch.Tensor):
    """A packed row's spans, ``[b, n_spans]`` integers whose absolute values sum to the row's
    length, passed as the model's ``mask``: a positive length is a document, which attends
    causally within itself alone; a negative one is padding, never attended (see [padding is
    not attended]). A tensor, so it travels with the batch (``batch_to_device``) as a mask
    does."""

    @staticmethod
    def of(seq_lens: list[int], padding: int = 0) -> DocumentLengths:
        """One row's documents, then ``padding`` positions, as ``[1, n_spans]``."""
        spans = [*seq_lens, -padding] if padding else list(seq_lens)
        return torch.tensor([spans], dtype=torch.long).as_subclass(DocumentLengths)


@torch.compiler.disable  # see [packed rows under compile]
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
    # Splits, not slices: a slice's backward writes its gradient into a zeroed tensor as large
    # as what it was cut from, once per slice; a split's backward joins the pieces once.
    rows = zip(*(t.split(1, dim=0) for t in (q, k, v)), strict=True)
    outputs_of_rows = []
    all_lengths = lengths.as_subclass(torch.Tensor).tolist()
    for row_lengths, (row_q, row_k, row_v) in zip(all_lengths, rows, strict=True):
        sizes = [abs(length) for length in row_lengths]
        if sum(sizes) != q.shape[2]:
            raise ValueError(f"document lengths {row_lengths} do not fill a row of {q.shape[2]}")
        spans_q, spans_k, spans_v = (t.split(sizes, dim=2) for t in (row_q, row_k, row_v))
        spans = zip(row_lengths, spans_q, spans_k, spans_v, strict=True)
        outputs = [attend(sq, sk, sv) if n > 0 else _unattended(sq, sv) for n, sq, sk, sv in spans]
        outputs_of_rows.append(torch.cat(outputs, dim=2))
    return torch.cat(outputs_of_rows, dim=0) if len(outputs_of_rows) > 1 else outputs_of_rows[0]


def _unattended(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A padding span's output: zeros, see [padding is not attended]."""
    return q.new_zeros((*q.shape[:3], v.shape[3]))


AttentionCall = Callable[..., torch.Tensor]


def _with_document_lengths(attention_call: AttentionCall) -> AttentionCall:
    """torchtune's ``_attention_call(q, k, v, mask, dropout_p, is_causal)`` that runs per
    document when ``mask`` is :class:`DocumentLengths`, flex attention through
    :func:`attend_flex` on a ``BlockMask`` (into a compiled layer's graph, see [flex attention
    inside a compiled layer]), and as before on any other mask."""

    def call(q, k, v, mask, dropout_p, is_causal):
        if isinstance(mask, BlockMask):
            if dropout_p > 0.0:
                raise ValueError("Flex attention (a BlockMask) does not support attention dropout")
            return attend_flex(q, k, v, mask)  # torchtune's call: its default scale, heads repeated
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


def accept_document_lengths(model: nn.Module) -> nn.Module:
    """``model`` with every attention module that calls torchtune's ``_attention_call``
    (``MultiHeadAttention`` and its subclasses) taking :class:`DocumentLengths` for a mask;
    once per module, however often it is called. Returns ``model``."""
    for module in model.modules():
        call = getattr(module, "_attention_call", None)
        if call is not None and not getattr(call, "accepts_document_lengths", False):
            module._attention_call = _with_document_lengths(call)
    return model


def instantiate_model(cfg_model: Any) -> nn.Module:
    """The model of a ``model`` ``_component_`` section, its attention taking packed rows'
    :class:`DocumentLengths`: every place that builds a model builds it here, so none can
    forget the wrap and meet a packed row with a mask its attention cannot read."""
    return accept_document_lengths(config.instantiate(cfg_model))
