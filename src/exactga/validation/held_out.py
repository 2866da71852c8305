"""Validation during training, for every family that validates: the validation set, the sums
of a held-out loss over every scored token of every rank, when to validate and where it goes.

A recipe with ``dataset_val`` builds its :class:`Validation` and, every
``run_val_every_n_steps`` optimizer steps and at the end of each epoch, calls its family's
figure. Three are :func:`loss_sums` over a validation set:
- ``exactga.sft.validation.validation_loss``: the loss and perplexity;
- ``exactga.kd.validation.distillation_validation_loss``: the student's class loss, the KD loss
  and their mix;
- ``exactga.dpo.validation.preference_validation_loss``: the per-pair loss, reward accuracy and
  margins (KTO's over its examples).
``exactga.grpo.validation`` and ``exactga.ppo.validation`` generate for held-out prompts and
score them (reward mean, success rate; PPO's value loss), with the same schedule and logging and
the same RNG and mode keeping (:func:`training_rng_kept`, :func:`eval_mode`). Without
``dataset_val`` nothing here runs. See [validation loss as one batch], [validation set order]
and docs/validation.md.

Note [validation loss as one batch]
The figure is the validation set's loss as if it were one batch on one device: the sum of the
per-token losses of every scored token of every validation sample on every rank (a position
whose label *after the one-position shift* is not ignored, the count of
[shifted token count] in exactga.accumulation.loss_units), divided by the number of those
tokens over every rank. It is computed as training weighs a window: each batch's mean loss,
through the family's training loss step (for SFT the recipe's own ``loss_fn`` through
``exactga.sft.loss.mean_token_loss``, so the same chunked or fused output projection and the
same cut to the scored positions), times its host-counted tokens is that batch's token-loss
sum; the sums (fp64) and the counts of every batch and rank are added, then divided once. So
``batch_size_val``, the number of ranks and how the rows fall into batches change nothing but
fp32 rounding inside each batch's mean. The usual figures do not have this property: a mean of
batch means (Hugging Face's ``eval_loss``) weighs a token by one over its batch's count, and a
count taken before the shift (torchtune main's ``validate``) adds each row's first label,
which no position predicts, to the denominator.

Note [validation set order]
The validation set is read in its own fixed order, never shuffled, by index: rank ``r`` of
``n`` takes samples ``r, r + n, r + 2n, ...`` of the set (its first ``max_val_batches x
batch_size_val`` samples under ``max_val_batches``), in batches of ``batch_size_val``. No data
loader, sampler or worker seed is made, so validating draws nothing from the training RNGs and
leaves the training loader's position alone; the model is in eval mode (dropout off) with no
gradient, and the CPU and device RNG states are restored afterwards all the same, so a run with
validation trains bit-identically to one without, and a resumed run validates at the same steps
with the same figures. Under FSDP every rank must run the same forwards: a rank with fewer
batches than rank 0 runs zero-weight fillers (a batch with every label ignored and one planted
label, as [empty micro-batches under FSDP] describes), and a batch without a scored token still
runs there, weighing 0; on one device such a batch is skipped.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset
from torchtune import utils

from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    LossUnits,
    loss_ignore_index,
    masked_labels,
)
from exactga.config.schemas import FullFinetuneSingleDeviceConfig, LoraFinetuneSingleDeviceConfig
from exactga.data.collation import Collate, micro_batch_collate
from exactga.data.loader import load_dataset, model_vocab_size
from exactga.data.micro_batching import MicroBatchingSettings
from exactga.data.packing import uses_flex_attention
from exactga.runtime.distributed import log_rank_zero


class ValidationSet:
    """This rank's share of the validation set, in batches; see [validation set order].

    Args:
        dataset: the validation samples (``exactga.data.loader.load_dataset``).
        batch_size: samples per batch (``batch_size_val``).
        collate: how a batch's samples are collated (the training loader's collate).
        max_batches: read only the first ``max_batches x batch_size`` samples of the set
            (``max_val_batches``); ``None`` reads them all.
        num_replicas: data-parallel ranks reading the set.
        rank: this process's data-parallel rank.
        dp_group: the group a figure's sums are added over, the runtime's count group (every
            rank that holds other tokens; ``None``: one process); kept with the set so that no
            caller can leave it out.
        ignore_index: the loss's ignore index, which a filler's labels take.
        emptied: how a filler is made of a collated batch (``LossUnits.emptied``: DPO's one pair
            marked as none); by default every label ignored.

    Raises:
        ValueError: the set has no sample.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        collate: Collate,
        max_batches: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        ignore_index: int = IGNORE_INDEX,
        emptied: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        num_samples = len(dataset)  # type: ignore[arg-type]
        if num_samples == 0:
            raise ValueError("config key 'dataset_val': the validation set has no sample.")
        if max_batches is not None:
            num_samples = min(num_samples, max_batches * batch_size)
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate = collate
        self.dp_group = dp_group
        self.emptied = emptied or (lambda batch: masked_labels(batch, ignore_index))
        self.num_samples = num_samples  # over every rank
        self.indices = list(range(rank, num_samples, num_replicas))
        # Rank 0 holds the most samples; every rank runs as many batches as it does.
        self.num_batches = math.ceil(math.ceil(num_samples / num_replicas) / batch_size)

    def batches(self) -> Iterator[dict[str, Any]]:
        """This rank's batches, on the host, then fillers without a unit (every label ignored) up
        to ``num_batches`` (a rank of fewer samples than rank 0's; see [validation set order])."""
        own = [
            self.indices[start : start + self.batch_size]
            for start in range(0, len(self.indices), self.batch_size)
        ]
        for indices in own:
            yield self.collate([self.dataset[i] for i in indices])
        for _ in range(self.num_batches - len(own)):
            yield self.emptied(self.collate([self.dataset[0]]))


