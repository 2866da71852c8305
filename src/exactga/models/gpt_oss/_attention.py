"""gpt-oss's self-attention: Gemma 3's module (torchtune's ``MultiHeadAttention`` with a sliding
window on the local layers, every mask torchtune hands a layer) with learned attention sinks.

A sink is one logit per query head that joins every query's softmax as an extra key with no
value: ``softmax([q k^T * scale, sink])`` with the sink's column dropped afterwards, so a
head can put weight on "nothing" and its rows need not sum to one. The sinks are trained
parameters (``attn.sinks``, ``[num_heads]``). PyTorch's fused attention kernels have no such
column, so the dense path here computes the softmax itself, as transformers' eager attention
(the only one its ``GptOssForCausalLM`` runs on a CPU): the scores, the mask, the sink column,
the row maximum subtracted, softmax, the sink column dropped.

With a ``BlockMask`` (flex attention: packed rows on CUDA) the sink enters through the
log-sum-exp flex attention returns: the sink adds ``exp(sink)`` to each row's normaliser
``exp(lse)``, so the output with the sink is flex's output times ``sigmoid(lse - sink)``, and
the sinks' gradient flows through that factor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from exactga.models.gemma3._attention import Gemma3Attention, causal_band
from exactga.runtime.document_attention import attend_flex


class GptOssAttention(Gemma3Attention):
    """Attention with a sliding window (``sliding_window``, ``None`` for a full layer) and one
    learned sink per query head; arguments as :class:`Gemma3Attention`'s (no QK-norm, the
    scale ``head_dim ** -0.5``)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # transformers initialises the sinks from N(0, initializer_range); the checkpoint's
        # values replace them.
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        nn.init.normal_(self.sinks, std=0.02)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """softmax([scaled q k^T masked, sink]) without the sink's column, times v:
        ``[b, n_h, s, h_d]``."""
        if isinstance(mask, BlockMask):
            return self._attend_flex(q, k, v, mask)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if mask is None:
            if self.kv_cache is not None and self.cache_enabled:
                raise ValueError("a KV-cache needs an explicit mask")
            slots = torch.arange(q.shape[2], device=q.device)
            mask = causal_band(slots, k.shape[2])
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask  # an additive float mask
        b, n_h, s_q, _ = scores.shape
        sinks = self.sinks.to(scores.dtype).reshape(1, n_h, 1, 1).expand(b, n_h, s_q, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        # As transformers: the row maximum subtracted first (it keeps bf16 from overflowing).
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        dropout = self.attn_dropout if self.training else 0.0
        probs = F.dropout(probs, p=dropout, training=self.training).to(v.dtype)
        return torch.matmul(probs, v)

    def _attend_flex(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask
    ) -> torch.Tensor:
        """Flex attention with the sinks: its output times ``sigmoid(lse - sink)``."""
        if self.training and self.attn_dropout > 0.0:
            raise ValueError("Flex attention (a BlockMask) does not support attention dropout")
        output, lse = attend_flex(
            q, k, v, block_mask, scale=self.scaling, enable_gqa=True, return_lse=True
        )
        kept = torch.sigmoid(lse - self.sinks.float().reshape(1, -1, 1))  # 1 - the sink's share
        return output * kept.unsqueeze(-1).to(output.dtype)
