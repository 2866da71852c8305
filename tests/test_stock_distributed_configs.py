"""torchtune 0.6.1's stock distributed configs run unchanged on our two distributed recipes.

Each stock config is adapted by tools/stock_configs.py (tiny model of the same family, tiny
tokenizer, data and initial checkpoint, ``device: cpu``, 2 steps; every other key as shipped)
and launched through the real ``tune run --nproc_per_node 2`` on gloo ranks, on the data's first
rows (twice what the run reads, at least 64: ``launch_args(..., sliced=True)``). All 57 run
in tools/stock_config_sweep.py; CI launches the 12 below, one per model family, which between
them cover full and LoRA fine-tuning with activation checkpointing on and off, DoRA, QLoRA,
``custom_sharded_layers``, ``fsdp_cpu_offload``, tied and untied embeddings and adapter-only
saving (``test_selection_covers_families_and_flags`` keeps that true). Two of exactga's own
distributed configs (``stock_configs.OUR_CONFIGS``, adapted the same way) run among the same
runs; tests/test_distributed_model_configs.py checks all ten in-process. The runs are made once,
in a module fixture shared by the xdist workers, one after another (tests/many_runs.py): each
config still goes through the recipe as ``tune run`` starts it, with a process group of its own,
its ranks forked from a server that imported torch and torchtune once (the imports were most of
a fresh launch: about 20 of its 30 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import stock_configs
import torch
from many_runs import Run, launch_runs, run_of
from omegaconf import DictConfig, OmegaConf
from recipe_utils import load_weights

FULL, LORA = stock_configs.RECIPES

# (recipe, stock config): what each adds to the coverage.
SELECTION = [
    (LORA, "llama2/13B_lora"),  # multi-head attention, LoRA on the output projection, AC off
    (LORA, "llama3/8B_dora"),  # DoRA, AC off
    (FULL, "llama3_1/70B_full"),  # fsdp_cpu_offload, custom_sharded_layers, unfused AdamW, AC
    (FULL, "llama3_2/1B_full"),  # tied embeddings, accumulation over 8 micro-batches, AC off
    (LORA, "llama3_3/70B_qlora"),  # QLoRA (NF4 base), adapter weights only, AC on
    (LORA, "mistral/7B_lora"),  # AC on
    (FULL, "gemma/2B_full"),  # multi-query attention, tied embeddings, AC on
    (LORA, "gemma2/27B_lora"),  # soft-capping, sliding window, query scaling, AC on
    (LORA, "phi3/mini_lora"),  # Phi-3's fused HF layout, no PEFT export, AC off
    (FULL, "phi4/14B_full"),  # AC on
    (FULL, "qwen2/0.5B_full"),  # attention biases, tied embeddings, AC off
    (LORA, "qwen2_5/72B_lora"),  # untied embeddings, AC on
]
# (recipe, our config): what each adds to the stock runs above, besides our keys and the
# TensorBoard logger. The others differ from their stock config only in those
# (test_distributed_model_configs.py); all ten run in tools/stock_config_sweep.py --ours.
OUR_SELECTION = [
    (FULL, "configs/qwen2_5/32B_full"),  # the one without a stock config: written by us
    (LORA, "configs/llama3_2/3B_lora"),  # rank 64, tied embeddings, 4 x 8 micro-batches, AC off
]
FAMILIES = {
    "llama2",
    "llama3",
    "llama3_1",
    "llama3_2",
    "llama3_3",
    "mistral",
    "gemma",
    "gemma2",
    "phi3",
    "phi4",
    "qwen2",
    "qwen2_5",
}


def _params(launches: list[tuple[str, str]]) -> list:
    return [pytest.param(r, n, id=f"{r.split('_')[0]}-{n}") for r, n in launches]


def _out(root: Path, recipe: str, name: str) -> Path:
    return root / recipe / name


def _run(root: Path, recipe: str, name: str) -> Run:
    """One config's run on a slice of the data (``launch_args(..., sliced=True)``: on the command
    line, the adapted config as written is tools/stock_configs.py's); its exit status and output
    are kept for the test that reads them."""
    out = _out(root, recipe, name)
    nproc, run = run_of(stock_configs.launch_args(name, recipe, out, sliced=True), out)
    assert nproc == 2  # what launch_runs starts
    return run


def _launch_all(root: Path) -> None:
    launch_runs([_run(root, recipe, name) for recipe, name in SELECTION + OUR_SELECTION])


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    return run_once("stock_distributed_runs", _launch_all)


def _stock_cfg(name: str) -> DictConfig:
    return stock_configs.stock_config(name)


def test_selection_covers_families_and_flags() -> None:
    """One run per model family; between them every flag combination the brief names."""
    assert {name.split("/")[0] for _, name in SELECTION} == FAMILIES
    assert len(SELECTION) <= 12
    cfgs = {(recipe, name): _stock_cfg(name) for recipe, name in SELECTION}
    for recipe in (FULL, LORA):
        ac = {c.enable_activation_checkpointing for (r, _), c in cfgs.items() if r == recipe}
        assert ac == {True, False}, recipe
    components = [c.model._component_ for c in cfgs.values()]
    assert any(".qlora_" in c for c in components)
    assert any(c.model.get("use_dora") for c in cfgs.values())
    assert any(c.get("custom_sharded_layers") for c in cfgs.values())
    assert any(c.get("fsdp_cpu_offload") for c in cfgs.values())
    assert any(c.get("save_adapter_weights_only") for c in cfgs.values())
    # No stock full config of torchtune 0.6.1 sets optimizer_in_bwd; if one does, cover it.
    in_bwd = [n for n in stock_configs.stock_config_names(FULL) if _stock_cfg(n).optimizer_in_bwd]
    assert not in_bwd or any(cfgs.get((FULL, n)) for n in in_bwd), in_bwd


def test_our_selection_is_ours_and_covers_both_recipes() -> None:
    assert {recipe for recipe, _ in OUR_SELECTION} == {FULL, LORA}
    assert set(OUR_SELECTION) <= set(stock_configs.OUR_CONFIGS)
    assert len(OUR_SELECTION) <= 2  # CI time: each run adds about 10 s


@pytest.mark.parametrize("recipe, name", _params(stock_configs.all_stock_configs()))
def test_every_stock_config_adapts(recipe: str, name: str, tmp_path: Path) -> None:
    """All 57 adapt: same family's builder, stock LoRA keys, only the agreed sections changed."""
    stock = _stock_cfg(name)
    cfg = stock_configs.adapted_config(name, recipe, tmp_path)
    assert cfg.device == "cpu" and cfg.max_steps_per_epoch == 2 and cfg.epochs == 1
    assert cfg.checkpointer.model_type == stock.checkpointer.model_type
    for key in stock_configs.LORA_KEYS:
        if key in stock.model:
            assert cfg.model[key] == stock.model[key], key
    assert cfg.model.get("quantize_base", False) == (".qlora_" in stock.model._component_)
    assert cfg.model.num_layers == 2 and cfg.model.vocab_size == 2048
    changed = {"model", "tokenizer", "dataset", "checkpointer", "device", "output_dir"}
    changed |= {"epochs", "max_steps_per_epoch"}
    ours, shipped = OmegaConf.to_container(cfg), OmegaConf.to_container(stock)
    assert ours.keys() == shipped.keys()
    for key in shipped.keys() - changed:
        assert ours[key] == shipped[key], key


