"""Launch arguments and readers shared by the DPO recipe tests (nothing here is a test).

Every run trains the small tiny model (``SMALL_MODEL``) on the first ``NUM_PAIRS`` pairs of the
shipped preference data (configs/tiny/preference_data.json: 29-512 tokens a sequence), so a
window of 8 pairs pads heavily unless regrouped, and an epoch ends on a partial window.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf
from recipe_utils import REPO_ROOT, SMALL_MODEL, load_adapters, load_weights, output_of, run_recipe
from torchtune import config

LORA_SINGLE = ("recipes/lora_dpo.py", "configs/tiny/lora_dpo_single_device.yaml")
LORA_DISTRIBUTED = ("recipes/lora_dpo.py", "configs/tiny/lora_dpo_distributed.yaml")
FULL_DISTRIBUTED = ("recipes/full_dpo_distributed.py", "configs/tiny/full_dpo_distributed.yaml")

# Two windows of 8 pairs and a partial one of 4 in each epoch (splits of batch size 1, 2, 4).
NUM_PAIRS = 20
# The shape of every run: no warm-up (the first step moves the weights already).
COMMON: dict[str, object] = {
    **SMALL_MODEL,
    "dataset.split": f"train[:{NUM_PAIRS}]",
    "max_steps_per_epoch": "null",
    "lr_scheduler.num_warmup_steps": 0,
    "saved_latency_every_n_steps": 0,
}
# Plain gradient descent for the LoRA splits, with an lr that moves the adapters ~10% of their
# norm in 6 steps: lora_b starts at zero, where AdamW turns fp32 rounding into lr-sized steps of
# the elements whose gradient nearly cancels (the tiny config's AdamW measured 1.8e-5 between 1x8
# and 2x4 after 3 steps; SGD 5e-7), so SGD measures the normalisation, not that amplification.
LORA_OPTIMIZER: dict[str, object] = {
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "optimizer.weight_decay": 0.0,
}
# Full DPO's splits with SGD too: AdamW's rounding amplification left 2 ranks 8.3e-6 to 8.5e-6
# from 1 rank (lr 2e-4), too near the 1e-5 bound to hold on every CPU; SGD lands at 3.4e-6
# whether the weights move 3% (lr 0.5) or 12% (lr 2.0) of their norm, so that is fp32's floor here.
FULL_OPTIMIZER: dict[str, object] = {
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "optimizer.weight_decay": 0.0,
}

# The single-device LoRA runs: the splits of one global batch of 8 pairs.
LORA_SPLITS: dict[str, dict[str, object]] = {
    "1x8": {"batch_size": 1, "gradient_accumulation_steps": 8},
    "2x4": {"batch_size": 2, "gradient_accumulation_steps": 4},
    # 2 x 512 positions: one long pair alone, or several short ones, per micro-batch.
    "4x2_budget": {
        "batch_size": 4,
        "gradient_accumulation_steps": 2,
        "micro_batching": "token_budget",
        "micro_batch_tokens": 1024,
    },
    # Whole pairs, both sides as two documents, packed into rows of 1024 positions (a pair is
    # up to 2 x 512: the model takes rows that long; its weights do not depend on it).
    "4x2_packed": {
        "batch_size": 4,
        "gradient_accumulation_steps": 2,
        "micro_batching": "packed",
        "micro_batch_tokens": 1024,
        "model__max_seq_len": 1024,
    },
    "8x1": {"batch_size": 8, "gradient_accumulation_steps": 1},
    "1x8_drop": {"batch_size": 1, "gradient_accumulation_steps": 8, "drop_partial_window": True},
    # Reference log-probs computed before training and looked up, as 2x4 splits the window.
    "2x4_precomputed": {
        "batch_size": 2,
        "gradient_accumulation_steps": 4,
        "precompute_reference_logprobs": True,
    },
}


# Full DPO across ranks (tests/test_recipe_dpo_distributed.py): (ranks, split). One rank is the
# distributed recipe without torchrun (it trains as one rank: a process group of one).
FULL_PAIRS = 24  # three whole windows of 8: every split steps on the same pairs
BUDGET = {"micro_batching": "token_budget", "micro_batch_tokens": 1024}
FULL_SPLITS: dict[str, tuple[int, dict[str, object]]] = {
    "1rank_8x1": (1, {"batch_size": 8, "gradient_accumulation_steps": 1}),
    "2ranks_4x1_budget": (2, {"batch_size": 4, "gradient_accumulation_steps": 1, **BUDGET}),
    "2ranks_1x4": (2, {"batch_size": 1, "gradient_accumulation_steps": 4}),
    # The reference's log-probs computed by both ranks before training, the model then freed.
    "2ranks_1x4_precomputed": (
        2,
        {"batch_size": 1, "gradient_accumulation_steps": 4, "precompute_reference_logprobs": True},
    ),
}
# LoRA DPO on 2 ranks, 2x2 under the token budget, against the single-device 1x8 run.
LORA_TWO_RANKS = "2ranks_2x2_budget"


# Validation during training (docs/validation.md) in every run of the DPO recipe modules: at
# each epoch's end, on the training pairs' first 6 (2 batches of 3, whatever the run's split or
# number of ranks). Every split and rank count must report the same figures; validating
# changes nothing in the training, so the parity bounds stay.
VALIDATED: dict[str, object] = {
    "dataset_val": "${dataset}",
    "batch_size_val": 3,
    "max_val_batches": 2,
}
VALIDATION_TAGS = (
    "val/loss",
    "val/rewards/accuracy",
    "val/rewards/margins",
    "val/rewards/chosen",
    "val/rewards/rejected",
)


def _dpo_recipe_runs(root: Path) -> None:
    """Every run of the DPO recipe modules (tests/test_recipe_dpo_lora.py and
    tests/test_recipe_dpo_distributed.py): the single-device LoRA splits and full DPO on one
    rank one after another, the 2-rank runs one after another beside them, each run forked
    from the tests' server (tests/many_runs.py: still the recipe as ``tune run`` starts it). A
    run's folder is its output directory."""
    from concurrent.futures import ThreadPoolExecutor

    from many_runs import launch_runs, run_of

    named = {
        f"lora_{split}": dpo_args(
            LORA_SINGLE, root / f"lora_{split}", epochs=2, **LORA_OPTIMIZER, **VALIDATED, **settings
        )
        for split, settings in LORA_SPLITS.items()
    }
    for split, (nproc, settings) in FULL_SPLITS.items():
        named[f"full_{split}"] = dpo_args(
            FULL_DISTRIBUTED,
            root / f"full_{split}",
            0 if nproc == 1 else nproc,
            dataset__split=f"train[:{FULL_PAIRS}]",
            **FULL_OPTIMIZER,
            **VALIDATED,
            **settings,
        )
    lora_two_ranks = dict(
        epochs=2, batch_size=2, gradient_accumulation_steps=2, **LORA_OPTIMIZER, **VALIDATED
    )
    named[f"lora_{LORA_TWO_RANKS}"] = dpo_args(
        LORA_DISTRIBUTED, root / f"lora_{LORA_TWO_RANKS}", 2, **lora_two_ranks, **BUDGET
    )
    by_ranks: dict[int, list] = {0: [], 2: []}
    for name, args in named.items():
        nproc, run = run_of(args, root / name)
        by_ranks[nproc].append(run)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(launch_runs, runs, nproc, timeout_per_run=600)
            for nproc, runs in sorted(by_ranks.items(), reverse=True)
        ]
        for future in futures:
            future.result()


