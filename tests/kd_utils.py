"""Launch helpers shared by the two KD recipe test modules (tests/test_recipe_kd_*.py).

The parity runs of one rank are launched once per session (``run_once``) and read by both
modules: the distributed module compares its 2-rank runs with the 1-rank 8x1 runs made here.
Nothing here imports a recipe.
"""

from __future__ import annotations

from pathlib import Path

import torch
from many_runs import launch_runs, run_of
from omegaconf import OmegaConf
from recipe_utils import REPO_ROOT, SMALL_MODEL, output_of, run_tune
from torchtune import config

KD_RECIPE = "recipes/knowledge_distillation_single_device.py"
KD_DISTRIBUTED_RECIPE = "recipes/knowledge_distillation_distributed.py"
KD_TINY_CONFIG = "configs/tiny/kd_single_device.yaml"
KD_DISTRIBUTED_CONFIG = "configs/tiny/kd_distributed.yaml"

ADAPTERS = "epoch_0/adapter_model.pt"
PEFT_ADAPTERS = "epoch_0/adapter/adapter_model.safetensors"
ADAPTER_CONFIG = "epoch_0/adapter/adapter_config.json"
MERGED = "epoch_0/model-00001-of-00001.safetensors"
BASE = "base_model/model.safetensors"

# The student shrunk as the SFT tests shrink it, and a teacher twice as wide.
SMALL_TEACHER = {
    "teacher_model.num_layers": 2,
    "teacher_model.embed_dim": 128,
    "teacher_model.num_heads": 4,
    "teacher_model.num_kv_heads": 2,
    "teacher_model.intermediate_dim": 256,
}

PARITY_STEPS = 12
# Two cases, each trained as 8x1, 1x8 and 2x4 (and 4x1x2, 1x4x2 on two ranks):
# - fp64, SGD, prompts masked: the plain CE and forward-KL losses (the chunked ones upcast to
#   fp32 only). Measured 1.1e-8 (1x8) and 2.7e-8 (2x4); the bound is the 1e-7.
# - fp32, AdamW with the cosine schedule, train_on_input (first labels live, where stock's count
#   before the shift is wrong): measured 2.6e-7 (1x8) and 2.6e-7 (2x4); the bound is 2e-6.
#   Its 8x1 run writes a step checkpoint every step: the kill -9 resume test's reference.
CASES = {
    "fp64_masked": (
        [
            "dtype=fp64",
            "loss._component_=torch.nn.CrossEntropyLoss",
            "kd_loss._component_=torchtune.modules.loss.ForwardKLLoss",
            "optimizer._component_=torch.optim.SGD",
            "optimizer.lr=0.5",
            "~optimizer.weight_decay",
            "dataset.train_on_input=False",
        ],
        1e-7,
    ),
    "fp32_train_on_input": (
        [
            "optimizer.lr=3e-3",
            "dataset.train_on_input=True",
            "lr_scheduler.num_warmup_steps=2",
            "save_every_n_steps=1",
        ],
        2e-6,
    ),
}


def kd_args(
    output_dir: Path | str,
    *,
    recipe: str = KD_RECIPE,
    config: str = KD_TINY_CONFIG,
    nproc: int = 1,
    **overrides: object,
) -> list[str]:
    """``tune run`` arguments: the recipe, its tiny config, the small student and teacher,
    ``output_dir``, then ``overrides`` (config keys, ``.`` written as ``__``)."""
    merged: dict[str, object] = {**SMALL_MODEL, **SMALL_TEACHER, "output_dir": str(output_dir)}
    merged.update({key.replace("__", "."): value for key, value in overrides.items()})
    head = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    return [*head, recipe, "--config", config, *(f"{k}={v}" for k, v in merged.items())]


def parity_args(
    output_dir: Path | str, case: str, batch_size: int, ga: int, **kwargs: object
) -> list[str]:
    """:func:`kd_args` for a parity run of ``case``: PARITY_STEPS steps, no clipping."""
    settings: dict[str, object] = {
        "batch_size": batch_size,
        "gradient_accumulation_steps": ga,
        "max_steps_per_epoch": PARITY_STEPS,
        "clip_grad_norm": "null",
        **kwargs,
    }
    return kd_args(output_dir, **settings) + CASES[case][0]


def train(args: list[str], extra: list[str] | None = None) -> None:
    """Launch and check the exit status."""
    proc = run_tune(args + (extra or []), timeout=600)
    assert proc.returncode == 0, output_of(proc)[-4000:]


def one_rank_run(run_once, case: str, split: tuple[int, int]) -> Path:
    """The one-device run of ``case`` with ``split`` (batch size, ga). Every case under every
    split of ``ONE_DEVICE_SPLITS`` is made once per session, on first use, one after another in
    one launch (tests/many_runs.py: each still the recipe as ``tune run`` starts it)."""
    batch_size, ga = split
    assert split in ONE_DEVICE_SPLITS, split
    out = run_once("kd_one_device_runs", _one_device_runs) / f"{case}_{batch_size}x{ga}"
    output = (out / "output.txt").read_text()
    assert (out / "returncode").read_text() == "0", output[-4000:]
    return out


ONE_DEVICE_SPLITS = [(8, 1), (1, 8), (2, 4)]


def _one_device_runs(root: Path) -> None:
    runs = []
    for case in CASES:
        for batch_size, ga in ONE_DEVICE_SPLITS:
            out = root / f"{case}_{batch_size}x{ga}"
            nproc, run = run_of(parity_args(out, case, batch_size, ga), out)
            assert nproc == 0
            runs.append(run)
    launch_runs(runs, nproc=0)


def initial_adapters(case: str) -> dict[str, torch.Tensor]:
    """The adapters every run of ``case`` starts from, drawn in-process by the library call the
    recipes make (``exactga.setup.lora.initialize_adapters`` from the config's ``seed``) on the
    small student built on the meta device: no launch. The LoRA tests check that a launch draws
    them."""
    from exactga.setup.lora import initialize_adapters

    cfg = OmegaConf.load(REPO_ROOT / KD_TINY_CONFIG)
    for key, value in SMALL_MODEL.items():
        OmegaConf.update(cfg, key, value)
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    dtype = torch.float64 if "dtype=fp64" in CASES[case][0] else torch.float32
    drawn: dict[str, torch.Tensor] = {}
    initialize_adapters(model, dtype=dtype, seed=cfg.seed, load=lambda _, sd: drawn.update(sd))
    return drawn
