"""GA parity report: does accumulation give the full-batch model on *your* config and data?

Takes a normal full or LoRA fine-tuning config and trains it several times from the same initial
weights on the same global batches: once as the full batch (``batch_size = B*G``,
``gradient_accumulation_steps = 1``), then as every split ``BxG`` in ``parity.splits`` under
every normalisation mode in ``parity.modes`` (``naive``, ``post_scale`` = stock torchtune,
``exact`` = exactga). Each run uses the recipes' own step (``exactga.training.train_window``).
It writes into ``<output_dir>/parity/``:

- ``tensorboard/<mode>_<split>/``: one TensorBoard run per mode and split, so the loss curves
  overlay (``tensorboard --logdir <output_dir>/parity/tensorboard``);
- ``parity.png``: loss curves per mode, and the L2 distance of each run's trained weights (the
  adapters, for LoRA) to the full-batch run's, relative to how far training moved them, on a
  log scale;
- ``report.md``: the same numbers as a table, and a one-line verdict against the fp32 floor.

Launch from the repository root::

    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_full.yaml
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_lora.yaml
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_full.yaml \\
        'parity.splits=[16x1,4x4,1x16]' parity.num_steps=20

On your own config, add a ``parity`` section (see docs/ga_parity.md); everything else is read as
the full or LoRA recipe reads it.
"""

import copy
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.datasets import ConcatDataset
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.training.metric_logging import TensorBoardLogger

from exactga.config import validate_config
from exactga.normalization import LossNormalizer, parse_mode
from exactga.parity_report import ParityRun, write_report
from exactga.profiling import setup_profiler
from exactga.schemas import GaParityConfig
from exactga.training import causal_lm_loss, train_window

log = utils.get_logger("INFO")

RECIPE_NAME = "ga_parity"


@dataclass(frozen=True)
class Split:
    """``batch_size x gradient_accumulation_steps``, written ``"BxG"`` in config."""

    batch_size: int
    ga: int

    @classmethod
    def parse(cls, text: str) -> "Split":
        try:
            batch_size, ga = (int(part) for part in str(text).lower().split("x"))
        except ValueError:
            raise ValueError(
                f"config key 'parity.splits': {text!r} is not 'BxG' (batch size x accumulation)."
            ) from None
        if batch_size < 1 or ga < 1:
            raise ValueError(f"config key 'parity.splits': {text!r} needs B >= 1 and G >= 1.")
        return cls(batch_size, ga)

    def __str__(self) -> str:
        return f"{self.batch_size}x{self.ga}"


