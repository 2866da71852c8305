"""The mesh keys' checks, and the loss count over the mesh's axes, in-process (docs/meshes.md).

The checks: impossible meshes fail in one message naming the keys (exactga.config.mesh), at
validation where the number of ranks does not matter, else when the runtime builds the mesh.

The count ([mesh axes and the loss count] in exactga.runtime.distributed), on 4 gloo ranks with
real FSDP2 over the mesh's FSDP submesh: every rank accumulates its share of eight
variable-length rows with masked prompts and the gradient must be the full-batch one. The model
is position-wise (an embedding and a projection, no attention), so a sequence split over
context-parallel ranks gives each rank exactly its slice's losses, as context parallelism's
attention does; the labels are shifted before the split, as context parallelism needs. Counting
over the right group stays at the fp32 floor; a wrong one moves the gradient far off it, or (with
tensor parallelism) counts every unit twice. Run with ``-rP`` to see the figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from grouping import GroupingNormalizer
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.fsdp import fully_shard
from unit_utils import EXACT_TOL, VOCAB, make_rows, rel_err, run_on_ranks

from exactga.config.mesh import MeshShape, mesh_keys, mesh_shape
from exactga.config.schemas import FullFinetuneDistributedConfig, LoraFinetuneDistributedConfig
from exactga.config.validation import validate_config
from exactga.dpo.schema import LoraDpoDistributedConfig
from exactga.grpo.schema import GrpoDistributedConfig
from exactga.kd.schema import KnowledgeDistillationDistributedConfig
from exactga.runtime.distributed import build_device_mesh

IGNORE = -100
FAR = 1e-2  # a wrong group's distance is above this; the right one's is under EXACT_TOL

# --- the checks --------------------------------------------------------------------------------


def _keys(replicate: int = 1, shard: int = -1, cp: int = 1, tp: int = 1) -> dict[str, int]:
    config = OmegaConf.create(
        {
            "data_parallel_replicate_dim": replicate,
            "data_parallel_shard_dim": shard,
            "context_parallel_dim": cp,
        }
    )
    return mesh_keys(config, tp)


@pytest.mark.parametrize(
    ("keys", "world_size", "shape"),
    [
        (_keys(), 4, MeshShape(1, 4, 1, 1)),  # the default: torchtune 0.6.1's one axis
        (_keys(replicate=2), 4, MeshShape(2, 2, 1, 1)),
        (_keys(tp=2), 4, MeshShape(1, 2, 1, 2)),
        (_keys(replicate=2, shard=2, cp=2, tp=2), 16, MeshShape(2, 2, 2, 2)),
    ],
)
def test_the_shard_dimension_takes_what_the_others_leave(keys, world_size, shape) -> None:
    assert mesh_shape(keys, world_size, "cuda") == shape


@pytest.mark.parametrize(
    ("keys", "world_size", "device", "message"),
    [
        (
            _keys(replicate=3),
            4,
            "cpu",
            "config keys data_parallel_replicate_dim=3, context_parallel_dim=1, "
            "tensor_parallel_dim=1: their product 3 must divide the 4 ranks",
        ),
        (
            _keys(replicate=2, shard=4),
            4,
            "cpu",
            "config keys data_parallel_replicate_dim=2, data_parallel_shard_dim=4, "
            "context_parallel_dim=1, tensor_parallel_dim=1: their product 8 must equal the 4 "
            "ranks (--nproc_per_node x --nnodes); set data_parallel_shard_dim=-1",
        ),
        (
            _keys(replicate=0, shard=-2),
            4,
            "cpu",
            "config keys data_parallel_replicate_dim=0, data_parallel_shard_dim=-2: every mesh "
            "dimension must be 1 or more",
        ),
        (
            _keys(cp=2),
            4,
            "cpu",
            "config key context_parallel_dim=2: context parallelism runs on CUDA only",
        ),
    ],
)
def test_an_impossible_mesh_fails_in_one_message(keys, world_size, device, message) -> None:
    with pytest.raises(ValueError) as raised:
        mesh_shape(keys, world_size, device)
    assert str(raised.value).startswith(message), str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("schema", "path", "overrides", "message"),
    [
        (
            FullFinetuneDistributedConfig,
            "configs/tiny/full_distributed.yaml",
            {"context_parallel_dim": 2},
            "config key context_parallel_dim=2: context parallelism runs on CUDA only",
        ),
        (
            LoraFinetuneDistributedConfig,
            "configs/tiny/lora_distributed.yaml",
            {"data_parallel_shard_dim": 0},
            "config keys data_parallel_shard_dim=0: every mesh dimension must be 1 or more",
        ),
        (  # LoRA has no tensor parallelism: the key is not the schema's
            LoraFinetuneDistributedConfig,
            "configs/tiny/lora_distributed.yaml",
            {"tensor_parallel_dim": 2},
            "tensor_parallel_dim",
        ),
        (  # distillation's step reads whole sequences: refused before the device is asked
            KnowledgeDistillationDistributedConfig,
            "configs/tiny/kd_distributed.yaml",
            {"context_parallel_dim": 2},
            "context_parallel_dim'=2: this recipe's loss step reads whole sequences",
        ),
        (
            LoraDpoDistributedConfig,
            "configs/tiny/lora_dpo_distributed.yaml",
            {"context_parallel_dim": 2},
            "context_parallel_dim'=2: this recipe's loss step reads whole sequences",
        ),
        (  # GRPO generates and scores whole sequences on each rank
            GrpoDistributedConfig,
            "configs/tiny/grpo_distributed.yaml",
            {"context_parallel_dim": 2},
            "context_parallel_dim'=2: this recipe's loss step reads whole sequences",
        ),
    ],
)
def test_validation_refuses_what_no_number_of_ranks_fixes(schema, path, overrides, message):
    config = OmegaConf.merge(OmegaConf.load(path), OmegaConf.create(overrides))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_config(config, schema, "recipe")


# --- the count ---------------------------------------------------------------------------------


class PositionWise(nn.Module):
    """Logits of each position from its own token: exact on any slice of a sequence."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.output = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(torch.tanh(self.embed(tokens)))


