"""Every Qwen3, Qwen3 MoE, Gemma 3 and gpt-oss config (configs/qwen3/, configs/qwen3_moe/,
configs/gemma3/, configs/gpt_oss/) runs on tiny shapes through ``tune run`` (issue #41: "Every new
config passes the stock-config sweep on tiny shapes"; issue #65).

Each config is adapted as tools/stock_configs.py adapts torchtune's stock configs: a tiny model
of the same family built with the family's own component builder (``exactga.models.qwen3.qwen3``
/ ``lora_qwen3``, ``exactga.models.qwen3_moe.qwen3_moe`` / ``lora_qwen3_moe``,
``exactga.models.gemma3.gemma3`` / ``lora_gemma3``, ``exactga.models.gpt_oss.gpt_oss`` /
``lora_gpt_oss``) and every argument the config's sized builder passes it except the sizes (Gemma 3
and gpt-oss: a window shorter than the sequences, one local and one global layer; Qwen3 MoE and
gpt-oss: 4 experts, 2 per token), the tiny tokenizer, local data, a seeded
initial checkpoint in the family's HF layout (``initialized_hf_checkpointer`` with the config's
``model_type``), ``device: cpu``, one optimizer step (``STEPS``; GRPO: completions of 16 tokens
at most); every other key as shipped (dtype, master weights, optimizer, loss, activation
checkpointing, micro-batching, logger, ...). By recipe:

- full and LoRA/QLoRA fine-tuning (one device and distributed), KD (both recipes):
  ``stock_configs.adapted_config``, on rows of 32 tokens and windows of 16 (``SEQ_LEN``), the
  data file's first 128 rows (``DATA_ROWS``, twice what a step reads); KD's teacher twice the
  student's width;
- GRPO: the same, keeping its shipped prompts (the bundled arithmetic questions), and its
  ``ref_checkpointer`` reads the same initial weights;
- LoRA DPO (one device and distributed): ``adapted_dpo_config`` of
  tests/test_dpo_stock_configs.py (the bundled preference pairs, 512 tokens).

Qwen3 MoE's and gpt-oss's fine-tuning configs keep their ``router_aux_loss_coef``: their runs add
the router's balance term (docs/moe.md).

Which recipe runs a config is the registry's (``exactga.launch.registry``, which tests/
test_registry.py keeps equal to the configs' headers). Two groups of runs, each forked from
the tests' server (tests/many_runs.py), shared with tests/test_recipe_model_families.py's runs
(tests/family_runs.py): one after another, the single-device runs and the distributed configs' runs
as one rank (the recipe started
without torchrun, exactga.runtime.distributed); on 2 gloo ranks, one distributed config of each
recipe and family that trains the router's balance term, whose statistics every rank's
micro-batch joins (``global_batch``) in the shipped dtype. What the sweep checks is that each
config adapts and trains; these families on 2 ranks are tests/test_recipe_model_families.py's
(full and LoRA, fp32, the term on and off), each distributed recipe's 2-rank behaviour its own
module's (tests/test_recipe_kd_distributed.py, tests/test_recipe_dpo_distributed.py,
tests/test_recipe_grpo.py, ...), and the stock configs' keys on 2 ranks
tests/test_stock_distributed_configs.py's: a second rank would double the CPU of those runs for
nothing checked here. A config adapted to the very config another is adapted to, paths aside
(gpt-oss's 120B_lora, 20B_lora on tiny shapes: ``same_run_as``), is checked on that one's run.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import stock_configs
import torch
from family_runs import GROUP, family_runs
from many_runs import Run, named_run
from omegaconf import DictConfig, OmegaConf
from recipe_utils import REPO_ROOT, read_scalars
from test_dpo_stock_configs import PAIRS, adapted_dpo_config
from torchtune import config

from exactga.launch import registry
from exactga.models.gemma3._component_builders import FULL as GLOBAL_LAYER
from exactga.models.gemma3._component_builders import SLIDING as LOCAL_LAYER
from exactga.models.gemma3._component_builders import gemma3_layer_types
from exactga.models.gpt_oss import gpt_oss_layer_types

FAMILIES = ("qwen3", "qwen3_moe", "gemma3", "gpt_oss")
DPO_RECIPES = ("lora_dpo_single_device", "lora_dpo_distributed")
GRPO = stock_configs.GRPO
DISTRIBUTED_RECIPES = {entry.name for entry in registry.RECIPES if entry.supports_distributed}
# (recipe, config): every config of the families, under the recipe the registry runs it on.
SWEEP = [
    (entry.name, f"configs/{name}")
    for entry in registry.RECIPES
    for name in entry.configs
    if name.split("/")[0] in FAMILIES
]
SINGLE_DEVICE = [(recipe, name) for recipe, name in SWEEP if recipe not in DISTRIBUTED_RECIPES]
DISTRIBUTED = [(recipe, name) for recipe, name in SWEEP if recipe in DISTRIBUTED_RECIPES]
# Sections an adaptation replaces (stock_configs' module docstring); every other key is shipped.
ADAPTED_KEYS = {"model", "tokenizer", "dataset", "checkpointer", "device", "output_dir"}
ADAPTED_KEYS |= {"epochs", "max_steps_per_epoch", "teacher_model", "teacher_checkpointer"}
ADAPTED_KEYS |= {"ref_checkpointer", "max_generated_tokens"}
# One optimizer step shows a config trains: the step's loss is finite, and the weights it saves
# (after the update) are finite too, which is what a second step's loss showed (a NaN update
# makes the next loss NaN). A step's shipped batch_size x gradient_accumulation_steps
# micro-batches are the CPU of these runs, so a second step would double it; what two steps add
# to one (optimizer state carried, a second update landing where the split says) is the recipes'
# own modules' (tests/test_micro_batching_recipes.py, tests/test_recipe_model_families.py, ...).
STEPS = 1
# Rows of 32 tokens, half the adaptation's (stock_configs.TOKENIZER_MAX_SEQ_LEN), and Gemma 3's and
# gpt-oss's sliding windows halved with them (16), so that they still mask. The instruction rows
# are longer than 64 tokens, so the adaptation's rows were all cut to one length already; a
# step's compute is in its tokens. DPO keeps its pairs' 512 (tests/test_dpo_stock_configs.py),
# GRPO its prompts (the completions are its cost).
SEQ_LEN = stock_configs.TOKENIZER_MAX_SEQ_LEN // 2
# The fine-tuning and KD runs read the data file's first 128 rows, twice the most a step of theirs
# takes (8 x 8 on one device, 2 x 8 x 2 ranks): a 2-rank run's start-up tokenizes every row it
# may deal out (rank_balancing: by_tokens), the whole file's 2,069 in 0.3-1.4 s of wall on a
# loaded machine, 128 in 0.04-0.12 s; one process builds no such index, and draws its rows alike.
DATA_ROWS = 128


def _params(runs: list[tuple[str, str]]) -> list:
    return [pytest.param(recipe, name, id=name.removeprefix("configs/")) for recipe, name in runs]


def adapted(recipe: str, name: str, output_dir: Path) -> DictConfig:
    """Config ``name`` adapted to tiny shapes for ``recipe``, as the module docstring says."""
    if recipe in DPO_RECIPES:
        cfg = adapted_dpo_config(name, recipe, output_dir)
    else:
        cfg = stock_configs.adapted_config(name, recipe, output_dir)
    if recipe not in DPO_RECIPES + (GRPO,):
        _shorter_rows(cfg)
        cfg.dataset.split = f"train[:{DATA_ROWS}]"
    cfg.max_steps_per_epoch = STEPS
    return cfg


def _shorter_rows(cfg: DictConfig) -> None:
    """Rows of ``SEQ_LEN`` tokens, every sliding window (the models', and the weights' model of
    the checkpointers) half of that."""
    cfg.tokenizer.max_seq_len = SEQ_LEN
    models = [cfg.get(key) for key in ("model", "teacher_model")]
    # LoRA's checkpointer draws the plain model's weights from a section of its own.
    models += [cfg[key].model for key in ("checkpointer", "teacher_checkpointer") if key in cfg]
    for model in models:
        if isinstance(model, DictConfig) and "sliding_window" in model:
            model.sliding_window = SEQ_LEN // 2


def _out(root: Path, name: str) -> Path:
    return root / name.removeprefix("configs/")


@functools.cache
def _adapted_yaml(recipe: str, name: str) -> str:
    return OmegaConf.to_yaml(adapted(recipe, name, Path("/output_dir")))


@functools.cache
def same_run_as(recipe: str, name: str) -> str:
    """The config whose run is this one's: the first of ``SWEEP`` adapted to the very same
    config, paths aside (gpt-oss's 120B_lora is 20B_lora on tiny shapes: the released sizes are
    all the two differ in); ``name`` itself for every other config."""
    mine = _adapted_yaml(recipe, name)
    return next(n for r, n in SWEEP if r == recipe and _adapted_yaml(r, n) == mine)


def _run(root: Path, recipe: str, name: str) -> Run:
    """The run of the adapted config, saved to its output folder's ``config.yaml``."""
    out = _out(root, name)
    out.mkdir(parents=True)
    config_path = out / "config.yaml"
    OmegaConf.save(adapted(recipe, name, out), config_path)
    return named_run(recipe, ["--config", str(config_path)], out)