def dpo_recipe_run(run_once, name: str) -> Path:
    """The folder (output directory, with the run's ``output.txt``) of the DPO recipe run
    ``name``: ``lora_<split>`` (a key of :data:`LORA_SPLITS`, or ``LORA_TWO_RANKS``) or
    ``full_<split>`` (a key of :data:`FULL_SPLITS`), made with every other once per session,
    after checking it succeeded."""
    out = run_once("dpo_recipe_runs", _dpo_recipe_runs) / name
    output = (out / "output.txt").read_text()
    assert (out / "returncode").read_text() == "0", f"{name}:\n{output[-6000:]}"
    return out


def validation_figures(run: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of the validation figures a run logged."""
    from recipe_utils import logged_steps

    return {tag: logged_steps(run / "logs", tag) for tag in VALIDATION_TAGS}


def assert_same_validation(run: Path, reference: Path, rel: float) -> None:
    """``run`` validated at ``reference``'s steps with its figures: the loss and the reward
    means within ``rel`` (or 1e-6 absolute: a margin is near 0), the accuracy, a count, equal."""
    import pytest

    ours, expected = validation_figures(run), validation_figures(reference)
    print(f"{run.name}: {ours['val/loss']}; {reference.name}: {expected['val/loss']}")
    assert expected["val/loss"], f"{reference.name} logged no validation"
    for tag in VALIDATION_TAGS:
        assert list(ours[tag]) == list(expected[tag]), tag
        for step, value in ours[tag].items():
            if tag == "val/rewards/accuracy":
                assert value == expected[tag][step], (tag, step)
            else:
                assert value == pytest.approx(expected[tag][step], rel=rel, abs=1e-6), (tag, step)


def lora_dpo_run(run_once, split: str) -> Path:
    """The two-epoch single-device LoRA DPO run of ``split`` (a key of :data:`LORA_SPLITS`)."""
    return dpo_recipe_run(run_once, f"lora_{split}")


def dpo_args(
    recipe: tuple[str, str], output_dir: Path, nproc: int = 0, **overrides: object
) -> list[str]:
    """``tune run`` arguments: ``nproc`` ranks (0: a single-device recipe), the tiny DPO config,
    :data:`COMMON`, ``output_dir``, then ``overrides`` (``.`` written as ``__``)."""
    merged = {**COMMON, "output_dir": str(output_dir)}
    merged.update({key.replace("__", "."): value for key, value in overrides.items()})
    launcher = ["--nproc_per_node", str(nproc)] if nproc else []
    path, cfg = recipe
    return [*launcher, path, "--config", cfg, *(f"{k}={v}" for k, v in merged.items())]


def train(args: list[str], output_dir: Path) -> None:
    """Launch, fail with the launch's output if it fails, keep that output in ``launch.log``."""
    proc = run_recipe(args, timeout=600)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "launch.log").write_text(output_of(proc))
    assert proc.returncode == 0, output_of(proc)[-6000:]


