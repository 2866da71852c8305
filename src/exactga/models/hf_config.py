"""A Hugging Face folder's ``config.json`` as the truth of the model a config builds.

A model section names a builder and some of its arguments; the checkpointer names a folder whose
``config.json`` says what the weights are. Two things follow from that file here:

- **the short way**: a component builder (``exactga.models.qwen3.qwen3``, ``gemma3``,
  ``qwen3_moe``, ``gpt_oss``, their ``lora_`` twins, and torchtune's ``llama3``, ``llama3_1``,
  ``llama3_2`` and ``qwen2`` with theirs) takes every argument the section leaves out from the
  folder (:func:`resolve_model_section` fills them in);
- **the check**: every value of the file that changes the numbers is compared with what the
  section builds (an explicit argument, a default, or a sized builder's own value); a
  disagreement is one ``ValueError`` naming the config.json key, both values and the fix.

What each family compares is its ``_SETTINGS`` table below (docs/models.md lists them). Values a
builder cannot build at all (an attention bias Qwen3 has none of, a RoPE scaling Llama 3.0's
builder does not apply) are refused the same way. ``attention_dropout`` is a training choice,
not the model's, and ``router_aux_loss_coef`` is the loss's (``exactga.models.moe``): neither is
compared. ``max_position_embeddings`` fills ``max_seq_len`` but is not compared: no builder's
numbers depend on it (a shorter ``max_seq_len`` only refuses longer rows).

Both transformers' formats are read: the released files' ``rope_theta``/``rope_scaling`` and
transformers 5's ``rope_parameters`` (per layer kind for Gemma 3); a key the file leaves out
takes transformers' default for the family (as ``from_pretrained`` would), and a multimodal
Gemma 3 folder's text decoder is its ``text_config``.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torchtune.config._utils import _get_component_from_path
from torchtune.models import llama3, llama3_1, llama3_2, qwen2
from torchtune.models.llama3._model_utils import scale_hidden_dim_for_mlp

from exactga.models import gemma3, gpt_oss, qwen3, qwen3_moe
from exactga.models.gemma3._component_builders import FULL, SLIDING, gemma3_layer_types
from exactga.models.gpt_oss._component_builders import gpt_oss_layer_types
from exactga.models.qwen3_moe._component_builders import is_sparse_layer

CONFIG_JSON = "config.json"


# --- the folder's values ---------------------------------------------------------------------


@dataclass(frozen=True)
class Rope:
    """One RoPE's settings as the file writes them: ``theta`` under ``theta_key``, its scaling
    type (``"default"``: none) and the scaling's fields, named ``prefix + field``."""

    theta: float
    theta_key: str
    kind: str
    fields: Mapping[str, Any]
    prefix: str

    def field_value(self, name: str) -> Any:
        return self.fields.get(name)


@dataclass(frozen=True)
class FolderConfig:
    """A folder's ``config.json`` (its ``text_config`` for a multimodal Gemma 3), each key the
    file leaves out at transformers' default for the family."""

    path: Path
    values: Mapping[str, Any]
    defaults: Mapping[str, Any]
    prefix: str = ""  # "text_config." where the decoder's values sit there
    model_type: str | None = None

    @classmethod
    def read(cls, folder: Path | str, defaults: Mapping[str, Any]) -> FolderConfig:
        path = Path(folder) / CONFIG_JSON
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not JSON ({err}): the folder's model is unknown") from err
        model_type = values.get("model_type")
        if isinstance(values.get("text_config"), dict) and "num_hidden_layers" not in values:
            return cls(path, values["text_config"], defaults, "text_config.", model_type)
        return cls(path, values, defaults, "", model_type)

    def get(self, key: str) -> Any:
        return self.values[key] if key in self.values else self.defaults.get(key)

    def name(self, key: str) -> str:
        """``key`` as the file spells it (under ``text_config`` where the values are there)."""
        return f"{self.prefix}{key}"

    def rope(self, layer_kind: str | None = None) -> Rope:
        """The RoPE of ``layer_kind``'s layers (Gemma 3 has one per kind), either format."""
        params = self.values.get("rope_parameters")
        if isinstance(params, dict):
            prefix = "rope_parameters."
            if layer_kind is not None and isinstance(params.get(layer_kind), dict):
                params, prefix = params[layer_kind], f"rope_parameters.{layer_kind}."
            kind = params.get("rope_type", params.get("type", "default"))
            return Rope(
                float(params["rope_theta"]),
                self.name(f"{prefix}rope_theta"),
                kind,
                params,
                self.name(prefix),
            )
        if layer_kind == SLIDING:  # Gemma 3's local layers: their own base, never scaled
            return Rope(
                float(self.get("rope_local_base_freq")),
                self.name("rope_local_base_freq"),
                "default",
                {},
                "",
            )
        scaling = self.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        return Rope(
            float(self.get("rope_theta")),
            self.name("rope_theta"),
            kind,
            scaling,
            self.name("rope_scaling."),
        )


