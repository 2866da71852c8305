"""Component builders of the Qwen3 dense models: :func:`qwen3` and :func:`lora_qwen3`.

Qwen3 is Qwen2 with three changes, and these builders take torchtune 0.6.1's Qwen2 modules
wherever they still fit (RoPE, RMSNorm, the SwiGLU MLP, ``TiedLinear``, the LoRA/DoRA linears):

- QK-norm: an RMSNorm over ``head_dim``, one per projection (``q_norm``, ``k_norm``), applied to
  every head of q and k *before* RoPE. torchtune 0.6.1's ``MultiHeadAttention`` takes
  ``q_norm``/``k_norm`` but applies them *after* RoPE; the two orders differ as soon as a norm's
  scale is not symmetric in the two halves RoPE rotates together, which trained Qwen3 scales are
  not. :class:`Qwen3Attention` keeps torchtune's module (its arguments, state-dict keys and
  KV-cache) and changes only that order.
- no bias on q, k, v.
- an explicit ``head_dim``: 128 at every released size, which is not ``embed_dim // num_heads``
  at 0.6B, 1.7B, 4B or 32B, so q and the attention output are ``num_heads * head_dim`` wide.

RoPE is Hugging Face's rotate-half layout, the layout of
``torchtune.models.qwen2._positional_embeddings.Qwen2RotaryPositionalEmbeddings``, so the
Hugging Face weights load as they are (no permutation of q/k rows, unlike Llama's conversion).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import (
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.attention_utils import _MaskType
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.peft import LORA_ATTN_MODULES, DoRALinear, LoRALinear

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "output_proj")


class Qwen3Attention(MultiHeadAttention):
    """torchtune's :class:`~torchtune.modules.MultiHeadAttention` in Hugging Face Qwen3's order:
    each head of q and k is normalised (``q_norm``, ``k_norm``) and *then* rotated by
    ``pos_embeddings``. Same constructor, submodules and KV-cache as torchtune's class."""

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        mask: _MaskType | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``x``'s tokens to ``y``'s (``y=None``: to the KV-cache only), with the
        arguments and result of torchtune's ``MultiHeadAttention.forward``."""
        b, s_x, _ = x.shape
        q = self._normed_rotated_heads(self.q_proj(x), self.q_norm, input_pos)  # [b, n_h, s, h_d]
        if y is None:
            if self.kv_cache is None or not self.cache_enabled:
                raise ValueError("y=None attends to the KV-cache only, which is not enabled")
            k, v = self.kv_cache.k_cache, self.kv_cache.v_cache
        else:
            k = self._normed_rotated_heads(self.k_proj(y), self.k_norm, input_pos)
            v = self.v_proj(y).view(b, y.shape[1], -1, self.head_dim).transpose(1, 2)
            if self.kv_cache is not None and self.cache_enabled:
                k, v = self.kv_cache.update(k, v)
        if self.num_heads != self.num_kv_heads:  # GQA: each kv head serves q_per_kv query heads
            q_per_kv = self.num_heads // self.num_kv_heads
            expanded = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expanded).flatten(1, 2)
            v = v.unsqueeze(2).expand(expanded).flatten(1, 2)
        output = self._attention_call(
            q,
            k,
            v,
            mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )
        return self.output_proj(output.transpose(1, 2).contiguous().view(b, s_x, -1))

    def _normed_rotated_heads(
        self, projected: torch.Tensor, norm: nn.Module | None, input_pos: torch.Tensor | None
    ) -> torch.Tensor:
        """``[b, s, n * h_d]`` projections as ``[b, n, s, h_d]`` heads, normalised, then rotated."""
        b, s, _ = projected.shape
        heads = projected.view(b, s, -1, self.head_dim)
        if norm is not None:
            heads = norm(heads)  # over h_d, per head: HF Qwen3's q_norm/k_norm, before RoPE
        if self.pos_embeddings is not None:
            heads = self.pos_embeddings(heads, input_pos=input_pos)
        return heads.transpose(1, 2)


@dataclass(frozen=True)
class _Adapters:
    """How a LoRA builder makes the linears it adapts."""

    rank: int
    alpha: float
    dropout: float
    use_dora: bool
    quantize_base: bool

    def linear(self, in_dim: int, out_dim: int, *, quantize_base: bool | None = None) -> nn.Module:
        """A bias-free LoRA (or DoRA) linear; ``quantize_base`` overrides the builder's."""
        adapter_cls = DoRALinear if self.use_dora else LoRALinear
        return adapter_cls(
            in_dim,
            out_dim,
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            quantize_base=self.quantize_base if quantize_base is None else quantize_base,
        )


