"""Gemma 3 (exactga.models.gemma3) computes what Hugging Face's ``Gemma3ForCausalLM`` computes,
and its format converts weights and adapters the way transformers and PEFT read them.

All in-process, fp32, eager attention in transformers, on tiny random models built so that each
Gemma 3 detail changes the logits: 4 layers with pattern 2 (local, global, local, global), a
window of 8 keys on sequences of 24 tokens, grouped attention (4 query heads, 2 kv heads),
``head_dim`` 16 (q is 64 wide, the model 48), ``query_pre_attn_scalar`` 24 (not ``head_dim``),
an embedding scale sqrt(48) that is not a power of two, and every weight random, the QK-norm and
the four layer norms' scales included (zero scales would hide the norm order and names).

- HF -> ours: ``hf_to_tune`` of a transformers model's files loads into ``gemma3(...)`` with
  ``strict=True`` and gives its logits, with and without the global layers' linear RoPE scaling,
  and with final-logit soft-capping set; a window one key wider or narrower does not.
  ``attn_logit_softcapping`` is refused: transformers' Gemma 3 ignores it.
- masks: a sliding layer given an explicit causal mask matches no mask; in a packed row (dense
  block-causal mask, and the same as flex attention's ``BlockMask``) each document gets the
  logits it gets alone; decoding token by token through the KV-cache past the window matches
  the full forward.
- ours -> HF: ``hf_to_tune(tune_to_hf(sd)) == sd`` exactly; ``hf_config`` and ``tune_to_hf``
  written out load with ``from_pretrained`` (no missing or unexpected key) into our logits.
- adapters: ``adapter_to_peft``'s file loads with ``PeftModel.from_pretrained`` into exactly our
  adapter values and our LoRA/DoRA model's logits.
- sizes: the sized builders' parameter counts (meta device) are the Gemma 3 report's, their
  weights have the names and shapes of transformers' model for the same ``config.json``, and
  the QLoRA twins quantize.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask
from torchtune.models.convert_weights import tune_to_peft_adapter_config
from torchtune.models.gemma.gemma_norm_embedding import GemmaNormEmbeddings
from torchtune.modules import TiedLinear
from torchtune.modules.attention_utils import create_block_causal_mask
from torchtune.modules.low_precision import FrozenNF4Linear
from torchtune.modules.peft import DoRALinear, get_adapter_state_dict, get_lora_module_names

from exactga.models.gemma3 import _model_builders as sized
from exactga.models.gemma3 import (
    gemma3,
    gemma3_1b,
    gemma3_4b,
    gemma3_12b,
    gemma3_27b,
    lora_gemma3,
    lora_gemma3_1b,
    lora_gemma3_4b,
    lora_gemma3_12b,
    lora_gemma3_27b,
    qlora_gemma3_1b,
    qlora_gemma3_4b,
    qlora_gemma3_12b,
    qlora_gemma3_27b,
)
from exactga.models.gemma3._convert_weights import GEMMA3_FORMAT
from exactga.models.hf_format import hf_format

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BOUND = 1e-5  # relative L2 of the logits, fp32
VOCAB = 96
LENGTH = 24  # tokens per row: three windows
TINY = {
    "vocab_size": VOCAB,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "embed_dim": 48,
    "intermediate_dim": 80,
    "max_seq_len": 64,
    "norm_eps": 1e-6,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "query_pre_attn_scalar": 24,
}
SCALED = {"rope_scaling_factor": 8.0}
SOFTCAPPED = {"final_logit_softcapping": 5.0}  # bites: the logits reach 4 and more
ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "output_proj"]
LORA = {"lora_rank": 4, "lora_alpha": 8.0}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def randomize_(model: nn.Module, seed: int = 0) -> None:
    """Every parameter random; Gemma's norms scale by ``1 + scale``, so 1-d ones around 0."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))


