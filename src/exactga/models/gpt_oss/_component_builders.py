"""Component builders of the gpt-oss models: :func:`gpt_oss` and :func:`lora_gpt_oss`.

The decoder Hugging Face's ``GptOssForCausalLM`` defines (``GptOssConfig``), from torchtune's
modules and exactga's:

- every layer: RMSNorm, attention, RMSNorm, a mixture-of-experts MLP (no dense layer);
- attention (:class:`~exactga.models.gpt_oss._attention.GptOssAttention`): biased q/k/v/output
  projections, GQA, scale ``head_dim ** -0.5``, no QK-norm, one learned sink per query head,
  a sliding window of ``sliding_window`` keys (the query's own included, as transformers) on
  the layers ``layer_types`` marks ``"sliding_attention"`` (released: even layers), full
  causal attention on the others;
- one YaRN rotate-half RoPE shared by all layers (``_positional_embeddings``);
- the MoE layer (:class:`~exactga.models.moe.MoEBlock`): a biased router whose top-k logits'
  softmax weighs the experts, ``num_experts`` experts with biased projections and the clamped
  SwiGLU (``_moe``); the router statistics feed the load-balancing term as for Qwen3 MoE;
- an untied output projection without bias.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from torch import nn
from torchtune.modules import RMSNorm, TransformerDecoder, TransformerSelfAttentionLayer
from torchtune.modules.peft import LORA_ATTN_MODULES, DoRALinear, LoRALinear

from exactga.models.gemma3._component_builders import FULL, SLIDING
from exactga.models.gpt_oss._attention import GptOssAttention
from exactga.models.gpt_oss._moe import (
    BiasedStackedLinear,
    ClampedSwiGLUExperts,
    GptOssRouter,
    LoRABiasedStackedLinear,
)
from exactga.models.gpt_oss._positional_embeddings import YarnRotaryPositionalEmbeddings
from exactga.models.moe import MoEBlock
from exactga.models.moe.experts import EXPERT_PATHS, ExpertPath

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "output_proj")


def gpt_oss_layer_types(num_layers: int, layer_types: Sequence[str] | None = None) -> list[str]:
    """Each layer's kind as ``GptOssConfig`` derives it: ``layer_types`` if given, else even
    layers sliding and odd layers full."""
    if layer_types is None:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    kinds = list(layer_types)
    if len(kinds) != num_layers or not set(kinds) <= {SLIDING, FULL}:
        raise ValueError(
            f"layer_types must name {num_layers} layers, each {SLIDING!r} or {FULL!r}; got {kinds}"
        )
    return kinds


class _Adapters:
    """How :func:`lora_gpt_oss` makes the linears it adapts (biased ones, as gpt-oss's)."""

    def __init__(self, rank: int, alpha: float, dropout: float, use_dora: bool) -> None:
        self.rank, self.alpha, self.dropout, self.use_dora = rank, alpha, dropout, use_dora

    def linear(self, in_dim: int, out_dim: int, *, bias: bool) -> nn.Module:
        adapter_cls = DoRALinear if self.use_dora else LoRALinear
        return adapter_cls(
            in_dim, out_dim, rank=self.rank, alpha=self.alpha, dropout=self.dropout, use_bias=bias
        )

    def stacked(self, num_experts: int, in_dim: int, out_dim: int) -> LoRABiasedStackedLinear:
        return LoRABiasedStackedLinear(
            num_experts, in_dim, out_dim, rank=self.rank, alpha=self.alpha, dropout=self.dropout
        )


def _attention(
    *,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    attn_dropout: float,
    sliding_window: int | None,
    rope: nn.Module,
    adapters: _Adapters | None,
    lora_modules: tuple[str, ...],
) -> GptOssAttention:
    def projection(name: str, in_dim: int, out_dim: int) -> nn.Module:
        if adapters is not None and name in lora_modules:
            return adapters.linear(in_dim, out_dim, bias=True)
        return nn.Linear(in_dim, out_dim, bias=True)

    return GptOssAttention(
        embed_dim=embed_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_proj=projection("q_proj", embed_dim, num_heads * head_dim),
        k_proj=projection("k_proj", embed_dim, num_kv_heads * head_dim),
        v_proj=projection("v_proj", embed_dim, num_kv_heads * head_dim),
        output_proj=projection("output_proj", num_heads * head_dim, embed_dim),
        pos_embeddings=rope,
        max_seq_len=max_seq_len,
        attn_dropout=attn_dropout,
        sliding_window=sliding_window,
    )


def _moe_block(
    *,
    embed_dim: int,
    intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    swiglu_alpha: float,
    swiglu_limit: float,
    expert_path: ExpertPath,
    expert_adapters: _Adapters | None,
    router_adapters: _Adapters | None,
) -> MoEBlock:
    """One layer's MLP; the experts and the router's gate adapted as asked."""

    def projection(in_dim: int, out_dim: int) -> nn.Module:
        if expert_adapters is None:
            return BiasedStackedLinear(num_experts, in_dim, out_dim)
        return expert_adapters.stacked(num_experts, in_dim, out_dim)

    experts = ClampedSwiGLUExperts(
        w1=projection(embed_dim, intermediate_dim),
        w2=projection(intermediate_dim, embed_dim),
        w3=projection(embed_dim, intermediate_dim),
        path=expert_path,
        alpha=swiglu_alpha,
        limit=swiglu_limit,
    )
    gate = None
    if router_adapters is not None:
        gate = router_adapters.linear(embed_dim, num_experts, bias=True)
    return MoEBlock(GptOssRouter(embed_dim, num_experts, num_experts_per_tok, gate=gate), experts)


def _gpt_oss_decoder(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_seq_len: int,
    head_dim: int,
    sliding_window: int,
    layer_types: Sequence[str] | None,
    attn_dropout: float,
    norm_eps: float,
    rope_base: float,
    rope_scaling_factor: float,
    rope_original_max_seq_len: int,
    rope_beta_fast: float,
    rope_beta_slow: float,
    rope_truncate: bool,
    swiglu_alpha: float,
    swiglu_limit: float,
    expert_path: ExpertPath,
    adapters: _Adapters | None = None,
    lora_modules: tuple[str, ...] = (),
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    apply_lora_to_router: bool = False,
) -> TransformerDecoder:
    """The decoder both public builders make; ``adapters=None`` adapts nothing."""
    if expert_path not in EXPERT_PATHS:
        raise ValueError(f"expert_path={expert_path!r}: give one of {list(EXPERT_PATHS)}")
    kinds = gpt_oss_layer_types(num_layers, layer_types)
    # One RoPE for all layers: it computes cos/sin for the positions it is given, no cache.
    rope = YarnRotaryPositionalEmbeddings(
        head_dim,
        rope_base,
        rope_scaling_factor,
        rope_original_max_seq_len,
        rope_beta_fast,
        rope_beta_slow,
        rope_truncate,
    )
    layers = nn.ModuleList()
    for kind in kinds:
        attn = _attention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_seq_len=max_seq_len,
            attn_dropout=attn_dropout,
            sliding_window=sliding_window if kind == SLIDING else None,
            rope=rope,
            adapters=adapters,
            lora_modules=lora_modules,
        )
        mlp = _moe_block(
            embed_dim=embed_dim,
            intermediate_dim=intermediate_dim,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit,
            expert_path=expert_path,
            expert_adapters=adapters if apply_lora_to_mlp else None,
            router_adapters=adapters if apply_lora_to_router else None,
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=mlp,
                sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            )
        )
    output = (
        adapters.linear(embed_dim, vocab_size, bias=False)
        if adapters is not None and apply_lora_to_output
        else nn.Linear(embed_dim, vocab_size, bias=False)
    )
    return TransformerDecoder(
        tok_embeddings=nn.Embedding(vocab_size, embed_dim),
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )


