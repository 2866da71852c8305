"""The output projection fused with the cross-entropy: the same loss and gradients as materialised
logits, without the logits.

See [projection fused with the loss] in ``exactga.accumulation.linear_cross_entropy``. The fused
loss must equal materialised logits + ``F.cross_entropy`` (summed over the scored tokens, divided
by their count) up to float rounding, alone and inside ``causal_lm_loss``, under fp32 and bf16;
must fall back to the present path where it cannot fuse; must keep no logits-sized tensor for the
backward, nor make one; and must run inside the forward of a model FSDP2 sharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode
from torchtune.models.llama3 import lora_llama3
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules import FrozenNF4Linear, TiedLinear, TransformerDecoder
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.training import get_shard_conditions, shard_model
from unit_utils import prompt_masked_batch, run_on_ranks

from exactga.accumulation.forward import can_fuse_output
from exactga.accumulation.linear_cross_entropy import (
    LinearCrossEntropyLoss,
    fusable_loss,
    linear_cross_entropy,
)
from exactga.accumulation.loss_units import IGNORE_INDEX, LOSS_POSITIONS, loss_positions
from exactga.model_build.trained import build_loss
from exactga.models.gemma3 import gemma3
from exactga.models.qwen3 import qwen3
from exactga.runtime.precision import Precision
from exactga.sft.loss import causal_lm_loss

VOCAB = 256
EMBED = 32
FP32_FLOOR = 1e-6  # relative L2, fp32 rounding of differently ordered sums
ROWS, CHUNK = 29, 7  # 7 does not divide 29: the last chunk is short


def tiny_decoder(tied: bool, vocab: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return llama3_2(
        vocab_size=vocab,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=EMBED,
        intermediate_dim=64,
        max_seq_len=64,
        tie_word_embeddings=tied,
    )


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    output = model.output
    return output.tied_module.weight if isinstance(output, TiedLinear) else output.weight


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def hidden_and_targets(num_ignored: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(ROWS, EMBED, generator=generator)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[torch.randperm(ROWS, generator=generator)[:num_ignored]] = IGNORE_INDEX
    return hidden, targets


def summed_loss_and_grads(
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = hidden.clone().requires_grad_(True)
    loss = loss_of(hidden, weight)
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    return loss.detach(), grad_hidden, grad_weight


def materialised(targets: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss_of(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = (hidden @ weight.T).float()
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")

    return loss_of


def fused(
    targets: torch.Tensor, chunk_size: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda hidden, weight: linear_cross_entropy(
        hidden, weight, targets, chunk_size=chunk_size
    )


# --- (a) the function against materialised logits ----------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk_size", [1, CHUNK, ROWS, 64], ids=lambda c: f"chunk{c}")
def test_fused_loss_and_gradients_equal_materialised_logits(tied, chunk_size):
    weight = output_weight(tiny_decoder(tied))
    hidden, targets = hidden_and_targets(num_ignored=10)

    expected = summed_loss_and_grads(materialised(targets), hidden, weight)
    got = summed_loss_and_grads(fused(targets, chunk_size), hidden, weight)

    for name, value, reference in zip(
        ("loss", "d/dhidden", "d/dweight"), got, expected, strict=True
    ):
        assert rel_err(value, reference) <= FP32_FLOOR, name
    ignored = targets == IGNORE_INDEX
    assert torch.all(got[1][ignored] == 0)  # an ignored row gets no gradient at all


def test_all_rows_ignored_give_zero_loss_and_zero_gradients():
    weight = output_weight(tiny_decoder(tied=False))
    hidden, targets = hidden_and_targets(num_ignored=ROWS)

    loss, grad_hidden, grad_weight = summed_loss_and_grads(fused(targets, CHUNK), hidden, weight)

    assert loss.item() == 0.0
    assert torch.all(grad_hidden == 0) and torch.all(grad_weight == 0)
    mean = LinearCrossEntropyLoss(chunk_size=CHUNK).from_hidden(hidden, weight, targets)
    assert mean.item() == 0.0  # not 0/0: the count is at least 1


def test_materialised_logits_give_torchtunes_chunked_loss_bit_for_bit():
    """The fallback's loss: on logits chunks as a decoder returns them, exactly
    ``CEWithChunkedOutputLoss``; on one tensor, exactly ``CrossEntropyLoss``."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 10, VOCAB, generator=generator).bfloat16()
    labels = torch.randint(0, VOCAB, (3, 10), generator=generator)
    labels[0, :4] = IGNORE_INDEX
    chunks = list(logits.chunk(8, dim=1))  # 10 tokens in 8 chunks: 5 chunks of 2

    ours, stock = LinearCrossEntropyLoss(), CEWithChunkedOutputLoss()
    assert torch.equal(ours(chunks, labels), stock(chunks, labels))
    plain = torch.nn.CrossEntropyLoss()(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
    assert torch.equal(ours(logits.reshape(-1, VOCAB), labels.reshape(-1)), plain)


# --- (b) causal_lm_loss: fused against torchtune's chunked loss ---------------------------------


def loss_and_grads(model, loss_fn, batch, *, positions: bool, precision=None):
    model.zero_grad(set_to_none=True)
    batch = {key: value.clone() for key, value in batch.items()}
    if positions:
        batch[LOSS_POSITIONS] = loss_positions(batch["labels"])
    loss = causal_lm_loss(model, loss_fn, batch, precision=precision).main
    loss.backward()
    grads = {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def present_path(model: torch.nn.Module) -> CEWithChunkedOutputLoss:
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    return loss_fn


def assert_same_loss_and_grads(got, expected, tolerance: float) -> dict[str, float]:
    (loss, grads), (ref_loss, ref_grads) = got, expected
    assert grads.keys() == ref_grads.keys()
    errors = {"loss": rel_err(loss, ref_loss)}
    errors |= {name: rel_err(grads[name], ref_grads[name]) for name in grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"{worst}: {errors[worst]:.2e}"
    return errors


@pytest.mark.parametrize("positions", [True, False], ids=["cut", "all_rows"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize(
    "loss_fn",
    [LinearCrossEntropyLoss(), LinearCrossEntropyLoss(chunk_size=5)],
    ids=["8_chunks", "chunk_size5"],
)
def test_causal_lm_loss_fused_equals_torchtunes_chunked_loss(loss_fn, tied, positions):
    model = tiny_decoder(tied)
    batch = prompt_masked_batch(VOCAB)
    assert can_fuse_output(model)

    expected = loss_and_grads(model, present_path(model), batch, positions=positions)
    got = loss_and_grads(model, loss_fn, batch, positions=positions)

    assert_same_loss_and_grads(got, expected, FP32_FLOOR)
    assert "unembed" not in vars(model) and "forward" not in vars(model.output)


def bf16_run(model: torch.nn.Module, mode: str) -> Precision | None:
    """``autocast``: bf16 compute over fp32 weights (exactga's ``master_weights: fp32``);
    ``pure``: the model itself in bf16 (``master_weights: none``)."""
    if mode == "pure":
        model.to(torch.bfloat16)
        return None
    return Precision(torch.bfloat16, torch.float32, "cpu")


@pytest.mark.parametrize("mode", ["autocast", "pure"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_causal_lm_loss_fused_under_bf16_is_within_bf16s_own_error(tied, mode):
    """Both paths multiply in bf16 and take the softmax in fp32; they differ only in where bf16
    rounds (the fused loss's chunks of rows against torchtune's chunks of the sequence). That
    difference must be no larger than bf16's own distance from the fp32 computation."""
    batch = prompt_masked_batch(VOCAB)
    fp32_model = tiny_decoder(tied)
    fp32 = loss_and_grads(fp32_model, present_path(fp32_model), batch, positions=True)
    model = tiny_decoder(tied)
    precision = bf16_run(model, mode)

    expected = loss_and_grads(
        model, present_path(model), batch, positions=True, precision=precision
    )
    got = loss_and_grads(
        model, LinearCrossEntropyLoss(), batch, positions=True, precision=precision
    )

    bf16_floor = max(assert_same_loss_and_grads(expected, fp32, 1.0).values())
    assert_same_loss_and_grads(got, expected, bf16_floor)
    assert all(grad.dtype == next(model.parameters()).dtype for grad in got[1].values())


def tiny_family(name: str, **kwargs: object) -> torch.nn.Module:
    """exactga's Qwen3 or Gemma 3 decoder at toy size."""
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=EMBED)
    shape |= dict(intermediate_dim=64, max_seq_len=64)
    if name == "qwen3":
        return qwen3(**shape, **kwargs)
    return gemma3(**shape, head_dim=8, sliding_window=8, sliding_window_pattern=2, **kwargs)


@pytest.mark.parametrize(
    ("family", "kwargs", "fuses"),
    [
        ("qwen3", {}, True),
        ("qwen3", {"tie_word_embeddings": True}, True),
        ("gemma3", {}, True),
        ("gemma3", {"final_logit_softcapping": 30.0}, False),  # the cap acts on the logits
    ],
    ids=["qwen3_untied", "qwen3_tied", "gemma3", "gemma3_soft_capped"],
)
def test_the_new_families_fuse_with_the_same_loss(family, kwargs, fuses):
    model = tiny_family(family, **kwargs)
    batch = prompt_masked_batch(VOCAB)
    assert can_fuse_output(model) == fuses

    expected = loss_and_grads(model, present_path(model), batch, positions=True)
    got = loss_and_grads(model, LinearCrossEntropyLoss(), batch, positions=True)

    assert_same_loss_and_grads(got, expected, FP32_FLOOR)


# --- (c) what cannot be fused takes the present path --------------------------------------------


def lora_decoder(apply_lora_to_output: bool, use_dora: bool = False) -> torch.nn.Module:
    """An untied llama3 (llama3_2's LoRA builder refuses an adapter on its tied output)."""
    torch.manual_seed(0)
    model = lora_llama3(
        lora_attn_modules=["q_proj", "v_proj"],
        apply_lora_to_output=apply_lora_to_output,
        use_dora=use_dora,
        lora_rank=4,
        lora_alpha=8,
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=EMBED,
        intermediate_dim=64,
        max_seq_len=64,
    )
    with torch.no_grad():  # a fresh adapter's lora_b is 0: draw it so the adapter matters
        for name, param in model.named_parameters():
            if "lora_b" in name:
                param.normal_(std=0.05)
    for module in model.modules():
        if hasattr(module, "initialize_dora_magnitude"):  # built empty, as the recipes set it
            module.initialize_dora_magnitude()
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name or "magnitude" in name)
    return model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_an_adapter_on_the_output_falls_back_to_materialised_logits_with_the_same_loss(use_dora):
    model = lora_decoder(apply_lora_to_output=True, use_dora=use_dora)
    batch = prompt_masked_batch(VOCAB)
    assert not can_fuse_output(model)
    ours = LinearCrossEntropyLoss()
    model.set_num_output_chunks(ours.num_output_chunks)  # what build_loss does for this loss

    expected = loss_and_grads(model, present_path(model), batch, positions=True)
    got = loss_and_grads(model, ours, batch, positions=True)

    assert torch.isfinite(expected[0])
    assert torch.equal(got[0], expected[0])  # the same computation, bit for bit
    assert_same_loss_and_grads(got, expected, 0.0)


def test_lora_elsewhere_fuses_a_frozen_output_with_the_same_adapter_gradients():
    model = lora_decoder(apply_lora_to_output=False)
    batch = prompt_masked_batch(VOCAB)
    assert can_fuse_output(model)

    expected = loss_and_grads(model, present_path(model), batch, positions=True)
    got = loss_and_grads(model, LinearCrossEntropyLoss(), batch, positions=True)

    assert got[1].keys() == expected[1].keys() and all("lora_" in name for name in got[1])
    assert_same_loss_and_grads(got, expected, FP32_FLOOR)


class Wrapped(torch.nn.Module):
    """A model that is not itself a torchtune decoder."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens)


def test_other_models_hidden_states_quantised_and_biased_outputs_are_not_fused():
    quantised = tiny_decoder(tied=False)
    quantised.output = FrozenNF4Linear(EMBED, 512, bias=False)  # 16,384 weights: NF4's block
    assert not can_fuse_output(quantised)
    assert not can_fuse_output(Wrapped(tiny_decoder(tied=True)))
    with_hidden = tiny_decoder(tied=False)
    with_hidden.output_hidden_states = [0]
    assert not can_fuse_output(with_hidden)
    biased = tiny_decoder(tied=False)
    biased.output = torch.nn.Linear(EMBED, VOCAB, bias=True)
    assert not can_fuse_output(biased)
    capped = tiny_decoder(tied=False)
    capped.__class__ = CappedDecoder
    assert not can_fuse_output(capped)


class CappedDecoder(TransformerDecoder):
    """A decoder whose own ``unembed`` does more than norm and project."""

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().unembed(h))


def test_a_compiled_loss_is_still_recognised():
    loss_fn = LinearCrossEntropyLoss()
    assert fusable_loss(torch.compile(loss_fn)) is loss_fn
    assert fusable_loss(CEWithChunkedOutputLoss()) is None


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_compiled_chunks_give_the_eager_sums_and_compile_a_bounded_number_of_times(
    monkeypatch, precision
):
    """[fused loss under compile]: with its chunks compiled the fused loss gives the eager
    loss and gradients, and once it has met a chunk of several rows, chunks of one row and a
    micro-batch of one row (torch specialises a size of 1), micro-batches of other row counts
    compile nothing new: the chunks are dynamic. Traced with ``aot_eager`` (torchtune's
    ``TORCH_COMPILE_BACKEND``): the operators inductor would fuse, without a C++ compiler's
    minutes; ``benchmarks/kernel_counts.py --loss fused`` runs inductor's kernels."""
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    weight = output_weight(tiny_decoder(tied=False))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
    graphs = [counters["stats"]["unique_graphs"]]
    # 29 rows: chunks of 4 and a last one of 1; 5: chunks of 1; then one row; then others.
    for rows in (29, 5, 1, 17, 64, 40, 100):
        generator = torch.Generator().manual_seed(rows)
        hidden = torch.randn(rows, EMBED, generator=generator)
        targets = torch.randint(0, VOCAB, (rows,), generator=generator)
        targets[1::3] = IGNORE_INDEX
        results = {}
        for compiled in (False, True):
            loss_fn = LinearCrossEntropyLoss()
            if compiled:
                loss_fn.compile_chunks()
            with autocast:
                results[compiled] = summed_loss_and_grads(
                    lambda h, w, f=loss_fn, t=targets: f.from_hidden(h, w, t), hidden, weight
                )
        for name, got, expected in zip(("loss", "d/dh", "d/dw"), *results.values(), strict=True):
            assert rel_err(got, expected) <= FP32_FLOOR, (rows, name)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] > graphs[0], graphs  # the chunks compiled
    assert len(set(graphs[3:])) == 1, graphs  # nothing new after the first three row counts


def test_a_compiled_runs_loss_compiles_the_fused_chunks():
    model = tiny_decoder(tied=True)
    fused_cfg = OmegaConf.create(
        {"_component_": f"{LinearCrossEntropyLoss.__module__}.LinearCrossEntropyLoss"}
    )
    compiled_loss = build_loss(fused_cfg, model, compile_loss=True)
    assert fusable_loss(compiled_loss).compiled
    assert not fusable_loss(build_loss(fused_cfg, model, compile_loss=False)).compiled


def test_model_is_restored_even_when_the_forward_fails():
    model = tiny_decoder(tied=True)
    batch = prompt_masked_batch(VOCAB)
    bad = {**batch, "tokens": batch["tokens"][:, :0]}  # fails inside the forward
    bad[LOSS_POSITIONS] = loss_positions(batch["labels"])
    with pytest.raises(Exception):  # noqa: B017 - any failure of the forward
        causal_lm_loss(model, LinearCrossEntropyLoss(), bad)
    assert "unembed" not in vars(model) and "forward" not in vars(model.output.linear)


# --- (d) no logits-sized tensor is kept for the backward, nor made ------------------------------


@contextlib.contextmanager
def largest_saved_tensor() -> Iterator[list[int]]:
    """Records the element count of every tensor autograd saves for the backward."""
    sizes: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield sizes


class LargestOutput(TorchDispatchMode):
    """Records the element count of every tensor an operator returns (what it allocates)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_logits_sized_tensor_is_saved_for_backward_or_made():
    vocab, chunk_size = 4096, 8
    model = tiny_decoder(tied=False, vocab=vocab)
    batch = prompt_masked_batch(vocab)
    rows = batch["tokens"].numel()  # 96 rows, every position: no cut
    logits_size = rows * vocab
    weight_size = vocab * EMBED

    def step(loss_fn: torch.nn.Module) -> tuple[int, int]:
        model.zero_grad(set_to_none=True)
        with largest_saved_tensor() as saved, LargestOutput() as made:
            causal_lm_loss(model, loss_fn, dict(batch)).backward()
        return max(saved), made.largest

    saved, made = step(LinearCrossEntropyLoss(chunk_size=chunk_size))
    assert saved < logits_size and made < logits_size
    assert made <= max(chunk_size * vocab, weight_size)  # one chunk's logits, or dL/dW
    saved_materialised, _ = step(torch.nn.CrossEntropyLoss())
    assert saved_materialised >= logits_size  # the probe sees logits where they are kept


# --- inside the forward of an FSDP2-sharded model -----------------------------------------------


def _sharded_worker(rank: int, tied: bool, shard_output: bool) -> dict:
    torch.set_num_threads(1)
    batch = prompt_masked_batch(VOCAB)
    reference = tiny_decoder(tied)
    expected = loss_and_grads(reference, present_path(reference), batch, positions=True)

    model = tiny_decoder(tied)
    names = ["output"] if shard_output else None
    shard_model(
        model,
        [partial(get_shard_conditions, names_to_match=names)],
        cpu_offload=False,
        reshard_after_forward=True,
    )
    fusable = can_fuse_output(model)
    loss, grads = loss_and_grads(model, LinearCrossEntropyLoss(), batch, positions=True)
    # Every rank ran the same batch: FSDP's averaged gradient is the one-batch gradient.
    full = {name: grad.full_tensor() for name, grad in grads.items()}
    errors = assert_same_loss_and_grads((loss, full), expected, 1.0)
    own_unit = isinstance(model.output, FSDPModule)  # gathered only in its own forward
    return {"fusable": fusable, "own_unit": own_unit, "worst": max(errors.values())}


@pytest.mark.parametrize(
    ("tied", "shard_output"),
    [(True, False), (False, False), (False, True)],
    ids=["tied", "untied", "untied_output_its_own_unit"],
)
def test_fused_loss_runs_inside_the_forward_of_an_fsdp2_sharded_model(tmp_path, tied, shard_output):
    for result in run_on_ranks(_sharded_worker, (tied, shard_output), tmp_path, world_size=2):
        assert result["fusable"] and result["own_unit"] == shard_output
        assert result["worst"] <= FP32_FLOOR
