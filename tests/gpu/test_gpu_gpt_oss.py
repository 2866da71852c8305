"""gpt-oss on CUDA (issues #65 and #68): transformers' logits on the GPU, and the sinks' backward
through flex attention's fused kernels, the one path of the family no CPU can run.

The CPU tests (tests/test_models_gpt_oss.py) hold our model to transformers' in fp32 on the
dense-mask path, flex attention's forward on packed rows to the documents alone, and the sinks'
gradient through flex's log-sum-exp to the dense mask's with flex's unfused backward (torch
refuses flex's backward on a CPU; the test lifts that check). The fused CUDA kernels, compiled as
the recipes run them (``exactga.models.gpt_oss._attention``), are checked here:

- the tiny random model (a sliding and a full layer, sinks and biases perturbed, expert weights
  past the clamp) gives transformers' logits on DEVICE in fp32 (see [fp32 bound] in
  test_gpu_families.py) and, in bf16, no further from transformers' fp32 logits than
  transformers' own bf16 ones are, times BF16_FACTOR (see [bf16 bound] there); transformers runs
  eager attention and eager experts, the definitions;
- a packed row under flex attention (the ``BlockMask`` the recipes' collation builds, compiled
  on CUDA) gives every parameter, the sinks first, the gradients the dense per-document mask
  gives, in fp32, and the sinks' gradients are non-zero; so do its layers compiled by inductor
  with ``fullgraph=True``, flex attention and the sinks inside each layer's graph.

``EXACTGA_GPU_DRY_RUN=1`` rehearses both on the CPU, where packed rows carry the dense mask on
both sides (the comparison is then of a path with itself: a rehearsal of the imports and
shapes, not a check); the compiled layers there are traced with ``aot_eager``.
"""

from __future__ import annotations

import pytest
import test_models_gpt_oss as gpt_oss_cpu
import torch
from cuda_runs import DEVICE
from test_gpu_families import (
    BF16_FACTOR,
    FP32_BOUND,
    compile_each_layer,
    hf_on_device,
    median_token_error,
    ours_on_device,
    relative_error,
)
from torch import nn
from torchtune import training
from torchtune.modules.attention_utils import create_block_causal_mask

from exactga.data.packing import document_mask, uses_flex_attention
from exactga.models.gpt_oss import gpt_oss

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.xdist_group("gpu_families"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
]

DOCUMENTS = [5, 11, 8]  # three documents in one row; the second and third outrun the window


def build() -> nn.Module:
    return gpt_oss(**gpt_oss_cpu.tiny_kwargs())


@pytest.fixture(scope="module")
def folder_and_state(tmp_path_factory: pytest.TempPathFactory):
    folder = gpt_oss_cpu.hf_saved_model(tmp_path_factory.mktemp("gpt_oss_gpu") / "hf")
    return folder, gpt_oss_cpu.ours_from(folder).state_dict()


def test_gpt_oss_gives_transformers_logits_in_fp32_and_bf16(folder_and_state, record_property):
    folder, state = folder_and_state
    ids = gpt_oss_cpu.tokens().to(DEVICE)
    logits = {}
    with torch.no_grad():
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            hf = hf_on_device(
                transformers.GptOssForCausalLM, folder, dtype, experts_implementation="eager"
            )
            logits[f"hf_{name}"] = hf(ids).logits
            logits[f"ours_{name}"] = ours_on_device(build, state, dtype)(ids)
    fp32_gap = relative_error(logits["ours_fp32"], logits["hf_fp32"])
    hf_bf16 = median_token_error(logits["hf_bf16"], logits["hf_fp32"])
    ours_bf16 = median_token_error(logits["ours_bf16"], logits["hf_fp32"])
    record_property("fp32_relative_l2_vs_transformers", f"{fp32_gap:.2e}")
    record_property("bf16_median_token_ours_vs_hf", f"{ours_bf16:.2e} vs {hf_bf16:.2e}")
    assert fp32_gap < FP32_BOUND  # See [fp32 bound]
    assert ours_bf16 <= BF16_FACTOR * hf_bf16  # See [bf16 bound]


def _packed_gradients(
    state: dict[str, torch.Tensor], flex: bool, compiled: bool = False
) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of one packed row's logits against fixed random weights, under
    the per-document mask the recipes' collation builds on CUDA (``flex``: a ``BlockMask``) or
    the dense block-causal mask; ``compiled``: each layer compiled with ``fullgraph=True``
    (``compile_each_layer``)."""
    with training.set_default_dtype(torch.float32), torch.device(DEVICE):
        model = build()
    model.load_state_dict(state, strict=True)
    if compiled:
        compile_each_layer(model)
    if flex:
        mask = document_mask(DOCUMENTS, flex=True)
    else:
        mask = create_block_causal_mask([torch.tensor(DOCUMENTS)]).to(DEVICE)
    return gpt_oss_cpu.packed_row_gradients(model, DOCUMENTS, mask)


def test_the_sinks_backward_under_flex_is_the_dense_masks(folder_and_state, record_property):
    _, state = folder_and_state
    flex = uses_flex_attention(DEVICE)  # CUDA; on the CPU rehearsal both sides are dense
    dense_grads = _packed_gradients(state, flex=False)
    flex_grads = _packed_gradients(state, flex=flex)
    sinks = sorted(name for name in dense_grads if name.endswith("sinks"))
    assert sinks, "the model has no sink parameters"
    gaps = {name: relative_error(flex_grads[name], dense_grads[name]) for name in dense_grads}
    sink_gap = max(gaps[name] for name in sinks)
    record_property("flex_attention", str(flex))
    record_property("sinks_grad_relative_l2_flex_vs_dense", f"{sink_gap:.2e}")
    record_property("worst_grad_relative_l2_flex_vs_dense", f"{max(gaps.values()):.2e}")
    assert all(dense_grads[name].abs().sum() > 0 for name in sinks)
    assert max(gaps.values()) < FP32_BOUND, max(gaps, key=gaps.get)


def test_compiled_layers_take_the_sinks_flex_attention_into_their_graphs(
    folder_and_state, record_property
):
    """[flex attention inside a compiled layer] (exactga.runtime.document_attention): gpt-oss's
    layers compiled by inductor with ``fullgraph=True`` on a packed row's ``BlockMask``, the
    sinks applied through flex's log-sum-exp inside the graph, give the dense mask's gradients
    (eager), every parameter's, in fp32."""
    _, state = folder_and_state
    dense_grads = _packed_gradients(state, flex=False)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled_grads = _packed_gradients(state, flex=uses_flex_attention(DEVICE), compiled=True)
    gaps = {name: relative_error(compiled_grads[name], dense_grads[name]) for name in dense_grads}
    worst = max(gaps, key=gaps.get)
    record_property("worst_grad_relative_l2_compiled_flex_vs_dense", f"{worst}: {gaps[worst]:.2e}")
    assert gaps[worst] < FP32_BOUND, worst
