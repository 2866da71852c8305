"""GA parity report: does accumulation give the full-batch model on *your* config and data?

Takes a normal full or LoRA fine-tuning config and trains it several times from the same initial
weights on the same global batches: once as the full batch on one device (``batch_size =
B*G*N``, ``gradient_accumulation_steps = 1``), then as every split in ``parity.splits`` under
every normalisation mode in ``parity.modes`` (``naive``, ``post_scale`` = stock torchtune,
``exact`` = exactga). A split ``BxG`` trains on one device; ``BxGxN`` trains data-parallel over
the N processes of a distributed launch, sharded with FSDP2 exactly as
recipes/full_finetune_distributed.py and recipes/lora_finetune_distributed.py shard, its window
token count reduced over the data-parallel group, each rank reading its share of the same global
batches. Every run takes the recipes' own step (``exactga.training.train_window``).
Rank 0 writes into ``<output_dir>/parity/``:

- ``tensorboard/<mode>_<split>/``: one TensorBoard run per mode and split, so the loss curves
  overlay (``tensorboard --logdir <output_dir>/parity/tensorboard``); written at the end;
- ``parity.png``: loss curves per mode, their gap to the full batch, and the L2 distance of each
  run's trained weights (the adapters, for LoRA) to the full-batch run's, relative to how far
  training moved them, on a log scale;
- ``report.md`` and ``summary.json``: the same numbers as a table, and a one-line verdict
  against the fp32 floor.

Launch from the repository root::

    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_full.yaml
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_lora.yaml
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_full.yaml \\
        'parity.splits=[16x1,4x4,1x16]' parity.num_steps=20
    # splits across data-parallel ranks: N of BxGxN is the number of processes (gloo on CPU)
    tune run --nproc_per_node 2 recipes/ga_parity.py \\
        --config configs/tiny/ga_parity_full.yaml 'parity.splits=[1x8,2x2x2,1x4x2]'

In a distributed launch the full-batch reference trains on every rank (each rank scores the
runs it trains against its own copy, so only numbers travel to rank 0), the ``xN`` runs train
on all ranks together, and the one-device ``BxG`` runs are dealt out to the ranks in turn.

On your own config, add a ``parity`` section (see docs/ga_parity.md); everything else is read as
the full or LoRA recipe reads it.
"""

import copy
import os
import random
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config, training, utils
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from exactga import distributed
from exactga.config import validate_config
from exactga.data import WindowLoader, build_dataloader, load_dataset, model_vocab_size
from exactga.lora import LoraSettings, load_lora_weights
from exactga.normalization import LossNormalizer, NormMode, parse_mode
from exactga.parity.report import write_report
from exactga.parity.scoring import (
    ParityRun,
    RunSummary,
    Split,
    parse_splits,
    summarize,
)
from exactga.profiling import setup_profiler
from exactga.resume import checkpointer_source
from exactga.schemas import GaParityConfig
from exactga.training import causal_lm_loss, train_window

log = utils.get_logger("INFO")

RECIPE_NAME = "ga_parity"