class PreShiftedTokens:
    """Loss tokens of labels shifted before the sequence was split (context parallelism)."""

    name = "loss_tokens"

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE).sum())

    def prepare(self, batch: dict, num_units: int, runs_empty: bool) -> dict:
        if runs_empty:  # a finite loss of weight 0, so that FSDP's collectives still pair up
            labels = batch["labels"].clone()
            labels[0, 0] = 0
            batch = {**batch, "labels": labels}
        return batch

    def emptied(self, batch: dict) -> dict:
        return {**batch, "labels": torch.full_like(batch["labels"], IGNORE)}


def _shifted_rows() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (tokens, torch.cat([labels[1:], torch.tensor([IGNORE])])) for tokens, labels in make_rows()
    ]


def _collate(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(len(tokens) for tokens, _ in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (row_tokens, row_labels) in enumerate(rows):
        tokens[i, : len(row_tokens)], labels[i, : len(row_labels)] = row_tokens, row_labels
    return {"tokens": tokens, "labels": labels}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor], reduction: str = "mean"):
    logits = model(batch["tokens"])
    return F.cross_entropy(
        logits.reshape(-1, VOCAB),
        batch["labels"].reshape(-1),
        ignore_index=IGNORE,
        reduction=reduction,
    )


def _full_batch_grad(rows) -> tuple[torch.Tensor, int]:
    model = PositionWise()
    batch = _collate(rows)
    count = int((batch["labels"] != IGNORE).sum())
    (_loss(model, batch, "sum") / count).backward()
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters()]), count


def _this_ranks_rows(mesh) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rows of this rank's data-parallel rank ("dp": replicate x shard), each cut to this
    rank's contiguous slice of the context-parallel split."""
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    cp, cp_rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
    rows = _shifted_rows()[dp_rank::dp]
    sliced = []
    for tokens, labels in rows:
        bounds = torch.linspace(0, len(tokens), cp + 1).round().long().tolist()
        start, end = bounds[cp_rank], bounds[cp_rank + 1]
        sliced.append((tokens[start:end], labels[start:end]))
    return sliced


def _count_worker(rank: int, shape: tuple[int, ...], group_name: str) -> dict:
    torch.set_num_threads(1)
    mesh = build_device_mesh(torch.device("cpu"), MeshShape(*shape))
    groups = {
        "dp_cp": mesh.count_group(),  # the runtime's count group
        "dp_shard": mesh["dp_shard"].get_group(),  # HSDP's replicas left out
        "dp": mesh["dp"].get_group(),  # context parallelism's slices left out
        "world": dist.group.WORLD,  # with tp: every unit counted tp times
    }
    reference, full_count = _full_batch_grad(_shifted_rows())
    model = PositionWise()
    fully_shard(model, mesh=mesh.fsdp)
    rows = _this_ranks_rows(mesh)
    normalizer = GroupingNormalizer(
        None, len(rows), dp_group=groups[group_name], units=PreShiftedTokens()
    )
    (window,) = normalizer.windows([_collate([row]) for row in rows])
    for micro_batch in window.micro_batches_to_run():
        window.scale(_loss(model, micro_batch.batch), micro_batch).backward()
    grad = torch.cat([p.grad.full_tensor().reshape(-1).double() for p in model.parameters()])
    return {
        "rel_err": rel_err(grad, reference),
        "count": window.num_global_units,
        "full_count": full_count,
        "local_count": sum(mb.num_units for mb in window.micro_batches),
    }


