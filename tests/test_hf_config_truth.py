"""A Hugging Face folder's ``config.json`` is the truth of the model a config trains (issue #62).

For each family (Qwen3, Gemma 3, Qwen3 MoE, and Llama 3.2 / Qwen2 through torchtune's builders)
a tiny model made with transformers' own classes, with values that differ from the builders'
defaults (RoPE bases, norm eps, tying, Gemma 3's window, scalar and RoPE scaling, Qwen3 MoE's
``norm_topk_prob``), is saved with ``save_pretrained``, and:

- a model section of one line (``_component_``) builds the model transformers builds from the same
  folder: the same logits in process through the recipes' own start-up step
  (``exactga.model_build.trained.models_from_folders``), and through ``tune run`` the same
  first-step loss, with an output folder whose ``config.json`` is the folder's and loads as the
  trained model;
- the builders' defaults would have built another model (the test can fail);
- an explicit value that disagrees, a sized builder of another size, a builder of another family
  are refused in one message naming the ``config.json`` key, both values and the fix; a builder
  argument nobody gives is named;
- the released ``config.json`` files (written here from the hub's, both of transformers' formats)
  agree with the shipped sized builders, so shipped configs start as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from many_runs import Run, launch_runs
from omegaconf import OmegaConf
from recipe_utils import REPO_ROOT, logged_steps
from torchtune import config, training

from exactga.model_build.trained import models_from_folders
from exactga.models.hf_config import FAMILIES, fillable_from_folder, resolve_model_section
from exactga.models.random_init_checkpointer import write_initial_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB = 2048  # configs/tiny's tokenizer has 2000 pieces: every family trains on it here
LOGITS_BOUND = 1e-5  # relative L2 of the logits, fp32
DEFAULTS_MOVE = 1e-3  # the builders' defaults move the logits at least this much
_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

# family -> transformers' classes, the folder's non-default values, the short model section, the
# checkpointer's model_type, the arguments whose defaults differ from the folder (the model those
# defaults build must differ), and one explicit value that disagrees with the message it gets.
FAMILY_CASES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "classes": ("Qwen3Config", "Qwen3ForCausalLM"),
        "hf_config": {
            **_SHAPE,
            "head_dim": 32,  # not hidden / heads
            "rope_theta": 1e4,
            "rms_norm_eps": 3e-6,
            "tie_word_embeddings": True,
        },
        "component": "exactga.models.qwen3.qwen3",
        "model_type": "QWEN3",
        "defaults_of": ("rope_base", "norm_eps"),
        "mismatch": (
            {"rope_base": 1e6},
            "model.rope_base=1000000.0 but {file} rope_parameters.rope_theta=10000.0: set "
            "model.rope_base=10000.0 or drop it to take the folder's",
        ),
    },
    "gemma3": {
        "classes": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "hf_config": {
            **_SHAPE,
            "head_dim": 16,
            "sliding_window": 8,  # rows are longer: the window matters
            "query_pre_attn_scalar": 256,  # not head_dim
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_theta": 1e4,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "rms_norm_eps": 3e-6,
            "max_position_embeddings": 1024,
        },
        "component": "exactga.models.gemma3.gemma3",
        "model_type": "GEMMA3",
        "defaults_of": (
            "sliding_window",
            "query_pre_attn_scalar",
            "rope_base",
            "local_rope_base",
            "rope_scaling_factor",
            "norm_eps",
        ),
        "mismatch": (
            {"sliding_window": 4096},
            "model.sliding_window=4096 but {file} sliding_window=8: set model.sliding_window=8 "
            "or drop it to take the folder's",
        ),
    },
    "qwen3_moe": {
        "classes": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "hf_config": {
            **_SHAPE,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,  # the builder's default is True
            "rope_theta": 1e4,
            "rms_norm_eps": 3e-6,
        },
        "component": "exactga.models.qwen3_moe.qwen3_moe",
        "model_type": "QWEN3_MOE",
        "defaults_of": ("norm_topk_prob", "rope_base", "norm_eps"),
        "mismatch": (
            {"num_experts_per_tok": 3},
            "model.num_experts_per_tok=3 but {file} num_experts_per_tok=2: set "
            "model.num_experts_per_tok=2 or drop it to take the folder's",
        ),
    },
    "llama3_2": {
        "classes": ("LlamaConfig", "LlamaForCausalLM"),
        "hf_config": {
            **_SHAPE,
            "rope_theta": 1e4,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "max_position_embeddings": 16384,
            "rms_norm_eps": 3e-6,
            "tie_word_embeddings": True,
        },
        "component": "torchtune.models.llama3_2.llama3_2",
        "model_type": "LLAMA3_2",
        "defaults_of": ("rope_base", "scale_factor", "norm_eps"),
        "mismatch": (
            {"scale_factor": 32},
            "model.scale_factor=32 but {file} rope_parameters.factor=4.0: set "
            "model.scale_factor=4.0 or drop it to take the folder's",
        ),
    },
    "qwen2": {
        "classes": ("Qwen2Config", "Qwen2ForCausalLM"),
        "hf_config": {
            **_SHAPE,
            "rope_theta": 1e4,
            "rms_norm_eps": 3e-6,
            "tie_word_embeddings": True,
        },
        "component": "torchtune.models.qwen2.qwen2",
        "model_type": "QWEN2",
        "defaults_of": ("rope_base", "norm_eps"),
        "mismatch": (
            {"norm_eps": 1e-5},
            "model.norm_eps=1e-05 but {file} rms_norm_eps=3e-06: set model.norm_eps=3e-06 or "
            "drop it to take the folder's",
        ),
    },
}


def _write_folder(family: str, folder: Path) -> Path:
    """A seeded tiny model of ``family`` as transformers writes it (safetensors)."""
    config_class, model_class = FAMILY_CASES[family]["classes"]
    torch.manual_seed(0)
    hf_config = getattr(transformers, config_class)(**FAMILY_CASES[family]["hf_config"])
    model = getattr(transformers, model_class)(hf_config)
    with torch.no_grad():  # norm scales away from their init: a wrong eps or order shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_folders")
    return {family: _write_folder(family, root / family) for family in FAMILY_CASES}


def _checkpointer(family: str, folder: Path, output_dir: Path) -> dict[str, Any]:
    return {
        "_component_": "exactga.models.checkpointer.FullModelHFCheckpointer",
        "checkpoint_dir": str(folder),
        "checkpoint_files": ["model.safetensors"],
        "recipe_checkpoint": None,
        "output_dir": str(output_dir),
        "model_type": FAMILY_CASES[family]["model_type"],
    }


def _cfg(family: str, folder: Path, output_dir: Path, **model: Any):
    section = {"_component_": FAMILY_CASES[family]["component"], **model}
    return OmegaConf.create(
        {"model": section, "checkpointer": _checkpointer(family, folder, output_dir)}
    )


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _transformers_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


def _our_logits(cfg, tokens: torch.Tensor) -> torch.Tensor:
    """The model a recipe builds from ``cfg`` (start-up, builder, checkpointer's weights)."""
    with training.set_default_dtype(torch.float32):
        model = config.instantiate(cfg.model)
    state = config.instantiate(cfg.checkpointer).load_checkpoint()[training.MODEL_KEY]
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_a_one_line_model_section_builds_the_folders_model(folders, family, tmp_path):
    cfg = models_from_folders(_cfg(family, folders[family], tmp_path))
    tokens = _tokens()
    reference = _transformers_logits(folders[family], tokens)
    assert _rel(_our_logits(cfg, tokens), reference) < LOGITS_BOUND
    # What the builders' defaults build instead: another model, silently, before issue #62.
    case = FAMILY_CASES[family]
    defaults = {k: v for k, v in cfg.model.items() if k not in case["defaults_of"]}
    cfg.model = defaults
    assert _rel(_our_logits(cfg, tokens), reference) > DEFAULTS_MOVE


@pytest.mark.parametrize("family", FAMILY_CASES)
def test_explicit_values_that_agree_pass_and_one_that_disagrees_is_refused(
    folders, family, tmp_path
):
    short = models_from_folders(_cfg(family, folders[family], tmp_path))
    spelled_out = OmegaConf.to_container(short.model)
    again = models_from_folders(_cfg(family, folders[family], tmp_path, **spelled_out))
    assert again.model == short.model
    values, message = FAMILY_CASES[family]["mismatch"]
    cfg = _cfg(family, folders[family], tmp_path, **values)
    expected = message.format(file=folders[family] / "config.json")
    with pytest.raises(ValueError) as refused:
        models_from_folders(cfg)
    assert str(refused.value) == expected


def test_a_sized_builder_of_another_size_is_refused_naming_the_short_way(folders, tmp_path):
    cfg = _cfg("qwen3", folders["qwen3"], tmp_path)
    cfg.model = {"_component_": "exactga.models.qwen3.qwen3_0_6b"}
    with pytest.raises(ValueError, match="builds another model than") as refused:
        models_from_folders(cfg)
    message = str(refused.value)
    assert "rope_base=1000000.0 (rope_parameters.rope_theta=10000.0)" in message
    assert "name exactga.models.qwen3.qwen3 with no shape arguments" in message


def test_a_builder_of_another_family_is_refused(folders, tmp_path):
    cfg = _cfg("qwen3", folders["qwen3"], tmp_path)
    cfg.model = {
        "_component_": "exactga.models.gemma3.lora_gemma3",
        "lora_attn_modules": ["q_proj"],
    }
    with pytest.raises(
        ValueError,
        match='model_type="qwen3" but model._component_=.*Gemma 3: name '
        "exactga.models.qwen3.lora_qwen3 with no shape arguments",
    ):
        models_from_folders(cfg)


def test_a_lora_section_takes_the_shape_and_keeps_its_adapters(folders, tmp_path):
    cfg = _cfg("gemma3", folders["gemma3"], tmp_path)
    lora = {"lora_attn_modules": ["q_proj", "v_proj"], "lora_rank": 4, "lora_alpha": 8}
    cfg.model = {"_component_": "exactga.models.gemma3.lora_gemma3", **lora}
    model = models_from_folders(cfg).model
    assert {k: model[k] for k in lora} == lora
    assert (model.sliding_window, model.rope_scaling_factor) == (8, 4.0)
    del cfg.model.lora_rank  # no folder gives a rank
    with pytest.raises(ValueError, match=r"lora_gemma3 needs model.lora_rank: give them"):
        models_from_folders(cfg)


def test_a_missing_argument_without_a_folder_is_named(tmp_path):
    tiny = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / "full_single_device.yaml")
    tiny.output_dir = str(tmp_path)
    del tiny.model.vocab_size, tiny.model.max_seq_len
    with pytest.raises(ValueError) as refused:  # the seeded checkpointer reads no config.json
        models_from_folders(tiny)
    assert str(refused.value) == (
        "model._component_=torchtune.models.llama3_2.llama3_2 needs model.vocab_size, "
        "model.max_seq_len: give them (point the checkpointer at a Hugging Face folder with "
        "config.json to take them from it)"
    )
    assert not list(tmp_path.iterdir())  # nothing written first


