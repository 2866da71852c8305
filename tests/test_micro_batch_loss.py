"""What a loss step returns, in-process: ``MicroBatchLoss``, and terms over units of their own.

docs/editing_recipes.md adds a term to ``self._loss_step(batch)``; these checks run that edit on a
window of two micro-batches whose loss has a further term over units of its own (as the router's
balance term and RPO's NLL have), against hand-computed float64 gradients: ``+`` enters once
(the vector of term means it replaced entered it once per term), ``with_term`` over units declared
with ``with_further_units`` is the full batch's mean over those units whatever the split, and the
run's normaliser counts over the runtime's ranks. See [one return type for every loss step] in
exactga.accumulation.micro_batch_loss.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from recipe_utils import REPO_ROOT
from torch import nn
from torch.nn.functional import pad

from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    LOSS_POSITIONS,
    ShiftedTokens,
    loss_positions,
    shift_labels,
    with_further_units,
)
from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.step import train_window
from exactga.data.micro_batching import SampleWindow
from exactga.wiring.run_start import _check_normalizer_ranks

VOCAB = 11
WD = 0.01


class _Profiler:
    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sample_gradient_pass(self, model: nn.Module) -> None:
        pass


class _Weights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.5, VOCAB, dtype=torch.float64))


def _rows(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Rows of random tokens, each with ``length`` live labels then padding."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths) + 1
    tokens = torch.randint(0, VOCAB, (len(lengths), width), generator=generator)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    for row, length in enumerate(lengths):
        labels[row, : length + 1] = tokens[row, : length + 1]
    return {"tokens": tokens, "labels": labels}


# Two micro-batches with unequal shares of tokens and rows: one long row, then three short.
MICRO_BATCHES = [[7], [2, 1, 3]]


def _row_count(batch: dict[str, torch.Tensor]) -> int:
    """Rows with a loss token: the further term's units (0 for an emptied batch)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1).sum())


def _token_and_row_losses(model: _Weights, batch: dict[str, torch.Tensor]):
    """Per scored token ``w[target]^2 / 2``; per live row ``(w[first token] - 1)^2``."""
    labels = batch.pop("labels")
    positions = batch.pop(LOSS_POSITIONS)
    targets = shift_labels(labels).reshape(-1).index_select(0, positions)
    token_losses = 0.5 * model.w[targets] ** 2
    live = (labels[:, 1:] != IGNORE_INDEX).any(dim=1)
    row_losses = (model.w[batch["tokens"][live, 0]] - 1.0) ** 2
    return token_losses, row_losses


def _window_batches(full_batch: bool) -> list[dict[str, torch.Tensor]]:
    """The window's micro-batches, or the same rows as one micro-batch (padded to one width)."""
    batches = [_rows(lengths, seed) for seed, lengths in enumerate(MICRO_BATCHES)]
    if not full_batch:
        return batches
    width = max(batch["tokens"].size(1) for batch in batches)

    def padded(key: str, value: int) -> torch.Tensor:
        return torch.cat([pad(b[key], (0, width - b[key].size(1)), value=value) for b in batches])

    return [{"tokens": padded("tokens", 0), "labels": padded("labels", IGNORE_INDEX)}]


def _step(loss_step, units, full_batch: bool = False) -> torch.Tensor:
    """The gradient of one window through ``train_window``, as the recipes' loop runs it."""
    model = _Weights()
    normalizer = LossNormalizer(nn.CrossEntropyLoss(), units=units)
    (window,) = normalizer.windows([SampleWindow(_window_batches(full_batch), 0, 0, 0, False)])
    train_window(
        window,
        model=model,
        loss_step=lambda batch: loss_step(model, batch),
        optimizer=None,
        profiler=_Profiler(),
        device=torch.device("cpu"),
        step=1,
    )
    return model.w.grad.clone()


def _shipped(model: _Weights, batch: dict) -> MicroBatchLoss:
    """A loss step with a further term, as the router's and RPO's: tokens, then rows."""
    token_losses, row_losses = _token_and_row_losses(model, batch)
    return MicroBatchLoss(token_losses.mean(), {"rows": row_losses.mean()})


def _units() -> object:
    return with_further_units(ShiftedTokens(nn.CrossEntropyLoss()), "rows", _row_count)


def _full_batch_gradient(with_penalty: bool) -> torch.Tensor:
    """By hand: the mean token loss over every token plus the mean row loss over every row."""
    model = _Weights()
    token_losses, row_losses = [], []
    for seed, lengths in enumerate(MICRO_BATCHES):
        batch = _rows(lengths, seed)
        batch[LOSS_POSITIONS] = loss_positions(batch["labels"])
        tokens, rows = _token_and_row_losses(model, batch)
        token_losses.append(tokens)
        row_losses.append(rows)
    loss = torch.cat(token_losses).mean() + torch.cat(row_losses).mean()
    if with_penalty:
        loss = loss + 0.5 * WD * model.w.pow(2).sum()
    loss.backward()
    return model.w.grad.clone()


