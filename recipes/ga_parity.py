"""GA parity report: does accumulation give the full-batch model on *your* config and data?

Takes a normal full or LoRA fine-tuning config, a knowledge-distillation one (its teacher built
once, frozen, and every run trained with the KD recipes' loss step), or a LoRA or full DPO one
(every run trained on preference pairs with the DPO recipes' loss step and reference), or a GRPO one
(see below), and trains it several times from the same initial weights on the same global batches:
once as the full batch on one device (``batch_size = B*G*N``, ``gradient_accumulation_steps = 1``),
then as every split in ``parity.splits`` under every normalisation mode in ``parity.modes``
(``naive``, ``post_scale`` = stock torchtune, ``exact`` = exactga; for DPO ``naive`` is stock's and
there is no ``post_scale``), exact runs under every ``micro_batching`` in ``parity.micro_batching``
too (``fixed``, ``by_length``, ``token_budget``: how a window's samples are grouped into
micro-batches, which changes no step; the baselines run ``fixed`` only, a DPO config's ``naive``
also ``token_budget``). A split ``BxG`` trains on one device; ``BxGxN`` trains data-parallel over
the N processes of a distributed launch, sharded with FSDP2 exactly as
recipes/full_finetune.py and recipes/lora_finetune.py shard, its window
token count reduced over the data-parallel group, each rank reading its share of the same global
batches. Every run takes the recipes' own step (``exactga.accumulation.step.train_window``). Rank 0
writes into ``<output_dir>/parity/``:

- ``tensorboard/<mode>/<micro_batching>/<split>/``: one TensorBoard run per run, so the loss
  curves overlay (``tensorboard --logdir <output_dir>/parity/tensorboard``); written at the end;
- ``parity.png``: loss curves per mode and micro-batching, their gap to the full batch, and the
  L2 distance of each run's trained weights (the adapters, for LoRA) to the full-batch run's,
  relative to how far training moved them, on a log scale;
- ``report.md`` and ``summary.json``: the same numbers as a table, a one-line verdict against
  the fp32 floor, and exact mode's micro-batchings side by side with the positions each
  processed (padding included).

Every run trains in the config's ``dtype`` and ``master_weights``, as the training recipes
would. Below fp32 (``dtype: bf16``) the full batch is also trained in fp32 from the same
initial weights, and every run shows its distance to both full batches: what its split costs at
this precision, and what split and precision cost together; the verdict's floor is then the
precision's own (see [parity floor below fp32] in exactga.parity.scoring).

Launch from the repository root::

    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_full.yaml
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_lora.yaml
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_kd.yaml
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_dpo.yaml
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_full.yaml \\
        'parity.splits=[16x1,4x4,1x16]' parity.num_steps=20
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_full.yaml \\
        'parity.micro_batching=[fixed,token_budget]' parity.micro_batch_tokens=512
    # bf16 over fp32 master weights, beside an fp32 full batch
    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_full.yaml \\
        dtype=bf16 master_weights=fp32
    # splits across data-parallel ranks: N of BxGxN is the number of processes (gloo on CPU)
    tune run --nproc_per_node 2 recipes/ga_parity.py \\
        --config configs/tiny/ga_parity_full.yaml 'parity.splits=[1x8,2x2x2,1x4x2]'

In a distributed launch the full-batch reference trains on every rank (each rank scores the
runs it trains against its own copy, so only numbers travel to rank 0), the ``xN`` runs train
on all ranks together, and the one-device ``BxG`` runs are dealt out to the ranks in turn.

A GRPO config (one that sets ``grpo_samples``) is trained by ``exactga.parity.grpo``, as
recipes/grpo_full_finetune_distributed.py steps: per ``parity.loss_aggregations`` (all five by
default) and per ``parity.losses`` (the config's ``loss`` by default) a full batch and every
split, whose ``B`` counts completions per micro-batch, under ``naive`` and ``exact``; one report
per objective under ``parity/<loss_aggregation>/`` (``parity/<loss>.<loss_aggregation>/`` with
``parity.losses``) and an index in ``parity/report.md`` (see [grpo parity] there)::

    tune run recipes/ga_parity.py --config configs/tiny/ga_parity_grpo.yaml

On your own config, add a ``parity`` section (see docs/ga_parity.md); everything else is read as
the full, LoRA, KD, DPO or GRPO recipe reads it.
"""

