"""Component builders of the Qwen3 MoE models: :func:`qwen3_moe` and :func:`lora_qwen3_moe`.

Qwen3 MoE is dense Qwen3 (its attention with QK-norm before RoPE, bias-free projections, an
explicit ``head_dim``, rotate-half RoPE: built here by :mod:`exactga.models.qwen3`'s own
functions) with the MLP of each sparse layer replaced by an
:class:`~exactga.models.moe.MoEBlock`: a top-k softmax router and ``num_experts`` SwiGLU
experts of width ``moe_intermediate_dim``, no shared expert. Hugging Face's rule for which
layers are sparse is kept: layer ``i`` is dense (a SwiGLU MLP of width ``intermediate_dim``)
if it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; the released
models have every layer sparse.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import TransformerDecoder
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.peft import LORA_ATTN_MODULES

from exactga.models.moe import (
    GroupedExperts,
    LoRAStackedLinear,
    MoEBlock,
    StackedLinear,
    TopKRouter,
)
from exactga.models.moe.experts import EXPERT_PATHS, ExpertPath

# Dense Qwen3's building blocks: the MoE family differs from it in the MLP only.
from exactga.models.qwen3._component_builders import (
    ATTENTION_PROJECTIONS,
    _Adapters,
    _decoder,
    _decoder_layer,
    _qwen3_mlp,
    _qwen3_self_attention,
    resolved_head_dim,
)


def is_sparse_layer(index: int, decoder_sparse_step: int, mlp_only_layers: tuple[int, ...]) -> bool:
    """Whether layer ``index`` has experts: Hugging Face ``Qwen3MoeDecoderLayer``'s rule."""
    return index not in mlp_only_layers and (index + 1) % decoder_sparse_step == 0


def _moe_block(
    *,
    embed_dim: int,
    moe_intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    norm_topk_prob: bool,
    expert_path: ExpertPath,
    adapters: _Adapters | None,
    adapt_experts: bool,
    adapt_router: bool,
) -> MoEBlock:
    """One sparse layer's MLP; the experts' and the router's adapters as asked."""

    def projection(in_dim: int, out_dim: int) -> StackedLinear | LoRAStackedLinear:
        if adapters is None or not adapt_experts:
            return StackedLinear(num_experts, in_dim, out_dim)
        return LoRAStackedLinear(
            num_experts,
            in_dim,
            out_dim,
            rank=adapters.rank,
            alpha=adapters.alpha,
            dropout=adapters.dropout,
        )

    experts = GroupedExperts(
        w1=projection(embed_dim, moe_intermediate_dim),
        w2=projection(moe_intermediate_dim, embed_dim),
        w3=projection(embed_dim, moe_intermediate_dim),
        path=expert_path,
    )
    # The router's base is never quantised: it is small and its logits decide the routing.
    gate = None
    if adapters is not None and adapt_router:
        gate = adapters.linear(embed_dim, num_experts, quantize_base=False)
    router = TopKRouter(embed_dim, num_experts, num_experts_per_tok, norm_topk_prob, gate=gate)
    return MoEBlock(router, experts)


def _qwen3_moe_decoder(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    moe_intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_seq_len: int,
    head_dim: int | None,
    norm_topk_prob: bool,
    intermediate_dim: int | None,
    mlp_only_layers: tuple[int, ...],
    decoder_sparse_step: int,
    attn_dropout: float,
    norm_eps: float,
    rope_base: float,
    tie_word_embeddings: bool,
    expert_path: ExpertPath,
    adapters: _Adapters | None = None,
    lora_modules: tuple[str, ...] = (),
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    apply_lora_to_router: bool = False,
) -> TransformerDecoder:
    """The decoder both public builders make; ``adapters=None`` adapts nothing."""
    _check_layer_kinds(num_layers, intermediate_dim, mlp_only_layers, decoder_sparse_step)
    if expert_path not in EXPERT_PATHS:
        raise ValueError(f"expert_path={expert_path!r}: give one of {list(EXPERT_PATHS)}")
    head_dim = resolved_head_dim(embed_dim, num_heads, head_dim)
    num_kv_heads = num_kv_heads if num_kv_heads else num_heads
    # One RoPE module for all layers, as dense Qwen3 (its cache is per position, not per layer).
    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    mlp_adapters = adapters if apply_lora_to_mlp else None
    layers = nn.ModuleList()
    for index in range(num_layers):
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
        if is_sparse_layer(index, decoder_sparse_step, mlp_only_layers):
            mlp = _moe_block(
                embed_dim=embed_dim,
                moe_intermediate_dim=moe_intermediate_dim,
                num_experts=num_experts,
                num_experts_per_tok=num_experts_per_tok,
                norm_topk_prob=norm_topk_prob,
                expert_path=expert_path,
                adapters=adapters,
                adapt_experts=apply_lora_to_mlp,
                adapt_router=apply_lora_to_router,
            )
        else:
            mlp = _qwen3_mlp(embed_dim, intermediate_dim, mlp_adapters)
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


