"""LoRA DPO on one device, whose every step is the full-batch step of its window.

A drop-in for torchtune 0.6.1's ``lora_dpo_single_device``: its configs run unchanged and it
writes the same artefacts (adapter weights in torchtune's and PEFT's format with
``adapter_config.json``; merged full weights unless ``save_adapter_weights_only``). The
reference is the policy with its adapters off. What differs is each optimizer step: the loss is
the mean of torchtune's per-pair ``DPOLoss`` (or ``RSOLoss``) over every pair of the window,
whatever the split into micro-batches, where stock divides each micro-batch's mean by the
accumulation count; see [pairs as loss units] in ``exactga.dpo.preference`` and docs/dpo.md.

Launch from the repository root (or any folder holding your copy of this file)::

    tune run recipes/lora_dpo_single_device.py --config configs/tiny/lora_dpo_single_device.yaml
    tune run recipes/lora_dpo_single_device.py --config llama3_1/8B_lora_dpo_single_device

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import sys
from functools import partial

import torch
import torchtune.modules.common_utils as common_utils
from omegaconf import DictConfig
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.optimizers import build_optimizer
from exactga.accumulation.step import StepContext
from exactga.data.loader import dataloader_from_config, load_dataset, model_vocab_size
from exactga.dpo.preference import (
    DpoTerms,
    PreferenceMetrics,
    collate_pairs,
    dpo_loss_step,
    lora_reference,
)
from exactga.dpo.reference_logprobs import with_precomputed_reference
from exactga.dpo.schema import DPO_FINGERPRINT_KEYS, LoraDpoSingleDeviceConfig
from exactga.launch.cli import run_recipe
from exactga.profiling import profiler_from_config
from exactga.run.metric_logging import close_metric_logger, open_run_logger, report_outputs
from exactga.run.progress import TrainingProgress, build_lr_scheduler
from exactga.run.resume import start_run, validate_run_config
from exactga.run.steps import StepBook, StepBookSettings
from exactga.run.threads import use_cpu_threads
from exactga.runtime.kernels import choose_attention_kernels
from exactga.runtime.precision import Precision
from exactga.setup.checkpoints import RunCheckpoints
from exactga.setup.lora import LoraSettings
from exactga.setup.model import AdapterWeights, ModelSettings, build_model

log = utils.get_logger("INFO")

RECIPE_NAME = "lora_dpo_single_device"


class LoRADPORecipeSingleDevice(FTRecipeInterface):
    """Direct preference optimisation of LoRA (DoRA, QLoRA) adapters on one device.

    The base weights are frozen; only the adapters train. The reference log-probs come from
    the same model with its adapters off, under no_grad, before the policy's forward.

    Features (each a config key; defaults in ``exactga.config.schemas`` and
    ``exactga.dpo.schema``):
        - Exact accumulation over pairs (``gradient_accumulation_steps``): each window's pairs
          are counted on the host and each micro-batch's mean loss over its pairs is scaled by
          ``batch_pairs / window_pairs`` before backward. An epoch's last, short window is a
          step of its own (``drop_partial_window: True`` drops it); stock leaks its leftover
          micro-batches' gradient into the next epoch's first step.
        - ``rpo_alpha`` (exactga): adds ``rpo_alpha`` times the chosen responses' NLL, a mean
          over the window's chosen tokens, weighted by its own units (RPO; exact where TRL
          averages per micro-batch); ``sequence_log_prob: mean`` length-normalises each
          response's log-prob (IPO, SimPO). Off by default: stock's loss, by the same code.
        - ``micro_batching`` on pairs: ``by_length`` (default: pairs sorted by their longer
          side), ``fixed`` (stock's order), ``token_budget`` (``micro_batch_tokens`` bounds
          the ``2 x pairs x longest`` positions of a micro-batch). Exact in every mode.
        - Log-probs only at response positions (the output projection runs nowhere else),
          each term in fp32 at least, summed in fp64.
        - ``loss_normalization``: ``exact`` (default) or ``naive``, stock's weighting (each
          micro-batch's mean over its pairs divided by the number of micro-batches).
        - Precision, ``master_weights``, activation checkpointing and offloading, ``compile``,
          ``clip_grad_norm``, schedulers, low-bit optimizers: as in the LoRA SFT recipe.
        - Checkpoints at each epoch's end as stock; with ``save_every_n_steps`` atomic step
          checkpoints that ``resume_from_checkpoint`` goes on from with the next window.
        - ``nonfinite_loss``: a NaN/inf loss skips the step (``skip``) or stops (``stop``).
        - Logging: ``loss`` (the exact window loss), ``lr``, ``pairs`` (the window's pairs),
          ``tokens_per_second_per_gpu`` (the pairs' own tokens, padding excluded), stock's
          ``rewards/*`` and ``log_probs/*`` as means over the window's pairs (stock logs the
          last micro-batch's), and the profiler's scalars. Stock's ``logits/*`` (means over
          every padded position's logits) are not logged: no logits exist off the responses.
          With ``rpo_alpha``: ``dpo_loss`` and ``chosen_nll``, the loss's two terms.

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
        self._cpu_threads = use_cpu_threads(cfg.cpu_threads)  # see [cpu threads]

        self._book_settings = StepBookSettings.from_config(cfg)  # logging, saving, non-finite

        self._save_adapter_weights_only = cfg.save_adapter_weights_only
        self._clip_grad_norm = cfg.clip_grad_norm
        self._loss_normalization = cfg.loss_normalization
        # What the loss is beyond the per-pair ``loss``: see exactga.dpo.preference.DpoTerms.
        self._dpo_terms = DpoTerms(rpo_alpha=cfg.rpo_alpha, sequence_log_prob=cfg.sequence_log_prob)
        self._compile = cfg.compile
        self._model_settings = ModelSettings.from_config(cfg, self._device)

        # LoRA settings, read from the model section as stock does.
        self._lora = LoraSettings.from_config(cfg.model)

        # Epochs, steps and their outcomes; a resume sets them in setup.
        self._progress = TrainingProgress(
            seed=training.set_seed(seed=cfg.seed, debug_mode=cfg.cudnn_deterministic_mode),
            total_epochs=cfg.epochs,
            max_steps_per_epoch=cfg.max_steps_per_epoch,
        )

    def setup(self, cfg: DictConfig) -> None:
        # Where to go on from: nothing, torchtune's epoch checkpoint or a step checkpoint.
        self._step_checkpointer, self._fingerprint, resume = start_run(cfg, DPO_FINGERPRINT_KEYS)
        # A resumed run's curves go on in its run ([resumed TensorBoard run]).
        self._metric_logger = open_run_logger(cfg, resumed=resume.resumed)
        self._checkpointer = self._precision.saving_in_dtype(  # adapters, merged: in dtype
            config.instantiate(
                cfg.checkpointer, should_load_recipe_state=resume.from_epoch_checkpoint
            )
        )
        ckpt_dict = self._checkpointer.load_checkpoint()  # the frozen base, always
        resume.restore_progress(self._progress, ckpt_dict)

        # torchtune's switch to the low-CPU-RAM version of the NF4 state-dict hook.
        common_utils._use_low_cpu_ram = cfg.low_cpu_ram
        # Built, adapters made trainable, cast, compiled, checkpointed and loaded in the one
        # order; see exactga.setup.model.
        built = build_model(
            cfg.model,
            AdapterWeights.at_start(
                self._lora, resume, ckpt_dict, cfg.checkpointer, self._progress.seed
            ),
            precision=self._precision,
            device=self._device,
            settings=self._model_settings,
            notes=(self._attention_kernels, self._cpu_threads),
        )
        self._model, self._activations_handling_ctx = built.model, built.activations_ctx
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer,
            self._model,
            state=resume.optimizer_state(ckpt_dict),
        )

        # One loss per pair (with rpo_alpha also an NLL over the chosen tokens); the normaliser
        # weighs each term by its units.
        self._loss_fn = config.instantiate(cfg.loss)
        self._normalizer = LossNormalizer(
            self._loss_fn, mode=self._loss_normalization, units=self._dpo_terms.units()
        )
        self._reference = lora_reference(self._model, self._precision)
        self._metrics = PreferenceMetrics(self._device, self._dpo_terms)

        # Data order, row checks and loader position: see [data order] in exactga.data.loader.
        dataset = load_dataset(cfg.dataset, self._tokenizer, model_vocab_size(self._model))
        # See [precomputed reference] in exactga.dpo.reference_logprobs.
        if cfg.precompute_reference_logprobs:
            self._reference, dataset = with_precomputed_reference(
                self._reference,
                dataset,
                collate=partial(collate_pairs, padding_idx=self._tokenizer.pad_id),
                batch_size=cfg.batch_size,
                device=self._device,
            )
        self._dataloader = dataloader_from_config(
            dataset,
            cfg,
            padding_idx=self._tokenizer.pad_id,
            ignore_idx=IGNORE_INDEX,
            state_dict=resume.dataloader_state(ckpt_dict),
        )
        self._progress.start(
            len(self._dataloader),  # windows per epoch
            resumed_mid_run=resume.from_step_checkpoint,
        )

        self._checkpoints = RunCheckpoints(
            self._progress,
            self._step_checkpointer,
            self._fingerprint,
            self._device,
            epoch_writer=self._checkpointer,
            lora=self._lora,
            adapter_only=self._save_adapter_weights_only,
        )
        self._lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self._optimizer, self._progress)
        # Phase timings on every rank; traces, snapshots and the report on rank 0.
        self._profiler = profiler_from_config(cfg, self._device, self._model, self._metric_logger)
        self._checkpoint_dir = cfg.checkpointer.output_dir
        resume.restore_rng(self._device)  # last: model and data setup above draw from the RNGs

    def save_checkpoint(self, epoch: int) -> None:
        """The epoch's checkpoint, as stock writes it."""
        self._checkpoints.save_epoch(self._model, self._optimizer, epoch)

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Reference and policy log-probs, and the mean DPO loss over the micro-batch's pairs."""
        return dpo_loss_step(
            self._model,
            self._loss_fn,
            batch,
            self._reference,
            terms=self._dpo_terms,
            metrics=self._metrics,
            precision=self._precision,
            activations_ctx=self._activations_handling_ctx,
        )

    def train(self) -> None:
        if self._compile:
            log.info("torch.compile is on: expect a slow first step while it compiles.")
        self._optimizer.zero_grad()
        progress = self._progress
        steps = self._step_book()
        with self._profiler:
            for curr_epoch in progress.epochs():
                for window in steps.windows(curr_epoch):
                    for batch in window:  # this rank's micro-batches, on the device
                        loss = self._loss_step(batch)  # forward and mean loss: edit here
                        window.backward(loss)  # weighed by its exact share, then backward
                    outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                    report = steps.end_step(window, outcome)  # .loss: on logged steps
                    log.debug("step %d: loss %s", report.step, report.loss)  # print() is bar-safe
                steps.end_epoch(curr_epoch)
        outputs = "Adapters and checkpoints"
        report_outputs(self._profiler.summary(), self._checkpoint_dir, self._metric_logger, outputs)

    def _step_book(self) -> StepBook:
        """The loop's bookkeeping: counters, scheduler, non-finite policy, logs and
        checkpoints, in the one order; see [step bookkeeping] in ``exactga.run.steps``."""
        return StepBook(
            self._progress,
            context=StepContext(self._model, self._device, self._profiler),
            dataloader=self._dataloader,
            normalizer=self._normalizer,
            optimizer=self._optimizer,
            lr_scheduler=self._lr_scheduler,
            settings=self._book_settings,
            checkpoints=self._checkpoints,
            metric_logger=self._metric_logger,
            window_metrics=self._metrics.window_metrics,
            track=self._metrics.track,
        )

    def cleanup(self) -> None:
        close_metric_logger(self._metric_logger)


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains."""
    cfg = validate_run_config(cfg, LoraDpoSingleDeviceConfig, RECIPE_NAME)
    config.log_config(recipe_name="LoRADPORecipeSingleDevice", cfg=cfg)
    recipe = LoRADPORecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