def test_the_tiny_configs_seeded_checkpointer_is_left_alone(tmp_path):
    tiny = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / "full_single_device.yaml")
    before = OmegaConf.to_container(tiny.model)
    assert OmegaConf.to_container(models_from_folders(tiny).model) == before


TINY_PAIRS = [
    (path.name, model, checkpointer)
    for path in sorted((REPO_ROOT / "configs" / "tiny").glob("*.yaml"))
    for model, checkpointer in (
        ("model", "checkpointer"),
        ("teacher_model", "teacher_checkpointer"),
        ("policy_model", "checkpointer"),
    )
    if {model, checkpointer} <= set(OmegaConf.load(path))
]


@pytest.mark.parametrize(("name", "model", "checkpointer"), TINY_PAIRS)
def test_the_seeded_folders_config_json_describes_the_tiny_model(
    name, model, checkpointer, tmp_path
):
    """The tiny configs' seeded checkpointer writes a config.json (RoPE scaling included) that
    agrees with the model trained: their output folders load as that model, and pointing
    torchtune's HF checkpointer at one (tests/test_bad_input_launch.py) starts."""
    cfg = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / name)
    cfg.output_dir = str(tmp_path)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    seeded = resolved[checkpointer]
    write_initial_checkpoint(
        OmegaConf.create(seeded["model"]),
        tmp_path / "base",
        "model.safetensors",
        0,
        model_type=seeded["model_type"],
    )
    assert resolve_model_section(model, resolved[model], tmp_path / "base")[1] == {}