# --- what is compared ------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One value of ``config.json`` that changes the numbers, and the builder's side of it.

    Args:
        key: the file's key (a function of the folder where the format decides it).
        folder: the folder's value, in the builder's terms.
        arg: the builder argument filled with it when the section leaves it out (``None``: the
            builder fixes it; a folder that differs cannot be built).
        built: the builder's value from its full arguments (default: ``arguments[arg]``).
        also: other arguments that set it (an explicit one is the user's choice, never filled
            over).
        when: compared only where this holds of the arguments (a dense width with no dense
            layer matters to nothing).
        needs: compared only where this holds of the folder (a scaling's fields, where the
            folder has that scaling: its type is a setting of its own).
        compare: ``False``: fills ``arg`` but is never refused.
        shown: the folder's value as a message shows it (default: ``folder``'s).
        fix: what to do when a fixed value differs.
    """

    key: str | Callable[[FolderConfig], str]
    folder: Callable[[FolderConfig], Any]
    arg: str | None = None
    built: Callable[[Mapping[str, Any]], Any] | None = None
    also: tuple[str, ...] = ()
    when: Callable[[Mapping[str, Any]], bool] | None = None
    needs: Callable[[FolderConfig], bool] | None = None
    compare: bool = True
    shown: Callable[[FolderConfig], Any] | None = None
    fix: str = "no exactga or torchtune builder of this family trains that model"

    def applies(self, arguments: Mapping[str, Any], hf: FolderConfig) -> bool:
        """Whether this setting is compared for these arguments and this folder."""
        return (
            self.compare
            and (self.when is None or self.when(arguments))
            and (self.needs is None or self.needs(hf))
        )

    def key_in(self, hf: FolderConfig) -> str:
        return self.key(hf) if callable(self.key) else hf.name(self.key)

    def built_value(self, arguments: Mapping[str, Any]) -> Any:
        return self.built(arguments) if self.built is not None else arguments[self.arg]


def _key(key: str, *, default: Any = None) -> Callable[[FolderConfig], Any]:
    """The folder's ``key`` as it is (``default`` where neither the file nor transformers'
    defaults have one)."""

    def read(hf: FolderConfig) -> Any:
        value = hf.get(key)
        return default if value is None else value

    return read


def _shape(key: str, arg: str, **kwargs: Any) -> Setting:
    return Setting(key, _key(key), arg, **kwargs)


def _fixed(key: str, value: Any, fix: str | None = None) -> Setting:
    """A value the builder fixes at ``value`` (a folder without the key has transformers'
    default, which is ``value`` for the families here)."""
    extra = {"fix": fix} if fix else {}
    return Setting(key, _key(key, default=value), None, built=lambda _: value, **extra)


def _kv_heads(arguments: Mapping[str, Any]) -> int:
    return arguments["num_kv_heads"] or arguments["num_heads"]


def _folder_kv_heads(hf: FolderConfig) -> int:
    return hf.get("num_key_value_heads") or hf.get("num_attention_heads")


def _split_head_dim(hf: FolderConfig) -> int:
    """``head_dim`` where the file has one, else ``hidden_size // num_attention_heads``."""
    return hf.get("head_dim") or hf.get("hidden_size") // hf.get("num_attention_heads")


def _rope_theta(layer_kind: str | None = None) -> Setting:
    arg = "local_rope_base" if layer_kind == SLIDING else "rope_base"
    return Setting(
        lambda hf: hf.rope(layer_kind).theta_key, lambda hf: hf.rope(layer_kind).theta, arg
    )


def _rope_kind(kinds: tuple[str, ...], fix: str, layer_kind: str | None = None) -> Setting:
    """The RoPE's scaling type, one of ``kinds`` (the first is what the builder builds)."""

    def folder(hf: FolderConfig) -> str:
        kind = hf.rope(layer_kind).kind
        return kinds[0] if kind in kinds else kind

    def key(hf: FolderConfig) -> str:
        rope = hf.rope(layer_kind)
        if not rope.fields and rope.prefix == hf.name("rope_scaling."):
            return hf.name("rope_scaling")  # none at all: null, or no key
        return f"{rope.prefix}rope_type" if rope.prefix else rope.theta_key

    def shown(hf: FolderConfig) -> Any:
        rope = hf.rope(layer_kind)
        return None if not rope.fields and rope.prefix == hf.name("rope_scaling.") else rope.kind

    return Setting(key, folder, None, built=lambda _: kinds[0], fix=fix, shown=shown)


