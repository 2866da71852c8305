"""Qwen3 (exactga.models.qwen3) computes what Hugging Face's ``Qwen3ForCausalLM`` computes, and
its format converts weights and adapters the way transformers and PEFT read them.

All in-process, fp32, on tiny random models whose ``head_dim`` (12) is not ``embed_dim //
num_heads`` (8) and whose attention is grouped (4 query heads, 2 kv heads). Every weight is
random, the QK-norm and layer-norm scales included: with torchtune's initial scales of one,
QK-norm before or after RoPE would give the same numbers and the order would go untested.

- HF -> ours: a transformers model saved with ``save_pretrained``, converted with
  ``QWEN3_FORMAT.hf_to_tune``, loads into ``qwen3(...)`` with ``strict=True`` and gives the same
  logits (also at shifted positions, and token by token through the KV-cache); torchtune's
  stock attention order (QK-norm after RoPE) does not.
- ours -> HF: ``tune_to_hf`` then ``hf_to_tune`` is the identity, and the files written from
  ``tune_to_hf`` and ``hf_config`` load with ``from_pretrained`` (no missing or unexpected
  key) into a model with our logits.
- adapters: ``adapter_to_peft``'s file loads with ``PeftModel.from_pretrained`` into exactly our
  adapter values and our LoRA/DoRA model's logits; torchtune 0.6.1's
  ``tune_to_peft_adapter_weights`` (Llama's q/k row permutation) does not. End to end: the
  seeded initial checkpoint, read and written by exactga's HF checkpointer with a LoRA model,
  loads in transformers and PEFT with that model's logits.
- sizes: the sized builders' parameter counts (meta device) are the model cards', and their
  weights have the names and shapes of transformers' model for the same ``config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torch import nn
from torchtune import training
from torchtune.models.convert_weights import (
    tune_to_peft_adapter_config,
    tune_to_peft_adapter_weights,
)
from torchtune.modules import MultiHeadAttention
from torchtune.modules.peft import (
    DoRALinear,
    LoRALinear,
    get_adapter_state_dict,
    get_lora_module_names,
)

from exactga.models.checkpointer import FullModelHFCheckpointer
from exactga.models.qwen3 import (
    BUILDER_ARGUMENTS,
    QWEN3_FORMAT,
    Qwen3Attention,
    lora_qwen3,
    lora_qwen3_0_6b,
    lora_qwen3_1_7b,
    lora_qwen3_4b,
    lora_qwen3_8b,
    lora_qwen3_14b,
    lora_qwen3_32b,
    qlora_qwen3_0_6b,
    qlora_qwen3_1_7b,
    qlora_qwen3_4b,
    qlora_qwen3_8b,
    qlora_qwen3_14b,
    qlora_qwen3_32b,
    qwen3,
    qwen3_0_6b,
    qwen3_1_7b,
    qwen3_4b,
    qwen3_8b,
    qwen3_14b,
    qwen3_32b,
)
from exactga.models.random_init_checkpointer import write_initial_checkpoint
from exactga.run.checkpointing import move_peft_adapter_to_own_folder

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# PEFT 0.18 calls a transformers 5 method that warns of its own deprecation.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

BOUND = 1e-5  # relative L2 of the logits, fp32
VOCAB = 96
TINY = {
    "vocab_size": VOCAB,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 32,
    "head_dim": 12,  # not 32 // 4: q and the attention output are 48 wide
    "intermediate_dim": 48,
    "max_seq_len": 64,
    "norm_eps": 1e-6,
    "rope_base": 10_000.0,  # a small base turns every RoPE pair visibly at 11 positions
}
ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "output_proj"]
LORA = {"lora_rank": 4, "lora_alpha": 8.0}


def tiny_kwargs(tied: bool) -> dict[str, Any]:
    return {**TINY, "tie_word_embeddings": tied}


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


def hf_reference_config(tied: bool) -> Any:
    """transformers' config of the tiny model, written out here (not by ``hf_config``)."""
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=TINY["embed_dim"],
        intermediate_size=TINY["intermediate_dim"],
        num_hidden_layers=TINY["num_layers"],
        num_attention_heads=TINY["num_heads"],
        num_key_value_heads=TINY["num_kv_heads"],
        head_dim=TINY["head_dim"],
        max_position_embeddings=TINY["max_seq_len"],
        rms_norm_eps=TINY["norm_eps"],
        rope_theta=TINY["rope_base"],
        tie_word_embeddings=tied,
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
    model, info = transformers.Qwen3ForCausalLM.from_pretrained(
        folder, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def hf_saved_model(folder: Path, tied: bool) -> Path:
    """A random transformers Qwen3, written by ``save_pretrained``."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(hf_reference_config(tied))
    randomize_(model)
    model.save_pretrained(folder)
    return folder


def ours_from_hf_folder(folder: Path, tied: bool) -> nn.Module:
    """``qwen3(...)`` loaded (``strict=True``) from a Hugging Face folder through hf_to_tune."""
    config = json.loads((folder / "config.json").read_text())
    weights = QWEN3_FORMAT.hf_to_tune(load_file(folder / "model.safetensors"), config)
    model = qwen3(**tiny_kwargs(tied))
    model.load_state_dict(weights, strict=True)
    return model.eval()


# --- Hugging Face -> ours --------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_weights_give_hf_logits(tmp_path: Path, tied: bool) -> None:
    folder = hf_saved_model(tmp_path / "hf", tied)
    hf = load_hf_model(folder)
    ours = ours_from_hf_folder(folder, tied)
    ids = tokens()
    shifted = torch.arange(5, 5 + ids.shape[1]).expand(ids.shape)  # a document at position 5
    with torch.no_grad():
        assert relative_error(ours(ids), hf(ids).logits) < BOUND
        shifted_hf = hf(ids, position_ids=shifted).logits
        assert relative_error(ours(ids, input_pos=shifted), shifted_hf) < BOUND
    assert all(isinstance(layer.attn, Qwen3Attention) for layer in ours.layers)


def test_tied_hf_files_have_no_lm_head(tmp_path: Path) -> None:
    saved = load_file(hf_saved_model(tmp_path / "hf", tied=True) / "model.safetensors")
    assert "lm_head.weight" not in saved
    ours = qwen3(**tiny_kwargs(tied=True))
    assert "output.weight" not in ours.state_dict()
    with_lm_head = {**saved, "lm_head.weight": saved["model.embed_tokens.weight"]}
    assert QWEN3_FORMAT.hf_to_tune(with_lm_head, {"tie_word_embeddings": True}).keys() == (
        ours.state_dict().keys()
    )


def test_qk_norm_before_rope_is_what_hf_does(tmp_path: Path) -> None:
    """torchtune 0.6.1's MultiHeadAttention normalises q and k after RoPE; with trained
    (non-unit) QK-norm scales that is another model."""
    folder = hf_saved_model(tmp_path / "hf", tied=False)
    hf = load_hf_model(folder)
    ours = ours_from_hf_folder(folder, tied=False)
    for layer in ours.layers:
        layer.attn.__class__ = MultiHeadAttention  # same modules, torchtune's order
    with torch.no_grad():
        assert relative_error(ours(tokens()), hf(tokens()).logits) > 1e-2


def test_kv_cache_decoding_matches_full_forward() -> None:
    torch.manual_seed(0)
    model = qwen3(**tiny_kwargs(tied=False)).eval()
    randomize_(model)
    ids = tokens(batch=1, length=9)
    with torch.no_grad():
        full = model(ids)
        model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=16)
        causal = torch.tril(torch.ones(16, 16, dtype=torch.bool))
        prompt = 5
        steps = [
            model(ids[:, :prompt], input_pos=torch.arange(prompt)[None], mask=causal[None, :prompt])
        ]
        for position in range(prompt, ids.shape[1]):
            step = model(
                ids[:, position : position + 1],
                input_pos=torch.tensor([[position]]),
                mask=causal[None, position : position + 1],
            )
            steps.append(step)
    assert relative_error(torch.cat(steps, dim=1), full) < BOUND


# --- ours -> Hugging Face --------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_round_trip_and_hf_config_load_in_transformers(tmp_path: Path, tied: bool) -> None:
    kwargs = tiny_kwargs(tied)
    torch.manual_seed(0)
    ours = qwen3(**kwargs).eval()
    randomize_(ours)
    config = QWEN3_FORMAT.hf_config(kwargs)
    state = ours.state_dict()
    hf_weights = QWEN3_FORMAT.tune_to_hf(state, config)
    back = QWEN3_FORMAT.hf_to_tune(hf_weights, config)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[key], state[key]) for key in state)
    assert ("lm_head.weight" in hf_weights) is not tied

    hf = load_hf_model(save_hf_model(tmp_path / "ours", hf_weights, config))
    assert hf.config.head_dim == TINY["head_dim"]
    assert hf.config.rope_parameters["rope_theta"] == TINY["rope_base"]
    assert hf.config.tie_word_embeddings is tied
    with torch.no_grad():
        assert relative_error(ours(tokens()), hf(tokens()).logits) < BOUND


def test_hf_config_defaults_and_refusals() -> None:
    required_only = {
        key: TINY[key] for key in TINY if key not in ("head_dim", "norm_eps", "rope_base")
    }
    config = QWEN3_FORMAT.hf_config(required_only)
    assert config["head_dim"] == TINY["embed_dim"] // TINY["num_heads"]  # qwen3's default
    assert (config["rope_theta"], config["rms_norm_eps"]) == (1_000_000.0, 1e-6)
    assert (config["architectures"], config["model_type"]) == (["Qwen3ForCausalLM"], "qwen3")
    assert config["tie_word_embeddings"] is False
    with pytest.raises(ValueError, match="vocab_size"):
        QWEN3_FORMAT.hf_config({key: v for key, v in TINY.items() if key != "vocab_size"})
    with pytest.raises(ValueError, match="lora_a"):
        QWEN3_FORMAT.tune_to_hf({"layers.0.attn.q_proj.lora_a.weight": torch.zeros(1)}, config)
    with pytest.raises(ValueError, match="bias"):
        QWEN3_FORMAT.hf_to_tune({"model.layers.0.self_attn.q_proj.bias": torch.zeros(1)}, config)


# --- adapters --------------------------------------------------------------------------------


def lora_model(tied: bool, use_dora: bool) -> nn.Module:
    """A tiny LoRA (or DoRA) Qwen3 on every projection, with random base and adapters."""
    torch.manual_seed(0)
    model = lora_qwen3(
        ATTN_MODULES,
        apply_lora_to_mlp=True,
        apply_lora_to_output=not tied,
        **tiny_kwargs(tied),
        **LORA,
        use_dora=use_dora,
    ).eval()
    randomize_(model)  # lora_b too (torchtune starts it at zero: no adapter to check)
    for module in model.modules():
        if isinstance(module, DoRALinear):
            module.initialize_dora_magnitude()  # the base weights' row norms ...
            with torch.no_grad():  # ... moved off them, as training moves them
                module.magnitude.mul_(1 + 0.3 * torch.randn_like(module.magnitude))
    return model


def peft_folder(
    folder: Path, adapter: dict[str, torch.Tensor], tied: bool, use_dora: bool, base: Path
) -> Path:
    """A PEFT adapter folder: ``adapter`` and the config torchtune's checkpointer writes."""
    folder.mkdir(parents=True)
    save_file(adapter, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    target_modules = get_lora_module_names(ATTN_MODULES, True, not tied)
    config = tune_to_peft_adapter_config(
        {
            "r": LORA["lora_rank"],
            "lora_alpha": LORA["lora_alpha"],
            "target_modules": target_modules,
            "peft_type": "LORA",
            "use_dora": use_dora,
        },
        base_model_name_or_path=str(base),
    )
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def base_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict less its adapters: the frozen base."""
    adapter = get_adapter_state_dict(state)
    return {key: value for key, value in state.items() if key not in adapter}


def base_hf_folder(folder: Path, model: nn.Module, tied: bool) -> Path:
    """The LoRA model's frozen base as a Hugging Face model folder."""
    base = base_weights(model.state_dict())
    config = QWEN3_FORMAT.hf_config(tiny_kwargs(tied))
    return save_hf_model(folder, QWEN3_FORMAT.tune_to_hf(base, config), config)


LORA_CASES = [(False, False), (True, False), (False, True)]
LORA_IDS = ["lora-untied-output", "lora-tied", "dora-untied-output"]


@pytest.mark.parametrize(("tied", "use_dora"), LORA_CASES, ids=LORA_IDS)
def test_peft_loads_our_adapter(tmp_path: Path, tied: bool, use_dora: bool) -> None:
    model = lora_model(tied, use_dora)
    base = base_hf_folder(tmp_path / "base", model, tied)
    config = json.loads((base / "config.json").read_text())
    adapter = QWEN3_FORMAT.adapter_to_peft(get_adapter_state_dict(model.state_dict()), config)
    folder = peft_folder(tmp_path / "adapter", adapter, tied, use_dora, base)

    peft_model = peft.PeftModel.from_pretrained(load_hf_model(base), folder).eval()
    # save_embedding_layers=False: without it PEFT adds lm_head's (base) weight when adapted.
    loaded = peft.get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    assert loaded.keys() == adapter.keys()  # nothing of ours dropped, nothing left at init
    assert all(torch.equal(loaded[key], adapter[key]) for key in adapter)
    with torch.no_grad():
        reference = peft_model(tokens()).logits
        assert relative_error(model(tokens()), reference) < BOUND
        base_only = load_hf_model(base)(tokens()).logits
    assert relative_error(base_only, reference) > 1e-2  # the adapter matters


def test_exactga_checkpointer_writes_what_transformers_and_peft_load(tmp_path: Path) -> None:
    """The seeded initial checkpoint (QWEN3) read by exactga's HF checkpointer into a LoRA
    model, whose epoch folder then loads in transformers (base) and PEFT (adapter)."""
    model_cfg = OmegaConf.create({"_component_": "exactga.models.qwen3.qwen3", **TINY})
    write_initial_checkpoint(model_cfg, tmp_path / "init", "model.safetensors", 0, "QWEN3")
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(tmp_path / "init"),
        checkpoint_files=["model.safetensors"],
        model_type="QWEN3",
        output_dir=str(tmp_path / "out"),
    )
    model = lora_model(tied=False, use_dora=False)  # random adapters ...
    missing, unexpected = model.load_state_dict(
        checkpointer.load_checkpoint()[training.MODEL_KEY], strict=False
    )  # ... on the seeded base
    assert not unexpected and set(missing) == set(get_adapter_state_dict(model.state_dict()))
    adapter_config = {
        "r": LORA["lora_rank"],
        "lora_alpha": LORA["lora_alpha"],
        "target_modules": get_lora_module_names(ATTN_MODULES, True, True),
        "peft_type": "LORA",
    }
    state = model.state_dict()
    checkpointer.save_checkpoint(
        {
            training.MODEL_KEY: base_weights(state),
            training.ADAPTER_KEY: get_adapter_state_dict(state),
            training.ADAPTER_CONFIG: adapter_config,
        },
        epoch=0,
    )
    epoch = tmp_path / "out" / "epoch_0"
    # As exactga's LoRA saves do: transformers 5 would read an adapter beside the base itself.
    adapter_folder = move_peft_adapter_to_own_folder(epoch, base_model=str(epoch))
    peft_model = peft.PeftModel.from_pretrained(load_hf_model(epoch), adapter_folder).eval()
    with torch.no_grad():
        assert relative_error(model(tokens()), peft_model(tokens()).logits) < BOUND


def test_torchtune_peft_conversion_scrambles_qwen3_adapters(tmp_path: Path) -> None:
    """torchtune 0.6.1's own conversion (which its checkpointer applies to Qwen2 as well)
    permutes q/k ``lora_B`` rows for Llama's RoPE layout: wrong for rotate-half Qwen."""
    model = lora_model(tied=False, use_dora=False)
    base = base_hf_folder(tmp_path / "base", model, tied=False)
    stock = tune_to_peft_adapter_weights(
        get_adapter_state_dict(model.state_dict()),
        num_heads=TINY["num_heads"],
        num_kv_heads=TINY["num_kv_heads"],
        dim=TINY["embed_dim"],
        head_dim=TINY["head_dim"],
    )
    folder = peft_folder(tmp_path / "adapter", stock, False, False, base)
    peft_model = peft.PeftModel.from_pretrained(load_hf_model(base), folder).eval()
    with torch.no_grad():
        assert relative_error(model(tokens()), peft_model(tokens()).logits) > 1e-2


def test_adapter_names() -> None:
    adapter = {
        "layers.3.attn.output_proj.lora_a.weight": torch.zeros(1),
        "layers.3.mlp.w1.lora_b.weight": torch.zeros(1),
        "layers.3.attn.k_proj.magnitude": torch.zeros(1),
        "output.lora_a.weight": torch.zeros(1),
    }
    assert list(QWEN3_FORMAT.adapter_to_peft(adapter, {})) == [
        "base_model.model.model.layers.3.self_attn.o_proj.lora_A.weight",
        "base_model.model.model.layers.3.mlp.gate_proj.lora_B.weight",
        "base_model.model.model.layers.3.self_attn.k_proj.lora_magnitude_vector",
        "base_model.model.lm_head.lora_A.weight",
    ]
    with pytest.raises(ValueError, match="q_norm"):
        QWEN3_FORMAT.adapter_to_peft({"layers.0.attn.q_norm.lora_a.weight": torch.zeros(1)}, {})


# --- builders --------------------------------------------------------------------------------

# builder -> (total, non-embedding) parameters on its Qwen3 model card. A tied embedding
# counts once, as the cards count it.
MODEL_CARDS = {
    qwen3_0_6b: (0.6e9, 0.44e9),
    qwen3_1_7b: (1.7e9, 1.4e9),
    qwen3_4b: (4.0e9, 3.6e9),
    qwen3_8b: (8.2e9, 6.95e9),
    qwen3_14b: (14.8e9, 13.2e9),
    qwen3_32b: (32.8e9, 31.2e9),
}


def parameter_count(model: nn.Module) -> tuple[int, int]:
    """(all parameters, those outside the embedding and the output projection)."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    output = model.output.weight.numel() if isinstance(model.output, nn.Linear) else 0
    return total, total - embedding - output


@pytest.mark.parametrize("builder", list(MODEL_CARDS), ids=lambda b: b.__name__)
def test_sized_builders_have_the_model_cards_sizes(builder: Any) -> None:
    with torch.device("meta"):
        model = builder()
    total, non_embedding = parameter_count(model)
    card_total, card_non_embedding = MODEL_CARDS[builder]
    assert total == pytest.approx(card_total, rel=0.02)
    assert non_embedding == pytest.approx(card_non_embedding, rel=0.02)


@pytest.mark.parametrize("builder", [qwen3_0_6b, qwen3_8b], ids=lambda b: b.__name__)
def test_sized_builders_match_transformers_for_their_config(builder: Any) -> None:
    config = QWEN3_FORMAT.hf_config(BUILDER_ARGUMENTS[builder.__name__])
    with torch.device("meta"):
        ours = builder()
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    ours_shapes = {
        k: v.shape for k, v in QWEN3_FORMAT.tune_to_hf(ours.state_dict(), config).items()
    }
    hf_shapes = {k: v.shape for k, v in hf.state_dict().items()}
    if config["tie_word_embeddings"]:
        del hf_shapes["lm_head.weight"]  # the embedding's, not in the files
    assert ours_shapes == hf_shapes


LORA_BUILDERS = {
    lora_qwen3_0_6b: qlora_qwen3_0_6b,
    lora_qwen3_1_7b: qlora_qwen3_1_7b,
    lora_qwen3_4b: qlora_qwen3_4b,
    lora_qwen3_8b: qlora_qwen3_8b,
    lora_qwen3_14b: qlora_qwen3_14b,
    lora_qwen3_32b: qlora_qwen3_32b,
}
TIED_LORA_BUILDERS = (lora_qwen3_0_6b, lora_qwen3_1_7b, lora_qwen3_4b)


@pytest.mark.parametrize("builder", list(LORA_BUILDERS), ids=lambda b: b.__name__)
def test_sized_lora_builders(builder: Any) -> None:
    qlora = LORA_BUILDERS[builder]
    assert qlora.func is builder and qlora.keywords == {"quantize_base": True}
    with torch.device("meta"):
        model = builder(["q_proj", "v_proj"], apply_lora_to_mlp=True)
    assert isinstance(model.layers[0].attn.q_proj, LoRALinear)
    assert type(model.layers[0].attn.k_proj) is nn.Linear
    if builder in TIED_LORA_BUILDERS:
        with pytest.raises(ValueError, match="tie_word_embeddings"):
            builder(["q_proj"], apply_lora_to_output=True)


def test_qlora_quantizes_the_adapted_bases_to_nf4() -> None:
    """NF4 needs multiples of 64 * 256 elements: a 256-wide, one-layer model."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    shapes = {**TINY, "num_layers": 1, "embed_dim": 256, "head_dim": 64, "intermediate_dim": 128}
    model = lora_qwen3(ATTN_MODULES, True, False, **shapes, **LORA, quantize_base=True)
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    quantized = [attn.q_proj, attn.k_proj, attn.v_proj, attn.output_proj, mlp.w1, mlp.w2, mlp.w3]
    assert all(isinstance(linear.weight, NF4Tensor) for linear in quantized)
    assert not isinstance(model.output.weight, NF4Tensor)  # never quantised, as in torchtune
    assert torch.isfinite(model(tokens(length=4))).all()
    # The state dict holds plain tensors (torchtune's hook): the base loads into qwen3(...).
    base = base_weights(model.state_dict())
    assert not any(isinstance(v, NF4Tensor) for v in base.values())
    qwen3(**shapes).load_state_dict(base, strict=True)


def test_lora_builder_refusals() -> None:
    with pytest.raises(ValueError, match="lora_attn_modules"):
        lora_qwen3([], **tiny_kwargs(tied=False), **LORA)
    with pytest.raises(ValueError, match="lora_attn_modules"):
        lora_qwen3(["q_norm"], **tiny_kwargs(tied=False), **LORA)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        lora_qwen3(["q_proj"], apply_lora_to_output=True, **tiny_kwargs(tied=True), **LORA)
