"""Gemma 3's self-attention: torchtune's ``MultiHeadAttention`` in Hugging Face Gemma 3's order,
with a sliding window on the local layers and ``query_pre_attn_scalar`` for the scale.

What differs from torchtune 0.6.1's modules, and why:

- ``MultiHeadAttention`` applies ``q_norm``/``k_norm`` *after* RoPE; Gemma 3 normalises every
  head of q and k *before* RoPE, and its norms' per-dim scales do not commute with the rotation.
- ``MultiHeadAttention`` scales scores by ``head_dim ** -0.5``; Gemma 3 by
  ``query_pre_attn_scalar ** -0.5`` (27B: 168 against ``head_dim`` 128).
- ``Gemma2Attention`` (torchtune's sliding-window attention) applies q/k-norm after RoPE as well,
  rejects the ``BlockMask`` that packed rows carry on CUDA, builds its window from row indices
  even when a KV-cache shifts the queries' slots, and caches keys already repeated to
  ``num_heads``. This module takes any of torchtune's masks: a boolean ``[b, s, s]``
  (block-)causal mask, ``None`` (causal), a ``BlockMask``, or a ``[b, s, cache_len]`` mask with
  a KV-cache; a sliding layer narrows whichever it is given to its window. A packed row's
  :class:`~exactga.runtime.document_attention.DocumentLengths` (off CUDA) runs each document
  alone, the window narrowed within it.

The window, as transformers defines it (``sliding_window_overlay``: ``kv_idx > q_idx -
sliding_window``): a query attends to itself and the ``sliding_window - 1`` slots before it, so
``sliding_window`` keys in all. torchtune's ``Gemma2Attention`` keeps the same band
(``triu(-w + 1)``/``tril(w - 1)``), so there is no off-by-one between the two. The window is
measured in sequence slots (row index, or KV-cache slot), which is what transformers measures
and, for a packed row, the distance within its document.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import (
    BlockMask,
    and_masks,
    create_block_mask,
)
from torchtune.modules import MultiHeadAttention
from torchtune.modules.attention_utils import _MaskType

from exactga.runtime.document_attention import DocumentLengths, attend_flex, attend_per_document


class WindowedBlockMasks:
    """The last ``BlockMask`` a model was given, narrowed to a window, shared by the model's
    sliding layers so that a forward pass derives it once, not once per layer.

    ``create_block_mask`` evaluates the mask over the whole ``[b, s, s]`` grid; without the
    cache every sliding layer (5 in 6) would evaluate the same mask again.
    """

    def __init__(self) -> None:
        self._source: weakref.ref[BlockMask] | None = None
        self._window: int | None = None
        self._narrowed: BlockMask | None = None

    def narrowed(self, block_mask: BlockMask, window: int) -> BlockMask:
        """``block_mask`` and'ed with ``q_idx - kv_idx < window``; cached for the last mask
        when run eagerly. In a layer being compiled it is derived in the layer's graph: a
        Python-side cache there would break the graph (see [flex attention inside a compiled
        layer] in exactga.runtime.document_attention)."""
        if torch.compiler.is_compiling():
            return _narrowed(block_mask, window)
        source = self._source() if self._source is not None else None
        if source is block_mask and self._window == window:
            return self._narrowed
        narrowed = _narrowed(block_mask, window)
        self._source, self._window, self._narrowed = weakref.ref(block_mask), window, narrowed
        return narrowed


def _narrowed(block_mask: BlockMask, window: int) -> BlockMask:
    """``block_mask`` and'ed with ``q_idx - kv_idx < window``, its blocks derived anew."""
    return create_block_mask(
        and_masks(block_mask.mask_mod, _within_window(window)),
        B=block_mask.kv_num_blocks.shape[0],
        H=block_mask.kv_num_blocks.shape[1],
        Q_LEN=block_mask.seq_lengths[0],
        KV_LEN=block_mask.seq_lengths[1],
        device=block_mask.kv_num_blocks.device,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
    )


def _within_window(window: int) -> Callable:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
        return q_idx - kv_idx < window

    return mask_mod


def window_band(query_slots: torch.Tensor, kv_len: int, window: int) -> torch.Tensor:
    """``[s_q, kv_len]`` booleans: key slot ``j`` is fewer than ``window`` slots before the
    query's slot (later keys are left to the causal mask)."""
    key_slots = torch.arange(kv_len, device=query_slots.device)
    return (query_slots[:, None] - key_slots[None, :]) < window


