"""torchtune 0.6.1's four stock KD configs run unchanged on our two KD recipes.

Each is adapted by tools/stock_configs.py (tiny student and teacher of the same family, the
teacher twice as wide, tiny tokenizer, data and initial checkpoints, ``device: cpu``, one step;
every other key as shipped: bf16, fused AdamW, chunked losses, ``kd_ratio``, scheduler,
profiler section, DiskLogger). All four adapt in CI; two run there (one per family, one per
recipe), and all four with ``EXACTGA_ALL_KD_STOCK_CONFIGS=1``, one after another, each
forked from the tests' server (tests/many_runs.py: still the recipe as ``tune run`` starts it). The
distributed recipe
starts without torchrun and trains as one rank (exactga.runtime.distributed): what is checked
here is that the configs run unchanged; the recipe on 2 ranks is
tests/test_recipe_kd_distributed.py's, so a second rank would double its CPU for nothing checked
here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import stock_configs
from many_runs import Run, launch_runs, named_run
from omegaconf import DictConfig, OmegaConf

SINGLE, DISTRIBUTED = stock_configs.KD_RECIPES
ALL = [
    (SINGLE, "llama3_2/8B_to_1B_KD_lora_single_device"),
    (DISTRIBUTED, "llama3_2/8B_to_1B_KD_lora_distributed"),
    (SINGLE, "qwen2/1.5_to_0.5B_KD_lora_single_device"),
    (DISTRIBUTED, "qwen2/1.5_to_0.5B_KD_lora_distributed"),
]
SELECTION = ALL if os.environ.get("EXACTGA_ALL_KD_STOCK_CONFIGS") else [ALL[0], ALL[3]]
# One optimizer step: its losses finite and the weights it saves finite (a NaN update, which a
# second step's loss would show) are what "the config runs unchanged" needs; a second step would
# double the runs' CPU. KD's steps after the first are tests/test_recipe_kd_distributed.py's and
# tests/test_recipe_ga_parity_kd.py's.
STEPS = 1


def _params(launches):
    return [pytest.param(r, n, id=n) for r, n in launches]


def adapted(name: str, recipe: str, output_dir: Path) -> DictConfig:
    """Stock KD config ``name`` as tools/stock_configs.py adapts it, for ``STEPS`` steps."""
    cfg = stock_configs.adapted_config(name, recipe, output_dir)
    cfg.max_steps_per_epoch = STEPS
    return cfg


def _run(root: Path, recipe: str, name: str) -> Run:
    """The adapted config's run."""
    out = root / name
    out.mkdir(parents=True)
    config_path = out / "config.yaml"
    OmegaConf.save(adapted(name, recipe, out), config_path)
    return named_run(recipe, ["--config", str(config_path)], out)


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    def launch_all(root: Path) -> None:
        launch_runs([_run(root, recipe, name) for recipe, name in SELECTION], nproc=0)

    return run_once("kd_stock_runs", launch_all)


def test_the_stock_kd_configs_are_all_listed() -> None:
    names = {
        n for recipe in stock_configs.KD_RECIPES for n in stock_configs.stock_config_names(recipe)
    }
    assert names == {name for _, name in ALL}


@pytest.mark.parametrize("recipe, name", _params(ALL))
def test_every_stock_kd_config_adapts(recipe: str, name: str, tmp_path: Path) -> None:
    stock = stock_configs.stock_config(name)
    cfg = adapted(name, recipe, tmp_path)
    assert cfg.max_steps_per_epoch == STEPS
    assert cfg.teacher_model.embed_dim == 2 * cfg.model.embed_dim
    assert cfg.teacher_checkpointer.model_type == stock.teacher_checkpointer.model_type
    for key in ("kd_loss", "kd_ratio", "loss", "optimizer", "dtype", "batch_size"):
        assert OmegaConf.to_container(cfg)[key] == OmegaConf.to_container(stock)[key], key


@pytest.mark.xdist_group("kd_stock_configs")
@pytest.mark.slow
@pytest.mark.parametrize("recipe, name", _params(SELECTION))
def test_stock_kd_config_runs(runs: Path, recipe: str, name: str) -> None:
    """Exit status 0, finite losses of both parts at the step, the stock artefacts, every
    saved weight finite."""
    out = runs / name
    output = (out / "output.txt").read_text()
    assert (out / "returncode").read_text() == "0", output[-4000:]
    losses = stock_configs.logged_losses(out)
    assert len(losses) == STEPS and stock_configs.all_finite(losses)
    log_text = "".join(p.read_text() for p in (out / "logs").glob("log_*.txt"))
    assert "class_loss:" in log_text and "kd_loss:" in log_text
    cfg = OmegaConf.load(out / "config.yaml")
    for artefact in stock_configs.expected_artefacts(cfg):
        assert (out / artefact).is_file(), artefact
    assert not stock_configs.weight_files_not_finite(out, cfg), name