import copy
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config, training, utils
from tqdm import tqdm

from exactga.accumulation.loss_units import loss_ignore_index
from exactga.accumulation.normalization import LossNormalizer, NormMode
from exactga.accumulation.step import train_window
from exactga.config.validation import typed_settings
from exactga.data.loader import WindowLoader, build_dataloader, load_dataset, model_vocab_size
from exactga.data.micro_batching import MicroBatching, MicroBatchingSettings
from exactga.data.packing import uses_flex_attention
from exactga.dpo.terms import DpoTerms
from exactga.kd.distillation import Distiller, check_kd_losses, check_vocabularies
from exactga.launch.cli import run_recipe
from exactga.lora.adapters import LoraSettings, load_lora_weights
from exactga.model_build.frozen import freeze_model
from exactga.parity.grpo import GrpoParity
from exactga.parity.grpo_schema import GrpoParityConfig, is_grpo_config
from exactga.parity.ppo import PpoParity
from exactga.parity.ppo_schema import PpoParityConfig, is_ppo_config
from exactga.parity.preference import (
    Preference,
    check_pairs,
    check_preference_keys,
    collate_fn_for,
    preference_loss_step,
)
from exactga.parity.report import (
    DataShape,
    Distillation,
    FakeQuantisation,
    RouterTerm,
    write_report,
)
from exactga.parity.runs import (
    FrozenModels,
    RunTally,
    build_model,
    build_sharded_model,
    gather_summaries,
    reseed,
    trained_weights,
)
from exactga.parity.schema import GaParityConfig
from exactga.parity.scoring import (
    ROUTER_TERM_OFF,
    ParityRun,
    PrecisionView,
    RunSummary,
    Split,
    parse_splits,
    plan_runs,
    relative_l2,
    summarize,
)
from exactga.profiling import setup_profiler
from exactga.qat.fake_quant import FakeQuantSchedule, quantizer_from_config
from exactga.run.resume import checkpointer_source, validate_run_config
from exactga.runtime import distributed
from exactga.runtime.precision import MasterWeights, Precision
from exactga.runtime.threads import use_cpu_threads
from exactga.sft.loss import causal_lm_loss
from exactga.sft.router_balance import RouterBalance

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
        - ``parity.micro_batching``: exact runs every split under each listed grouping of a
          window's samples (``token_budget`` cuts at ``parity.micro_batch_tokens`` padded
          positions); the baselines and the reference group ``fixed``. The report sets them
          side by side with the positions each processed. See exactga.parity.scoring.plan_runs.
        - The model, tokenizer, dataset, optimizer, scheduler, loss, ``clip_grad_norm``,
          ``shuffle``, ``seed``, ``device``, ``dtype`` and ``master_weights`` (null: the
          recipes' default, fp32 for LoRA, none for full) are read as the recipes read them.
          Under data parallelism gradients are reduced after every micro-batch (the
          distributed recipes' default ``gradient_sync``).
        - Below fp32 (``dtype: bf16``), an fp32 full batch from the same initial weights cast
          to fp32: each run's distance to it stands beside its distance to the bf16 full
          batch, and the verdict's floor is twice the bf16 full batch's own distance to it
          (see [parity floor below fp32] in exactga.parity.scoring).
        - Knowledge distillation (``teacher_model``, ``teacher_checkpointer``, ``kd_loss``,
          ``kd_ratio``, as the KD recipes read them): the teacher is built once, frozen, in
          ``dtype`` (one copy per rank, unsharded: it only runs forwards), and every run trains
          ``exactga.kd.distillation.Distiller``'s loss step; ``post_scale`` is then stock's KD
          weighting (see [stock kd weighting] there).
        - DPO (a ``loss`` that weighs pairs, torchtune's ``DPOLoss`` or ``RSOLoss``, exactga's
          SimPO, ORPO, IPO, or KTO on unpaired examples, on a preference dataset): every run
          trains the DPO recipes' loss step, counted in the loss's units (pairs; ORPO's and
          RPO's chosen tokens too; KTO's examples, its reference point a window statistic);
          the reference is the policy with its adapters off (LoRA) or a frozen copy of
          ``model`` with ``ref_checkpointer``'s weights, built once in ``dtype`` (sharded like
          the policy for ``BxGxN`` runs), none for SimPO and ORPO. ``naive`` is stock DPO's
          weighting and also runs ``token_budget``; no ``post_scale`` (see
          exactga.parity.preference).
        - A mixture-of-experts model with ``router_aux_loss_coef > 0``: every run adds the
          router's balance term as the fine-tuning recipes do; the full batch and the
          exact/fixed splits also train without it, and the report shows the term's own gap
          beside the token loss's (see [router term in the parity report] in
          exactga.parity.report).
        - Quantisation-aware training (``quantizer``, ``fake_quant_after_n_steps``, as the QAT
          recipes read them): every run's linears fake-quantised by torchao as
          recipes/qat_distributed.py and recipes/qat_lora_finetune_distributed.py build them
          (exactga.qat.fake_quant), switched on at the same step; see docs/qat.md for how far its
          splits stay at the floor.

    Args:
        cfg: the validated settings (see ``recipe_main``).

    Raises:
        ValueError: a bad ``parity.splits`` (see ``exactga.parity.scoring.parse_splits``),
            ``parity.num_steps`` beyond one epoch, ``optimizer_in_bwd``, a packed dataset, a
            loss and a dataset of different kinds (pairs or sequences).
    """

    def __init__(self, cfg: GaParityConfig) -> None:
        self._device = utils.get_device(device=cfg.device)
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._dtype_name = str(cfg.dtype)  # as the report names it
        self._cpu_threads = use_cpu_threads(cfg.cpu_threads)  # see [cpu threads]
        self._is_lora = "lora" in str(cfg.model._component_)
        self._is_kd = cfg.teacher_model is not None
        self._kd_ratio = cfg.kd_ratio
        # A mixture-of-experts model's router balance term, as the fine-tuning recipes add it;
        # see [router term in the parity report] in exactga.parity.report.
        self._router_coef = float(cfg.router_aux_loss_coef)
        self._router_balance = cfg.router_balance
        self._is_preference = GaParityConfig.is_preference(cfg)  # DPO: the units are pairs
        self._collate_fn = collate_fn_for(cfg.collate_fn, self._is_preference)
        self._master_weights = GaParityConfig.master_weights_for(cfg, is_lora=self._is_lora)
        self._precision = Precision.from_config(self._dtype, self._master_weights, self._device)
        # Below fp32 an fp32 full batch shows what the precision costs; see
        # [parity floor below fp32] in exactga.parity.scoring.
        self._fp32_precision = None
        if torch.finfo(self._dtype).bits < 32:
            self._fp32_precision = Precision.from_config(
                torch.float32, MasterWeights.NONE, self._device
            )
        # torchrun sets WORLD_SIZE; a plain ``tune run`` is one process and starts no group.
        launched_world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._splits = parse_splits(cfg.parity.splits, launched_world_size)
        self._modes = GaParityConfig.modes_for(cfg)
        self._micro_batchings = list(cfg.parity.micro_batching)
        self._baseline_micro_batchings = GaParityConfig.baseline_micro_batchings(cfg)
        self._micro_batch_tokens = cfg.parity.micro_batch_tokens
        self._num_steps = cfg.parity.num_steps
        self._noise_floor = cfg.parity.noise_floor
        self._clip_grad_norm = cfg.clip_grad_norm
        self._global_batch = self._splits[0].global_batch
        self._report_dir = Path(cfg.output_dir) / "parity"

        self._mesh = None
        if launched_world_size > 1:
            distributed.init_distributed(self._device)
            self._mesh = distributed.build_device_mesh(self._device)
        self._world_size, self._rank = utils.get_world_size_and_rank()
        self._is_rank_zero = self._rank == 0
        check_preference_keys(cfg, is_preference=self._is_preference, is_lora=self._is_lora)
        # torchtune's set_seed seeds ``seed + rank``; it is called once to agree on a seed when
        # ``seed`` is null, and every run then reseeds with that seed alone (see _reseed).
        self._seed = training.set_seed(seed=cfg.seed)

        # Filled by setup and train.
        self._reference: ParityRun | None = None
        self._fp32_reference: ParityRun | None = None
        self._reference_to_fp32: float | None = None  # relative L2, below fp32 only
        self._summaries: list[RunSummary] = []
        self._teacher: nn.Module | None = None  # a KD config's, built once in setup
        self._ref_models: FrozenModels | None = None  # full DPO's reference, by layout
        self._data_shape: DataShape | None = None  # of the full batch's samples
        self._num_runs = 0  # for the progress lines: "run k of n"

    def setup(self, cfg: GaParityConfig) -> None:
        self._cfg = cfg
        reseed(self._seed)
        checkpointer = config.instantiate(cfg.checkpointer)
        base_state = checkpointer.load_checkpoint()[training.MODEL_KEY]
        self._initial_state = self._initial_model_state(cfg.model, base_state)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = config.instantiate(cfg.loss)
        self._ignore_index = loss_ignore_index(self._loss_fn)  # padding's label; a pair loss's too
        self._dpo_terms = None  # a DPO config's: units, reference, NLL term (exactga.dpo)
        if self._is_preference:
            self._dpo_terms = DpoTerms.for_loss(
                self._loss_fn, rpo_alpha=cfg.rpo_alpha, sequence_log_prob=cfg.sequence_log_prob
            )
        if self._is_preference and not self._is_lora and not self._dpo_terms.reference_free:
            ref_state = config.instantiate(cfg.ref_checkpointer).load_checkpoint()
            self._ref_models = FrozenModels(
                cfg.model,
                ref_state[training.MODEL_KEY],
                self._device,
                self._mesh.fsdp if self._mesh is not None else None,
            )
        if self._is_kd:
            self._kd_loss_fn = config.instantiate(cfg.kd_loss)
            check_kd_losses(self._loss_fn, self._kd_loss_fn)
            self._teacher = self._setup_teacher(cfg.teacher_model, cfg.teacher_checkpointer)
        self._dataset = self._setup_dataset(cfg.dataset)
        check_pairs(self._dataset, self._is_preference, type(self._loss_fn).__name__)
        # Past one epoch the splits would end on different partial windows.
        num_available = len(self._dataset) // self._global_batch
        if self._num_steps > num_available:
            raise ValueError(
                f"config key 'parity.num_steps'={self._num_steps}: the dataset holds "
                f"{len(self._dataset)} samples, enough for {num_available} steps of "
                f"{self._global_batch} sequences."
            )

    def _initial_model_state(self, cfg_model: DictConfig, base_state: dict) -> dict[str, Any]:
        """Every run starts from these tensors: base weights plus (seeded) fresh adapters, in
        the run's precision (trainable ones in fp32 over fp32 master weights). The fp32 full
        batch loads them cast to fp32."""
        model = self._build_model(cfg_model, self._precision)
        if self._is_lora:  # the adapters the LoRA recipes start from; see [adapter init]
            load_lora_weights(
                model,
                LoraSettings.from_config(cfg_model),
                base_state=base_state,
                base_source=checkpointer_source(self._cfg.checkpointer),
                adapters=None,
                load=partial(nn.Module.load_state_dict, strict=False),
                seed=self._seed,
                dtype=self._precision.param_dtype,
            )
        else:
            model.load_state_dict(base_state)
        self._vocab_size = model_vocab_size(model)
        return copy.deepcopy(model.state_dict())

    def _setup_teacher(self, cfg_teacher: DictConfig, cfg_checkpointer: DictConfig) -> nn.Module:
        """The frozen teacher in ``dtype``, as the KD recipes build it: one for every run, so
        all runs (the fp32 full batch too) distil the same logits."""
        teacher_state = config.instantiate(cfg_checkpointer).load_checkpoint()
        with training.set_default_dtype(self._dtype), self._device:
            teacher = config.instantiate(cfg_teacher)
        teacher.load_state_dict(teacher_state[training.MODEL_KEY])
        freeze_model(teacher)
        check_vocabularies(self._vocab_size, model_vocab_size(teacher))
        if hasattr(self._loss_fn, "num_output_chunks"):
            teacher.set_num_output_chunks(self._loss_fn.num_output_chunks)
        return teacher

    def _build_model(self, cfg_model: DictConfig, precision: Precision) -> nn.Module:
        return build_model(
            cfg_model,
            precision,
            self._device,
            is_lora=self._is_lora,
            quantizer=self._quantizer(precision),
        )

    def _quantizer(self, precision: Precision) -> Any:
        """A QAT config's quantizer for a model in ``precision`` (stock builds it in ``dtype``;
        the fp32 full batch's in fp32); None without ``quantizer``."""
        if self._cfg.quantizer is None:
            return None
        dtype = torch.float32 if precision is self._fp32_precision else self._dtype
        return quantizer_from_config(self._cfg.quantizer, dtype)

    def _build_sharded_model(self, cfg_model: DictConfig, precision: Precision) -> nn.Module:
        """Sharded over the ``dp`` mesh as the distributed recipes shard it, loaded with the
        shared initial state."""
        return build_sharded_model(
            cfg_model,
            self._initial_state,
            precision,
            self._device,
            self._mesh.fsdp,
            is_lora=self._is_lora,
            quantizer=self._quantizer(precision),
        )

    def _setup_dataset(self, cfg_dataset: DictConfig) -> Any:
        return load_dataset(cfg_dataset, self._tokenizer, self._vocab_size)

    def _dataloader(self, split: Split, micro_batching: MicroBatching) -> WindowLoader:
        """The same sample order for every split: the sampler's permutation depends on its
        seed alone, and N ranks taking every N-th sample of it in windows of B*G hold, window by
        window, exactly the global batches of one device (see docs/ga_parity.md). How each
        rank's window is then cut is ``micro_batching``'s; ``token_budget`` cuts by the budget
        whatever B."""
        num_replicas, rank = 1, 0
        if split.num_ranks > 1:
            num_replicas, rank = split.num_ranks, self._mesh["dp"].get_local_rank()
        return build_dataloader(
            self._dataset,
            batch_size=split.batch_size,
            gradient_accumulation_steps=split.ga,
            micro_batching=MicroBatchingSettings(
                mode=micro_batching,
                batch_size=split.batch_size,
                micro_batch_tokens=self._micro_batch_tokens,  # read by token_budget, packed
            ),
            shuffle=self._cfg.shuffle,
            collate_fn=self._collate_fn,
            padding_idx=self._tokenizer.pad_id,
            ignore_idx=self._ignore_index,
            num_replicas=num_replicas,
            rank=rank,
            flex_attention=uses_flex_attention(self._device),
        )

    def train(self) -> None:
        """Train the full-batch reference (and below fp32 the fp32 one), then every planned
        run, and gather the scores."""
        reference_split = Split(self._global_batch, 1)
        plan = plan_runs(
            self._modes,
            self._micro_batchings,
            self._splits,
            reference_split,
            self._baseline_micro_batchings,
        )
        num_references = 1 if self._fp32_precision is None else 2
        # With the router term: the full batch and exact/fixed splits without it too.
        term_off_plan = (
            []
            if self._router_coef == 0
            else plan_runs([NormMode.EXACT], [MicroBatching.FIXED], self._splits, reference_split)
        )
        num_term_off = len(term_off_plan) + 1 if term_off_plan else 0
        self._num_runs = num_references + len(plan) + num_term_off
        distributed.log_rank_zero(
            f"{self._num_runs} runs of {self._num_steps} steps; the full-batch reference "
            f"{reference_split} first, {self._precision.describe()}"
        )
        distributed.log_rank_zero(self._cpu_threads)
        self._reference = self._train(
            reference_split, NormMode.EXACT, MicroBatching.FIXED, self._precision, run=1
        )
        # Every run, the fp32 one included, starts from these (cast to fp32 there).
        initial = {n: self._initial_state[n].float().cpu() for n in self._reference.weights}
        if self._fp32_precision is not None:
            self._fp32_reference = self._train(
                reference_split, NormMode.EXACT, MicroBatching.FIXED, self._fp32_precision, run=2
            )
            self._reference_to_fp32 = relative_l2(
                self._reference.weights, self._fp32_reference.weights, initial
            )
        # Runs over all ranks first, all together; then the one-device runs, dealt out in
        # turn, so a rank waits for the others at most one run's time, at the final gather.
        sharded = [i for i, (_, _, split) in enumerate(plan) if split.num_ranks > 1]
        single = [i for i, (_, _, split) in enumerate(plan) if split.num_ranks == 1]
        local: dict[int, RunSummary] = {}
        for index in sharded + single[self._rank :: self._world_size]:
            mode, micro_batching, split = plan[index]
            run = self._train(
                split, mode, micro_batching, self._precision, run=num_references + index + 1
            )
            if run.weights:  # a sharded run's weights are gathered on rank 0 only
                local[index] = summarize(run, self._reference, initial, self._fp32_reference)
        if term_off_plan:
            first = num_references + len(plan) + 1
            local |= self._train_without_router_term(term_off_plan, reference_split, initial, first)
        self._summaries = [summary for _, summary in sorted(gather_summaries(local).items())]

    def _train_without_router_term(
        self,
        plan: list[tuple[NormMode, MicroBatching, Split]],
        reference_split: Split,
        initial: dict[str, torch.Tensor],
        first: int,
    ) -> dict[int, RunSummary]:
        """The full batch and ``plan``'s runs with the token loss alone, each scored against
        that full batch: the weights gap of the split without the router term, beside the one
        with it. Keyed after the main plan's runs; ``first`` numbers the full batch."""
        reference = self._train(
            reference_split, NormMode.EXACT, MicroBatching.FIXED, self._precision, first, False
        )
        sharded = [i for i, (_, _, split) in enumerate(plan) if split.num_ranks > 1]
        single = [i for i, (_, _, split) in enumerate(plan) if split.num_ranks == 1]
        local = {}
        for index in sharded + single[self._rank :: self._world_size]:
            mode, micro_batching, split = plan[index]
            run = self._train(
                split, mode, micro_batching, self._precision, first + index + 1, False
            )
            if run.weights:
                local[self._num_runs + index] = summarize(run, reference, initial)
        return local

    def _train(
        self,
        split: Split,
        mode: NormMode,
        micro_batching: MicroBatching,
        precision: Precision,
        run: int,
        router_term: bool = True,
    ) -> ParityRun:
        """Train one split under one mode, micro-batching and precision from the shared initial
        state, as the training recipes would (their Precision calls). ``run`` numbers it in
        the progress lines; the full-batch reference is run 1. ``router_term``: add the router's
        balance term where the config sets one (False: the token loss alone)."""
        reseed(self._seed)  # dropout and any other randomness start equal
        sharded = split.num_ranks > 1
        what = (
            f"run {run} of {self._num_runs}: {split} with loss_normalization={mode.value}, "
            f"micro_batching={micro_batching.value}"
        )
        coef = self._router_coef if router_term else 0.0
        variant = ROUTER_TERM_OFF if coef != self._router_coef else ""
        if variant:
            what += f" ({variant})"
        if run == 1:
            what += " (full-batch reference)"
        elif precision is self._fp32_precision:
            what += " (fp32 full-batch reference)"
        if sharded:
            distributed.log_rank_zero(what)
            model = self._build_sharded_model(self._cfg.model, precision)
        else:
            prefix = f"rank {self._rank}: " if self._world_size > 1 else ""
            log.info(f"{prefix}{what}")
            model = self._build_model(self._cfg.model, precision)
            model.load_state_dict(self._initial_state)  # cast to the model's dtypes
        if hasattr(self._loss_fn, "num_output_chunks"):
            model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = config.instantiate(self._cfg.optimizer, trainable)
        lr_scheduler = None
        if self._cfg.lr_scheduler is not None:
            lr_scheduler = config.instantiate(
                self._cfg.lr_scheduler, optimizer, num_training_steps=self._num_steps
            )
        dp_group = self._mesh.count_group() if sharded else None
        # The fine-tuning recipes' router term (off for a dense model, KD and DPO).
        router = RouterBalance(model, coef, self._router_balance, dp_group, self._device)
        preference = None  # a DPO config's loss step, against its reference, and KTO's statistic
        if self._dpo_terms is not None:
            preference = preference_loss_step(
                model, self._loss_fn, precision, self._reference_model(sharded), self._dpo_terms
            )
        normalizer = LossNormalizer(
            self._loss_fn,
            mode=mode,
            dp_group=dp_group,
            units=(
                self._dpo_terms.units(self._ignore_index)
                if self._dpo_terms is not None
                else router.units(self._loss_fn)
            ),
            statistics=preference.statistics if preference is not None else (),
        )
        micro_batch_context = None
        if sharded:  # the distributed recipes' default policy
            micro_batch_context = partial(
                distributed.gradient_sync, model, distributed.GradientSync.EVERY_MICRO_BATCH
            )
        # Timings and traces off: the report compares numbers; the hook stays the recipes' own.
        profiler = setup_profiler(
            None,
            self._device,
            model,
            output_dir=self._cfg.output_dir,
            micro_batching=micro_batching.value,
            log_timings=False,
        )
        windows = normalizer.windows(self._dataloader(split, micro_batching), self._num_steps)
        loss_step = partial(
            causal_lm_loss, model, self._loss_fn, precision=precision, router=router
        )
        windows = router.track(windows)  # its statistics start empty every window
        if preference is not None:  # the DPO recipes' loss step
            loss_step = preference.loss_step
        if self._teacher is not None:  # the KD recipes' loss step and windows
            distiller = Distiller(
                model,
                self._teacher,
                self._loss_fn,
                self._kd_loss_fn,
                self._kd_ratio,
                precision=precision,
                device=self._device,
            )
            loss_step, windows = distiller.loss_step, distiller.track(windows)
        # A step bar per run on rank 0; the other ranks' one-device runs log their line only.
        bar = tqdm(
            total=self._num_steps,
            desc=f"run {run}/{self._num_runs}",
            disable=not self._is_rank_zero,
        )
        tally = RunTally()
        labels = []  # the full batch's, for the report's data shape
        # A QAT config's fake_quant_after_n_steps, as the QAT recipe switches it.
        fake_quant = FakeQuantSchedule(model, self._cfg.fake_quant_after_n_steps)
        for step, window in enumerate(windows, start=1):
            fake_quant.before_window(step - 1)
            if run == 1:
                labels += [mb.batch["labels"] for mb in window.micro_batches]
            train_window(
                window,
                model=model,
                loss_step=loss_step,
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
            tally.add(window)  # its loss over every rank of the run, what this rank ran
            bar.update(1)
        bar.close()
        if run == 1:
            train_on_input = None  # several datasets have several settings
            if not OmegaConf.is_list(self._cfg.dataset):
                train_on_input = self._cfg.dataset.get("train_on_input")
            self._data_shape = DataShape.of_labels(labels, self._ignore_index, train_on_input)
        if sharded:  # summed over the run's ranks
            tally.reduce(self._mesh.count_group(), self._device)
        keep = not sharded or self._is_rank_zero  # a sharded run's weights: on rank 0
        weights = trained_weights(model, adapters_only=self._is_lora, keep=keep)
        return tally.run(mode.value, micro_batching.value, str(split), weights, variant)

    def _reference_model(self, sharded: bool) -> nn.Module | None:
        """Full DPO's frozen reference in ``dtype``, built on first use once on one device and
        once sharded like the policy; None for LoRA DPO (the policy with its adapters off)."""
        if self._ref_models is None:
            return None
        return self._ref_models.get(sharded=sharded, dtype=self._dtype)

    def save_report(self) -> Path | None:
        """Rank 0 writes the report, figure, summary and TensorBoard runs."""
        if not self._is_rank_zero:
            return None
        precision = PrecisionView(
            dtype=self._dtype_name,
            master_weights=self._master_weights,
            noise_floor=self._noise_floor,
            reference_to_fp32=self._reference_to_fp32,
        )
        report = write_report(
            self._report_dir,
            reference=self._reference,
            summaries=self._summaries,
            precision=precision,
            what="adapter weights" if self._is_lora else "weights",
            micro_batch_tokens=self._micro_batch_tokens,
            fp32_reference=self._fp32_reference,
            data=None if self._is_preference else self._data_shape,
            distillation=self._distillation(),
            preference=(
                Preference.of(self._loss_fn, self._is_lora, self._dpo_terms)
                if self._dpo_terms is not None
                else None
            ),
            router=(
                RouterTerm(self._router_coef, str(self._router_balance.value))
                if self._router_coef > 0
                else None
            ),
            fake_quantisation=self._fake_quantisation(),
        )
        log.info(f"Parity report: {report} (figure: {self._report_dir / 'parity.png'})")
        return report

    def _distillation(self) -> Distillation | None:
        """A KD config's mix, for the report to say what every run trained."""
        if not self._is_kd:
            return None
        return Distillation(
            kd_ratio=float(self._kd_ratio),
            loss=type(self._loss_fn).__name__,
            kd_loss=type(self._kd_loss_fn).__name__,
            teacher=str(self._cfg.teacher_model._component_),
        )

    def _fake_quantisation(self) -> FakeQuantisation | None:
        """A QAT config's quantizer, for the report to say what every run trained under."""
        if self._cfg.quantizer is None:
            return None
        return FakeQuantisation(
            quantizer=str(self._cfg.quantizer._component_).rsplit(".", 1)[-1],
            groupsize=self._cfg.quantizer.get("groupsize"),
            after_n_steps=self._cfg.fake_quant_after_n_steps,
        )

    def cleanup(self) -> None:
        distributed.destroy()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: validates the config strictly, then trains every planned run. A GRPO
    config (one that sets ``grpo_samples``) is trained by exactga.parity.grpo.GrpoParity, a PPO
    one (``ppo_batch_size``) by exactga.parity.ppo.PpoParity, each from its typed settings."""
    if is_grpo_config(cfg):
        grpo = typed_settings(
            validate_run_config(cfg, GrpoParityConfig, RECIPE_NAME), GrpoParityConfig
        )
        recipe = GrpoParity(grpo)
        recipe.setup(grpo)
    elif is_ppo_config(cfg):  # see [ppo parity] in exactga.parity.ppo
        ppo = typed_settings(
            validate_run_config(cfg, PpoParityConfig, RECIPE_NAME), PpoParityConfig
        )
        recipe = PpoParity(ppo)
        recipe.setup(ppo)
    else:
        settings = typed_settings(
            validate_run_config(cfg, GaParityConfig, RECIPE_NAME), GaParityConfig
        )
        recipe = GaParityRecipe(settings)
        recipe.setup(settings)
    recipe.train()
    recipe.save_report()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))  # bad input: one message; see [user errors]
