"""This wave's model families on CUDA (issue #46): exactga's Qwen3, Gemma 3 and Qwen3 MoE give
transformers' logits on the GPU, and the paths that run only there are checked against the
paths the CPU tests check.

The CPU tests (tests/test_models_qwen3.py, test_models_gemma3.py, test_models_qwen3_moe.py)
build tiny random models whose every detail moves the logits and compare them with
transformers in fp32. Their helpers build the same models here, on ``cuda_runs.DEVICE``:

- families: Qwen3 (tied and untied), Gemma 3 (sliding and global layers, a row three windows
  long) and Qwen3 MoE (a dense layer and expert layers) against transformers' own model of the
  same files, in fp32 (see [fp32 bound]) and bf16 (see [bf16 bound]); transformers runs eager
  attention and, for the MoE, eager experts: the definitions, not its own fast kernels.
- Gemma 3 under flex attention (compiled on CUDA, as the recipes run packed rows, with the
  mask their collation builds, ``exactga.data.packing.document_mask``): documents
  packed in one row get the logits they get alone, and one document's ``BlockMask`` gives
  transformers' sliding-window logits, on a row long enough for the window to leave whole
  128-token blocks full, partial and empty; its layers compiled by inductor with
  ``fullgraph=True`` (flex attention and the window's narrowing inside each layer's graph)
  give eager's logits and gradients.
- ``LinearCrossEntropyLoss`` at Qwen3's vocabulary (151,936) gives materialised logits' loss and
  gradients, with a lower peak of GPU memory.
- Qwen3 MoE: router statistics summed over micro-batches are the whole batch's; the expert
  path ``auto`` picks (``torch._grouped_mm`` on CUDA in bf16 with compute capability 9.0+, the
  loop elsewhere) agrees with the loop and a naive dense reference, forward and backward, the
  path that ran recorded.

``EXACTGA_GPU_DRY_RUN=1`` rehearses all of it on the CPU; the two tests that measure CUDA
itself (the grouped path chosen, peak GPU memory) skip there, and packed rows carry the dense
mask the recipes give SDPA on a CPU instead of a ``BlockMask``.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import test_models_gemma3 as gemma3_cpu
import test_models_qwen3 as qwen3_cpu
import test_models_qwen3_moe as moe_cpu
import torch
import torch.nn.functional as F
from cuda_runs import DEVICE, DRY_RUN, cuda_only
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from torchtune import training
from unit_utils import compiled_layers, probe_gradients

from exactga.accumulation.linear_cross_entropy import LinearCrossEntropyLoss
from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.data.packing import document_mask, uses_flex_attention
from exactga.models.gemma3 import gemma3
from exactga.models.moe import (
    GroupedExperts,
    LoRAStackedLinear,
    StackedLinear,
    load_balancing_loss,
    recording_router_stats,
    sum_router_stats,
)
from exactga.models.qwen3 import qwen3
from exactga.models.qwen3_moe import qwen3_moe

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.xdist_group("gpu_families"),
]

# [fp32 bound]
# The CPU tests' bound, relative L2 of the logits. fp32 matrix products on CUDA run in IEEE
# fp32 (torch's default: no TF32, and nothing in this file turns it on), so ours and
# transformers' differ only in the order of their sums: SDPA's or flex attention's fused
# kernels against eager matmul and softmax, cuBLAS tilings. That is some 1e-7 relative a
# layer (measured on the CPU: below 1e-6 through 2 to 4 layers); a real fault moves the logits
# by 1e-3 or more (the CPU tests measure a window one key off, the QK-norm after RoPE).
FP32_BOUND = 1e-5
# [bf16 bound]
# In bf16 each product and activation is rounded to 8 bits of mantissa (2**-9 relative), and
# where each implementation rounds is its own choice: ours keeps RoPE in fp32, transformers
# rounds cos/sin to bf16, the attention kernels differ. So our bf16 logits are held to how far
# bf16 moves transformers' own from its fp32 logits: at most BF16_FACTOR times as far. Errors
# of like size and independent signs put either within about 1.4x of the other (measured on
# the CPU: ours 0.8x to 1.0x of transformers'); a bf16 path that rounds where it should not is
# off by a multiple (RoPE angles taken in bf16 are off by up to position x 2**-9 radians: a
# whole radian at the long Gemma 3 row below).
# The distance is each token's relative L2 over its logits, the median over the tokens: a
# token whose router ranks its second and third experts almost alike may take the third under
# one rounding and not under the other, a discrete change in that token's logits (10% and
# more) that no rounding bound covers, in either model. It moves the L2 over the whole batch
# by up to 4x in some batches (measured on the CPU with transformers' bf16), the median not.
BF16_FACTOR = 2.0

EXPERT_PATH_NAMES = ("grouped", "loop")


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative L2 distance, in fp64 whatever the operands' dtype."""
    ours, reference = ours.detach().double(), reference.detach().double()
    return ((ours - reference).norm() / reference.norm()).item()


