"""Component builders of the Gemma 3 text decoder: :func:`gemma3` and :func:`lora_gemma3`.

The decoder Hugging Face's ``Gemma3ForCausalLM`` defines (``Gemma3TextConfig``), built from
torchtune 0.6.1's modules wherever they fit:

- embedding scaled by ``sqrt(embed_dim)`` rounded to the activations' dtype
  (torchtune's ``GemmaNormEmbeddings``; transformers rounds the float32 scale to the weight's
  dtype, which gives the same number for every width up to 20,000 in bfloat16 and float16);
- four ``GemmaRMSNorm`` (``x * (1 + scale)``, computed in float32) per layer: before and after
  attention (``sa_norm``, ``sa_scale``), before and after the MLP (``mlp_norm``, ``mlp_scale``);
- the GELU-tanh gated MLP (torchtune's ``gemma_mlp``/``lora_gemma_mlp``);
- the output tied to the embedding (``TiedLinear``);
- :class:`~exactga.models.gemma3._attention.Gemma3Attention`: QK-norm (a ``GemmaRMSNorm`` over
  ``head_dim``) before RoPE, scale ``query_pre_attn_scalar ** -0.5``, a sliding window on local
  layers;
- two rotate-half RoPEs (see ``_positional_embeddings``): base ``local_rope_base`` for local
  layers, base ``rope_base`` with linear ``rope_scaling_factor`` for global ones.

Layer ``i`` is global iff ``(i + 1) % sliding_window_pattern == 0`` (released: 5 local, then 1
global), unless ``layer_types`` names every layer's kind.

Soft-capping: every released Gemma 3 config has ``attn_logit_softcapping`` and
``final_logit_softcapping`` ``None``. ``final_logit_softcapping`` is supported as transformers
applies it (on the logits). ``attn_logit_softcapping`` must stay ``None``: transformers' Gemma 3
(5.24) stores it but never hands it to its attention functions (Gemma 2's does), so a model that
capped its scores would not be the model transformers loads from the same ``config.json``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchtune.models.gemma._component_builders import gemma_mlp, lora_gemma_mlp
from torchtune.models.gemma.gemma_norm_embedding import GemmaNormEmbeddings
from torchtune.models.gemma.rms_norm import GemmaRMSNorm
from torchtune.modules import (
    FeedForward,
    FrozenNF4Linear,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.common_utils import _register_reparametrize_state_dict_hooks
from torchtune.modules.peft import LORA_ATTN_MODULES, DoRALinear, LoRALinear

from exactga.models.gemma3._attention import Gemma3Attention, WindowedBlockMasks
from exactga.models.gemma3._positional_embeddings import Gemma3RotaryPositionalEmbeddings

SLIDING = "sliding_attention"  # transformers' layer_types names
FULL = "full_attention"


def gemma3_layer_types(
    num_layers: int,
    sliding_window_pattern: int = 6,
    layer_types: Sequence[str] | None = None,
) -> list[str]:
    """Each layer's kind, ``"sliding_attention"`` or ``"full_attention"``, as
    ``Gemma3TextConfig`` derives them: ``layer_types`` if given, else layer ``i`` is full iff
    ``(i + 1) % sliding_window_pattern == 0``."""
    if layer_types is not None:
        kinds = list(layer_types)
        if len(kinds) != num_layers or not set(kinds) <= {SLIDING, FULL}:
            raise ValueError(
                f"layer_types must name {num_layers} layers, each {SLIDING!r} or {FULL!r}; "
                f"got {kinds}"
            )
        return kinds
    if sliding_window_pattern < 1:
        raise ValueError(f"sliding_window_pattern must be at least 1, got {sliding_window_pattern}")
    return [FULL if (i + 1) % sliding_window_pattern == 0 else SLIDING for i in range(num_layers)]


class SoftCappedTiedLinear(TiedLinear):
    """The tied output with ``cap * tanh(logits / cap)`` on the logits (Gemma 2's
    ``final_logit_softcapping``; ``None`` in Gemma 3). Still a ``TiedLinear``, so code that
    asks whether a model's output is tied keeps its answer.

    torchtune 0.6.1's ``Gemma2FinalNorm`` caps the *normalised hidden state* before the output
    projection instead; transformers caps the logits, as here."""

    def __init__(self, tied_module: nn.Module, cap: float) -> None:
        super().__init__(tied_module)
        self.cap = cap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().__call__(x) / self.cap) * self.cap


def _tied_output(tok_embeddings: nn.Embedding, final_logit_softcapping: float | None):
    if final_logit_softcapping is None:
        return TiedLinear(tok_embeddings)
    return SoftCappedTiedLinear(tok_embeddings, final_logit_softcapping)


def _rope_per_layer_kind(
    head_dim: int, rope_base: float, local_rope_base: float, rope_scaling_factor: float | None
) -> dict[str, Gemma3RotaryPositionalEmbeddings]:
    """One RoPE module per layer kind, each shared by the layers of its kind."""
    return {
        SLIDING: Gemma3RotaryPositionalEmbeddings(head_dim, local_rope_base),
        FULL: Gemma3RotaryPositionalEmbeddings(head_dim, rope_base, rope_scaling_factor or 1.0),
    }


def _linear(in_dim: int, out_dim: int, quantize_base: bool = False) -> nn.Module:
    if quantize_base:
        return FrozenNF4Linear(in_dim, out_dim, bias=False)
    return nn.Linear(in_dim, out_dim, bias=False)


def _projection(
    name: str,
    in_dim: int,
    out_dim: int,
    lora_modules: Sequence[str],
    lora: dict | None,
) -> nn.Module:
    """An attention projection: a LoRA/DoRA linear if ``name`` is in ``lora_modules``, else a
    plain (or, with ``quantize_base``, NF4) linear."""
    quantize_base = bool(lora and lora["quantize_base"])
    if lora is None or name not in lora_modules:
        return _linear(in_dim, out_dim, quantize_base)
    adapter_cls = DoRALinear if lora["use_dora"] else LoRALinear
    return adapter_cls(
        in_dim,
        out_dim,
        rank=lora["lora_rank"],
        alpha=lora["lora_alpha"],
        dropout=lora["lora_dropout"],
        quantize_base=quantize_base,
    )


def gemma3_self_attention(
    *,
    embed_dim: int,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    max_seq_len: int,
    pos_embeddings: nn.Module,
    norm_eps: float = 1e-6,
    attn_dropout: float = 0.0,
    sliding_window: int | None = None,
    query_pre_attn_scalar: float | None = None,
    windowed_block_masks: WindowedBlockMasks | None = None,
    lora_modules: Sequence[str] = (),
    lora: dict | None = None,
) -> Gemma3Attention:
    """One layer's attention; ``lora`` (the LoRA keyword arguments) puts adapters on the
    projections named in ``lora_modules``."""
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    return Gemma3Attention(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_proj=_projection("q_proj", embed_dim, q_dim, lora_modules, lora),
        k_proj=_projection("k_proj", embed_dim, kv_dim, lora_modules, lora),
        v_proj=_projection("v_proj", embed_dim, kv_dim, lora_modules, lora),
        output_proj=_projection("output_proj", q_dim, embed_dim, lora_modules, lora),
        pos_embeddings=pos_embeddings,
        q_norm=GemmaRMSNorm(head_dim, eps=norm_eps),
        k_norm=GemmaRMSNorm(head_dim, eps=norm_eps),
        kv_cache=None,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        sliding_window=sliding_window,
        query_pre_attn_scalar=query_pre_attn_scalar,
        windowed_block_masks=windowed_block_masks,
    )


def _layer(attn: Gemma3Attention, mlp: FeedForward, embed_dim: int, norm_eps: float):
    # torchtune's layer computes h = x + sa_scale(attn(sa_norm(x))), then
    # h + mlp_scale(mlp(mlp_norm(h))): HF's input / post-attention / pre-feedforward /
    # post-feedforward norms, in that order.
    return TransformerSelfAttentionLayer(
        attn=attn,
        mlp=mlp,
        sa_norm=GemmaRMSNorm(embed_dim, eps=norm_eps),
        sa_scale=GemmaRMSNorm(embed_dim, eps=norm_eps),
        mlp_norm=GemmaRMSNorm(embed_dim, eps=norm_eps),
        mlp_scale=GemmaRMSNorm(embed_dim, eps=norm_eps),
    )


def _decoder(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float,
    norm_eps: float,
    rope_base: float,
    local_rope_base: float,
    rope_scaling_factor: float | None,
    sliding_window: int,
    sliding_window_pattern: int,
    layer_types: Sequence[str] | None,
    query_pre_attn_scalar: float | None,
    attn_logit_softcapping: float | None,
    final_logit_softcapping: float | None,
    lora_attn_modules: Sequence[str] = (),
    apply_lora_to_mlp: bool = False,
    lora: dict | None = None,
) -> TransformerDecoder:
    """The decoder of :func:`gemma3` (``lora=None``) and :func:`lora_gemma3`."""
    if attn_logit_softcapping is not None:
        raise ValueError(
            f"attn_logit_softcapping={attn_logit_softcapping}: transformers' Gemma 3 ignores it "
            "(its attention is never capped), so a capped model would not be the Hugging Face "
            "model of the same config.json; leave it None, as every released Gemma 3 does."
        )
    kinds = gemma3_layer_types(num_layers, sliding_window_pattern, layer_types)
    ropes = _rope_per_layer_kind(head_dim, rope_base, local_rope_base, rope_scaling_factor)
    windowed_block_masks = WindowedBlockMasks()  # one per model: see its docstring
    layers = nn.ModuleList()
    for kind in kinds:
        attn = gemma3_self_attention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            head_dim=head_dim,
            num_kv_heads=num_kv_heads,
            max_seq_len=max_seq_len,
            pos_embeddings=ropes[kind],
            norm_eps=norm_eps,
            attn_dropout=attn_dropout,
            sliding_window=sliding_window if kind == SLIDING else None,
            query_pre_attn_scalar=query_pre_attn_scalar,
            windowed_block_masks=windowed_block_masks,
            lora_modules=lora_attn_modules,
            lora=lora,
        )
        if lora is not None and apply_lora_to_mlp:
            mlp = lora_gemma_mlp(dim=embed_dim, hidden_dim=intermediate_dim, **lora)
        else:
            quantize_base = bool(lora and lora["quantize_base"])
            mlp = gemma_mlp(dim=embed_dim, hidden_dim=intermediate_dim, quantize_base=quantize_base)
        layers.append(_layer(attn, mlp, embed_dim, norm_eps))
    tok_embeddings = GemmaNormEmbeddings(vocab_size, embed_dim)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=GemmaRMSNorm(embed_dim, eps=norm_eps),
        output=_tied_output(tok_embeddings, final_logit_softcapping),
    )


def gemma3(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    local_rope_base: float = 10_000.0,
    rope_scaling_factor: float | None = None,
    sliding_window: int = 4096,
    sliding_window_pattern: int = 6,
    layer_types: Sequence[str] | None = None,
    query_pre_attn_scalar: float | None = None,
    attn_logit_softcapping: float | None = None,
    final_logit_softcapping: float | None = None,
) -> TransformerDecoder:
    """Build the Gemma 3 text decoder (HF ``Gemma3ForCausalLM``); see the module docstring.

    Args:
        vocab_size: rows of the (tied) embedding (``vocab_size``).
        num_layers: decoder layers (``num_hidden_layers``).
        num_heads: query heads (``num_attention_heads``).
        head_dim: per-head width (``head_dim``), not necessarily ``embed_dim // num_heads``.
        num_kv_heads: key/value heads (``num_key_value_heads``).
        embed_dim: model width (``hidden_size``).
        intermediate_dim: MLP width (``intermediate_size``).
        max_seq_len: longest sequence the model takes (``max_position_embeddings``).
        attn_dropout: dropout on the attention weights in training (``attention_dropout``).
        norm_eps: every RMSNorm's epsilon (``rms_norm_eps``).
        rope_base: RoPE base of the global layers (``rope_theta``).
        local_rope_base: RoPE base of the sliding-window layers (``rope_local_base_freq``).
        rope_scaling_factor: linear position scaling of the global layers' RoPE
            (``rope_scaling: {"rope_type": "linear", "factor": ...}``); ``None`` for none.
        sliding_window: keys a query of a local layer sees, itself included
            (``sliding_window``).
        sliding_window_pattern: layer ``i`` is global iff ``(i + 1) % pattern == 0``.
        layer_types: every layer's kind, ``"sliding_attention"`` or ``"full_attention"``
            (``layer_types``); overrides the pattern.
        query_pre_attn_scalar: attention scores are scaled by its ``** -0.5``
            (``query_pre_attn_scalar``); ``None``: ``head_dim``.
        attn_logit_softcapping: must be ``None`` (see the module docstring); taken so that
            a config naming every ``Gemma3TextConfig`` field builds.
        final_logit_softcapping: soft cap of the logits; ``None`` in Gemma 3.

    Returns:
        TransformerDecoder: the decoder, its output tied to its embedding.
    """
    return _decoder(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        norm_eps=norm_eps,
        rope_base=rope_base,
        local_rope_base=local_rope_base,
        rope_scaling_factor=rope_scaling_factor,
        sliding_window=sliding_window,
        sliding_window_pattern=sliding_window_pattern,
        layer_types=layer_types,
        query_pre_attn_scalar=query_pre_attn_scalar,
        attn_logit_softcapping=attn_logit_softcapping,
        final_logit_softcapping=final_logit_softcapping,
    )


def lora_gemma3(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    local_rope_base: float = 10_000.0,
    rope_scaling_factor: float | None = None,
    sliding_window: int = 4096,
    sliding_window_pattern: int = 6,
    layer_types: Sequence[str] | None = None,
    query_pre_attn_scalar: float | None = None,
    attn_logit_softcapping: float | None = None,
    final_logit_softcapping: float | None = None,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`gemma3` with LoRA (or DoRA) adapters, as torchtune's ``lora_gemma2``.

    The output projection takes no adapter: it is the embedding (tied).

    Args:
        lora_attn_modules: the attention projections that get adapters, of
            ``{"q_proj", "k_proj", "v_proj", "output_proj"}``.
        apply_lora_to_mlp: adapters on the MLP's three projections too.
        lora_rank: rank of each adapter.
        lora_alpha: adapters' scale numerator (scale ``lora_alpha / lora_rank``).
        lora_dropout: dropout on the adapters' input.
        use_dora: DoRA adapters (a learnt magnitude per output row) instead of LoRA.
        quantize_base: NF4 base weights in every attention/MLP linear (QLoRA).
        **others: as :func:`gemma3`.

    Returns:
        TransformerDecoder: the decoder with adapters.
    """
    lora = {
        "lora_rank": lora_rank,
        "lora_alpha": lora_alpha,
        "lora_dropout": lora_dropout,
        "use_dora": use_dora,
        "quantize_base": quantize_base,
    }
    model = _decoder(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        norm_eps=norm_eps,
        rope_base=rope_base,
        local_rope_base=local_rope_base,
        rope_scaling_factor=rope_scaling_factor,
        sliding_window=sliding_window,
        sliding_window_pattern=sliding_window_pattern,
        layer_types=layer_types,
        query_pre_attn_scalar=query_pre_attn_scalar,
        attn_logit_softcapping=attn_logit_softcapping,
        final_logit_softcapping=final_logit_softcapping,
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        lora=lora,
    )
    if quantize_base:
        # As torchtune's QLoRA builders: the NF4 weights are saved in the embedding's dtype.
        _register_reparametrize_state_dict_hooks(model, dtype=model.tok_embeddings.weight.dtype)
    return model
