"""The keys of the GRPO recipe, with their one default and their checks (see
exactga.config.schemas).

torchtune 0.6.1's ``recipes/dev/grpo_full_finetune_distributed.py`` reads the full distributed
fine-tuning keys plus ``ref_checkpointer``, ``grpo_samples``, ``max_generated_tokens``,
``temperature``, ``top_k``, ``ppo_epochs``, ``num_steps``, ``forward_batch_size``,
``stop_token_ids`` and ``save_every_n_epochs``, with ``loss`` its ``GRPOLoss`` (``epsilon``,
``kl_coeff``). This recipe reads the same keys, plus ``rewards`` (its reward components, where
stock hard-codes one) and ``loss_aggregation``. Like exactga.config.schemas, this module imports
only bottom modules (``tests/test_architecture.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, ListConfig

from exactga.config.options import (
    LossAggregation,
    MicroBatching,
    NormMode,
    RankBalancing,
)
from exactga.config.schemas import (
    FullFinetuneDistributedConfig,
)

# A resume with another reward, sampler or loss is refused like one with another model; see
# [what a resume may change] in exactga.run.resume.
GRPO_FINGERPRINT_KEYS = (
    "loss",
    "ref_checkpointer",
    "rewards",
    "grpo_samples",
    "max_generated_tokens",
    "temperature",
    "top_k",
    "stop_token_ids",
    "ppo_epochs",
    "loss_aggregation",
)

# The policy loss's settings and their defaults (torchtune's dev ``GRPOLoss``).
LOSS_DEFAULTS = {"epsilon": 0.1, "kl_coeff": 0.1}


@dataclass
class RolloutKeys:
    """The keys of a GRPO step's rollouts and policy loss, which the recipe and the GA parity
    report read alike."""

    ref_checkpointer: Any = MISSING
    rewards: Any = MISSING  # a list of reward components (exactga.grpo.rewards)
    grpo_samples: int = MISSING
    max_generated_tokens: int = MISSING
    temperature: float = 1.0
    top_k: int | None = None
    stop_token_ids: list[int] | None = None  # default: the tokenizer's end of sequence
    ppo_epochs: int = 1
    # Rollouts per no-grad forward of the reference and the old policy; default: the training
    # micro-batch (batch_size x grpo_samples / gradient_accumulation_steps).
    forward_batch_size: int | None = None


@dataclass
class GrpoDistributedConfig(FullFinetuneDistributedConfig, RolloutKeys):
    """``grpo_full_finetune_distributed``. ``batch_size`` is prompts per rank per step; each
    step's ``batch_size x grpo_samples`` completions on a rank are cut into
    ``gradient_accumulation_steps`` micro-batches."""

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema

    num_steps: int = MISSING  # rollout steps of the run at most (each is ppo_epochs steps)
    save_every_n_epochs: int | None = None  # stock's key; epoch checkpoints are written always
    # exactga: what the policy loss is a mean over; see [three policy denominators] and
    # docs/grpo.md. token_mean (DAPO), sequence_mean (the GRPO paper), constant (Dr. GRPO).
    loss_aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    # Prompts are dealt as stock deals them: a prompt's rollouts are generated where it lands.
    rank_balancing: RankBalancing = RankBalancing.NONE

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        check_grpo_keys(cfg)
        super().check_flags(cfg)


PACKED_ROLLOUTS = (
    "config key 'micro_batching': packed is for the fine-tuning, distillation and DPO recipes; "
    "GRPO's rollouts are cut by fixed, by_length or token_budget."
)


def check_grpo_keys(cfg: DictConfig) -> None:
    """The GRPO recipe's keys' own checks, naming the key at fault.

    Raises:
        ValueError: a bad rollout key (:func:`check_rollout_keys`), a split that does not
            divide a step's completions, a token baseline, or tensor parallelism.
    """
    check_rollout_keys(cfg)
    if cfg.num_steps < 1:
        raise ValueError("config key 'num_steps' must be at least 1.")
    if cfg.micro_batching is MicroBatching.PACKED:
        raise ValueError(PACKED_ROLLOUTS)
    if cfg.rank_balancing is not RankBalancing.NONE:
        raise ValueError(
            "config key 'rank_balancing': GRPO deals prompts, not windows of samples, and "
            "generates their rollouts where they land; set rank_balancing=none."
        )
    num_completions = cfg.batch_size * cfg.grpo_samples
    ga = cfg.gradient_accumulation_steps
    if cfg.micro_batching is not MicroBatching.TOKEN_BUDGET and num_completions % ga:
        raise ValueError(
            f"config key 'gradient_accumulation_steps'={ga}: a step's {num_completions} "
            f"completions per rank (batch_size {cfg.batch_size} x grpo_samples "
            f"{cfg.grpo_samples}) must split into {ga} equal micro-batches; choose a divisor."
        )
    if cfg.loss_normalization is NormMode.POST_SCALE:
        raise ValueError(
            "config key 'loss_normalization': post_scale is stock fine-tuning's token weighting; "
            "for GRPO choose exact (default) or naive (each micro-batch's own mean over ga)."
        )
    if cfg.tensor_parallel_dim > 1:
        raise ValueError(
            "config key 'tensor_parallel_dim': GRPO shards policy and reference over "
            "data-parallel ranks only; set tensor_parallel_dim=1."
        )


def check_rollout_keys(cfg: DictConfig) -> None:
    """The rollout and loss keys (:class:`RolloutKeys`, ``loss``), naming the key at fault.

    Raises:
        ValueError: ``grpo_samples`` below 2, counts below 1, a temperature that is not
            positive, a loss with settings it does not take, or ``rewards`` not a list.
    """
    if cfg.grpo_samples < 2:
        raise ValueError(
            f"config key 'grpo_samples'={cfg.grpo_samples}: a group-relative advantage compares "
            "completions of one prompt, so it needs at least 2 (e.g. grpo_samples=8)."
        )
    if cfg.max_generated_tokens < 1:
        raise ValueError("config key 'max_generated_tokens' must be at least 1.")
    if cfg.ppo_epochs < 1:
        raise ValueError("config key 'ppo_epochs' must be at least 1.")
    if cfg.temperature <= 0:
        raise ValueError(f"config key 'temperature'={cfg.temperature}: must be positive.")
    if cfg.forward_batch_size is not None and cfg.forward_batch_size < 1:
        raise ValueError("config key 'forward_batch_size' must be at least 1 (or null).")
    loss = cfg.loss if isinstance(cfg.loss, DictConfig) else {}
    unknown = sorted(set(loss) - {"_component_", *LOSS_DEFAULTS})
    if unknown:
        raise ValueError(
            f"config key 'loss.{unknown[0]}': the GRPO loss takes epsilon and kl_coeff only "
            "(exactga.grpo.policy computes it; see docs/grpo.md)."
        )
    if not isinstance(cfg.rewards, ListConfig) or not len(cfg.rewards):
        raise ValueError(
            "config key 'rewards': a list of reward components, e.g. "
            "[{_component_: exactga.grpo.rewards.CorrectAnswer}]."
        )


def loss_settings(cfg: DictConfig) -> dict[str, float]:
    """``epsilon`` and ``kl_coeff`` of the config's ``loss`` section, defaults filled in (stock
    names torchtune.dev.grpo's loss there, which the pip package lacks; only its settings are
    read)."""
    loss = cfg.loss if isinstance(cfg.loss, DictConfig) else {}
    return {key: float(loss.get(key, default)) for key, default in LOSS_DEFAULTS.items()}