def _qwen_attention() -> list[Setting]:
    """Qwen3's and Qwen3 MoE's attention: QK-norm, bias-free, rotate-half RoPE, no window
    (``head_dim`` where the file leaves it out: 128 for Qwen3, the split for Qwen3 MoE, as
    transformers' classes)."""
    return [
        _shape("vocab_size", "vocab_size"),
        _shape("num_hidden_layers", "num_layers"),
        _shape("num_attention_heads", "num_heads"),
        Setting("num_key_value_heads", _folder_kv_heads, "num_kv_heads", built=_kv_heads),
        _shape("hidden_size", "embed_dim"),
        Setting(
            "head_dim",
            _split_head_dim,
            "head_dim",
            built=lambda a: a["head_dim"] or a["embed_dim"] // a["num_heads"],
        ),
        _shape("rms_norm_eps", "norm_eps"),
        _rope_theta(),
        _rope_kind(("default",), "this builder applies RoPE unscaled"),
        _shape("tie_word_embeddings", "tie_word_embeddings"),
        _shape("max_position_embeddings", "max_seq_len", compare=False),
        _fixed("attention_bias", False),
        _fixed("hidden_act", "silu"),
        _fixed("use_sliding_window", False, "this builder attends over the whole row"),
        Setting(
            "layer_types",
            lambda hf: sorted(set(hf.get("layer_types") or [FULL])),
            None,
            built=lambda _: [FULL],
            fix="this builder attends over the whole row",
        ),
    ]


def _has_dense_layer(arguments: Mapping[str, Any]) -> bool:
    sparse_step, dense = arguments["decoder_sparse_step"], tuple(arguments["mlp_only_layers"])
    return any(not is_sparse_layer(i, sparse_step, dense) for i in range(arguments["num_layers"]))


def _experts_key(hf: FolderConfig) -> str:
    """``num_experts`` (the released files, transformers 4) or ``num_local_experts`` (5)."""
    return "num_local_experts" if "num_local_experts" in hf.values else "num_experts"


def _qwen3_moe_settings() -> list[Setting]:
    return [
        *_qwen_attention(),
        _shape("moe_intermediate_size", "moe_intermediate_dim"),
        Setting(
            lambda hf: hf.name(_experts_key(hf)), lambda hf: hf.get(_experts_key(hf)), "num_experts"
        ),
        _shape("num_experts_per_tok", "num_experts_per_tok"),
        _shape("norm_topk_prob", "norm_topk_prob"),
        _shape("decoder_sparse_step", "decoder_sparse_step"),
        Setting(
            "mlp_only_layers",
            lambda hf: list(hf.get("mlp_only_layers") or []),
            "mlp_only_layers",
            built=lambda a: list(a["mlp_only_layers"]),
        ),
        _shape("intermediate_size", "intermediate_dim", when=_has_dense_layer),
    ]


def _gemma3_layer_kinds(hf: FolderConfig) -> list[str]:
    if hf.values.get("layer_types") is not None:
        return list(hf.values["layer_types"])
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return gemma3_layer_types(hf.get("num_hidden_layers"), pattern)


def _gemma3_rope_scaling(hf: FolderConfig) -> float | None:
    """The global layers' linear position scaling (``None``: none; another type is refused by
    the scaling type's own setting)."""
    rope = hf.rope(FULL)
    return float(rope.field_value("factor")) if rope.kind == "linear" else None


