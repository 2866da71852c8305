"""Logits only at loss positions on CUDA (issue #30): the cut projection gives the full
projection's loss and gradients, in fp32 and in bf16, and takes less memory.

The CPU tests (tests/test_loss_positions.py) show the cut exact on a 128-word vocabulary. Here
the shapes are a real model's where it matters, the output projection: a 32,768-word vocabulary
over 8 x 512 positions of which about half are scored, so the full projection's logits alone
are 512 MiB in fp32. See [logits only at loss positions] in ``exactga.accumulation.forward``.
"""

from __future__ import annotations

import pytest
import torch
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss

from exactga.accumulation.loss_units import IGNORE_INDEX, LOSS_POSITIONS, loss_positions
from exactga.sft.loss import causal_lm_loss

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_loss_positions")]

VOCAB = 32_768
ROWS, WIDTH = 8, 512
# fp32: both ways run the same GEMMs on different row counts, so cuBLAS may tile them
# differently; measured on an H100 below 1e-6. bf16: each logit is rounded once to bf16
# (2**-8 relative) in either way, in tiles that may differ, and the loss averages thousands of
# them; the bounds stay 10x below what one mis-scored row would move (1/2000 of the rows'
# loss, relative 5e-4 each, summed over a sample's worth of rows).
BOUNDS = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 5e-2)}


def model_and_batch(dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = llama3_2(
            vocab_size=VOCAB,
            num_layers=2,
            num_heads=8,
            num_kv_heads=2,
            embed_dim=512,
            intermediate_dim=1536,
            max_seq_len=WIDTH,
            tie_word_embeddings=True,
        ).to(dtype)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=generator)
    labels = tokens.clone()
    for row in range(ROWS):  # prompts of varied length, answers up to a ragged end
        prompt, end = 32 * row + 16, WIDTH - 24 * row
        labels[row, :prompt] = IGNORE_INDEX
        labels[row, end:] = IGNORE_INDEX
        tokens[row, end:] = 0
    return model, {"tokens": tokens.cuda(), "labels": labels.cuda()}


def loss_gradients_peak(model, batch, with_positions: bool):
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    model.zero_grad(set_to_none=True)
    batch = dict(batch)
    if with_positions:
        batch[LOSS_POSITIONS] = loss_positions(batch["labels"].cpu()).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = causal_lm_loss(model, loss_fn, batch).main
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
    return loss.detach().double(), grads, peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cut_projection_on_cuda_is_the_full_projection(dtype, record_property):
    model, batch = model_and_batch(dtype)
    full_loss, full_grads, full_peak = loss_gradients_peak(model, batch, with_positions=False)
    cut_loss, cut_grads, cut_peak = loss_gradients_peak(model, batch, with_positions=True)

    loss_gap = (abs(cut_loss - full_loss) / abs(full_loss)).item()
    grad_gap = ((cut_grads - full_grads).norm() / full_grads.norm()).item()
    record_property("relative_loss_difference", f"{loss_gap:.2e}")
    record_property("relative_l2_of_gradients", f"{grad_gap:.2e}")
    record_property("peak_mib_full_vs_cut", f"{full_peak / 2**20:.0f} vs {cut_peak / 2**20:.0f}")
    loss_bound, grad_bound = BOUNDS[dtype]
    assert loss_gap <= loss_bound
    assert grad_gap <= grad_bound
    assert cut_peak < full_peak
