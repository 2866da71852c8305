"""Qwen3 MoE (exactga.models.qwen3_moe, on the MoE layer of exactga.models.moe) computes what
Hugging Face's ``Qwen3MoeForCausalLM`` computes, its format converts weights the way
transformers reads and writes them, and its router statistics give Hugging Face's
load-balancing loss and sum over micro-batches.

All in-process, fp32, tiny random models (2 layers, 8 experts, top-2, width 64, head_dim 16 not
64 // 4, grouped attention), every weight random (norm scales around one).

- HF -> ours: a transformers model saved with ``save_pretrained`` (per-expert keys on disk)
  read by exactga's checkpointer (``QWEN3_MOE``) loads with ``strict=True`` and gives the same
  logits, also for a right-padded batch and with a dense layer (``mlp_only_layers``).
- ours -> HF: the checkpointer's save loads with ``from_pretrained`` (no missing or unexpected
  key) into a model with our logits.
- experts: the per-expert loop, ``torch._grouped_mm`` (fp32 runs on CPU in torch 2.13) and a
  naive dense reference agree, forward and backward, with and without adapters.
- router statistics: our recorded logits are HF's; HF's ``load_balancing_loss_func`` is
  ``top_k`` times ours on the layer-summed statistics (without and with padding); statistics
  summed over micro-batches give the loss of the concatenated batch; padding does not count.
- LoRA: adapters start as identity; ``apply_lora_to_mlp`` makes the experts' stacked factors
  trainable; torchtune's merge folds them in exactly; PEFT loads the attention/output adapters
  with our logits, and the experts' are left out of the PEFT file with a warning.
- sizes: the sized builders' parameter counts (meta device) are transformers' for the same
  ``config.json``.
"""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointError
from torchtune import training
from torchtune.models.convert_weights import tune_to_peft_adapter_config
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_merged_lora_ckpt,
    set_trainable_params,
)

from exactga.models.checkpointer import FullModelHFCheckpointer
from exactga.models.moe import (
    GroupedExperts,
    LoRAStackedLinear,
    MoEBlock,
    StackedLinear,
    expert_load_ratio,
    load_balancing_loss,
    moe_blocks,
    recording_router_stats,
    router_entropy_mean,
    router_recording_context_fn,
    router_z_loss,
    sum_router_stats,
)
from exactga.models.qwen3_moe import (
    BUILDER_ARGUMENTS,
    QWEN3_MOE_FORMAT,
    lora_qwen3_moe,
    qwen3_moe,
    qwen3_moe_30b_a3b,
    qwen3_moe_235b_a22b,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
hf_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

BOUND = 1e-5  # relative L2 of the logits, fp32
VOCAB = 300
NUM_EXPERTS, TOP_K = 8, 2
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "head_dim": 16,
    "moe_intermediate_dim": 32,
    "num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "max_seq_len": 64,
    "rope_base": 10_000.0,
}
WITH_DENSE_LAYER = {"mlp_only_layers": [1], "intermediate_dim": 48}
ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "output_proj"]
LORA = {"lora_rank": 4, "lora_alpha": 8.0}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def randomize_(model: nn.Module, seed: int = 0) -> None:
    """Every parameter random: scales (1-d) around one, matrices around zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.3 * noise if parameter.ndim == 1 else 0.3 * noise)


def tokens(batch: int = 2, length: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def right_padding_mask(lengths: list[int], length: int) -> torch.Tensor:
    return torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]


def hf_reference_config(dense_layer: bool = False) -> Any:
    """transformers' config of the tiny model, written out here (not by ``hf_config``)."""
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=TINY["embed_dim"],
        intermediate_size=WITH_DENSE_LAYER["intermediate_dim"],
        moe_intermediate_size=TINY["moe_intermediate_dim"],
        num_hidden_layers=TINY["num_layers"],
        num_attention_heads=TINY["num_heads"],
        num_key_value_heads=TINY["num_kv_heads"],
        head_dim=TINY["head_dim"],
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        mlp_only_layers=WITH_DENSE_LAYER["mlp_only_layers"] if dense_layer else [],
        max_position_embeddings=TINY["max_seq_len"],
        rms_norm_eps=1e-6,
        rope_theta=TINY["rope_base"],
        tie_word_embeddings=False,
    )


