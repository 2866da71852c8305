"""exactga's recipes and configs as ``tune ls``, ``tune cp`` and ``tune run`` know them.

torchtune's command line finds its built-in recipes and configs in one list,
``torchtune._recipe_registry._ALL_RECIPES``, and joins each entry's ``file_path`` onto its own
install folder; an absolute ``file_path`` survives that join. So the start-up hook
(``_exactga_recipes_hook``) appends exactga's recipes to that list, each with its configs, under
an ``exactga/`` prefix and with absolute paths, the moment ``tune`` imports it
(:func:`add_to_torchtune_registry`). Stock names keep meaning stock recipes::

    tune ls                                                     # stock, then exactga/...
    tune cp exactga/full_finetune_single_device my_recipe.py
    tune cp exactga/tiny/full_single_device my.yaml
    tune run exactga/full_finetune_single_device --config exactga/tiny/full_single_device

The shipped configs name their bundled files (tokenizer, data) as ``${exactga_file:<path>}``,
a path inside exactga's files (:func:`exactga_file`), so a copied config runs from any folder.

Kept free of torch and torchtune imports: it runs in every ``tune`` command.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "exactga/"
RESOLVER = "exactga_file"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # exactga/, above launch/
# Where a wheel puts recipes/ and configs/ (pyproject.toml's force-include).
_BUNDLED_DIR = _PACKAGE_DIR / "_bundled"


@dataclass(frozen=True)
class RecipeEntry:
    """One recipe of ``recipes/`` and the configs of ``configs/`` it runs (names without
    ``.yaml``), as ``tune ls`` lists them after the prefix."""

    name: str
    configs: tuple[str, ...]
    supports_distributed: bool
    # The file's name under recipes/ (without ``.py``) where it is not ``name``: torchtune's
    # twins share one file (see [one recipe, two launches] in exactga.launch.twins).
    file: str = ""

    @property
    def recipe_file(self) -> str:
        return self.file or self.name


# Each config is listed under the recipe its header launches (tests/test_registry.py checks
# that every recipe and config file is here, and that the headers agree).
RECIPES = (
    RecipeEntry(
        "full_finetune_single_device",
        (
            "tiny/full_single_device",
            "llama3_1/8B_full_single_device",
            "llama3_2/1B_full_single_device",
            "llama3_2/3B_full_single_device",
            "qwen2_5/0.5B_full_single_device",
            "qwen2_5/1.5B_full_single_device",
            "qwen2_5/7B_full_single_device",
            "qwen3/0.6B_full_single_device",
            "gemma3/1B_full_single_device",
        ),
        supports_distributed=False,
        file="full_finetune",
    ),
    RecipeEntry(
        "full_finetune_distributed",
        (
            "tiny/full_distributed",
            "llama3_1/8B_full",
            "llama3_1/70B_full",
            "llama3_2/3B_full",
            "qwen2_5/7B_full",
            "qwen2_5/32B_full",
            "qwen3/8B_full",
            "qwen3_moe/30B_A3B_full",
            "gemma3/4B_full",
            "gpt_oss/20B_full",
        ),
        supports_distributed=True,
        file="full_finetune",
    ),
    RecipeEntry(
        "lora_finetune_single_device",
        (
            "tiny/lora_single_device",
            "tiny/qlora_single_device",
            "llama3_1/8B_lora_single_device",
            "llama3_1/8B_qlora_single_device",
            "llama3_2/1B_lora_single_device",
            "llama3_2/1B_qlora_single_device",
            "llama3_2/3B_lora_single_device",
            "llama3_2/3B_qlora_single_device",
            "qwen2_5/0.5B_lora_single_device",
            "qwen2_5/1.5B_lora_single_device",
            "qwen2_5/7B_lora_single_device",
            "qwen3/0.6B_lora_single_device",
            "qwen3/8B_qlora_single_device",
            "qwen3_moe/30B_A3B_lora_single_device",
            "gemma3/1B_lora_single_device",
            "gemma3/4B_qlora_single_device",
            "gpt_oss/20B_lora_single_device",
        ),
        supports_distributed=False,
        file="lora_finetune",
    ),
    RecipeEntry(
        "lora_finetune_distributed",
        (
            "tiny/lora_distributed",
            "llama3_1/8B_lora",
            "llama3_1/70B_lora",
            "llama3_2/3B_lora",
            "qwen2_5/7B_lora",
            "qwen2_5/32B_lora",
            "qwen3/8B_lora",
            "qwen3_moe/30B_A3B_lora",
            "gemma3/4B_lora",
            "gpt_oss/20B_lora",
            "gpt_oss/120B_lora",
        ),
        supports_distributed=True,
        file="lora_finetune",
    ),
    RecipeEntry(
        "knowledge_distillation_single_device",
        (
            "tiny/kd_single_device",
            "llama3_2/8B_to_1B_KD_lora_single_device",
            "qwen2_5/7B_to_0.5B_KD_lora_single_device",
            "qwen3/8B_to_0.6B_KD_lora_single_device",
            "gemma3/4B_to_1B_KD_lora_single_device",
        ),
        supports_distributed=False,
        file="knowledge_distillation",
    ),
    RecipeEntry(
        "knowledge_distillation_distributed",
        (
            "tiny/kd_distributed",
            "llama3_2/8B_to_1B_KD_lora_distributed",
            "qwen2_5/7B_to_0.5B_KD_lora_distributed",
            "qwen3/8B_to_0.6B_KD_lora_distributed",
            "gemma3/4B_to_1B_KD_lora_distributed",
        ),
        supports_distributed=True,
        file="knowledge_distillation",
    ),
    RecipeEntry(
        "lora_dpo_single_device",
        (
            "tiny/lora_dpo_single_device",
            "qwen3/0.6B_lora_dpo_single_device",
            "gemma3/1B_lora_dpo_single_device",
        ),
        supports_distributed=False,
        file="lora_dpo",
    ),
    RecipeEntry(
        "lora_dpo_distributed",
        ("tiny/lora_dpo_distributed", "qwen3_moe/30B_A3B_lora_dpo", "gpt_oss/20B_lora_dpo"),
        supports_distributed=True,
        file="lora_dpo",
    ),
    RecipeEntry("full_dpo_distributed", ("tiny/full_dpo_distributed",), True),
    RecipeEntry("qat_distributed", ("tiny/qat_distributed",), True),
    RecipeEntry("qat_lora_finetune_distributed", ("tiny/qat_lora_distributed",), True),
    RecipeEntry(
        "grpo_full_finetune_distributed",
        ("tiny/grpo_distributed", "qwen3/0.6B_grpo", "gemma3/1B_grpo", "gpt_oss/20B_grpo"),
        supports_distributed=True,
    ),
    RecipeEntry("ppo_full_finetune_single_device", ("tiny/ppo_single_device",), False),
    RecipeEntry(
        "ga_parity",
        (
            "tiny/ga_parity_full",
            "tiny/ga_parity_lora",
            "tiny/ga_parity_kd",
            "tiny/ga_parity_dpo",
            "tiny/ga_parity_grpo",
            "tiny/ga_parity_qat",
        ),
        supports_distributed=True,
    ),
)


# Top-level config keys that exactga's recipes read and torchtune 0.6.1's do not (none of its
# recipes reads one, none of its configs sets one): a config that sets any of them is written
# for exactga, and torchtune's own recipe of the same name would train without it, without a
# word (see [launch mix-ups] in exactga.launch.cli). tests/test_launch_mixups.py derives the set
# from the schemas and torchtune's recipes and configs and checks it is this one.
EXACTGA_ONLY_KEYS = frozenset(
    {
        "batch_size_val",
        "context_parallel_dim",  # torchtune main's mesh keys, which 0.6.1 does not read
        "cpu_threads",
        "cudnn_attention",
        "data_parallel_replicate_dim",
        "data_parallel_shard_dim",
        "dataset_val",
        "drop_partial_window",
        "dynamic_sampling",
        "gradient_sync",
        "keep_best_checkpoint",
        "keep_last_n_checkpoints",
        "log_timings",
        "loss_aggregation",
        "loss_normalization",
        "master_weights",
        "max_sampling_rounds",
        "max_val_batches",
        "micro_batch_tokens",
        "micro_batching",
        "nonfinite_loss",
        "overlong_buffer",
        "overlong_penalty_factor",
        "pad_to_multiple_of",
        "peak_flops",
        "precompute_reference_logprobs",
        "rank_balancing",
        "resume_allow_changed_keys",
        "router_aux_loss_coef",
        "router_balance",
        "rpo_alpha",
        "run_val_every_n_steps",
        "save_every_n_steps",
        "saved_latency_every_n_steps",
        "sequence_log_prob",
    }
)


def recipe_entry(name: str) -> RecipeEntry | None:
    """exactga's recipe of that name (without the prefix), or None."""
    return next((entry for entry in RECIPES if entry.name == name), None)


