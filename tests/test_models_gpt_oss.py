"""gpt-oss (exactga.models.gpt_oss) computes what Hugging Face's ``GptOssForCausalLM`` computes,
and its format reads and writes weights the way transformers does, the released MXFP4 experts
included.

All in-process, fp32, a tiny random model: 2 layers (one sliding with a window of 4, one full),
4 experts top-2, width 64, head_dim 16, grouped attention, YaRN RoPE, sequences of 12 tokens,
every weight random (sinks, all biases and norm scales away from their init).

- HF -> ours: ``save_pretrained``'s folder read by the checkpointer (``GPT_OSS``) gives HF's
  logits; so does a folder whose experts are MXFP4 blocks and scales (the test quantises the
  tiny experts), against transformers holding the same dequantised values.
- MXFP4: our dequantisation equals transformers' ``convert_moe_packed_tensors`` bit for bit on
  random blocks and scales, in fp32 and bf16.
- ours -> HF: the checkpointer's save loads with ``from_pretrained`` (no missing or unexpected
  key) and gives our logits; the LoRA adapters load in PEFT with our logits: attention and
  output as LoRA linears, the experts' and router's on their parameters (``target_parameters``);
  a DoRA router adapter, which PEFT cannot hold, is left out with a warning.
- training: the sinks get non-zero gradients; the router statistics are HF's router logits,
  the balance term on them HF's ``aux_loss`` over ``top_k``, and the recipes' ``RouterBalance``
  term ``coef`` times it; the grouped-matmul experts are the loop's, forward and backward; LoRA
  starts as its base and torchtune's merge folds the attention and stacked expert adapters in.
- packed rows (a document longer than the window) give each document's logits alone, with the
  dense block-causal mask and with a ``BlockMask`` (flex attention), and under the ``BlockMask``
  every parameter's gradient, the sinks' through flex's log-sum-exp, is the dense mask's (flex
  attention's unfused backward, its CPU refusal lifted); KV-cache decoding past the window gives
  the full forward's logits.
- config.json: a one-line ``gpt_oss`` section takes the folder's shape and gives HF's logits.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torchtune import training
from torchtune.models.convert_weights import tune_to_peft_adapter_config
from torchtune.modules.attention_utils import create_block_causal_mask
from torchtune.modules.peft import get_adapter_state_dict, get_merged_lora_ckpt
from unit_utils import allow_flex_backward_on_cpu, cpu_document_block_mask, probe_gradients

from exactga.models.checkpointer import FullModelHFCheckpointer
from exactga.models.gpt_oss import (
    BUILDER_ARGUMENTS,
    GPT_OSS_FORMAT,
    dequantize_mxfp4,
    gpt_oss,
    gpt_oss_20b,
    gpt_oss_120b,
    lora_gpt_oss,
    quantize_mxfp4,
)
from exactga.models.gpt_oss._positional_embeddings import yarn_inverse_frequencies
from exactga.models.moe import load_balancing_loss, recording_router_stats, sum_router_stats

transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

BOUND = 1e-5  # relative, fp32
NUM_EXPERTS, TOP_K, WINDOW, SEQ = 4, 2, 4, 12
ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}


def tiny_kwargs() -> dict:
    return {
        "vocab_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 64,
        "intermediate_dim": 64,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "max_seq_len": 256,
        "head_dim": 16,
        "sliding_window": WINDOW,
        "rope_scaling_factor": ROPE["factor"],
        "rope_original_max_seq_len": ROPE["original_max_position_embeddings"],
        "expert_path": "loop",
    }


def hf_config() -> transformers.GptOssConfig:
    return transformers.GptOssConfig(
        vocab_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=64,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=256,
        head_dim=16,
        sliding_window=WINDOW,
        rope_parameters=dict(ROPE),
    )


def randomize_(model: nn.Module) -> None:
    """Every weight random: norm scales around one, sinks of either sign, biases non-zero,
    expert weights large enough that the clamp at 7 is reached."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_(1 + 0.2 * noise)
            elif "sinks" in name:
                parameter.copy_(noise)
            elif "experts" in name:
                parameter.copy_(0.5 * noise)
            else:
                parameter.copy_(0.1 * noise)


