"""The keys of the GRPO recipe, with their one default and their checks (see exactga.schemas).

torchtune 0.6.1's ``recipes/dev/grpo_full_finetune_distributed.py`` reads the full distributed
fine-tuning keys plus ``ref_checkpointer``, ``grpo_samples``, ``max_generated_tokens``,
``temperature``, ``top_k``, ``ppo_epochs``, ``num_steps``, ``forward_batch_size``,
``stop_token_ids`` and ``save_every_n_epochs``, with ``loss`` its ``GRPOLoss`` (``epsilon``,
``kl_coeff``). This recipe reads the same keys, plus ``rewards`` (its reward components, where
stock hard-codes one) and ``loss_aggregation``. Like exactga.schemas, this module imports only
bottom modules (``tests/test_architecture.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, ListConfig

from exactga.options import (
    LossAggregation,
    MasterWeights,
    MicroBatching,
    NormMode,
    RankBalancing,
)
from exactga.parity_schemas import PADDED_MODES, ParitySettings
from exactga.schemas import (
    FullFinetuneDistributedConfig,
    TrainingRunConfig,
    check_master_weights,
)

# A resume with another reward, sampler or loss is refused like one with another model; see
# [what a resume may change] in exactga.resume.
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
    rewards: Any = MISSING  # a list of reward components (exactga.rewards)
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
            "(exactga.policy computes it; see docs/grpo.md)."
        )
    if not isinstance(cfg.rewards, ListConfig) or not len(cfg.rewards):
        raise ValueError(
            "config key 'rewards': a list of reward components, e.g. "
            "[{_component_: exactga.rewards.CorrectAnswer}]."
        )


def loss_settings(cfg: DictConfig) -> dict[str, float]:
    """``epsilon`` and ``kl_coeff`` of the config's ``loss`` section, defaults filled in (stock
    names torchtune.dev.grpo's loss there, which the pip package lacks; only its settings are
    read)."""
    loss = cfg.loss if isinstance(cfg.loss, DictConfig) else {}
    return {key: float(loss.get(key, default)) for key, default in LOSS_DEFAULTS.items()}


# ---------------------------------------------------------------------------------------------
# The GA parity report on a GRPO config (recipes/ga_parity.py, exactga.parity.grpo).


@dataclass
class GrpoParitySettings(ParitySettings):
    """The ``parity`` section of ``ga_parity`` for a GRPO config. A split ``BxG`` or ``BxGxN``
    counts completions: ``B`` per micro-batch, ``G`` micro-batches, ``N`` ranks, so a rank's
    step takes ``B*G / grpo_samples`` prompts; ``num_steps`` counts rollout steps (each
    ``ppo_epochs`` optimizer steps)."""

    # null: the config's own split, batch_size x grpo_samples completions in
    # gradient_accumulation_steps micro-batches (in 2 where it has 1).
    splits: list[str] | None = None  # type: ignore[assignment]
    micro_batching: list[MicroBatching] = field(default_factory=lambda: list(PADDED_MODES))
    # Each is trained as its own objective, with its own full-batch reference.
    loss_aggregations: list[LossAggregation] = field(default_factory=lambda: list(LossAggregation))
    num_steps: int = 4


@dataclass
class GrpoParityConfig(TrainingRunConfig, RolloutKeys):
    """``ga_parity`` on a GRPO config: the rollout keys and what is trained, plus ``parity``.
    The recipe's other keys are accepted and named in one warning (the report trains
    ``parity.num_steps`` rollout steps of each split in memory)."""

    master_weights: MasterWeights = MasterWeights.NONE  # as the GRPO recipe reads it
    parity: GrpoParitySettings = field(default_factory=GrpoParitySettings)
    # Read for the default split only.
    batch_size: int | None = None
    gradient_accumulation_steps: int = 1

    accepts_unread_keys_of: ClassVar[tuple[type, ...]] = (GrpoDistributedConfig,)

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        check_rollout_keys(cfg)
        check_master_weights(cfg)
        parity = cfg.parity
        aggregations = [LossAggregation(a).value for a in parity.loss_aggregations]
        if not aggregations or len(set(aggregations)) < len(aggregations):
            raise ValueError(
                f"config key 'parity.loss_aggregations'={aggregations}: list each of "
                f"{', '.join(a.value for a in LossAggregation)} at most once, at least one."
            )
        if parity.num_steps < 1:
            raise ValueError("config key 'parity.num_steps' must be at least 1 (rollout steps).")
        if parity.modes is not None and NormMode.POST_SCALE in parity.modes:
            raise ValueError(
                "config key 'parity.modes': post_scale is stock fine-tuning's token weighting; "
                "for GRPO list naive and exact."
            )
        if not parity.micro_batching:
            raise ValueError("config key 'parity.micro_batching' is empty; list at least one.")
        if MicroBatching.PACKED in parity.micro_batching:
            raise ValueError(PACKED_ROLLOUTS.replace("'micro_batching'", "'parity.micro_batching'"))
        if parity.micro_batch_tokens < 1:
            raise ValueError("config key 'parity.micro_batch_tokens' must be at least 1.")

    @staticmethod
    def splits_for(cfg: DictConfig) -> list[str]:
        """``parity.splits``, or where null the config's own split (see GrpoParitySettings)."""
        if cfg.parity.splits is not None:
            return [str(split) for split in cfg.parity.splits]
        if cfg.batch_size is None:
            raise ValueError(
                "config key 'parity.splits': list the splits to compare (e.g. [4x4, 8x2]: "
                "completions per micro-batch x micro-batches), or set batch_size for the "
                "config's own."
            )
        completions = cfg.batch_size * cfg.grpo_samples
        ga = cfg.gradient_accumulation_steps if cfg.gradient_accumulation_steps > 1 else 2
        if completions % ga:
            ga = 1
        return [f"{completions // ga}x{ga}"]

    @staticmethod
    def modes_for(cfg: DictConfig) -> list[NormMode]:
        """``parity.modes``; where null, naive and exact."""
        if cfg.parity.modes is None:
            return [NormMode.NAIVE, NormMode.EXACT]
        return list(cfg.parity.modes)


def is_grpo_config(cfg: DictConfig) -> bool:
    """Whether ``cfg`` is a GRPO config (it sets ``grpo_samples``), for the parity report."""
    return "grpo_samples" in cfg
