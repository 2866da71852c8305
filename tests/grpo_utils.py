"""Launch arguments and readers shared by the GRPO recipe tests (nothing here is a test).

Every run is the tiny GRPO config (configs/tiny/grpo_distributed.yaml) shrunk to
``SMALL_MODEL`` for 2 optimizer steps on one global batch of 4 prompts x 4 completions. A
randomly initialised model rarely samples its end-of-sequence token, so the runs stop a
completion at any of ``STOP_TOKENS`` (an eighth of the vocabulary): completions then end after
1 to 8 tokens, and the three ``loss_aggregation`` denominators differ.
"""

from __future__ import annotations

from pathlib import Path

import torch
from recipe_utils import SMALL_MODEL, load_weights

RECIPE = "recipes/grpo_full_finetune_distributed.py"
CONFIG = "configs/tiny/grpo_distributed.yaml"
GLOBAL_PROMPTS = 4
GRPO_SAMPLES = 4
STOP_TOKENS = list(range(3, 2048, 8))

COMMON: dict[str, object] = {
    **SMALL_MODEL,
    "grpo_samples": GRPO_SAMPLES,
    "max_generated_tokens": 8,
    "stop_token_ids": "[" + ",".join(str(t) for t in STOP_TOKENS) + "]",
    "log_every_n_steps": 1,
    # Plain gradient descent: AdamW turns fp32 rounding of near-zero gradients into lr-sized
    # steps (see tests/dpo_utils.py), so SGD measures the normalisation.
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "optimizer.weight_decay": 0.0,
    "clip_grad_norm": "null",
    "loss.kl_coeff": 0.1,
    # A dense reward (tests/grpo_rewards.py), so the first step has advantages to learn from.
    "rewards": "[{_component_: grpo_rewards.VowelShare}]",
}

# The splits of one global batch of GLOBAL_PROMPTS prompts: (ranks, overrides).
SPLITS: dict[str, tuple[int, dict[str, object]]] = {
    "1rank_ga1": (0, {"batch_size": GLOBAL_PROMPTS, "gradient_accumulation_steps": 1}),
    "1rank_ga4": (0, {"batch_size": GLOBAL_PROMPTS, "gradient_accumulation_steps": 4}),
    "2ranks_ga2": (2, {"batch_size": GLOBAL_PROMPTS // 2, "gradient_accumulation_steps": 2}),
}


def grpo_args(output_dir: Path, **overrides: object) -> list[str]:
    """Config arguments (no launcher): the tiny GRPO config, :data:`COMMON`, ``output_dir``,
    then ``overrides`` (``.`` written as ``__``)."""
    merged = {**COMMON, "output_dir": str(output_dir)}
    merged.update({key.replace("__", "."): value for key, value in overrides.items()})
    return ["--config", CONFIG, *(f"{k}={v}" for k, v in merged.items())]


def initial_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_weights(output_dir / "base_model" / "model.safetensors")


def trained_weights(output_dir: Path, epoch: int = 0) -> dict[str, torch.Tensor]:
    return load_weights(output_dir / f"epoch_{epoch}" / "model-00001-of-00001.safetensors")