@dataclass(frozen=True)
class LossSums:
    """Each part's sum over every unit of the set on every rank (scored tokens; DPO's pairs),
    and their count."""

    sums: tuple[float, ...]
    num_units: int

    def mean(self, part: int) -> float:
        """Part ``part``'s figure of the set as one batch: its sum over the one count (NaN
        without a unit)."""
        return self.sums[part] / self.num_units if self.num_units else math.nan


def loss_sums(
    validation_set: ValidationSet,
    batch_means: Callable[[dict[str, Any]], torch.Tensor],
    units: LossUnits,
    *,
    models: Sequence[nn.Module],
    device: torch.device,
) -> LossSums:
    """The sums of [validation loss as one batch], for one figure or several over the same
    units (``units``: the training normaliser's, scored tokens after the shift or pairs).

    ``batch_means`` takes a batch already on ``device`` (as ``units.prepare`` leaves it) and
    returns a 1-d tensor: each part's mean over the batch's units (one part for SFT; the class
    and KD losses for distillation; DPO's loss, reward accuracy and margin over pairs). Each
    mean times the batch's host count is its sum; the sums
    (fp64) and counts of every batch and rank are added. ``models`` run in eval mode, without
    gradients, the RNG states restored after (see [validation set order]); every rank of
    the set's ``dp_group`` calls it, and a rank with fewer batches runs zero-weight fillers. One
    host read, and under data parallelism one all-reduce of ``parts + 1`` numbers, per call.
    """
    dp_group = validation_set.dp_group
    sharded = dp_group is not None and dist.get_world_size(dp_group) > 1
    means: list[torch.Tensor] = []
    counts: list[int] = []
    with training_rng_kept(device), torch.no_grad(), contextlib.ExitStack() as modes:
        for model in models:
            modes.enter_context(eval_mode(model))
        for batch in validation_set.batches():
            num_units = units.count(batch)
            if num_units == 0 and not sharded:
                continue  # nothing to score, and no other rank waits for its forward
            batch = units.prepare(batch, num_units, runs_empty=num_units == 0)
            utils.batch_to_device(batch, device)
            means.append(batch_means(batch))
            counts.append(num_units)
    totals = _unit_totals(means, counts)  # this rank's [sums..., count], fp64 on the host
    if sharded:
        totals = totals.to(_collective_device(dp_group))
        dist.all_reduce(totals, group=dp_group)
    *sums, num_units = totals.tolist()
    return LossSums(sums=tuple(sums), num_units=int(num_units))


