"""Checks on the Qwen3, Qwen3 MoE, Gemma 3 and gpt-oss configs in configs/qwen3/,
configs/qwen3_moe/, configs/gemma3/ and configs/gpt_oss/, fast and offline.

exactga builds these families itself (exactga.models.qwen3, exactga.models.qwen3_moe,
exactga.models.gemma3, exactga.models.gpt_oss; torchtune 0.6.1 has none of them), so there is
no stock config of the same name to compare with: each config is checked against its recipe's
schema, the released checkpoints and exactga's keys. As in tests/test_model_configs.py, models
are built on the meta device (nothing allocated or downloaded), tokenizers are only resolved to
their builder (their files are absent), and no recipe is run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from tiny_runs import recipe_script
from tokenizer_files import QWEN3_SPECIAL_TOKENS
from torchtune import config
from torchtune.config._utils import _get_component_from_path
from torchtune.modules.peft import get_adapter_params
from torchtune.training import FormattedCheckpointFiles
from unit_utils import CONFIGS, config_header, load_config

from exactga.config.schemas import (
    FullFinetuneDistributedConfig,
    FullFinetuneSingleDeviceConfig,
    LoraFinetuneDistributedConfig,
    LoraFinetuneSingleDeviceConfig,
)
from exactga.config.validation import validate_config
from exactga.data.loader import model_vocab_size
from exactga.dpo.schema import LoraDpoDistributedConfig, LoraDpoSingleDeviceConfig
from exactga.grpo.rewards import build_rewards
from exactga.grpo.schema import GrpoDistributedConfig
from exactga.kd.distillation import check_kd_losses, check_vocabularies
from exactga.kd.schema import (
    KnowledgeDistillationDistributedConfig,
    KnowledgeDistillationSingleDeviceConfig,
)
from exactga.launch import registry

GRPO = "grpo_full_finetune_distributed"
SCHEMAS: dict[str, type] = {
    "full_finetune_single_device": FullFinetuneSingleDeviceConfig,
    "full_finetune_distributed": FullFinetuneDistributedConfig,
    "lora_finetune_single_device": LoraFinetuneSingleDeviceConfig,
    "lora_finetune_distributed": LoraFinetuneDistributedConfig,
    "lora_dpo_single_device": LoraDpoSingleDeviceConfig,
    "lora_dpo_distributed": LoraDpoDistributedConfig,
    GRPO: GrpoDistributedConfig,
    "knowledge_distillation_single_device": KnowledgeDistillationSingleDeviceConfig,
    "knowledge_distillation_distributed": KnowledgeDistillationDistributedConfig,
}
LORA_RECIPES = {
    "lora_finetune_single_device",
    "lora_finetune_distributed",
    "lora_dpo_single_device",
    "lora_dpo_distributed",
    "knowledge_distillation_single_device",
    "knowledge_distillation_distributed",
}
KD_RECIPES = {"knowledge_distillation_single_device", "knowledge_distillation_distributed"}
# Recipes whose loss is the SFT cross-entropy (DPO and GRPO take their own).
CE_RECIPES = SCHEMAS.keys() - {"lora_dpo_single_device", "lora_dpo_distributed", GRPO}
# The recipes that add a mixture-of-experts router's balance term (distillation, DPO and GRPO
# add none: their schemas reject router_aux_loss_coef > 0).
ROUTER_RECIPES = {
    "full_finetune_single_device",
    "full_finetune_distributed",
    "lora_finetune_single_device",
    "lora_finetune_distributed",
}
FUSED_LOSS = "exactga.accumulation.linear_cross_entropy.LinearCrossEntropyLoss"
CHUNKED_LOSS = "torchtune.modules.loss.CEWithChunkedOutputLoss"


@dataclass(frozen=True)
class Release:
    """A released Hugging Face checkpoint: what ``model.parameters()`` counts for the builder
    of its size (a tied embedding once), and its weight files."""

    params: tuple[float, float]
    files: tuple[str, ...]


def _shards(count: int, first: int = 1) -> tuple[str, ...]:
    return tuple(f"model-{i:05}-of-{count:05}.safetensors" for i in range(first, count + 1))


# Ranges from the released config.json files; measured counts in the comments.
RELEASES = {
    # 151,936 x 1,024 embedding, tied, + 28 layers x 15.7M: 596,049,920 (0.44e9 without it).
    "Qwen/Qwen3-0.6B": Release((0.55e9, 0.65e9), ("model.safetensors",)),
    # 2 x 151,936 x 4,096 (untied) + 36 layers x 192.9M: 8,190,735,360.
    "Qwen/Qwen3-8B": Release((8.1e9, 8.3e9), _shards(5)),
    # 262,144 x 1,152 embedding, tied, + 26 layers x 26.8M: 999,885,952.
    "google/gemma-3-1b-it": Release((0.95e9, 1.05e9), ("model.safetensors",)),
    # Text decoder: 262,208 x 2,560, tied, + 34 layers x 94.4M: 3,880,263,168 (the release's
    # 4.3e9 adds a 0.42e9 vision encoder, which is not built).
    "google/gemma-3-4b-it": Release((3.8e9, 4.0e9), _shards(2)),
    # 2 x 151,936 x 2,048 (untied) + 48 layers x 623.1M (128 experts of 3 x 2,048 x 768 each):
    # 30,532,122,624, the release's 30.5e9; 3.3e9 active per token.
    "Qwen/Qwen3-30B-A3B": Release((30.4e9, 30.6e9), _shards(16)),
    # 2 x 201,088 x 2,880 (untied) + 24 layers of 32 experts (3 x 2,880 x 2,880 and biases each)
    # and biased attention with sinks: 20,914,757,184, 3.6e9 active per token. The release's
    # files are numbered from 0.
    "openai/gpt-oss-20b": Release((20.8e9, 21.0e9), _shards(2, first=0)),
    # 36 layers of 128 experts: 116,829,156,672, 5.1e9 active per token.
    "openai/gpt-oss-120b": Release((116.7e9, 116.9e9), _shards(14, first=0)),
}


@dataclass(frozen=True)
class Case:
    """A config: the recipe its header launches, on how many devices (1: no
    ``--nproc_per_node``), the model it trains and, for distillation, the teacher."""

    recipe: str
    devices: int
    model: str
    teacher: str | None = None


QWEN3_0_6B, QWEN3_8B = "Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B"
QWEN3_30B_A3B = "Qwen/Qwen3-30B-A3B"
GEMMA3_1B, GEMMA3_4B = "google/gemma-3-1b-it", "google/gemma-3-4b-it"
GPT_OSS_20B, GPT_OSS_120B = "openai/gpt-oss-20b", "openai/gpt-oss-120b"
CASES = {
    "qwen3/0.6B_full_single_device": Case("full_finetune_single_device", 1, QWEN3_0_6B),
    "qwen3/8B_full": Case("full_finetune_distributed", 2, QWEN3_8B),
    "qwen3/0.6B_lora_single_device": Case("lora_finetune_single_device", 1, QWEN3_0_6B),
    "qwen3/8B_lora": Case("lora_finetune_distributed", 2, QWEN3_8B),
    "qwen3/8B_qlora_single_device": Case("lora_finetune_single_device", 1, QWEN3_8B),
    "qwen3/0.6B_lora_dpo_single_device": Case("lora_dpo_single_device", 1, QWEN3_0_6B),
    "qwen3/0.6B_grpo": Case(GRPO, 2, QWEN3_0_6B),
    "qwen3/8B_to_0.6B_KD_lora_single_device": Case(
        "knowledge_distillation_single_device", 1, QWEN3_0_6B, QWEN3_8B
    ),
    "qwen3/8B_to_0.6B_KD_lora_distributed": Case(
        "knowledge_distillation_distributed", 2, QWEN3_0_6B, QWEN3_8B
    ),
    "qwen3_moe/30B_A3B_full": Case("full_finetune_distributed", 2, QWEN3_30B_A3B),
    "qwen3_moe/30B_A3B_lora": Case("lora_finetune_distributed", 2, QWEN3_30B_A3B),
    "qwen3_moe/30B_A3B_lora_single_device": Case("lora_finetune_single_device", 1, QWEN3_30B_A3B),
    "qwen3_moe/30B_A3B_lora_dpo": Case("lora_dpo_distributed", 8, QWEN3_30B_A3B),
    "gemma3/1B_full_single_device": Case("full_finetune_single_device", 1, GEMMA3_1B),
    "gemma3/4B_full": Case("full_finetune_distributed", 2, GEMMA3_4B),
    "gemma3/1B_lora_single_device": Case("lora_finetune_single_device", 1, GEMMA3_1B),
    "gemma3/4B_lora": Case("lora_finetune_distributed", 2, GEMMA3_4B),
    "gemma3/4B_qlora_single_device": Case("lora_finetune_single_device", 1, GEMMA3_4B),
    "gemma3/1B_lora_dpo_single_device": Case("lora_dpo_single_device", 1, GEMMA3_1B),
    "gemma3/1B_grpo": Case(GRPO, 2, GEMMA3_1B),
    "gemma3/4B_to_1B_KD_lora_single_device": Case(
        "knowledge_distillation_single_device", 1, GEMMA3_1B, GEMMA3_4B
    ),
    "gemma3/4B_to_1B_KD_lora_distributed": Case(
        "knowledge_distillation_distributed", 2, GEMMA3_1B, GEMMA3_4B
    ),
    "gpt_oss/20B_lora_single_device": Case("lora_finetune_single_device", 1, GPT_OSS_20B),
    "gpt_oss/20B_full": Case("full_finetune_distributed", 8, GPT_OSS_20B),
    "gpt_oss/20B_lora": Case("lora_finetune_distributed", 2, GPT_OSS_20B),
    "gpt_oss/120B_lora": Case("lora_finetune_distributed", 8, GPT_OSS_120B),
    "gpt_oss/20B_lora_dpo": Case("lora_dpo_distributed", 2, GPT_OSS_20B),
    "gpt_oss/20B_grpo": Case(GRPO, 8, GPT_OSS_20B),
}
NAMES = list(CASES)


@dataclass(frozen=True)
class Family:
    """What every config of a family names: its checkpointer's model_type, its tokenizer
    builder and the tokenizer's files (config key -> file name in the download folder)."""

    model_type: str
    tokenizer: str
    tokenizer_files: dict[str, str]