def hf_saved_model(folder: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config())
    randomize_(model)
    model.save_pretrained(folder)
    return folder


def load_hf_model(folder: Path) -> nn.Module:
    model, info = transformers.GptOssForCausalLM.from_pretrained(
        folder, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def checkpointer_for(folder: Path, output_dir: Path) -> FullModelHFCheckpointer:
    return FullModelHFCheckpointer(
        checkpoint_dir=str(folder),
        checkpoint_files=["model.safetensors"],
        model_type="GPT_OSS",
        output_dir=str(output_dir),
    )


def ours_from(folder: Path) -> nn.Module:
    weights = checkpointer_for(folder, folder.parent / "out").load_checkpoint()
    model = gpt_oss(**tiny_kwargs())
    model.load_state_dict(weights[training.MODEL_KEY], strict=True)
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(2))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_saved_model(tmp_path_factory.mktemp("gpt_oss") / "hf")


# --- Hugging Face -> ours --------------------------------------------------------------------


def test_yarn_table_is_transformers(hf_folder: Path) -> None:
    hf = load_hf_model(hf_folder)
    ours = yarn_inverse_frequencies(16, 150000.0, 4.0, 64, truncate=False)
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq.cpu())
    assert gpt_oss(**tiny_kwargs()).layers[0].attn.pos_embeddings.attention_factor == (
        hf.model.rotary_emb.attention_scaling
    )


def test_hf_weights_give_hf_logits(hf_folder: Path) -> None:
    hf, ours = load_hf_model(hf_folder), ours_from(hf_folder)
    kinds = [layer.attn.sliding_window for layer in ours.layers]
    assert kinds == [WINDOW, None] and hf.config.layer_types == [
        "sliding_attention",
        "full_attention",
    ]
    ids = tokens()
    with torch.no_grad():
        error = relative_error(ours(ids), hf(ids).logits)
    print(f"gpt-oss logits, dequantised folder: relative difference {error:.2e}")
    assert error < BOUND


