"""The keys of the DPO recipes, with their one default and their checks (see
exactga.config.schemas).

torchtune 0.6.1's ``lora_dpo_single_device``, ``lora_dpo_distributed`` and
``full_dpo_distributed`` read the keys of the fine-tuning recipe of the same kind, plus the
reference's checkpointer for full DPO; their configs run unchanged here. Like
exactga.config.schemas, this module imports only bottom modules (``tests/test_architecture.py``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig

from exactga.config.options import MicroBatching, NormMode, SequenceLogProb
from exactga.config.schemas import (
    FullFinetuneDistributedConfig,
    LoraFinetuneDistributedConfig,
    LoraFinetuneSingleDeviceConfig,
    TwinSchemas,
    max_seq_len_of,
)

# Stock collates pairs with torchtune's ``padded_collate_dpo`` and reads no ``collate_fn`` key;
# this is the same layout as a dict, which the loader and the normaliser take.
PAIR_COLLATE = "exactga.dpo.preference.collate_pairs"

# A resume with another DPO loss (or beta, or its terms) is refused like one with another model;
# see [what a resume may change] in exactga.run.resume.
DPO_FINGERPRINT_KEYS = ("loss", "rpo_alpha", "sequence_log_prob")
FULL_DPO_FINGERPRINT_KEYS = (*DPO_FINGERPRINT_KEYS, "ref_checkpointer")


@dataclass
class DpoLossKeys:
    """exactga's keys for what the DPO loss is made of beyond ``loss``, read by all three
    recipes (``exactga.dpo.preference.DpoTerms`` takes them). Neither is stock's: left at their
    defaults, the loss is stock's per-pair ``loss`` on summed log-probs, with the same code."""

    # The weight of an NLL term on the chosen responses, a mean over their tokens (RPO; TRL's
    # name); 0: none. See [chosen tokens as the NLL's units] in exactga.dpo.preference.
    rpo_alpha: float = 0.0
    # A response's log-prob from its tokens': their sum or mean (length-normalised). null: the
    # loss's own (the sum for torchtune's DPOLoss and RSOLoss, the mean for SimPO, ORPO, IPO).
    # See [length-normalised log-probs are per pair] in exactga.dpo.preference.
    sequence_log_prob: SequenceLogProb | None = None


def check_preference_keys(cfg: DictConfig) -> None:
    """The keys every DPO recipe checks: a pair collate and a per-pair weighting.

    Raises:
        ValueError: naming the key, for a collate that does not stack pairs, a token
            weighting (``post_scale``) or a negative ``rpo_alpha``.
    """
    if not math.isfinite(cfg.rpo_alpha) or cfg.rpo_alpha < 0:
        raise ValueError(
            f"config key 'rpo_alpha' must be at least 0 (0: no NLL term), got {cfg.rpo_alpha}."
        )
    if cfg.loss_normalization is NormMode.POST_SCALE:
        raise ValueError(
            "config key 'loss_normalization': post_scale is stock's token weighting of "
            "fine-tuning; stock DPO weighs each micro-batch's mean over its pairs by 1/ga, "
            "which is naive here. Choose exact (default) or naive."
        )
    check_packed_pairs(cfg)
    if cfg.precompute_reference_logprobs and loss_is_reference_free(cfg):
        warnings.warn(
            "config key 'precompute_reference_logprobs' ignored: "
            f"{cfg.loss['_component_']} is reference-free, there is no reference to compute.",
            stacklevel=2,
        )
    if cfg.collate_fn != PAIR_COLLATE and not cfg.collate_fn.endswith("collate_pairs"):
        raise ValueError(
            f"config key 'collate_fn'={cfg.collate_fn}: DPO micro-batches stack each pair's "
            f"chosen and rejected rows; use {PAIR_COLLATE} (torchtune's padded_collate_dpo "
            "layout, as a dict), or remove the key."
        )


def loss_declares(cfg: DictConfig, name: str) -> bool:
    """Whether the config's ``loss`` class declares ``name`` true (``reference_free``: SimPO,
    ORPO; ``unpaired``: KTO; see exactga.dpo.losses). The class is looked up by its path, not
    built; a path that does not resolve is left to instantiation to name."""
    from torchtune.config._utils import _get_component_from_path  # only when validating

    try:
        loss_class = _get_component_from_path(str(cfg.loss["_component_"]))
    except Exception:  # instantiating the loss names what is wrong
        return False
    return bool(getattr(loss_class, name, False))


def loss_is_reference_free(cfg: DictConfig) -> bool:
    """Whether the config's ``loss`` takes no reference (SimPO, ORPO)."""
    return loss_declares(cfg, "reference_free")


