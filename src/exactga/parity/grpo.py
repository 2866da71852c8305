"""The GA parity report on a GRPO config: every policy loss x ``loss_aggregation`` under every
split.

``recipes/ga_parity.py`` hands a config that sets ``grpo_samples`` to :class:`GrpoParity`, which
trains it as recipes/grpo_full_finetune_distributed.py does
(``exactga.grpo.rollout_step.make_rollouts``, ``exactga.grpo.windows.ppo_epoch_windows``,
``exactga.grpo.policy.grpo_micro_batch_loss`` and the recipes' ``train_window``), once per listed
loss (``parity.losses``, or the config's ``loss``) and ``loss_aggregation`` as the full batch on
one device and then under every split and mode, and scores and reports each as its own
objective with the fine-tuning report's tables, verdict and figure (exactga.parity.report). See
[grpo parity].

Note [grpo parity]
A split ``BxGxN`` counts completions: ``B`` per micro-batch, ``G`` micro-batches, ``N`` ranks;
a rank's step takes ``B*G / grpo_samples`` prompts, so every split of one global batch trains on
the same prompts (the loader deals one shuffled order out to the ranks) and, since a
completion's sampling randomness is a function of (seed, step, prompt, sample), samples the same
completions at the first rollout step, where every run holds the initial weights. After it each
run samples from its own policy: an exact split's weights differ from the full batch's by
rounding, which leaves the sampled tokens as they were, but a baseline whose weights moved
elsewhere samples other completions from its second rollout step on, so its later losses
compare different rollouts. The report therefore checks that the runs counted the same units
(completion tokens, or completions) over the first rollout step's windows only, and says so.
``naive`` is each micro-batch's own mean over its units, divided by ``G`` (TRL's and veRL's
weighting before their fixes): off wherever a window's micro-batches hold different numbers of
units, which for ``token_mean`` is almost always and for the completion units only where
micro-batches hold different numbers of completions (``token_budget``'s, which the baselines do
not train: they run ``fixed`` only, as in the fine-tuning report).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torchtune import config, training, utils
from tqdm import tqdm

from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.step import train_window
from exactga.config.options import (
    LossAggregation,
    MasterWeights,
    MicroBatching,
    NormMode,
)
from exactga.data.loader import build_prompt_loader
from exactga.generation.sampling import SamplingSettings, check_prompt
from exactga.grpo.losses import PolicyLoss, build_policy_loss
from exactga.grpo.policy import grpo_micro_batch_loss, loss_units_for
from exactga.grpo.rewards import build_rewards, reward_name
from exactga.grpo.rollout_step import ShapingKeys, StepSettings, make_rollouts
from exactga.grpo.windows import ppo_epoch_windows
from exactga.parity.grpo_report import PolicyObjective, grpo_splits, write_index
from exactga.parity.grpo_schema import GrpoParityConfig
from exactga.parity.report import markdown_table, write_report
from exactga.parity.runs import (
    FrozenModels,
    RunTally,
    build_model,
    build_sharded_model,
    gather_summaries,
    reseed,
    trained_weights,
)
from exactga.parity.scoring import (
    ParityRun,
    PrecisionView,
    RunSummary,
    Split,
    plan_runs,
    relative_l2,
    summarize,
    verdict,
)
from exactga.profiling import setup_profiler
from exactga.runtime import distributed
from exactga.runtime.precision import Precision

log = utils.get_logger("INFO")


@dataclass(frozen=True)
class SplitRuntime:
    """What one split's run hands ``make_rollouts`` of itself (a recipe hands its ``Runtime``;
    see exactga.grpo.rollout_step.RolloutRuntime): the rollouts' device, precision and
    data-parallel group."""

    device: torch.device
    precision: Precision
    dp_group: Any = None

    @property
    def dp_size(self) -> int:
        return torch.distributed.get_world_size(self.dp_group) if self.dp_group is not None else 1


class GrpoParity:
    """Trains a GRPO config under each ``parity.loss_aggregations`` x split x mode and writes
    one report per aggregation and an index over them; see [grpo parity].

    Args:
        cfg: the typed settings of the validated config (``GrpoParityConfig``; see
            [typed settings] in exactga.config.validation).

    Raises:
        ValueError: bad ``parity.splits`` (:func:`grpo_splits`), ``parity.num_steps`` beyond
            the prompts of one epoch, a prompt too long for the model.
    """

    def __init__(self, cfg: GrpoParityConfig) -> None:
        self._cfg = cfg
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._precision = Precision.from_config(self._dtype, cfg.master_weights, self._device)
        self._fp32_precision = None  # below fp32; see [parity floor below fp32]
        if torch.finfo(self._dtype).bits < 32:
            self._fp32_precision = Precision.from_config(
                torch.float32, MasterWeights.NONE, self._device
            )
        launched_world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._splits = grpo_splits(
            GrpoParityConfig.splits_for(cfg), launched_world_size, cfg.grpo_samples
        )
        self._modes = GrpoParityConfig.modes_for(cfg)
        self._aggregations = list(cfg.parity.loss_aggregations)
        self._micro_batchings = list(cfg.parity.micro_batching)
        self._num_steps = cfg.parity.num_steps
        self._global_completions = self._splits[0].global_batch
        self._report_dir = Path(cfg.output_dir) / "parity"
        self._mesh = None
        if launched_world_size > 1:
            distributed.init_distributed(self._device)
            self._mesh = distributed.build_device_mesh(self._device)
        self._world_size, self._rank = utils.get_world_size_and_rank()
        self._seed = training.set_seed(seed=cfg.seed)  # the recipe's rollout seed
        # Each objective is a (loss, loss_aggregation): the config's ``loss``, or each of
        # ``parity.losses``, under each of ``parity.loss_aggregations``.
        self._losses = GrpoParityConfig.losses_for(cfg)
        self._reports: dict[str, dict[str, Any]] = {}  # rank 0: each aggregation's outcome
        self._num_runs = 0

    def setup(self, cfg: GrpoParityConfig) -> None:
        reseed(self._seed)
        checkpointer = config.instantiate(cfg.checkpointer)
        base_state = checkpointer.load_checkpoint()[training.MODEL_KEY]
        model = build_model(cfg.model, self._precision, self._device, is_lora=False)
        model.load_state_dict(base_state)
        self._initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ref_state = config.instantiate(
            cfg.ref_checkpointer, should_load_recipe_state=False
        ).load_checkpoint()[training.MODEL_KEY]
        # The recipe's reference: ``ref_checkpointer``'s weights, frozen, in the run's dtype.
        self._references = FrozenModels(
            cfg.model, ref_state, self._device, self._mesh.fsdp if self._mesh else None
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._rewards = build_rewards(cfg.rewards)
        self._sampling = SamplingSettings(
            max_generated_tokens=cfg.max_generated_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            stop_tokens=tuple(cfg.stop_token_ids or [self._tokenizer.eos_id]),
        )
        self._dataset = config.instantiate(cfg.dataset, self._tokenizer)
        for prompt in self._dataset:
            check_prompt(
                model,
                prompt["prompt_tokens"],
                prompt_index=prompt["index"],
                max_generated_tokens=cfg.max_generated_tokens,
            )
        prompts_per_step = self._global_completions // cfg.grpo_samples
        available = len(self._dataset) // prompts_per_step
        if self._num_steps > available:
            raise ValueError(
                f"config key 'parity.num_steps'={self._num_steps}: the dataset holds "
                f"{len(self._dataset)} prompts, enough for {available} rollout steps of "
                f"{prompts_per_step} prompts."
            )

    def train(self) -> None:
        """Per aggregation: its full-batch reference (and below fp32 the fp32 one), then every
        planned run, scored where it trained and gathered on rank 0."""
        reference_split = Split(self._global_completions, 1)
        plan = plan_runs(self._modes, self._micro_batchings, self._splits, reference_split)
        references = 1 if self._fp32_precision is None else 2
        self._num_runs = len(self._objectives()) * (references + len(plan))
        distributed.log_rank_zero(
            f"{self._num_runs} runs of {self._num_steps} rollout steps x {self._cfg.ppo_epochs} "
            f"PPO epochs: per loss_aggregation the full batch {reference_split} first, "
            f"{self._precision.describe()}"
        )
        run = 0
        for (loss_name, loss_section), aggregation in self._objectives():
            loss = build_policy_loss(loss_section)
            train = partial(self._train, loss, aggregation)
            run += 1
            reference = train(reference_split, NormMode.EXACT, MicroBatching.FIXED, run=run)
            initial = {n: self._initial_state[n].float().cpu() for n in reference.weights}
            fp32_reference, to_fp32 = None, None
            if self._fp32_precision is not None:
                run += 1
                fp32_reference = train(
                    reference_split,
                    NormMode.EXACT,
                    MicroBatching.FIXED,
                    run=run,
                    precision=self._fp32_precision,
                )
                to_fp32 = relative_l2(reference.weights, fp32_reference.weights, initial)
            sharded = [i for i, (_, _, split) in enumerate(plan) if split.num_ranks > 1]
            single = [i for i, (_, _, split) in enumerate(plan) if split.num_ranks == 1]
            local: dict[int, RunSummary] = {}
            for index in sharded + single[self._rank :: self._world_size]:
                mode, micro_batching, split = plan[index]
                trained = train(split, mode, micro_batching, run=run + index + 1)
                if trained.weights:  # a sharded run's weights are gathered on rank 0 only
                    local[index] = summarize(
                        trained,
                        reference,
                        initial,
                        fp32_reference,
                        compared_steps=self._cfg.ppo_epochs,  # the first rollout step's
                    )
            run += len(plan)
            summaries = [s for _, s in sorted(gather_summaries(local).items())]
            if self._rank == 0:
                objective = (loss_name, loss, aggregation)
                self._save(objective, reference, summaries, fp32_reference, to_fp32)

    def _objectives(self) -> list[tuple[tuple[str | None, Any], LossAggregation]]:
        """Each (loss, aggregation) the report trains: every listed loss under every listed
        aggregation (the loss's name is None for the config's own ``loss``)."""
        return [(loss, a) for loss in self._losses for a in self._aggregations]

    def _train(
        self,
        loss: PolicyLoss,
        aggregation: LossAggregation,
        split: Split,
        mode: NormMode,
        micro_batching: MicroBatching,
        *,
        run: int,
        precision: Precision | None = None,
    ) -> ParityRun:
        """One run from the initial weights, as the GRPO recipe steps."""
        precision = precision or self._precision
        reseed(self._seed)
        sharded = split.num_ranks > 1
        what = (
            f"run {run} of {self._num_runs}: {type(loss).__name__}, "
            f"loss_aggregation={aggregation.value}, {split} with "
            f"loss_normalization={mode.value}, micro_batching={micro_batching.value}"
        )
        if sharded:
            distributed.log_rank_zero(what)
            model = build_sharded_model(
                self._cfg.model,
                self._initial_state,
                precision,
                self._device,
                self._mesh.fsdp,
                is_lora=False,
            )
        else:
            log.info(f"rank {self._rank}: {what}" if self._world_size > 1 else what)
            model = build_model(self._cfg.model, precision, self._device, is_lora=False)
            model.load_state_dict(self._initial_state)
        num_prompts = split.batch_size * split.ga // self._cfg.grpo_samples
        settings = StepSettings.of(
            num_prompts=num_prompts,
            grpo_samples=self._cfg.grpo_samples,
            sampling=self._sampling,
            ppo_epochs=self._cfg.ppo_epochs,
            gradient_accumulation_steps=split.ga,
            micro_batching=micro_batching,
            micro_batch_tokens=self._cfg.parity.micro_batch_tokens,
            forward_batch_size=self._cfg.forward_batch_size,
            pad_id=self._tokenizer.pad_id,
            shaping=ShapingKeys.from_settings(self._cfg, loss),
        )
        optimizer = config.instantiate(self._cfg.optimizer, list(model.parameters()))
        lr_scheduler = None
        if self._cfg.lr_scheduler is not None:
            lr_scheduler = config.instantiate(
                self._cfg.lr_scheduler,
                optimizer,
                num_training_steps=self._num_steps * self._cfg.ppo_epochs,
            )
        dp_group = self._mesh.count_group() if sharded else None
        runtime = SplitRuntime(self._device, precision, dp_group)  # the rollouts'
        normalizer = LossNormalizer(
            None, mode=mode, dp_group=dp_group, units=loss_units_for(aggregation)
        )
        profiler = setup_profiler(  # timings off: the report compares numbers
            None,
            self._device,
            model,
            output_dir=self._cfg.output_dir,
            micro_batching=micro_batching.value,
            log_timings=False,
        )
        loss_step = partial(
            grpo_micro_batch_loss,
            model,
            aggregation=aggregation,
            loss=loss,
            max_generated_tokens=self._cfg.max_generated_tokens,
            num_completions=self._global_completions,
            precision=precision,
        )
        loader = build_prompt_loader(
            self._dataset,
            batch_size=num_prompts,
            shuffle=self._cfg.shuffle,
            num_replicas=split.num_ranks,
            rank=self._mesh["dp"].get_local_rank() if sharded else 0,
        )
        sync = None
        if sharded:  # the distributed recipes' default policy
            sync = partial(
                distributed.gradient_sync, model, distributed.GradientSync.EVERY_MICRO_BATCH
            )
        tally = RunTally()
        bar = tqdm(total=self._num_steps, desc=f"run {run}/{self._num_runs}", disable=self._rank)
        prompt_batches = iter(loader)
        for rollout_step in range(self._num_steps):
            prompts = next(prompt_batches, None)
            if prompts is None:  # dynamic sampling drew the epoch's last prompts
                break
            rollouts = make_rollouts(
                model,
                self._references.get(sharded=sharded, dtype=precision.compute_dtype),
                prompts,
                settings=settings,
                reward_components=self._rewards,
                tokenizer=self._tokenizer,
                step=rollout_step,
                seed=self._seed,
                runtime=runtime,
                more_prompts=partial(next, prompt_batches, None),
            )
            for window in ppo_epoch_windows(rollouts, settings, normalizer):
                train_window(
                    window,
                    model=model,
                    loss_step=loss_step,
                    optimizer=optimizer,
                    profiler=profiler,
                    device=self._device,
                    step=len(tally.losses) + 1,
                    clip_grad_norm=self._cfg.clip_grad_norm,
                    micro_batch_context=sync,
                    announce_skip=self._rank == 0 or not sharded,
                )
                if lr_scheduler is not None:
                    lr_scheduler.step()
                tally.add(window)
            bar.update(1)
        bar.close()
        if sharded:
            tally.reduce(dp_group, self._device)
        weights = trained_weights(model, adapters_only=False, keep=not sharded or self._rank == 0)
        return tally.run(mode.value, micro_batching.value, str(split), weights)

    def _save(
        self,
        objective: tuple[str | None, PolicyLoss, LossAggregation],
        reference: ParityRun,
        summaries: list[RunSummary],
        fp32_reference: ParityRun | None,
        reference_to_fp32: float | None,
    ) -> None:
        """Rank 0: the objective's report in ``parity/<name>/`` (the aggregation's name, after
        the loss's where ``parity.losses`` lists losses)."""
        loss_name, loss, aggregation = objective
        precision = PrecisionView(
            dtype=self._cfg.dtype,
            master_weights=self._cfg.master_weights.value,
            noise_floor=self._cfg.parity.noise_floor,
            reference_to_fp32=reference_to_fp32,
        )
        policy = PolicyObjective(
            aggregation=aggregation.value,
            grpo_samples=self._cfg.grpo_samples,
            ppo_epochs=self._cfg.ppo_epochs,
            rewards=tuple(reward_name(r) for r in self._rewards),
            loss=loss.describe(),
        )
        name = aggregation.value if loss_name is None else f"{loss_name}.{aggregation.value}"
        report = write_report(
            self._report_dir / name,
            reference=reference,
            summaries=summaries,
            precision=precision,
            micro_batch_tokens=self._cfg.parity.micro_batch_tokens,
            fp32_reference=fp32_reference,
            policy=policy,
        )
        self._reports[name] = {
            "report": str(report.relative_to(self._report_dir)),
            "verdict": verdict(summaries, precision),
            "table": markdown_table(summaries, reference, precision, "weights"),
            "loss": loss.describe(),
            "aggregation": aggregation.value,
        }

    def save_report(self) -> Path | None:
        """Rank 0 writes ``parity/report.md`` and ``summary.json`` over the aggregations."""
        if self._rank != 0:
            return None
        path = write_index(
            self._report_dir,
            self._reports,
            num_completions=self._global_completions,
            num_steps=self._num_steps,
            ppo_epochs=self._cfg.ppo_epochs,
        )
        log.info(f"Parity report: {path}")
        return path

    def cleanup(self) -> None:
        distributed.destroy()