def mxfp4_folder(hf_folder: Path, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """``hf_folder`` with every expert weight stored as MXFP4 blocks and scales (quantised
    here, in the released layout ``[E, out, in / 32, 16]``), and the dequantised weights in
    transformers' layout, as ``convert_moe_packed_tensors`` gives them."""
    weights = load_file(hf_folder / "model.safetensors")
    dequantised = {}
    for key in [k for k in weights if k.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = quantize_mxfp4(weights.pop(key).transpose(1, 2))  # [E, out, in]
        blocks = blocks.reshape(*scales.shape, 16)
        weights[f"{key}_blocks"], weights[f"{key}_scales"] = blocks, scales
        dequantised[key] = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    folder.mkdir(parents=True)
    config = json.loads((hf_folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, dequantised


def test_mxfp4_folder_gives_hf_logits_of_the_dequantised_weights(
    hf_folder: Path, tmp_path: Path
) -> None:
    folder, dequantised = mxfp4_folder(hf_folder, tmp_path / "mxfp4")
    hf = load_hf_model(hf_folder)
    state = hf.state_dict()
    assert not torch.equal(
        state["model.layers.0.mlp.experts.down_proj"],
        dequantised["model.layers.0.mlp.experts.down_proj"],
    )  # the quantisation changed the weights: the check below is not the one above
    hf.load_state_dict({**state, **dequantised})
    ours = ours_from(folder)
    ids = tokens()
    with torch.no_grad():
        error = relative_error(ours(ids), hf(ids).logits)
    print(f"gpt-oss logits, MXFP4 folder: relative difference {error:.2e}")
    assert error < BOUND


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_dequantisation_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 40, 5, 16), generator=generator, dtype=torch.uint8)
    # Exponents 2^-127 .. 2^127, all of the E8M0 range but the top (2^128 * 6 overflows).
    scales = torch.randint(0, 255, (3, 40, 5), generator=generator, dtype=torch.uint8)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]
    assert ours.dtype == dtype
    assert torch.equal(
        ours.transpose(1, 2).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )


# --- ours -> Hugging Face --------------------------------------------------------------------


def test_save_loads_back_in_transformers(hf_folder: Path, tmp_path: Path) -> None:
    ours = ours_from(hf_folder)
    checkpointer = checkpointer_for(hf_folder, tmp_path / "out")
    checkpointer.load_checkpoint()
    checkpointer.save_checkpoint({training.MODEL_KEY: ours.state_dict()}, epoch=0)
    hf = load_hf_model(tmp_path / "out" / "epoch_0")
    ids = tokens()
    with torch.no_grad():
        error = relative_error(hf(ids).logits, ours(ids))
    print(f"gpt-oss logits, saved folder in transformers: relative difference {error:.2e}")
    assert error < BOUND


def test_mxfp4_folder_saves_dequantised(hf_folder: Path, tmp_path: Path) -> None:
    folder, _ = mxfp4_folder(hf_folder, tmp_path / "mxfp4")
    checkpointer = checkpointer_for(folder, tmp_path / "out")
    weights = checkpointer.load_checkpoint()[training.MODEL_KEY]
    checkpointer.save_checkpoint({training.MODEL_KEY: weights}, epoch=0)
    saved = tmp_path / "out" / "epoch_0"
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    on_disk = load_file(next(saved.glob("*.safetensors")))
    assert not any(key.endswith(("_blocks", "_scales")) for key in on_disk)
    assert GPT_OSS_FORMAT.hf_to_tune(on_disk, {}).keys() == weights.keys()


# --- training --------------------------------------------------------------------------------


def test_sinks_get_gradients_and_the_router_term_is_hfs(hf_folder: Path) -> None:
    """The sinks train; the router statistics the exact step's balance term reads
    (exactga.sft.router_balance, as for Qwen3 MoE) are HF's router logits, and the balance
    loss on them is HF's ``aux_loss`` over ``top_k`` (see load_balancing_loss)."""
    ours, hf = ours_from(hf_folder).train(), load_hf_model(hf_folder)
    ids = tokens()
    with recording_router_stats(ours, keep_logits=True) as blocks:
        ours(ids).float().pow(2).mean().backward()
    for layer in ours.layers:
        assert layer.attn.sinks.grad is not None and layer.attn.sinks.grad.abs().min() > 0
    with torch.no_grad():
        hf_out = hf(ids, output_router_logits=True)
    per_layer = [block.last_router_stats for block in blocks]
    for stats, theirs in zip(per_layer, hf_out.router_logits, strict=True):
        assert relative_error(stats.logits, theirs.reshape(-1, NUM_EXPERTS)) < BOUND
    total = sum_router_stats(per_layer)
    balance = load_balancing_loss(
        total.expert_counts, total.prob_sums, total.num_tokens, NUM_EXPERTS, TOP_K
    )
    assert torch.allclose(TOP_K * balance, hf_out.aux_loss, rtol=1e-6)


def test_the_exact_steps_router_term_is_hfs_aux_loss(hf_folder: Path) -> None:
    """``router_aux_loss_coef`` reaches gpt-oss as it reaches Qwen3 MoE: the fine-tuning
    recipes' ``RouterBalance`` finds the MoE blocks and its term is ``coef`` times HF's
    ``aux_loss`` (every token routed), with a gradient into every router."""
    from exactga.sft.router_balance import RouterBalance

    ours, hf = ours_from(hf_folder).train(), load_hf_model(hf_folder)
    coef, ids = 0.25, tokens()
    balance = RouterBalance(ours, coef, "micro_batch", None, torch.device("cpu"))
    assert len(balance.blocks) == 2
    with balance.recording(ours, labels=ids):
        ours(ids)
    term = balance.with_term(torch.tensor(0.0)).terms["router_micro_batches"]
    with torch.no_grad():
        aux_loss = hf(ids, output_router_logits=True).aux_loss
    assert torch.allclose(term, coef * aux_loss, rtol=1e-6)
    term.backward()
    assert all(layer.mlp.router.gate.weight.grad.abs().sum() > 0 for layer in ours.layers)


@pytest.mark.parametrize("adapted", [False, True], ids=["plain", "lora"])
def test_grouped_experts_are_the_loop_forward_and_backward(adapted: bool) -> None:
    """The biased experts on ``torch._grouped_mm`` (fp32 runs on the CPU) and on the loop."""
    torch.manual_seed(0)
    lora = {"lora_attn_modules": ["q_proj"], "apply_lora_to_mlp": True, "lora_rank": 4}
    build = partial(lora_gpt_oss, **lora, lora_alpha=8) if adapted else gpt_oss
    models = {path: build(**{**tiny_kwargs(), "expert_path": path}) for path in ("loop", "grouped")}
    randomize_(models["loop"])
    models["grouped"].load_state_dict(models["loop"].state_dict())
    ids = tokens()
    results = {}
    for path, model in models.items():
        logits = model(ids)
        logits.float().pow(2).mean().backward()
        grads = {name: p.grad for name, p in model.named_parameters() if "experts" in name}
        results[path] = (logits.detach(), grads)
    assert relative_error(results["grouped"][0], results["loop"][0]) < BOUND
    for name, grad in results["loop"][1].items():
        assert relative_error(results["grouped"][1][name], grad) < 1e-5, name


def test_lora_starts_as_its_base_and_adapts_experts(hf_folder: Path) -> None:
    base = ours_from(hf_folder)
    lora = lora_gpt_oss(
        ["q_proj", "v_proj", "output_proj"],
        apply_lora_to_mlp=True,
        apply_lora_to_router=True,
        **tiny_kwargs(),
        lora_rank=4,
        lora_alpha=8,
    ).eval()
    missing, unexpected = lora.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all("lora_" in key for key in missing)
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(lora(ids), base(ids))
        for name, parameter in lora.named_parameters():
            if "lora_b" in name:
                parameter.normal_(std=0.1)  # trained adapters
        adapted = lora(ids)
    merged = get_merged_lora_ckpt(
        {key: value.clone() for key, value in lora.state_dict().items()}, rank=4, alpha=8
    )
    base.load_state_dict(merged, strict=True)
    with torch.no_grad():
        assert relative_error(base(ids), adapted) < BOUND


def test_peft_loads_every_adapter(hf_folder: Path, tmp_path: Path) -> None:
    """The PEFT file and config hold every adapter: attention and output as PEFT's LoRA
    linears, the experts' and the router's on their parameters (``target_parameters``);
    ``PeftModel.from_pretrained`` gives our logits."""
    modules = ["q_proj", "k_proj", "v_proj", "output_proj"]
    lora = lora_gpt_oss(
        modules,
        apply_lora_to_mlp=True,
        apply_lora_to_router=True,
        apply_lora_to_output=True,
        **tiny_kwargs(),
        lora_rank=4,
        lora_alpha=8,
    )
    lora.load_state_dict(ours_from(hf_folder).state_dict(), strict=False)
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_b" in name:
                parameter.normal_(std=0.1)
    adapter = get_adapter_state_dict(lora.state_dict())
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file(
        GPT_OSS_FORMAT.adapter_to_peft(adapter, {}),
        folder / "adapter_model.safetensors",
        metadata={"format": "pt"},
    )
    # torchtune's config as the LoRA recipes write it (w1/w2/w3 for the experts' adapters).
    targets = [*modules, "w1", "w2", "w3", "output"]
    peft_config = GPT_OSS_FORMAT.peft_config(
        tune_to_peft_adapter_config(
            {"r": 4, "lora_alpha": 8, "target_modules": targets, "peft_type": "LORA"},
            base_model_name_or_path=str(hf_folder),
        ),
        adapter,
    )
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))
    peft_model = peft.PeftModel.from_pretrained(load_hf_model(hf_folder), folder).eval()
    ids = tokens()
    with torch.no_grad():
        error = relative_error(lora.eval()(ids), peft_model(ids).logits)
    print(f"gpt-oss logits, LoRA adapter (experts and router too) in PEFT: {error:.2e}")
    assert error < BOUND
    with torch.no_grad(), peft_model.disable_adapter():  # the adapters are not zero
        assert relative_error(lora(ids), peft_model(ids).logits) > 1e-3