def causal_band(query_slots: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``[s_q, kv_len]`` booleans: key slot ``j`` is at or before the query's slot."""
    key_slots = torch.arange(kv_len, device=query_slots.device)
    return query_slots[:, None] >= key_slots[None, :]


class Gemma3Attention(MultiHeadAttention):
    """Gemma 3's attention; torchtune's ``MultiHeadAttention`` constructor, submodules, state-dict
    keys and KV-cache (unrepeated ``num_kv_heads``), plus:

    Args:
        sliding_window: keys a query sees, itself included, in a local layer; ``None`` for a
            global layer.
        query_pre_attn_scalar: scores are scaled by its ``** -0.5``; ``None``: ``head_dim``.
        windowed_block_masks: shared cache of narrowed ``BlockMask``s (see
            :class:`WindowedBlockMasks`); one is made if not given.
        **kwargs: ``MultiHeadAttention``'s arguments.
    """

    def __init__(
        self,
        *,
        sliding_window: int | None = None,
        query_pre_attn_scalar: float | None = None,
        windowed_block_masks: WindowedBlockMasks | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.query_pre_attn_scalar = query_pre_attn_scalar or self.head_dim
        self.scaling = float(self.query_pre_attn_scalar) ** -0.5
        self._windowed_block_masks = windowed_block_masks or WindowedBlockMasks()

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        mask: _MaskType | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``x``'s tokens to ``y``'s (``y=None``: to the KV-cache only), with the
        arguments and result of torchtune's ``MultiHeadAttention.forward``; ``mask`` True means
        "may attend", ``None`` means causal."""
        b, s_x, _ = x.shape
        q = self._normed_rotated_heads(self.q_proj(x), self.num_heads, self.q_norm, input_pos)
        cache_in_use = self.kv_cache is not None and self.cache_enabled
        # The queries' slots in the key sequence: where the cache will write them, else 0..s-1.
        query_slots = (
            self.kv_cache.cache_pos[:s_x].clone()
            if cache_in_use
            else torch.arange(s_x, device=x.device)
        )
        if y is None:
            if not cache_in_use:
                raise ValueError(
                    "Must provide y input or use kv_cache to enable streaming decoding"
                )
            k, v = self.kv_cache.k_cache, self.kv_cache.v_cache
        else:
            k = self._normed_rotated_heads(
                self.k_proj(y), self.num_kv_heads, self.k_norm, input_pos
            )
            v = self.v_proj(y).view(b, y.shape[1], self.num_kv_heads, self.head_dim).transpose(1, 2)
            if cache_in_use:
                k, v = self.kv_cache.update(k, v)
        if isinstance(mask, DocumentLengths):  # a packed row off CUDA: each document alone
            output = attend_per_document(q, k, v, mask, self._attend_document)
        else:
            mask = self._layer_mask(mask, query_slots, k.shape[2], default_causal=not cache_in_use)
            output = self._attend(q, k, v, mask)
        return self.output_proj(output.transpose(1, 2).reshape(b, s_x, -1))

    def _normed_rotated_heads(
        self,
        projected: torch.Tensor,
        num_heads: int,
        norm: nn.Module | None,
        input_pos: torch.Tensor | None,
    ) -> torch.Tensor:
        """``[b, s, num_heads * head_dim]`` to ``[b, num_heads, s, head_dim]``, each head
        normalised over ``head_dim`` and then rotated (Gemma 3's order)."""
        b, s, _ = projected.shape
        heads = projected.view(b, s, num_heads, self.head_dim)
        if norm is not None:
            heads = norm(heads)
        if self.pos_embeddings is not None:
            heads = self.pos_embeddings(heads, input_pos=input_pos)
        return heads.transpose(1, 2)

    def _layer_mask(
        self,
        mask: _MaskType | None,
        query_slots: torch.Tensor,
        kv_len: int,
        *,
        default_causal: bool,
    ) -> _MaskType | None:
        """The mask this layer attends with: the given one (``None``: causal), narrowed to the
        window in a sliding layer, shaped for SDPA (``[b, 1, s, kv]`` or ``[s, kv]``)."""
        if isinstance(mask, BlockMask):
            if self.sliding_window is None:
                return mask
            return self._windowed_block_masks.narrowed(mask, self.sliding_window)
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # one mask for every head
        if self.sliding_window is None:
            return mask
        band = window_band(query_slots, kv_len, self.sliding_window)
        if mask is None:
            return band & causal_band(query_slots, kv_len) if default_causal else band
        if mask.dtype == torch.bool:
            return mask & band
        return mask.masked_fill(~band, float("-inf"))  # an additive float mask

    def _attend_document(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:meth:`_attend` on one document's span: causal, narrowed to the window in a sliding
        layer when the document is longer than it (the window counts slots within the document,
        as on the whole row; see [per-document attention is exact])."""
        length = q.shape[2]
        if self.sliding_window is None or length <= self.sliding_window:
            return self._attend(q, k, v, None)
        slots = torch.arange(length, device=q.device)
        band = window_band(slots, length, self.sliding_window) & causal_band(slots, length)
        return self._attend(q, k, v, band)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """softmax(scaled q k^T, masked) v, ``[b, n_h, s, h_d]``; ``mask`` None means causal
        when no KV-cache is in use (as torchtune: with one, the caller must give a mask)."""
        dropout = self.attn_dropout if self.training else 0.0
        if isinstance(mask, BlockMask):
            if dropout > 0.0:
                raise ValueError("Flex attention (a BlockMask) does not support attention dropout")
            return attend_flex(q, k, v, mask, scale=self.scaling, enable_gqa=True)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        is_causal = mask is None and not (self.kv_cache is not None and self.cache_enabled)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=self.scaling
        )

    def _repeat_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """``[b, n_kv, s, d]`` to ``[b, n_h, s, d]``: query head ``h`` reads kv head
        ``h // (n_h / n_kv)``, as torchtune and transformers group them."""
        if self.num_heads == self.num_kv_heads:
            return kv
        b, n_kv, s, d = kv.shape
        q_per_kv = self.num_heads // n_kv
        return kv.unsqueeze(2).expand(b, n_kv, q_per_kv, s, d).flatten(1, 2)