def tokens(batch: int = 2, length: int = LENGTH, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_reference_config(**overrides: Any) -> Any:
    """transformers' config of the tiny model, written out here (not by ``hf_config``), in
    transformers 5's own form (``layer_types``, ``rope_parameters``)."""
    kwargs = {**TINY, **overrides}
    scaling = kwargs.get("rope_scaling_factor")
    full_rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if scaling is not None:
        full_rope = {"rope_type": "linear", "factor": scaling, "rope_theta": 1_000_000.0}
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=kwargs["embed_dim"],
        intermediate_size=kwargs["intermediate_dim"],
        num_hidden_layers=kwargs["num_layers"],
        num_attention_heads=kwargs["num_heads"],
        num_key_value_heads=kwargs["num_kv_heads"],
        head_dim=kwargs["head_dim"],
        max_position_embeddings=kwargs["max_seq_len"],
        rms_norm_eps=kwargs["norm_eps"],
        sliding_window=kwargs["sliding_window"],
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": full_rope,
        },
        query_pre_attn_scalar=kwargs["query_pre_attn_scalar"],
        attn_logit_softcapping=kwargs.get("attn_logit_softcapping"),
        final_logit_softcapping=kwargs.get("final_logit_softcapping"),
    )


def save_hf_model(folder: Path, weights: dict[str, torch.Tensor], config: dict) -> Path:
    """A Hugging Face model folder: ``config.json`` and one safetensors file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    contiguous = {key: value.contiguous() for key, value in weights.items()}
    save_file(contiguous, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def load_hf_model(folder: Path) -> Any:
    """``from_pretrained`` in fp32 with eager attention; fails on any missing/unexpected key."""
    model, info = transformers.Gemma3ForCausalLM.from_pretrained(
        folder, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def hf_saved_model(folder: Path, **overrides: Any) -> Path:
    """A random transformers Gemma 3, written by ``save_pretrained``."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(hf_reference_config(**overrides))
    randomize_(model)
    model.save_pretrained(folder)
    return folder


def ours_from_hf_folder(folder: Path, **overrides: Any) -> nn.Module:
    """``gemma3(...)`` loaded (``strict=True``) from a Hugging Face folder through hf_to_tune."""
    config = json.loads((folder / "config.json").read_text())
    weights = GEMMA3_FORMAT.hf_to_tune(load_file(folder / "model.safetensors"), config)
    model = gemma3(**{**TINY, **overrides})
    model.load_state_dict(weights, strict=True)
    return model.eval()


def random_model(**overrides: Any) -> nn.Module:
    torch.manual_seed(0)
    model = gemma3(**{**TINY, **overrides}).eval()
    randomize_(model)
    return model


# --- Hugging Face -> ours --------------------------------------------------------------------

VARIANTS = {"plain": {}, "global-rope-scaled": SCALED, "soft-capped": SOFTCAPPED}


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_hf_weights_give_hf_logits(tmp_path: Path, variant: str) -> None:
    overrides = VARIANTS[variant]
    folder = hf_saved_model(tmp_path / "hf", **overrides)
    hf = load_hf_model(folder)
    ours = ours_from_hf_folder(folder, **overrides)
    with torch.no_grad():
        reference = hf(tokens()).logits
        assert relative_error(ours(tokens()), reference) < BOUND
        shifted = torch.arange(5, 5 + LENGTH).expand(2, -1)  # positions not starting at 0
        reference = hf(tokens(), position_ids=shifted).logits
        assert relative_error(ours(tokens(), input_pos=shifted), reference) < BOUND


def test_attention_softcapping_is_refused_as_transformers_ignores_it() -> None:
    torch.manual_seed(0)
    capped = transformers.Gemma3ForCausalLM(hf_reference_config(attn_logit_softcapping=0.5))
    randomize_(capped.eval())
    plain = transformers.Gemma3ForCausalLM(hf_reference_config()).eval()
    plain.load_state_dict(capped.state_dict())
    with torch.no_grad():
        assert torch.equal(capped(tokens()).logits, plain(tokens()).logits)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        gemma3(**TINY, attn_logit_softcapping=50.0)