def test_what_a_builder_can_take_from_a_folder():
    assert {"vocab_size", "sliding_window", "layer_types", "sliding_window_pattern"} <= (
        fillable_from_folder("exactga.models.gemma3.gemma3")
    )
    assert "lora_rank" not in fillable_from_folder("exactga.models.qwen3.lora_qwen3")
    assert fillable_from_folder("exactga.models.qwen3.qwen3_0_6b") == set()
    assert fillable_from_folder("no.such.builder") == set()


# --- the released folders and the shipped sized builders ---------------------------------------

# The hub's config.json of each release (transformers 4's format: rope_theta, rope_scaling,
# num_experts; Gemma 3 4B multimodal, its text_config leaving transformers' defaults out), the
# keys that decide the model.
RELEASES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "Qwen/Qwen3-0.6B": (
        {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "max_position_embeddings": 40960,
            "max_window_layers": 28,
            "model_type": "qwen3",
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        ("exactga.models.qwen3.qwen3_0_6b", "exactga.models.qwen3.lora_qwen3_0_6b"),
    ),
    "Qwen/Qwen3-8B": (
        {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "max_position_embeddings": 40960,
            "model_type": "qwen3",
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        ("exactga.models.qwen3.qwen3_8b", "exactga.models.qwen3.qlora_qwen3_8b"),
    ),
    "Qwen/Qwen3-30B-A3B": (
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        (
            "exactga.models.qwen3_moe.qwen3_moe_30b_a3b",
            "exactga.models.qwen3_moe.lora_qwen3_moe_30b_a3b",
        ),
    ),
    "google/gemma-3-1b-it": (
        {
            "architectures": ["Gemma3ForCausalLM"],
            "attention_bias": False,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "max_position_embeddings": 32768,
            "model_type": "gemma3_text",
            "num_attention_heads": 4,
            "num_hidden_layers": 26,
            "num_key_value_heads": 1,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "vocab_size": 262144,
        },
        ("exactga.models.gemma3.gemma3_1b", "exactga.models.gemma3.lora_gemma3_1b"),
    ),
    "google/gemma-3-4b-it": (
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "model_type": "gemma3_text",
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
        },
        ("exactga.models.gemma3.gemma3_4b", "exactga.models.gemma3.qlora_gemma3_4b"),
    ),
    "meta-llama/Llama-3.2-1B-Instruct": (
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 16,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "vocab_size": 128256,
        },
        ("torchtune.models.llama3_2.llama3_2_1b", "torchtune.models.llama3_2.lora_llama3_2_1b"),
    ),
    "meta-llama/Llama-3.1-8B-Instruct": (
        {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "vocab_size": 128256,
        },
        ("torchtune.models.llama3_1.llama3_1_8b", "torchtune.models.llama3_1.lora_llama3_1_8b"),
    ),
    "Qwen/Qwen2.5-0.5B-Instruct": (
        {
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_act": "silu",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "max_position_embeddings": 32768,
            "model_type": "qwen2",
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        ("torchtune.models.qwen2_5.qwen2_5_0_5b", "torchtune.models.qwen2_5.lora_qwen2_5_0_5b"),
    ),
}


