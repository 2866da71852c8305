"""Unit tier: per-document attention for packed rows (exactga.runtime.document_attention).

A packed row off CUDA carries its document lengths as its mask, and every family's attention
runs each document's span alone; the dense block-causal mask it replaces computes the whole
row and masks it. Here, per family (torchtune's Llama and Qwen2, our Qwen3, Qwen3 MoE, Gemma 3
with a window of 8, gpt-oss with sinks and a window of 4), on one tiny random fp32 model: a
packed row's logits and every parameter's gradient are the dense mask's within the fp32 floor,
with documents longer than the windows, a one-token document and padding at the row's end
(the documents' logits; the padding is not attended, see [padding is not attended]).
See [per-document attention is exact].
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torchtune import training
from torchtune.models.qwen2 import qwen2
from torchtune.modules.attention_utils import create_block_causal_mask
from unit_utils import (
    allow_flex_backward_on_cpu,
    compiled_layers,
    cpu_document_block_mask,
    tiny_model,
)

from exactga.data.packing import DENSE_PACKED_MASK, pack_samples
from exactga.models.gemma3 import gemma3
from exactga.models.gpt_oss import gpt_oss
from exactga.models.qwen3 import qwen3
from exactga.models.qwen3_moe import qwen3_moe
from exactga.runtime.document_attention import (
    DocumentLengths,
    accept_document_lengths,
    attend_per_document,
)

BOUND = 1e-5  # relative L2, fp32: the kernels' rounding, not a masking difference (that is O(1))
VOCAB = 64
LENGTHS = [9, 1, 14, 3]  # 14 > Gemma 3's window of 8 > gpt-oss's of 4; a 1-token document
PADDING = 5  # the row's unfilled end, never attended (exactga.data.packing)
HEADS = {"num_heads": 4, "num_kv_heads": 2, "embed_dim": 32, "max_seq_len": 64}

FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: tiny_model(),
    "qwen2": lambda: qwen2(vocab_size=VOCAB, num_layers=2, intermediate_dim=48, **HEADS),
    "qwen3": lambda: qwen3(
        vocab_size=VOCAB, num_layers=2, head_dim=12, intermediate_dim=48, **HEADS
    ),
    "qwen3_moe": lambda: qwen3_moe(
        vocab_size=VOCAB,
        num_layers=2,
        head_dim=8,
        moe_intermediate_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        **HEADS,
    ),
    "gemma3": lambda: gemma3(
        vocab_size=VOCAB,
        num_layers=2,
        head_dim=8,
        intermediate_dim=48,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=12,
        **HEADS,
    ),
    "gpt_oss": lambda: gpt_oss(
        vocab_size=VOCAB,
        num_layers=2,
        head_dim=8,
        intermediate_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        expert_path="loop",
        **HEADS,
    ),
}


def random_model(family: str) -> nn.Module:
    """The family's tiny model, every parameter random (sinks of either sign included), as a
    recipe builds it: its attention takes :class:`DocumentLengths`."""
    torch.manual_seed(0)
    model = accept_document_lengths(FAMILIES[family]())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.2 * noise if parameter.ndim == 1 else 0.2 * noise)
    return model


def packed_row(lengths: list[int] = LENGTHS, padding: int = PADDING) -> dict[str, torch.Tensor]:
    """One packed row of random documents of ``lengths`` and ``padding`` positions, as the
    ``packed`` collate makes it (its ``mask`` the document lengths)."""
    generator = torch.Generator().manual_seed(2)
    samples = []
    for length in lengths:
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        samples.append({"tokens": ids, "labels": ids})
    row = pack_samples(samples, capacity=sum(lengths) + padding)
    return {key: row[key] for key in ("tokens", "mask", "input_pos")}


def logits_and_gradients(model: nn.Module, row: dict) -> tuple[torch.Tensor, dict]:
    """The documents' logits and every parameter's gradient of a fixed random weighting of
    them; the padding's logits weigh nothing, as its ignored labels weigh nothing in a loss
    (see [padding is not attended])."""
    model.zero_grad(set_to_none=True)
    logits = model(**row)[:, : sum(LENGTHS)]
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def assert_same_numbers(ours: tuple, reference: tuple) -> None:
    """Logits and every parameter's gradient (``logits_and_gradients``) within ``BOUND``."""
    assert relative_error(ours[0], reference[0]) < BOUND
    assert ours[1].keys() == reference[1].keys()
    worst = max(relative_error(ours[1][n], g) for n, g in reference[1].items() if g.any())
    assert worst < BOUND, f"worst parameter gradient: relative error {worst:.2e}"