FAMILIES = {
    "qwen3": Family("QWEN3", "exactga.models.qwen3.qwen3_tokenizer", {"path": "tokenizer.json"}),
    # The MoE models share Qwen3's tokenizer.
    "qwen3_moe": Family(
        "QWEN3_MOE", "exactga.models.qwen3.qwen3_tokenizer", {"path": "tokenizer.json"}
    ),
    "gemma3": Family(
        "GEMMA3", "exactga.models.gemma3.gemma3_tokenizer", {"path": "tokenizer.json"}
    ),
    "gpt_oss": Family(
        "GPT_OSS", "exactga.models.gpt_oss.gpt_oss_tokenizer", {"path": "tokenizer.json"}
    ),
}
CHECKPOINTER = "exactga.models.checkpointer.FullModelHFCheckpointer"
# The one component a shipped config names without it being importable: stock GRPO's loss,
# which the pip package lacks; the GRPO recipe reads only its settings (exactga.grpo.schema).
NAMED_ONLY = {"torchtune.dev.grpo.loss.GRPOSimpleLoss"}


def _family(name: str) -> Family:
    return FAMILIES[name.split("/")[0]]


# A size in a config's name: ``0.6B``, ``8B``, or a mixture of experts' total and active
# parameters, ``30B_A3B``.
SIZE = r"[\d.]+B(?:_A[\d.]+B)?"


