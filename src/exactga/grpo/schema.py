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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, ListConfig

from exactga.config.options import (
    KLEstimator,
    LossAggregation,
    MicroBatching,
    NormMode,
    RankBalancing,
    as_option,
    bad_value,
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
    "overlong_buffer",
    "overlong_penalty_factor",
    "dynamic_sampling",
    "max_sampling_rounds",
)

# The policy losses a config's ``loss._component_`` may name (exactga.grpo.losses), and the
# settings each takes. Stock's names (torchtune.dev.grpo.loss, which the pip package lacks) train
# PPOClipLoss with stock's settings. Kept here, as data, so validating a config imports no torch;
# tests/test_policy_losses.py checks the table against the classes' signatures.
_KL_KEYS = ("kl_coeff", "kl_estimator", "kl_in_reward")
POLICY_LOSS_KEYS = {
    "exactga.grpo.losses.PPOClipLoss": ("epsilon", "epsilon_low", "epsilon_high", *_KL_KEYS),
    "exactga.grpo.losses.GSPOLoss": ("epsilon_low", "epsilon_high", *_KL_KEYS),
    "exactga.grpo.losses.CISPOLoss": ("epsilon_low", "epsilon_high", *_KL_KEYS),
}
STOCK_LOSSES = (
    "torchtune.dev.grpo.loss.GRPOLoss",
    "torchtune.dev.grpo.loss.GRPOSimpleLoss",
    "torchtune.dev.grpo.loss.GRPOWithChunkedOutputLoss",
)


@dataclass
class RolloutKeys:
    """The keys of a GRPO step's rollouts and policy loss, which the recipe and the GA parity
    report read alike."""

    # ``loss`` is checked by check_loss_section (stock's names do not import), not as a
    # component's arguments (exactga.config.components).
    checks_own_components: ClassVar[tuple[str, ...]] = ("loss",)

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
    # DAPO's overlong shaping: completions longer than max_generated_tokens - overlong_buffer
    # lose up to overlong_penalty_factor of reward (null: off). See exactga.grpo.shaping.
    overlong_buffer: int | None = None
    overlong_penalty_factor: float = 1.0
    # DAPO's dynamic sampling: drop the groups whose rewards are all equal and sample further
    # prompts of the data order, at most max_sampling_rounds rounds a step; the same groups on
    # any rank layout. See [dynamic sampling on any layout] in exactga.grpo.shaping.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4


@dataclass
class GrpoDistributedConfig(FullFinetuneDistributedConfig, RolloutKeys):
    """``grpo_full_finetune_distributed``. ``batch_size`` is prompts per rank per step; each
    step's ``batch_size x grpo_samples`` completions on a rank are cut into
    ``gradient_accumulation_steps`` micro-batches."""

    ROUTER_BALANCE_RECIPES: ClassVar[bool] = False  # no router term: see the base schema
    CONTEXT_PARALLEL: ClassVar[bool] = False  # it generates and scores whole sequences

    num_steps: int = MISSING  # rollout steps of the run at most (each is ppo_epochs steps)
    save_every_n_epochs: int | None = None  # stock's key; epoch checkpoints are written always
    # exactga: what the policy loss is a mean over, by veRL's names: token-mean (DAPO),
    # seq-mean-token-mean (the GRPO paper), seq-mean-token-sum, seq-mean-token-sum-norm (Dr.
    # GRPO), token-sum; token_mean, sequence_mean, constant are aliases. See [policy
    # aggregations] and docs/grpo.md.
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
    buffer = cfg.overlong_buffer
    if buffer is not None and not 0 < buffer <= cfg.max_generated_tokens:
        raise ValueError(
            f"config key 'overlong_buffer'={buffer}: must be between 1 and max_generated_tokens "
            f"({cfg.max_generated_tokens}), or null for no overlong shaping."
        )
    if cfg.max_sampling_rounds < 1:  # RolloutKeys' default (4) is the one default
        raise ValueError("config key 'max_sampling_rounds' must be at least 1.")
    check_loss_keys(cfg)
    if not isinstance(cfg.rewards, ListConfig) or not len(cfg.rewards):
        raise ValueError(
            "config key 'rewards': a list of reward components, e.g. "
            "[{_component_: exactga.grpo.rewards.CorrectAnswer}]."
        )


def check_loss_keys(cfg: DictConfig) -> None:
    """The ``loss`` section; see :func:`check_loss_section`."""
    check_loss_section(cfg.loss, "loss")


def check_loss_section(loss: Any, key: str) -> None:
    """A policy loss section: a component of :data:`POLICY_LOSS_KEYS` (or stock's), with
    settings it takes; ``key`` is where the config holds it.

    Raises:
        ValueError: another component, an unknown setting or KL estimator, naming the key.
    """
    if not isinstance(loss, DictConfig):
        return  # stock's default loss: PPO-clip with its defaults
    component = loss.get("_component_")
    accepted = POLICY_LOSS_KEYS["exactga.grpo.losses.PPOClipLoss"]
    if component is not None and component not in STOCK_LOSSES:
        if component not in POLICY_LOSS_KEYS:
            raise bad_value(f"{key}._component_", component, [*POLICY_LOSS_KEYS, *STOCK_LOSSES])
        accepted = POLICY_LOSS_KEYS[component]
    unknown = sorted(set(loss) - {"_component_", *accepted})
    if unknown:
        # Most often a swap of the shipped loss: its PPO-clip ``epsilon`` stays in the section.
        removal = " ".join(f"~{key}.{name}" for name in unknown)
        raise ValueError(
            f"config key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(repr(f'{key}.{name}') for name in unknown)}: "
            f"{component or 'the GRPO loss'} takes {', '.join(accepted)}. Drop "
            f"{'them' if len(unknown) > 1 else 'it'} on the command line with {removal} "
            "(exactga.grpo.losses; see docs/grpo.md for a command per policy loss)."
        )
    if loss.get("kl_estimator") is not None:
        as_option(KLEstimator, loss.kl_estimator, f"{key}.kl_estimator")


def loss_short_name(loss: Any) -> str:
    """A loss section's name in reports (a config node, or a dict of the typed settings): its
    class without ``Loss``, lower case (``ppoclip``, ``gspo``, ``cispo``; stock's names are
    ``ppoclip``)."""
    component = loss.get("_component_") if isinstance(loss, Mapping) else None
    if component is None or component in STOCK_LOSSES:
        return "ppoclip"
    return component.rsplit(".", 1)[-1].removesuffix("Loss").lower()