class GaParityRecipe:
    """Trains one config under several splits and modes and reports how far each lands.

    Features:
        - ``parity.splits``: ``BxG`` (one device) and ``BxGxN`` (data-parallel over all N
          processes of the launch, FSDP2 on the ``dp`` mesh as the distributed recipes), all
          with one global batch; the full batch ``(B*G*N)x1`` on one device is the reference.
        - ``parity.modes``: the normalisation modes to compare; ``parity.num_steps`` optimizer
          steps each, from the same initial weights (the same fresh adapters, for LoRA) and the
          same sample order; ``parity.noise_floor`` decides the verdict.
        - The model, tokenizer, dataset, optimizer, scheduler, loss, ``clip_grad_norm``,
          ``shuffle``, ``seed``, ``device`` and ``dtype`` are read as the recipes read them.
          Under data parallelism gradients are reduced after every micro-batch (the
          distributed recipes' default ``gradient_sync``).

    Args:
        cfg: the validated config (see ``recipe_main``).

    Raises:
        ValueError: a bad ``parity.splits`` (see ``exactga.parity.scoring.parse_splits``),
            ``parity.num_steps`` beyond one epoch, ``optimizer_in_bwd``, a packed dataset.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        # torchrun sets WORLD_SIZE; a plain ``tune run`` is one process and starts no group.
        launched_world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._splits = parse_splits(cfg.parity.splits, launched_world_size)
        self._modes = [parse_mode(mode, "parity.modes") for mode in cfg.parity.modes]
        self._num_steps = cfg.parity.num_steps
        self._noise_floor = cfg.parity.noise_floor
        self._clip_grad_norm = cfg.clip_grad_norm
        self._global_batch = self._splits[0].global_batch
        self._report_dir = Path(cfg.output_dir) / "parity"

        self._mesh = None
        if launched_world_size > 1:
            distributed.init_distributed(self._device)
            self._mesh = distributed.build_device_mesh(self._device, tensor_parallel_dim=1)
        self._world_size, self._rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self._rank == 0
        # torchtune's set_seed seeds ``seed + rank``; it is called once to agree on a seed when
        # ``seed`` is null, and every run then reseeds with that seed alone (see _reseed).
        self._seed = training.set_seed(seed=cfg.seed)

        # Filled by setup and train.
        self._reference: ParityRun | None = None
        self._summaries: list[RunSummary] = []

    def setup(self, cfg: DictConfig) -> None:
        self._cfg = cfg
        _reseed(self._seed)
        checkpointer = config.instantiate(cfg.checkpointer)
        base_state = checkpointer.load_checkpoint()[training.MODEL_KEY]
        self._is_lora = "lora" in str(cfg.model._component_)
        self._initial_state = self._initial_model_state(cfg.model, base_state)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = config.instantiate(cfg.loss)
        self._dataset = self._setup_dataset(cfg.dataset)
        # Past one epoch the splits would end on different partial windows.
        num_available = len(self._dataset) // self._global_batch
        if self._num_steps > num_available:
            raise ValueError(
                f"config key 'parity.num_steps'={self._num_steps}: the dataset holds "
                f"{len(self._dataset)} samples, enough for {num_available} steps of "
                f"{self._global_batch} sequences."
            )
        # Timings and traces off: the report compares numbers; the hook stays the recipes' own.
        self._profiler_cfg = OmegaConf.merge(cfg, {"log_timings": False, "profiler": None})

    def _initial_model_state(self, cfg_model: DictConfig, base_state: dict) -> dict[str, Any]:
        """Every run starts from these tensors: base weights plus (seeded) fresh adapters."""
        model = self._build_model(cfg_model)
        if self._is_lora:  # the adapters the LoRA recipes start from; see [adapter init]
            load_lora_weights(
                model,
                LoraSettings.from_config(cfg_model),
                base_state=base_state,
                base_source=checkpointer_source(self._cfg.checkpointer),
                adapters=None,
                load=partial(nn.Module.load_state_dict, strict=False),
                seed=self._seed,
                dtype=self._dtype,
            )
        else:
            model.load_state_dict(base_state)
        self._vocab_size = model_vocab_size(model)
        return copy.deepcopy(model.state_dict())

    def _build_model(self, cfg_model: DictConfig) -> nn.Module:
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        if self._is_lora:
            set_trainable_params(model, get_adapter_params(model))
        return model

    def _build_sharded_model(self, cfg_model: DictConfig) -> nn.Module:
        """The model on the meta device, sharded with FSDP2 over the ``dp`` mesh as the
        distributed recipes shard it, then loaded with the shared initial state."""
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(cfg_model)
        if self._is_lora:
            set_trainable_params(model, get_adapter_params(model))
        training.shard_model(
            model=model,
            shard_conditions=[partial(training.get_shard_conditions, names_to_match=None)],
            cpu_offload=False,
            reshard_after_forward=True,
            dp_mesh=self._mesh["dp"],
        )
        with training.set_default_dtype(self._dtype), self._device:
            for module in model.modules():
                if hasattr(module, "rope_init"):  # RoPE buffers are not in the state dict
                    module.rope_init()
        training.load_from_full_model_state_dict(
            model, self._initial_state, self._device, strict=True
        )
        training.validate_no_params_on_meta_device(model)
        return model

    def _setup_dataset(self, cfg_dataset: DictConfig) -> Any:
        return load_dataset(cfg_dataset, self._tokenizer, self._vocab_size)

    def _dataloader(self, split: Split) -> WindowLoader:
        """The same sample order for every split: the sampler's permutation depends on its
        seed alone, and N ranks taking every N-th sample of it in batches of B hold, window by
        window, exactly the global batches of one device (see docs/ga_parity.md)."""
        num_replicas, rank = 1, 0
        if split.num_ranks > 1:
            num_replicas, rank = split.num_ranks, self._mesh["dp"].get_local_rank()
        return build_dataloader(
            self._dataset,
            batch_size=split.batch_size,
            gradient_accumulation_steps=split.ga,
            shuffle=self._cfg.shuffle,
            collate_fn=self._cfg.collate_fn,
            padding_idx=self._tokenizer.pad_id,
            ignore_idx=self._loss_fn.ignore_index,
            num_replicas=num_replicas,
            rank=rank,
        )

    def train(self) -> None:
        """Train the full-batch reference, then every split and mode, and gather the scores."""
        reference_split = Split(self._global_batch, 1)
        distributed.log_rank_zero(
            f"Full-batch reference: {reference_split} for {self._num_steps} steps"
        )
        self._reference = self._train(reference_split, NormMode.EXACT)
        initial = {n: self._initial_state[n].float().cpu() for n in self._reference.weights}
        plan = [
            (mode, split)
            for mode in self._modes
            for split in self._splits
            if split != reference_split
        ]
        # Runs over all ranks first, all together; then the one-device runs, dealt out in
        # turn, so a rank waits for the others at most one run's time, at the final gather.
        sharded = [i for i, (_, split) in enumerate(plan) if split.num_ranks > 1]
        single = [i for i, (_, split) in enumerate(plan) if split.num_ranks == 1]
        local: dict[int, RunSummary] = {}
        for index in sharded + single[self._rank :: self._world_size]:
            mode, split = plan[index]
            run = self._train(split, mode)
            if run.weights:  # a sharded run's weights are gathered on rank 0 only
                local[index] = summarize(run, self._reference, initial)
        self._summaries = [summary for _, summary in sorted(self._gather(local).items())]

    def _train(self, split: Split, mode: NormMode) -> ParityRun:
        """Train one split under one mode from the shared initial state."""
        _reseed(self._seed)  # dropout and any other randomness start equal
        sharded = split.num_ranks > 1
        if sharded:
            distributed.log_rank_zero(f"Training {split} with loss_normalization={mode.value}")
            model = self._build_sharded_model(self._cfg.model)
        else:
            prefix = f"rank {self._rank}: " if self._world_size > 1 else ""
            log.info(f"{prefix}training {split} with loss_normalization={mode.value}")
            model = self._build_model(self._cfg.model)
            model.load_state_dict(self._initial_state)
        if hasattr(self._loss_fn, "num_output_chunks"):
            model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = config.instantiate(self._cfg.optimizer, trainable)
        lr_scheduler = None
        if self._cfg.lr_scheduler is not None:
            lr_scheduler = config.instantiate(
                self._cfg.lr_scheduler, optimizer, num_training_steps=self._num_steps
            )
        normalizer = LossNormalizer(
            self._loss_fn,
            split.ga,
            mode=mode,
            dp_group=distributed.dp_group(self._mesh) if sharded else None,
        )
        micro_batch_context = None
        if sharded:  # the distributed recipes' default policy
            micro_batch_context = partial(
                distributed.gradient_sync, model, distributed.GradientSync.EVERY_MICRO_BATCH
            )
        profiler = setup_profiler(self._profiler_cfg, self._device, model)
        losses, loss_tokens = [], []
        windows = normalizer.windows(self._dataloader(split), self._num_steps)
        for step, window in enumerate(windows, start=1):
            train_window(
                window,
                model=model,
                loss_step=partial(causal_lm_loss, model, self._loss_fn),
                optimizer=optimizer,
                profiler=profiler,
                device=self._device,
                step=step,
                clip_grad_norm=self._clip_grad_norm,
                micro_batch_context=micro_batch_context,
                announce_skip=self._is_rank_zero or not sharded,
            )
            if lr_scheduler is not None:
                lr_scheduler.step()
            # The exact window loss over every rank of the run (one all-reduce when sharded).
            loss_tokens.append(window.num_global_tokens)
            losses.append(float("nan") if window.should_skip_step() else window.global_mean_loss())
        return ParityRun(
            mode=mode.value,
            split=str(split),
            losses=losses,
            loss_tokens=loss_tokens,
            weights=self._trained_weights(model, sharded),
        )

    def _trained_weights(self, model: nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
        """The trained tensors (the adapters, for LoRA) as full fp32 CPU tensors; a sharded
        run's are gathered from every rank and kept on rank 0 only."""
        weights = {}
        for name, param in model.named_parameters():
            if self._is_lora and not param.requires_grad:
                continue
            full = distributed.full_tensor(param.detach())  # a collective when sharded
            if not sharded or self._is_rank_zero:
                weights[name] = full.float().cpu().clone()
        return weights

    def _gather(self, local: dict[int, RunSummary]) -> dict[int, RunSummary]:
        """Every rank's scores on rank 0 (empty elsewhere): numbers only, no weights."""
        if self._world_size == 1:
            return local
        parts: list[Any] | None = [None] * self._world_size if self._is_rank_zero else None
        dist.gather_object(local, parts, dst=0)
        merged: dict[int, RunSummary] = {}
        for part in parts or []:
            merged.update(part)
        return merged

    def save_report(self) -> Path | None:
        """Rank 0 writes the report, figure, summary and TensorBoard runs."""
        if not self._is_rank_zero:
            return None
        report = write_report(
            self._report_dir,
            reference=self._reference,
            summaries=self._summaries,
            noise_floor=self._noise_floor,
            what="adapter weights" if self._is_lora else "weights",
        )
        log.info(f"Parity report: {report} (figure: {self._report_dir / 'parity.png'})")
        return report

    def cleanup(self) -> None:
        distributed.destroy()


def _reseed(seed: int) -> None:
    """Seed every generator with ``seed`` itself. torchtune's set_seed would add the rank, and
    every rank must draw the same initial adapters (and a run's randomness must not depend on
    the rank that trains it)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains every split and mode."""
    cfg = validate_config(cfg, GaParityConfig, RECIPE_NAME)
    recipe = GaParityRecipe(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.save_report()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