def gpt_oss(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_seq_len: int,
    head_dim: int = 64,
    sliding_window: int = 128,
    layer_types: Sequence[str] | None = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-5,
    rope_base: float = 150_000.0,
    rope_scaling_factor: float = 32.0,
    rope_original_max_seq_len: int = 4096,
    rope_beta_fast: float = 32.0,
    rope_beta_slow: float = 1.0,
    rope_truncate: bool = False,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    expert_path: ExpertPath = "auto",
) -> TransformerDecoder:
    """A gpt-oss decoder (Hugging Face's ``GptOssForCausalLM``).

    Args:
        vocab_size: number of tokens in the vocabulary.
        num_layers: number of transformer layers, each with experts.
        num_heads: number of query heads (and of sinks per layer).
        num_kv_heads: number of key/value heads (GQA); divides ``num_heads``.
        embed_dim: the model width, HF's ``hidden_size``.
        intermediate_dim: each expert's hidden width, HF's ``intermediate_size``.
        num_experts: experts per layer, HF's ``num_local_experts``.
        num_experts_per_tok: experts each token goes through (top-k).
        max_seq_len: the longest sequence (a KV-cache's size; RoPE has no cache).
        head_dim: the width of one head.
        sliding_window: keys a query sees in a sliding layer, itself included.
        layer_types: each layer's ``"sliding_attention"`` or ``"full_attention"``; ``None``
            alternates, sliding first (HF's default and the release).
        attn_dropout: dropout on the attention probabilities while training.
        norm_eps: epsilon of every RMSNorm.
        rope_base: RoPE's base, HF's ``rope_theta``.
        rope_scaling_factor: YaRN's ``factor``.
        rope_original_max_seq_len: YaRN's ``original_max_position_embeddings``.
        rope_beta_fast: YaRN's ``beta_fast``.
        rope_beta_slow: YaRN's ``beta_slow``.
        rope_truncate: YaRN's ``truncate`` (false in the release; HF's default is true).
        swiglu_alpha: the clamped SwiGLU's sigmoid gain.
        swiglu_limit: the clamped SwiGLU's clamp.
        expert_path: how the experts run (``exactga.models.moe.ExpertPath``).

    Returns:
        TransformerDecoder: the model; each layer's ``mlp`` a
        :class:`~exactga.models.moe.MoEBlock`, each ``attn`` with ``sinks``.

    Raises:
        ValueError: ``layer_types`` of the wrong length or kind, an unknown ``expert_path``,
            ``num_experts_per_tok`` above ``num_experts``.
    """
    return _gpt_oss_decoder(**_shape_arguments(locals()))