def test_global_rope_tables_are_transformers(tmp_path: Path) -> None:
    """Bit-equal inverse frequencies: local base 1e4; global base 1e6 divided by 8."""
    hf = transformers.Gemma3ForCausalLM(hf_reference_config(**SCALED))
    ours = gemma3(**TINY, **SCALED)
    local, full = ours.layers[0].attn.pos_embeddings, ours.layers[1].attn.pos_embeddings
    assert torch.equal(local.inv_freq, hf.model.rotary_emb.sliding_attention_inv_freq)
    assert torch.equal(full.inv_freq, hf.model.rotary_emb.full_attention_inv_freq)
    assert full.scaling_factor == 8.0 and local.scaling_factor == 1.0


@pytest.mark.parametrize("window", [7, 9])
def test_a_window_one_key_off_gives_other_logits(tmp_path: Path, window: int) -> None:
    """The window is HF's to the key: ``sliding_window`` keys, the query's own included."""
    folder = hf_saved_model(tmp_path / "hf")
    hf = load_hf_model(folder)
    ours = ours_from_hf_folder(folder)
    for layer in ours.layers:
        if layer.attn.sliding_window is not None:
            layer.attn.sliding_window = window
    with torch.no_grad():
        assert relative_error(ours(tokens()), hf(tokens()).logits) > 1e-3


def test_layer_kinds_follow_the_pattern() -> None:
    windows = [layer.attn.sliding_window for layer in gemma3(**{**TINY, "num_layers": 12}).layers]
    assert windows == [8, None] * 6
    released = gemma3(**{**TINY, "num_layers": 12, "sliding_window_pattern": 6}).layers
    assert [layer.attn.sliding_window is None for layer in released] == [False] * 5 + [True] + [
        False
    ] * 5 + [True]
    explicit = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    chosen = gemma3(**TINY, layer_types=explicit).layers
    assert [layer.attn.sliding_window for layer in chosen] == [None, 8, None, None]
    with pytest.raises(ValueError, match="layer_types"):
        gemma3(**TINY, layer_types=["full_attention"])


def test_embedding_scale_rounds_as_transformers_at_released_widths() -> None:
    """sqrt(width) rounded to bfloat16: torchtune's ``GemmaNormEmbeddings`` rounds it from a
    double, transformers from a float32; the same number at every released width."""
    for width in (1152, 2560, 3840, 5376):
        ours = GemmaNormEmbeddings(4, width).to(torch.bfloat16)
        with torch.device("cpu"):
            theirs = transformers.models.gemma3.modeling_gemma3.Gemma3TextScaledWordEmbedding(
                4, width, 0, embed_scale=width**0.5
            ).to(torch.bfloat16)
        theirs.weight.data.copy_(ours.weight.data)
        ids = torch.arange(4)[None]
        assert torch.equal(ours(ids), theirs(ids)), width


# --- masks: explicit, packed, flex, KV-cache -------------------------------------------------


def test_sliding_layers_given_an_explicit_causal_mask_match_no_mask() -> None:
    model = random_model()
    causal = torch.tril(torch.ones(LENGTH, LENGTH, dtype=torch.bool)).expand(2, -1, -1)
    with torch.no_grad():
        assert relative_error(model(tokens(), mask=causal), model(tokens())) < 1e-6
        hidden = torch.randn(2, LENGTH, TINY["embed_dim"])
        sliding = model.layers[0].attn
        assert sliding.sliding_window == TINY["sliding_window"]
        explicit = sliding(hidden, hidden, mask=causal)
        assert relative_error(explicit, sliding(hidden, hidden)) < 1e-6