def tiny_kwargs(dense_layer: bool = False) -> dict[str, Any]:
    return {**TINY, **(WITH_DENSE_LAYER if dense_layer else {})}


def load_hf_model(folder: Path) -> Any:
    """``from_pretrained`` in fp32 with eager attention; fails on any missing/unexpected key."""
    model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        folder, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def hf_saved_model(folder: Path, dense_layer: bool = False) -> Path:
    """A random transformers Qwen3 MoE, written by ``save_pretrained``."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hf_reference_config(dense_layer))
    randomize_(model)
    model.save_pretrained(folder)
    return folder


def checkpointer_for(folder: Path, output_dir: Path) -> FullModelHFCheckpointer:
    return FullModelHFCheckpointer(
        checkpoint_dir=str(folder),
        checkpoint_files=["model.safetensors"],
        model_type="QWEN3_MOE",
        output_dir=str(output_dir),
    )


def ours_through_checkpointer(folder: Path, dense_layer: bool = False) -> nn.Module:
    weights = checkpointer_for(folder, folder.parent / "out").load_checkpoint()
    model = qwen3_moe(**tiny_kwargs(dense_layer))
    model.load_state_dict(weights[training.MODEL_KEY], strict=True)
    return model.eval()


def save_hf_folder(folder: Path, weights: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# --- Hugging Face -> ours --------------------------------------------------------------------


def test_transformers_writes_per_expert_keys_and_holds_fused_ones(tmp_path: Path) -> None:
    """What the conversion is written against (see [Qwen3 MoE expert layouts])."""
    folder = hf_saved_model(tmp_path / "hf")
    on_disk = load_file(folder / "model.safetensors")
    assert on_disk["model.layers.0.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert on_disk["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert on_disk["model.layers.0.mlp.gate.weight"].shape == (NUM_EXPERTS, 64)
    in_memory = load_hf_model(folder).state_dict()
    assert in_memory["model.layers.0.mlp.experts.gate_up_proj"].shape == (NUM_EXPERTS, 64, 64)
    fused = QWEN3_MOE_FORMAT.hf_to_tune(in_memory, {})
    per_expert = QWEN3_MOE_FORMAT.hf_to_tune(on_disk, {"num_experts": NUM_EXPERTS})
    assert fused.keys() == per_expert.keys()
    assert all(torch.equal(fused[key], per_expert[key]) for key in fused)


@pytest.mark.parametrize("dense_layer", [False, True], ids=["all-sparse", "mlp-only-layer"])
def test_hf_weights_give_hf_logits(tmp_path: Path, dense_layer: bool) -> None:
    folder = hf_saved_model(tmp_path / "hf", dense_layer)
    hf = load_hf_model(folder)
    ours = ours_through_checkpointer(folder, dense_layer)
    ids = tokens()
    with torch.no_grad():
        assert relative_error(ours(ids), hf(ids).logits) < BOUND
    assert isinstance(ours.layers[0].mlp, MoEBlock)
    assert isinstance(ours.layers[1].mlp, MoEBlock) is not dense_layer


def test_padded_batch_gives_hf_logits_on_its_tokens(tmp_path: Path) -> None:
    """Right padding: the real tokens' logits are HF's with its attention mask (no capacity,
    so padding tokens cannot push real ones out of an expert)."""
    folder = hf_saved_model(tmp_path / "hf")
    hf = load_hf_model(folder)
    ours = ours_through_checkpointer(folder)
    ids, mask = tokens(batch=3), right_padding_mask([11, 6, 3], 11)
    with torch.no_grad():
        reference = hf(ids, attention_mask=mask.long()).logits[mask]
        assert relative_error(ours(ids)[mask], reference) < BOUND


def test_missing_expert_is_named(tmp_path: Path) -> None:
    on_disk = load_file(hf_saved_model(tmp_path / "hf") / "model.safetensors")
    del on_disk["model.layers.1.mlp.experts.7.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.7\.up_proj"):
        QWEN3_MOE_FORMAT.hf_to_tune(on_disk, {"num_experts": NUM_EXPERTS})
    with pytest.raises(ValueError, match="shared_expert"):
        QWEN3_MOE_FORMAT.hf_to_tune({"model.layers.0.mlp.shared_expert.w": torch.zeros(1)}, {})


# --- ours -> Hugging Face --------------------------------------------------------------------


def test_our_save_loads_in_transformers_with_our_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ours = qwen3_moe(**tiny_kwargs(dense_layer=True)).eval()
    randomize_(ours, seed=3)
    config = QWEN3_MOE_FORMAT.hf_config(tiny_kwargs(dense_layer=True))
    state = ours.state_dict()
    hf_weights = QWEN3_MOE_FORMAT.tune_to_hf(state, config)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in hf_weights
    back = QWEN3_MOE_FORMAT.hf_to_tune(hf_weights, config)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[key], state[key]) for key in state)

    initial = save_hf_folder(tmp_path / "init", hf_weights, config)
    checkpointer = checkpointer_for(initial, tmp_path / "out")
    loaded = checkpointer.load_checkpoint()[training.MODEL_KEY]
    checkpointer.save_checkpoint({training.MODEL_KEY: loaded}, epoch=0)
    hf = load_hf_model(tmp_path / "out" / "epoch_0")
    assert hf.config.num_experts == NUM_EXPERTS and hf.config.norm_topk_prob is True
    assert hf.config.mlp_only_layers == [1]
    with torch.no_grad():
        assert relative_error(ours(tokens()), hf(tokens()).logits) < BOUND


def test_hf_config_refusals() -> None:
    incomplete = {key: value for key, value in TINY.items() if key != "num_experts"}
    with pytest.raises(ValueError, match="num_experts"):
        QWEN3_MOE_FORMAT.hf_config(incomplete)
    with pytest.raises(ValueError, match="intermediate_dim"):
        qwen3_moe(**{**TINY, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        qwen3_moe(**{**TINY, "num_experts_per_tok": NUM_EXPERTS + 1})
    with pytest.raises(ValueError, match="expert_path"):
        qwen3_moe(**TINY, expert_path="fast")


# --- experts: grouped, loop, naive -----------------------------------------------------------


def naive_experts(
    experts: GroupedExperts, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token, kept where routed: the definition, no gathering."""
    output = torch.zeros_like(x)
    w1, w2, w3 = experts.w1.per_expert(), experts.w2.per_expert(), experts.w3.per_expert()
    for index in range(experts.num_experts):
        hidden = F.silu(w1[index](x)) * w3[index](x)
        routed_weight = (weights * (indices == index)).sum(dim=-1, keepdim=True)
        output = output + routed_weight * w2[index](hidden)
    return output