def _gemma3_settings() -> list[Setting]:
    def layer_kinds(a: Mapping[str, Any]) -> list[str]:
        return gemma3_layer_types(a["num_layers"], a["sliding_window_pattern"], a["layer_types"])

    return [
        _shape("vocab_size", "vocab_size"),
        _shape("num_hidden_layers", "num_layers"),
        _shape("num_attention_heads", "num_heads"),
        Setting("num_key_value_heads", _folder_kv_heads, "num_kv_heads"),
        _shape("hidden_size", "embed_dim"),
        _shape("head_dim", "head_dim"),
        _shape("intermediate_size", "intermediate_dim"),
        _shape("rms_norm_eps", "norm_eps"),
        _rope_theta(FULL),
        _rope_theta(SLIDING),
        _rope_kind(
            ("default", "linear"), "this builder scales global RoPE linearly or not at all", FULL
        ),
        _rope_kind(("default",), "this builder never scales the local layers' RoPE", SLIDING),
        Setting(
            lambda hf: (
                hf.rope(FULL).prefix + "factor" if hf.rope(FULL).prefix else hf.name("rope_scaling")
            ),
            _gemma3_rope_scaling,
            "rope_scaling_factor",
            built=lambda a: (
                a["rope_scaling_factor"] if a["rope_scaling_factor"] not in (None, 1.0) else None
            ),
        ),
        _shape("sliding_window", "sliding_window"),
        Setting(
            lambda hf: hf.name(
                "layer_types" if "layer_types" in hf.values else "sliding_window_pattern"
            ),
            _gemma3_layer_kinds,
            "layer_types",
            built=layer_kinds,
            also=("sliding_window_pattern",),
        ),
        Setting(
            "query_pre_attn_scalar",
            _key("query_pre_attn_scalar"),
            "query_pre_attn_scalar",
            built=lambda a: a["query_pre_attn_scalar"] or a["head_dim"],
        ),
        _shape("attn_logit_softcapping", "attn_logit_softcapping"),
        _shape("final_logit_softcapping", "final_logit_softcapping"),
        _shape("max_position_embeddings", "max_seq_len", compare=False),
        _fixed("tie_word_embeddings", True, "Gemma 3's output is its embedding here"),
        _fixed("attention_bias", False),
        _fixed("hidden_activation", "gelu_pytorch_tanh"),
        _fixed("use_bidirectional_attention", False, "this builder is a causal decoder"),
    ]


def _yarn(hf: FolderConfig) -> bool:
    return hf.rope().kind == "yarn"


def _yarn_field(name: str, arg: str, absent: Any) -> Setting:
    """A YaRN field of the folder's RoPE (``absent``: transformers' value where the file has
    none) against the builder argument ``arg``."""

    def folder(hf: FolderConfig) -> Any:
        value = hf.rope().field_value(name)
        return absent if value is None else value

    return Setting(lambda hf: hf.rope().prefix + name, folder, arg, needs=_yarn)


def _yarn_unsupported(name: str) -> Setting:
    return Setting(
        lambda hf: hf.rope().prefix + name,
        lambda hf: hf.rope().field_value(name),
        None,
        built=lambda _: None,
        needs=_yarn,
        fix="this builder takes YaRN's attention factor from its factor alone",
    )


def _gpt_oss_experts_key(hf: FolderConfig) -> str:
    """``num_local_experts`` (the released files and transformers' name), unless the file
    writes the alias ``num_experts``."""
    return "num_experts" if "num_experts" in hf.values else "num_local_experts"


def _gpt_oss_layer_kinds(hf: FolderConfig) -> list[str]:
    return gpt_oss_layer_types(hf.get("num_hidden_layers"), hf.values.get("layer_types"))


def _gpt_oss_settings() -> list[Setting]:
    return [
        _shape("vocab_size", "vocab_size"),
        _shape("num_hidden_layers", "num_layers"),
        _shape("num_attention_heads", "num_heads"),
        Setting("num_key_value_heads", _folder_kv_heads, "num_kv_heads"),
        _shape("hidden_size", "embed_dim"),
        _shape("head_dim", "head_dim"),
        _shape("intermediate_size", "intermediate_dim"),
        Setting(
            lambda hf: hf.name(_gpt_oss_experts_key(hf)),
            lambda hf: hf.get(_gpt_oss_experts_key(hf)),
            "num_experts",
        ),
        _shape("num_experts_per_tok", "num_experts_per_tok"),
        _shape("rms_norm_eps", "norm_eps"),
        _rope_theta(),
        _rope_kind(("yarn",), "this builder applies YaRN RoPE"),
        _yarn_field("factor", "rope_scaling_factor", None),
        _yarn_field("original_max_position_embeddings", "rope_original_max_seq_len", None),
        _yarn_field("beta_fast", "rope_beta_fast", 32.0),
        _yarn_field("beta_slow", "rope_beta_slow", 1.0),
        _yarn_field("truncate", "rope_truncate", True),  # transformers' default when absent
        *(_yarn_unsupported(name) for name in ("attention_factor", "mscale", "mscale_all_dim")),
        _shape("sliding_window", "sliding_window"),
        Setting(
            "layer_types",
            _gpt_oss_layer_kinds,
            "layer_types",
            built=lambda a: gpt_oss_layer_types(a["num_layers"], a["layer_types"]),
        ),
        _shape("swiglu_alpha", "swiglu_alpha"),
        _shape("swiglu_limit", "swiglu_limit"),
        _shape("max_position_embeddings", "max_seq_len", compare=False),
        _fixed("attention_bias", True, "gpt-oss's attention projections have biases here"),
        _fixed("tie_word_embeddings", False, "gpt-oss's output has its own weight here"),
        _fixed("hidden_act", "silu"),
    ]