def _stem_parts(name: str) -> tuple[str, str]:
    """The sizes and the kind of a config's name: ``("8B_to_0.6B", "KD_lora_distributed")``
    for ``qwen3/8B_to_0.6B_KD_lora_distributed``, ``("30B_A3B", "lora")`` for
    ``qwen3_moe/30B_A3B_lora``."""
    match = re.fullmatch(rf"({SIZE}(?:_to_{SIZE})?)_(.+)", name.split("/")[1])
    assert match is not None, name
    return match.group(1), match.group(2)


def _size(release: str) -> str:
    """``"0.6B"`` for ``Qwen/Qwen3-0.6B``, ``"4B"`` for ``google/gemma-3-4b-it``, ``"30B_A3B"``
    for ``Qwen/Qwen3-30B-A3B``: as the config names and sized builders spell it."""
    match = re.search(r"-([\d.]+)[bB](?:-A([\d.]+)B)?(?:-it)?$", release)
    assert match is not None, release
    total, active = match.groups()
    return f"{total}B" + (f"_A{active}B" if active else "")


def _folder(release: str) -> str:
    return "/tmp/" + release.split("/")[1]


def _launch(name: str) -> str:
    case = CASES[name]
    devices = f"--nproc_per_node {case.devices} " if case.devices > 1 else ""
    return f"tune run {devices}{recipe_script(case.recipe)} --config configs/{name}.yaml"