def test_a_term_added_to_the_loss_steps_return_enters_the_step_once() -> None:
    """The doc's first edit on a loss with a further term: the edited step minus the shipped
    one is exactly 1x the penalty's gradient (the vector of term means made it 2x)."""
    shipped = _step(_shipped, _units())
    penalty = lambda model: 0.5 * WD * model.w.pow(2).sum()  # noqa: E731
    edited = _step(lambda m, b: _shipped(m, b) + penalty(m), _units())
    weights = _Weights().w.detach()
    ratio = float((edited - shipped) @ (WD * weights)) / float((WD * weights) @ (WD * weights))
    assert ratio == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(edited, _full_batch_gradient(True), rtol=1e-12, atol=1e-14)

    def as_vector(model: _Weights, batch: dict) -> torch.Tensor:  # what the steps returned
        return _shipped(model, batch).term_means(("rows",)) + penalty(model)

    doubled = _step(as_vector, _units())
    ratio = float((doubled - shipped) @ (WD * weights)) / float((WD * weights) @ (WD * weights))
    assert ratio == pytest.approx(2.0, abs=1e-12)  # the defect this return type removes


def test_a_term_over_its_own_units_is_the_full_batchs_mean_whatever_the_split() -> None:
    """``with_term`` over units declared with ``with_further_units``: one micro-batch or two,
    the step is the full batch's; the same term added with ``+`` (weighed by tokens) is not."""

    def with_rows(model: _Weights, batch: dict) -> MicroBatchLoss:
        token_losses, row_losses = _token_and_row_losses(model, batch)
        return MicroBatchLoss(token_losses.mean()).with_term("rows", row_losses.mean())

    def rows_by_tokens(model: _Weights, batch: dict) -> MicroBatchLoss:
        token_losses, row_losses = _token_and_row_losses(model, batch)
        return MicroBatchLoss(token_losses.mean()) + row_losses.mean()

    expected = _full_batch_gradient(False)
    for full_batch in (False, True):
        got = _step(with_rows, _units(), full_batch)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    plain = ShiftedTokens(nn.CrossEntropyLoss())
    wrong = _step(rows_by_tokens, plain)
    assert (wrong - expected).norm() > 1e-3 * expected.norm()


def test_the_return_type_refuses_what_would_miscount() -> None:
    loss = MicroBatchLoss(torch.tensor(1.0), {"rows": torch.tensor(2.0)})
    assert float(loss + 1.0) == 4.0 and (loss + 1.0).terms["rows"] == 2.0  # + : main only
    assert float(2 * loss) == 6.0 and float(-loss) == -3.0  # * : the whole loss
    with pytest.raises(ValueError, match="a micro-batch's main loss is a 0-d tensor"):
        MicroBatchLoss(torch.ones(2))
    with pytest.raises(ValueError, match="a term is one value"):
        loss + torch.ones(3)
    with pytest.raises(ValueError, match=r"terms over \['rows'\] units, the normaliser counts"):
        loss.term_means(())
    with pytest.raises(ValueError, match=r"missing: \['rows'\]"):
        MicroBatchLoss(torch.tensor(1.0)).term_means(("rows",))


def test_the_run_refuses_a_normaliser_over_other_ranks_than_its_own() -> None:
    """A copy's own ``LossNormalizer(...)`` without the runtime's group counts one rank's units
    on a 2-rank run: refused at setup, naming the fix."""
    normalizer = LossNormalizer(nn.CrossEntropyLoss())
    _check_normalizer_ranks(normalizer, SimpleNamespace(count_size=1))
    with pytest.raises(ValueError, match=r"over 1 rank\(s\), the run trains on 2 that hold"):
        _check_normalizer_ranks(normalizer, SimpleNamespace(count_size=2))


@pytest.mark.parametrize(
    "recipe",
    [p for p in sorted((REPO_ROOT / "recipes").glob("*.py")) if p.stem != "ga_parity"],
    ids=lambda p: p.stem,
)
def test_every_training_recipe_has_the_lines_the_documented_edits_replace(recipe) -> None:
    """docs/editing_recipes.md's edits apply unchanged to every training recipe: the loop's
    lines they replace are there (tests/test_editing_recipes.py runs them on SFT, MoE with the
    router term and DPO with rpo_alpha), and ``_loss_step`` returns a ``MicroBatchLoss``."""
    from test_editing_recipes import END_STEP_LINE, LOSS_LINE, STEP_LINE, TRAIN_DEF

    source = recipe.read_text()
    for line in (LOSS_LINE, STEP_LINE, END_STEP_LINE, TRAIN_DEF):
        assert source.count(line) == 1, f"{recipe.name} lacks {line!r}"
    assert "def _loss_step(self, batch: dict[str, torch.Tensor]) -> MicroBatchLoss:" in source
    assert "LossNormalizer" not in source  # the normaliser over the runtime's ranks:
    assert "start.normalizer(" in source or "preference_run(" in source