_SHAPE_ARGUMENTS = tuple(inspect.signature(gpt_oss).parameters)


def _shape_arguments(arguments: dict) -> dict:
    """A public builder's shape arguments as the decoder takes them."""
    return {key: value for key, value in arguments.items() if key in _SHAPE_ARGUMENTS}


def lora_gpt_oss(
    lora_attn_modules: list[LORA_ATTN_MODULES],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    apply_lora_to_router: bool = False,
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_seq_len: int,
    head_dim: int = 64,
    sliding_window: int = 128,
    layer_types: Sequence[str] | None = None,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-5,
    rope_base: float = 150_000.0,
    rope_scaling_factor: float = 32.0,
    rope_original_max_seq_len: int = 4096,
    rope_beta_fast: float = 32.0,
    rope_beta_slow: float = 1.0,
    rope_truncate: bool = False,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    expert_path: ExpertPath = "auto",
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
) -> TransformerDecoder:
    """:func:`gpt_oss` with LoRA adapters.

    Args:
        lora_attn_modules: the attention projections to adapt, among ``q_proj``, ``k_proj``,
            ``v_proj``, ``output_proj`` (biased LoRA or DoRA linears).
        apply_lora_to_mlp: adapt every expert's ``w1``/``w2``/``w3`` (stacked per-expert LoRA
            pairs, the experts' biases frozen with their weights).
        apply_lora_to_output: adapt the output projection.
        apply_lora_to_router: adapt each layer's router gate.
        vocab_size, ..., expert_path: as :func:`gpt_oss`.
        lora_rank: rank of each adapter.
        lora_alpha: adapter scaling numerator (the scale is ``lora_alpha / lora_rank``).
        lora_dropout: dropout on the adapters' input.
        use_dora: DoRA for the adapted linears; the experts' stacked adapters are LoRA only.

    The sinks are no adapter: a LoRA recipe trains the adapters only, so they stay frozen.

    Returns:
        TransformerDecoder: the model with adapters.

    Raises:
        ValueError: as :func:`gpt_oss`; ``lora_attn_modules`` empty or naming another module;
            ``use_dora`` with ``apply_lora_to_mlp``.
    """
    unknown = set(lora_attn_modules) - set(ATTENTION_PROJECTIONS)
    if not lora_attn_modules or unknown:
        raise ValueError(
            f"lora_attn_modules={list(lora_attn_modules)}: give one or more of "
            f"{list(ATTENTION_PROJECTIONS)}"
        )
    if use_dora and apply_lora_to_mlp:
        raise ValueError(
            "use_dora with apply_lora_to_mlp: the experts' stacked adapters are LoRA only; "
            "set apply_lora_to_mlp to false or use_dora to false."
        )
    return _gpt_oss_decoder(
        **_shape_arguments(locals()),
        adapters=_Adapters(lora_rank, lora_alpha, lora_dropout, use_dora),
        lora_modules=tuple(lora_attn_modules),
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        apply_lora_to_router=apply_lora_to_router,
    )