def test_a_packed_row_carries_its_document_lengths_unless_the_dense_mask_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row = pack_samples(
        [{"tokens": [1, 2], "labels": [1, 2]}, {"tokens": [3], "labels": [3]}], capacity=4
    )
    assert isinstance(row["mask"], DocumentLengths)
    assert row["mask"].tolist() == [[2, 1, -1]]  # the padding: a span of negative length
    monkeypatch.setenv(DENSE_PACKED_MASK, "1")
    dense = pack_samples(
        [{"tokens": [1, 2], "labels": [1, 2]}, {"tokens": [3], "labels": [3]}], capacity=4
    )
    assert torch.equal(dense["mask"], create_block_causal_mask([torch.tensor([2, 1, 1])]))


@pytest.mark.parametrize("family", FAMILIES)
def test_per_document_attention_gives_the_dense_masks_logits_and_gradients(family: str) -> None:
    model = random_model(family)
    row = packed_row()
    per_document = logits_and_gradients(model, row)
    dense = logits_and_gradients(model, dense_row(row))
    assert_same_numbers(per_document, dense)


def dense_row(row: dict) -> dict:
    """``row`` under its dense block-causal mask (what ``DENSE_PACKED_MASK`` packs), the
    padding one more document."""
    spans = [abs(length) for length in row["mask"].tolist()[0]]
    return {**row, "mask": create_block_causal_mask([torch.tensor(spans)])}


def flex_row(row: dict) -> dict:
    """``row`` under flex attention's ``BlockMask``, as packed rows carry it on CUDA (the padding
    one more document), in blocks of 8 so that a row has full, partial and skipped blocks."""
    spans = [abs(length) for length in row["mask"].tolist()[0]]
    return {**row, "mask": cpu_document_block_mask(spans, block_size=8)}


def test_the_padding_is_never_attended_and_its_output_is_zero() -> None:
    """[padding is not attended]: one attention call per document, none for the padding."""
    calls = []

    def attend(q, k, v):
        calls.append(q.shape[2])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(1, 2, 7, 4) for _ in range(3))
    output = attend_per_document(q, k, v, DocumentLengths.of([3, 2], padding=2), attend)
    assert calls == [3, 2]
    assert output.shape == (1, 2, 7, 4) and not output[:, :, 5:].any()
    assert torch.equal(output[:, :, :3], attend(q[:, :, :3], k[:, :, :3], v[:, :, :3]))


@pytest.fixture
def scalar_outputs_traced():
    """Dynamo's setting as exactga's ``compile_layers`` sets it, for this test only."""
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        yield


@pytest.mark.usefixtures("scalar_outputs_traced")
@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_layer_compiles_into_one_graph_on_a_dense_packed_row(family: str) -> None:
    """The one-graph option ([packed rows under compile]): every family's layer, its MoE
    experts' loop included, is one graph, with eager's logits and gradients."""
    model = random_model(family)
    row = dense_row(packed_row())
    eager = logits_and_gradients(model, row)
    compiled = logits_and_gradients(compiled_layers(model, fullgraph=True), row)
    assert_same_numbers(compiled, eager)