def packed_row(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of documents back to back, and every token's position in its document."""
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return tokens(batch=1, length=sum(lengths), seed=3), positions


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("flex", [False, True], ids=["dense-mask", "block-mask"])
def test_packed_documents_get_the_logits_they_get_alone(flex: bool) -> None:
    model = random_model()
    lengths = [10, 14]  # the second document is longer than the window
    ids, positions = packed_row(lengths)
    if flex:
        document = torch.tensor([0] * lengths[0] + [1] * lengths[1])

        def block_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (document[q_idx] == document[kv_idx])

        mask = create_block_mask(block_causal, 1, None, LENGTH, LENGTH, device="cpu")
    else:
        mask = create_block_causal_mask([torch.tensor(lengths)])
    with torch.no_grad():
        packed = model(ids, mask=mask, input_pos=positions)
        first, second = ids[:, : lengths[0]], ids[:, lengths[0] :]
        assert relative_error(packed[:, : lengths[0]], model(first)) < BOUND
        assert relative_error(packed[:, lengths[0] :], model(second)) < BOUND


def test_kv_cache_decoding_past_the_window_matches_full_forward() -> None:
    model = random_model()
    ids = tokens(batch=1)
    with torch.no_grad():
        full = model(ids)
        model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=32)
        causal = torch.tril(torch.ones(32, 32, dtype=torch.bool))
        prompt = 5
        steps = [
            model(ids[:, :prompt], input_pos=torch.arange(prompt)[None], mask=causal[None, :prompt])
        ]
        for position in range(prompt, LENGTH):  # 19 steps: the window slides 16 times
            step = model(
                ids[:, position : position + 1],
                input_pos=torch.tensor([[position]]),
                mask=causal[None, position : position + 1],
            )
            steps.append(step)
    assert relative_error(torch.cat(steps, dim=1), full) < BOUND


# --- ours -> Hugging Face --------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_round_trip_and_hf_config_load_in_transformers(tmp_path: Path, variant: str) -> None:
    kwargs = {**TINY, **VARIANTS[variant]}
    ours = random_model(**VARIANTS[variant])
    config = GEMMA3_FORMAT.hf_config(kwargs)
    state = ours.state_dict()
    hf_weights = GEMMA3_FORMAT.tune_to_hf(state, config)
    back = GEMMA3_FORMAT.hf_to_tune(hf_weights, config)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[key], state[key]) for key in state)
    assert "lm_head.weight" not in hf_weights  # tied

    hf = load_hf_model(save_hf_model(tmp_path / "ours", hf_weights, config))
    reference = hf_reference_config(**VARIANTS[variant])
    assert hf.config.layer_types == reference.layer_types
    assert hf.config.rope_parameters == reference.rope_parameters
    assert hf.config.sliding_window == TINY["sliding_window"]
    assert hf.config.query_pre_attn_scalar == TINY["query_pre_attn_scalar"]
    assert hf.config.tie_word_embeddings is True
    with torch.no_grad():
        assert relative_error(ours(tokens()), hf(tokens()).logits) < BOUND


def test_hf_config_defaults_and_refusals() -> None:
    required = ["vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"]
    required += ["embed_dim", "intermediate_dim", "max_seq_len"]
    config = GEMMA3_FORMAT.hf_config({key: TINY[key] for key in required})
    assert config["query_pre_attn_scalar"] == TINY["head_dim"]  # the builder's default
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert config["rope_scaling"] is None and config["sliding_window_pattern"] == 6
    assert config["layer_types"] == ["sliding_attention"] * 4  # the 6th layer would be global
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    assert config["torch_dtype"] == "float32"
    assert hf_format("GEMMA3") is GEMMA3_FORMAT
    with pytest.raises(ValueError, match="vocab_size"):
        GEMMA3_FORMAT.hf_config({key: TINY[key] for key in required[1:]})
    with pytest.raises(ValueError, match="rope_theta"):
        GEMMA3_FORMAT.hf_config({**TINY, "rope_theta": 1.0})  # HF's name, not the builder's
    with pytest.raises(ValueError, match="lora_a"):
        GEMMA3_FORMAT.tune_to_hf({"layers.0.attn.q_proj.lora_a.weight": torch.zeros(1)}, config)
    with pytest.raises(ValueError, match="bias"):
        GEMMA3_FORMAT.hf_to_tune({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)}, config)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        GEMMA3_FORMAT.hf_to_tune({"lm_head.weight": torch.zeros(1)}, {"tie_word_embeddings": False})


