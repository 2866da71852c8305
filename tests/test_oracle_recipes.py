"""Every training recipe's first step through ``tune run`` against the full-batch reference of
tests/oracle_utils.py (plain PyTorch, fp64, knows nothing of exactga).

Each recipe trains one SGD step (no momentum, no weight decay, no clipping, no warm-up) over a
global batch of the first 16 rows of the bundled data, which is the whole dataset here
(``dataset.split=train[:16]``), so the step covers every row whatever order the loader draws
them in. Before the launch the test writes the initial checkpoints itself (the recipes read an
existing one), computes the reference gradient on them with torchtune's own model, tokenizer,
dataset and checkpoint loader, and passes the learning rate that moves the weights by their own
norm; after it (all six recipes, each run forked from the tests' server, tests/many_runs.py), the
trained weights (full)
or adapters (LoRA, distillation) must be ``w - lr * g`` of that gradient. Splits, micro-batching
modes and gradient-sync policies differ across the six recipes. The in-process twin, with the
variants that must fail, is tests/test_oracle.py.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from kd_utils import SMALL_TEACHER  # the student's sizes, twice as wide
from many_runs import Run, launch_runs
from omegaconf import DictConfig, OmegaConf
from oracle_utils import flat, lr_for_unit_update, reference_gradient, step_gap, trainable
from recipe_utils import REPO_ROOT, SMALL_MODEL, load_adapters
from tiny_runs import recipe_script
from torchtune import config
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.training import FullModelHFCheckpointer

from exactga.lora.adapters import initialize_adapters
from exactga.models.random_init_checkpointer import write_initial_checkpoint

pytestmark = pytest.mark.slow

# fp32 launches against the fp64 reference, with an update as large as the trained weights:
# measured 1.1e-7 to 2.7e-7 in-process (tests/test_oracle.py); a loss 1% off gives 1e-2.
ORACLE_BOUND = 2e-6
NUM_ROWS = 16

# recipe -> (config, ranks, batch_size, gradient_accumulation_steps, other overrides)
RECIPES: dict[str, tuple[str, int, int, int, dict[str, Any]]] = {
    "full_finetune_single_device": ("full_single_device", 1, 4, 4, {"micro_batching": "by_length"}),
    "full_finetune_distributed": (
        "full_distributed",
        2,
        2,
        4,
        {"micro_batching": "token_budget", "micro_batch_tokens": 256},
    ),
    "lora_finetune_single_device": ("lora_single_device", 1, 2, 8, {"micro_batching": "fixed"}),
    "lora_finetune_distributed": (
        "lora_distributed",
        2,
        2,
        4,
        {"micro_batching": "by_length", "gradient_sync": "once_per_window"},
    ),
    "knowledge_distillation_single_device": (
        "kd_single_device",
        1,
        4,
        4,
        {"micro_batching": "token_budget", "micro_batch_tokens": 256},
    ),
    "knowledge_distillation_distributed": (
        "kd_distributed",
        2,
        2,
        4,
        {"micro_batching": "fixed", "gradient_sync": "every_micro_batch"},
    ),
}


def recipe_config(recipe: str, output_dir: Path) -> tuple[DictConfig, dict[str, Any]]:
    """The recipe's tiny config with the test's overrides, and those overrides."""
    config_name, _, batch_size, ga, extra = RECIPES[recipe]
    overrides: dict[str, Any] = {
        **SMALL_MODEL,
        **(SMALL_TEACHER if "knowledge" in recipe else {}),
        "output_dir": str(output_dir),
        "tokenizer.path": str(REPO_ROOT / "configs/tiny/tokenizer.model"),
        "dataset.data_files": str(REPO_ROOT / "configs/tiny/data.json"),
        "dataset.split": f"train[:{NUM_ROWS}]",
        "batch_size": batch_size,
        "gradient_accumulation_steps": ga,
        "max_steps_per_epoch": 1,
        "epochs": 1,
        "clip_grad_norm": None,
        "lr_scheduler.num_warmup_steps": 0,
        "optimizer._component_": "torch.optim.SGD",
        **extra,
    }
    cfg = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / f"{config_name}.yaml")
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    del cfg.optimizer.weight_decay
    return cfg, overrides


def write_initial_checkpoints(cfg: DictConfig) -> None:
    """What the recipes' checkpointer writes on first use, written first so that the reference
    can be computed before the launch; the launch reads them."""
    sections = ["checkpointer"] + (
        ["teacher_checkpointer"] if "teacher_checkpointer" in cfg else []
    )
    for section in sections:
        ckpt = cfg[section]
        write_initial_checkpoint(
            ckpt.model, Path(ckpt.checkpoint_dir), ckpt.checkpoint_files[0], ckpt.init_seed
        )


def load_hf(checkpoint_dir: Path | str, file_name: str, output_dir: Path) -> dict[str, Any]:
    """torchtune's own reading of a Hugging Face checkpoint (its keys and layout)."""
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(checkpoint_dir),
        checkpoint_files=[file_name],
        model_type="LLAMA3_2",
        output_dir=str(output_dir / "unused"),
    )
    return checkpointer.load_checkpoint()["model"]