def test_a_dora_router_adapter_is_left_out_of_the_peft_file_with_a_warning() -> None:
    dora = lora_gpt_oss(
        ["q_proj"],
        apply_lora_to_router=True,
        **tiny_kwargs(),
        lora_rank=4,
        lora_alpha=8,
        use_dora=True,
    )
    adapter = get_adapter_state_dict(dora.state_dict())
    with pytest.warns(UserWarning, match="DoRA router adapters"):
        kept = GPT_OSS_FORMAT.adapter_to_peft(adapter, {})
    assert kept and not any(".mlp." in key for key in kept)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
    assert "target_parameters" not in GPT_OSS_FORMAT.peft_config(config, adapter)


def test_sized_builders_have_the_released_parameter_counts() -> None:
    with torch.device("meta"):
        counts = {
            name: sum(p.numel() for p in builder().parameters())
            for name, builder in (("gpt_oss_20b", gpt_oss_20b), ("gpt_oss_120b", gpt_oss_120b))
        }
    # openai/gpt-oss-20b and -120b: 20.91e9 and 116.83e9 parameters in transformers' model.
    for name, count in counts.items():
        config = GPT_OSS_FORMAT.hf_config(BUILDER_ARGUMENTS[name])
        with torch.device("meta"):
            reference = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config))
        assert count == sum(p.numel() for p in reference.parameters()), name