def test_a_multimodal_checkpoints_text_decoder_converts() -> None:
    """Google's 4B/12B/27B files are Gemma3ForConditionalGeneration's: the decoder under
    ``language_model.model.`` (transformers >= 4.52 saves ``model.language_model.``)."""
    causal_lm = GEMMA3_FORMAT.tune_to_hf(random_model().state_dict(), {})
    expected = GEMMA3_FORMAT.hf_to_tune(causal_lm, {})
    not_the_decoder = {
        "vision_tower.vision_model.post_layernorm.weight": torch.zeros(1),
        "multi_modal_projector.mm_input_projection_weight": torch.zeros(1),
        "model.multi_modal_projector.mm_soft_emb_norm.weight": torch.zeros(1),
    }
    for prefix in ("language_model.model.", "model.language_model."):
        renamed = {prefix + key.removeprefix("model."): v for key, v in causal_lm.items()}
        converted = GEMMA3_FORMAT.hf_to_tune({**renamed, **not_the_decoder}, {})
        assert converted.keys() == expected.keys()


# --- adapters --------------------------------------------------------------------------------


def lora_model(use_dora: bool) -> nn.Module:
    """A tiny LoRA (or DoRA) Gemma 3 on every attention and MLP projection, base and adapters
    random (torchtune starts lora_b at zero: no adapter to check)."""
    torch.manual_seed(0)
    model = lora_gemma3(ATTN_MODULES, apply_lora_to_mlp=True, **TINY, **LORA, use_dora=use_dora)
    randomize_(model.eval())
    for module in model.modules():
        if isinstance(module, DoRALinear):
            module.initialize_dora_magnitude()  # the base weights' row norms ...
            with torch.no_grad():  # ... moved off them, as training moves them
                module.magnitude.mul_(1 + 0.3 * torch.randn_like(module.magnitude))
    return model


