"""The keys of the PPO recipe, with their one default and their checks (see
exactga.config.schemas).

torchtune 0.6.1's ``recipes/ppo_full_finetune_single_device.py`` reads the single-device full
fine-tuning keys minus ``model``, ``epochs`` and ``max_steps_per_epoch``, plus ``policy_model``,
``reward_and_value_model``, the ``ref_policy_checkpointer``, ``value_checkpointer`` and
``reward_checkpointer``, and the RLHF keys below, with ``loss`` its ``PPOLoss`` (``epsilon``,
``value_clip_range``, ``value_coeff``). This recipe reads the same keys, so stock's configs run
unchanged. Like exactga.config.schemas, this module imports only bottom modules
(``tests/test_architecture.py``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig

from exactga.config.options import MicroBatching, NormMode
from exactga.config.schemas import FullFinetuneSingleDeviceConfig

# A resume with another reward, sampler, advantage or loss is refused like one with another
# model; see [what a resume may change] in exactga.run.resume.
PPO_FINGERPRINT_KEYS = (
    "loss",
    "policy_model",
    "reward_and_value_model",
    "ref_policy_checkpointer",
    "reward_checkpointer",
    "batch_size",
    "ppo_batch_size",
    "ppo_epochs",
    "forward_batch_size",
    "max_generated_tokens",
    "temperature",
    "top_k",
    "stop_token_ids",
    "kl_coeff",
    "gamma",
    "lmbda",
    "whiten_rewards",
    "min_response_length",
    "penalise_no_eos",
    "reward_penalty",
)

# The PPO loss's settings and their defaults (torchtune's ``rlhf.loss.PPOLoss``).
LOSS_DEFAULTS = {"epsilon": 0.1, "value_clip_range": 0.2, "value_coeff": 0.1}


@dataclass
class PpoFullFinetuneSingleDeviceConfig(FullFinetuneSingleDeviceConfig):
    """``ppo_full_finetune_single_device``. ``batch_size`` prompts make one step's trajectories;
    each PPO epoch over them takes ``batch_size / ppo_batch_size`` optimizer steps, each over a
    PPO batch of ``ppo_batch_size`` trajectories in ``gradient_accumulation_steps``
    micro-batches."""

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema

    model: Any = None  # not read: stock's PPO names its models policy_model and the one below
    policy_model: Any = MISSING
    reward_and_value_model: Any = MISSING  # a classifier with num_classes: 1
    ref_policy_checkpointer: Any = MISSING
    value_checkpointer: Any = MISSING
    reward_checkpointer: Any = MISSING
    # The run's length, in trajectories (stock: num_steps // batch_size trajectory steps); the
    # epochs over the prompts follow from it, so ``epochs`` is not read.
    num_steps: int = MISSING
    epochs: int | None = None  # not read: derived from num_steps, as stock
    ppo_epochs: int = 1
    ppo_batch_size: int = MISSING  # trajectories per optimizer step
    forward_batch_size: int = MISSING  # trajectories per no-grad forward of the four models
    enable_kv_cache: bool = True  # stock's key; generation always runs with a KV cache here
    # Generation (torchtune's generate)
    max_generated_tokens: int = MISSING
    temperature: float = 1.0
    top_k: int | None = None
    stop_token_ids: list[int] | None = None  # default: the tokenizer's stop tokens
    # Reward shaping, as stock: a penalty score for short responses or ones without a stop token
    min_response_length: int | None = None
    penalise_no_eos: bool = False
    reward_penalty: float = -3.0
    whiten_rewards: bool = False  # stock reads it and ignores it; here it whitens the rewards
    # GAE and the KL penalty
    gamma: float = 1.0
    lmbda: float = 0.95
    kl_coeff: float = 0.01

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        check_ppo_keys(cfg)
        super().check_flags(cfg)


def check_ppo_keys(cfg: DictConfig) -> None:
    """The PPO recipe's keys' own checks (stock's, and the splits a step's trajectories allow),
    naming the key at fault.

    Raises:
        ValueError: a batch size that does not divide another, a run shorter than one step, a
            loss with settings it does not take, a token baseline or packed micro-batches.
    """
    for key in ("batch_size", "ppo_batch_size", "forward_batch_size", "ppo_epochs"):
        if cfg[key] < 1:
            raise ValueError(f"config key '{key}' must be at least 1.")
    if cfg.max_generated_tokens < 1:
        raise ValueError("config key 'max_generated_tokens' must be at least 1.")
    if cfg.temperature <= 0:
        raise ValueError(f"config key 'temperature'={cfg.temperature}: must be positive.")
    for key in ("forward_batch_size", "ppo_batch_size"):
        if cfg.batch_size % cfg[key]:
            raise ValueError(
                f"config keys 'batch_size' and '{key}': batch_size ({cfg.batch_size}) must be "
                f"exactly divisible by {key} ({cfg[key]})."
            )
    ga = cfg.gradient_accumulation_steps
    if cfg.micro_batching is not MicroBatching.TOKEN_BUDGET and cfg.ppo_batch_size % ga:
        raise ValueError(
            f"config keys 'ppo_batch_size' and 'gradient_accumulation_steps': ppo_batch_size "
            f"({cfg.ppo_batch_size}) must split into {ga} equal micro-batches; choose a divisor."
        )
    if cfg.num_steps < cfg.batch_size:
        raise ValueError(
            f"config key 'num_steps'={cfg.num_steps}: the run's trajectories, at least one "
            f"step's batch_size ({cfg.batch_size})."
        )
    if cfg.micro_batching is MicroBatching.PACKED:
        raise ValueError(
            "config key 'micro_batching': packed is for the fine-tuning, distillation and DPO "
            "recipes; PPO's trajectories are cut by fixed, by_length or token_budget."
        )
    if cfg.loss_normalization is NormMode.POST_SCALE:
        raise ValueError(
            "config key 'loss_normalization': post_scale is stock fine-tuning's token weighting; "
            "for PPO choose exact (default) or naive (stock PPO: each micro-batch's own means "
            "over gradient_accumulation_steps)."
        )
    if not cfg.enable_kv_cache and int(os.environ.get("RANK", "0")) == 0:
        warnings.warn(
            "config key 'enable_kv_cache' is ignored: generation always runs with a KV cache "
            "here (exactga.generation.sampling), which changes no number.",
            stacklevel=2,
        )
    loss = cfg.loss if isinstance(cfg.loss, DictConfig) else {}
    unknown = sorted(set(loss) - {"_component_", *LOSS_DEFAULTS})
    if unknown:
        raise ValueError(
            f"config key 'loss.{unknown[0]}': the PPO loss takes epsilon, value_clip_range and "
            "value_coeff only (exactga.ppo.loss computes it; see docs/ppo.md)."
        )


def loss_settings(settings: PpoFullFinetuneSingleDeviceConfig) -> dict[str, float]:
    """``epsilon``, ``value_clip_range`` and ``value_coeff`` of the typed settings' ``loss``
    section (stock's ``PPOLoss``), its defaults filled in."""
    loss = settings.loss if isinstance(settings.loss, DictConfig) else {}
    return {key: float(loss.get(key, default)) for key, default in LOSS_DEFAULTS.items()}