def build_fp32(model_cfg: DictConfig, state: dict[str, Any]) -> torch.nn.Module:
    model = config.instantiate(model_cfg).float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("lora_" in key for key in missing), missing
    return model


def reference_case(cfg: DictConfig, output_dir: Path):
    """The student at its initial weights (adapters drawn as the recipes draw them, from the
    config's seed), the frozen teacher if any, and the rows, tokenized by torchtune."""
    ckpt = cfg.checkpointer
    student = build_fp32(cfg.model, load_hf(ckpt.checkpoint_dir, "model.safetensors", output_dir))
    if "lora_rank" in cfg.model:
        load = partial(torch.nn.Module.load_state_dict, strict=False)
        initialize_adapters(student, dtype=torch.float32, seed=cfg.seed, load=load)
        set_trainable_params(student, get_adapter_params(student))
    teacher = None
    if "teacher_model" in cfg:
        t_ckpt = cfg.teacher_checkpointer
        teacher = build_fp32(
            cfg.teacher_model, load_hf(t_ckpt.checkpoint_dir, "model.safetensors", output_dir)
        )
        teacher.requires_grad_(False)
    tokenizer = config.instantiate(cfg.tokenizer)
    dataset = config.instantiate(cfg.dataset, tokenizer)
    assert len(dataset) == NUM_ROWS
    rows = [(torch.tensor(sample["tokens"]), torch.tensor(sample["labels"])) for sample in dataset]
    return student, teacher, rows


def trained_weights(recipe: str, student: torch.nn.Module, output_dir: Path) -> torch.Tensor:
    """What the launch trained, in the order of the reference's trainable parameters."""
    names = [name for name, p in student.named_parameters() if p.requires_grad]
    if "full" in recipe:
        state = load_hf(output_dir / "epoch_0", "model-00001-of-00001.safetensors", output_dir)
    else:
        state = load_adapters(output_dir / "epoch_0" / "adapter_model.pt")
    return flat([state[name] for name in names])


def _prepare(recipe: str, output_dir: Path) -> dict[str, Any]:
    """The recipe's initial checkpoints, written; its reference step; and its launch."""
    cfg, overrides = recipe_config(recipe, output_dir)
    write_initial_checkpoints(cfg)
    student, teacher, rows = reference_case(cfg, output_dir)
    initial = flat(trainable(student))
    kd_ratio = float(cfg.kd_ratio) if teacher is not None else 0.0
    gradient = reference_gradient(student, rows, teacher, kd_ratio)
    lr = lr_for_unit_update(initial, gradient)
    config_file = REPO_ROOT / "configs" / "tiny" / f"{RECIPES[recipe][0]}.yaml"
    args = [f"{key}={'null' if value is None else value}" for key, value in overrides.items()]
    args += [f"optimizer.lr={lr!r}", "~optimizer.weight_decay"]
    run = Run(recipe_script(recipe), ["--config", str(config_file), *args], output_dir)
    return {"student": student, "initial": initial, "gradient": gradient, "lr": lr, "run": run}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every recipe's reference and its finished run: the one-rank recipes one after another,
    the 2-rank ones one after another (tests/many_runs.py; each run still the recipe as
    ``tune run`` starts it)."""
    root = tmp_path_factory.mktemp("oracle_recipes")
    cases = {recipe: _prepare(recipe, root / recipe) for recipe in RECIPES}
    for ranks in sorted({spec[1] for spec in RECIPES.values()}):
        runs = [cases[r]["run"] for r in RECIPES if RECIPES[r][1] == ranks]
        launch_runs(runs, nproc=0 if ranks == 1 else ranks)
    return cases


@pytest.mark.xdist_group("oracle_recipes")
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_recipes_first_step_is_the_full_batch_step(launched, recipe: str) -> None:
    case = launched[recipe]
    out = case["run"].folder
    assert (out / "returncode").read_text() == "0", (out / "output.txt").read_text()[-4000:]
    trained = trained_weights(recipe, case["student"], out)
    gap = step_gap(trained, case["initial"], case["gradient"], case["lr"])
    print(f"{recipe}: relative L2 to the reference step {gap:.2e} (lr {case['lr']:.3g})")
    assert gap <= ORACLE_BOUND
