"""Logits only at loss positions: ``causal_lm_loss`` projects only the positions the loss scores.

See [logits only at loss positions] in ``exactga.accumulation.forward``. The cut must not change
the loss or the gradients beyond float rounding, must really skip the unscored rows, and must leave
the model as it found it.
"""

from __future__ import annotations

import pytest
import torch
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss
from unit_utils import prompt_masked_batch

from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    LOSS_POSITIONS,
    count_loss_tokens,
    loss_positions,
    shift_labels,
)
from exactga.sft.loss import causal_lm_loss

VOCAB = 128


def tiny_decoder(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return llama3_2(
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=32,
        intermediate_dim=64,
        max_seq_len=64,
        tie_word_embeddings=tied,
    )


def loss_and_gradients(model, loss_fn, batch, with_positions: bool):
    model.zero_grad()
    batch = {key: value.clone() for key, value in batch.items()}
    if with_positions:
        batch[LOSS_POSITIONS] = loss_positions(batch["labels"])
    loss = causal_lm_loss(model, loss_fn, batch).main
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return loss.detach().double(), grads.double()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "plain"])
def test_cut_projection_gives_the_full_projections_loss_and_gradients(tied, chunked):
    model = tiny_decoder(tied)
    if chunked:
        loss_fn = CEWithChunkedOutputLoss()
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    else:
        loss_fn = torch.nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
    batch = prompt_masked_batch(VOCAB)

    full_loss, full_grads = loss_and_gradients(model, loss_fn, batch, with_positions=False)
    cut_loss, cut_grads = loss_and_gradients(model, loss_fn, batch, with_positions=True)

    assert cut_loss.item() == pytest.approx(full_loss.item(), rel=1e-6)
    assert ((cut_grads - full_grads).norm() / full_grads.norm()).item() < 1e-6


def test_projection_sees_only_the_scored_positions():
    model = tiny_decoder(tied=False)
    rows_projected = []
    model.output.register_forward_hook(
        lambda module, args, out: rows_projected.append(args[0].reshape(-1, 32).shape[0])
    )
    batch = prompt_masked_batch(VOCAB)
    num_scored = count_loss_tokens(batch["labels"])
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    causal_lm_loss(model, loss_fn, {**batch, LOSS_POSITIONS: loss_positions(batch["labels"])})
    causal_lm_loss(model, loss_fn, dict(batch))  # no index: every position

    assert rows_projected == [num_scored, batch["tokens"].numel()]
    assert num_scored < batch["tokens"].numel() / 2  # the batch is mostly unscored


def test_positions_are_those_the_shifted_labels_score():
    labels = prompt_masked_batch(VOCAB)["labels"]
    positions = loss_positions(labels)
    scored = shift_labels(labels).reshape(-1) != IGNORE_INDEX
    assert len(positions) == count_loss_tokens(labels)
    assert torch.equal(positions, torch.arange(labels.numel())[scored])


def test_model_is_restored_after_the_loss_even_when_it_fails():
    model = tiny_decoder(tied=True)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
    batch = prompt_masked_batch(VOCAB)
    causal_lm_loss(model, loss_fn, {**batch, LOSS_POSITIONS: loss_positions(batch["labels"])})
    assert "unembed" not in vars(model)

    bad = {**batch, "tokens": batch["tokens"][:, :0]}  # fails inside the forward
    bad[LOSS_POSITIONS] = loss_positions(batch["labels"])
    with pytest.raises(Exception):  # noqa: B017 - any failure of the forward
        causal_lm_loss(model, loss_fn, bad)
    assert "unembed" not in vars(model)


class Wrapped(torch.nn.Module):
    """A model that is not itself a torchtune decoder: its projection cannot be cut."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens)


def test_other_models_take_the_full_projection_with_the_same_loss():
    decoder = tiny_decoder(tied=True)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
    batch = prompt_masked_batch(VOCAB)
    expected = causal_lm_loss(decoder, loss_fn, dict(batch)).main

    wrapped = causal_lm_loss(
        Wrapped(decoder), loss_fn, {**batch, LOSS_POSITIONS: loss_positions(batch["labels"])}
    )

    assert wrapped.main.item() == expected.item()  # the same computation, bit for bit
