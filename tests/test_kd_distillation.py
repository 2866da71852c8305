"""Unit tests of exactga.kd.distillation: the KD denominator check, the combined loss's weights,
and both models projecting only the scored positions (see [kd logits at loss positions]).

Tier (a) of docs/contributing.md point 9: library functions against naive references, no launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from grouping import GroupingNormalizer
from torch import nn
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules.loss import (
    CEWithChunkedOutputLoss,
    ForwardKLLoss,
    ForwardKLWithChunkedOutputLoss,
    ReverseKLLoss,
    ReverseKLWithChunkedOutputLoss,
    SymmetricKLLoss,
    SymmetricKLWithChunkedOutputLoss,
)
from unit_utils import prompt_masked_batch

from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    LOSS_POSITIONS,
    count_loss_tokens,
    loss_positions,
    shift_labels,
)
from exactga.accumulation.normalization import NormMode
from exactga.accumulation.step import train_window
from exactga.kd.distillation import (
    Distiller,
    _cut_to_vocab,
    check_kd_losses,
    check_vocabularies,
    kd_loss_denominator,
    kd_mean,
    verify_kd_loss_denominator,
)
from exactga.model_build.frozen import freeze_model
from exactga.profiling import ProfilerSettings, TrainingProfiler
from exactga.runtime.precision import Precision


def _labels() -> torch.Tensor:
    labels = torch.randint(0, 5, (3, 16))
    labels[0, :6] = IGNORE_INDEX  # a masked prompt
    labels[1, 10:] = IGNORE_INDEX  # padding
    return labels  # row 2: first label live, where a count before the shift is one too many


class SummedKL(ForwardKLLoss):
    """A KD loss that forgets to divide."""

    def forward(self, student, teacher, labels, normalize=True):
        return super().forward(student, teacher, labels, normalize=False)


@pytest.mark.parametrize(
    "kd_loss",
    [ForwardKLLoss(), ReverseKLLoss(), SymmetricKLLoss(0.3), ForwardKLWithChunkedOutputLoss(4)],
    ids=lambda loss: type(loss).__name__,
)
def test_torchtunes_kd_losses_divide_by_the_shifted_count(kd_loss):
    labels = _labels()
    measured = kd_loss_denominator(kd_loss, shift_labels(labels))
    assert measured == pytest.approx(count_loss_tokens(labels), rel=1e-6)
    verify_kd_loss_denominator(kd_loss, labels)


ALL_KD_LOSSES = [
    ForwardKLLoss(),
    ReverseKLLoss(),
    SymmetricKLLoss(0.3),
    ForwardKLWithChunkedOutputLoss(4),
    ReverseKLWithChunkedOutputLoss(4),
    SymmetricKLWithChunkedOutputLoss(4, 0.3),
]


def _kd_inputs(kd_loss: nn.Module, labels: torch.Tensor) -> tuple:
    """Student and teacher logits for ``labels`` (shifted), as the loss takes them."""
    generator = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(*labels.shape, 7, generator=generator) for _ in range(2))
    chunks = getattr(kd_loss, "num_output_chunks", None)
    if chunks is not None:
        return list(student.chunk(chunks, dim=1)), list(teacher.chunk(chunks, dim=1)), labels
    return student.reshape(-1, 7), teacher.reshape(-1, 7), labels.reshape(-1)


@pytest.mark.parametrize("kd_loss", ALL_KD_LOSSES, ids=lambda loss: type(loss).__name__)
def test_the_kd_mean_without_a_host_read_is_the_losses_own_bit_for_bit(kd_loss):
    """See [kd mean without a host read]: the same value, bit for bit, where a token is scored,
    and 0 where none is (torchtune's chunked reverse and symmetric KL give NaN there)."""
    labels = shift_labels(_labels(), IGNORE_INDEX)
    assert torch.equal(
        kd_mean(kd_loss, *_kd_inputs(kd_loss, labels)), kd_loss(*_kd_inputs(kd_loss, labels))
    )
    ignored = torch.full_like(labels, IGNORE_INDEX)
    assert kd_mean(kd_loss, *_kd_inputs(kd_loss, ignored)).item() == 0.0


def test_a_subclass_of_a_torchtune_kd_loss_is_called_as_it_is():
    """Only torchtune's own classes are known to sum when asked (``normalize=False``); a subclass
    may compute otherwise, so its own forward gives its mean."""
    labels = shift_labels(_labels(), IGNORE_INDEX)
    summed = SummedKL()
    assert torch.equal(
        kd_mean(summed, *_kd_inputs(summed, labels)), summed(*_kd_inputs(summed, labels))
    )


def test_a_kd_loss_with_another_denominator_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="config key 'kd_loss'.*divides the first batch"):
        verify_kd_loss_denominator(SummedKL(), _labels())


