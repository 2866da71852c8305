"""The keys of the GA parity report, ``recipes/ga_parity.py``, on a fine-tuning, KD or DPO config
(its ``parity`` section and the recipes' keys it reads); see docs/ga_parity.md. A GRPO config's
are in exactga.parity.grpo_schema. Like exactga.config.schemas, it imports no runtime module of
exactga.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from exactga.config.options import (
    MasterWeights,
    MicroBatching,
    NormMode,
    RouterBalanceObjective,
)
from exactga.config.schemas import (
    FullFinetuneDistributedConfig,
    FullFinetuneSingleDeviceConfig,
    LoraFinetuneDistributedConfig,
    LoraFinetuneSingleDeviceConfig,
    TrainingRunConfig,
    _warn_once,
    max_seq_len_of,
)
from exactga.dpo.schema import DpoLossKeys
from exactga.kd.schema import DistillationKeys

# The modes that pad micro-batches (every one but packed).
PADDED_MODES = (MicroBatching.FIXED, MicroBatching.BY_LENGTH, MicroBatching.TOKEN_BUDGET)


@dataclass
class ParitySettings:
    """The ``parity`` section of ``ga_parity``: what to compare, for how long."""

    # batch_size x gradient_accumulation_steps, "BxG", or x data-parallel ranks, "BxGxN" (N = the
    # launch's process count); all with the same global batch. The full batch (global x 1) on
    # one device is always trained as the reference.
    splits: list[str] = field(default_factory=lambda: ["1x8", "2x4", "4x2"])
    modes: list[NormMode] | None = None  # null: the loss's modes (GaParityConfig.modes_for)
    num_steps: int = 12
    # Relative L2 an exact split may differ by in fp32. Below fp32 (dtype: bf16) the floor is
    # the larger of this and twice the bf16 full batch's distance to an fp32 full batch, which
    # the report then also trains; see [parity floor below fp32] in exactga.parity.scoring.
    noise_floor: float = 1e-5
    # How a window's samples are split into micro-batches (see [micro-batching modes] in
    # exactga.data.micro_batching): exact runs every split under each of these, the baselines under
    # fixed only (see [regrouping is exact]). The full-batch reference is fixed. packed is
    # listed by hand: its rows must fit the model's max_seq_len.
    micro_batching: list[MicroBatching] = field(default_factory=lambda: list(PADDED_MODES))
    # token_budget's padded positions per micro-batch; packed's positions per row.
    micro_batch_tokens: int = 1024


@dataclass
class GaParityConfig(TrainingRunConfig, DpoLossKeys):
    """``ga_parity``: the keys of a full, LoRA, KD or DPO config it reads, plus ``parity``.

    The other keys of those recipes (single-device or distributed) are accepted, so a training
    config runs with a ``parity`` section added, and named in one warning: the report trains
    ``parity.num_steps`` steps of each split in memory from the initial weights, so batching,
    epochs, checkpoints, logging, compile and memory settings change nothing in it. A KD config
    (``teacher_model``) or a DPO one (:meth:`is_preference`) trains its recipes' loss step.
    """

    optimizer_in_bwd: bool = False  # read by full configs; must stay False here
    collate_fn: str | None = None  # null: padded_collate_sft, or collate_pairs for DPO
    # As the training recipes read it (see [fp32 master weights] in exactga.runtime.precision);
    # null: the default of the recipe the config is for, fp32 for LoRA and none for full
    # (master_weights_for). One schema covers both kinds, so its default cannot be either.
    master_weights: MasterWeights | None = None
    parity: ParitySettings = field(default_factory=ParitySettings)
    # Knowledge distillation: DistillationKeys, optional here. Null teacher_model: no teacher,
    # the causal-LM loss alone.
    teacher_model: Any = None
    teacher_checkpointer: Any = None
    kd_loss: Any = None
    kd_ratio: float = 0.5
    ref_checkpointer: Any = None  # full DPO's reference weights; LoRA DPO's is the base
    # A mixture-of-experts model's router balance term, as the fine-tuning recipes read it;
    # every run adds it, and the report shows its own gap (docs/ga_parity.md, "Router term").
    router_aux_loss_coef: float = 0.0
    router_balance: RouterBalanceObjective = RouterBalanceObjective.GLOBAL_BATCH
    # Quantisation-aware training, as the QAT recipes read them (docs/qat.md): every run
    # fake-quantised by ``quantizer``, off for the first ``fake_quant_after_n_steps`` steps.
    quantizer: Any = None
    fake_quant_after_n_steps: int | None = None

    # Keys of these (and so of the single-device) recipes are accepted, named in a warning.
    accepts_unread_keys_of: ClassVar[tuple[type, ...]] = (
        FullFinetuneDistributedConfig,
        LoraFinetuneDistributedConfig,
    )

    @classmethod
    def check_flags(cls, cfg: DictConfig) -> None:
        if cfg.optimizer_in_bwd:
            raise ValueError("config key 'optimizer_in_bwd' must be False for the parity report.")
        dataset_sections = cfg.dataset if OmegaConf.is_list(cfg.dataset) else [cfg.dataset]
        if any(section.get("packed") for section in dataset_sections):
            raise ValueError("config key 'dataset.packed' is not supported by the parity report.")
        cls._check_micro_batching(cfg)  # and the modes (modes_for)
        cls._check_distillation(cfg)
        cls._check_router_term(cfg)
        after = cfg.fake_quant_after_n_steps
        if after is not None and (cfg.quantizer is None or after < 0):
            raise ValueError(
                "config key 'fake_quant_after_n_steps' needs a 'quantizer' and must be 0 or "
                f"more, got {after}."
            )

    @classmethod
    def _check_router_term(cls, cfg: DictConfig) -> None:
        """``router_aux_loss_coef``: at least 0, and 0 for KD and DPO, whose recipes add no
        router term (the model's lack of MoE layers is named when it is built)."""
        coef = cfg.router_aux_loss_coef
        if not math.isfinite(coef) or coef < 0:
            raise ValueError(f"config key 'router_aux_loss_coef' must be 0 or more, got {coef}.")
        if coef > 0 and (cfg.teacher_model is not None or cls.is_preference(cfg)):
            raise ValueError(
                "config key 'router_aux_loss_coef': the KD and DPO recipes add no router "
                "balance term (the fine-tuning recipes do; docs/moe.md); set it to 0."
            )

    @staticmethod
    def _check_distillation(cfg: DictConfig) -> None:
        """The KD keys come together: a teacher needs its checkpointer and a KD loss."""
        if cfg.teacher_model is None:
            unread = [key for key in ("teacher_checkpointer", "kd_loss") if cfg[key] is not None]
            if unread:
                names = ", ".join(f"'{key}'" for key in unread)
                _warn_once(
                    f"config key {names} ignored: without teacher_model the report trains "
                    "the causal-LM loss alone."
                )
            return
        for key in ("teacher_checkpointer", "kd_loss"):
            if cfg[key] is None:
                raise ValueError(f"config key '{key}' is needed with teacher_model.")
        DistillationKeys.check_kd_ratio(cfg)

    @staticmethod
    def master_weights_for(cfg: DictConfig, *, is_lora: bool) -> MasterWeights:
        """``master_weights``, or where it is null the default of the training recipe the
        config is for: the LoRA recipes' (fp32) or the full recipes' (none)."""
        if cfg.master_weights is not None:
            return cfg.master_weights
        recipe = LoraFinetuneSingleDeviceConfig if is_lora else FullFinetuneSingleDeviceConfig
        return recipe.master_weights

    @staticmethod
    def is_preference(cfg: DictConfig) -> bool:
        """Whether ``loss`` weighs pairs (DPO): its forward takes summed log-probs, as torchtune's
        DPOLoss and RSOLoss do. A path that does not resolve is left to instantiation to name."""
        from torchtune.config._utils import _get_component_from_path

        try:
            loss_class = _get_component_from_path(str(cfg.loss["_component_"]))
        except Exception:  # instantiating the loss names what is wrong
            return False
        if getattr(loss_class, "unpaired", False):  # KTO: unpaired examples, laid out as pairs
            return True
        return "policy_chosen_logps" in inspect.signature(loss_class.forward).parameters

    @classmethod
    def modes_for(cls, cfg: DictConfig) -> list[NormMode]:
        """``parity.modes``; where null, naive, post_scale and exact, without post_scale for a
        preference loss: a token weighting, which raises ValueError naming the key there."""
        preference = cls.is_preference(cfg)
        default = [NormMode.NAIVE, *([] if preference else [NormMode.POST_SCALE]), NormMode.EXACT]
        modes = default if cfg.parity.modes is None else list(cfg.parity.modes)
        if preference and NormMode.POST_SCALE in modes:
            raise ValueError(
                "config key 'parity.modes': post_scale is a token weighting and a preference "
                "loss weighs pairs (stock DPO's weighting is naive); list naive and exact."
            )
        return modes

    @classmethod
    def baseline_micro_batchings(cls, cfg: DictConfig) -> list[MicroBatching]:
        """``fixed``; for a preference loss also ``token_budget``, see [stock dpo weighting]."""
        budget = [MicroBatching.TOKEN_BUDGET] if cls.is_preference(cfg) else []
        return [MicroBatching.FIXED, *budget]

    @classmethod
    def _check_micro_batching(cls, cfg: DictConfig) -> None:
        listed = list(cfg.parity.micro_batching)
        if not listed:
            raise ValueError(
                "config key 'parity.micro_batching' is empty; list at least one of "
                f"{', '.join(m.value for m in MicroBatching)}."
            )
        duplicates = sorted({m for m in listed if listed.count(m) > 1})
        if duplicates:
            raise ValueError(
                f"config key 'parity.micro_batching' lists {', '.join(duplicates)} twice."
            )
        if cfg.parity.micro_batch_tokens < 1:
            raise ValueError(
                "config key 'parity.micro_batch_tokens' must be at least 1, got "
                f"{cfg.parity.micro_batch_tokens}."
            )
        max_seq_len = max_seq_len_of(cfg, "model")
        rows = cfg.parity.micro_batch_tokens
        if MicroBatching.PACKED in listed and max_seq_len and rows > max_seq_len:
            raise ValueError(
                f"config keys 'parity.micro_batch_tokens' and 'model.max_seq_len': a packed row "
                f"of {rows} positions is one sequence to the model, which takes at most "
                f"{max_seq_len}; set parity.micro_batch_tokens={max_seq_len} or less."
            )
        modes = cls.modes_for(cfg)
        regrouping = cls.baseline_micro_batchings(cfg) if NormMode.NAIVE in modes else ()
        regrouped = [m for m in listed if m is not MicroBatching.FIXED and m not in regrouping]
        if regrouped and NormMode.EXACT not in modes:
            _warn_once(
                f"config key 'parity.micro_batching': {', '.join(regrouped)} is ignored: only "
                "exact runs regroup (and naive under token_budget, for a preference loss), and "
                "'parity.modes' lists no exact."
            )