def median_token_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Each token's relative L2 error over its logits, the median over the tokens; see
    [bf16 bound]."""
    logits = logits.detach().double().flatten(0, -2)
    reference = reference.detach().double().flatten(0, -2)
    return ((logits - reference).norm(dim=-1) / reference.norm(dim=-1)).median().item()


def ours_on_device(
    build: Callable[[], nn.Module], state: dict[str, torch.Tensor], dtype: torch.dtype
) -> nn.Module:
    """Our model built on DEVICE in ``dtype`` as a recipe builds it (default dtype, so RoPE
    tables stay fp32) and loaded with ``state`` (``strict=True``)."""
    with training.set_default_dtype(dtype), torch.device(DEVICE):
        model = build()
    model.load_state_dict(state, strict=True)
    return model.eval()


def hf_on_device(hf_class: Any, folder: Path, dtype: torch.dtype, **kwargs: Any) -> Any:
    """transformers' model of ``folder`` in ``dtype`` on DEVICE, eager attention; fails on a
    missing or unexpected key."""
    model, info = hf_class.from_pretrained(
        folder, output_loading_info=True, attn_implementation="eager", dtype=dtype, **kwargs
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.to(DEVICE).eval()


@contextlib.contextmanager
def recording_expert_paths(model: nn.Module) -> Iterator[Counter]:
    """Counts the calls of each expert path (``grouped``, ``loop``) of ``model``'s experts,
    ``model`` itself included, while the context is open."""
    ran: Counter = Counter()
    patched = []
    for experts in (m for m in model.modules() if isinstance(m, GroupedExperts)):
        for path in EXPERT_PATH_NAMES:
            method = getattr(experts, f"_{path}")

            def counted(*args: Any, _method: Callable = method, _path: str = path) -> Any:
                ran[_path] += 1
                return _method(*args)

            setattr(experts, f"_{path}", counted)  # shadows the method on this instance
            patched.append((experts, f"_{path}"))
    try:
        yield ran
    finally:
        for experts, name in patched:
            delattr(experts, name)  # the class's method again


def paths_that_ran(ran: Counter) -> str:
    return "+".join(sorted(ran)) or "none"


# --- the families against transformers -------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One family as its CPU test builds it: a random transformers model written to a folder,
    our model loaded from that folder on the CPU, our builder with the same shapes, and the
    tokens the CPU test feeds."""

    hf_class: Any
    write_hf_folder: Callable[[Path], Path]
    ours_on_cpu: Callable[[Path], nn.Module]
    build: Callable[[], nn.Module]
    tokens: Callable[[], torch.Tensor]
    hf_kwargs: dict[str, Any] = field(default_factory=dict)


FAMILIES = {
    "qwen3-untied": Family(
        transformers.Qwen3ForCausalLM,
        partial(qwen3_cpu.hf_saved_model, tied=False),
        partial(qwen3_cpu.ours_from_hf_folder, tied=False),
        partial(qwen3, **qwen3_cpu.tiny_kwargs(tied=False)),
        qwen3_cpu.tokens,
    ),
    "qwen3-tied": Family(
        transformers.Qwen3ForCausalLM,
        partial(qwen3_cpu.hf_saved_model, tied=True),
        partial(qwen3_cpu.ours_from_hf_folder, tied=True),
        partial(qwen3, **qwen3_cpu.tiny_kwargs(tied=True)),
        qwen3_cpu.tokens,
    ),
    "gemma3": Family(  # 4 layers, local and global; rows of 24 tokens, windows of 8
        transformers.Gemma3ForCausalLM,
        gemma3_cpu.hf_saved_model,
        gemma3_cpu.ours_from_hf_folder,
        partial(gemma3, **gemma3_cpu.TINY),
        gemma3_cpu.tokens,
    ),
    "qwen3-moe": Family(  # layer 0 sparse (8 experts, top-2), layer 1 dense
        transformers.Qwen3MoeForCausalLM,
        partial(moe_cpu.hf_saved_model, dense_layer=True),
        partial(moe_cpu.ours_through_checkpointer, dense_layer=True),
        partial(qwen3_moe, **moe_cpu.tiny_kwargs(dense_layer=True)),
        moe_cpu.tokens,
        {"experts_implementation": "eager"},  # the definition; its default is grouped_mm
    ),
}