def trained_adapters(output_dir: Path, epoch: int) -> dict[str, torch.Tensor]:
    """The adapters a LoRA DPO run wrote at the end of ``epoch`` (torchtune's names)."""
    return load_adapters(output_dir / f"epoch_{epoch}" / "adapter_model.pt")


def trained_weights(output_dir: Path, epoch: int) -> dict[str, torch.Tensor]:
    """The full weights a full DPO run wrote at the end of ``epoch``."""
    return load_weights(output_dir / f"epoch_{epoch}" / "model-00001-of-00001.safetensors")


def initial_adapters(config_path: str = LORA_SINGLE[1]) -> dict[str, torch.Tensor]:
    """The adapters every LoRA run of ``config_path`` (default: LoRA DPO's) starts from, drawn
    in-process by the library call the recipes make (``exactga.lora.adapters.initialize_adapters``
    from the config's seed) on the small model built on the meta device: no launch."""
    from exactga.lora.adapters import initialize_adapters

    cfg = OmegaConf.load(REPO_ROOT / config_path)
    for key, value in SMALL_MODEL.items():
        OmegaConf.update(cfg, key, value)
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    drawn: dict[str, torch.Tensor] = {}
    initialize_adapters(
        model, dtype=torch.float32, seed=cfg.seed, load=lambda _, sd: drawn.update(sd)
    )
    return drawn
