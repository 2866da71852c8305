"""The keys of the knowledge-distillation recipes: the LoRA student's plus the teacher's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig

from exactga.config.schemas import (
    LoraFinetuneDistributedConfig,
    LoraFinetuneSingleDeviceConfig,
    TwinSchemas,
)


@dataclass
class DistillationKeys:
    """The keys torchtune 0.6.1's KD recipes add to the LoRA ones (see exactga.kd.distillation)."""

    teacher_model: Any = MISSING  # a plain builder; frozen, run under no_grad
    teacher_checkpointer: Any = MISSING
    kd_loss: Any = MISSING  # e.g. torchtune.modules.loss.ForwardKLWithChunkedOutputLoss
    kd_ratio: float = 0.5  # loss = (1 - kd_ratio) class loss + kd_ratio KD loss

    @staticmethod
    def check_kd_ratio(cfg: DictConfig) -> None:
        if not 0.0 <= cfg.kd_ratio <= 1.0:
            raise ValueError(f"config key 'kd_ratio' must be in [0, 1], got {cfg.kd_ratio}.")


@dataclass
class KnowledgeDistillationSingleDeviceConfig(LoraFinetuneSingleDeviceConfig, DistillationKeys):
    """``knowledge_distillation_single_device``: the LoRA student's keys plus the teacher's."""

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        cls.check_kd_ratio(cfg)


@dataclass
class KnowledgeDistillationDistributedConfig(LoraFinetuneDistributedConfig, DistillationKeys):
    """``knowledge_distillation_distributed``: the distributed LoRA keys plus the teacher's."""

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema
    CONTEXT_PARALLEL: ClassVar[bool] = False  # its loss step reads whole sequences

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        super().check_flags(cfg)
        cls.check_kd_ratio(cfg)


KNOWLEDGE_DISTILLATION = TwinSchemas(
    KnowledgeDistillationSingleDeviceConfig, KnowledgeDistillationDistributedConfig
)
KnowledgeDistillationConfig = (
    KnowledgeDistillationSingleDeviceConfig | KnowledgeDistillationDistributedConfig
)