@pytest.mark.filterwarnings("ignore:.*without torch.compile.*:UserWarning")
@pytest.mark.parametrize("flex", [False, True], ids=["dense-mask", "block-mask"])
def test_packed_documents_get_the_logits_they_get_alone(hf_folder: Path, flex: bool) -> None:
    """Packed rows' per-document masks, dense or a ``BlockMask`` (flex attention: the sinks
    through its log-sum-exp; the backward: the next test)."""
    ours = ours_from(hf_folder)
    lengths = [4, 8]  # the second document is longer than the window
    ids = tokens()[:1, : sum(lengths)]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    mask = (
        cpu_document_block_mask(lengths)
        if flex
        else create_block_causal_mask([torch.tensor(lengths)])
    )
    with torch.no_grad():
        packed = ours(ids, mask=mask, input_pos=positions)
        alone = torch.cat([ours(ids[:, : lengths[0]]), ours(ids[:, lengths[0] :])], dim=1)
    error = relative_error(packed, alone)
    print(f"gpt-oss logits, packed ({'flex' if flex else 'dense'}) against alone: {error:.2e}")
    assert error < BOUND


def packed_row_gradients(model: nn.Module, lengths: list[int], mask) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of one packed row's logits against a fixed random probe, on
    the model's device (tests/gpu/test_gpu_gpt_oss.py runs it on CUDA)."""
    device = next(model.parameters()).device
    ids = tokens()[:1].repeat(1, 2)[:, : sum(lengths)].to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    return probe_gradients(model, ids, mask, positions)[1]