def _check_layer_kinds(
    num_layers: int,
    intermediate_dim: int | None,
    mlp_only_layers: tuple[int, ...],
    decoder_sparse_step: int,
) -> None:
    if decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={decoder_sparse_step}: give 1 or more")
    outside = [index for index in mlp_only_layers if not 0 <= index < num_layers]
    if outside:
        raise ValueError(
            f"mlp_only_layers={list(mlp_only_layers)}: layers {outside} are not in "
            f"0..{num_layers - 1}"
        )
    has_dense = any(
        not is_sparse_layer(index, decoder_sparse_step, mlp_only_layers)
        for index in range(num_layers)
    )
    if has_dense and intermediate_dim is None:
        raise ValueError(
            "intermediate_dim is needed: mlp_only_layers / decoder_sparse_step make some "
            "layers dense, and a dense layer's MLP is intermediate_dim wide"
        )


def qwen3_moe(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    moe_intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_seq_len: int,
    head_dim: int | None = None,
    norm_topk_prob: bool = True,
    intermediate_dim: int | None = None,
    mlp_only_layers: tuple[int, ...] | list[int] = (),
    decoder_sparse_step: int = 1,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
    expert_path: ExpertPath = "auto",
) -> TransformerDecoder:
    """A Qwen3 MoE decoder (Hugging Face's ``Qwen3MoeForCausalLM``).

    Args:
        vocab_size: number of tokens in the vocabulary.
        num_layers: number of transformer layers.
        num_heads: number of query heads.
        num_kv_heads: number of key/value heads (GQA); divides ``num_heads``.
        embed_dim: the model width, HF's ``hidden_size``.
        moe_intermediate_dim: each expert's hidden width, HF's ``moe_intermediate_size``.
        num_experts: experts per sparse layer, HF's ``num_experts``.
        num_experts_per_tok: experts each token goes through (top-k).
        max_seq_len: the longest sequence RoPE's cache (and a KV-cache) covers.
        head_dim: the width of one head; ``None`` means ``embed_dim // num_heads``.
        norm_topk_prob: renormalise the top-k router probabilities to sum to one (true in the
            released configs; transformers' ``Qwen3MoeConfig`` defaults to false).
        intermediate_dim: a dense layer's MLP width, HF's ``intermediate_size``; needed only
            when some layer is dense.
        mlp_only_layers: layers with a dense MLP instead of experts.
        decoder_sparse_step: every ``decoder_sparse_step``-th layer is sparse (HF's rule).
        attn_dropout: dropout in scaled dot-product attention while training.
        norm_eps: epsilon of every RMSNorm.
        rope_base: RoPE's base period, HF's ``rope_theta``.
        tie_word_embeddings: the output projection is the token embedding.
        expert_path: how the experts run (``exactga.models.moe.ExpertPath``).

    Returns:
        TransformerDecoder: the model; each sparse layer's ``mlp`` a
        :class:`~exactga.models.moe.MoEBlock`.

    Raises:
        ValueError: a dense layer without ``intermediate_dim``, a layer index outside the
            model, ``decoder_sparse_step`` below 1, ``num_experts_per_tok`` above
            ``num_experts``, or an unknown ``expert_path``.
    """
    return _qwen3_moe_decoder(**_shape_arguments(locals()))