def _downloads(name: str) -> dict[str, str]:
    """The header's ``tune download <repo> --output-dir <folder>`` lines, repo -> line."""
    lines = [line for line in config_header(name).splitlines() if "tune download " in line]
    return {line.split("tune download ")[1].split()[0]: line for line in lines}


def _components(node: object) -> list[str]:
    """Every ``_component_`` in a config, sections and lists of sections alike."""
    if isinstance(node, DictConfig):
        own = [str(node["_component_"])] if "_component_" in node else []
        return own + [c for key in node if key != "_component_" for c in _components(node[key])]
    if isinstance(node, ListConfig):
        return [c for item in node for c in _components(item)]
    return []


def _checkpointers(cfg: DictConfig) -> dict[str, DictConfig]:
    keys = ("checkpointer", "teacher_checkpointer", "ref_checkpointer")
    return {key: cfg[key] for key in keys if key in cfg}


def _file_names(section: DictConfig) -> tuple[str, ...]:
    """The weight files a checkpointer section names, its ``{filename_format, max_filename}``
    form expanded as torchtune expands it."""
    files = OmegaConf.to_container(section.checkpoint_files)
    if isinstance(files, dict):
        return tuple(FormattedCheckpointFiles.from_dict(files).build_checkpoint_filenames())
    return tuple(str(name) for name in files)


@dataclass(frozen=True)
class Built:
    """A model section built on the meta device: its base and adapter parameters and its
    embedding rows."""

    n_params: int
    n_adapter: int
    vocab_size: int


@cache
def _build(name: str, key: str) -> Built:
    """The config's ``key`` model (``model``, ``teacher_model``), built once per test run."""
    with torch.device("meta"):
        model = config.instantiate(load_config(name)[key])
    n_adapter = sum(p.numel() for p in get_adapter_params(model).values())
    n_params = sum(p.numel() for p in model.parameters()) - n_adapter
    return Built(n_params, n_adapter, model_vocab_size(model))


def test_every_config_file_of_the_families_is_checked() -> None:
    on_disk = {
        f"{family}/{path.stem}" for family in FAMILIES for path in (CONFIGS / family).glob("*.yaml")
    }
    assert on_disk == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_listed_by_tune_ls_under_its_recipe(name: str) -> None:
    (entry,) = [entry for entry in registry.RECIPES if entry.name == CASES[name].recipe]
    assert name in entry.configs