def _gpt_oss_release(num_layers: int, num_experts: int) -> dict[str, Any]:
    """openai/gpt-oss-20b's and -120b's config.json (transformers 4.56's format, MXFP4)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2),
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": 8,
        "num_local_experts": num_experts,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": [], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 201088,
    }


RELEASES["openai/gpt-oss-20b"] = (
    _gpt_oss_release(24, 32),
    ("exactga.models.gpt_oss.gpt_oss_20b", "exactga.models.gpt_oss.lora_gpt_oss_20b"),
)
RELEASES["openai/gpt-oss-120b"] = (
    _gpt_oss_release(36, 128),
    ("exactga.models.gpt_oss.gpt_oss_120b", "exactga.models.gpt_oss.lora_gpt_oss_120b"),
)


LORA_ARGS = {"lora_attn_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("release", RELEASES)
def test_released_folders_agree_with_the_shipped_sized_builders(release, tmp_path):
    values, builders = RELEASES[release]
    (tmp_path / "config.json").write_text(json.dumps(values))
    for builder in builders:
        section = {"_component_": builder, **(LORA_ARGS if "lora" in builder else {})}
        assert resolve_model_section("model", section, tmp_path) == (section, {})


def test_a_released_folder_refuses_another_size(tmp_path):
    values, _ = RELEASES["google/gemma-3-4b-it"]
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(
        ValueError,
        match=r"gemma3_1b builds another model than .*"
        r"sliding_window=512 \(text_config.sliding_window=1024\)",
    ):
        resolve_model_section("model", {"_component_": "exactga.models.gemma3.gemma3_1b"}, tmp_path)


def test_the_defaults_of_keys_a_file_leaves_out_are_transformers():
    """Where a file leaves a key out, transformers' config class has the value read here."""
    for family in FAMILIES:
        config_class = {
            "qwen3": "Qwen3Config",
            "qwen3_moe": "Qwen3MoeConfig",
            "gpt_oss": "GptOssConfig",
            "gemma3_text": "Gemma3TextConfig",
            "llama": "LlamaConfig",
            "qwen2": "Qwen2Config",
        }[family.model_types[0]]
        hf = getattr(transformers, config_class)()
        for key, value in family.defaults.items():
            if key in ("rope_theta", "rope_local_base_freq"):
                params = hf.rope_parameters
                kind = "sliding_attention" if key == "rope_local_base_freq" else "full_attention"
                got = params.get(kind, params)["rope_theta"]
            elif key == "num_experts":
                got = getattr(hf, "num_local_experts", None) or hf.num_experts
            else:
                got = getattr(hf, key)
            assert got == value, f"{config_class}.{key}: transformers {got!r}, read as {value!r}"


