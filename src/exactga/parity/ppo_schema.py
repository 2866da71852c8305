"""The keys of the GA parity report on a PPO config (``recipes/ga_parity.py``,
exactga.parity.ppo)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from exactga.config.options import MicroBatching, NormMode
from exactga.parity.schema import PADDED_MODES, ParitySettings
from exactga.ppo.schema import PpoFullFinetuneSingleDeviceConfig


@dataclass
class PpoParitySettings(ParitySettings):
    """The ``parity`` section of ``ga_parity`` for a PPO config. A split ``BxG`` counts the
    trajectories of one PPO batch: ``B`` per micro-batch, ``G`` micro-batches, ``B*G`` the
    config's ``ppo_batch_size``; ``num_steps`` counts trajectory steps (each ``ppo_epochs x
    batch_size / ppo_batch_size`` optimizer steps). One device only, as the recipe."""

    # null: the config's own split, ppo_batch_size in gradient_accumulation_steps micro-batches
    # (in 2 where it has 1).
    splits: list[str] | None = None  # type: ignore[assignment]
    micro_batching: list[MicroBatching] = field(default_factory=lambda: list(PADDED_MODES))
    num_steps: int = 1


@dataclass
class PpoParityConfig(PpoFullFinetuneSingleDeviceConfig):
    """``ga_parity`` on a PPO config: the recipe's keys, plus ``parity``. The report trains
    ``parity.num_steps`` trajectory steps of each split in memory, from the initial weights."""

    parity: PpoParitySettings = field(default_factory=PpoParitySettings)

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        parity = cfg.parity
        if parity.num_steps < 1:
            raise ValueError("config key 'parity.num_steps' must be at least 1 (trajectory steps).")
        if parity.modes is not None and NormMode.POST_SCALE in parity.modes:
            raise ValueError(
                "config key 'parity.modes': post_scale is stock fine-tuning's token weighting; "
                "for PPO list naive and exact."
            )
        if not parity.micro_batching or MicroBatching.PACKED in parity.micro_batching:
            raise ValueError(
                "config key 'parity.micro_batching': list fixed, by_length or token_budget "
                "(packed is not for trajectories), at least one."
            )

    @staticmethod
    def splits_for(settings: PpoParityConfig) -> list[str]:
        """``parity.splits``, or where null the config's own split (see PpoParitySettings)."""
        if settings.parity.splits is not None:
            return [str(split) for split in settings.parity.splits]
        ga = settings.gradient_accumulation_steps
        ga = ga if ga > 1 else 2
        if settings.ppo_batch_size % ga:
            ga = 1
        return [f"{settings.ppo_batch_size // ga}x{ga}"]

    @staticmethod
    def modes_for(settings: PpoParityConfig) -> list[NormMode]:
        """``parity.modes``; where null, naive and exact."""
        if settings.parity.modes is None:
            return [NormMode.NAIVE, NormMode.EXACT]
        return list(settings.parity.modes)


def is_ppo_config(cfg: DictConfig) -> bool:
    """Whether ``cfg`` is a PPO config (it sets ``ppo_batch_size``), for the parity report."""
    return "ppo_batch_size" in cfg