def _shape_arguments(arguments: dict) -> dict:
    """A public builder's shape arguments as the decoder takes them."""
    shapes = {key: value for key, value in arguments.items() if key in _SHAPE_ARGUMENTS}
    shapes["mlp_only_layers"] = tuple(shapes["mlp_only_layers"])  # a YAML list arrives as list
    return shapes


_SHAPE_ARGUMENTS = (
    "vocab_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "embed_dim",
    "moe_intermediate_dim",
    "num_experts",
    "num_experts_per_tok",
    "max_seq_len",
    "head_dim",
    "norm_topk_prob",
    "intermediate_dim",
    "mlp_only_layers",
    "decoder_sparse_step",
    "attn_dropout",
    "norm_eps",
    "rope_base",
    "tie_word_embeddings",
    "expert_path",
)


def lora_qwen3_moe(
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
    moe_intermediate_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_seq_len: int,
    head_dim: int | None = None,
    norm_topk_prob: bool = True,
    intermediate_dim: int | None = None,
    mlp_only_layers: tuple[int, ...] | list[int] = (),
    decoder_sparse_step: int = 1,
    attn_dropout: float = 0.0,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
    expert_path: ExpertPath = "auto",
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """:func:`qwen3_moe` with LoRA adapters.

    Args:
        lora_attn_modules: the attention projections to adapt, among ``q_proj``, ``k_proj``,
            ``v_proj``, ``output_proj`` (LoRA or DoRA linears).
        apply_lora_to_mlp: adapt every expert's ``w1``/``w2``/``w3`` (one LoRA pair per expert,
            stacked: :class:`~exactga.models.moe.LoRAStackedLinear`), and a dense layer's MLP.
        apply_lora_to_output: adapt the output projection (untied models only).
        apply_lora_to_router: adapt each sparse layer's router gate (a LoRA linear).
        vocab_size, ..., expert_path: as :func:`qwen3_moe`.
        lora_rank: rank of each adapter.
        lora_alpha: adapter scaling numerator (the scale is ``lora_alpha / lora_rank``).
        lora_dropout: dropout on the adapters' input.
        use_dora: DoRA for the adapted linears; the experts' stacked adapters are LoRA only.
        quantize_base: NF4 frozen weights (QLoRA) for the adapted attention and dense-MLP
            linears; the experts' stacked weights and the router stay in the model's dtype.

    Returns:
        TransformerDecoder: the model with adapters.

    Raises:
        ValueError: as :func:`qwen3_moe`; ``lora_attn_modules`` empty or naming another module;
            ``apply_lora_to_output`` with ``tie_word_embeddings``; ``use_dora`` with
            ``apply_lora_to_mlp``.
    """
    unknown = set(lora_attn_modules) - set(ATTENTION_PROJECTIONS)
    if not lora_attn_modules or unknown:
        raise ValueError(
            f"lora_attn_modules={list(lora_attn_modules)}: give one or more of "
            f"{list(ATTENTION_PROJECTIONS)}"
        )
    if apply_lora_to_output and tie_word_embeddings:
        raise ValueError(
            "apply_lora_to_output is incompatible with tie_word_embeddings: the output "
            "projection is the token embedding, so there is no output linear to adapt."
        )
    if use_dora and apply_lora_to_mlp:
        raise ValueError(
            "use_dora with apply_lora_to_mlp: the experts' stacked adapters are LoRA only; "
            "set apply_lora_to_mlp to false or use_dora to false."
        )
    adapters = _Adapters(lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base)
    model = _qwen3_moe_decoder(
        **_shape_arguments(locals()),
        adapters=adapters,
        lora_modules=tuple(lora_attn_modules),
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        apply_lora_to_router=apply_lora_to_router,
    )
    if quantize_base:
        # As torchtune's QLoRA builders: the state dict holds NF4 weights dequantised (on CPU).
        model._register_state_dict_hook(
            partial(
                reparametrize_as_dtype_state_dict_post_hook,
                dtype=model.tok_embeddings.weight.dtype,
                offload_to_cpu=True,
            )
        )
    return model