# --- through tune run ----------------------------------------------------------------------------

ROWS = [  # the first step trains on all four, so its loss does not depend on their order
    {"instruction": "Name a colour.", "input": "", "output": "Blue is a colour of the sky."},
    {"instruction": "Add two and three.", "input": "", "output": "Two and three make five."},
    {"instruction": "Say hello.", "input": "in French", "output": "Bonjour, tout le monde!"},
    {"instruction": "What is a fox?", "input": "", "output": "A fox is a small wild animal."},
]


def _run_args(cfg_path: Path, out: Path) -> list[str]:
    return [
        "--config",
        str(cfg_path),
        f"output_dir={out}",
        "batch_size=4",
        "gradient_accumulation_steps=1",
        "max_steps_per_epoch=1",
    ]


def _launch(root: Path, folders: dict[str, Path]) -> None:
    data = root / "data.json"
    data.write_text(json.dumps(ROWS))
    tiny = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / "full_single_device.yaml")
    tiny.dataset.data_files = str(data)
    runs = []
    for family in FAMILY_CASES:
        cfg = tiny.copy()
        cfg.model = {"_component_": FAMILY_CASES[family]["component"]}  # the short way
        cfg.checkpointer = _checkpointer(family, folders[family], Path("${output_dir}"))
        cfg_path = root / f"{family}.yaml"
        OmegaConf.save(cfg, cfg_path)
        runs.append(
            Run(
                "recipes/full_finetune.py",
                _run_args(cfg_path, root / family / "out"),
                root / family,
            )
        )
    refused = [*_run_args(root / "qwen3.yaml", root / "refused" / "out"), "model.rope_base=1e6"]
    runs.append(Run("recipes/full_finetune.py", refused, root / "refused"))
    launch_runs(runs, nproc=0)