def _run_count(tmp_path: Path, shape: tuple[int, ...], group_name: str) -> list[dict]:
    return run_on_ranks(_count_worker, (shape, group_name), tmp_path, world_size=4)


HSDP = (2, 2, 1, 1)  # dp_replicate 2 x dp_shard 2
TP = (1, 2, 1, 2)  # dp_shard 2 x tp 2: ranks of a tp group hold the same rows
CP = (1, 2, 2, 1)  # dp_shard 2 x cp 2: ranks of a cp group hold halves of the same rows


@pytest.mark.parametrize(("name", "shape"), [("hsdp", HSDP), ("tp", TP), ("cp", CP)])
def test_the_count_group_gives_the_full_batch_gradient(tmp_path, name, shape) -> None:
    """Counting over dp_cp: the full-batch count on every rank, the full-batch gradient at the
    fp32 floor. Under cp each rank counts only its slice's tokens."""
    results = _run_count(tmp_path, shape, "dp_cp")
    print(f"{name} {shape}, count over dp_cp: relative error {results[0]['rel_err']:.3e}")
    for result in results:
        assert result["count"] == result["full_count"]
        assert result["rel_err"] <= EXACT_TOL
    if name == "cp":  # each cp pair's slices add up to its rows' count
        assert results[0]["local_count"] + results[1]["local_count"] < results[0]["full_count"]
        assert sum(r["local_count"] for r in results) == results[0]["full_count"]


@pytest.mark.parametrize(("name", "shape", "wrong"), [("hsdp", HSDP, "dp_shard"), ("cp", CP, "dp")])
def test_a_group_that_leaves_out_a_token_axis_moves_far_off(tmp_path, name, shape, wrong):
    """Counting over dp_shard alone under HSDP, or over dp alone under cp: the count misses
    ranks with other tokens, and the factor misses ranks FSDP means over; the gradient moves
    far above the floor."""
    results = _run_count(tmp_path, shape, wrong)
    print(f"{name} {shape}, count over {wrong}: relative error {results[0]['rel_err']:.3e}")
    assert all(result["rel_err"] > FAR for result in results)


def test_a_group_with_tensor_parallel_ranks_counts_every_unit_twice(tmp_path) -> None:
    """Counting over dp x tp: the ranks of a tp group hold the same tokens, so each is counted
    tp times (the logged count, and any sum over the window); the gradient's factor, the
    group's size, happens to double too and cancel it."""
    results = _run_count(tmp_path, TP, "world")
    print(f"tp {TP}, count over dp x tp: {results[0]['count']} for {results[0]['full_count']}")
    assert all(result["count"] == 2 * result["full_count"] for result in results)


def test_the_step_cuts_micro_batches_over_the_runtimes_cp_axis_and_only_with_one() -> None:
    """The normaliser and the step take the cp axis from the runtime, never from a recipe: a
    copy cannot count shards that its step does not cut, or the other way round."""
    from dataclasses import replace

    from exactga.runtime.precision import Precision
    from exactga.runtime.runtime import Runtime
    from exactga.wiring.run_start import _step_context

    cpu = torch.device("cpu")
    precision = Precision.from_config(torch.float32, "none", cpu)
    one_device = Runtime(device=cpu, precision=precision, seed=0, notes=())
    assert one_device.cp_mesh is None
    assert _step_context(one_device, nn.Linear(2, 2), None).cp_mesh is None

    class Mesh(dict):  # the two axes a runtime reads, without a process group
        pass

    mesh = Mesh(cp="the cp axis", dp="the dp axis")
    sharded = replace(one_device, mesh=mesh, context_parallel_dim=2, gradient_sync="sync")
    assert sharded.cp_mesh == "the cp axis"
    assert _step_context(sharded, nn.Linear(2, 2), None).cp_mesh == "the cp axis"
    assert replace(sharded, context_parallel_dim=1).cp_mesh is None