# torchtune's Llama 3 RoPE scaling (Llama3ScaledRoPE as its llama3_1/llama3_2 builders make it):
# only the factor is the builder's argument.
_LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama3_scaled(hf: FolderConfig) -> bool:
    return hf.rope().kind == "llama3"


def _llama3_rope_field(name: str, value: float) -> Setting:
    return Setting(
        lambda hf: hf.rope().prefix + name,
        lambda hf: hf.rope().field_value(name),
        None,
        built=lambda _: value,
        needs=_llama3_scaled,
        fix="torchtune's Llama 3 RoPE scaling fixes it",
    )


def _split_heads_settings(tied: bool | None) -> list[Setting]:
    """What torchtune's Llama 3 and Qwen2 builders share: ``head_dim`` is
    ``embed_dim // num_heads``; ``tied``: the builder's fixed tying (``None``: an argument)."""
    settings = [
        _shape("vocab_size", "vocab_size"),
        _shape("num_hidden_layers", "num_layers"),
        _shape("num_attention_heads", "num_heads"),
        Setting("num_key_value_heads", _folder_kv_heads, "num_kv_heads"),
        _shape("hidden_size", "embed_dim"),
        Setting(
            "head_dim",
            _split_head_dim,
            None,
            built=lambda a: a["embed_dim"] // a["num_heads"],
            fix="torchtune's builders make heads hidden_size / num_attention_heads wide",
        ),
        _shape("rms_norm_eps", "norm_eps"),
        Setting(
            lambda hf: hf.rope().theta_key,
            lambda hf: hf.rope().theta,
            "rope_base",
            built=lambda a: float(a["rope_base"]),
        ),
        _shape("max_position_embeddings", "max_seq_len", compare=False),
        _fixed("hidden_act", "silu"),
    ]
    if tied is None:
        settings.append(_shape("tie_word_embeddings", "tie_word_embeddings"))
    else:
        settings.append(_fixed("tie_word_embeddings", tied, "this builder has its own output"))
    return settings


def _llama3_settings(scaled: bool, tied: bool | None) -> list[Setting]:
    """torchtune's Llama 3 builders: ``llama3`` (RoPE unscaled, untied), ``llama3_1``
    (scaled, untied) and ``llama3_2`` (scaled, tying an argument)."""
    settings = [
        *_split_heads_settings(tied),
        Setting(
            "intermediate_size",
            _key("intermediate_size"),
            "intermediate_dim",
            built=lambda a: a["intermediate_dim"] or scale_hidden_dim_for_mlp(a["embed_dim"]),
        ),
        _fixed("attention_bias", False),
        _fixed("mlp_bias", False),
    ]
    if not scaled:
        fix = "name torchtune.models.llama3_2.llama3_2 or llama3_1, which scale RoPE as Llama 3"
        return [*settings, _rope_kind(("default",), fix)]
    fix = "name torchtune.models.llama3.llama3, which applies RoPE unscaled"
    return [
        *settings,
        _rope_kind(("llama3",), fix),
        Setting(
            lambda hf: hf.rope().prefix + "factor",
            lambda hf: hf.rope().field_value("factor"),
            "scale_factor",
            needs=_llama3_scaled,
        ),
        *(_llama3_rope_field(name, value) for name, value in _LLAMA3_ROPE_FIXED.items()),
    ]


def _qwen2_settings() -> list[Setting]:
    """torchtune's ``qwen2`` (Qwen2 and Qwen2.5): q/k/v with bias, as every Qwen2 has."""
    return [
        *_split_heads_settings(None),
        _shape("intermediate_size", "intermediate_dim"),
        _rope_kind(("default",), "this builder applies RoPE unscaled"),
        _fixed("use_sliding_window", False, "this builder attends over the whole row"),
    ]


# --- the families ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A model family: its component builders (plain, LoRA), the ``model_type`` values of its
    folders, transformers' defaults for keys a file leaves out, and what is compared."""

    title: str
    builders: tuple[Callable[..., Any], Callable[..., Any]]
    builder_paths: tuple[str, str]
    model_types: tuple[str, ...]
    defaults: Mapping[str, Any]
    settings: list[Setting] = field(repr=False, default_factory=list)