def random_experts(lora: bool) -> GroupedExperts:
    torch.manual_seed(0)
    if lora:

        def projection(i: int, o: int) -> LoRAStackedLinear:
            return LoRAStackedLinear(NUM_EXPERTS, i, o, **{"rank": 4, "alpha": 8.0})

    else:

        def projection(i: int, o: int) -> StackedLinear:
            return StackedLinear(NUM_EXPERTS, i, o)

    experts = GroupedExperts(projection(16, 24), projection(24, 16), projection(16, 24))
    randomize_(experts)
    return experts


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_grouped_loop_and_naive_experts_agree(lora: bool) -> None:
    experts = random_experts(lora)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(40, 16, generator=generator, requires_grad=True)
    # Expert 5 gets no token: the empty group must pass through both paths.
    choices = torch.tensor([0, 1, 2, 3, 4, 6, 7])
    indices = torch.stack(
        [choices[torch.randperm(7, generator=generator)[:TOP_K]] for _ in range(40)]
    )
    weights = torch.rand(40, TOP_K, generator=generator)
    upstream = torch.randn(40, 16, generator=generator)  # dense: see grouped_mm's CPU backward

    results = {}
    for path in ("loop", "grouped", "naive"):
        experts.zero_grad(), setattr(x, "grad", None)
        if path == "naive":
            output = naive_experts(experts, x, indices, weights)
        else:
            experts.path = path
            output = experts(x, indices, weights)
        output.backward(upstream)
        grads = {name: p.grad.clone() for name, p in experts.named_parameters()}
        results[path] = (output.detach(), x.grad.clone(), grads)
    reference_out, reference_x_grad, reference_grads = results["naive"]
    for path in ("loop", "grouped"):
        out, x_grad, grads = results[path]
        assert relative_error(out, reference_out) < 1e-6, path
        assert relative_error(x_grad, reference_x_grad) < 1e-6, path
        for name, grad in grads.items():
            assert torch.allclose(grad, reference_grads[name], atol=1e-5, rtol=1e-5), name
    assert results["loop"][2]["w1.weight"][5].abs().max() == 0  # the idle expert learns nothing