def test_mismatched_losses_are_refused():
    with pytest.raises(ValueError, match="num_output_chunks"):
        check_kd_losses(CEWithChunkedOutputLoss(8), ForwardKLLoss())
    with pytest.raises(ValueError, match="ignore_index"):
        check_kd_losses(nn.CrossEntropyLoss(ignore_index=-1), ForwardKLLoss())
    check_kd_losses(CEWithChunkedOutputLoss(8), ForwardKLWithChunkedOutputLoss(8))


def test_teacher_vocabulary_is_cut_to_the_students():
    with pytest.raises(ValueError, match="config key 'teacher_model'"):
        check_vocabularies(student_vocab=10, teacher_vocab=8)
    check_vocabularies(student_vocab=8, teacher_vocab=10)
    logits = torch.randn(2, 3, 10)
    assert _cut_to_vocab(logits, 10) is logits
    assert torch.equal(_cut_to_vocab([logits], 8)[0], logits[..., :8])


def test_token_weighted_micro_batch_mixes_equal_the_full_batch_mix():
    """[two token-normalised losses]: micro-batch means of (1 - r) CE + r KD, each weighted by
    n_m / N, sum to the full batch's mix; so do their gradients."""
    torch.manual_seed(0)
    labels = shift_labels(_labels())
    student = torch.randn(3, 16, 7, requires_grad=True)
    teacher = torch.randn(3, 16, 7)
    ce, kd, r = nn.CrossEntropyLoss(), ForwardKLLoss(), 0.3

    def mix(rows: slice) -> torch.Tensor:
        s, t, y = student[rows].reshape(-1, 7), teacher[rows].reshape(-1, 7), labels[rows]
        return (1 - r) * ce(s, y.reshape(-1)) + r * kd(s, t, y.reshape(-1))

    full = mix(slice(0, 3))
    (full_grad,) = torch.autograd.grad(full, student)
    total = int((labels != IGNORE_INDEX).sum())
    parts = [slice(0, 1), slice(1, 2), slice(2, 3)]
    weighted = sum(mix(p) * int((labels[p] != IGNORE_INDEX).sum()) / total for p in parts)
    (split_grad,) = torch.autograd.grad(weighted, student)
    assert float(weighted.detach()) == pytest.approx(float(full.detach()), rel=1e-6)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-5, atol=1e-7)
    # The reference the weights stand for: per-token sums over the one count.
    token_ce = F.cross_entropy(student.reshape(-1, 7), labels.reshape(-1), reduction="sum")
    assert float(full.detach()) == pytest.approx(
        float(
            (1 - r) * token_ce.detach() / total
            + r * kd(student.reshape(-1, 7), teacher.reshape(-1, 7), labels.reshape(-1)).detach()
        ),
        rel=1e-6,
    )


# ---------------------------------------------------------------------------------------------
# Logits only at loss positions, for the student and the teacher; see [kd logits at loss
# positions]. A student and a wider teacher with a padded vocabulary (see [padded teacher
# vocabulary]), on rows mostly prompt and padding.

VOCAB, TEACHER_VOCAB = 128, 136