# transformers' config-class defaults (5.x, the same in 4.5x) of the keys read here;
# tests/test_hf_config_truth.py checks them against the installed transformers.
_QWEN3_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "use_sliding_window": False,
}
_QWEN3_MOE_DEFAULTS = {
    **{k: v for k, v in _QWEN3_DEFAULTS.items() if k != "head_dim"},
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_key_value_heads": 4,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
}
_GEMMA3_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
    "use_bidirectional_attention": False,
}
_GPT_OSS_DEFAULTS = {
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    },
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
_LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
}
_QWEN2_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "use_sliding_window": False,
}

FAMILIES = (
    Family(
        "Qwen3",
        (qwen3.qwen3, qwen3.lora_qwen3),
        ("exactga.models.qwen3.qwen3", "exactga.models.qwen3.lora_qwen3"),
        ("qwen3",),
        _QWEN3_DEFAULTS,
        [*_qwen_attention(), _shape("intermediate_size", "intermediate_dim")],
    ),
    Family(
        "Qwen3 MoE",
        (qwen3_moe.qwen3_moe, qwen3_moe.lora_qwen3_moe),
        ("exactga.models.qwen3_moe.qwen3_moe", "exactga.models.qwen3_moe.lora_qwen3_moe"),
        ("qwen3_moe",),
        _QWEN3_MOE_DEFAULTS,
        _qwen3_moe_settings(),
    ),
    Family(
        "gpt-oss",
        (gpt_oss.gpt_oss, gpt_oss.lora_gpt_oss),
        ("exactga.models.gpt_oss.gpt_oss", "exactga.models.gpt_oss.lora_gpt_oss"),
        ("gpt_oss",),
        _GPT_OSS_DEFAULTS,
        _gpt_oss_settings(),
    ),
    Family(
        "Gemma 3",
        (gemma3.gemma3, gemma3.lora_gemma3),
        ("exactga.models.gemma3.gemma3", "exactga.models.gemma3.lora_gemma3"),
        ("gemma3_text", "gemma3"),
        _GEMMA3_DEFAULTS,
        _gemma3_settings(),
    ),
    Family(
        "Llama 3 (unscaled RoPE)",
        (llama3.llama3, llama3.lora_llama3),
        ("torchtune.models.llama3.llama3", "torchtune.models.llama3.lora_llama3"),
        ("llama",),
        _LLAMA_DEFAULTS,
        _llama3_settings(scaled=False, tied=False),
    ),
    Family(
        "Llama 3.1",
        (llama3_1.llama3_1, llama3_1.lora_llama3_1),
        ("torchtune.models.llama3_1.llama3_1", "torchtune.models.llama3_1.lora_llama3_1"),
        ("llama",),
        _LLAMA_DEFAULTS,
        _llama3_settings(scaled=True, tied=False),
    ),
    Family(
        "Llama 3.2",
        (llama3_2.llama3_2, llama3_2.lora_llama3_2),
        ("torchtune.models.llama3_2.llama3_2", "torchtune.models.llama3_2.lora_llama3_2"),
        ("llama",),
        _LLAMA_DEFAULTS,
        _llama3_settings(scaled=True, tied=None),
    ),
    Family(
        "Qwen2 / Qwen2.5",
        (qwen2.qwen2, qwen2.lora_qwen2),
        ("torchtune.models.qwen2.qwen2", "torchtune.models.qwen2.lora_qwen2"),
        ("qwen2",),
        _QWEN2_DEFAULTS,
        _qwen2_settings(),
    ),
)
_FAMILY_OF = {builder: family for family in FAMILIES for builder in family.builders}


def _builder_path(family: Family, builder: Callable[..., Any]) -> str:
    return family.builder_paths[family.builders.index(builder)]


def _short_way_for(model_type: str | None, lora: bool, hf: FolderConfig | None = None) -> str:
    """The component builder that takes a ``model_type`` folder's shape."""
    candidates = [f for f in FAMILIES if model_type in f.model_types]
    if model_type == "llama" and hf is not None:  # the one that applies the folder's RoPE
        scaled = hf.rope().kind == "llama3"
        candidates = [f for f in candidates if (f.title == "Llama 3.2") == scaled] or candidates
    if not candidates:
        return "a builder of that family"
    return candidates[0].builder_paths[1 if lora else 0]


# --- the section, resolved -------------------------------------------------------------------


class _Captured(Exception):  # noqa: N818 - not an error: how a sized builder's call is read
    def __init__(self, builder: Callable[..., Any], arguments: dict[str, Any]) -> None:
        super().__init__()
        self.builder, self.arguments = builder, arguments