@pytest.mark.usefixtures("scalar_outputs_traced")
@pytest.mark.parametrize("family", ["llama", "gemma3"])  # the two per-document attentions
def test_compiled_layers_attend_each_document_alone_with_the_eager_rows_numbers(
    family: str,
) -> None:
    """The default under compile: per-document attention outside the layer's graph."""
    model = random_model(family)
    row = packed_row()
    eager = logits_and_gradients(model, row)
    compiled = logits_and_gradients(compiled_layers(model, fullgraph=False), row)
    assert_same_numbers(compiled, eager)


@pytest.fixture
def flex_backward_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """See ``unit_utils.allow_flex_backward_on_cpu``."""
    allow_flex_backward_on_cpu(monkeypatch)


# The three ways a family's attention takes a BlockMask: torchtune's MultiHeadAttention (Llama,
# Qwen2, Qwen3, Qwen3 MoE: one wrapped call), Gemma 3's (its window narrowed), gpt-oss's (sinks).
FLEX_PATHS = ["llama", "gemma3", "gpt_oss"]


@pytest.mark.filterwarnings("ignore:.*without torch.compile.*:UserWarning")
@pytest.mark.usefixtures("scalar_outputs_traced", "flex_backward_on_the_cpu")
@pytest.mark.parametrize("family", FLEX_PATHS)
def test_each_familys_layer_compiles_flex_attention_into_one_graph(family: str) -> None:
    """[flex attention inside a compiled layer]: on a packed row's ``BlockMask`` (CUDA's mask)
    each attention's layer, Gemma 3's window narrowed and gpt-oss's sinks included, is one graph
    (``fullgraph``: any break fails), eager and compiled give the dense mask's logits and
    gradients, and a row of other documents compiles nothing new."""
    model = random_model(family)
    row = packed_row()
    dense = logits_and_gradients(model, dense_row(row))
    assert_same_numbers(logits_and_gradients(model, flex_row(row)), dense)
    compiled = compiled_layers(model, fullgraph=True)
    assert_same_numbers(logits_and_gradients(compiled, flex_row(row)), dense)
    graphs = counters["stats"]["unique_graphs"]
    other = packed_row(lengths=[5, 12, 10], padding=PADDING)  # as long, other documents
    logits_and_gradients(compiled, flex_row(other))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.filterwarnings("ignore:.*without torch.compile.*:UserWarning")
@pytest.mark.usefixtures("scalar_outputs_traced", "flex_backward_on_the_cpu")
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_checkpointed_compiled_layers_under_flex_attention_give_the_dense_masks_numbers(
    family: str,
) -> None:
    """Activation checkpointing around compiled layers on a ``BlockMask``: the dense mask's
    logits and gradients. Llama's layer stays one graph; a sliding layer of Gemma 3 breaks once
    (see [flex attention inside a compiled layer]), and compiles as the recipes compile, with
    breaks allowed."""
    model = random_model(family)
    row = packed_row()
    dense = logits_and_gradients(model, dense_row(row))
    training.set_activation_checkpointing(model, auto_wrap_policy={type(model.layers[0])})
    compiled = compiled_layers(model, fullgraph=family == "llama")
    logits, grads = logits_and_gradients(compiled, flex_row(row))
    unwrapped = {name.replace("._checkpoint_wrapped_module", ""): g for name, g in grads.items()}
    assert_same_numbers((logits, unwrapped), dense)


def test_each_row_of_a_batch_attends_its_own_documents() -> None:
    """Two rows of different spans in one batch: each row's output is its own, computed alone."""

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    spans = [[3, 2, -1], [4, 1, 1]]
    both = attend_per_document(q, k, v, torch.tensor(spans).as_subclass(DocumentLengths), attend)
    for r, row_spans in enumerate(spans):
        alone = DocumentLengths.of(
            [n for n in row_spans if n > 0], -sum(min(n, 0) for n in row_spans)
        )
        row = (t[r : r + 1] for t in (q, k, v))
        assert torch.equal(both[r : r + 1], attend_per_document(*row, alone, attend))