def _trains_the_router_term(name: str) -> bool:
    return stock_configs.stock_config(name).get("router_aux_loss_coef", 0) > 0


def planned_runs(root: Path) -> tuple[list[Run], list[Run]]:
    """The runs of one process, no torchrun (the single-device configs, and the distributed ones
    as one rank), and the 2-rank runs (a distributed config of each recipe and family that
    trains the router's balance term), for tests/family_runs.py to launch; see the module's
    docstring."""
    one, two, on_two_ranks = [], [], set()
    for recipe, name in SINGLE_DEVICE + DISTRIBUTED:
        if same_run_as(recipe, name) != name:
            continue  # its twin's run is its run
        # One config per recipe and family on 2 ranks.
        first = (recipe, name.split("/")[1]) not in on_two_ranks
        if (recipe, name) in DISTRIBUTED and _trains_the_router_term(name) and first:
            on_two_ranks.add((recipe, name.split("/")[1]))
            two.append(_run(root, recipe, name))
        else:
            one.append(_run(root, recipe, name))
    return one, two


@pytest.fixture(scope="module")
def single_device_runs(run_once) -> Path:
    """Every single-device config's run's folder's parent."""
    return family_runs(run_once, "sweep")


@pytest.fixture(scope="module")
def distributed_runs(run_once) -> Path:
    """Every distributed config's run's folder's parent (one rank, or 2: planned_runs)."""
    return family_runs(run_once, "sweep")