def _sized_builder_call(
    builder: Callable[..., Any], arguments: Mapping[str, Any]
) -> tuple[Callable[..., Any], dict[str, Any]] | None:
    """The component builder a sized builder (``qwen3_0_6b``, torchtune's ``llama3_2_1b``,
    ``qlora_...`` partials) calls, and with what: its module's component builders swapped
    for a stand-in that records the call and stops, so nothing is built. ``None`` for a
    builder that calls none of the families' builders (or fails before it does: instantiate
    reports that)."""
    func, keywords = builder, dict(arguments)
    while isinstance(func, functools.partial):
        keywords = {**func.keywords, **keywords}
        func = func.func
    namespace = getattr(func, "__globals__", None)
    if namespace is None:
        return None
    swapped = {
        name: value
        for name, value in namespace.items()
        if inspect.isfunction(value) and value in _FAMILY_OF
    }
    if not swapped:
        return None

    def recorder(component: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            raise _Captured(component, inspect.signature(component).bind(*args, **kwargs).arguments)

        return record

    try:
        namespace.update({name: recorder(value) for name, value in swapped.items()})
        with torch.device("meta"):  # a builder that calls none of them builds nothing real
            func(**keywords)
    except _Captured as call:
        return call.builder, dict(call.arguments)
    except Exception:  # noqa: BLE001 - instantiating the section names what is wrong
        return None
    finally:
        namespace.update(swapped)
    return None


@dataclass
class _Section:
    """A model section being resolved: its builder and the arguments it will be called with."""

    name: str  # "model", "teacher_model", ...
    path: str  # its _component_
    family: Family
    builder: Callable[..., Any]
    arguments: dict[str, Any]
    explicit: frozenset[str]
    sized: bool  # a sized builder: its arguments are its own, nothing is filled

    def full_arguments(self) -> dict[str, Any]:
        bound = inspect.signature(self.builder).bind_partial(**self.arguments)
        bound.apply_defaults()
        return dict(bound.arguments)

    def missing(self) -> list[str]:
        params = inspect.signature(self.builder).parameters.values()
        return [
            p.name
            for p in params
            if p.default is p.empty
            and p.name not in self.arguments
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]


def _same(built: Any, folder: Any) -> bool:
    if isinstance(built, (list, tuple)) or isinstance(folder, (list, tuple)):
        return (
            isinstance(built, (list, tuple))
            and isinstance(folder, (list, tuple))
            and (len(built) == len(folder) and all(map(_same, built, folder)))
        )
    numbers = (int, float)
    if (
        isinstance(built, bool)
        or isinstance(folder, bool)
        or not (isinstance(built, numbers) and isinstance(folder, numbers))
    ):
        return built == folder
    return math.isclose(float(built), float(folder), rel_tol=1e-9, abs_tol=0.0)


def _show(value: Any) -> str:
    """A config.json value as the file writes it."""
    return json.dumps(value)


def _yaml(value: Any) -> str:
    """A model-section value as a config (or a command-line override) writes it."""
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _fill(section: _Section, hf: FolderConfig) -> dict[str, Any]:
    """Every argument the section leaves out that the builder needs, or whose default the
    folder contradicts, from the folder; what was filled."""
    filled: dict[str, Any] = {}
    settings = section.family.settings
    for setting in settings:  # required first: the derived values below need them
        if setting.arg in section.missing():
            filled[setting.arg] = section.arguments[setting.arg] = setting.folder(hf)
    for setting in settings:
        if setting.arg is None or not setting.applies(section.full_arguments(), hf):
            continue
        if {setting.arg, *setting.also} & section.explicit:
            continue  # the user's value: compared below, never filled over
        want = setting.folder(hf)
        if not _same(setting.built_value(section.full_arguments()), want):
            filled[setting.arg] = section.arguments[setting.arg] = want
    return filled


def _disagreements(section: _Section, hf: FolderConfig) -> list[str]:
    """One sentence for each compared value the section builds otherwise than the folder."""
    arguments = section.full_arguments()
    file = str(hf.path)
    found, sized = [], []
    for setting in section.family.settings:
        if not setting.applies(arguments, hf):
            continue
        built, want = setting.built_value(arguments), setting.folder(hf)
        if _same(built, want):
            continue
        if setting.shown is not None:
            want = setting.shown(hf)
        key = setting.key_in(hf)
        given = [a for a in (setting.arg, *setting.also) if a and a in section.explicit]
        if section.sized and setting.arg is not None:
            sized.append(f"{setting.arg}={_yaml(built)} ({key}={_show(want)})")
        elif given:
            arg = given[0]
            value = section.arguments[arg]
            fill = want if arg == setting.arg else None
            set_it = f"set {section.name}.{arg}={_yaml(fill)} or " if fill is not None else ""
            found.append(
                f"{section.name}.{arg}={_yaml(value)} but {file} {key}={_show(want)}: "
                f"{set_it}drop it to take the folder's"
            )
        else:
            found.append(
                f"{file} {key}={_show(want)} but {section.name}._component_={section.path} "
                f"builds {_show(built)}: {setting.fix}"
            )
    if sized:  # one sentence: a sized builder is another model, whatever the count
        found.insert(
            0,
            f"{section.name}._component_={section.path} builds another model than {file}: "
            f"{', '.join(sized)}; name {_builder_path(section.family, section.builder)} with "
            "no shape arguments to take the folder's shape",
        )
    return found


def _section_of(name: str, model: Mapping[str, Any]) -> _Section | None:
    """The section's family builder and arguments (``None``: a builder of no family here)."""
    path = model["_component_"]
    builder = _get_component_from_path(path)
    explicit = {k: v for k, v in model.items() if k != "_component_"}
    if builder in _FAMILY_OF:
        return _Section(
            name,
            path,
            _FAMILY_OF[builder],
            builder,
            dict(explicit),
            frozenset(explicit),
            sized=False,
        )
    call = _sized_builder_call(builder, explicit)
    if call is None:
        return None
    component, arguments = call
    return _Section(
        name, path, _FAMILY_OF[component], component, arguments, frozenset(arguments), sized=True
    )


def missing_arguments_message(
    name: str, model: Mapping[str, Any], folder: str | None
) -> str | None:
    """The one message for a model section that leaves out a required argument of its builder
    (``None``: nothing is missing). ``folder``: the HF checkpointer's folder without a
    ``config.json``, or ``None`` where the checkpointer reads none."""
    builder = _get_component_from_path(model["_component_"])
    try:
        params = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):
        return None
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.name not in model
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not missing:
        return None
    fillable = fillable_from_folder(model["_component_"])
    where = (
        f"point the checkpointer at a Hugging Face folder with {CONFIG_JSON} to take them from it"
        if set(missing) <= fillable
        else ""
    )
    if folder is not None and where:
        where = f"{folder} has no {CONFIG_JSON} to take them from"
    keys = ", ".join(f"{name}.{arg}" for arg in missing)
    return f"{name}._component_={model['_component_']} needs {keys}: give them" + (
        f" ({where})" if where else ""
    )


