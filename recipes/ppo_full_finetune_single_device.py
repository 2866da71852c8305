"""PPO of a policy and a value model on one device, each optimizer step the full-PPO-batch step.

Proximal policy optimisation of every weight of a dense decoder (the policy) and of a classifier
with one output (the value model), against a frozen reference policy and a frozen reward model,
after torchtune 0.6.1's ``recipes/ppo_full_finetune_single_device.py`` (same keys; its configs
run unchanged). Each step takes ``batch_size`` prompts, generates one response to each, scores
it with the reward model, takes stock's KL-penalised rewards and GAE advantages over the whole
batch, then trains ``ppo_epochs`` passes of ``batch_size / ppo_batch_size`` optimizer steps.
What differs from stock: a PPO batch goes through ``gradient_accumulation_steps`` micro-batches
whose step is exactly the full-PPO-batch step (the policy term a mean over the PPO batch's
response tokens, the value term over its value positions, each counted by the one normaliser;
stock averages each micro-batch's own means), and the responses go through GRPO's generation
path, so they do not depend on the split. See [a PPO step] in ``exactga.ppo.trajectory``,
[policy and value terms] in ``exactga.ppo.loss`` and docs/ppo.md.

Launch from the repository root::

    tune run recipes/ppo_full_finetune_single_device.py \\
        --config configs/tiny/ppo_single_device.yaml

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import math
import sys
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig
from torchtune import config, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.accumulation.normalization import Window
from exactga.launch.cli import run_recipe
from exactga.ppo.loss import PpoMetrics, ResponseTokens, collate_trajectories, ppo_micro_batch_loss
from exactga.ppo.models import PolicyAndValue
from exactga.ppo.schema import (
    PPO_FINGERPRINT_KEYS,
    PpoFullFinetuneSingleDeviceConfig,
    loss_settings,
)
from exactga.ppo.trajectory import (
    StepModels,
    StepTrajectories,
    TrajectorySettings,
    make_trajectories,
    ppo_batch_windows,
    prompt_loader,
    trajectory_metrics,
)
from exactga.ppo.validation import held_out_ppo, ppo_validation_from_settings
from exactga.run.steps import StepBookSettings
from exactga.runtime.runtime import Runtime
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

RECIPE_NAME = "ppo_full_finetune_single_device"


class PPOFullFinetuneRecipeSingleDevice(FTRecipeInterface):
    """PPO of a policy and a value model on one device, exact under any split of a PPO batch.

    Features (each a config key; defaults in ``exactga.config.schemas`` and
    ``exactga.ppo.schema``):
        - Models: ``policy_model`` (trained; ``checkpointer``), ``reward_and_value_model`` built
          twice, the value model (trained; ``value_checkpointer``) and the reward model
          (frozen; ``reward_checkpointer``), and the frozen reference policy
          (``ref_policy_checkpointer``), each with its own checkpointer's weights.
        - Trajectories: one response per prompt, ``max_generated_tokens``, ``temperature``,
          ``top_k``, cut after the first of ``stop_token_ids``; no-grad forwards in chunks of
          ``forward_batch_size``; stock's ``min_response_length``, ``penalise_no_eos`` and
          ``reward_penalty``, the KL penalty ``kl_coeff``, GAE (``gamma``, ``lmbda``) with the
          advantages whitened over the batch, ``whiten_rewards``.
        - ``ppo_epochs`` passes of ``batch_size / ppo_batch_size`` optimizer steps, each over a
          PPO batch in ``gradient_accumulation_steps`` micro-batches (``micro_batching``),
          exact: the policy and value terms weighed by their own units over the PPO batch;
          ``naive`` in ``loss_normalization`` is stock's per-micro-batch means, a baseline.
        - ``loss`` is stock's ``PPOLoss`` section (``epsilon``, ``value_clip_range``,
          ``value_coeff``); precision, ``optimizer_in_bwd``, activation checkpointing,
          ``compile``, ``clip_grad_norm`` as in the full fine-tuning recipe.
        - Checkpoints at each epoch's end, the policy's and the value model's through their own
          checkpointers as stock; with ``save_every_n_steps`` (counted in trajectory steps)
          atomic step checkpoints that ``resume_from_checkpoint`` goes on from,
          bit-identically.
        - Validation during training (``dataset_val``: held-out prompts, any dataset section
          the recipe trains on; ``run_val_every_n_steps``, ``batch_size_val``,
          ``max_val_batches``): ``val/reward_mean`` (the reward model's score of one response
          to each held-out prompt, seeded by (seed, prompt row) only) and ``val/value_loss``
          over every value position (docs/validation.md); with ``keep_best_checkpoint`` the
          policy's and the value model's weights of each new highest ``val/reward_mean`` as
          epoch folders in ``best/`` and ``value/best/``.
        - Logging: ``loss`` (the exact PPO-batch loss), stock's ``policy_loss``,
          ``value_loss``, ``ratios``, ``clipfrac``, ``approx_policy_kl`` as exact means over
          the PPO batch, and stock's trajectory statistics (``scores``, ``rlhf_reward``, ``kl``,
          ``kl_reward``, ``num_stop_tokens``, ``response_lengths``).

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up.
    """

    def __init__(self, cfg: PpoFullFinetuneSingleDeviceConfig) -> None:
        # Device, precision policy, kernels, threads and the seed; see [setup order].
        self._runtime = Runtime.single_device(cfg)
        self._clip_grad_norm = cfg.clip_grad_norm
        self._loss_settings = loss_settings(cfg)
        self._temperature = cfg.temperature
        # Optimizer steps per trajectory step, and the run's trajectory steps (stock's keys).
        self._steps_per_batch = cfg.ppo_epochs * (cfg.batch_size // cfg.ppo_batch_size)
        self._trajectory_steps = cfg.num_steps // cfg.batch_size

    def setup(self, cfg: PpoFullFinetuneSingleDeviceConfig) -> None:
        # Resume point, metric logger, the policy's checkpointer and the weights it read.
        start = RunStart(cfg, self._runtime, PPO_FINGERPRINT_KEYS)
        policy = start.build_model(cfg.policy_model, start.full_weights(part="policy"))
        value_weights = start.trained_part_weights(cfg.value_checkpointer, part="value")
        value = start.build_model(cfg.reward_and_value_model, value_weights)
        self._model = PolicyAndValue(policy, value)  # one optimizer, one step, one checkpoint
        self._activations_ctx = start.activations_ctx
        # The frozen models, each with its own checkpointer's weights (also on resume).
        self._models = StepModels(
            policy=policy,
            value=value,
            reference=start.frozen_model(
                cfg.policy_model, cfg.ref_policy_checkpointer, "Reference"
            ),
            reward=start.frozen_model(
                cfg.reward_and_value_model, cfg.reward_checkpointer, "Reward"
            ),
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._settings = TrajectorySettings.from_settings(cfg, self._tokenizer)
        self._optimizer = start.build_optimizer(
            cfg.optimizer, self._model, in_backward=cfg.optimizer_in_bwd
        )
        # Two terms, each a mean over its own units across the PPO batch's micro-batches.
        self._normalizer = start.normalizer(None, units=ResponseTokens())
        self._ppo_metrics = PpoMetrics()
        self._trajectories: StepTrajectories | None = None  # the current step's, for its metrics
        self._dataloader = prompt_loader(
            cfg, self._tokenizer, policy, state_dict=start.dataloader_state()
        )
        # Validation during training (dataset_val; none without it): the reward model's score
        # and the value loss of held-out prompts' responses, see [PPO validation] in
        # exactga.ppo.validation.
        self._validation = ppo_validation_from_settings(
            cfg, tokenizer=self._tokenizer, policy=policy, metric_logger=start.metric_logger
        )
        # Checkpoints, scheduler, profiler, logs: set up last. Step checkpoints only fall
        # between trajectory steps, since trajectories are not saved.
        steps_per_epoch = min(len(self._dataloader), self._trajectory_steps)
        book_settings = StepBookSettings.from_settings(cfg)
        every = cfg.save_every_n_steps * self._steps_per_batch if cfg.save_every_n_steps else None
        self._run = start.training_run(
            self._model,
            self._optimizer,
            self._dataloader,
            self._normalizer,
            windows_per_epoch=steps_per_epoch * self._steps_per_batch,
            total_epochs=math.ceil(self._trajectory_steps / steps_per_epoch),
            book_settings=replace(book_settings, save_every_n_steps=every),
            window_metrics=self._window_metrics,
            validation=self._validation,  # its step checkpoints and keep_best_checkpoint
        )

    def _make_trajectories(self, prompts: list[dict[str, Any]], step: int) -> StepTrajectories:
        """Generate, score and give advantages to one step's responses; see [a PPO step]."""
        return make_trajectories(
            self._models,
            prompts,
            settings=self._settings,
            seed=self._run.progress.seed,
            step=step,
            device=self._runtime.device,
            precision=self._runtime.precision,
            phase=self._run.profiler.phase,
        )

    def _windows(self, trajectories: StepTrajectories, step: int) -> Any:
        """The step's optimizer steps: ``ppo_epochs`` shuffles cut into PPO batches."""
        return ppo_batch_windows(
            trajectories,
            self._settings,
            self._normalizer,
            seed=self._run.progress.seed,
            step=step,
            collate=lambda rows: collate_trajectories(rows, self._settings.pad_id),
        )

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        """The policy's log-probs at the response tokens, the value model's values at the
        value positions, and the micro-batch's two term means."""
        return ppo_micro_batch_loss(
            self._model.policy,
            self._model.value,
            batch,
            temperature=self._temperature,
            precision=self._runtime.precision,
            activations_ctx=self._activations_ctx,
            metrics=self._ppo_metrics,
            **self._loss_settings,
        )

    def train(self) -> None:
        progress = self._run.progress
        with self._run as steps:  # the profiler, the progress bar and the closing report
            for curr_epoch in steps.epochs():
                steps.open_epoch(curr_epoch)
                trajectory_steps_left = (
                    progress.windows_left_in(curr_epoch) // self._steps_per_batch
                )
                prompt_batches = iter(self._dataloader)
                for _ in range(trajectory_steps_left):
                    step = progress.global_step // self._steps_per_batch
                    trajectories = self._make_trajectories(next(prompt_batches), step)
                    self._trajectories = trajectories  # read by _window_metrics on logged steps
                    for window in steps.training(self._windows(trajectories, step)):
                        self._ppo_metrics.clear()  # this PPO batch's statistics
                        for batch in window:  # the PPO batch's micro-batches, on the device
                            loss = self._loss_step(batch)  # forward and mean loss: edit here
                            window.backward(loss)  # weighed by its exact share, then backward
                        outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                        steps.end_step(window, outcome)  # counters, scheduler, logs, checkpoints
                        self._validate_if_due(progress.global_step)  # run_val_every_n_steps
                self._validate_if_due(progress.global_step, epoch_end=True)
                next(prompt_batches, None)  # lets the loader see its end (its epoch position)
                steps.end_epoch(curr_epoch)

    def _validate_if_due(self, step: int, *, epoch_end: bool = False) -> None:
        """The reward mean and value loss of the held-out prompts' responses, when due; nothing
        without dataset_val. See [PPO validation] in exactga.ppo.validation."""
        if self._validation is None or not self._validation.due(step, epoch_end=epoch_end):
            return
        figure = held_out_ppo(
            self._models,
            self._validation.validation_set,
            settings=self._settings,
            seed=self._run.progress.seed,  # every validation draws the same numbers
            device=self._runtime.device,
            precision=self._runtime.precision,
        )
        self._validation.log(figure, step)  # val/reward_mean, val/value_loss, a console line

    def _window_metrics(self, window: Window) -> dict[str, float]:
        """What a logged step adds: stock's PPO statistics over the PPO batch, exact, and the
        step's trajectory statistics (the same for each of its optimizer steps)."""
        assert self._trajectories is not None, "a window is trained after its trajectories"
        trajectories = self._trajectories
        metrics = {**self._ppo_metrics.window_metrics(), **trajectory_metrics(trajectories)}
        if trajectories.generation_seconds:
            metrics["tokens_per_second_trajectory"] = (
                trajectories.num_tokens / trajectories.generation_seconds
            )
        return metrics

    def cleanup(self) -> None:
        self._run.close()  # the metric logger


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    cfg = validated_config(cfg, PpoFullFinetuneSingleDeviceConfig, RECIPE_NAME)
    recipe = PPOFullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