def _linear(in_dim: int, out_dim: int, adapters: _Adapters | None) -> nn.Module:
    """A bias-free linear: adapted when ``adapters`` is given, plain otherwise."""
    if adapters is None:
        return nn.Linear(in_dim, out_dim, bias=False)
    return adapters.linear(in_dim, out_dim)


def resolved_head_dim(embed_dim: int, num_heads: int, head_dim: int | None) -> int:
    """``head_dim`` as given, else ``embed_dim // num_heads`` (what Qwen2 always used)."""
    return head_dim if head_dim is not None else embed_dim // num_heads


def _qwen3_mlp(dim: int, hidden_dim: int, adapters: _Adapters | None = None) -> FeedForward:
    """Qwen3's SwiGLU MLP, ``down(silu(gate(x)) * up(x))``: torchtune's ``w1``/``w3``/``w2``."""
    return FeedForward(
        gate_proj=_linear(dim, hidden_dim, adapters),
        down_proj=_linear(hidden_dim, dim, adapters),
        up_proj=_linear(dim, hidden_dim, adapters),
    )


def _qwen3_self_attention(
    *,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    attn_dropout: float,
    norm_eps: float,
    rope: nn.Module,
    adapters: _Adapters | None = None,
    lora_modules: tuple[str, ...] = (),
) -> Qwen3Attention:
    """One layer's attention: bias-free q/k/v/output projections (those in ``lora_modules``
    adapted), the per-head QK-norms, and the model's shared ``rope``."""

    def projection(name: str, in_dim: int, out_dim: int) -> nn.Module:
        return _linear(in_dim, out_dim, adapters if name in lora_modules else None)

    return Qwen3Attention(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_proj=projection("q_proj", embed_dim, num_heads * head_dim),
        k_proj=projection("k_proj", embed_dim, num_kv_heads * head_dim),
        v_proj=projection("v_proj", embed_dim, num_kv_heads * head_dim),
        # The heads are num_heads * head_dim wide, which need not be embed_dim.
        output_proj=projection("output_proj", num_heads * head_dim, embed_dim),
        pos_embeddings=rope,
        q_norm=RMSNorm(dim=head_dim, eps=norm_eps),
        k_norm=RMSNorm(dim=head_dim, eps=norm_eps),
        kv_cache=None,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
    )


def _qwen3_decoder(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int | None,
    attn_dropout: float,
    norm_eps: float,
    rope_base: float,
    tie_word_embeddings: bool,
    adapters: _Adapters | None = None,
    lora_modules: tuple[str, ...] = (),
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
) -> TransformerDecoder:
    """The decoder both public builders make; ``adapters=None`` adapts nothing."""
    head_dim = resolved_head_dim(embed_dim, num_heads, head_dim)
    num_kv_heads = num_kv_heads if num_kv_heads else num_heads
    # One RoPE module for all layers: its cos/sin cache is max_seq_len * 2 * head_dim floats
    # (42 MB at 40960 positions), so one per layer (as lora_qwen2 builds) would cost GBs.
    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = _qwen3_self_attention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
            norm_eps=norm_eps,
            rope=rope,
            adapters=adapters,
            lora_modules=lora_modules,
        )
        mlp = _qwen3_mlp(embed_dim, intermediate_dim, adapters if apply_lora_to_mlp else None)
        layers.append(_decoder_layer(attn, mlp, embed_dim, norm_eps))
    return _decoder(
        layers,
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm_eps=norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        output_adapters=adapters if apply_lora_to_output else None,
    )


def _decoder_layer(attn: nn.Module, mlp: nn.Module, embed_dim: int, norm_eps: float) -> nn.Module:
    """One layer: attention and MLP, each after its RMSNorm, as Qwen3's (and Qwen3 MoE's)."""
    return TransformerSelfAttentionLayer(
        attn=attn,
        mlp=mlp,
        sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
        mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
    )


def _decoder(
    layers: list[nn.Module],
    *,
    vocab_size: int,
    embed_dim: int,
    max_seq_len: int,
    num_heads: int,
    head_dim: int,
    norm_eps: float,
    tie_word_embeddings: bool,
    output_adapters: _Adapters | None,
) -> TransformerDecoder:
    """The decoder around ``layers``: embedding, final norm and the LM head (tied, or its own
    weight; with ``output_adapters``, adapted)."""
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=_output_projection(tok_embeddings, tie_word_embeddings, output_adapters),
    )


