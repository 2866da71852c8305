"""Checks on exactga's own distributed configs in configs/, fast and offline.

Full and LoRA configs of ``full_finetune_distributed`` and ``lora_finetune_distributed`` for
Llama 3.1 8B and 70B, Llama 3.2 3B and Qwen2.5 7B and 32B (``stock_configs.OUR_CONFIGS``). As in
tests/test_model_configs.py, models are built on the meta device, tokenizers are only resolved
to their builder and no recipe is run here. Each config is also adapted to tiny shapes as the
stock-config sweep adapts it and validated there; two of them are launched with the stock
configs' runs (tests/test_stock_distributed_configs.py), all ten by
``python tools/stock_config_sweep.py --ours``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import stock_configs
import torch
from omegaconf import OmegaConf
from stock_configs import FULL, LORA
from tiny_runs import recipe_script
from torchtune import config
from torchtune.config._utils import _get_component_from_path
from torchtune.modules.peft import get_adapter_params
from unit_utils import CONFIGS, EXACTGA_KEYS, STOCK_CONFIGS, config_header, load_config

from exactga.config.schemas import FullFinetuneDistributedConfig, LoraFinetuneDistributedConfig
from exactga.config.validation import validate_config

SCHEMAS = {FULL: FullFinetuneDistributedConfig, LORA: LoraFinetuneDistributedConfig}
RECIPE_OF = {name.removeprefix("configs/"): recipe for recipe, name in stock_configs.OUR_CONFIGS}
NAMES = list(RECIPE_OF)

# config (relative to configs/, no suffix) -> (output tag, min params, max params of the base)
MODEL_CONFIGS = {
    "llama3_1/8B_full": ("llama3_1_8B", 7.5e9, 8.5e9),  # 8.03e9
    "llama3_1/8B_lora": ("llama3_1_8B", 7.5e9, 8.5e9),
    "llama3_1/70B_full": ("llama3_1_70B", 70.0e9, 71.0e9),  # 70.55e9
    "llama3_1/70B_lora": ("llama3_1_70B", 70.0e9, 71.0e9),
    "llama3_2/3B_full": ("llama3_2_3B", 2.8e9, 3.6e9),  # 3.21e9
    "llama3_2/3B_lora": ("llama3_2_3B", 2.8e9, 3.6e9),
    "qwen2_5/7B_full": ("qwen2_5_7B", 7.0e9, 8.0e9),  # 7.62e9
    "qwen2_5/7B_lora": ("qwen2_5_7B", 7.0e9, 8.0e9),
    "qwen2_5/32B_full": ("qwen2_5_32B", 32.0e9, 33.5e9),  # 32.76e9
    "qwen2_5/32B_lora": ("qwen2_5_32B", 32.0e9, 33.5e9),
}
# family -> tokenizer builder, checkpointer model_type, the component builder of its tiny model
FAMILIES = {
    "llama3_1": ("torchtune.models.llama3.llama3_tokenizer", "LLAMA3", "llama3_1"),
    "llama3_2": ("torchtune.models.llama3.llama3_tokenizer", "LLAMA3_2", "llama3_2"),
    "qwen2_5": ("torchtune.models.qwen2_5.qwen2_5_tokenizer", "QWEN2", "qwen2"),
}
# The distributed knob our configs add besides the single-device ones (unit_utils.EXACTGA_KEYS).
OUR_KEYS = EXACTGA_KEYS | {"gradient_sync"}
# Keys whose value differs from the stock config's: ours go to /tmp/exactga and log to TensorBoard.
CHANGED_KEYS = {"output_dir", "metric_logger"}
# No stock config: qwen2_5/32B_full is qwen2_5/7B_full with these sections from 32B_lora (its
# header says so), and custom_sharded_layers as llama3_1/70B_full.
MODELLED = {"qwen2_5/32B_full": ("qwen2_5/7B_full", "qwen2_5/32B_lora")}


def _family(name: str) -> str:
    return name.split("/")[0]


def _size(name: str) -> str:
    """``"70B"`` for ``llama3_1/70B_lora``."""
    return name.split("/")[1].split("_")[0]


def _raw(name: str) -> dict:
    raw = OmegaConf.to_container(load_config(name), resolve=False)
    assert isinstance(raw, dict)
    return raw


def test_the_list_is_the_files() -> None:
    """``OUR_CONFIGS`` (what the sweep runs) names every distributed config of these families
    and no other; each is its recipe's by name, ``*_full`` or ``*_lora``."""
    on_disk = {
        f"{path.parent.name}/{path.stem}"
        for family in FAMILIES
        for path in (CONFIGS / family).glob("*.yaml")
        if not path.stem.endswith("_single_device") and "_KD_" not in path.stem
    }
    assert on_disk == set(NAMES) == set(MODEL_CONFIGS)
    assert len(NAMES) == len(stock_configs.OUR_CONFIGS)
    for name, recipe in RECIPE_OF.items():
        assert recipe == (FULL if name.endswith("_full") else LORA), name