class GaParityRecipe:
    """Trains one config under several splits and modes and reports how far each lands.

    Args:
        cfg: the validated config (see ``recipe_main``).
    """

    def __init__(self, cfg: DictConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._seed = cfg.seed
        self._report_dir = Path(cfg.output_dir) / "parity"
        self._splits = [Split.parse(text) for text in cfg.parity.splits]
        self._modes = [parse_mode(mode, "parity.modes") for mode in cfg.parity.modes]
        self._num_steps = cfg.parity.num_steps
        self._noise_floor = cfg.parity.noise_floor
        self._clip_grad_norm = cfg.clip_grad_norm
        global_batches = {s.batch_size * s.ga for s in self._splits}
        if len(global_batches) != 1:
            raise ValueError(
                "config key 'parity.splits': every split must hold the same global batch "
                f"(B*G), got {sorted(global_batches)}."
            )
        self._global_batch = global_batches.pop()
        if cfg.get("optimizer_in_bwd", False):
            raise ValueError("config key 'optimizer_in_bwd' must be False for the parity report.")

    def setup(self, cfg: DictConfig) -> None:
        self._cfg = cfg
        training.set_seed(seed=cfg.seed)
        checkpointer = config.instantiate(cfg.checkpointer)
        base_state = checkpointer.load_checkpoint()[training.MODEL_KEY]
        self._is_lora = "lora" in str(cfg.model._component_)
        self._initial_state = self._initial_model_state(cfg.model, base_state)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = config.instantiate(cfg.loss)
        self._dataset = self._setup_dataset(cfg.dataset)

    def _initial_model_state(self, cfg_model: DictConfig, base_state: dict) -> dict[str, Any]:
        """Every run starts from these tensors: base weights plus (seeded) fresh adapters."""
        model = self._build_model(cfg_model)
        model.load_state_dict(base_state, strict=not self._is_lora)
        return copy.deepcopy(model.state_dict())

    def _build_model(self, cfg_model: DictConfig) -> nn.Module:
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg_model)
        if self._is_lora:
            set_trainable_params(model, get_adapter_params(model))
        return model

    def _setup_dataset(self, cfg_dataset: DictConfig) -> Any:
        if isinstance(cfg_dataset, ListConfig):
            return ConcatDataset([config.instantiate(c, self._tokenizer) for c in cfg_dataset])
        if cfg_dataset.get("packed", False):
            raise ValueError("config key 'dataset.packed' is not supported by the parity report.")
        return config.instantiate(cfg_dataset, self._tokenizer)

    def _dataloader(self, batch_size: int) -> StatefulDataLoader:
        """The same sample order for every split: the sampler depends on the seed alone."""
        sampler = StatefulDistributedSampler(
            self._dataset, num_replicas=1, rank=0, shuffle=self._cfg.shuffle, seed=0
        )
        collate = _get_component_from_path(self._cfg.collate_fn)
        return StatefulDataLoader(
            self._dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=partial(
                collate,
                padding_idx=self._tokenizer.pad_id,
                ignore_idx=self._loss_fn.ignore_index,
            ),
            drop_last=True,
        )

    def _train(self, split: Split, mode: Any) -> ParityRun:
        """Train one split under one mode from the shared initial state."""
        training.set_seed(seed=self._seed)  # dropout and any other randomness start equal
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
        normalizer = LossNormalizer(self._loss_fn, split.ga, mode=mode)
        # Timings off: the report compares numbers, and the hook stays the recipes' own.
        profiler = setup_profiler(
            OmegaConf.merge(self._cfg, {"log_timings": False}), self._device, model
        )
        name = f"{mode.value}_{split}"
        logger = TensorBoardLogger(
            str(self._report_dir / "tensorboard" / name), organize_logs=False
        )
        losses = []
        for step, window in enumerate(
            normalizer.windows(self._dataloader(split.batch_size), self._num_steps), start=1
        ):
            train_window(
                window,
                model=model,
                loss_step=partial(causal_lm_loss, model, self._loss_fn),
                optimizer=optimizer,
                profiler=profiler,
                device=self._device,
                step=step,
                clip_grad_norm=self._clip_grad_norm,
            )
            if lr_scheduler is not None:
                lr_scheduler.step()
            losses.append(window.mean_loss())
            logger.log("loss", losses[-1], step)
        logger.close()
        weights = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        if self._is_lora:
            weights = {n: w for n, w in weights.items() if n in _trainable_names(model)}
        return ParityRun(mode=mode.value, split=str(split), losses=losses, weights=weights)

    def run(self) -> Path:
        reference_split = Split(self._global_batch, 1)
        log.info(f"Full-batch reference: {reference_split} for {self._num_steps} steps")
        reference = self._train(reference_split, parse_mode("exact"))
        initial = {n: self._initial_state[n].float().cpu() for n in reference.weights}
        runs = []
        for mode in self._modes:
            for split in self._splits:
                if split == reference_split:
                    continue
                log.info(f"Training {split} with loss_normalization={mode.value}")
                runs.append(self._train(split, mode))
        report = write_report(
            self._report_dir,
            reference=reference,
            runs=runs,
            initial_weights=initial,
            noise_floor=self._noise_floor,
            what="adapter weights" if self._is_lora else "weights",
        )
        log.info(f"Parity report: {report} (figure: {self._report_dir / 'parity.png'})")
        return report


def _trainable_names(model: nn.Module) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains every split and mode."""
    cfg = validate_config(cfg, GaParityConfig, RECIPE_NAME)
    recipe = GaParityRecipe(cfg)
    recipe.setup(cfg)
    recipe.run()


if __name__ == "__main__":
    sys.exit(recipe_main())