def test_auto_path_is_the_loop_on_cpu() -> None:
    experts = random_experts(lora=False)
    assert experts.path == "auto"
    assert not experts._use_grouped(torch.zeros(3, 16))


# --- router statistics and losses ------------------------------------------------------------


def hf_and_ours(tmp_path: Path) -> tuple[Any, nn.Module]:
    folder = hf_saved_model(tmp_path / "hf")
    return load_hf_model(folder), ours_through_checkpointer(folder)


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padded"])
def test_load_balancing_loss_is_hfs_over_top_k(tmp_path: Path, padded: bool) -> None:
    hf, ours = hf_and_ours(tmp_path)
    ids = tokens(batch=3)
    mask = right_padding_mask([11, 6, 3] if padded else [11] * 3, 11)
    with torch.no_grad():
        hf_out = hf(ids, attention_mask=mask.long(), output_router_logits=True)
        with recording_router_stats(ours, token_mask=mask, keep_logits=True) as blocks:
            ours(ids)
    per_layer = [block.last_router_stats for block in blocks]
    for layer, hf_logits in zip(per_layer, hf_out.router_logits, strict=True):
        assert relative_error(layer.logits, hf_logits[mask.reshape(-1)]) < BOUND
    total = sum_router_stats(per_layer)  # HF pools the layers' tokens
    assert total.num_tokens == len(per_layer) * mask.sum()
    ours_loss = load_balancing_loss(
        total.expert_counts, total.prob_sums, total.num_tokens, NUM_EXPERTS, TOP_K
    )
    assert torch.allclose(TOP_K * ours_loss, hf_out.aux_loss, rtol=1e-6)
    assert ours_loss > 1.0  # random routers are not balanced: a loss above uniform's


def test_statistics_summed_over_micro_batches_give_the_whole_batchs_loss() -> None:
    """See [router statistics are sums]: the micro-batches hold different numbers of real
    tokens, so a mean of per-micro-batch losses is another number, and the test sees it."""
    torch.manual_seed(0)
    model = qwen3_moe(**TINY).eval()
    randomize_(model)
    ids = tokens(batch=4)
    mask = right_padding_mask([11, 2, 9, 4], 11)

    def statistics(rows: slice) -> list:
        with torch.no_grad(), recording_router_stats(model, token_mask=mask[rows]) as blocks:
            model(ids[rows])
        return [block.last_router_stats for block in blocks]

    def losses(stats: Any) -> torch.Tensor:
        balance = load_balancing_loss(
            stats.expert_counts, stats.prob_sums, stats.num_tokens, NUM_EXPERTS, TOP_K
        )
        z = router_z_loss(stats.logsumexp_sq_sum, stats.num_tokens)
        entropy = router_entropy_mean(stats.entropy_sum, stats.num_tokens)
        return torch.stack([balance, z, entropy, expert_load_ratio(stats.expert_counts)])

    whole = statistics(slice(0, 4))
    first, second = statistics(slice(0, 1)), statistics(slice(1, 4))
    for layer in range(TINY["num_layers"]):
        summed = sum_router_stats([first[layer], second[layer]])
        assert torch.allclose(losses(summed), losses(whole[layer]), rtol=1e-5)
        mean_of_losses = (losses(first[layer]) + losses(second[layer])) / 2
        assert not torch.allclose(mean_of_losses[0], losses(whole[layer])[0], rtol=1e-3)