@pytest.mark.parametrize("name", NAMES)
def test_header_has_download_launch_and_override(name: str) -> None:
    case = CASES[name]
    downloads = _downloads(name)
    assert set(downloads) == {case.model, case.teacher} - {None}
    for release, line in downloads.items():
        assert f"tune download {release} --output-dir {_folder(release)}" in line
        assert ("--hf-token <HF_TOKEN>" in line) == release.startswith("google/")  # gated
    lines = [line.rstrip() for line in config_header(name).splitlines()]
    launch = _launch(name)
    assert f"#   {launch}" in lines
    overrides = [line for line in lines if line.startswith(f"#   {launch} ")]
    assert overrides and all("=" in line.removeprefix(f"#   {launch} ") for line in overrides)


@pytest.mark.parametrize("name", NAMES)
def test_model_builds_on_meta_with_the_release_size(name: str) -> None:
    """The family's builder of the release's size; adapters only where the recipe trains
    them, a small fraction of the weights; a QLoRA config names a QLoRA builder."""
    case, cfg = CASES[name], load_config(name)
    component = str(cfg.model._component_)
    builder = component.rsplit(".", 1)[1]
    assert component.startswith(f"exactga.models.{name.split('/')[0]}."), component
    assert builder.endswith("_" + _size(case.model).lower().replace(".", "_")), component
    assert builder.startswith(("lora_", "qlora_")) == (case.recipe in LORA_RECIPES), component
    assert builder.startswith("qlora_") == ("qlora" in name), component
    built = _build(name, "model")
    lo, hi = RELEASES[case.model].params
    assert lo <= built.n_params <= hi, f"{component}: {built.n_params:,} parameters"
    if case.recipe in LORA_RECIPES:
        assert 0 < built.n_adapter < 0.05 * built.n_params, f"{built.n_adapter:,} adapters"
        assert cfg.model.lora_dropout == 0.0  # dropout masks would differ between splits
    else:
        assert built.n_adapter == 0


@pytest.mark.parametrize("name", [n for n in NAMES if CASES[n].recipe in KD_RECIPES])
def test_kd_teacher_is_the_plain_larger_release_and_the_losses_fit(name: str) -> None:
    case, cfg = CASES[name], load_config(name)
    assert str(cfg.teacher_model._component_).endswith(
        "_" + _size(case.teacher).lower().replace(".", "_")
    )
    student, teacher = _build(name, "model"), _build(name, "teacher_model")
    lo, hi = RELEASES[case.teacher].params
    assert lo <= teacher.n_params <= hi, f"teacher: {teacher.n_params:,} parameters"
    assert teacher.n_adapter == 0  # a plain teacher: nothing of it trains
    check_vocabularies(student.vocab_size, teacher.vocab_size)
    check_kd_losses(config.instantiate(cfg.loss), config.instantiate(cfg.kd_loss))


@pytest.mark.parametrize("name", NAMES)
def test_every_component_resolves(name: str) -> None:
    components = set(_components(load_config(name))) - NAMED_ONLY
    for component in components:
        assert callable(_get_component_from_path(component)), component


@cache
def _validated(name: str) -> DictConfig:
    """The config as its recipe's ``validate_config`` types it, validated once per test run (the
    tests only read it)."""
    recipe = CASES[name].recipe
    return validate_config(load_config(name), SCHEMAS[recipe], recipe)


@pytest.mark.parametrize("name", NAMES)
def test_validates_against_its_recipe(name: str) -> None:
    cfg = _validated(name)
    assert cfg.loss_normalization == "exact"
    assert cfg.drop_partial_window is False


# The released config.json's router_aux_loss_coef: the weight transformers gives the balance
# loss of these models when it adds it.
RELEASE_ROUTER_AUX_LOSS_COEF = {QWEN3_30B_A3B: 0.001, GPT_OSS_20B: 0.9, GPT_OSS_120B: 0.9}