# --- fast: the list and the adaptation, in-process --------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sweep_lists_every_config_of_the_family(family: str) -> None:
    """A config added to configs/<family>/ is swept, once (else the registry misses it)."""
    files = {
        f"configs/{family}/{path.stem}" for path in (REPO_ROOT / "configs" / family).glob("*.yaml")
    }
    swept = [name for _, name in SWEEP if name.startswith(f"configs/{family}/")]
    assert sorted(swept) == sorted(files)


def test_both_launches_have_runs() -> None:
    assert SINGLE_DEVICE and DISTRIBUTED
    assert len(SINGLE_DEVICE) + len(DISTRIBUTED) == len(SWEEP) == len(set(SWEEP))


# The tiny model's sizes (stock_configs.tiny_model): every other builder argument is the sized
# builder's.
SIZE_ARGUMENTS = {
    "vocab_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "embed_dim",
    "intermediate_dim",
    "max_seq_len",
    "head_dim",
    "query_pre_attn_scalar",  # Gemma 3: its head_dim, as released at 1B and 4B
    "sliding_window",  # Gemma 3: shorter than the sequences
    "sliding_window_pattern",  # Gemma 3: a local and a global layer among the tiny ones
    "num_experts",  # Qwen3 MoE: a few narrow experts
    "num_experts_per_tok",
    "moe_intermediate_dim",
}


def _family_builder(stock_model: DictConfig) -> str:
    """The component builder a sized builder of exactga's families calls: ``lora_qwen3`` for
    ``qlora_qwen3_8b``, ``gemma3`` for ``gemma3_4b``."""
    module, sized = stock_model._component_.rsplit(".", 1)
    family = module.rsplit(".", 1)[1]
    return f"{module}.lora_{family}" if "lora_" in sized else f"{module}.{family}"


def _plain(value: object) -> object:
    """A sequence as a list: a builder's tuple (Qwen3 MoE's ``mlp_only_layers``) is a list in
    YAML."""
    return list(value) if isinstance(value, (tuple, list)) else value


def _check_tiny_model(model: DictConfig, stock_model: DictConfig, rows: int, what: str) -> None:
    """``model`` is the family's component builder with the sized builder's arguments but the
    sizes, and builds; Gemma 3's and gpt-oss's have a local and a global layer, the window shorter
    than the ``rows`` tokens of a sequence."""
    assert model._component_ == _family_builder(stock_model), what
    _, arguments = stock_configs.stock_component_call(stock_model)
    tiny = OmegaConf.to_container(model, resolve=True)
    assert tiny.keys() - {"_component_"} == arguments.keys(), what
    for key in arguments.keys() - SIZE_ARGUMENTS:
        assert _plain(tiny[key]) == _plain(arguments[key]), f"{what}: {key}"
    assert tiny["num_layers"] == stock_configs.TINY_SIZES["num_layers"], what
    if "sliding_window" in tiny:
        if "sliding_window_pattern" in tiny:
            kinds = gemma3_layer_types(tiny["num_layers"], tiny["sliding_window_pattern"])
        else:  # gpt-oss: the builder's default, layers alternating
            kinds = gpt_oss_layer_types(tiny["num_layers"])
        assert set(kinds) == {LOCAL_LAYER, GLOBAL_LAYER}, f"{what}: {kinds}"
        assert tiny["sliding_window"] < rows, what
    with torch.device("cpu"):
        config.instantiate(model)