def test_padding_tokens_are_not_counted() -> None:
    torch.manual_seed(0)
    model = qwen3_moe(**TINY).eval()
    randomize_(model)
    ids = tokens(batch=1)
    with torch.no_grad():
        with recording_router_stats(model, right_padding_mask([7], 11)) as padded:
            model(ids)
        with recording_router_stats(model) as unpadded:
            model(ids[:, :7])  # the same real tokens, no padding at all
    for a, b in zip(padded, unpadded, strict=True):
        stats, reference = a.last_router_stats, b.last_router_stats
        assert stats.num_tokens == 7 and stats.expert_counts.sum() == 7 * TOP_K
        assert torch.equal(stats.expert_counts, reference.expert_counts)
        assert torch.allclose(stats.prob_sums, reference.prob_sums, rtol=1e-6)
        assert torch.allclose(stats.logsumexp_sq_sum, reference.logsumexp_sq_sum, rtol=1e-6)


def test_recording_is_off_outside_the_context_and_losses_train_the_router() -> None:
    torch.manual_seed(0)
    model = qwen3_moe(**TINY)
    randomize_(model)
    model(tokens())
    assert all(block.last_router_stats is None for block in moe_blocks(model))
    wrong_shape = torch.ones(3, 11, dtype=torch.bool)
    with pytest.raises(ValueError, match="token_mask"), recording_router_stats(model, wrong_shape):
        model(tokens())
    with recording_router_stats(model) as blocks:
        model(tokens())
    stats = sum_router_stats([block.last_router_stats for block in blocks])
    loss = load_balancing_loss(
        stats.expert_counts, stats.prob_sums, stats.num_tokens, NUM_EXPERTS, TOP_K
    ) + router_z_loss(stats.logsumexp_sq_sum, stats.num_tokens)
    loss.backward()
    assert blocks[0].router.gate.weight.grad.abs().sum() > 0


def _checkpointed(model: nn.Module, **wrapper_kwargs: Any) -> nn.Module:
    """``model`` with each layer's activations checkpointed, as the recipes' setup does."""
    wrapper = partial(checkpoint_wrapper, **wrapper_kwargs)
    training.set_activation_checkpointing(
        model, auto_wrap_policy={TransformerSelfAttentionLayer}, checkpoint_wrapper_fn=wrapper
    )
    return model


