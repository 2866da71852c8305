"""No host read inside a micro-batch (issue #66): each family's loss step and its backward never
wait for the device.

On a GPU, reading a value back to the host (``.item()``, ``bool(tensor)``, ``.tolist()``) or an
operator whose output shape depends on values (``nonzero``, a boolean-mask index,
``masked_select``) makes the host wait for every kernel queued so far, so the next kernels are
launched only after the device has run dry: with one micro-batch already host-bound (2,204
launches, docs/gpu_report_round_two.md), each read costs the queue it drains. The window's
counts are taken on the host from the labels before the first forward (exactga.accumulation),
and the step reads one flag after the last backward (``TrainingWindow.step``); in between,
nothing may read. Here each family's micro-batch runs on the CPU under two modes that record
what would be such a read on a GPU: torch's function mode for the Python calls, its dispatch
mode for the operators. Packed rows off CUDA read their document lengths on purpose (a CPU
path; on CUDA a packed row carries a ``BlockMask`` and reads nothing): not covered here.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
import torchtune.modules.loss
from grouping import GroupingNormalizer
from omegaconf import OmegaConf
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.rlhf.loss import DPOLoss
from unit_utils import make_rows, split, tiny_model

from exactga.accumulation.step import StepContext, TrainingWindow
from exactga.dpo.log_probs import frozen_model_reference
from exactga.dpo.loss import dpo_micro_batch_loss
from exactga.dpo.metrics import PreferenceMetrics
from exactga.dpo.preference import PreferencePairs, collate_pairs
from exactga.kd.distillation import Distiller
from exactga.model_build.frozen import freeze_model
from exactga.model_build.trained import build_loss
from exactga.models.qwen3_moe import qwen3_moe
from exactga.profiling import ProfilerSettings, TrainingProfiler
from exactga.runtime.precision import Precision
from exactga.sft.loss import causal_lm_loss
from exactga.sft.router_balance import RouterBalance

CPU = torch.device("cpu")
FP32 = Precision.from_config(torch.float32, "none", CPU)
CHUNKED = "torchtune.modules.loss.CEWithChunkedOutputLoss"
FUSED = "exactga.accumulation.linear_cross_entropy.LinearCrossEntropyLoss"
# Python calls that copy a tensor's values to the host.
READ_CALLS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
# Operators that read a value (_local_scalar_dense: item, bool, int, float) or whose output's
# shape depends on the values, which the host must wait for before it can allocate it.
READ_OPERATORS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2"}


@dataclass
class HostReads:
    """What ran under :func:`recording`: each read's name and where it came from."""

    found: list[str] = field(default_factory=list)

    def add(self, name: str) -> None:
        self.found.append(f"{name} at\n{''.join(traceback.format_stack(limit=6)[:-2])}")


