"""Knowledge distillation under exact accumulation: the teacher, the combined loss, its checks.

The two KD recipes train a student on a mix of two losses, and every piece of that mix lives
here: the teacher's forward (frozen, under no_grad), the combined loss of one micro-batch,
the start-up check of the KD loss's denominator, and the exact window values of both parts for
the ``class_loss`` and ``kd_loss`` metrics. The weighting of micro-batches is still the shared
one, ``Window.scale`` in :mod:`exactga.accumulation.normalization`; see [two token-normalised
losses].

Note [two token-normalised losses]
The student's loss on micro-batch m is ``L_m = (1 - r) CE_m + r KD_m`` with ``r = kd_ratio``.
torchtune's CE and its KD losses (forward, reverse and symmetric KL, chunked or not) are both
means over the same positions: those whose shifted label is not ignored (the KD loss masks
with the labels it is given, the shifted ones). So ``L_m = sum_{t in T_m} l_t / n_m`` with
``l_t = (1 - r) ce_t + r kd_t``: one per-token loss, one mean over n_m tokens. Scaling it by
``dp_size * n_m / N`` before backward (see [loss scaled before backward]) leaves the gradient
of ``sum_t l_t / N`` over the whole window and every rank, which is
``(1 - r) sum_t ce_t / N + r sum_t kd_t / N``: each loss weighted by the window's one count,
exactly as full-batch training weights it. No second count, no second factor, no gradient pass.
That holds only if the KD loss's denominator is n_m, so it is measured on the first batch, as
the CE loss's is; see [kd denominator probe].

Stock torchtune 0.6.1 backpropagates each micro-batch's *mean* combined loss unscaled and then
multiplies the gradients by ``1 / num_tokens`` (counted before the shift): the gradient is the
sum of micro-batch means over the window's count, which is neither the window mean nor
independent of the split, at any ``gradient_accumulation_steps`` (docs/math.md, and
docs/knowledge_distillation_single_device.md for the measured difference). The ``post_scale``
baseline reproduces it; see [stock kd weighting].

Note [stock kd weighting]
``post_scale`` in exactga.accumulation.normalization is stock's *fine-tuning* weighting: each
micro-batch's mean loss times its count before the shift, then the gradient pass by ``dp_size``
over the window's count (reduced over the ranks). Stock's KD recipes (single-device and distributed)
keep the gradient pass but backpropagate each mean unscaled. So under ``post_scale``
:meth:`Distiller.track` turns the windows' ``post_scale_weights_by_count`` off (see [baseline
modes] in exactga.accumulation.normalization): each mean goes to backward as it is, the window still
records it for the logged loss, and its own gradient pass follows: stock's KD weighting, op
for op. Exact and naive windows pass unchanged (naive, the
mean of micro-batch means over ga, means the same for KD as for fine-tuning).

Note [kd denominator probe]
A KD loss takes student and teacher logits. With all-zero student logits over a two-way
vocabulary and teacher logits ``(1, 0)``, every scored position costs the same value c (log 2
for forward KL; a positive constant for reverse and symmetric KL), so a loss that divides by d
returns ``num_scored * c / d``. One call on a single live position gives c (any reduction of one
position divides by 1), a second on the batch's masks gives d. No model runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torchtune import config, training
from torchtune.modules.loss import (
    ForwardKLLoss,
    ForwardKLWithChunkedOutputLoss,
    ReverseKLLoss,
    ReverseKLWithChunkedOutputLoss,
    SymmetricKLLoss,
    SymmetricKLWithChunkedOutputLoss,
)

from exactga.accumulation.forward import projecting_only
from exactga.accumulation.loss_units import (
    LOSS_POSITIONS,
    count_loss_tokens,
    loss_ignore_index,
    shift_labels,
)
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.accumulation.normalization import Window
from exactga.model_build.frozen import frozen_forward
from exactga.runtime.distributed import is_rank_zero
from exactga.runtime.precision import Precision

# Config keys of the KD recipes that decide what a run computes, beside
# exactga.run.resume.FINGERPRINT_KEYS (``run_fingerprint(cfg, KD_FINGERPRINT_KEYS, ...)``): a resume
# with another teacher or mix is refused like one with another model; see
# [what a resume may change].
KD_FINGERPRINT_KEYS = ("teacher_model", "kd_loss", "kd_ratio", "loss")


def check_kd_losses(loss_fn: nn.Module, kd_loss_fn: nn.Module) -> None:
    """The class loss and the KD loss must score the same positions of the same logits.

    Raises:
        ValueError: naming ``kd_loss`` when its ``ignore_index`` or ``num_output_chunks``
            differs from the class loss's (stock asserts the latter only).
    """
    ignore, kd_ignore = loss_ignore_index(loss_fn), loss_ignore_index(kd_loss_fn)
    if ignore != kd_ignore:
        raise ValueError(
            f"config key 'kd_loss': its ignore_index {kd_ignore} differs from the loss's "
            f"{ignore}; both losses must mask the same labels."
        )
    chunks = getattr(loss_fn, "num_output_chunks", None)
    kd_chunks = getattr(kd_loss_fn, "num_output_chunks", None)
    if chunks != kd_chunks:
        raise ValueError(
            f"config keys 'loss' and 'kd_loss': num_output_chunks {chunks} and {kd_chunks} "
            "differ; use the chunked losses together (CEWithChunkedOutputLoss with "
            "ForwardKLWithChunkedOutputLoss) or the plain ones together, with equal chunks."
        )


def check_vocabularies(student_vocab: int, teacher_vocab: int) -> None:
    """Forward KL compares the two output distributions position by position, so they must
    cover the same token ids; see [padded teacher vocabulary].

    Raises:
        ValueError: naming ``teacher_model`` when its output is smaller than the student's.
    """
    if teacher_vocab < student_vocab:
        raise ValueError(
            f"config key 'teacher_model': its vocabulary ({teacher_vocab}) is smaller than the "
            f"student's ({student_vocab}); distillation needs the student's tokenizer and at "
            "least its output size in the teacher."
        )


# Note [padded teacher vocabulary]
# Models of one family share a tokenizer but may pad their output layer differently: Qwen2.5
# 7B has 152,064 output rows, 0.5B 151,936, for a tokenizer of 151,665 ids. The rows past the
# student's output are ids no token maps to (the data are checked against the student's
# vocabulary at start-up), so the teacher's logits are cut to the student's width before the KD
# loss: the teacher's distribution over the ids that exist. For a trained teacher the cut mass is
# nil; the loss is then exactly torchtune's on models of equal width.


def _cut_to_vocab(teacher_logits: Any, vocab_size: int) -> Any:
    """The teacher's logits over the student's ``vocab_size`` ids; see [padded teacher
    vocabulary]. A no-op (no copy) when the widths agree."""
    if isinstance(teacher_logits, list):
        return [_cut_to_vocab(chunk, vocab_size) for chunk in teacher_logits]
    if teacher_logits.size(-1) == vocab_size:
        return teacher_logits
    return teacher_logits[..., :vocab_size]


# Note [kd logits at loss positions]
# Both losses mask by the shifted labels, so a position whose label is ignored adds exactly 0 to
# the CE and to the KD loss, and neither denominator counts it. So, as the SFT loss step does
# (see [logits only at loss positions] in exactga.accumulation.step), the student's and the
# teacher's final norm and output projection run only at the scored positions, the same index for
# both, and the labels are cut to match: the same terms over the same count, so the loss and the
# gradients are the full projection's up to float rounding, and the two vocabulary-wide logit
# tensors (the teacher's is the larger with a wider teacher vocabulary) shrink to the loss
# tokens. Chunked losses chunk the one row of cut logits and the cut labels alike. Should only
# one model be cuttable (not a torchtune decoder, or returning hidden states), the other's full
# logits are cut to the same positions after its forward.


def _at_positions(logits: Any, positions: torch.Tensor, num_chunks: int | None) -> Any:
    """Full logits ``[b, s, v]`` (or their chunks) at ``positions`` as one row ``[1, n, v]``,
    chunked as a cut forward chunks it; see [kd logits at loss positions]."""
    if isinstance(logits, list):
        assert num_chunks is not None, "chunked logits come with a chunked loss"
        row = _at_positions(torch.cat(logits, dim=1), positions, None)
        return list(row.chunk(num_chunks, dim=1))
    return logits.reshape(-1, logits.size(-1)).index_select(0, positions).unsqueeze(0)


# ---------------------------------------------------------------------------------------------
# The KD loss's mean without a host read. See [kd mean without a host read].

# Note [kd mean without a host read]
# torchtune's forward and reverse KL losses (the symmetric one calls both, the chunked forward
# KL checks too) end with ``if sum_masks == 0: return 0``: a value read back to the host, which
# on a GPU makes the host wait for every kernel queued so far, once per micro-batch
# (tests/test_host_reads.py). Each also gives its sum undivided (``normalize=False``; the
# chunked ones sum their inner loss per chunk), so the mean is taken here, on the device: the
# same sums, in the same order, divided by the same count, clamped to 1 where torchtune returns
# 0 (a sum over no token is 0; the chunked reverse and symmetric KL returned 0/0 = NaN there).
# Where a token is scored the result is bit-identical to the loss's own. Any other KD loss (a
# user's own, a subclass of one of torchtune's included) is called as it is.


def kd_mean(kd_loss_fn: nn.Module, logits: Any, teacher_logits: Any, labels: torch.Tensor) -> Any:
    """``kd_loss_fn``'s mean over the non-ignored positions of ``labels`` (shifted), computed
    without a host read for torchtune's KD losses; see [kd mean without a host read]."""
    kind = type(kd_loss_fn)  # torchtune's own classes: a subclass may compute otherwise
    if kind in _CHUNKED_KD:
        inner = _CHUNKED_KD[kind](kd_loss_fn)
        chunks = labels.chunk(kd_loss_fn.num_output_chunks, dim=1)
        total: Any = 0.0
        for student, teacher, chunk in zip(logits, teacher_logits, chunks, strict=True):
            student = student.reshape(-1, student.size(-1))
            teacher = teacher.reshape(-1, teacher.size(-1))
            total += inner(student, teacher, chunk.reshape(-1), normalize=False)
        return total / _num_scored(labels, kd_loss_fn.ignore_index)
    if kind is SymmetricKLLoss:  # its two parts' means, mixed as it mixes them
        ratio = kd_loss_fn.sym_kd_ratio
        forward = kd_mean(kd_loss_fn.fkl, logits, teacher_logits, labels)
        return ratio * forward + (1 - ratio) * kd_mean(
            kd_loss_fn.rkl, logits, teacher_logits, labels
        )
    if kind in (ForwardKLLoss, ReverseKLLoss):
        summed = kd_loss_fn(logits, teacher_logits, labels, normalize=False)
        return summed / _num_scored(labels, kd_loss_fn.ignore_index)
    return kd_loss_fn(logits, teacher_logits, labels)


