"""Quantisation-aware LoRA fine-tuning with FSDP2, GPUs or CPUs, with exact accumulation.

A drop-in for torchtune 0.6.1's ``qat_lora_finetune_distributed``: its configs run unchanged,
with the same artefacts, written by rank 0 (adapter weights in torchtune's format and, through
the checkpointer, in PEFT's format with ``adapter_config.json``; merged full weights unless
``save_adapter_weights_only``). The config's ``quantizer`` (torchao's
``Int8DynActInt4WeightQATQuantizer`` or ``Int4WeightOnlyQATQuantizer``) swaps each LoRA linear
for torchtune's ``QATLoRALinear``: the frozen base weight (and the input activations) are
fake-quantised in the forward, the adapters are not. The merged weights are saved in full
precision for ``tune run quantize`` to convert, as stock (docs/qat.md). What differs from stock,
as in recipes/lora_finetune.py: the loss of each optimizer step is exactly the
full-batch loss of the window over every data-parallel rank, whatever the split into ranks and
micro-batches; ``device: cpu`` runs (gloo); the initial adapters do not depend on the number of
ranks; ``gradient_sync``.

Launch from the repository root::

    tune run --nproc_per_node 2 recipes/qat_lora_finetune_distributed.py \\
        --config configs/tiny/qat_lora_distributed.yaml

Copy this file to change the loop; the numerics stay in ``exactga``.
"""

import sys

import torch
from omegaconf import DictConfig
from torchtune import config, utils
from torchtune.recipe_interfaces import FTRecipeInterface

from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.config.schemas import QatLoraFinetuneDistributedConfig
from exactga.data.loader import load_dataset, model_vocab_size
from exactga.launch.cli import run_recipe
from exactga.lora.adapters import LoraSettings
from exactga.model_build.trained import build_loss
from exactga.runtime.runtime import Runtime
from exactga.sft.loss import causal_lm_loss
from exactga.sft.validation import validation_loss
from exactga.validation.held_out import validation_from_settings
from exactga.wiring.run_start import RunStart, validated_config

log = utils.get_logger("INFO")

RECIPE_NAME = "qat_lora_finetune_distributed"


class QATLoRAFinetuneRecipeDistributed(FTRecipeInterface):
    """Quantisation-aware LoRA fine-tuning of a dense decoder with FSDP2, on GPUs or CPUs.

    The base weights are frozen and fake-quantised in the forward; only the adapter parameters
    get gradients and optimizer state, and only they are reduced across ranks.

    Features (each a config key; defaults in ``exactga.config.schemas``):
        - ``quantizer``: a torchao QAT quantizer; its fake-quantize configs go into
          ``QATLoRALinear`` right after the model is built on the meta device, before the
          adapters are made trainable, as stock (``exactga.qat.fake_quant.prepare_for_qat``). Not
          with DoRA (stock's rule).
        - Exact accumulation over micro-batches *and* data-parallel ranks, as in
          recipes/full_finetune.py: one all-reduce of the window's loss-token count
          over the data-parallel group per step, each micro-batch loss scaled by ``dp_size *
          batch_tokens / window_tokens`` before backward; an empty micro-batch still runs with
          weight 0, and a window empty on every rank skips its step (``skipped_steps``).
        - ``gradient_sync``: ``every_micro_batch`` (default, as stock) or ``once_per_window``
          (one reduce-scatter of the adapter gradients per step).
        - FSDP2 through torchtune's ``shard_model`` over the data-parallel mesh:
          ``fsdp_cpu_offload``, ``fsdp_reshard_after_forward``, ``custom_sharded_layers``.
        - ``micro_batching`` per rank, as in the full distributed recipe.
        - ``loss_normalization``, precision, activation checkpointing and offloading,
          ``clip_grad_norm``, schedulers: as in the single-device LoRA recipe;
          with ``master_weights: fp32`` (default) the fp32 adapter shards are gathered in bf16
          and their gradients reduced in fp32 (docs/precision.md).
        - Checkpointing at each epoch's end, gathered to and written by rank 0: adapter weights
          and adapter config, merged weights unless ``save_adapter_weights_only``, recipe and
          optimizer state between epochs. With ``save_every_n_steps``, atomic step checkpoints
          (adapters and optimizer as every rank's shards, RNG and data-loader position from
          every rank): ``resume_from_checkpoint`` then goes on with the next window, also on
          another number of data-parallel ranks with the same global batch
          (docs/reliability.md); without them it resumes at an epoch boundary, as stock.
        - ``nonfinite_loss``: a NaN/inf loss on any rank skips the step on every rank
          (``skip``) or stops the run with a checkpoint (``stop``).
        - Rank-0-only metric logging and progress bar; ``loss`` is the exact window loss over
          all ranks.
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
            (``recipe_main``'s ``validate_run_config``; each schema's ``check_flags``); as
            stock, ``compile: True``, a quantizer that is not a QAT one, and DoRA.
    """

    def __init__(self, cfg: QatLoraFinetuneDistributedConfig) -> None:
        # Device, process group, data-parallel mesh (stock LoRA has no tensor parallelism),
        # precision policy, kernels, threads and the seed; see [setup order].
        self._runtime = Runtime.distributed(cfg)
        self._lora = LoraSettings.from_config(cfg.model)  # read from the model, as stock does
        self._clip_grad_norm = cfg.clip_grad_norm

    def setup(self, cfg: QatLoraFinetuneDistributedConfig) -> None:
        # Resume point, metric logger, torchtune's checkpointer and the frozen base it read.
        start = RunStart(cfg, self._runtime)
        # Built on meta, fake-quantised by the quantizer, adapters trainable, cast, sharded and
        # loaded.
        self._model = start.build_model(
            cfg.model, start.adapter_weights(self._lora), quantizer=cfg.quantizer
        )
        self._activations_ctx = start.activations_ctx  # activation offloading, or nothing
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._optimizer = start.build_optimizer(cfg.optimizer, self._model)  # the adapters'
        self._loss_fn = build_loss(cfg.loss, self._model, compile_loss=cfg.compile)
        # Loss tokens are counted over every data-parallel rank: one all-reduce per window.
        normalizer = start.normalizer(self._loss_fn)
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
            validation=self._validation,  # its step checkpoints and keep_best_checkpoint
        )

    def _loss_step(self, batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        """Forward and mean loss of one micro-batch already on the device."""
        return causal_lm_loss(
            self._model, self._loss_fn, batch, self._activations_ctx, self._runtime.precision
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
        self._run.close()  # the metric logger and the process group


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: the config checked strictly and logged, then training."""
    cfg = validated_config(cfg, QatLoraFinetuneDistributedConfig, RECIPE_NAME)
    recipe = QATLoRAFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