@pytest.fixture(scope="module")
def launched(run_once, folders) -> Path:
    return run_once("hf_config_truth", lambda root: _launch(root, folders))


def _transformers_first_loss(folder: Path, cfg) -> float:
    """transformers' loss on the run's four rows, tokenised as the run tokenised them, summed
    over every trained token and divided by their count (the exact step's loss)."""
    tokenizer = config.instantiate(cfg.tokenizer)
    dataset = config.instantiate(cfg.dataset, tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for sample in dataset:
        tokens, labels = torch.tensor([sample["tokens"]]), torch.tensor(sample["labels"])
        with torch.no_grad():
            logits = model(tokens).logits[0, :-1]
        targets = labels[1:]
        total += torch.nn.functional.cross_entropy(
            logits.double(), targets, ignore_index=-100, reduction="sum"
        )
        count += int((targets != -100).sum())
    assert len(dataset) == len(ROWS)
    return float(total / count)


@pytest.mark.slow
@pytest.mark.xdist_group("hf_config_truth")
@pytest.mark.parametrize("family", FAMILY_CASES)
def test_a_short_section_trains_the_folders_model_through_tune_run(launched, folders, family):
    run = launched / family
    assert (run / "returncode").read_text() == "0", (run / "output.txt").read_text()[-4000:]
    out = run / "out"
    resolved = OmegaConf.load(out / "resolved_config.yaml")
    first = logged_steps(out / "logs")[1]
    expected = _transformers_first_loss(folders[family], resolved)
    assert abs(first - expected) / expected < 1e-5, (first, expected)
    # The output folder describes the model that was trained: the folder's config.json, which
    # transformers loads with the trained weights as our builder does.
    epoch = out / "epoch_0"
    assert json.loads((epoch / "config.json").read_text()) == json.loads(
        (folders[family] / "config.json").read_text()
    )
    trained = OmegaConf.create({"model": resolved.model, "checkpointer": resolved.checkpointer})
    trained.checkpointer.checkpoint_dir = str(epoch)
    trained.checkpointer.checkpoint_files = ["model-00001-of-00001.safetensors"]
    trained.checkpointer.output_dir = str(run / "reread")
    tokens = _tokens()
    assert _rel(_our_logits(trained, tokens), _transformers_logits(epoch, tokens)) < LOGITS_BOUND


@pytest.mark.slow
@pytest.mark.xdist_group("hf_config_truth")
def test_a_disagreeing_value_is_refused_at_start_up_before_anything_is_written(launched, folders):
    run = launched / "refused"
    assert (run / "returncode").read_text() != "0"
    output = (run / "output.txt").read_text()
    assert (
        f"model.rope_base=1000000.0 but {folders['qwen3'] / 'config.json'} "
        "rope_parameters.rope_theta=10000.0: set model.rope_base=10000.0 or drop it" in output
    )
    assert "Traceback" not in output
    out = run / "out"
    assert not out.exists() or not any(out.iterdir())