@dataclass
class FamilyLogits:
    """One family's logits on DEVICE: transformers' and ours, fp32 and bf16, and which expert
    paths our bf16 model ran."""

    hf_fp32: torch.Tensor
    ours_fp32: torch.Tensor
    hf_bf16: torch.Tensor
    ours_bf16: torch.Tensor
    bf16_expert_paths: Counter


def family_logits(family: Family, folder: Path) -> FamilyLogits:
    family.write_hf_folder(folder)
    state = family.ours_on_cpu(folder).state_dict()
    ids = family.tokens().to(DEVICE)
    logits, paths = {}, {}
    with torch.no_grad():
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            hf = hf_on_device(family.hf_class, folder, dtype, **family.hf_kwargs)
            ours = ours_on_device(family.build, state, dtype)
            logits[f"hf_{name}"] = hf(ids).logits
            with recording_expert_paths(ours) as paths[name]:
                logits[f"ours_{name}"] = ours(ids)
            assert next(ours.parameters()).dtype == dtype  # its logits: fp32 (torchtune upcasts)
    return FamilyLogits(**logits, bf16_expert_paths=paths["bf16"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_gives_transformers_logits_in_fp32_and_bf16(tmp_path, name, record_property):
    logits = family_logits(FAMILIES[name], tmp_path / "hf")
    fp32_gap = relative_error(logits.ours_fp32, logits.hf_fp32)
    record_property("fp32_relative_l2_vs_transformers", f"{fp32_gap:.2e}")
    for measure, error in (("relative_l2", relative_error), ("median_token", median_token_error)):
        record_property(
            f"bf16_transformers_vs_its_fp32_{measure}",
            f"{error(logits.hf_bf16, logits.hf_fp32):.2e}",
        )
        record_property(
            f"bf16_ours_vs_transformers_fp32_{measure}",
            f"{error(logits.ours_bf16, logits.hf_fp32):.2e}",
        )
    if name == "qwen3-moe":
        record_property("bf16_expert_path", paths_that_ran(logits.bf16_expert_paths))
    assert fp32_gap < FP32_BOUND  # See [fp32 bound]
    bf16_move = median_token_error(logits.hf_bf16, logits.hf_fp32)  # bf16 on transformers itself
    assert median_token_error(logits.ours_bf16, logits.hf_fp32) <= BF16_FACTOR * bf16_move


# --- Gemma 3 under flex attention ------------------------------------------------------------

# Gemma 3 at a length where flex attention's 128-token blocks matter: with a window of 300 keys
# over 640 tokens a sliding layer's blocks are full (one block back), partial (two and three
# back, and the diagonal) and empty (four back), so each of the kernel's block kinds runs.
# head_dim 64 as the tiny recipe configs (kernels are tuned for such sizes, not for 16).
LONG = {"head_dim": 64, "sliding_window": 300, "max_seq_len": 1024}
LONG_LENGTH = 640
DOCUMENTS = [220, 420]  # packed in one row; the second is longer than the window


def long_gemma3_state(folder: Path) -> dict[str, torch.Tensor]:
    """Writes the long-window Gemma 3 of transformers to ``folder``; ours of it, on the CPU."""
    gemma3_cpu.hf_saved_model(folder, **LONG)
    return gemma3_cpu.ours_from_hf_folder(folder, **LONG).state_dict()


def long_gemma3(state: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    return ours_on_device(partial(gemma3, **{**gemma3_cpu.TINY, **LONG}), state, dtype)


def document_block_mask(lengths: list[int]) -> BlockMask | torch.Tensor:
    """The mask a packed row of these documents carries in the recipes (the window is the
    model's to add): on CUDA flex attention's ``BlockMask``, on the CPU rehearsal the row's
    ``DocumentLengths`` (each document attended alone)."""
    return document_mask(lengths, flex=uses_flex_attention(DEVICE))


def test_gemma3_packed_documents_get_their_own_logits_under_flex(tmp_path, record_property):
    model = long_gemma3(long_gemma3_state(tmp_path / "hf"), torch.float32)
    ids, positions = gemma3_cpu.packed_row(DOCUMENTS)
    ids, positions = ids.to(DEVICE), positions.to(DEVICE)
    with torch.no_grad():
        packed = model(ids, mask=document_block_mask(DOCUMENTS), input_pos=positions)
        alone = [model(document) for document in ids.split(DOCUMENTS, dim=1)]  # SDPA, no mask
    gaps = [
        relative_error(got, expected)
        for got, expected in zip(packed.split(DOCUMENTS, dim=1), alone, strict=True)
    ]
    record_property("fp32_relative_l2_packed_vs_alone", ", ".join(f"{g:.2e}" for g in gaps))
    assert max(gaps) < FP32_BOUND  # See [fp32 bound]


def compile_each_layer(model: nn.Module) -> nn.Module:
    """``model``'s layers compiled by inductor as the recipes compile them, but with
    ``fullgraph=True``, so that a graph break fails; the CPU rehearsal traces with ``aot_eager``
    and allows the breaks its per-document attention takes (no ``BlockMask`` there)."""
    return compiled_layers(
        model, fullgraph=not DRY_RUN, backend="aot_eager" if DRY_RUN else "inductor"
    )


def test_gemma3_layers_compile_flex_attention_into_one_graph(tmp_path, record_property):
    """[flex attention inside a compiled layer] (exactga.runtime.document_attention): Gemma 3's
    layers, each compiled by inductor with ``fullgraph=True`` on a packed row's ``BlockMask``
    (the sliding layers narrow it to their window inside their graphs), give eager's logits and
    every gradient in fp32."""
    state = long_gemma3_state(tmp_path / "hf")
    ids, positions = gemma3_cpu.packed_row(DOCUMENTS)
    ids, positions = ids.to(DEVICE), positions.to(DEVICE)
    mask = document_block_mask(DOCUMENTS)
    eager = probe_gradients(long_gemma3(state, torch.float32), ids, mask, positions)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        model = compile_each_layer(long_gemma3(state, torch.float32))
        compiled = probe_gradients(model, ids, mask, positions)
    logits_gap = relative_error(compiled[0], eager[0])
    gradient_gaps = {name: relative_error(compiled[1][name], g) for name, g in eager[1].items()}
    worst = max(gradient_gaps, key=gradient_gaps.get)
    record_property("fp32_relative_l2_compiled_vs_eager_logits", f"{logits_gap:.2e}")
    record_property("fp32_worst_gradient", f"{worst}: {gradient_gaps[worst]:.2e}")
    assert compiled[1].keys() == eager[1].keys()
    assert max(logits_gap, gradient_gaps[worst]) < FP32_BOUND  # See [fp32 bound]


def test_gemma3_sliding_window_under_flex_is_transformers(tmp_path, record_property):
    folder = tmp_path / "hf"
    state = long_gemma3_state(folder)
    ids = gemma3_cpu.tokens(batch=1, length=LONG_LENGTH).to(DEVICE)
    whole_row = document_block_mask([LONG_LENGTH])
    logits = {}
    with torch.no_grad():
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            hf = hf_on_device(transformers.Gemma3ForCausalLM, folder, dtype)
            ours = long_gemma3(state, dtype)
            logits[f"hf_{name}"] = hf(ids).logits
            logits[f"flex_{name}"] = ours(ids, mask=whole_row)
            logits[f"sdpa_{name}"] = ours(ids)  # no mask: SDPA with the window's band
    reference = logits["hf_fp32"]
    fp32_gaps = {key: relative_error(logits[key], reference) for key in ("flex_fp32", "sdpa_fp32")}
    bf16_gaps = {
        key: median_token_error(logits[key], reference)
        for key in ("hf_bf16", "flex_bf16", "sdpa_bf16")
    }
    for key, gap in fp32_gaps.items():
        record_property(f"{key}_relative_l2_vs_transformers_fp32", f"{gap:.2e}")
    for key, gap in bf16_gaps.items():
        record_property(f"{key}_median_token_vs_transformers_fp32", f"{gap:.2e}")
    assert max(fp32_gaps.values()) < FP32_BOUND  # See [fp32 bound]
    assert bf16_gaps["flex_bf16"] <= BF16_FACTOR * bf16_gaps["hf_bf16"]  # See [bf16 bound]
    assert bf16_gaps["sdpa_bf16"] <= BF16_FACTOR * bf16_gaps["hf_bf16"]


# --- the fused linear cross-entropy at Qwen3's vocabulary ------------------------------------

QWEN3_VOCAB = 151_936
LCE_WIDTH = 128  # small: the logits, not the model, are what the fused loss saves
LCE_ROWS = 390  # 8 chunks of 49 rows, the last one short
# (parameter dtype, autocast dtype): pure fp32, pure bf16, bf16 autocast over fp32 weights
# (exactga's master_weights: fp32).
PRECISIONS = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "bf16-autocast": (torch.float32, torch.bfloat16),
}


def lce_inputs(param_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states, output weight (logits of about unit spread) and labels on DEVICE; a
    prompt's worth of rows and every seventh row ignored."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(LCE_ROWS, LCE_WIDTH, generator=generator)
    weight = 0.1 * torch.randn(QWEN3_VOCAB, LCE_WIDTH, generator=generator)
    labels = torch.randint(0, QWEN3_VOCAB, (LCE_ROWS,), generator=generator)
    labels[:60] = IGNORE_INDEX
    labels[::7] = IGNORE_INDEX
    return hidden.to(DEVICE, param_dtype), weight.to(DEVICE, param_dtype), labels.to(DEVICE)


def autocast_or_not(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=DEVICE, dtype=dtype)


def lce_loss_gradients_peak(
    precision: str, fused: bool
) -> tuple[dict[str, torch.Tensor], int | None]:
    """Mean loss and the gradients of the hidden states and the weight, by the fused loss or
    by materialised logits + ``F.cross_entropy``; and the peak GPU memory above the inputs
    (None on the CPU)."""
    param_dtype, autocast_dtype = PRECISIONS[precision]
    hidden, weight, labels = lce_inputs(param_dtype)
    hidden.requires_grad_()
    weight.requires_grad_()
    if not DRY_RUN:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with autocast_or_not(autocast_dtype):
        if fused:
            loss = LinearCrossEntropyLoss(num_output_chunks=8).from_hidden(hidden, weight, labels)
        else:
            logits = F.linear(hidden, weight)
            loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)
    loss.backward()
    peak = None
    if not DRY_RUN:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    return {"loss": loss.detach(), "hidden.grad": hidden.grad, "weight.grad": weight.grad}, peak


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_fused_loss_at_qwen3_vocab_is_materialised_logits(precision, record_property):
    """fp32: within FP32_BOUND. bf16: both ways multiply in bf16 and take the softmax in fp32,
    differing only in where bf16 rounds (chunks of 49 rows against all rows at once; the
    weight's gradient summed over chunks in its dtype): the fused result must be no further
    from the materialised one than bf16 moves the materialised one from fp32, as the CPU test
    (tests/test_linear_cross_entropy.py) holds it."""
    fused, _ = lce_loss_gradients_peak(precision, fused=True)
    materialised, _ = lce_loss_gradients_peak(precision, fused=False)
    gaps = {key: relative_error(fused[key], materialised[key]) for key in materialised}
    for key, gap in gaps.items():
        record_property(f"{key}_relative_l2", f"{gap:.2e}")
    if precision == "fp32":
        assert max(gaps.values()) < FP32_BOUND, gaps  # See [fp32 bound]
        return
    fp32, _ = lce_loss_gradients_peak("fp32", fused=False)
    bf16_floor = max(relative_error(materialised[key], fp32[key]) for key in fp32)
    record_property("bf16_materialised_vs_fp32", f"{bf16_floor:.2e}")
    assert max(gaps.values()) <= bf16_floor, gaps
    assert fused["weight.grad"].dtype == PRECISIONS[precision][0]


@cuda_only
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_fused_loss_peaks_below_materialised_logits_on_cuda(precision, record_property):
    _, fused_peak = lce_loss_gradients_peak(precision, fused=True)
    _, materialised_peak = lce_loss_gradients_peak(precision, fused=False)
    record_property("peak_mib_materialised", f"{materialised_peak / 2**20:.0f}")
    record_property("peak_mib_fused", f"{fused_peak / 2**20:.0f}")
    assert fused_peak < materialised_peak


# --- Qwen3 MoE: router statistics and expert paths -------------------------------------------

# Last in the file: a grouped matmul whose groups break the kernel's layout rules stops at a
# device-side assert, after which every CUDA call of the process fails; the tests above have
# reported by then.

NUM_EXPERTS, TOP_K = moe_cpu.NUM_EXPERTS, moe_cpu.TOP_K
EXPERT_DIM, EXPERT_HIDDEN = 64, 32  # multiples of 8: grouped_mm's alignment on CUDA
LORA_RANK = 8  # a multiple of 8 too, so adapters do not send auto to the loop
NUM_TOKENS = 256
IDLE_EXPERT = 5  # routed no token: an empty group in every path


def router_losses(stats: Any) -> torch.Tensor:
    return load_balancing_loss(
        stats.expert_counts, stats.prob_sums, stats.num_tokens, NUM_EXPERTS, TOP_K
    )


def test_router_statistics_summed_over_micro_batches_are_the_whole_batchs(record_property):
    """The CPU test's check on DEVICE (fp32, where per-token results do not depend on the
    batch's size beyond summation order): micro-batches of 1 and 3 rows holding different
    numbers of real tokens; see [router statistics are sums]."""
    torch.manual_seed(0)
    model = qwen3_moe(**moe_cpu.TINY)
    moe_cpu.randomize_(model)
    model = model.to(DEVICE).eval()
    ids = moe_cpu.tokens(batch=4).to(DEVICE)
    mask = moe_cpu.right_padding_mask([11, 2, 9, 4], 11).to(DEVICE)

    def statistics(rows: slice) -> list:
        with torch.no_grad(), recording_router_stats(model, token_mask=mask[rows]) as blocks:
            model(ids[rows])
        return [block.last_router_stats for block in blocks]

    whole = statistics(slice(0, 4))
    first, second = statistics(slice(0, 1)), statistics(slice(1, 4))
    for layer, whole_layer in enumerate(whole):
        summed = sum_router_stats([first[layer], second[layer]])
        assert torch.equal(summed.expert_counts, whole_layer.expert_counts), layer
        assert summed.num_tokens == whole_layer.num_tokens == mask.sum()
        gap = abs(router_losses(summed) / router_losses(whole_layer) - 1).item()
        mean_of_losses = (router_losses(first[layer]) + router_losses(second[layer])) / 2
        mean_gap = abs(mean_of_losses / router_losses(whole_layer) - 1).item()
        record_property(f"layer{layer}_balance_loss_summed_vs_whole", f"{gap:.2e}")
        record_property(f"layer{layer}_mean_of_micro_batch_losses_vs_whole", f"{mean_gap:.2e}")
        assert gap < 1e-5  # fp32 sums of the same tokens' values in another order
        assert mean_gap > 1e-3  # the wrong way to combine them is visibly wrong


def stacked_experts(lora: bool) -> GroupedExperts:
    """Random experts (``path="auto"``) on DEVICE in bf16, where auto may pick grouped_mm."""
    if lora:
        projection = partial(LoRAStackedLinear, rank=LORA_RANK, alpha=2.0 * LORA_RANK)
    else:
        projection = StackedLinear
    experts = GroupedExperts(
        projection(NUM_EXPERTS, EXPERT_DIM, EXPERT_HIDDEN),
        projection(NUM_EXPERTS, EXPERT_HIDDEN, EXPERT_DIM),
        projection(NUM_EXPERTS, EXPERT_DIM, EXPERT_HIDDEN),
    )
    moe_cpu.randomize_(experts)  # lora_b too: a trained adapter, not a zero one
    return experts.to(DEVICE, torch.bfloat16)


def routed_tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, their top-k experts (never IDLE_EXPERT) and weights, and a dense upstream
    gradient (an expanded one has zero strides, which grouped_mm's CPU backward refuses)."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(NUM_TOKENS, EXPERT_DIM, generator=generator)
    choices = torch.tensor([e for e in range(NUM_EXPERTS) if e != IDLE_EXPERT])
    picks = [torch.randperm(len(choices), generator=generator)[:TOP_K] for _ in x]
    indices = choices[torch.stack(picks)]
    weights = torch.rand(NUM_TOKENS, TOP_K, generator=generator)
    upstream = torch.randn(NUM_TOKENS, EXPERT_DIM, generator=generator)
    return x, indices, weights, upstream


def forward_backward(
    experts: GroupedExperts, dtype: torch.dtype, path: str
) -> tuple[dict[str, torch.Tensor], Counter]:
    """Output, input gradient and parameter gradients of ``experts`` (a copy in ``dtype``) run
    by ``path``: ``auto``, ``loop`` or ``naive``; and the expert paths that ran."""
    experts = copy.deepcopy(experts).to(dtype)
    x, indices, weights, upstream = (t.to(DEVICE) for t in routed_tokens())
    x = x.to(dtype).requires_grad_()
    weights, upstream = weights.to(dtype), upstream.to(dtype)
    with recording_expert_paths(experts) as ran:
        if path == "naive":  # every expert on every token, kept where routed
            output = moe_cpu.naive_experts(experts, x, indices, weights)
        else:
            experts.path = path
            output = experts(x, indices, weights)
        output.backward(upstream)
    results = {"output": output.detach(), "x.grad": x.grad}
    results.update({name: p.grad for name, p in experts.named_parameters()})
    return results, ran


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_auto_expert_path_agrees_with_loop_and_naive(lora, record_property):
    """In bf16 (where auto takes grouped_mm on CUDA) the auto path is as close to the fp32
    naive reference as the bf16 loop, within BF16_FACTOR (see [bf16 bound]); in fp32 (the loop
    on every device) the loop is the naive reference within FP32_BOUND. Every output and
    gradient, each on its own."""
    experts = stacked_experts(lora)
    reference, _ = forward_backward(experts, torch.float32, "naive")
    loop_fp32, _ = forward_backward(experts, torch.float32, "loop")
    auto, ran = forward_backward(experts, torch.bfloat16, "auto")
    loop, _ = forward_backward(experts, torch.bfloat16, "loop")
    record_property("bf16_auto_expert_path", paths_that_ran(ran))
    worst = {"fp32_loop": 0.0, "bf16_loop": 0.0, "bf16_auto": 0.0}
    for key, expected in reference.items():
        gaps = {
            "fp32_loop": relative_error(loop_fp32[key], expected),
            "bf16_loop": relative_error(loop[key], expected),
            "bf16_auto": relative_error(auto[key], expected),
        }
        worst = {path: max(worst[path], gap) for path, gap in gaps.items()}
        assert gaps["fp32_loop"] < FP32_BOUND, key  # See [fp32 bound]
        assert gaps["bf16_auto"] <= BF16_FACTOR * gaps["bf16_loop"], key  # See [bf16 bound]
    for path, gap in worst.items():
        record_property(f"{path}_worst_relative_l2_vs_naive_fp32", f"{gap:.2e}")
    for results in (loop_fp32, loop, auto):  # the idle expert learns nothing, exactly
        assert results["w1.weight"][IDLE_EXPERT].abs().max() == 0
        assert results["w2.weight"][IDLE_EXPERT].abs().max() == 0


@cuda_only
def test_auto_expert_path_is_grouped_mm_on_cuda_in_bf16(record_property):
    capability = torch.cuda.get_device_capability()
    record_property("compute_capability", f"{capability[0]}.{capability[1]}")
    if capability < (9, 0):
        pytest.skip(f"grouped_mm is auto's path from compute capability 9.0; this is {capability}")
    _, ran = forward_backward(stacked_experts(lora=False), torch.bfloat16, "auto")
    _, ran_fp32 = forward_backward(stacked_experts(lora=False), torch.float32, "auto")
    record_property("bf16_path", paths_that_ran(ran))
    record_property("fp32_path", paths_that_ran(ran_fp32))
    assert set(ran) == {"grouped"} and set(ran_fp32) == {"loop"}