def _unit_totals(means: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """``[sum of each part over the units..., number of units]`` of this rank's batches, fp64
    on the host: each batch's mean times its count is its sum (a filler's count is 0, so it
    adds exactly 0). No batch run (one device, no unit): a count of 0, so no mean."""
    if not means:
        return torch.zeros(2, dtype=torch.float64)
    weights = torch.tensor(counts, dtype=torch.float64)
    losses = torch.stack([mean.detach().double() for mean in means]).cpu()
    return torch.cat(((losses * weights[:, None]).sum(dim=0), weights.sum().reshape(1)))


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """Where a tensor for ``group``'s collectives lives: the current GPU under NCCL."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode within, each submodule's own mode restored after (a module a
    recipe keeps in eval mode stays so)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def training_rng_kept(device: torch.device) -> Iterator[None]:
    """The CPU RNG's state, and ``device``'s where it is an accelerator, restored on exit: a
    validation (its dropout-free forwards, a reward's or a sampler's draws) takes nothing from
    training's random streams."""
    on_accelerator = device.type != "cpu"
    with torch.random.fork_rng(
        devices=[device] if on_accelerator else [],
        device_type=device.type if on_accelerator else None,
    ):
        yield


class _Runtime(Protocol):
    """What :func:`validation_from_settings` reads of a recipe's runtime
    (``exactga.runtime.runtime.Runtime``): which data-parallel rank of how many it is."""

    @property
    def dp_size(self) -> int: ...

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_group(self) -> dist.ProcessGroup | None: ...


class ValidationFigure(Protocol):
    """What a family's validation returns (``exactga.sft.validation.ValidationLoss``,
    ``exactga.kd.validation.DistillationValidationLoss``,
    ``exactga.dpo.validation.PreferenceValidationLoss``): its scalars and its console line."""

    def metrics(self) -> dict[str, float]:
        """The logged scalars; none without a unit to measure."""
        ...

    def line(self, step: int) -> str: ...


@dataclass(frozen=True)
class BestFigure:
    """Which logged validation scalar ``keep_best_checkpoint`` ranks the weights by, and which
    way; each family's validation declares its own (:data:`LOWEST_VAL_LOSS`,
    :data:`HIGHEST_REWARD_MEAN`), so no recipe decides it. See [the best checkpoint] in
    exactga.run.steps."""

    name: str  # the scalar among the figure's metrics
    higher_is_better: bool

    def improves(self, value: float, best: float | None) -> bool:
        """Whether ``value`` beats ``best`` (``None``: no best yet); a tie keeps the earlier
        best, and a non-finite value is never the best."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        return value > best if self.higher_is_better else value < best

    def __str__(self) -> str:
        return f"the {'highest' if self.higher_is_better else 'lowest'} {self.name}"


# The loss families' (fine-tuning, distillation, DPO): the held-out loss.
LOWEST_VAL_LOSS = BestFigure("val/loss", higher_is_better=False)
# GRPO's and PPO's: the mean reward of the held-out prompts' completions.
HIGHEST_REWARD_MEAN = BestFigure("val/reward_mean", higher_is_better=True)


class Validation:
    """When a recipe validates, what on, and where the figures go; ``None`` from
    :func:`validation_from_settings` when the config has no ``dataset_val``.

    Args:
        validation_set: this rank's share of the set: a :class:`ValidationSet` of samples, or
            a family's own held-out prompts (GRPO's and PPO's, which generate before they score).
        every_n_steps: validate after every such optimizer step (``run_val_every_n_steps``);
            ``None``: at the end of each epoch only.
        metric_logger: where the figure's ``val/*`` scalars go; ``None`` on ranks that do not
            write.
        keep_best: ``keep_best_checkpoint``: the run's ``StepBook`` saves the weights of each
            new best ``best`` (see [the best checkpoint] in exactga.run.steps).
        best: the figure the best checkpoint is ranked by, the family's: the held-out loss
            by default, GRPO's and PPO's reward mean (their ``*_validation_from_settings``).

    Attributes:
        after_log: called on every rank with the step and the logged scalars once a figure is
            logged; the run's ``StepBook`` sets it (the best checkpoint, the step's checkpoint).
    """

    def __init__(
        self,
        validation_set: Any,
        *,
        every_n_steps: int | None,
        metric_logger: Any | None,
        keep_best: bool = False,
        best: BestFigure = LOWEST_VAL_LOSS,
    ) -> None:
        self.validation_set = validation_set
        self.every_n_steps = every_n_steps
        self.metric_logger = metric_logger
        self.keep_best = keep_best
        self.best = best
        self.after_log: Callable[[int, dict[str, float]], None] | None = None
        self._last_step: int | None = None  # an epoch's last step is validated once

    def due(self, step: int, *, epoch_end: bool = False) -> bool:
        """Whether to validate after optimizer step ``step``: every ``every_n_steps`` steps
        and at an epoch's end, once per step."""
        if step == self._last_step:
            return False
        return epoch_end or (self.every_n_steps is not None and step % self.every_n_steps == 0)

    def log(self, figure: ValidationFigure, step: int) -> None:
        """``figure`` to the metric logger at ``step`` and one console line (rank 0), then
        :attr:`after_log` (every rank: the figure is every rank's)."""
        self._last_step = step
        metrics = figure.metrics()
        if self.metric_logger is not None and metrics:
            self.metric_logger.log_dict(metrics, step=step)
        log_rank_zero(figure.line(step))
        if self.after_log is not None:
            self.after_log(step, metrics)


