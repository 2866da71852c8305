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
See [a GRPO step] in ``exactga.grpo.step``, [three policy denominators] in ``exactga.grpo.policy``
and docs/grpo.md.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/grpo_full_finetune_distributed.py \\
        --config configs/tiny/grpo_distributed.yaml

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import sys
import time
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training.checkpointing._checkpoint_client import CheckpointClient

from exactga.accumulation.normalization import LossNormalizer, Window
from exactga.accumulation.optimizers import build_optimizer
from exactga.accumulation.step import StepContext
from exactga.data.loader import build_prompt_loader
from exactga.grpo.policy import PolicyMetrics, grpo_loss_step, loss_units_for
from exactga.grpo.rewards import build_rewards
from exactga.grpo.rollouts import SamplingSettings, check_prompt
from exactga.grpo.schema import GRPO_FINGERPRINT_KEYS, GrpoDistributedConfig, loss_settings
from exactga.grpo.step import (
    StepRollouts,
    StepSettings,
    make_rollouts,
    ppo_windows,
    rollout_metrics,
)
from exactga.launch.cli import run_recipe
from exactga.profiling import profiler_from_config
from exactga.run.metric_logging import close_metric_logger, open_run_logger, report_outputs
from exactga.run.progress import TrainingProgress, build_lr_scheduler
from exactga.run.resume import start_run, validate_run_config
from exactga.run.steps import StepBook, StepBookSettings
from exactga.run.threads import use_cpu_threads
from exactga.runtime import distributed
from exactga.runtime.kernels import choose_attention_kernels
from exactga.runtime.precision import Precision
from exactga.setup.checkpoints import RunCheckpoints
from exactga.setup.frozen import build_frozen_model
from exactga.setup.model import FullWeights, ModelSettings, Parallelism, build_model

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
          ``exactga.grpo.rollouts``. Rewards are the config's ``rewards`` components, summed.
        - Exact accumulation over micro-batches and ranks for each ``loss_aggregation``
          (``token_mean``, ``sequence_mean``, ``constant``): one all-reduce of the window's
          units per step, each micro-batch's mean scaled before backward; ``naive`` in
          ``loss_normalization`` is the per-micro-batch baseline, for the parity report.
        - ``ppo_epochs`` optimizer steps per batch of rollouts; ``micro_batching`` of the
          rollouts, log-probs only at completion positions; precision, ``master_weights``,
          activation checkpointing, ``compile``, ``clip_grad_norm``, ``gradient_sync`` and
          the FSDP2 keys as in the full fine-tuning recipe.
        - Checkpoints of the policy at each epoch's end through torchtune's checkpoint client;
          with ``save_every_n_steps`` (counted in rollout steps) atomic step checkpoints that
          ``resume_from_checkpoint`` goes on from, bit-identically.
        - Rank-0-only logging: ``loss`` (the exact window loss over all ranks), rewards mean,
          spread, components and success rate, completion lengths, ``policy/kl``,
          ``policy/clip_fraction``, and the phases (generate, reward, reference, forward,
          backward, optimizer) with generation and training tokens per second apart.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._precision = Precision.from_config(self._dtype, cfg.master_weights, self._device)
        self._attention_kernels = choose_attention_kernels(cfg.cudnn_attention, self._device)
        self._cpu_threads = use_cpu_threads(  # see [cpu threads]
            cfg.cpu_threads, optimizer_on_cpu=cfg.fsdp_cpu_offload and self._device.type != "cpu"
        )
        self._gradient_sync = cfg.gradient_sync

        self._enable_async_checkpointing = cfg.enable_async_checkpointing
        self._fsdp_cpu_offload = cfg.fsdp_cpu_offload and self._device.type != "cpu"
        distributed.init_distributed(
            self._device,
            offload_ops_to_cpu=self._fsdp_cpu_offload or self._enable_async_checkpointing,
        )
        self.world_size, self.rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self.rank == 0
        self._mesh = distributed.build_device_mesh(self._device, tensor_parallel_dim=1)
        self.dp_size = self._mesh["dp"].size()
        self.dp_rank = self._mesh["dp"].get_local_rank()

        self._optimizer_in_bwd = cfg.optimizer_in_bwd
        self._clip_grad_norm = cfg.clip_grad_norm
        self._loss_normalization = cfg.loss_normalization
        self._compile = cfg.compile
        self._model_settings = ModelSettings.from_config(cfg, self._device)

        # The RL keys (stock's names).
        self._batch_size = cfg.batch_size
        self._ppo_epochs = cfg.ppo_epochs
        self._max_generated_tokens = cfg.max_generated_tokens
        self._loss_aggregation = cfg.loss_aggregation
        self._loss_settings = loss_settings(cfg)
        # Step checkpoints only between rollout steps: the rollouts themselves are not saved.
        self._book_settings = replace(  # logging, saving, non-finite
            StepBookSettings.from_config(cfg),
            save_every_n_steps=cfg.save_every_n_steps * cfg.ppo_epochs
            if cfg.save_every_n_steps
            else None,
        )

        # Epochs, steps and their outcomes; a resume sets them in setup. An epoch is at most
        # num_steps rollout steps, each ppo_epochs optimizer steps.
        self._num_steps = cfg.num_steps
        self._progress = TrainingProgress(
            seed=training.set_seed(seed=cfg.seed, debug_mode=cfg.cudnn_deterministic_mode),
            total_epochs=cfg.epochs,
            max_steps_per_epoch=cfg.max_steps_per_epoch,
        )

    def setup(self, cfg: DictConfig) -> None:
        # Where to go on from: nothing, torchtune's epoch checkpoint or a step checkpoint.
        self._step_checkpointer, self._fingerprint, resume = start_run(cfg, GRPO_FINGERPRINT_KEYS)
        # Rank 0's; a resumed run's curves go on in its run ([resumed TensorBoard run]).
        self._metric_logger = open_run_logger(cfg, resumed=resume.resumed)
        self._checkpoint_client = self._precision.saving_in_dtype(  # weights for users in dtype
            CheckpointClient(
                OmegaConf.merge(cfg, {"resume_from_checkpoint": resume.from_epoch_checkpoint})
            )
        )
        ckpt_dict = self._checkpoint_client.load_base_checkpoint()
        # Built, cast, compiled, checkpointed, sharded and loaded in the one order; see
        # exactga.setup.model.
        built = build_model(
            cfg.model,
            FullWeights(resume.model_weights(ckpt_dict), resume.weights_source(cfg.checkpointer)),
            precision=self._precision,
            device=self._device,
            settings=self._model_settings,
            parallelism=Parallelism(dp_mesh=self._mesh["dp"]),
            notes=(self._attention_kernels, self._cpu_threads),
        )
        self._model, self._activations_handling_ctx = built.model, built.activations_ctx
        self._ref_model = self._setup_reference_model(cfg)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._step_settings = StepSettings.of(
            num_prompts=cfg.batch_size,
            grpo_samples=cfg.grpo_samples,
            sampling=SamplingSettings(
                max_generated_tokens=cfg.max_generated_tokens,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                stop_tokens=tuple(cfg.stop_token_ids or [self._tokenizer.eos_id]),
            ),
            ppo_epochs=cfg.ppo_epochs,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            micro_batching=cfg.micro_batching,
            micro_batch_tokens=cfg.micro_batch_tokens,
            forward_batch_size=cfg.forward_batch_size,
            pad_id=self._tokenizer.pad_id,
        )
        self._rewards = build_rewards(cfg.rewards)
        self._optimizer = build_optimizer(
            cfg.optimizer,
            self._model,
            in_backward=self._optimizer_in_bwd,
            state=resume.optimizer_state(ckpt_dict),
            sharded=True,
            device=self._device,
        )  # see [optimizer in backward]
        resume.restore_progress(self._progress, ckpt_dict)

        # The policy loss is a mean over completion tokens or completions; the normaliser
        # weighs micro-batches by those units on every rank.
        self._normalizer = LossNormalizer(
            None,
            mode=self._loss_normalization,
            dp_group=distributed.dp_group(self._mesh),
            units=loss_units_for(self._loss_aggregation),
        )
        self._policy_metrics = PolicyMetrics(self._device)
        self._rollouts: StepRollouts | None = None  # the current step's, for its metrics

        # Prompts: batch_size per rank per step, dealt out of one shuffled order, so the
        # step's global batch is the same prompts on any number of ranks.
        dataset = config.instantiate(cfg.dataset, self._tokenizer)
        for prompt in dataset:  # every rank fails alike at start-up, not one rank mid-run
            check_prompt(
                self._model,
                prompt["prompt_tokens"],
                prompt_index=prompt["index"],
                max_generated_tokens=self._max_generated_tokens,
            )
        self._dataloader = build_prompt_loader(
            dataset,
            batch_size=self._batch_size,
            shuffle=cfg.shuffle,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            state_dict=resume.dataloader_state(ckpt_dict),
        )
        rollout_steps = min(len(self._dataloader), self._num_steps)
        self._progress.start(
            rollout_steps * self._ppo_epochs,  # optimizer steps per epoch
            resumed_mid_run=resume.from_step_checkpoint,
        )

        self._checkpoints = RunCheckpoints(
            self._progress,
            self._step_checkpointer,
            self._fingerprint,
            self._device,
            epoch_writer=self._checkpoint_client,
            sharded=True,
        )
        self._lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self._optimizer, self._progress)
        # Phase timings on every rank; traces, snapshots and the report on rank 0.
        self._profiler = profiler_from_config(cfg, self._device, self._model, self._metric_logger)
        self._checkpoint_dir = cfg.checkpointer.output_dir
        resume.restore_rng(self._device)  # last: model and data setup above draw from the RNGs

    def _setup_reference_model(self, cfg: DictConfig) -> nn.Module:
        """The frozen reference: ``model`` with the weights of ``ref_checkpointer`` (stock's
        rule: the original weights, also on resume), sharded like the policy, never saved."""
        t0 = time.perf_counter()
        ref_state = config.instantiate(
            cfg.ref_checkpointer, should_load_recipe_state=False
        ).load_checkpoint()
        ref_model = build_frozen_model(
            cfg.model,
            ref_state[training.MODEL_KEY],
            dtype=self._dtype,
            device=self._device,
            dp_mesh=self._mesh["dp"],
            custom_sharded_layers=cfg.custom_sharded_layers,
            cpu_offload=self._fsdp_cpu_offload,
            reshard_after_forward=cfg.fsdp_reshard_after_forward,
            compile_model=self._compile,
            verbose=self._is_rank_zero,
        )
        distributed.log_rank_zero(
            f"Reference built, sharded over dp={self.dp_size} and loaded in "
            f"{time.perf_counter() - t0:.2f} s, precision {self._dtype}; frozen."
        )
        distributed.barrier()
        return ref_model

    def save_checkpoint(self, epoch: int) -> None:
        """The epoch's checkpoint, as stock writes it (every rank calls this)."""
        self._checkpoints.save_epoch(self._model, self._optimizer, epoch)

    def _make_rollouts(self, prompts: list[dict[str, Any]], rollout_step: int) -> StepRollouts:
        """Generate, score and record log-probs for one step's prompts on this rank; see
        [a GRPO step] in exactga.grpo.step."""
        return make_rollouts(
            self._model,
            self._ref_model,
            prompts,
            settings=self._step_settings,
            reward_components=self._rewards,
            tokenizer=self._tokenizer,
            seed=self._progress.seed,
            step=rollout_step,
            device=self._device,
            run_full_length=self.dp_size > 1,  # every rank runs as many forwards
            precision=self._precision,
            phase=self._profiler.phase,
        )

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The policy's log-probs at completion positions, and the micro-batch's mean loss
        over its units."""
        return grpo_loss_step(
            self._model,
            batch,
            aggregation=self._loss_aggregation,
            max_generated_tokens=self._max_generated_tokens,
            precision=self._precision,
            activations_ctx=self._activations_handling_ctx,
            metrics=self._policy_metrics,
            **self._loss_settings,
        )

    def train(self) -> None:
        distributed.cleanup_before_training(self._device)
        if self._compile:
            distributed.log_rank_zero("torch.compile is on: expect a slow first step.")
        self._optimizer.zero_grad()
        progress = self._progress
        steps = self._step_book()
        with self._profiler:
            for curr_epoch in progress.epochs():
                steps.open_epoch(curr_epoch)
                rollout_steps_left = progress.windows_left_in(curr_epoch) // self._ppo_epochs
                prompt_batches = iter(self._dataloader)
                for _ in range(rollout_steps_left):
                    prompts = next(prompt_batches)
                    rollout_step = progress.global_step // self._ppo_epochs
                    rollouts = self._make_rollouts(prompts, rollout_step)
                    self._rollouts = rollouts  # read by _window_metrics on logged steps
                    for window in steps.training(
                        ppo_windows(rollouts, self._step_settings, self._normalizer)
                    ):
                        self._policy_metrics.clear()  # this pass's KL and clipping
                        for batch in window:  # this rank's micro-batches, on the device
                            loss = self._loss_step(batch)  # forward and mean loss: edit here
                            window.backward(loss)  # weighed by its exact share, then backward
                        outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                        report = steps.end_step(window, outcome)  # .loss: on logged steps
                        log.debug(
                            "step %d: loss %s", report.step, report.loss
                        )  # print() is bar-safe
                next(
                    prompt_batches, None
                )  # lets the loader see its end, as exactga.accumulation.normalization
                steps.end_epoch(curr_epoch)
        outputs = "Checkpoints"
        report_outputs(self._profiler.summary(), self._checkpoint_dir, self._metric_logger, outputs)

    def _window_metrics(self, window: Window) -> dict[str, float]:
        """What a logged step adds: the policy's KL and clipping over the window, and the
        rollouts' rewards and lengths (the same for each of a batch's PPO epochs)."""
        assert self._rollouts is not None, "a window is trained after its rollouts"
        metrics = self._policy_metrics.window_metrics(window.dp_group)
        rollouts = rollout_metrics(
            self._rollouts,
            window.dp_group,
            self._device,
            generation_seconds=self._rollouts.generation_seconds,
        )
        return {**metrics, **rollouts}

    def _step_book(self) -> StepBook:
        """The loop's bookkeeping: counters, scheduler, non-finite policy, logs and
        checkpoints, in the one order; see [step bookkeeping] in ``exactga.run.steps``."""
        return StepBook(
            self._progress,
            context=StepContext(
                self._model,
                self._device,
                self._profiler,
                partial(distributed.gradient_sync, self._model, self._gradient_sync),
                announce_skip=self._is_rank_zero,
            ),
            dataloader=self._dataloader,
            normalizer=self._normalizer,
            optimizer=self._optimizer,
            lr_scheduler=self._lr_scheduler,
            settings=self._book_settings,
            checkpoints=self._checkpoints,
            metric_logger=self._metric_logger,
            window_metrics=self._window_metrics,
        )

    def cleanup(self) -> None:
        close_metric_logger(self._metric_logger)
        distributed.destroy()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains."""
    cfg = validate_run_config(cfg, GrpoDistributedConfig, RECIPE_NAME)
    if distributed.is_rank_zero():
        config.log_config(recipe_name="GRPOFullFinetuneRecipeDistributed", cfg=cfg)
    recipe = GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
