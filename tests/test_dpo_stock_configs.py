"""torchtune 0.6.1's five stock DPO configs run unchanged on our three DPO recipes.

Each is adapted as tools/stock_configs.py adapts the fine-tuning configs (tiny model of the same
family, tiny tokenizer, initial checkpoint written on first use, ``device: cpu``, one step), with
two differences: the data is the shipped preference pairs (``preference_dataset`` over
configs/tiny/preference_data.json) where stock reads Stack Exchange, and sequences may be 512
tokens (the pairs' longest; at 64 most responses would be cut away). Full DPO's
``ref_checkpointer`` reads the same initial weights as its ``checkpointer``. Every other key
stays as shipped: bf16, fused AdamW, the DPO loss and its beta, batch size, accumulation,
activation checkpointing, scheduler, DiskLogger. All five adapt in CI; one per recipe runs
there, all five with ``EXACTGA_ALL_DPO_STOCK_CONFIGS=1``, one after another, each
forked from the tests' server (tests/many_runs.py): the distributed recipes start without torchrun
and train as one rank
(exactga.runtime.distributed). What is checked here is that the configs run unchanged; both
distributed DPO recipes on 2 ranks are tests/test_recipe_dpo_distributed.py's, so a second rank
would double those runs' CPU for nothing checked here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import stock_configs
from many_runs import Run, launch_runs, named_run
from omegaconf import DictConfig, OmegaConf
from recipe_utils import REPO_ROOT

SINGLE, DISTRIBUTED, FULL = "lora_dpo_single_device", "lora_dpo_distributed", "full_dpo_distributed"
ALL = [
    (SINGLE, "llama3_1/8B_lora_dpo_single_device"),
    (DISTRIBUTED, "llama2/7B_lora_dpo"),
    (FULL, "llama3_1/8B_full_dpo"),
    (SINGLE, "llama2/7B_lora_dpo_single_device"),
    (DISTRIBUTED, "llama3_1/8B_lora_dpo"),
]
SELECTION = ALL if os.environ.get("EXACTGA_ALL_DPO_STOCK_CONFIGS") else ALL[:3]
PAIRS = REPO_ROOT / "configs" / "tiny" / "preference_data.json"
MAX_SEQ_LEN = 512
# One optimizer step: its loss finite and the weights it saves finite (a NaN update, which a
# second step's loss would show) are what "the config runs unchanged" needs; a step is the
# shipped batch_size x gradient_accumulation_steps pairs, each through policy and reference, so
# a second would double the runs' CPU. DPO's steps after the first are
# tests/test_recipe_dpo_distributed.py's and tests/test_resume_dpo.py's.
STEPS = 1


def adapted_dpo_config(name: str, recipe: str, output_dir: Path) -> DictConfig:
    """Stock DPO config ``name`` adapted as the module docstring says."""
    stock = stock_configs.stock_config(name)
    model, base_model = stock_configs.tiny_model(stock.model)
    model["max_seq_len"] = MAX_SEQ_LEN
    base_model["max_seq_len"] = MAX_SEQ_LEN
    cfg = stock.copy()
    cfg.output_dir = str(output_dir)
    cfg.device = "cpu"
    cfg.epochs = 1
    cfg.max_steps_per_epoch = STEPS
    cfg.model = model
    cfg.tokenizer = {
        "_component_": "torchtune.models.llama2.llama2_tokenizer",
        "path": str(stock_configs.TOKENIZER),
        "max_seq_len": MAX_SEQ_LEN,
        "prompt_template": None,
    }
    cfg.dataset = {
        "_component_": "torchtune.datasets.preference_dataset",
        "source": "json",
        "data_files": str(PAIRS),
        "split": "train",
    }
    is_lora = recipe != FULL
    checkpointer = {
        "_component_": "exactga.models.random_init_checkpointer.initialized_hf_checkpointer",
        "model": base_model if is_lora else "${model}",
        "init_seed": 0,
        "checkpoint_dir": "${output_dir}/base_model",
        "checkpoint_files": ["model.safetensors"],
        "recipe_checkpoint": None,
        "output_dir": "${output_dir}",
        "model_type": stock.checkpointer.model_type,
    }
    cfg.checkpointer = checkpointer
    if "ref_checkpointer" in stock:
        cfg.ref_checkpointer = {**checkpointer, "model_type": stock.ref_checkpointer.model_type}
    return cfg


def _run(root: Path, recipe: str, name: str) -> Run:
    """The adapted config's run."""
    out = root / name
    out.mkdir(parents=True)
    config_path = out / "config.yaml"
    OmegaConf.save(adapted_dpo_config(name, recipe, out), config_path)
    return named_run(recipe, ["--config", str(config_path)], out)


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    """Every selected config's run, one after another, no torchrun, each forked from the tests'
    server (tests/many_runs.py: still the recipe as ``tune run`` starts it)."""

    def launch_all(root: Path) -> None:
        launch_runs([_run(root, recipe, name) for recipe, name in SELECTION], nproc=0)

    return run_once("dpo_stock_runs", launch_all)


def test_the_stock_dpo_configs_are_all_listed() -> None:
    names = {
        n
        for recipe in (SINGLE, DISTRIBUTED, FULL)
        for n in stock_configs.stock_config_names(recipe)
    }
    assert names == {name for _, name in ALL}


@pytest.mark.parametrize("recipe, name", [pytest.param(r, n, id=n) for r, n in ALL])
def test_every_stock_dpo_config_adapts(recipe: str, name: str, tmp_path: Path) -> None:
    stock = stock_configs.stock_config(name)
    cfg = adapted_dpo_config(name, recipe, tmp_path)
    for key in ("loss", "optimizer", "dtype", "batch_size", "gradient_accumulation_steps"):
        assert OmegaConf.to_container(cfg)[key] == OmegaConf.to_container(stock)[key], key
    assert ("ref_checkpointer" in cfg) == (recipe == FULL)
    outside = set(stock_configs._paths_outside(cfg, tmp_path)) - {str(PAIRS)}
    assert not outside, f"paths left outside output_dir: {outside}"


@pytest.mark.slow
@pytest.mark.xdist_group("dpo_stock_configs")  # one worker makes the runs, the other goes on
@pytest.mark.parametrize("recipe, name", [pytest.param(r, n, id=n) for r, n in SELECTION])
def test_stock_dpo_config_runs(runs: Path, recipe: str, name: str) -> None:
    """Exit status 0, a finite loss at the step, the stock artefacts, every saved weight
    finite."""
    out = runs / name
    output = (out / "output.txt").read_text()
    assert (out / "returncode").read_text() == "0", output[-4000:]
    losses = stock_configs.logged_losses(out)
    assert len(losses) == STEPS and stock_configs.all_finite(losses)
    cfg = OmegaConf.load(out / "config.yaml")
    for artefact in stock_configs.expected_artefacts(cfg):
        assert (out / artefact).is_file(), f"{name}: no {artefact}"
    assert not stock_configs.weight_files_not_finite(out, cfg), name