@pytest.mark.parametrize("name", NAMES)
def test_router_balance_term_as_released_where_the_recipe_adds_one(name: str) -> None:
    """A mixture-of-experts config trains with its release's coefficient, balanced over the
    global batch (the default), where its recipe adds the term; elsewhere (dense models, DPO)
    the coefficient is 0."""
    case = CASES[name]
    cfg = _validated(name)
    released = RELEASE_ROUTER_AUX_LOSS_COEF.get(case.model, 0.0)
    assert cfg.router_aux_loss_coef == (released if case.recipe in ROUTER_RECIPES else 0.0)
    assert str(cfg.router_balance.value) == "global_batch"


@pytest.mark.parametrize("name", NAMES)
def test_exactga_settings(name: str) -> None:
    """exactga's keys written out; output under /tmp/exactga/<models>/<kind>; TensorBoard."""
    cfg = load_config(name)
    raw = OmegaConf.to_container(cfg, resolve=False)
    assert raw["loss_normalization"] == "exact"
    assert raw.get("drop_partial_window", False) is False  # GRPO's windows are never partial
    assert "micro_batching" in raw and "master_weights" in raw
    sizes, kind = _stem_parts(name)
    assert cfg.output_dir == f"/tmp/exactga/{name.split('/')[0]}_{sizes.replace('.', '_')}/{kind}"
    assert cfg.metric_logger._component_ == "torchtune.training.metric_logging.TensorBoardLogger"
    assert raw["metric_logger"]["log_dir"] == "${output_dir}/logs"
    if CASES[name].recipe in CE_RECIPES:
        # Fine-tuning fuses the projection with the loss (a large vocabulary's peak); distillation
        # needs the student's logits for its KD loss, so it keeps torchtune's chunked loss.
        fused = "knowledge_distillation" not in CASES[name].recipe
        assert cfg.loss._component_ == (FUSED_LOSS if fused else CHUNKED_LOSS)


@pytest.mark.parametrize("name", NAMES)
def test_checkpointers_read_the_release_with_exactgas_format(name: str) -> None:
    """exactga's checkpointer and the family's model_type for every model the config loads,
    reading the folder the header's download writes and the release's weight files."""
    case, cfg, family = CASES[name], load_config(name), _family(name)
    releases = {"checkpointer": case.model, "ref_checkpointer": case.model}
    releases["teacher_checkpointer"] = case.teacher
    checkpointers = _checkpointers(cfg)
    assert ("teacher_checkpointer" in checkpointers) == (case.teacher is not None)
    assert ("ref_checkpointer" in checkpointers) == (case.recipe == GRPO)
    for key, section in checkpointers.items():
        release = releases[key]
        assert section._component_ == CHECKPOINTER, key
        assert section.model_type == family.model_type, key
        assert section.checkpoint_dir.rstrip("/") == _folder(release), key
        assert _file_names(section) == RELEASES[release].files, key


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_is_the_familys_from_the_trained_models_folder(name: str) -> None:
    cfg, family = load_config(name), _family(name)
    assert cfg.tokenizer._component_ == family.tokenizer
    folder = _folder(CASES[name].model)
    for key, file_name in family.tokenizer_files.items():
        assert cfg.tokenizer[key] == f"{folder}/{file_name}", key


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("_grpo")])
def test_grpo_prompts_and_rewards_are_bundled_and_build(name: str) -> None:
    """The prompts ship with exactga (no download) and the rewards instantiate."""
    registry.register_config_resolvers()
    cfg = load_config(name)
    data_files = Path(OmegaConf.to_container(cfg.dataset, resolve=True)["data_files"])
    assert data_files == registry.files_root() / "configs/tiny/arithmetic_data.json"
    assert data_files.is_file()
    assert build_rewards(cfg.rewards)


def test_qwen3_grpo_stops_at_the_tokenizers_stop_tokens() -> None:
    """``<|im_end|>`` (the tokenizer's eos_id) and ``<|endoftext|>``, where a plain-text
    prompt's continuation ends; ``null`` would stop at the first only."""
    stop = list(load_config("qwen3/0.6B_grpo").stop_token_ids)
    assert stop == [QWEN3_SPECIAL_TOKENS["<|im_end|>"], QWEN3_SPECIAL_TOKENS["<|endoftext|>"]]