def validation_from_settings(
    settings: FullFinetuneSingleDeviceConfig | LoraFinetuneSingleDeviceConfig,
    *,
    tokenizer: Any,
    loss_fn: nn.Module,
    model: nn.Module,
    runtime: _Runtime,
    metric_logger: Any | None,
    collate: Collate | None = None,
    emptied: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Validation | None:
    """The recipe's validation from its typed settings (``dataset_val``,
    ``run_val_every_n_steps``, ``batch_size_val``, ``max_val_batches``,
    ``keep_best_checkpoint``), or ``None`` without
    ``dataset_val``. The set is built and checked as the training set is (any dataset builder,
    or a list of them; rows checked), and collated with the training loader's ``collate_fn``
    and ``pad_to_multiple_of``, or with ``collate`` (DPO's pairs), fillers made by ``emptied``
    (see :class:`ValidationSet`)."""
    if settings.dataset_val is None:
        return None
    dataset = load_dataset(settings.dataset_val, tokenizer, model_vocab_size(model), "dataset_val")
    batch_size = settings.batch_size_val or settings.batch_size
    ignore_index = loss_ignore_index(loss_fn)
    collate = collate or micro_batch_collate(
        MicroBatchingSettings(
            batch_size=batch_size, pad_to_multiple_of=settings.pad_to_multiple_of
        ),
        settings.collate_fn,
        padding_idx=tokenizer.pad_id,
        ignore_idx=ignore_index,
        packed_data=dataset.packed,  # a CheckedDataset says whether its samples are packs
        flex_attention=uses_flex_attention(settings.device),
    )
    validation_set = ValidationSet(
        dataset,
        batch_size=batch_size,
        collate=collate,
        max_batches=settings.max_val_batches,
        num_replicas=runtime.dp_size,
        rank=runtime.dp_rank,
        ignore_index=ignore_index,
        emptied=emptied,
        dp_group=runtime.count_group,  # its sums: see [mesh axes and the loss count]
    )
    return Validation(
        validation_set,
        every_n_steps=settings.run_val_every_n_steps,
        metric_logger=metric_logger,
        keep_best=settings.keep_best_checkpoint,  # ranked by the default, LOWEST_VAL_LOSS
    )