@pytest.mark.slow
@pytest.mark.xdist_group("stock_configs")
@pytest.mark.parametrize("recipe, name", _params(SELECTION + OUR_SELECTION))
def test_stock_config_runs(runs: Path, recipe: str, name: str) -> None:
    """Exit status 0, a finite loss on both steps, and the epoch's artefacts on disk."""
    out = _out(runs, recipe, name)
    output = (out / "output.txt").read_text()
    assert (out / "returncode").read_text() == "0", output[-4000:]
    losses = stock_configs.logged_losses(out)
    assert len(losses) == stock_configs.MAX_STEPS_PER_EPOCH and stock_configs.all_finite(losses)
    cfg = OmegaConf.load(out / "config.yaml")
    for artefact in stock_configs.expected_artefacts(cfg):
        assert (out / artefact).is_file(), artefact
    if cfg.get("save_adapter_weights_only", False):
        assert not (out / "epoch_0" / "model-00001-of-00001.safetensors").exists()


# Stock llama3/8B_dora trains in bf16 at lr 3e-6 over its 2 steps (warm-up of 100): too little
# to move a bf16 magnitude (spacing 2^-8 relative), so what this run shows is where the
# magnitudes start and that they make the merged weights; that they train is
# tests/test_recipe_lora_single_device.py (fp32, moved 2e-2). Measured on this run: magnitudes
# within 4.1e-3 (max relative) of the base weights' row norms, the merged weights within 2.6e-3
# (relative L2 per weight) of DoRA's formula: bf16 rounding. The bounds are bf16's spacing and
# about 4x the measured.
DORA_MAGNITUDE_RTOL = 2**-7
DORA_MERGED_RTOL = 1e-2


