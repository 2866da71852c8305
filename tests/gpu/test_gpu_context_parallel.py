"""Context parallelism on CUDA: torch's ring attention over two ranks trains a tiny Llama's
window to the gradient of the same window without it.

Each rank holds half of every sequence (torch's head-tail order) and counts its half's loss
tokens; the real units, step and context of exactga.runtime.context_parallel run, then the
gradients are averaged over the two ranks as FSDP's reduction over dp x cp does. The reference
is the same window through the plain path on one device. See [loss tokens under context
parallelism]; tests/test_context_parallel.py checks the count and the cut on CPU, where torch's
ring attention has no kernel.

Two GPUs: NCCL refuses two ranks on one device ("Duplicate GPU detected"), so on a one-GPU
machine this test skips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cuda_runs import cuda_only
from grouping import GroupingNormalizer
from torch import nn
from unit_utils import collate, make_rows, tiny_model

from exactga.accumulation.loss_units import IGNORE_INDEX, ShiftedTokens, context_parallel_units
from exactga.accumulation.step import StepContext, TrainingWindow
from exactga.config.profiler import ProfilerSettings
from exactga.profiling import TrainingProfiler
from exactga.sft.loss import mean_token_loss

pytestmark = [
    pytest.mark.gpu,
    cuda_only,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason="two ranks of NCCL need two GPUs (NCCL refuses two ranks on one device)",
    ),
]

CP = 2
WIDTH = 48  # a multiple of 2 * CP, within the tiny model's 64 positions
# fp32 (the efficient kernel): ring attention merges the shards' partial softmaxes through
# their log-sum-exps, a different order of the same sums; bf16 (flash): single bf16 roundings
# in some activations and gradients. Far below what a wrong count or position moves (tenths to
# more than 1 on CPU: tests/test_context_parallel.py).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    """make_rows' eight rows two at a time, padded to WIDTH."""
    rows = make_rows()
    batches = []
    for i in range(0, len(rows), 2):
        batch = collate(rows[i : i + 2])
        pad = WIDTH - batch["tokens"].shape[1]
        batches.append(
            {
                "tokens": nn.functional.pad(batch["tokens"], (0, pad)),
                "labels": nn.functional.pad(batch["labels"], (0, pad), value=IGNORE_INDEX),
            }
        )
    return batches


def _window_gradient(
    model: nn.Module, device: torch.device, cp_mesh, dp_group
) -> list[torch.Tensor]:
    """One window of every micro-batch through the real step; the gradients it leaves."""
    loss_fn = nn.CrossEntropyLoss()
    batches = _micro_batches()
    units = context_parallel_units(ShiftedTokens(loss_fn), cp_mesh)
    normalizer = GroupingNormalizer(loss_fn, len(batches), dp_group=dp_group, units=units)
    profiler = TrainingProfiler(
        ProfilerSettings(log_timings=False, saved_latency_every_n_steps=0), device, model
    )
    context = StepContext(model, device, profiler, cp_mesh=cp_mesh)
    (window,) = [TrainingWindow(w, context, 1) for w in normalizer.windows(batches)]
    for batch in window:
        window.backward(mean_token_loss(model, loss_fn, batch))
    assert not window.step(None).nonfinite
    return [p.grad.detach().clone() for p in model.parameters()]


def _rank(rank: int, out_dir: str, dtype_name: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"file://{out_dir}/init", rank=rank, world_size=CP, device_id=device
    )
    try:
        dtype = getattr(torch, dtype_name)
        cp_mesh = init_device_mesh("cuda", (CP,), mesh_dim_names=("cp",))["cp"]
        sharded = _window_gradient(
            tiny_model(dtype).to(device), device, cp_mesh, cp_mesh.get_group()
        )
        for grad in sharded:
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        whole = _window_gradient(tiny_model(dtype).to(device), device, None, None)
        errors = [
            float((s.float() - w.float()).norm() / w.float().norm())
            for s, w in zip(sharded, whole, strict=True)
            if w.float().norm() > 0
        ]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(max(errors)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ring_attention_over_two_ranks_trains_the_window_without_it(
    dtype: torch.dtype, tmp_path: Path, record_property
) -> None:
    dtype_name = str(dtype).removeprefix("torch.")
    mp.start_processes(_rank, args=(str(tmp_path), dtype_name), nprocs=CP, start_method="spawn")
    errors = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(CP)]
    record_property("grad_rel_l2_max", max(errors))
    assert max(errors) < TOLERANCE[dtype], errors