def _gradients_of_loss_and_balance(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of a token loss plus the balance term over the rows' real tokens."""
    ids, mask = tokens(batch=3), right_padding_mask([11, 6, 3], 11)
    with recording_router_stats(model, token_mask=mask) as blocks:
        logits = model(ids)
    stats = sum_router_stats([block.last_router_stats for block in blocks])
    balance = load_balancing_loss(
        stats.expert_counts, stats.prob_sums, stats.num_tokens, NUM_EXPERTS, TOP_K
    )
    (logits[mask].logsumexp(dim=-1).mean() + balance).backward()  # after recording stopped
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_recomputes_the_recorded_router_statistics() -> None:
    """See [router recording under activation checkpointing]: the recomputation, which runs
    in the backward after recording stopped, records with the forward's token mask, so the
    gradients are those without checkpointing; a plain checkpoint wrapper cannot recompute."""
    torch.manual_seed(0)
    plain = qwen3_moe(**TINY)
    randomize_(plain)
    replaying, bare = copy.deepcopy(plain), copy.deepcopy(plain)
    expected = _gradients_of_loss_and_balance(plain)
    _checkpointed(replaying, context_fn=router_recording_context_fn(replaying))
    got = _gradients_of_loss_and_balance(replaying)
    assert {name.replace("._checkpoint_wrapped_module", "") for name in got} == expected.keys()
    for name, grad in got.items():
        reference = expected[name.replace("._checkpoint_wrapped_module", "")]
        assert relative_error(grad, reference) < BOUND, name
    with pytest.raises(CheckpointError):
        _gradients_of_loss_and_balance(_checkpointed(bare))


def test_loss_formulas_at_the_extremes() -> None:
    uniform = torch.full((NUM_EXPERTS,), 10.0 * TOP_K / NUM_EXPERTS)
    probs = torch.full((NUM_EXPERTS,), 10.0 / NUM_EXPERTS)
    assert load_balancing_loss(uniform, probs, 10, NUM_EXPERTS, TOP_K) == pytest.approx(1.0)
    assert expert_load_ratio(uniform) == pytest.approx(1.0)
    collapsed = torch.zeros(NUM_EXPERTS)
    collapsed[0] = 10.0
    one_hot = torch.zeros(NUM_EXPERTS)
    one_hot[0] = 10.0
    # top-1's worst case: everything on one expert.
    assert load_balancing_loss(collapsed, one_hot, 10, NUM_EXPERTS, 1) == pytest.approx(8.0)
    assert expert_load_ratio(collapsed) == pytest.approx(NUM_EXPERTS)
    zero = torch.zeros(NUM_EXPERTS)
    assert load_balancing_loss(zero, zero, 0, NUM_EXPERTS, TOP_K) == 0  # an all-padding rank
    assert router_z_loss(torch.tensor(0.0), 0) == 0


# --- LoRA ------------------------------------------------------------------------------------


def lora_moe(**flags: bool) -> nn.Module:
    torch.manual_seed(0)
    return lora_qwen3_moe(ATTN_MODULES, **flags, **tiny_kwargs(dense_layer=True), **LORA)


ALL_ADAPTERS = {"apply_lora_to_mlp": True, "apply_lora_to_output": True}


def test_adapters_start_as_identity_and_mlp_lora_trains_the_experts() -> None:
    torch.manual_seed(0)
    base = qwen3_moe(**tiny_kwargs(dense_layer=True)).eval()
    randomize_(base)
    model = lora_moe(**ALL_ADAPTERS, apply_lora_to_router=True).eval()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all("lora" in key for key in missing)
    with torch.no_grad():
        assert torch.equal(model(tokens()), base(tokens()))

    adapter_params = get_adapter_params(model)
    assert adapter_params["layers.0.mlp.experts.w1.lora_a.weight"].shape == (NUM_EXPERTS, 4, 64)
    assert adapter_params["layers.0.mlp.experts.w2.lora_b.weight"].shape == (NUM_EXPERTS, 64, 4)
    assert "layers.0.mlp.router.gate.lora_a.weight" in adapter_params
    assert "layers.1.mlp.w1.lora_a.weight" in adapter_params  # the dense layer's MLP
    set_trainable_params(model, adapter_params)
    assert not model.layers[0].mlp.experts.w1.weight.requires_grad
    model.train()
    model(tokens()).sum().backward()
    expert_b = model.layers[0].mlp.experts.w1.lora_b.weight.grad
    assert expert_b is not None and expert_b.abs().sum() > 0


def test_without_apply_lora_to_mlp_the_experts_have_no_adapter() -> None:
    keys = get_adapter_params(lora_moe()).keys()
    assert keys and all(".attn." in key for key in keys)
    with pytest.raises(ValueError, match="use_dora"):
        lora_qwen3_moe(ATTN_MODULES, True, **TINY, **LORA, use_dora=True)


def test_torchtunes_merge_folds_the_stacked_adapters_in() -> None:
    model = lora_moe(**ALL_ADAPTERS, apply_lora_to_router=True).eval()
    randomize_(model, seed=5)  # lora_b too: a trained adapter
    copied = {key: value.clone() for key, value in model.state_dict().items()}  # merged in place
    merged = get_merged_lora_ckpt(copied, rank=LORA["lora_rank"], alpha=LORA["lora_alpha"])
    base = qwen3_moe(**tiny_kwargs(dense_layer=True)).eval()
    base.load_state_dict(merged, strict=True)
    with torch.no_grad():
        assert relative_error(base(tokens()), model(tokens())) < BOUND


def test_peft_loads_the_attention_and_output_adapters(tmp_path: Path) -> None:
    model = lora_moe(apply_lora_to_output=True).eval()
    randomize_(model, seed=5)
    state = model.state_dict()
    adapter = get_adapter_state_dict(state)
    config = QWEN3_MOE_FORMAT.hf_config(tiny_kwargs(dense_layer=True))
    base_state = {key: value for key, value in state.items() if key not in adapter}
    base = save_hf_folder(
        tmp_path / "base", QWEN3_MOE_FORMAT.tune_to_hf(base_state, config), config
    )
    folder = tmp_path / "adapter"
    folder.mkdir()
    peft_weights = QWEN3_MOE_FORMAT.adapter_to_peft(adapter, config)
    save_file(peft_weights, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    peft_config = tune_to_peft_adapter_config(
        {
            "r": LORA["lora_rank"],
            "lora_alpha": LORA["lora_alpha"],
            "target_modules": [*ATTN_MODULES, "output"],
            "peft_type": "LORA",
        },
        base_model_name_or_path=str(base),
    )
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))
    peft_model = peft.PeftModel.from_pretrained(load_hf_model(base), folder).eval()
    loaded = peft.get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    assert loaded.keys() == peft_weights.keys()
    with torch.no_grad():
        assert relative_error(model(tokens()), peft_model(tokens()).logits) < BOUND