def peft_folder(folder: Path, adapter: dict[str, torch.Tensor], use_dora: bool, base: Path):
    """A PEFT adapter folder: ``adapter`` and the config torchtune's checkpointer writes."""
    folder.mkdir(parents=True)
    save_file(adapter, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = tune_to_peft_adapter_config(
        {
            "r": LORA["lora_rank"],
            "lora_alpha": LORA["lora_alpha"],
            "target_modules": get_lora_module_names(ATTN_MODULES, True, False),
            "peft_type": "LORA",
            "use_dora": use_dora,
        },
        base_model_name_or_path=str(base),
    )
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_peft_loads_our_adapter(tmp_path: Path, use_dora: bool) -> None:
    model = lora_model(use_dora)
    state = model.state_dict()
    adapter_keys = get_adapter_state_dict(state).keys()
    config = GEMMA3_FORMAT.hf_config(TINY)
    base_weights = {k: v for k, v in state.items() if k not in adapter_keys}
    base = save_hf_model(tmp_path / "base", GEMMA3_FORMAT.tune_to_hf(base_weights, config), config)
    adapter = GEMMA3_FORMAT.adapter_to_peft(get_adapter_state_dict(state), config)
    assert "base_model.model.model.layers.3.mlp.gate_proj.lora_A.weight" in adapter
    assert "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight" in adapter
    folder = peft_folder(tmp_path / "adapter", adapter, use_dora, base)

    peft_model = peft.PeftModel.from_pretrained(load_hf_model(base), folder).eval()
    loaded = peft.get_peft_model_state_dict(peft_model)
    assert loaded.keys() == adapter.keys()  # nothing of ours dropped, nothing left at init
    assert all(torch.equal(loaded[key], adapter[key]) for key in adapter)
    with torch.no_grad():
        reference = peft_model(tokens()).logits
        assert relative_error(model(tokens()), reference) < BOUND
        base_only = load_hf_model(base)(tokens()).logits
    assert relative_error(base_only, reference) > 1e-2  # the adapter matters


def test_adapter_names_and_refusals() -> None:
    adapter = GEMMA3_FORMAT.adapter_to_peft(
        {
            "layers.2.attn.k_proj.lora_a.weight": torch.zeros(1),
            "layers.2.mlp.w2.lora_b.weight": torch.zeros(1),
            "layers.2.mlp.w3.magnitude": torch.zeros(1),
        },
        {},
    )
    assert set(adapter) == {
        "base_model.model.model.layers.2.self_attn.k_proj.lora_A.weight",
        "base_model.model.model.layers.2.mlp.down_proj.lora_B.weight",
        "base_model.model.model.layers.2.mlp.up_proj.lora_magnitude_vector",
    }
    with pytest.raises(ValueError, match="q_norm"):
        GEMMA3_FORMAT.adapter_to_peft({"layers.0.attn.q_norm.lora_a.weight": torch.zeros(1)}, {})


# --- sizes -----------------------------------------------------------------------------------

# The Gemma 3 technical report's table 1, text decoder: embedding + non-embedding parameters.
REPORT_SIZES = {
    gemma3_1b: 302e6 + 698e6,
    gemma3_4b: 675e6 + 3_209e6,
    gemma3_12b: 1_012e6 + 10_759e6,
    gemma3_27b: 1_416e6 + 25_600e6,
}
SIZED_ARGUMENTS = {
    gemma3_1b: sized._GEMMA3_1B,
    gemma3_4b: sized._GEMMA3_4B,
    gemma3_12b: sized._GEMMA3_12B,
    gemma3_27b: sized._GEMMA3_27B,
}


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("builder", list(REPORT_SIZES), ids=lambda b: b.__name__)
def test_sized_builders_have_the_reports_sizes(builder: Any) -> None:
    with torch.device("meta"):
        model = builder()
    assert isinstance(model.output, TiedLinear)
    assert abs(parameter_count(model) / REPORT_SIZES[builder] - 1) < 0.01


@pytest.mark.parametrize("builder", [gemma3_1b, gemma3_27b], ids=lambda b: b.__name__)
def test_sized_builders_match_transformers_for_their_config(builder: Any) -> None:
    config = GEMMA3_FORMAT.hf_config({**SIZED_ARGUMENTS[builder], **sized._SHARED})
    with torch.device("meta"):
        ours = builder()
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig.from_dict(config))
    theirs = {k: v.shape for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    converted = GEMMA3_FORMAT.tune_to_hf(ours.state_dict(), config)
    assert {k: v.shape for k, v in converted.items()} == theirs
    assert hf.config.layer_types.count("full_attention") == len(ours.layers) // 6
    scaling = hf.config.rope_parameters["full_attention"]
    assert scaling.get("factor") == SIZED_ARGUMENTS[builder]["rope_scaling_factor"]


LORA_BUILDERS = {
    lora_gemma3_1b: qlora_gemma3_1b,
    lora_gemma3_4b: qlora_gemma3_4b,
    lora_gemma3_12b: qlora_gemma3_12b,
    lora_gemma3_27b: qlora_gemma3_27b,
}


@pytest.mark.parametrize("builder", list(LORA_BUILDERS), ids=lambda b: b.__name__)
def test_sized_lora_builders_and_their_qlora_twins(builder: Any) -> None:
    qlora = LORA_BUILDERS[builder]
    assert qlora.func is builder and qlora.keywords == {"quantize_base": True}
    with torch.device("meta"):
        model = builder(["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=8)
    adapters = [key for key in model.state_dict() if ".lora_" in key]
    per_layer = 2 * 2 + 3 * 2  # lora_a and lora_b on q, v and the MLP's three projections
    assert len(adapters) == per_layer * len(model.layers)


def test_qlora_quantizes_the_base_linears_to_nf4() -> None:
    # NF4 quantizes in blocks of 64 values, scaled in blocks of 256 blocks: 256-wide linears.
    sizes = {**TINY, "embed_dim": 256, "intermediate_dim": 256, "head_dim": 64}
    model = lora_gemma3(["q_proj"], apply_lora_to_mlp=False, **sizes, **LORA, quantize_base=True)
    attn = model.layers[0].attn
    assert attn.q_proj._quantize_base
    assert isinstance(attn.k_proj, FrozenNF4Linear)
    assert isinstance(model.layers[0].mlp.w1, FrozenNF4Linear)
    with torch.no_grad():
        assert model(tokens()).shape == (2, LENGTH, VOCAB)