def _output_projection(
    tok_embeddings: nn.Embedding, tie_word_embeddings: bool, adapters: _Adapters | None
) -> nn.Module | TiedLinear:
    """The LM head: the embedding's own weight when tied (no parameter, no state-dict key),
    else a linear of its own, adapted when ``adapters`` is given."""
    if tie_word_embeddings:
        return TiedLinear(tok_embeddings)
    vocab_size, embed_dim = tok_embeddings.weight.shape
    if adapters is None:
        return nn.Linear(embed_dim, vocab_size, bias=False)
    # As torchtune's LoRA builders: the output projection's base is never quantised.
    return adapters.linear(embed_dim, vocab_size, quantize_base=False)


def qwen3(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int | None = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
) -> TransformerDecoder:
    """A Qwen3 dense decoder (Hugging Face's ``Qwen3ForCausalLM``).

    Args:
        vocab_size: number of tokens in the vocabulary.
        num_layers: number of transformer layers.
        num_heads: number of query heads.
        num_kv_heads: number of key/value heads (GQA); divides ``num_heads``.
        embed_dim: the model (residual stream) width, HF's ``hidden_size``.
        intermediate_dim: the MLP's hidden width, HF's ``intermediate_size``.
        max_seq_len: the longest sequence RoPE's cache (and a KV-cache) covers.
        head_dim: the width of one head; ``None`` means ``embed_dim // num_heads``. Qwen3's
            released sizes all use 128.
        attn_dropout: dropout in scaled dot-product attention while training.
        norm_eps: epsilon of every RMSNorm (layers, QK-norm, final).
        rope_base: RoPE's base period, HF's ``rope_theta``.
        tie_word_embeddings: the output projection is the token embedding (0.6B, 1.7B, 4B).

    Returns:
        TransformerDecoder: the model, its attention :class:`Qwen3Attention`.
    """
    return _qwen3_decoder(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        head_dim=head_dim,
        attn_dropout=attn_dropout,
        norm_eps=norm_eps,
        rope_base=rope_base,
        tie_word_embeddings=tie_word_embeddings,
    )


def lora_qwen3(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int | None = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3` with LoRA (or DoRA) adapters, as torchtune's ``lora_qwen2``.

    Args:
        lora_attn_modules: the attention projections to adapt, among ``q_proj``, ``k_proj``,
            ``v_proj``, ``output_proj``. The QK-norms are never adapted.
        apply_lora_to_mlp: adapt the MLP's three projections in every layer.
        apply_lora_to_output: adapt the output projection (untied models only).
        vocab_size, num_layers, num_heads, num_kv_heads, embed_dim, intermediate_dim,
            max_seq_len, head_dim, attn_dropout, norm_eps, rope_base, tie_word_embeddings:
            as :func:`qwen3`.
        lora_rank: rank of each adapter.
        lora_alpha: adapter scaling numerator (the scale is ``lora_alpha / lora_rank``).
        lora_dropout: dropout on the adapters' input.
        use_dora: DoRA adapters (a learnt magnitude per output row) instead of LoRA.
        quantize_base: store the adapted linears' frozen weights in NF4 (QLoRA); the output
            projection is never quantised, as in torchtune.

    Returns:
        TransformerDecoder: the model with adapters.

    Raises:
        ValueError: ``lora_attn_modules`` is empty or names another module, or
            ``apply_lora_to_output`` with ``tie_word_embeddings``.
    """
    unknown = set(lora_attn_modules) - set(ATTENTION_PROJECTIONS)
    if not lora_attn_modules or unknown:
        raise ValueError(
            f"lora_attn_modules={list(lora_attn_modules)}: give one or more of "
            f"{list(ATTENTION_PROJECTIONS)}"
        )
    if apply_lora_to_output and tie_word_embeddings:  # before building GBs of layers
        raise ValueError(
            "apply_lora_to_output is incompatible with tie_word_embeddings: the output "
            "projection is the token embedding, so there is no output linear to adapt."
        )
    adapters = _Adapters(lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base)
    model = _qwen3_decoder(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        head_dim=head_dim,
        attn_dropout=attn_dropout,
        norm_eps=norm_eps,
        rope_base=rope_base,
        tie_word_embeddings=tie_word_embeddings,
        adapters=adapters,
        lora_modules=tuple(lora_attn_modules),
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
    )
    if quantize_base:
        # As torchtune's QLoRA builders: the state dict holds the NF4 weights dequantised to
        # the model's dtype (and on CPU, so a save does not hold two copies on the GPU).
        model._register_state_dict_hook(
            partial(
                reparametrize_as_dtype_state_dict_post_hook,
                dtype=model.tok_embeddings.weight.dtype,
                offload_to_cpu=True,
            )
        )
    return model