@pytest.mark.parametrize("name", NAMES)
def test_validates_against_its_recipe(name: str) -> None:
    """Every key is known to its recipe's schema and its flags fit together (a config listed
    under the wrong recipe fails test_model_builds_on_meta: LoRA builders go to LoRA)."""
    recipe = RECIPE_OF[name]
    cfg = validate_config(load_config(name), SCHEMAS[recipe], recipe)
    assert cfg.loss_normalization == "exact"


@pytest.mark.parametrize("name", NAMES)
def test_model_builds_on_meta(name: str) -> None:
    """The family's builder of that size; base size in range; adapters only in LoRA configs."""
    _, lo, hi = MODEL_CONFIGS[name]
    cfg = load_config(name)
    component = cfg.model._component_
    assert component.startswith(f"torchtune.models.{_family(name)}."), component
    assert f"_{_size(name).lower()}" in component, component
    assert (".lora_" in component) == (RECIPE_OF[name] == LORA), component
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    n_adapter = sum(p.numel() for p in get_adapter_params(model).values())
    n_params = sum(p.numel() for p in model.parameters()) - n_adapter
    assert lo <= n_params <= hi, f"{component}: {n_params:,} params"
    if RECIPE_OF[name] == LORA:
        assert 0 < n_adapter < 0.05 * n_params
    else:
        assert n_adapter == 0


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_and_checkpointer_match_the_model(name: str) -> None:
    """The family's tokenizer and checkpoint layout, both read from the folder the header's
    ``tune download`` writes; every component resolves."""
    tokenizer, model_type, _ = FAMILIES[_family(name)]
    cfg = load_config(name)
    assert cfg.tokenizer._component_ == tokenizer
    assert cfg.checkpointer.model_type == model_type
    (download,) = [line for line in config_header(name).splitlines() if "tune download" in line]
    folder = download.split("--output-dir ")[1].split()[0].rstrip("/")
    assert cfg.checkpointer.checkpoint_dir.rstrip("/") == folder
    assert cfg.tokenizer.path.startswith(f"{folder}/")
    assert _size(name) in folder  # the model of the config's own size
    for key in ("tokenizer", "dataset", "loss", "checkpointer", "optimizer", "metric_logger"):
        assert callable(_get_component_from_path(cfg[key]._component_)), key


@pytest.mark.parametrize("name", NAMES)
def test_header_has_download_and_launch_commands(name: str) -> None:
    header = config_header(name)
    assert "tune download" in header
    recipe = RECIPE_OF[name]
    launch = f"{recipe_script(recipe)} --config configs/{name}.yaml"
    launches = [line for line in header.splitlines() if launch in line]
    assert launches and all("tune run --nproc_per_node " in line for line in launches)
    # ... plus at least one override example on top of the plain launch command.
    assert any(line.rstrip().endswith(launch) for line in launches)
    assert any("=" in line.split(launch)[1] for line in launches)


