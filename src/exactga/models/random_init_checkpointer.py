"""A checkpointer that writes seeded random initial weights on first use, then reads them.

Named for what it is: the embedded default's (and the tests') initial checkpoint, made on first
use if absent.

The tiny model has no published weights, so its config points torchtune's
``FullModelHFCheckpointer`` at a folder that :func:`initialized_hf_checkpointer` fills the first
time: seeded random weights of the configured architecture, written in Hugging Face's format
(``config.json`` plus ``model.safetensors``), the same path real Llama checkpoints take. Nothing
is ever downloaded.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file
from torchtune import config
from torchtune.models import convert_weights

from exactga.models.checkpointer import FullModelHFCheckpointer
from exactga.models.hf_format import hf_format


def initialized_hf_checkpointer(
    *, model: DictConfig | dict[str, Any], init_seed: int = 0, **checkpointer_kwargs: Any
) -> FullModelHFCheckpointer:
    """A ``FullModelHFCheckpointer`` whose ``checkpoint_dir`` is created from ``model`` if empty
    (exactga's, so that the families torchtune 0.6.1 lacks are written and read too).

    Args:
        model: the recipe's model section (``model: ${model}`` in the config).
        init_seed: seed of the initial weights; every run with the same seed starts equal.
        **checkpointer_kwargs: passed to ``FullModelHFCheckpointer`` unchanged.
    """
    checkpoint_dir = Path(checkpointer_kwargs["checkpoint_dir"])
    files = list(checkpointer_kwargs["checkpoint_files"])
    if len(files) != 1:
        raise ValueError("config key 'checkpointer.checkpoint_files' must name one file here.")
    if not (checkpoint_dir / files[0]).exists():
        # torchtune hands sections over as plain dicts.
        write_initial_checkpoint(
            OmegaConf.create(model),
            checkpoint_dir,
            files[0],
            init_seed,
            model_type=checkpointer_kwargs["model_type"],
        )
    return FullModelHFCheckpointer(**checkpointer_kwargs)


def write_initial_checkpoint(
    model_cfg: DictConfig,
    checkpoint_dir: Path,
    file_name: str,
    init_seed: int,
    model_type: str = "LLAMA3_2",
) -> None:
    """Seeded weights of ``model_cfg`` in HF format; atomic, so parallel first runs agree.

    ``model_cfg`` is a plain model: a LoRA builder's state dict has adapter keys that no HF
    checkpoint holds (configs/tiny/lora_single_device.yaml gives the checkpointer the plain
    builder with the LoRA model's sizes). ``model_type`` is the checkpointer's: the weights are
    written in the layout its loader converts from (Phi-3's fused projections, Qwen2's tied
    output, ...), so any family of torchtune's builders round-trips.
    """
    family_format = hf_format(model_type)
    if model_type not in _HF_ARCHITECTURES and family_format is None:
        raise ValueError(
            f"config key 'checkpointer.model_type'={model_type!r}: the initial checkpoint can be "
            f"written for {', '.join(_HF_ARCHITECTURES)}, QWEN3 and GEMMA3 only."
        )
    if "lora_rank" in model_cfg:
        raise ValueError(
            f"config key 'checkpointer.model' is a LoRA model ({model_cfg.get('_component_')}); "
            "the initial checkpoint holds base weights only, so give it the plain builder with "
            "the same sizes (see configs/tiny/lora_single_device.yaml)."
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        with torch.device("cpu"):
            model = config.instantiate(model_cfg)
        _init_like_pretraining(model)
    if family_format is not None:  # an exactga family describes its own format
        hf_config = family_format.hf_config(_builder_arguments(model_cfg))
        state_dict = family_format.tune_to_hf(model.state_dict(), hf_config)
    else:
        hf_config = _hf_config(model_cfg, model, model_type)
        state_dict = _tune_to_hf(model.state_dict(), hf_config, model_type)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    weights = {key: value.contiguous() for key, value in state_dict.items()}
    _atomic_write(checkpoint_dir / "config.json", lambda p: p.write_text(json.dumps(hf_config)))
    _atomic_write(checkpoint_dir / file_name, lambda p: save_file(weights, str(p)))


def _builder_arguments(model_cfg: DictConfig) -> dict[str, Any]:
    """Every argument the model section's builder is called with, its defaults included: the
    ``config.json`` must describe the model built, not only the keys the config spells out."""
    from torchtune.config._utils import _get_component_from_path

    kwargs = OmegaConf.to_container(model_cfg, resolve=True)
    builder = _get_component_from_path(kwargs.pop("_component_"))
    bound = inspect.signature(builder).bind(**kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _init_like_pretraining(model: torch.nn.Module, std: float = 0.02) -> None:
    """GPT-style init: torch's unit-variance embeddings, tied to the output, start at a loss
    of hundreds; small normal weights start near ``log(vocab_size)`` as a pretrained run did."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)


# checkpointer.model_type -> (HF architecture, HF model_type) written to config.json.
_HF_ARCHITECTURES = {
    "LLAMA2": ("LlamaForCausalLM", "llama"),
    "LLAMA3": ("LlamaForCausalLM", "llama"),
    "LLAMA3_2": ("LlamaForCausalLM", "llama"),
    "MISTRAL": ("MistralForCausalLM", "mistral"),
    "GEMMA": ("GemmaForCausalLM", "gemma"),
    "GEMMA2": ("Gemma2ForCausalLM", "gemma2"),
    "PHI3_MINI": ("Phi3ForCausalLM", "phi3"),
    "PHI4": ("Phi3ForCausalLM", "phi3"),
    "QWEN2": ("Qwen2ForCausalLM", "qwen2"),
    # torchtune's reward and value models: a Mistral-style classifier (``score`` head).
    "REWARD": ("MistralForSequenceClassification", "mistral"),
}


def _hf_config(model_cfg: DictConfig, model: torch.nn.Module, model_type: str) -> dict[str, Any]:
    """The ``config.json`` fields torchtune's HF checkpointer reads, taken from the built model
    (a builder may derive ``intermediate_dim`` or ``head_dim`` from the others)."""
    from torchtune.modules import TiedLinear

    attn = model.layers[0].attn
    architecture, hf_model_type = _HF_ARCHITECTURES[model_type]
    arguments = _builder_arguments(model_cfg)  # the builder's own defaults, not guesses here
    config = {
        "architectures": [architecture],
        "model_type": hf_model_type,
        "vocab_size": model.tok_embeddings.num_embeddings,
        "hidden_size": model.tok_embeddings.embedding_dim,
        "intermediate_size": model.layers[0].mlp.w1.out_features,
        "num_hidden_layers": len(model.layers),
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "max_position_embeddings": model_cfg.max_seq_len,
        # As built: a sized builder takes neither argument and passes its family's released
        # values, which only the model holds (no default restated here).
        "rms_norm_eps": _final_norm_eps(model),
        "rope_theta": attn.pos_embeddings.base,
        "tie_word_embeddings": isinstance(model.output, TiedLinear),
        "torch_dtype": "float32",
    }
    if "scale_factor" in arguments:  # torchtune's llama3_1/llama3_2: Llama 3's RoPE scaling
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(arguments["scale_factor"]),
            "low_freq_factor": 1.0,  # what torchtune's Llama3ScaledRoPE fixes
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return config


def _final_norm_eps(model: torch.nn.Module) -> float:
    """The final norm's epsilon, as built: the norm itself, or the norm inside a wrapper of it
    (Gemma 2's final norm wraps its RMSNorm with the logits' soft-capping)."""
    for module in model.norm.modules():
        if hasattr(module, "eps"):
            return float(module.eps)
    raise ValueError(f"the final norm {type(model.norm).__name__} holds no epsilon to record")


def _tune_to_hf(
    state_dict: dict[str, torch.Tensor], hf_config: dict[str, Any], model_type: str
) -> dict[str, torch.Tensor]:
    """torchtune's names and layout to HF's, dispatched on ``model_type`` exactly as
    ``FullModelHFCheckpointer.save_checkpoint`` does, so its ``load_checkpoint`` inverts it."""
    sizes = {
        "num_heads": hf_config["num_attention_heads"],
        "num_kv_heads": hf_config["num_key_value_heads"],
        "dim": hf_config["hidden_size"],
        "head_dim": hf_config["head_dim"],
    }
    if model_type in ("PHI3_MINI", "PHI4"):
        from torchtune.models.phi3 import phi3_tune_to_hf

        return phi3_tune_to_hf(state_dict)
    if model_type == "QWEN2":
        from torchtune.models.qwen2 import qwen2_tune_to_hf

        return qwen2_tune_to_hf(
            state_dict, **sizes, tie_word_embeddings=hf_config["tie_word_embeddings"]
        )
    if model_type == "REWARD":
        from torchtune.rlhf.utils import reward_tune_to_hf

        return reward_tune_to_hf(
            state_dict,
            num_heads=sizes["num_heads"],
            num_kv_heads=sizes["num_kv_heads"],
            dim=sizes["dim"],
        )
    if model_type == "GEMMA2":
        from torchtune.models.gemma2._convert_weights import gemma2_tune_to_hf

        return gemma2_tune_to_hf(state_dict, **sizes)
    return convert_weights.tune_to_hf(state_dict, **sizes)


def _atomic_write(path: Path, write: Any) -> None:
    """Write through a temporary file in the same folder, then rename over ``path``."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
