"""GRPO with FSDP2 on one node or many, GPUs or CPUs, each step the full-batch step.

Group relative policy optimisation of every weight of a dense decoder, after torchtune
0.6.1's ``recipes/dev/grpo_full_finetune_distributed.py`` (same keys; that recipe imports
``torchtune.dev.grpo`` modules the pip package lacks). Each step takes ``batch_size`` prompts
per rank, generates ``grpo_samples`` completions of each with torchtune's ``generate`` and KV
cache, scores them with the config's ``rewards``, and trains ``ppo_epochs`` optimizer steps on
them. What differs from stock: the rollouts go through ``gradient_accumulation_steps``
micro-batches whose step is exactly the full-batch step for the chosen ``loss_aggregation``
(completion tokens or completions counted over every micro-batch and rank by the one
normaliser; stock has no accumulation and FSDP averages ranks with equal weight), and the
completions do not depend on the rank layout, so 1 rank and 4 ranks train the same step.
See [a GRPO step] in ``exactga.grpo.rollout_step``, [policy aggregations] in
``exactga.grpo.policy`` and docs/grpo.md.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/grpo_full_finetune_distributed.py \\
        --config configs/tiny/grpo_distributed.yaml

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import sys
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig
from torchtune import config, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.accumulation.normalization import Window
from exactga.grpo.losses import build_policy_loss
from exactga.grpo.policy import PolicyMetrics, grpo_micro_batch_loss, loss_units_for
from exactga.grpo.prompts import checked_prompt_loader
from exactga.grpo.rewards import build_rewards
from exactga.grpo.rollout_metrics import rollout_metrics
from exactga.grpo.rollout_step import StepSettings, make_rollouts
from exactga.grpo.rollouts import StepRollouts
from exactga.grpo.schema import GRPO_FINGERPRINT_KEYS, GrpoDistributedConfig
from exactga.grpo.validation import grpo_validation_from_settings, held_out_rewards
from exactga.grpo.windows import ppo_epoch_windows
from exactga.launch.cli import run_recipe
from exactga.run.steps import StepBookSettings
from exactga.runtime.runtime import Runtime
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

RECIPE_NAME = "grpo_full_finetune_distributed"


class GRPOFullFinetuneRecipeDistributed(FTRecipeInterface):
    """GRPO of every weight of a dense decoder with FSDP2, exact under any split.

    Policy and reference are sharded over the data-parallel ranks; the reference (weights from
    ``ref_checkpointer``, frozen at setup) is run under no_grad on each step's rollouts.

    Features (each a config key; defaults in ``exactga.config.schemas`` and
    ``exactga.grpo.schema``):
        - Rollouts: ``grpo_samples`` completions per prompt, ``max_generated_tokens``,
          ``temperature``, ``top_k``, ``stop_token_ids``, with randomness drawn from (seed,
          step, prompt, sample) only; see [rollouts independent of the rank layout] in
          ``exactga.generation.sampling``. Rewards are the config's ``rewards`` components, summed.
        - Exact accumulation over micro-batches and ranks for each ``loss_aggregation``
          (veRL's ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
          ``seq-mean-token-sum-norm``, ``token-sum``) and each policy ``loss`` (PPO-clip with
          asymmetric clipping, GSPO, CISPO; KL k1/k2/k3 in the loss or the reward): one
          all-reduce of the window's units per step, each micro-batch's mean scaled before
          backward; ``naive`` in ``loss_normalization`` is the per-micro-batch baseline, for
          the parity report.
        - DAPO's ``dynamic_sampling`` and ``overlong_buffer`` shaping, the same groups and
          rewards on any rank layout (exactga.grpo.shaping).
        - ``ppo_epochs`` optimizer steps per batch of rollouts; ``micro_batching`` of the
          rollouts, log-probs only at completion positions; precision, ``master_weights``,
          activation checkpointing, ``compile``, ``clip_grad_norm``, ``gradient_sync`` and
          the FSDP2 keys as in the full fine-tuning recipe.
        - Checkpoints of the policy at each epoch's end through torchtune's checkpoint client;
          with ``save_every_n_steps`` (counted in rollout steps) atomic step checkpoints that
          ``resume_from_checkpoint`` goes on from, bit-identically.
        - Validation during training (``dataset_val``: held-out prompts, any prompt dataset
          section; ``run_val_every_n_steps``, ``batch_size_val``, ``max_val_batches``):
          ``val/reward_mean`` and ``val/success_rate`` of ``grpo_samples`` completions of each
          held-out prompt over every rank, seeded by (seed, prompt row, completion) only, so the
          same on any rank layout and batch size (docs/validation.md); with
          ``keep_best_checkpoint`` the weights of each new highest ``val/reward_mean`` as an
          epoch folder in ``best/``.
        - Rank-0-only logging: ``loss`` (the exact window loss over all ranks), rewards mean,
          spread, components and success rate, completion lengths, ``policy/kl``,
          ``policy/clip_fraction``, and the phases (generate, reward, reference, forward,
          backward, optimizer) with generation and training tokens per second apart.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up.
    """

    def __init__(self, cfg: GrpoDistributedConfig) -> None:
        # Device, process group, data-parallel mesh, precision policy, kernels, threads and
        # the seed; see [setup order].
        self._runtime = Runtime.distributed(cfg)
        self._clip_grad_norm = cfg.clip_grad_norm
        # The RL keys (stock's names).
        self._ppo_epochs = cfg.ppo_epochs
        self._max_generated_tokens = cfg.max_generated_tokens
        self._loss_aggregation = cfg.loss_aggregation
        # The policy loss component (PPO-clip, GSPO, CISPO; stock's names are PPO-clip).
        self._loss = build_policy_loss(cfg.loss)
        # The step's completions over every rank: token-sum's C (see [policy aggregations]).
        self._num_completions = cfg.batch_size * cfg.grpo_samples * self._runtime.dp_size

    def setup(self, cfg: GrpoDistributedConfig) -> None:
        # Resume point, metric logger, torchtune's checkpoint client and the weights it read.
        start = RunStart(cfg, self._runtime, GRPO_FINGERPRINT_KEYS)
        self._model = start.build_model(cfg.model, start.full_weights())
        self._activations_ctx = start.activations_ctx  # activation offloading, or nothing
        # The frozen reference: ``model`` with ref_checkpointer's weights (also on resume, as
        # stock), sharded like the policy.
        self._ref_model = start.frozen_model(cfg.model, cfg.ref_checkpointer, "Reference")
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._step_settings = StepSettings.from_settings(
            cfg,
            pad_id=self._tokenizer.pad_id,
            eos_id=self._tokenizer.eos_id,
            loss=self._loss,
        )
        self._rewards = build_rewards(cfg.rewards)
        self._optimizer = start.build_optimizer(
            cfg.optimizer, self._model, in_backward=cfg.optimizer_in_bwd
        )
        # The policy loss is a mean over completion tokens or completions; the normaliser
        # weighs micro-batches by those units on every rank.
        self._normalizer = start.normalizer(None, units=loss_units_for(self._loss_aggregation))
        self._policy_metrics = PolicyMetrics(self._runtime.device)
        self._rollouts: StepRollouts | None = None  # the current step's, for its metrics
        # Prompts: batch_size per rank per step, dealt out of one shuffled order, so the
        # step's global batch is the same prompts on any number of ranks.
        self._dataloader = checked_prompt_loader(
            cfg,
            self._tokenizer,
            self._model,
            num_replicas=self._runtime.dp_size,
            rank=self._runtime.dp_rank,
            state_dict=start.dataloader_state(),
        )
        # Validation during training (dataset_val; none without it): the rewards of held-out
        # prompts' completions, see [GRPO validation] in exactga.grpo.validation.
        self._validation = grpo_validation_from_settings(
            cfg,
            tokenizer=self._tokenizer,
            model=self._model,
            runtime=self._runtime,  # this rank's rows of the held-out prompts
            metric_logger=start.metric_logger,
        )
        # Checkpoints, scheduler, profiler, logs: set up last. An epoch is at most num_steps
        # rollout steps, each ppo_epochs optimizer steps; step checkpoints only fall between
        # rollout steps, since the rollouts themselves are not saved.
        book_settings = StepBookSettings.from_settings(cfg)
        every = cfg.save_every_n_steps * cfg.ppo_epochs if cfg.save_every_n_steps else None
        self._run = start.training_run(
            self._model,
            self._optimizer,
            self._dataloader,
            self._normalizer,
            windows_per_epoch=min(len(self._dataloader), cfg.num_steps) * cfg.ppo_epochs,
            book_settings=replace(book_settings, save_every_n_steps=every),
            window_metrics=self._window_metrics,
            validation=self._validation,  # its step checkpoints and keep_best_checkpoint
        )

    def _make_rollouts(
        self, prompts: list[dict[str, Any]], rollout_step: int, more_prompts: Any
    ) -> StepRollouts:
        """Generate, score and record log-probs for one step's prompts on this rank (with
        dynamic sampling, further prompts from ``more_prompts``); see [a GRPO step] in
        exactga.grpo.rollout_step."""
        return make_rollouts(
            self._model,
            self._ref_model,
            prompts,
            settings=self._step_settings,
            reward_components=self._rewards,
            tokenizer=self._tokenizer,
            step=rollout_step,
            seed=self._run.progress.seed,  # the run's (an epoch checkpoint's on resume)
            runtime=self._runtime,  # the device, precision and ranks, as one
            phase=self._run.profiler.phase,
            more_prompts=more_prompts,
        )

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        """The policy's log-probs at completion positions, and the micro-batch's mean loss
        over its units."""
        return grpo_micro_batch_loss(
            self._model,
            batch,
            aggregation=self._loss_aggregation,
            loss=self._loss,
            max_generated_tokens=self._max_generated_tokens,
            num_completions=self._num_completions,
            precision=self._runtime.precision,
            activations_ctx=self._activations_ctx,
            metrics=self._policy_metrics,
        )

    def train(self) -> None:
        progress = self._run.progress
        with self._run as steps:  # the profiler, the progress bar and the closing report
            for curr_epoch in steps.epochs():
                steps.open_epoch(curr_epoch)
                rollout_steps_left = progress.windows_left_in(curr_epoch) // self._ppo_epochs
                prompt_batches = iter(self._dataloader)
                more_prompts = partial(next, prompt_batches, None)  # dynamic sampling's refill
                for _ in range(rollout_steps_left):
                    prompts = next(prompt_batches, None)
                    if prompts is None:  # dynamic sampling drew this epoch's last prompts
                        break
                    rollout_step = progress.global_step // self._ppo_epochs
                    rollouts = self._make_rollouts(prompts, rollout_step, more_prompts)
                    self._rollouts = rollouts  # read by _window_metrics on logged steps
                    windows = ppo_epoch_windows(rollouts, self._step_settings, self._normalizer)
                    for window in steps.training(windows):  # ppo_epochs passes over them
                        self._policy_metrics.clear()  # this pass's KL and clipping
                        for batch in window:  # this rank's micro-batches, on the device
                            loss = self._loss_step(batch)  # forward and mean loss: edit here
                            window.backward(loss)  # weighed by its exact share, then backward
                        outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                        steps.end_step(window, outcome)  # counters, scheduler, logs, checkpoints
                        self._validate_if_due(progress.global_step)  # run_val_every_n_steps
                self._validate_if_due(progress.global_step, epoch_end=True)
                next(prompt_batches, None)  # lets the loader see its end (its epoch position)
                steps.end_epoch(curr_epoch)

    def _validate_if_due(self, step: int, *, epoch_end: bool = False) -> None:
        """The reward mean and success rate of the held-out prompts' completions over every
        rank, when due; nothing without dataset_val. See [GRPO validation] in
        exactga.grpo.validation."""
        if self._validation is None or not self._validation.due(step, epoch_end=epoch_end):
            return
        figure = held_out_rewards(
            self._model,
            self._validation.validation_set,
            settings=self._step_settings,
            reward_components=self._rewards,
            tokenizer=self._tokenizer,
            seed=self._run.progress.seed,  # every validation draws the same numbers
            runtime=self._runtime,
        )
        self._validation.log(figure, step)  # val/reward_mean, val/success_rate, a console line

    def _window_metrics(self, window: Window) -> dict[str, float]:
        """What a logged step adds: the policy's KL and clipping over the window, and the
        rollouts' rewards and lengths (the same for each of a batch's PPO epochs)."""
        assert self._rollouts is not None, "a window is trained after its rollouts"
        metrics = self._policy_metrics.window_metrics(window.dp_group)
        rollouts = rollout_metrics(
            self._rollouts,
            window.dp_group,
            self._runtime.device,
            generation_seconds=self._rollouts.generation_seconds,
        )
        return {**metrics, **rollouts}

    def cleanup(self) -> None:
        self._run.close()  # the metric logger and the process group


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    cfg = validated_config(cfg, GrpoDistributedConfig, RECIPE_NAME)
    recipe = GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