def check_ref_checkpointer(cfg: DictConfig) -> None:
    """Full DPO reads the reference's weights from ``ref_checkpointer``, unless its loss is
    reference-free, which builds no reference at all (the key is then ignored, with a warning).

    Raises:
        ValueError: naming ``ref_checkpointer``, when a reference-based loss has none.
    """
    reference_free = loss_is_reference_free(cfg)
    if cfg.ref_checkpointer is None and not reference_free:
        raise ValueError(
            f"config key 'ref_checkpointer' is needed: {cfg.loss['_component_']} compares the "
            "policy with a reference model, whose weights it reads (or choose a reference-free "
            "loss: exactga.dpo.losses.SimPOLoss, ORPOLoss)."
        )
    if cfg.ref_checkpointer is not None and reference_free:
        warnings.warn(
            f"config key 'ref_checkpointer' ignored: {cfg.loss['_component_']} is "
            "reference-free, so no reference model is built.",
            stacklevel=2,
        )


def check_packed_pairs(cfg: DictConfig) -> None:
    """Under ``micro_batching: packed`` a pair is one document pair of a row: its two sides,
    up to twice ``tokenizer.max_seq_len`` positions, must fit the model's ``max_seq_len``
    (a row is one sequence to it), where both are given."""
    if cfg.micro_batching is not MicroBatching.PACKED:
        return
    if loss_declares(cfg, "unpaired"):
        raise ValueError(
            "config key 'micro_batching': KTO reads its examples and their mismatched sequences "
            "as rows; use fixed, by_length or token_budget, not packed."
        )
    side, limit = max_seq_len_of(cfg, "tokenizer"), max_seq_len_of(cfg, "model")
    if side and limit and 2 * side > limit:
        raise ValueError(
            f"config keys 'tokenizer.max_seq_len' and 'model.max_seq_len': a packed pair holds "
            f"both its sides, up to 2 x {side} = {2 * side} positions, one sequence to the model, "
            f"which takes at most {limit}; set model.max_seq_len={2 * side} (micro_batch_tokens "
            f"at most that) or tokenizer.max_seq_len={limit // 2}."
        )


@dataclass
class LoraDpoSingleDeviceConfig(LoraFinetuneSingleDeviceConfig, DpoLossKeys):
    """``lora_dpo_single_device``: the LoRA keys; the reference is the policy without its
    adapters. ``loss`` is torchtune's ``DPOLoss`` or ``RSOLoss`` (one loss per pair)."""

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema

    collate_fn: str = PAIR_COLLATE
    # exactga: each pair's reference log-probs computed once, before training, and looked up
    # (see [precomputed reference] in exactga.dpo.reference_logprobs and docs/dpo.md).
    precompute_reference_logprobs: bool = False

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        check_preference_keys(cfg)  # first: stock's own checks would name post_scale otherwise
        super().check_flags(cfg)


@dataclass
class LoraDpoDistributedConfig(LoraFinetuneDistributedConfig, DpoLossKeys):
    """``lora_dpo_distributed``: the distributed LoRA keys; the reference as on one device."""

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema
    CONTEXT_PARALLEL: ClassVar[bool] = False  # its loss step reads whole sequences

    collate_fn: str = PAIR_COLLATE
    # exactga: each pair's reference log-probs computed once, before training, and looked up
    # (see [precomputed reference] in exactga.dpo.reference_logprobs and docs/dpo.md).
    precompute_reference_logprobs: bool = False

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        check_preference_keys(cfg)  # first: stock's own checks would name post_scale otherwise
        super().check_flags(cfg)


LORA_DPO = TwinSchemas(LoraDpoSingleDeviceConfig, LoraDpoDistributedConfig)
LoraDpoConfig = LoraDpoSingleDeviceConfig | LoraDpoDistributedConfig


@dataclass
class FullDpoDistributedConfig(FullFinetuneDistributedConfig, DpoLossKeys):
    """``full_dpo_distributed``: the full distributed keys plus ``ref_checkpointer``, the
    reference's weights (a frozen copy of ``model``, sharded like it)."""

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema
    CONTEXT_PARALLEL: ClassVar[bool] = False  # its loss step reads whole sequences

    collate_fn: str = PAIR_COLLATE
    # The reference's weights; needed unless the loss is reference-free (SimPO, ORPO).
    ref_checkpointer: Any = None
    # exactga: as in the LoRA DPO recipes; the reference model is also freed after the pre-pass.
    precompute_reference_logprobs: bool = False

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        check_preference_keys(cfg)  # first: stock's own checks would name post_scale otherwise
        check_ref_checkpointer(cfg)
        if cfg.tensor_parallel_dim > 1:
            raise ValueError(
                "config key 'tensor_parallel_dim': full DPO shards policy and reference over "
                "data-parallel ranks only (as stock); set tensor_parallel_dim=1."
            )
        super().check_flags(cfg)