def distributed_twin(name: str) -> str | None:
    """The distributed recipe that trains what the single-device recipe ``name`` trains
    (``full_finetune_single_device`` -> ``full_finetune_distributed``), or None where there is
    none (PPO)."""
    twin = name.replace("_single_device", "_distributed")
    entry = recipe_entry(twin)
    return twin if twin != name and entry is not None and entry.supports_distributed else None


def recipe_of_config(config_file: str | Path) -> str | None:
    """The exactga recipe a shipped config file is listed under (its header launches it), or
    None for any other file."""
    target = Path(config_file).resolve()
    for entry in RECIPES:
        if any(config_path(config).resolve() == target for config in entry.configs):
            return entry.name
    return None


def files_root() -> Path:
    """The folder holding exactga's ``recipes/`` and ``configs/``: the checkout of an
    editable install (so edits there are what runs), else the wheel's bundled copy."""
    checkout = _PACKAGE_DIR.parents[1]
    if _PACKAGE_DIR.parent.name == "src" and (checkout / "recipes").is_dir():
        return checkout
    return _BUNDLED_DIR


def recipe_path(name: str) -> Path:
    return files_root() / "recipes" / f"{name}.py"


def config_path(name: str) -> Path:
    return files_root() / "configs" / f"{name}.yaml"


