"""The keys of the GA parity report on a GRPO config (``recipes/ga_parity.py``,
exactga.parity.grpo)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import DictConfig

from exactga.config.options import (
    LossAggregation,
    MasterWeights,
    MicroBatching,
    NormMode,
    as_option,
)
from exactga.config.schemas import TrainingRunConfig, check_master_weights
from exactga.grpo.schema import (
    PACKED_ROLLOUTS,
    GrpoDistributedConfig,
    RolloutKeys,
    check_loss_section,
    check_rollout_keys,
    loss_short_name,
)
from exactga.parity.schema import PADDED_MODES, ParitySettings


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
    # Policy loss sections ({_component_: exactga.grpo.losses.GSPOLoss, ...}), each trained under
    # every loss_aggregation as its own objective; null: the config's own ``loss``. The typed
    # settings hold them as dicts (exactga.grpo.losses.build_policy_loss takes a mapping).
    losses: list[Any] | None = None
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
        aggregations = [
            as_option(LossAggregation, a, "parity.loss_aggregations").value
            for a in parity.loss_aggregations
        ]
        if not aggregations or len(set(aggregations)) < len(aggregations):
            raise ValueError(
                f"config key 'parity.loss_aggregations'={aggregations}: list each of "
                f"{', '.join(a.value for a in LossAggregation)} at most once, at least one."
            )
        for index, loss in enumerate(parity.losses or []):
            check_loss_section(loss, f"parity.losses[{index}]")
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
    def splits_for(settings: GrpoParityConfig) -> list[str]:
        """``parity.splits``, or where null the config's own split (see GrpoParitySettings)."""
        if settings.parity.splits is not None:
            return [str(split) for split in settings.parity.splits]
        if settings.batch_size is None:
            raise ValueError(
                "config key 'parity.splits': list the splits to compare (e.g. [4x4, 8x2]: "
                "completions per micro-batch x micro-batches), or set batch_size for the "
                "config's own."
            )
        completions = settings.batch_size * settings.grpo_samples
        ga = settings.gradient_accumulation_steps
        ga = ga if ga > 1 else 2
        if completions % ga:
            ga = 1
        return [f"{completions // ga}x{ga}"]

    @staticmethod
    def losses_for(settings: GrpoParityConfig) -> list[tuple[str | None, Any]]:
        """Each loss the report trains, as (its name in the report, its section): the
        config's own ``loss`` (name None) where ``parity.losses`` is null; a loss listed twice
        is named with its place in the list."""
        losses = settings.parity.losses
        if losses is None:
            return [(None, settings.loss)]
        names = [loss_short_name(loss) for loss in losses]
        return [
            (name if names.count(name) == 1 else f"{name}{index}", loss)
            for index, (name, loss) in enumerate(zip(names, losses, strict=True))
        ]

    @staticmethod
    def modes_for(settings: GrpoParityConfig) -> list[NormMode]:
        """``parity.modes``; where null, naive and exact."""
        if settings.parity.modes is None:
            return [NormMode.NAIVE, NormMode.EXACT]
        return list(settings.parity.modes)


def is_grpo_config(cfg: DictConfig) -> bool:
    """Whether ``cfg`` is a GRPO config (it sets ``grpo_samples``), for the parity report."""
    return "grpo_samples" in cfg