def test_expert_and_router_adapters_are_left_out_of_the_peft_file_with_a_warning() -> None:
    model = lora_moe(**ALL_ADAPTERS, apply_lora_to_router=True)
    adapter = get_adapter_state_dict(model.state_dict())
    config = QWEN3_MOE_FORMAT.hf_config(tiny_kwargs(dense_layer=True))
    with pytest.warns(UserWarning, match="experts or routers"):
        peft_weights = QWEN3_MOE_FORMAT.adapter_to_peft(adapter, config)
    assert not any(".experts." in key or ".mlp.gate." in key for key in peft_weights)
    assert any(".mlp.gate_proj." in key for key in peft_weights)  # the dense layer's are kept
    assert any(".self_attn.q_proj.lora_A" in key for key in peft_weights)


# --- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "builder", "expected"),
    [
        ("qwen3_moe_30b_a3b", qwen3_moe_30b_a3b, 30_532_122_624),
        ("qwen3_moe_235b_a22b", qwen3_moe_235b_a22b, 235_093_634_560),
    ],
)
def test_sized_builders_have_transformers_parameter_count(name, builder, expected) -> None:
    with torch.device("meta"):
        ours = builder()
        config = QWEN3_MOE_FORMAT.hf_config(BUILDER_ARGUMENTS[name])
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters()) == expected


def test_expert_adapters_get_first_values_from_the_seed_alone() -> None:
    """A distributed LoRA run builds on the meta device, where the builder's own init does not
    run: ``initialize_adapters`` must draw the stacked experts' adapters too, from the seed
    alone (see [adapter init] in exactga.lora.adapters), A as torchtune draws a LoRALinear's and
    B zero, so the model starts as its base."""
    from exactga.lora.adapters import initialize_adapters
    from exactga.models.qwen3_moe import lora_qwen3_moe

    def drawn(seed: int) -> dict[str, torch.Tensor]:
        model = lora_qwen3_moe(
            lora_attn_modules=["q_proj"],
            apply_lora_to_mlp=True,
            lora_rank=4,
            lora_alpha=8,
            vocab_size=64,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            embed_dim=16,
            moe_intermediate_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            max_seq_len=32,
            head_dim=8,
        )
        out: dict[str, torch.Tensor] = {}
        initialize_adapters(
            model, dtype=torch.float32, seed=seed, load=lambda _, sd: out.update(sd)
        )
        return {k: v for k, v in out.items() if ".experts." in k}

    first, again, other = drawn(3), drawn(3), drawn(4)
    assert sorted(first) == sorted(
        f"layers.0.mlp.experts.{w}.{part}.weight"
        for w in ("w1", "w2", "w3")
        for part in ("lora_a", "lora_b")
    )
    for key, value in first.items():
        assert torch.equal(value, again[key])
        if "lora_b" in key:
            assert not value.any()
        else:
            assert value[0].abs().sum() > 0 and not torch.equal(value[0], value[1])  # per expert
            assert not torch.equal(value, other[key])