@pytest.mark.parametrize("name", NAMES)
def test_exactga_settings(name: str) -> None:
    """Our keys written out, each with its default; fp32 master weights where they fit."""
    tag, _, _ = MODEL_CONFIGS[name]
    raw = _raw(name)
    assert raw.keys() >= OUR_KEYS
    cfg = load_config(name)
    assert cfg.loss_normalization == "exact"
    assert cfg.drop_partial_window is False
    assert cfg.micro_batching == "by_length"
    assert cfg.gradient_sync == "every_micro_batch"  # stock's: never more memory than stock
    kind = "full" if RECIPE_OF[name] == FULL else "lora"
    assert cfg.output_dir == f"/tmp/exactga/{tag}/{kind}"
    assert cfg.metric_logger._component_ == "torchtune.training.metric_logging.TensorBoardLogger"
    assert raw["metric_logger"]["log_dir"] == "${output_dir}/logs"
    # LoRA: fp32 adapters (megabytes); full: fp32 up to 3B, as the single-device configs, and
    # stock's pure bf16 above, where it would double the weights' memory.
    small = float(_size(name).removesuffix("B")) <= 3
    assert cfg.master_weights == ("fp32" if kind == "lora" or small else "none")
    if kind == "lora":
        assert cfg.model.lora_dropout == 0.0  # dropout masks would differ between splits
    else:
        assert not (cfg.optimizer_in_bwd and cfg.gradient_accumulation_steps > 1)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in MODELLED])
def test_matches_stock_config(name: str) -> None:
    """Apart from our keys, output_dir and the logger's component, torchtune 0.6.1's config."""
    stock_path = STOCK_CONFIGS / f"{name}.yaml"
    assert stock_path.is_file(), stock_path
    ours, stock = _raw(name), OmegaConf.to_container(OmegaConf.load(stock_path))
    assert set(ours) == set(stock) | OUR_KEYS
    for key in stock.keys() - CHANGED_KEYS:
        assert ours[key] == stock[key], key
    assert ours["output_dir"] == stock["output_dir"].replace("/tmp/torchtune/", "/tmp/exactga/")
    ours_logger = {k: v for k, v in ours["metric_logger"].items() if k != "_component_"}
    assert ours_logger == {k: v for k, v in stock["metric_logger"].items() if k != "_component_"}


def test_qwen2_5_32B_full_is_modelled_as_its_header_says() -> None:
    """No stock config: qwen2_5/7B_full's settings, qwen2_5/32B_lora's tokenizer and checkpoint
    files with the plain builder, llama3_1/70B_full's custom_sharded_layers."""
    name = "qwen2_5/32B_full"
    base, lora = (_raw(other) for other in MODELLED[name])
    ours = _raw(name)
    assert not (STOCK_CONFIGS / f"{name}.yaml").exists()  # else it should be based on that
    sections = {"model", "tokenizer", "checkpointer", "custom_sharded_layers"}
    assert set(ours) == set(base) | {"custom_sharded_layers"}
    for key in base.keys() - sections - CHANGED_KEYS:
        assert ours[key] == base[key], key
    assert ours["tokenizer"] == lora["tokenizer"]
    assert ours["checkpointer"] == lora["checkpointer"]
    assert ours["model"] == {"_component_": lora["model"]["_component_"].replace(".lora_", ".")}
    assert ours["custom_sharded_layers"] == _raw("llama3_1/70B_full")["custom_sharded_layers"]
    assert ours["output_dir"] == base["output_dir"].replace("7B", "32B")
    assert "tune run --nproc_per_node 8 " in config_header(name)  # as 32B_lora


@pytest.mark.parametrize("name", NAMES)
def test_adapts_to_tiny_shapes(name: str, tmp_path: Path) -> None:
    """What the sweep and the CI launch run: a tiny model from the family's component builder,
    our keys as shipped, and the result still valid for the recipe."""
    recipe = RECIPE_OF[name]
    cfg = stock_configs.adapted_config(f"configs/{name}", recipe, tmp_path)
    _, _, builder = FAMILIES[_family(name)]
    assert cfg.model._component_.startswith(f"torchtune.models.{builder}."), cfg.model
    assert cfg.model.num_layers == 2 and cfg.device == "cpu"
    shipped = load_config(name)
    for key in OUR_KEYS:
        assert cfg[key] == shipped[key], key
    logger = OmegaConf.to_container(cfg.metric_logger)
    assert logger == OmegaConf.to_container(shipped.metric_logger)
    validate_config(cfg, SCHEMAS[recipe], recipe)