@pytest.mark.filterwarnings("ignore:.*without torch.compile.*:UserWarning")
def test_the_sinks_backward_through_flex_attention_is_the_dense_masks(
    hf_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sinks' gradient through flex attention's log-sum-exp (``sigmoid(lse - sink)``, the
    path packed rows take on CUDA) equals the dense per-document mask's, every parameter's.

    torch 2.13 refuses flex attention's backward on a CPU in ``_validate_device`` because it has
    no fused CPU kernel; uncompiled, flex attention runs its unfused implementation, whose
    backward (the log-sum-exp's gradient included) is the same on every device. The test lifts
    that one check to run it: it checks our formula through torch's autograd of flex attention.
    The fused CUDA kernel's backward is tests/gpu/test_gpu_gpt_oss.py's."""
    allow_flex_backward_on_cpu(monkeypatch)
    model = ours_from(hf_folder).train()
    lengths = [5, 11, 8]  # three documents; the second and third outrun the window of 4
    dense = packed_row_gradients(model, lengths, create_block_causal_mask([torch.tensor(lengths)]))
    flex = packed_row_gradients(model, lengths, cpu_document_block_mask(lengths))
    sinks = [name for name in dense if name.endswith("attn.sinks")]
    assert len(sinks) == len(model.layers)
    assert all(dense[name].abs().min() > 0 for name in sinks)  # every head's sink trains
    gaps = {name: relative_error(flex[name], dense[name]) for name in dense}
    print(
        f"gpt-oss gradients, flex against dense: sinks {max(gaps[n] for n in sinks):.2e}, "
        f"worst {max(gaps.values()):.2e}"
    )
    assert max(gaps.values()) < BOUND, max(gaps, key=gaps.get)


def test_kv_cache_decoding_past_the_window_matches_full_forward(hf_folder: Path) -> None:
    ours = ours_from(hf_folder)
    ids = tokens()[:1]
    with torch.no_grad():
        full = ours(ids)
        ours.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=SEQ)
        causal = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))
        prompt = 3
        steps = [
            ours(ids[:, :prompt], input_pos=torch.arange(prompt)[None], mask=causal[None, :prompt])
        ]
        for position in range(prompt, SEQ):  # 9 steps: the window of 4 slides past the prompt
            step = ours(
                ids[:, position : position + 1],
                input_pos=torch.tensor([[position]]),
                mask=causal[None, position : position + 1],
            )
            steps.append(step)
    error = relative_error(torch.cat(steps, dim=1), full)
    print(f"gpt-oss logits, KV-cache decoding against the full forward: {error:.2e}")
    assert error < BOUND


# --- config.json as the truth (exactga.models.hf_config) -------------------------------------


def test_a_one_line_section_builds_the_folders_model(hf_folder: Path) -> None:
    from exactga.models.hf_config import resolve_model_section

    section, filled = resolve_model_section(
        "model", {"_component_": "exactga.models.gpt_oss.gpt_oss"}, hf_folder
    )
    assert filled["rope_scaling_factor"] == 4.0 and filled["sliding_window"] == WINDOW
    model = gpt_oss(**{key: value for key, value in section.items() if key != "_component_"})
    weights = checkpointer_for(hf_folder, hf_folder.parent / "out").load_checkpoint()
    model.load_state_dict(weights[training.MODEL_KEY], strict=True)
    ids = tokens()
    with torch.no_grad():
        error = relative_error(model.eval()(ids), load_hf_model(hf_folder)(ids).logits)
    print(f"gpt-oss logits, one-line model section: relative difference {error:.2e}")
    assert error < BOUND
    with pytest.raises(ValueError, match="rope_original_max_seq_len=4096"):
        resolve_model_section(
            "model",
            {"_component_": "exactga.models.gpt_oss.gpt_oss", "rope_original_max_seq_len": 4096},
            hf_folder,
        )


def test_the_format_writes_the_config_json_transformers_reads_as_the_builders() -> None:
    config = GPT_OSS_FORMAT.hf_config(tiny_kwargs())
    hf = transformers.GptOssConfig(**config)
    assert hf.layer_types == ["sliding_attention", "full_attention"]
    assert hf.rope_parameters["factor"] == 4.0 and hf.rope_parameters["truncate"] is False
