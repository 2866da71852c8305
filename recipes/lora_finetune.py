"""LoRA and QLoRA fine-tuning with exact gradient accumulation, on one device or with FSDP2 on
every rank of one node or many, GPUs or CPUs.

A drop-in for torchtune 0.6.1's ``lora_finetune_single_device`` and ``lora_finetune_distributed``:
this one file runs under both names (``tune ls``: ``exactga/<name>``), and their configs run
unchanged, with the same artefacts, written by rank 0 (adapter weights in torchtune's format and,
through the checkpointer, in PEFT's format with ``adapter_config.json``; merged full weights unless
``save_adapter_weights_only``). Only the adapters train. Under torchrun it trains on every rank,
else on one device (or as one rank, launched as the distributed name or with a distributed
config): see [one recipe, two launches] in exactga.launch.twins. What differs from stock: the loss
of each optimizer step is exactly the full-batch loss of the window over every data-parallel
rank, whatever the split into ranks and micro-batches, with no pass over the gradients; ranks may
hold very different token counts, or none; ``device: cpu`` runs distributed (gloo), which stock
0.6.1 does not; the initial adapters do not depend on the number of ranks; and gradients may be
reduced once per window instead of after every micro-batch (``gradient_sync``). See
``exactga.accumulation.normalization``, docs/math.md, docs/lora_finetune_single_device.md and
docs/lora_finetune_distributed.md.

Launch from the repository root (or any folder holding your copy of this file)::

    tune run recipes/lora_finetune.py --config configs/tiny/lora_single_device.yaml
    tune run recipes/lora_finetune.py --config configs/tiny/qlora_single_device.yaml
    tune run recipes/lora_finetune.py \\
        --config configs/llama3_2/1B_lora_single_device.yaml gradient_accumulation_steps=16
    tune run --nproc_per_node 2 recipes/lora_finetune.py --config configs/tiny/lora_distributed.yaml
    # several nodes: the same command on each, through torchrun's rendezvous
    tune run --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \\
        --rdzv_endpoint HOST:29500 --rdzv_id JOB recipes/lora_finetune.py --config llama3_1/70B_lora

Copy this file to change the loop (``tune cp exactga/lora_finetune_single_device my.py``; the
distributed name copies the same file); the numerics stay in ``exactga``.
"""

import sys

import torch
from omegaconf import DictConfig
from torchtune import config, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.config.schemas import LORA_FINETUNE, LoraFinetuneConfig
from exactga.data.loader import load_dataset, model_vocab_size
from exactga.launch.cli import run_recipe
from exactga.lora.adapters import LoraSettings
from exactga.model_build.trained import build_loss
from exactga.runtime.runtime import Runtime
from exactga.sft.loss import causal_lm_loss
from exactga.sft.router_balance import RouterBalance
from exactga.sft.validation import validation_loss
from exactga.validation.held_out import validation_from_settings
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

# The family of torchtune's two names for this file: lora_finetune_single_device and
# lora_finetune_distributed (see [one recipe, two launches] in exactga.launch.twins).
RECIPE_NAME = "lora_finetune"


