"""Full DPO with FSDP2 on one node or many, GPUs or CPUs, each step the full-batch step.

A drop-in for torchtune 0.6.1's ``full_dpo_distributed``: its configs run unchanged and it
writes the same artefacts through torchtune's checkpoint client (rank 0). The reference is a
frozen copy of the model read from ``ref_checkpointer``, sharded like the policy and run under
no_grad. What differs: each step's loss is the mean per-pair DPO loss over every pair of the
window on every rank, whatever the split into ranks and micro-batches (stock divides each
micro-batch's mean by the accumulation count and lets FSDP average ranks); ``device: cpu``
runs (gloo), which stock 0.6.1 does not. See [pairs as loss units] in ``exactga.dpo.preference``
and docs/dpo.md.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/full_dpo_distributed.py \\
        --config configs/tiny/full_dpo_distributed.yaml
    tune run --nproc_per_node 8 recipes/full_dpo_distributed.py --config llama3_1/8B_full_dpo

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import sys
import time
from functools import partial

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config, training, utils
from torchtune.recipe_interfaces import FTRecipeInterface
from torchtune.training.checkpointing._checkpoint_client import CheckpointClient

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
    frozen_model_reference,
)
from exactga.dpo.reference_logprobs import with_precomputed_reference
from exactga.dpo.schema import FULL_DPO_FINGERPRINT_KEYS, FullDpoDistributedConfig
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

RECIPE_NAME = "full_dpo_distributed"


class FullDPORecipeDistributed(FTRecipeInterface):
    """Direct preference optimisation of every weight of a dense decoder with FSDP2.

    Policy and reference are sharded over the data-parallel ranks; the reference (weights from
    ``ref_checkpointer``, frozen at setup) runs under no_grad before the policy's forward.

    Features (each a config key; defaults in ``exactga.config.schemas`` and
    ``exactga.dpo.schema``):
        - Exact accumulation over pairs, micro-batches and data-parallel ranks: one all-reduce
          of the window's pair count per step, each micro-batch's mean loss over its pairs
          scaled by ``dp_size * batch_pairs / window_pairs`` before backward, which undoes
          FSDP's averaging; ``token_budget`` fillers as in the LoRA DPO recipe.
        - ``rpo_alpha`` (exactga): adds ``rpo_alpha`` times the chosen responses' NLL, a mean
          over the window's chosen tokens, weighted by its own units (RPO; exact where TRL
          averages per micro-batch); ``sequence_log_prob: mean`` length-normalises each
          response's log-prob (IPO, SimPO). Off by default: stock's loss, by the same code.
        - ``micro_batching`` on pairs per rank, log-probs only at response positions,
          ``loss_normalization`` (``exact`` or stock's ``naive``), precision and
          ``master_weights``, activation checkpointing (also selective with ``ac_mode``) and
          offloading, ``compile``, ``optimizer_in_bwd`` (ga = 1), ``clip_grad_norm``,
          ``gradient_sync``, FSDP2 keys: as in the full fine-tuning recipe.
        - Checkpoints of the policy at each epoch's end through torchtune's checkpoint client;
          with ``save_every_n_steps`` atomic step checkpoints that ``resume_from_checkpoint``
          goes on from with the next window on the same world size. The reference is never
          saved: it is read from ``ref_checkpointer`` again on resume.
        - ``nonfinite_loss``: a NaN/inf loss on any rank skips the step everywhere or stops.
        - Rank-0-only logging: ``loss`` (the exact window loss over all ranks), ``pairs``,
          stock's ``rewards/*`` and ``log_probs/*`` as means over the window's pairs on every
          rank, ``tokens_per_second_per_gpu`` (rank 0's own tokens, padding excluded); with
          ``rpo_alpha``, ``dpo_loss`` and ``chosen_nll``, the loss's two terms.

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
        # Pure data parallelism, as stock (the schema refuses tensor_parallel_dim > 1).
        self._mesh = distributed.build_device_mesh(self._device, tensor_parallel_dim=1)
        self.dp_size = self._mesh["dp"].size()
        self.dp_rank = self._mesh["dp"].get_local_rank()

        self._book_settings = StepBookSettings.from_config(cfg)  # logging, saving, non-finite

        self._optimizer_in_bwd = cfg.optimizer_in_bwd
        self._clip_grad_norm = cfg.clip_grad_norm
        self._loss_normalization = cfg.loss_normalization
        # What the loss is beyond the per-pair ``loss``: see exactga.dpo.preference.DpoTerms.
        self._dpo_terms = DpoTerms(rpo_alpha=cfg.rpo_alpha, sequence_log_prob=cfg.sequence_log_prob)
        self._compile = cfg.compile
        self._model_settings = ModelSettings.from_config(cfg, self._device)

        # Epochs, steps and their outcomes; a resume sets them in setup.
        self._progress = TrainingProgress(
            seed=training.set_seed(seed=cfg.seed, debug_mode=cfg.cudnn_deterministic_mode),
            total_epochs=cfg.epochs,
            max_steps_per_epoch=cfg.max_steps_per_epoch,
        )

    def setup(self, cfg: DictConfig) -> None:
        # Where to go on from: nothing, torchtune's epoch checkpoint or a step checkpoint.
        self._step_checkpointer, self._fingerprint, resume = start_run(
            cfg, FULL_DPO_FINGERPRINT_KEYS
        )
        # Rank 0's; a resumed run's curves go on in its run ([resumed TensorBoard run]).
        self._metric_logger = open_run_logger(cfg, resumed=resume.resumed)
        # torchtune's client reads the base weights, or with an epoch resume the epoch's.
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
        ref_model = self._setup_reference_model(cfg)  # held only by the reference below
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = build_optimizer(
            cfg.optimizer,
            self._model,
            in_backward=self._optimizer_in_bwd,
            state=resume.optimizer_state(ckpt_dict),
            sharded=True,
            device=self._device,
        )  # see [optimizer in backward]
        if resume.from_epoch_checkpoint and self._enable_async_checkpointing:
            # torchtune's distributed checkpoint loads weights and optimizer state in place.
            ckpt_dict = self._checkpoint_client.load_distributed_checkpoint(
                self._model, self._optimizer
            )
        resume.restore_progress(self._progress, ckpt_dict)

        # One loss per pair (with rpo_alpha also an NLL over the chosen tokens); the normaliser
        # weighs each term by its units on every rank.
        self._loss_fn = config.instantiate(cfg.loss)
        self._normalizer = LossNormalizer(
            self._loss_fn,
            mode=self._loss_normalization,
            dp_group=distributed.dp_group(self._mesh),
            units=self._dpo_terms.units(),
        )
        self._reference = frozen_model_reference(ref_model, self._precision)
        del ref_model  # precomputed log-probs replace the reference, and free the model
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
                dp_group=distributed.dp_group(self._mesh),
            )
        self._dataloader = dataloader_from_config(
            dataset,
            cfg,
            padding_idx=self._tokenizer.pad_id,
            ignore_idx=IGNORE_INDEX,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            rank_balancing=cfg.rank_balancing,
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
        distributed.cleanup_before_training(self._device)
        if self._compile:
            distributed.log_rank_zero("torch.compile is on: expect a slow first step.")
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
        outputs = "Checkpoints"
        report_outputs(self._profiler.summary(), self._checkpoint_dir, self._metric_logger, outputs)

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
            window_metrics=self._metrics.window_metrics,
            track=self._metrics.track,
        )

    def cleanup(self) -> None:
        close_metric_logger(self._metric_logger)
        distributed.destroy()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains."""
    cfg = validate_run_config(cfg, FullDpoDistributedConfig, RECIPE_NAME)
    if distributed.is_rank_zero():
        config.log_config(recipe_name="FullDPORecipeDistributed", cfg=cfg)
    recipe = FullDPORecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
