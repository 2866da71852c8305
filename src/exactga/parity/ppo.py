"""The GA parity report on a PPO config: every split of a PPO batch, exact and naive.

``recipes/ga_parity.py`` hands a config that sets ``ppo_batch_size`` to :class:`PpoParity`,
which trains it as recipes/ppo_full_finetune_single_device.py does (exactga.ppo's
``make_trajectories``, ``ppo_batch_windows`` and ``ppo_micro_batch_loss`` through the recipes'
``train_window``), first as the full PPO batch (``ppo_batch_size x 1``), then under every split
and mode, on one device, and scores the policy's and the value model's weights together with the
fine-tuning report's tables, verdict and figure (exactga.parity.report). See [ppo parity].

Note [ppo parity]
A split ``BxG`` counts trajectories of one PPO batch, so every split trains the same PPO batches
of the same trajectories at the first trajectory step, where every run holds the initial
weights: the responses, the recorded log-probs, values and scores, and the advantages are
computed once before any split (see [a PPO step] in exactga.ppo.trajectory). After it each run
generates from its own policy: an exact split's weights differ from the full batch's by rounding
only, but a baseline's moved elsewhere, so from the second trajectory step on it may train on
other responses. The report therefore checks that the runs counted the same units (response
tokens) over the first trajectory step's optimizer steps only. ``naive`` is stock PPO's
weighting: each micro-batch's policy and value means over ``G``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig
from torchtune import config, training, utils
from tqdm import tqdm

from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.step import train_window
from exactga.config.options import MicroBatching, NormMode
from exactga.data.loader import build_prompt_loader, load_dataset
from exactga.data.micro_batching import MicroBatchingSettings
from exactga.parity.ppo_schema import PpoParityConfig
from exactga.parity.report import write_report
from exactga.parity.runs import FrozenModels, RunTally, build_model, reseed, trained_weights
from exactga.parity.scoring import (
    SPLITS_KEY,
    ParityRun,
    PrecisionView,
    RunSummary,
    Split,
    parse_splits,
    plan_runs,
    summarize,
)
from exactga.ppo.loss import ResponseTokens, collate_trajectories, ppo_micro_batch_loss
from exactga.ppo.models import PolicyAndValue
from exactga.ppo.schema import loss_settings
from exactga.ppo.trajectory import (
    StepModels,
    TrajectorySettings,
    make_trajectories,
    ppo_batch_windows,
)
from exactga.profiling import setup_profiler
from exactga.runtime.precision import Precision

log = utils.get_logger("INFO")


class PpoParity:
    """Trains a PPO config under each split x mode and writes the report; see [ppo parity].

    Args:
        cfg: the typed settings of the validated config (``PpoParityConfig``; see
            [typed settings] in exactga.config.validation).

    Raises:
        ValueError: ``parity.splits`` that are not splits of one PPO batch, or more
            ``parity.num_steps`` than the prompts of one epoch hold.
    """

    def __init__(self, cfg: PpoParityConfig) -> None:
        self._cfg = cfg
        self._device = utils.get_device(device=cfg.device)
        dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._precision = Precision.from_config(dtype, cfg.master_weights, self._device)
        self._splits = parse_splits(PpoParityConfig.splits_for(cfg), world_size=1)
        for split in self._splits:
            if split.num_ranks != 1 or split.global_batch != cfg.ppo_batch_size:
                raise ValueError(
                    f"config key '{SPLITS_KEY}': {split} is not a split of one PPO batch of "
                    f"ppo_batch_size {cfg.ppo_batch_size} trajectories on one device (BxG with "
                    f"B x G = {cfg.ppo_batch_size})."
                )
        self._modes = PpoParityConfig.modes_for(cfg)
        self._micro_batchings = list(cfg.parity.micro_batching)
        self._num_steps = cfg.parity.num_steps
        self._steps_per_batch = cfg.ppo_epochs * (cfg.batch_size // cfg.ppo_batch_size)
        self._report_dir = Path(cfg.output_dir) / "parity"
        self._seed = training.set_seed(seed=cfg.seed)
        self._loss_settings = loss_settings(cfg)
        self._num_runs = 0
        self._path: Path | None = None

    def setup(self, cfg: PpoParityConfig) -> None:
        reseed(self._seed)

        def weights(cfg_checkpointer: DictConfig) -> dict:
            checkpointer = config.instantiate(cfg_checkpointer, should_load_recipe_state=False)
            state = checkpointer.load_checkpoint()[training.MODEL_KEY]
            state.pop("output.bias", None)  # torchtune's classifiers have none
            return state

        self._policy_state = weights(cfg.checkpointer)
        self._value_state = weights(cfg.value_checkpointer)
        self._reference = FrozenModels(
            cfg.policy_model, weights(cfg.ref_policy_checkpointer), self._device, None
        )
        self._reward = FrozenModels(
            cfg.reward_and_value_model, weights(cfg.reward_checkpointer), self._device, None
        )
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._settings = TrajectorySettings.from_settings(cfg, self._tokenizer)
        with torch.device("meta"):  # the policy's vocabulary, for the dataset's row checks
            vocab_size = config.instantiate(cfg.policy_model).tok_embeddings.num_embeddings
        self._dataset = load_dataset(cfg.dataset, self._tokenizer, vocab_size)
        available = len(self._dataset) // cfg.batch_size
        if self._num_steps > available:
            raise ValueError(
                f"config key 'parity.num_steps'={self._num_steps}: the dataset holds "
                f"{len(self._dataset)} prompts, enough for {available} trajectory steps of "
                f"batch_size {cfg.batch_size}."
            )

    def train(self) -> None:
        """The full PPO batch, then every planned run, scored against it."""
        reference_split = Split(self._cfg.ppo_batch_size, 1)
        plan = plan_runs(self._modes, self._micro_batchings, self._splits, reference_split)
        self._num_runs = 1 + len(plan)
        log.info(
            f"{self._num_runs} runs of {self._num_steps} trajectory steps x "
            f"{self._steps_per_batch} optimizer steps: the full PPO batch {reference_split} "
            f"first, {self._precision.describe()}"
        )
        reference = self._train(reference_split, NormMode.EXACT, MicroBatching.FIXED, run=1)
        initial = {
            **{f"policy.{k}": v.float().cpu() for k, v in self._policy_state.items()},
            **{f"value.{k}": v.float().cpu() for k, v in self._value_state.items()},
        }
        summaries: list[RunSummary] = []
        for index, (mode, micro_batching, split) in enumerate(plan):
            trained = self._train(split, mode, micro_batching, run=index + 2)
            summaries.append(
                summarize(trained, reference, initial, compared_steps=self._steps_per_batch)
            )
        precision = PrecisionView(
            dtype=self._cfg.dtype,
            master_weights=self._cfg.master_weights.value,
            noise_floor=self._cfg.parity.noise_floor,
            reference_to_fp32=None,
        )
        self._path = write_report(
            self._report_dir,
            reference=reference,
            summaries=summaries,
            precision=precision,
            micro_batch_tokens=self._cfg.parity.micro_batch_tokens,
        )

    def _train(
        self, split: Split, mode: NormMode, micro_batching: MicroBatching, *, run: int
    ) -> ParityRun:
        """One run from the initial weights, as the PPO recipe steps."""
        reseed(self._seed)
        log.info(
            f"run {run} of {self._num_runs}: {split} with loss_normalization={mode.value}, "
            f"micro_batching={micro_batching.value}"
        )
        precision, cfg = self._precision, self._cfg
        policy = build_model(cfg.policy_model, precision, self._device, is_lora=False)
        policy.load_state_dict(self._policy_state)
        value = build_model(cfg.reward_and_value_model, precision, self._device, is_lora=False)
        value.load_state_dict(self._value_state)
        models = PolicyAndValue(policy, value)
        dtype = precision.compute_dtype
        step_models = StepModels(
            policy=policy,
            value=value,
            reference=self._reference.get(sharded=False, dtype=dtype),
            reward=self._reward.get(sharded=False, dtype=dtype),
        )
        budget = micro_batching is MicroBatching.TOKEN_BUDGET
        settings = replace(
            self._settings,
            micro_batching=MicroBatchingSettings(
                micro_batching,
                batch_size=1 if budget else split.batch_size,
                micro_batch_tokens=cfg.parity.micro_batch_tokens,
            ),
        )
        optimizer = config.instantiate(cfg.optimizer, list(models.parameters()))
        normalizer = LossNormalizer(None, mode=mode, units=ResponseTokens())
        profiler = setup_profiler(  # timings off: the report compares numbers
            None,
            self._device,
            models,
            output_dir=cfg.output_dir,
            micro_batching=micro_batching.value,
            log_timings=False,
        )
        loss_step = partial(
            ppo_micro_batch_loss,
            policy,
            value,
            temperature=cfg.temperature,
            precision=precision,
            **self._loss_settings,
        )
        collate = partial(collate_trajectories, padding_idx=settings.pad_id)
        loader = build_prompt_loader(self._dataset, batch_size=cfg.batch_size, shuffle=cfg.shuffle)
        prompt_batches = iter(loader)
        tally = RunTally()
        for step in tqdm(range(self._num_steps), desc=f"run {run}/{self._num_runs}"):
            trajectories = make_trajectories(
                step_models,
                next(prompt_batches),
                settings=settings,
                seed=self._seed,
                step=step,
                device=self._device,
                precision=precision,
            )
            windows = ppo_batch_windows(
                trajectories, settings, normalizer, seed=self._seed, step=step, collate=collate
            )
            for window in windows:
                train_window(
                    window,
                    model=models,
                    loss_step=loss_step,
                    optimizer=optimizer,
                    profiler=profiler,
                    device=self._device,
                    step=len(tally.losses) + 1,
                    clip_grad_norm=cfg.clip_grad_norm,
                )
                tally.add(window)
        weights = trained_weights(models, adapters_only=False, keep=True)
        return tally.run(mode.value, micro_batching.value, str(split), weights)

    def save_report(self) -> Path | None:
        if self._path is not None:
            log.info(f"Parity report: {self._path}")
        return self._path

    def cleanup(self) -> None:
        pass