@pytest.mark.slow
@pytest.mark.xdist_group("stock_configs")
def test_dora_magnitudes_start_at_the_base_norms_and_make_the_merged_weights(runs: Path) -> None:
    """Every adapted linear saves a magnitude of its output size, set from the norms of the
    loaded base weights' rows (not the placeholder drawn before the weights load: see
    [adapter init] in exactga.lora.adapters), and the saved adapters on the base weights give the
    merged weights the run wrote, by DoRA's ``m * (W + s B A) / ||W + s B A||`` per row."""
    from torchtune.models.convert_weights import hf_to_tune

    out = _out(runs, LORA, "llama3/8B_dora")
    cfg = OmegaConf.load(out / "config.yaml").model
    adapters = torch.load(out / "epoch_0" / "adapter_model.pt", weights_only=True)
    layout = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "dim": cfg.embed_dim}
    base = hf_to_tune(load_weights(out / "base_model" / "model.safetensors"), **layout)
    merged = hf_to_tune(
        load_weights(out / "epoch_0" / "model-00001-of-00001.safetensors"), **layout
    )
    magnitudes = [key for key in adapters if key.endswith(".magnitude")]
    per_layer = len(cfg.lora_attn_modules) + (3 if cfg.apply_lora_to_mlp else 0)
    assert len(magnitudes) == per_layer * cfg.num_layers, sorted(magnitudes)
    scale = cfg.lora_alpha / cfg.lora_rank
    for key in magnitudes:
        module = key.removesuffix(".magnitude")
        weight = base[f"{module}.weight"]
        magnitude = adapters[key].float()
        norms = torch.linalg.norm(weight, dim=1)
        assert magnitude.shape == norms.shape, key
        assert torch.allclose(magnitude, norms, rtol=DORA_MAGNITUDE_RTOL, atol=0), key
        lora_b = adapters[f"{module}.lora_b.weight"].float()
        lora_a = adapters[f"{module}.lora_a.weight"].float()
        adapted = weight + scale * lora_b @ lora_a
        expected = adapted * (magnitude / torch.linalg.norm(adapted, dim=1)).view(-1, 1)
        distance = float((merged[f"{module}.weight"].float() - expected).norm() / expected.norm())
        assert distance <= DORA_MERGED_RTOL, (module, distance)


@pytest.mark.slow
@pytest.mark.xdist_group("stock_configs")
def test_cpu_offload_is_ignored_with_a_message(runs: Path) -> None:
    """FSDP2's CPU offload pins memory, which needs an accelerator; on CPU the recipe says it
    ignores the key instead of failing to load the weights."""
    output = (_out(runs, FULL, "llama3_1/70B_full") / "output.txt").read_text()
    lines = output.splitlines()
    assert any("fsdp_cpu_offload" in line and "ignored on CPU" in line for line in lines)