def resolve_model_section(
    name: str, model: Mapping[str, Any], folder: Path | str, *, fill: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``model`` (a plain model section) checked against ``folder``'s ``config.json`` and,
    with ``fill``, completed from it: ``(section, filled)``, the section as it will be
    instantiated and the arguments taken from the folder. A builder of no family here comes
    back as it is.

    Raises:
        ValueError: one message naming every disagreement (the config.json key, both values
            and the fix), or a folder of another family.
    """
    section = _section_of(name, model)
    if section is None:
        return dict(model), {}
    hf = FolderConfig.read(folder, section.family.defaults)
    lora = section.builder is section.family.builders[1]
    if hf.model_type is not None and hf.model_type not in section.family.model_types:
        raise ValueError(
            f"{hf.path} model_type={_show(hf.model_type)} but {name}._component_={section.path} "
            f"builds {section.family.title}: name {_short_way_for(hf.model_type, lora, hf)} "
            "with no shape arguments to take the folder's model"
        )
    filled = _fill(section, hf) if fill and not section.sized else {}
    if section.missing():  # what the folder cannot give either (a LoRA rank, say)
        keys = ", ".join(f"{name}.{arg}" for arg in section.missing())
        raise ValueError(f"{name}._component_={section.path} needs {keys}: give them")
    problems = _disagreements(section, hf)
    if problems:
        raise ValueError("; ".join(problems))
    if section.sized:
        return dict(model), {}
    return {"_component_": model["_component_"], **section.arguments}, filled


def fillable_from_folder(component_path: str) -> set[str]:
    """The arguments of the builder ``component_path`` names that a Hugging Face folder's
    ``config.json`` can fill (empty for a sized or unknown builder): a model section may leave
    them out when its checkpointer reads such a folder."""
    try:
        builder = _get_component_from_path(component_path)
    except Exception:  # noqa: BLE001 - an unknown path fills nothing; instantiate names it
        return set()
    family = _FAMILY_OF.get(builder)
    if family is None:
        return set()
    params = set(inspect.signature(builder).parameters)
    return {s.arg for s in family.settings if s.arg is not None and s.arg in params} | {
        a for s in family.settings for a in s.also if a in params
    }