class LoRAFinetuneRecipe(FTRecipeInterface):
    """LoRA, DoRA and QLoRA fine-tuning of a dense decoder on one device (GPU or CPU), or with
    FSDP2 on every rank.

    The base weights are frozen (NF4-quantised with a ``qlora_*`` builder or
    ``quantize_base: True``); only the adapter parameters get gradients and optimizer state, and
    only they are reduced across ranks.

    Features (each a config key; defaults in ``exactga.config.schemas``):
        - Exact gradient accumulation (``gradient_accumulation_steps``): each window of micro-
          batches is prefetched, its loss tokens counted on the host after the label shift, and
          each micro-batch loss scaled by ``batch_tokens / window_tokens`` before backward. With
          one micro-batch no scaling op runs at all. An epoch's last, short window is a step of
          its own (``drop_partial_window: True`` drops it); a window without a loss token skips
          the optimizer step and is counted in the ``skipped_steps`` metric.
        - Distributed, exact over micro-batches *and* data-parallel ranks, as in
          recipes/full_finetune.py: one all-reduce of the window's loss-token count over the
          data-parallel group per step, each micro-batch loss scaled by ``dp_size *
          batch_tokens / window_tokens`` before backward; an empty micro-batch still runs with
          weight 0, and a window empty on every rank skips its step (``skipped_steps``).
        - ``gradient_sync`` (distributed): ``every_micro_batch`` (default, as stock) or
          ``once_per_window`` (one reduce-scatter of the adapter gradients per step).
        - FSDP2 through torchtune's ``shard_model`` over the data-parallel mesh (stock LoRA has
          no tensor parallelism): ``fsdp_cpu_offload``, ``fsdp_reshard_after_forward``,
          ``custom_sharded_layers``.
        - ``loss_normalization``: ``exact`` (default); ``post_scale`` (stock torchtune) and
          ``naive`` (mean of micro-batch means) exist for benchmarks and parity reports.
        - ``micro_batching``: how each window's samples are cut into micro-batches (per rank),
          exact in every mode: ``by_length`` (default: sorted by length, least padding),
          ``fixed`` (the loader's order, as stock), ``token_budget`` (``micro_batch_tokens``
          padded positions per micro-batch). Logs ``throughput/padding_fraction``; see
          docs/micro_batching.md.
        - Precision (``dtype``: fp32 or bf16), activation checkpointing and offloading,
          ``compile``, ``clip_grad_norm``, learning-rate schedulers, low-bit optimizers
          (``torchao.optim.AdamW8bit``, bitsandbytes): as in torchtune. Under bf16 the
          adapters, their gradients and optimizer state are fp32 over the bf16 base
          (``master_weights: fp32``, the default; ``none`` is stock's pure bf16; distributed,
          the fp32 adapter shards are gathered in bf16 and their gradients reduced in fp32),
          and are written in the base's dtype (docs/precision.md).
        - Checkpointing at each epoch's end (distributed: gathered to and written by rank 0):
          adapter weights and adapter config, plus merged full weights unless
          ``save_adapter_weights_only``. With ``save_every_n_steps``, atomic step checkpoints
          (adapters, optimizer, counters, RNG, data-loader position, every rank's;
          ``keep_last_n_checkpoints``) from which ``resume_from_checkpoint`` goes on with the
          very next window, also on another number of data-parallel ranks with the same global
          batch (docs/reliability.md); without them it
          resumes at an epoch boundary from the adapter checkpoint, as stock.
        - ``nonfinite_loss``: a step with a NaN/inf loss (on any rank) is skipped (``skip``) or
          stops the run with a checkpoint (``stop``); one host read per step, none per
          micro-batch.
        - Logging through torchtune's metric loggers, on rank 0: ``loss`` (the exact window
          loss over all ranks), ``lr``, ``tokens_per_second_per_gpu``, ``loss_tokens``,
          ``skipped_steps``, ``grad_norm`` when clipping, and peak memory on GPU.
        - Validation during training (``dataset_val``, ``run_val_every_n_steps``,
          ``batch_size_val``, ``max_val_batches``): the loss of the whole validation set as one
          batch over every rank, the same whatever its batch size or the number of ranks,
          logged as ``val/loss`` and ``val/perplexity`` every n steps and at each epoch's end
          (docs/validation.md).
          ``keep_best_checkpoint``: the weights of each new lowest ``val/loss`` as an epoch
          folder in ``best/``, resume-safe.

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: bad values and impossible combinations of config keys, at start-up
            (``recipe_main``'s ``validate_run_config``; each schema's ``check_flags``).
    """

    def __init__(self, cfg: LoraFinetuneConfig) -> None:
        # Device, precision policy, kernels, threads and the seed, and distributed the process
        # group and the data-parallel mesh; see [setup order].
        self._runtime = Runtime.for_settings(cfg)
        self._lora = LoraSettings.from_config(cfg.model)  # read from the model, as stock does
        self._clip_grad_norm = cfg.clip_grad_norm

    def setup(self, cfg: LoraFinetuneConfig) -> None:
        # Resume point, metric logger, torchtune's checkpointer and the frozen base it read.
        start = RunStart(cfg, self._runtime)
        # Built on meta, adapters trainable, cast, compiled, sharded where distributed, loaded.
        self._model = start.build_model(cfg.model, start.adapter_weights(self._lora))
        self._activations_ctx = start.activations_ctx  # activation offloading, or nothing
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = start.build_optimizer(cfg.optimizer, self._model)  # the adapters'
        self._loss_fn = build_loss(cfg.loss, self._model, compile_loss=cfg.compile)
        # A mixture-of-experts model's router balance term (none for a dense one): docs/moe.md.
        self._router = RouterBalance.from_settings(cfg, self._model, self._runtime)
        # Loss tokens are counted over every data-parallel rank: one all-reduce per window.
        normalizer = start.normalizer(self._loss_fn, units=self._router.units(self._loss_fn))
        # Row checks, data order and loader position: see [data order] in exactga.data.loader.
        dataset = load_dataset(cfg.dataset, self._tokenizer, model_vocab_size(self._model))
        dataloader = start.dataloader(
            dataset, padding_idx=self._tokenizer.pad_id, ignore_idx=self._loss_fn.ignore_index
        )
        # Validation during training (dataset_val; none without it): docs/validation.md.
        self._validation = validation_from_settings(
            cfg,
            tokenizer=self._tokenizer,
            loss_fn=self._loss_fn,
            model=self._model,
            runtime=self._runtime,
            metric_logger=start.metric_logger,
        )
        # Checkpoints (adapters, and merged weights), scheduler, profiler, logs: set up last.
        self._run = start.training_run(
            self._model,
            self._optimizer,
            dataloader,
            normalizer,
            lora=self._lora,
            window_metrics=self._router.window_metrics,  # expert load, on logged steps
            track=self._router.track,
            validation=self._validation,  # its step checkpoints and keep_best_checkpoint
        )

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        """Forward and mean loss of one micro-batch already on the device."""
        return causal_lm_loss(
            self._model,
            self._loss_fn,
            batch,
            self._activations_ctx,
            self._runtime.precision,
            router=self._router,
        )

    def train(self) -> None:
        with self._run as steps:  # the profiler, the progress bar and the closing report
            for curr_epoch in steps.epochs():
                for window in steps.windows(curr_epoch):
                    for batch in window:  # this rank's micro-batches; fillers have weight 0
                        loss = self._loss_step(batch)  # forward and mean loss: edit here
                        window.backward(loss)  # weighed by its exact share, then backward
                    outcome = window.step(self._optimizer, clip_grad_norm=self._clip_grad_norm)
                    steps.end_step(window, outcome)  # counters, scheduler, logs, checkpoints
                    self._validate_if_due(steps.progress.global_step)  # run_val_every_n_steps
                self._validate_if_due(steps.progress.global_step, epoch_end=True)
                steps.end_epoch(curr_epoch)

    def _validate_if_due(self, step: int, *, epoch_end: bool = False) -> None:
        """The validation set's loss as one batch over every rank, when due; nothing without
        dataset_val. See [validation loss as one batch] in exactga.validation.held_out."""
        if self._validation is None or not self._validation.due(step, epoch_end=epoch_end):
            return
        figure = validation_loss(
            self._model,
            self._loss_fn,
            self._validation.validation_set,
            device=self._runtime.device,
            precision=self._runtime.precision,
        )
        self._validation.log(figure, step)  # val/loss, val/perplexity and a console line

    def cleanup(self) -> None:
        self._run.close()  # the metric logger, and the process group where distributed


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    # The launch's schema, one device's or the distributed one's: see [one recipe, two
    # launches] in exactga.launch.twins.
    cfg = validated_config(cfg, LORA_FINETUNE, RECIPE_NAME)
    recipe = LoRAFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