def _decoder(embed_dim: int, vocab_size: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return llama3_2(
        vocab_size=vocab_size,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=embed_dim,
        intermediate_dim=2 * embed_dim,
        max_seq_len=64,
        tie_word_embeddings=False,
    )


class Wrapped(nn.Module):
    """A teacher that is not a torchtune decoder: its projection cannot be cut."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: torch.Tensor) -> object:
        return self.decoder(tokens)


def _distiller(chunked: bool, wrap_teacher: bool = False) -> Distiller:
    student = _decoder(32, VOCAB, seed=0)
    teacher = freeze_model(_decoder(48, TEACHER_VOCAB, seed=1))
    if chunked:
        loss_fn, kd_loss_fn = CEWithChunkedOutputLoss(), ForwardKLWithChunkedOutputLoss()
        student.set_num_output_chunks(loss_fn.num_output_chunks)
        teacher.set_num_output_chunks(loss_fn.num_output_chunks)
    else:
        loss_fn, kd_loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX), ForwardKLLoss()
    return Distiller(
        student,
        Wrapped(teacher) if wrap_teacher else teacher,
        loss_fn,
        kd_loss_fn,
        kd_ratio=0.4,
        precision=Precision.from_config(torch.float32, "none", torch.device("cpu")),
        device=torch.device("cpu"),
    )


def _loss_and_gradients(distiller: Distiller, with_positions: bool):
    distiller.student.zero_grad()
    batch = prompt_masked_batch(VOCAB)
    if with_positions:
        batch[LOSS_POSITIONS] = loss_positions(batch["labels"])
    loss = distiller.loss_step(batch).main
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in distiller.student.parameters()])
    parts = torch.stack(distiller._parts[-1]).double()  # (class loss, kd loss)
    return loss.detach().double(), parts, grads.double()


@pytest.mark.parametrize("wrap_teacher", [False, True], ids=["both_cut", "student_cut"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "plain"])
def test_cut_projections_give_the_full_projections_loss_and_gradients(chunked, wrap_teacher):
    """Both losses, their mix and every gradient equal the full projections' to the fp32
    floor; with a teacher that cannot be cut, its full logits are cut after the forward."""
    distiller = _distiller(chunked, wrap_teacher)
    full_loss, full_parts, full_grads = _loss_and_gradients(distiller, with_positions=False)
    cut_loss, cut_parts, cut_grads = _loss_and_gradients(distiller, with_positions=True)

    loss_gap = abs(cut_loss - full_loss).item() / full_loss.item()
    parts_gap = ((cut_parts - full_parts).abs() / full_parts).max().item()
    grad_gap = ((cut_grads - full_grads).norm() / full_grads.norm()).item()
    print(f"cut vs full: loss {loss_gap:.1e}, parts {parts_gap:.1e}, gradients {grad_gap:.1e}")
    assert full_parts.min() > 0  # both losses live, so both are compared
    assert loss_gap < 1e-6 and parts_gap < 1e-6
    assert grad_gap < 1e-6


def test_both_projections_see_only_the_scored_positions():
    distiller = _distiller(chunked=True)
    projected: dict[str, list[int]] = {"student": [], "teacher": []}
    for name, model in (("student", distiller.student), ("teacher", distiller.teacher)):
        model.output.register_forward_hook(
            lambda module, args, out, rows=projected[name]: rows.append(
                args[0].reshape(-1, args[0].size(-1)).shape[0]
            )
        )
    batch = prompt_masked_batch(VOCAB)
    num_scored, num_positions = count_loss_tokens(batch["labels"]), batch["tokens"].numel()

    distiller.loss_step({**batch, LOSS_POSITIONS: loss_positions(batch["labels"])})
    cut = {name: sum(rows) for name, rows in projected.items()}
    distiller.loss_step(dict(batch))  # no index: every position
    full = {name: sum(rows) - cut[name] for name, rows in projected.items()}

    assert cut == {"student": num_scored, "teacher": num_scored}
    assert full == {"student": num_positions, "teacher": num_positions}
    assert num_scored < num_positions / 2  # the batch is mostly unscored
    for model in (distiller.student, distiller.teacher):  # restored, even the frozen teacher
        assert "unembed" not in vars(model)


# ---------------------------------------------------------------------------------------------
# post_scale is stock torchtune 0.6.1's KD weighting; see [stock kd weighting].


class CaptureGradients:
    """An optimizer that keeps the gradients it is asked to step on, and steps nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.gradients: torch.Tensor | None = None

    def step(self) -> None:
        self.gradients = torch.cat([p.grad.reshape(-1) for p in self.params]).double()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _stock_kd_gradients(distiller: Distiller, micro_batches: list[dict]) -> torch.Tensor:
    """Stock's loop (recipes/knowledge_distillation_single_device.py of torchtune 0.6.1, its
    ``train`` and ``_loss_step``) by hand: each mean mix backpropagated unscaled, then the
    gradients times one over the window's count taken before the shift."""
    student, teacher, r = distiller.student, distiller.teacher, distiller.kd_ratio
    num_tokens = 0
    for batch in micro_batches:
        tokens, labels = batch["tokens"], batch["labels"]
        num_tokens += (labels != IGNORE_INDEX).sum()
        logits = student(tokens)
        with torch.no_grad():
            teacher_logits = teacher(tokens)[..., :VOCAB]
        ignore = torch.full((labels.shape[0], 1), IGNORE_INDEX)
        labels = torch.hstack((labels[..., 1:], ignore)).reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
        teacher_logits = teacher_logits.reshape(-1, teacher_logits.size(-1))
        kd_loss = distiller.kd_loss_fn(logits, teacher_logits, labels)
        class_loss = distiller.loss_fn(logits, labels)
        ((1 - r) * class_loss + r * kd_loss).backward()
    gradients = [p.grad.reshape(-1) * (1 / num_tokens) for p in student.parameters()]
    student.zero_grad()
    return torch.cat(gradients).double()


def _windowed_gradients(distiller: Distiller, micro_batches: list[dict], mode: NormMode):
    normalizer = GroupingNormalizer(distiller.loss_fn, len(micro_batches), mode=mode)
    (window,) = distiller.track(normalizer.windows([dict(b) for b in micro_batches]))
    optimizer = CaptureGradients(distiller.student)
    settings = ProfilerSettings(log_timings=False, saved_latency_every_n_steps=0)
    train_window(
        window,
        model=distiller.student,
        loss_step=distiller.loss_step,
        optimizer=optimizer,
        profiler=TrainingProfiler(settings, torch.device("cpu"), distiller.student),
        device=torch.device("cpu"),
        step=1,
    )
    return optimizer.gradients


def test_post_scale_is_stocks_kd_weighting_and_exact_is_the_full_batch():
    """Four micro-batches of one row each, of different loss-token counts and live first
    labels: ``post_scale`` gives stock's gradients (not stock fine-tuning's), exact the full
    batch's, and the two differ. Under both weightings both models project only the scored rows."""
    distiller = _distiller(chunked=False)
    batch = prompt_masked_batch(VOCAB)
    batch["labels"][2, 0] = batch["tokens"][2, 0]  # a live first label, as train_on_input
    micro_batches = [{key: value[i : i + 1] for key, value in batch.items()} for i in range(4)]

    stock = _stock_kd_gradients(distiller, micro_batches)
    post_scale = _windowed_gradients(distiller, micro_batches, NormMode.POST_SCALE)
    exact = _windowed_gradients(distiller, micro_batches, NormMode.EXACT)
    full = _windowed_gradients(distiller, [batch], NormMode.EXACT)

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    print(f"post_scale vs stock {gap(post_scale, stock):.1e}, exact vs full {gap(exact, full):.1e}")
    assert gap(post_scale, stock) < 1e-6
    assert gap(exact, full) < 1e-6
    assert gap(stock, full) > 0.1  # stock's weighting is another objective