class _Calls(TorchFunctionMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if getattr(func, "__name__", "") in READ_CALLS:
            self.reads.add(func.__name__)
        return func(*args, **(kwargs or {}))


class _Operators(TorchDispatchMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        boolean_index = name == "index" and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool
            for index in (args[1] if len(args) > 1 else ())
        )
        if name in READ_OPERATORS or boolean_index:
            self.reads.add(f"aten.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording() -> Iterator[HostReads]:
    reads = HostReads()
    with _Calls(reads), _Operators(reads):
        yield reads


def test_the_recording_sees_each_kind_of_read() -> None:
    """The check can fail: each kind of read it looks for is recorded."""
    x = torch.arange(6.0)
    with recording() as reads:
        x.sum().item()
        bool(x[0] > 1)
        x.tolist()
        x[x > 2]  # noqa: B018 - a boolean-mask index: its shape depends on the values
        torch.nonzero(x)
    kinds = [read.split(" at")[0] for read in reads.found]
    assert {"item", "__bool__", "tolist", "aten.index", "aten.nonzero"} <= set(kinds), kinds


def _sft_window(
    model: torch.nn.Module, loss_fn: torch.nn.Module, router: RouterBalance | None
) -> TrainingWindow:
    """The first window (4 micro-batches of 2 rows) of the unit tier's rows, as a recipe runs it
    (counting the router term's units where there is one)."""
    profiler = TrainingProfiler(
        ProfilerSettings(log_timings=False, saved_latency_every_n_steps=0), CPU, model
    )
    units = router.units(loss_fn) if router is not None else None
    normalizer = GroupingNormalizer(loss_fn, 4, units=units)
    window = next(iter(normalizer.windows(split(make_rows(), 2))))
    return TrainingWindow(window, StepContext(model, CPU, profiler), 1)


def _reads_of_sft_window(
    model: torch.nn.Module, loss_fn: torch.nn.Module, router: RouterBalance | None = None
) -> list[str]:
    window = _sft_window(model, loss_fn, router)
    reads: list[str] = []
    for batch in window:
        with recording() as recorded:
            loss = causal_lm_loss(model, loss_fn, batch, precision=FP32, router=router)
            window.backward(loss)
        reads += recorded.found
    return reads


@pytest.mark.parametrize("loss", ["chunked", "fused"])
def test_a_fine_tuning_micro_batch_reads_nothing(loss: str) -> None:
    torch.manual_seed(0)
    model = tiny_model()
    components = {"chunked": CHUNKED, "fused": FUSED}
    loss_fn = build_loss(
        OmegaConf.create({"_component_": components[loss]}), model, compile_loss=False
    )
    assert _reads_of_sft_window(model, loss_fn) == []


@pytest.mark.parametrize("objective", ["micro_batch", "global_batch"])
def test_a_micro_batch_with_the_router_term_reads_nothing(objective: str) -> None:
    """On the grouped expert matmuls (``torch._grouped_mm``: CUDA's path in bf16 on sm90+). The
    per-expert loop, the fallback elsewhere, reads each expert's row count to split the rows."""
    torch.manual_seed(0)
    model = qwen3_moe(
        vocab_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=32,
        head_dim=8,
        moe_intermediate_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_seq_len=64,
        expert_path="grouped",
    )
    router = RouterBalance(model, 0.01, objective, None, CPU)
    loss_fn = build_loss(OmegaConf.create({"_component_": CHUNKED}), model, compile_loss=False)
    reads = _reads_of_sft_window(model, loss_fn, router)
    assert reads == [], "\n".join(reads)


def _distiller(kd_loss: str) -> Distiller:
    student, teacher = tiny_model(), freeze_model(tiny_model(seed=1))
    kd_loss_fn = getattr(torchtune.modules.loss, kd_loss)()
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100)
    if "Chunked" in kd_loss:
        loss_fn = CEWithChunkedOutputLoss()
        for model in (student, teacher):
            model.set_num_output_chunks(loss_fn.num_output_chunks)
    return Distiller(
        student, teacher, loss_fn, kd_loss_fn, kd_ratio=0.4, precision=FP32, device=CPU
    )


def _pairs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    pairs = []
    for prompt_len, chosen_len, rejected_len in [(5, 12, 3), (3, 4, 9)]:
        prompt = torch.randint(1, 64, (prompt_len,), generator=generator).tolist()
        pair = {}
        for side, length in (("chosen", chosen_len), ("rejected", rejected_len)):
            response = torch.randint(1, 64, (length,), generator=generator).tolist()
            pair[f"{side}_input_ids"] = prompt + response
            pair[f"{side}_labels"] = [-100] * prompt_len + response
        pairs.append(pair)
    return PreferencePairs().prepare(collate_pairs(pairs), 2, runs_empty=False)


def _kd_step(kd_loss: str) -> Callable[[], torch.Tensor]:
    distiller = _distiller(kd_loss)
    batch = split(make_rows(), 4)[0]
    return lambda: distiller.loss_step(dict(batch)).main


def _dpo_step() -> Callable[[], torch.Tensor]:
    model, reference = tiny_model(), frozen_model_reference(freeze_model(tiny_model(seed=7)))
    batch = _pairs()
    metrics = PreferenceMetrics()
    return lambda: (
        dpo_micro_batch_loss(
            model, DPOLoss(beta=0.1), dict(batch), reference, metrics=metrics, precision=FP32
        ).main
    )


KD_LOSSES = [
    f"{kind}KL{chunked}Loss"
    for kind in ("Forward", "Reverse", "Symmetric")
    for chunked in ("", "WithChunkedOutput")
]


@pytest.mark.parametrize("family", [*KD_LOSSES, "dpo"])
def test_a_distillation_or_preference_micro_batch_reads_nothing(family: str) -> None:
    """Each of torchtune's KD losses (see [kd mean without a host read]), and DPO's step."""
    torch.manual_seed(0)
    loss_step = _dpo_step() if family == "dpo" else _kd_step(family)
    with recording() as reads:
        loss_step().backward()
    assert reads.found == [], "\n".join(reads.found)