@pytest.mark.parametrize("recipe, name", _params(SWEEP))
def test_every_config_adapts(recipe: str, name: str, tmp_path: Path) -> None:
    """Tiny models of the family (student, teacher), seeded checkpoints of the config's
    model_type, CPU, one step, every other key as shipped; no path outside the run's folder."""
    stock = stock_configs.stock_config(name)
    cfg = adapted(recipe, name, tmp_path)
    assert cfg.device == "cpu" and cfg.epochs == 1
    assert cfg.max_steps_per_epoch == STEPS
    if recipe not in DPO_RECIPES + (GRPO,):  # the slice holds twice what a run reads
        ranks = 2 if (recipe, name) in DISTRIBUTED and _trains_the_router_term(name) else 1
        read = STEPS * cfg.batch_size * cfg.gradient_accumulation_steps * ranks
        assert cfg.dataset.split == f"train[:{DATA_ROWS}]" and 2 * read <= DATA_ROWS, read
    rows = cfg.tokenizer.max_seq_len
    _check_tiny_model(cfg.model, stock.model, rows, "model")
    for key in stock_configs.LORA_KEYS:
        if key in stock.model:
            assert cfg.model[key] == stock.model[key], key
    assert cfg.model.get("quantize_base", False) == (".qlora_" in stock.model._component_)
    if "teacher_model" in stock:
        _check_tiny_model(cfg.teacher_model, stock.teacher_model, rows, "teacher_model")
    for checkpointer in ("checkpointer", "teacher_checkpointer", "ref_checkpointer"):
        if checkpointer in stock:
            assert cfg[checkpointer]._component_.endswith(".initialized_hf_checkpointer")
            assert cfg[checkpointer].model_type == stock[checkpointer].model_type, checkpointer
    ours, shipped = OmegaConf.to_container(cfg), OmegaConf.to_container(stock)
    assert ours.keys() == shipped.keys()
    kept = shipped.keys() - ADAPTED_KEYS | ({"dataset"} if recipe == GRPO else set())
    for key in kept:
        assert ours[key] == shipped[key], key
    outside = set(stock_configs._paths_outside(cfg, tmp_path)) - {str(PAIRS)}
    assert not outside, f"paths left outside output_dir: {outside}"


# --- slow: the two groups ---------------------------------------------------------------------


def _check_run(root: Path, recipe: str, name: str) -> None:
    """Exit status 0, a finite loss logged at the step, the epoch's artefacts on disk (for
    LoRA the adapters, in PEFT's format too in epoch_0/adapter/), every saved weight finite."""
    out = _out(root, same_run_as(recipe, name))
    output = (out / "output.txt").read_text()
    first_error = stock_configs.first_error_line(output)
    assert (out / "returncode").read_text() == "0", f"{first_error}\n{output[-4000:]}"
    losses = stock_configs.logged_losses(out)
    assert len(losses) == STEPS, losses
    assert stock_configs.all_finite(losses), losses
    if recipe.startswith("knowledge_distillation"):  # both parts of the loss, logged
        assert {"class_loss", "kd_loss"} <= read_scalars(out / "logs").keys()
    cfg = OmegaConf.load(out / "config.yaml")
    if cfg.get("router_aux_loss_coef", 0) > 0:  # Qwen3 MoE: the router's balance term, trained
        balance = read_scalars(out / "logs")["router/balance_loss"]
        assert len(balance) == STEPS, balance
        assert stock_configs.all_finite(balance) and min(balance) > 0, balance
    missing = [f for f in stock_configs.expected_artefacts(cfg) if not (out / f).is_file()]
    assert not missing, f"no {missing} in {out}"
    not_finite = stock_configs.weight_files_not_finite(out, cfg)
    assert not not_finite, f"values not finite in {not_finite} of {out}"


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("recipe, name", _params(SINGLE_DEVICE))
def test_single_device_config_runs(single_device_runs: Path, recipe: str, name: str) -> None:
    _check_run(single_device_runs, recipe, name)


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("recipe, name", _params(DISTRIBUTED))
def test_distributed_config_runs(distributed_runs: Path, recipe: str, name: str) -> None:
    _check_run(distributed_runs, recipe, name)
