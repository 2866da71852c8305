"""torchtune 0.6.1's six stock QAT configs run unchanged on our two QAT recipes.

Each is adapted by tools/stock_configs.py (tiny model of the same family, width 256 so that
the stock ``quantizer.groupsize: 256`` divides every linear's input width, tiny tokenizer, data
and initial checkpoint, ``device: cpu``, 2 steps; every other key as shipped: bf16, fused AdamW,
activation checkpointing, ``custom_sharded_layers``, accumulation, the quantizer). All six
adapt here in-process; two launch in CI (``qat_runs.STOCK_SELECTION``, one per recipe, in the
QAT tests' shared 2-rank launch, tests/qat_runs.py, each on the data's first rows: twice what it
reads, at least 64); all six launch with ``tools/stock_config_sweep.py --only qat``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import stock_configs
from omegaconf import OmegaConf
from qat_runs import STOCK_SELECTION, shared_runs, stock_folder

ALL = stock_configs.all_stock_configs(stock_configs.QAT_RECIPES)


def _params(launches):
    return [pytest.param(r, n, id=n) for r, n in launches]


def test_the_selection_covers_both_recipes() -> None:
    assert len(ALL) == 6
    assert set(STOCK_SELECTION) <= set(ALL)
    assert {recipe for recipe, _ in STOCK_SELECTION} == set(stock_configs.QAT_RECIPES)


@pytest.mark.parametrize("recipe, name", _params(ALL))
def test_every_stock_qat_config_adapts(recipe: str, name: str, tmp_path: Path) -> None:
    """The quantizer and the training keys as shipped; a width the group size divides."""
    stock = stock_configs.stock_config(name)
    cfg = stock_configs.adapted_config(name, recipe, tmp_path)
    shipped, ours = OmegaConf.to_container(stock), OmegaConf.to_container(cfg)
    for key in ("quantizer", "optimizer", "dtype", "batch_size", "gradient_accumulation_steps"):
        assert ours[key] == shipped[key], key
    assert ours.get("fake_quant_after_n_steps") == shipped.get("fake_quant_after_n_steps")
    assert cfg.model.embed_dim % cfg.quantizer.groupsize == 0
    if cfg.model.get("intermediate_dim") is not None:  # llama2 derives it from the width
        assert cfg.model.intermediate_dim % cfg.quantizer.groupsize == 0


@pytest.mark.slow
@pytest.mark.xdist_group("qat")
@pytest.mark.parametrize("recipe, name", _params(STOCK_SELECTION))
def test_stock_qat_config_runs(run_once, recipe: str, name: str) -> None:
    """Exit status 0 on 2 gloo ranks, a finite loss on both steps, the epoch's artefacts."""
    out = stock_folder(shared_runs(run_once), recipe, name)
    output = (out / "output.txt").read_text()
    assert (out / "returncode").read_text() == "0", output[-4000:]
    losses = stock_configs.logged_losses(out)
    assert len(losses) == stock_configs.MAX_STEPS_PER_EPOCH and stock_configs.all_finite(losses)
    cfg = OmegaConf.load(out / "config.yaml")
    for artefact in stock_configs.expected_artefacts(cfg):
        assert (out / artefact).is_file(), artefact