# torchtune's chunked KD losses, each with the loss it sums per chunk.
_CHUNKED_KD = {
    ForwardKLWithChunkedOutputLoss: lambda loss: loss.fkl_loss,
    ReverseKLWithChunkedOutputLoss: lambda loss: loss.rkl_loss,
    SymmetricKLWithChunkedOutputLoss: lambda loss: loss.sym_kl_loss,
}


def _num_scored(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The positions whose label is scored, on the device, at least 1 (the sum of none is 0)."""
    return (labels != ignore_index).int().view(-1).sum(dim=0).clamp(min=1)


# ---------------------------------------------------------------------------------------------
# Start-up check: the KD loss's own denominator equals our count. See [kd denominator probe].


def _kd_probe(kd_loss_fn: nn.Module, labels: torch.Tensor) -> float:
    student = torch.zeros(*labels.shape, 2)
    teacher = torch.zeros(*labels.shape, 2)
    teacher[..., 0] = 1.0
    num_chunks = getattr(kd_loss_fn, "num_output_chunks", None)
    if num_chunks is not None:
        loss = kd_loss_fn(
            list(student.chunk(num_chunks, dim=1)), list(teacher.chunk(num_chunks, dim=1)), labels
        )
    else:
        loss = kd_loss_fn(student.reshape(-1, 2), teacher.reshape(-1, 2), labels.reshape(-1))
    if loss.numel() != 1:
        raise ValueError(
            f"config key 'kd_loss': {type(kd_loss_fn).__name__} returned {loss.numel()} values; "
            "exactga needs a scalar loss that is a mean over non-ignored tokens."
        )
    return float(loss)


def kd_loss_denominator(kd_loss_fn: nn.Module, shifted_labels: torch.Tensor) -> float:
    """The number of tokens ``kd_loss_fn`` divides by on these labels, measured by probing it."""
    ignore_index = loss_ignore_index(kd_loss_fn)
    probe_labels = torch.where(shifted_labels == ignore_index, ignore_index, 0).cpu()
    per_token = _kd_probe(kd_loss_fn, torch.zeros(1, 1, dtype=probe_labels.dtype))
    num_counted = int((probe_labels != ignore_index).sum())
    loss = _kd_probe(kd_loss_fn, probe_labels)
    if per_token == 0.0 or loss == 0.0:
        raise ValueError(
            f"config key 'kd_loss': {type(kd_loss_fn).__name__} returned 0 on a probe where "
            "student and teacher disagree; exactga cannot measure what it divides by."
        )
    return num_counted * per_token / loss


def verify_kd_loss_denominator(
    kd_loss_fn: nn.Module, labels: torch.Tensor, num_tokens: int | None = None
) -> None:
    """Fail loudly if ``kd_loss_fn`` does not divide by the host count of these labels (a
    batch's labels as the loader gives them, before the shift), as the CE check does."""
    ignore_index = loss_ignore_index(kd_loss_fn)
    if num_tokens is None:
        num_tokens = count_loss_tokens(labels, ignore_index)
    if num_tokens == 0:
        return
    measured = kd_loss_denominator(kd_loss_fn, shift_labels(labels, ignore_index))
    if not math.isclose(measured, num_tokens, rel_tol=1e-5):
        raise ValueError(
            f"config key 'kd_loss': {type(kd_loss_fn).__name__} divides the first batch by "
            f"{measured:.1f} tokens, but exactga counts {num_tokens} loss tokens (labels after "
            f"the one-position shift, ignore_index={ignore_index}). The KD loss must be a mean "
            "over the positions whose label is not ignored, as the class loss is; see "
            "[two token-normalised losses] in exactga.kd.distillation."
        )


# ---------------------------------------------------------------------------------------------
# The combined loss of one micro-batch, and the exact window values of its two parts.


def build_kd_losses(
    cfg_loss: DictConfig,
    cfg_kd_loss: DictConfig,
    student: nn.Module,
    teacher: nn.Module,
    *,
    compile_loss: bool,
) -> tuple[nn.Module, nn.Module]:
    """The class loss and the KD loss of a KD config, compiled when asked. A chunked class
    loss (``num_output_chunks``) has both models return their logits in as many chunks, which
    is what the two losses take."""
    loss_fn = config.instantiate(cfg_loss)
    kd_loss_fn = config.instantiate(cfg_kd_loss)
    if compile_loss:
        loss_fn = training.compile_loss(loss_fn, verbose=is_rank_zero())
        kd_loss_fn = training.compile_loss(kd_loss_fn, verbose=is_rank_zero())
    if hasattr(loss_fn, "num_output_chunks"):
        student.set_num_output_chunks(loss_fn.num_output_chunks)
        teacher.set_num_output_chunks(loss_fn.num_output_chunks)
    return loss_fn, kd_loss_fn


class Distiller:
    """The student's loss against a frozen teacher; the KD recipes' ``loss_step``.

    Args:
        student: the model being trained (LoRA adapters over a frozen base).
        teacher: the frozen teacher (:func:`exactga.model_build.frozen.freeze_model`), possibly
            sharded with FSDP2.
        loss_fn: the class loss (cross-entropy against the labels).
        kd_loss_fn: the KD loss (``kd_loss``), called as ``kd_loss_fn(student_logits,
            teacher_logits, labels)``.
        kd_ratio: ``r`` of [two token-normalised losses]: ``(1 - r) CE + r KD``.
        precision: the run's precision (the forwards run under its autocast).
        device: where a metric reduction's tensor lives (the data-parallel backend's device).
        activations_ctx: the student forward's activation offloading context, if any.
    """

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        loss_fn: nn.Module,
        kd_loss_fn: nn.Module,
        kd_ratio: float,
        *,
        precision: Precision,
        device: torch.device,
        activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        check_kd_losses(loss_fn, kd_loss_fn)
        self.student = student
        self.teacher = teacher
        self.loss_fn = loss_fn
        self.kd_loss_fn = kd_loss_fn
        self.kd_ratio = float(kd_ratio)
        self.precision = precision
        self.device = device
        self.activations_ctx = activations_ctx
        self._kd_denominator_verified = False
        # (class loss, kd loss) of each micro-batch of the current window, detached, in the
        # order the window ran them; read back only on logged steps.
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def teacher_logits(self, batch: dict[str, torch.Tensor]) -> Any:
        """The teacher's logits (a list of chunks with a chunked loss): no autograd graph and
        no saved activations; see [frozen forwards run under no_grad]."""
        with frozen_forward(), self.precision.autocast():
            return self.teacher(**batch)

    def loss_step(self, batch: dict[str, torch.Tensor]) -> MicroBatchLoss:
        """Forward both models on one micro-batch already on the device; its mean combined
        loss, for ``window.backward``. See [two token-normalised losses]."""
        class_loss, kd_loss = self.part_losses(batch, self.activations_ctx)
        self._parts.append((class_loss.detach(), kd_loss.detach()))
        return MicroBatchLoss((1.0 - self.kd_ratio) * class_loss + self.kd_ratio * kd_loss)

    def part_losses(
        self,
        batch: dict[str, torch.Tensor],
        activations_ctx: contextlib.AbstractContextManager[Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The class loss and the KD loss of one micro-batch already on the device, each the
        mean over its scored tokens (``activations_ctx`` around the student's forward). Both
        models project only the scored positions when the batch carries their index, see [kd
        logits at loss positions]."""
        labels = batch.pop("labels")
        positions = batch.pop(LOSS_POSITIONS, None)
        with (
            projecting_only(self.teacher, positions) as teacher_cut,
            projecting_only(self.student, positions) as student_cut,
        ):
            # The teacher first: its activations are gone before the student's are made, so
            # the peak holds one model's activations plus the teacher's logits.
            teacher_logits = self.teacher_logits(batch)
            with activations_ctx or contextlib.nullcontext(), self.precision.autocast():
                logits = self.student(**batch)
        labels = shift_labels(labels, loss_ignore_index(self.loss_fn))
        if teacher_cut or student_cut:
            labels = labels.reshape(-1).index_select(0, positions).unsqueeze(0)
        num_chunks = getattr(self.kd_loss_fn, "num_output_chunks", None)
        if teacher_cut != student_cut:  # one model could not be cut: cut its logits
            if not teacher_cut:
                teacher_logits = _at_positions(teacher_logits, positions, num_chunks)
            else:
                logits = _at_positions(logits, positions, num_chunks)
        vocab_size = (logits[0] if isinstance(logits, list) else logits).size(-1)
        teacher_logits = _cut_to_vocab(teacher_logits, vocab_size)
        if not isinstance(logits, list):  # chunked losses take the lists as they are
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
            teacher_logits = teacher_logits.reshape(-1, teacher_logits.size(-1))
        kd_loss = kd_mean(self.kd_loss_fn, logits, teacher_logits, labels)
        class_loss = self.loss_fn(logits, labels)
        del logits, teacher_logits  # the largest activations, before backward
        return class_loss, kd_loss

    def track(self, windows: Iterable[Window]) -> Iterator[Window]:
        """The windows, with the KD loss's denominator checked on the first micro-batch with a
        loss token (on the host, before it moves; see [kd denominator probe]) and this
        distiller's per-window record cleared as each window opens. ``post_scale`` windows
        come weighted as stock's KD recipes weight them; see [stock kd weighting]."""
        for window in windows:
            window.post_scale_weights_by_count = False  # read by post_scale only
            if not self._kd_denominator_verified:
                for micro_batch in window.nonempty_micro_batches():
                    verify_kd_loss_denominator(
                        self.kd_loss_fn, micro_batch.batch["labels"], micro_batch.num_units
                    )
                    self._kd_denominator_verified = True
                    break
            self._parts = []
            yield window

    def window_metrics(self, window: Window) -> dict[str, float]:
        """``class_loss`` and ``kd_loss``: each part's exact mean over the window's loss tokens on
        every rank, so ``loss = (1 - kd_ratio) class_loss + kd_ratio kd_loss``. One all-reduce of
        two numbers under data parallelism (call on every rank, on logged steps only); nothing
        for a skipped window, as ``step_metrics`` logs no ``loss`` then."""
        if window.should_skip_step():
            return {}
        weights = [mb.num_units for mb in window.micro_batches_to_run()]
        assert len(weights) == len(self._parts), "one record per micro-batch the window ran"
        sums = torch.zeros(2, dtype=torch.float64)
        if self._parts:
            parts = torch.stack([torch.stack(p).double() for p in self._parts]).cpu()
            sums = (parts * torch.tensor(weights, dtype=torch.float64)[:, None]).sum(dim=0)
        if window.dp_group is not None and window.dp_size > 1:
            sums = sums.to(self.device)
            dist.all_reduce(sums, group=window.dp_group)
            sums = sums.cpu()
        num_tokens = window.num_global_units
        return {"class_loss": float(sums[0]) / num_tokens, "kd_loss": float(sums[1]) / num_tokens}