def exactga_file(relative_path: str) -> str:
    """The resolver ``${exactga_file:configs/tiny/tokenizer.model}``: that file of exactga's,
    wherever exactga is installed, so a shipped config runs from any working directory."""
    return str(files_root() / relative_path)


def register_config_resolvers() -> None:
    """Make ``${exactga_file:...}`` resolvable in any config OmegaConf reads."""
    from omegaconf import OmegaConf

    if OmegaConf.has_resolver(RESOLVER):
        return
    # OmegaConf 2.4 renamed register_new_resolver (deprecated there) to register_resolver.
    register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    register(RESOLVER, exactga_file)


def add_to_torchtune_registry(registry_module: Any) -> None:
    """Append exactga's recipes, prefixed, to ``torchtune._recipe_registry``'s list (once)."""
    known = {recipe.name for recipe in registry_module.get_all_recipes()}
    for entry in RECIPES:
        name = PREFIX + entry.name
        if name in known:
            continue
        configs = [
            registry_module.Config(name=PREFIX + config, file_path=str(config_path(config)))
            for config in entry.configs
        ]
        registry_module.get_all_recipes().append(
            registry_module.Recipe(
                name=name,
                file_path=str(recipe_path(entry.recipe_file)),
                configs=configs,
                supports_distributed=entry.supports_distributed,
            )
        )
