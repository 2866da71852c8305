"""A micro-batch under context parallelism (exactga.runtime.context_parallel), on CPU.

torch's ring attention has no CPU kernel, so attention itself runs under CP only on CUDA
(tests/gpu/test_gpu_context_parallel.py). What decides the numbers is tested here: the shards
(torch's head-tail order, reassembling to the batch), each rank's count of its shard's shifted
labels (summing to the full count), and a window of a model without attention across positions
trained on two gloo ranks through torch's real ``context_parallel`` and the real step, whose
gradient is the full-batch gradient at the fp32 floor. See [loss tokens under context
parallelism].
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from grouping import GroupingNormalizer
from torch import nn
from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer
from unit_utils import VOCAB, collate, make_rows

from exactga.accumulation.loss_units import (
    IGNORE_INDEX,
    LOSS_POSITIONS,
    ContextParallelTokens,
    ShiftedTokens,
    context_parallel_units,
    count_loss_tokens,
    count_unshifted_tokens,
)
from exactga.runtime.context_parallel import (
    INPUT_POS,
    SHIFTED_LABELS,
    shard,
    shard_positions,
    sharded_micro_batch,
)
from exactga.sft.loss import mean_token_loss
from exactga.sft.router_balance import RouterMicroBatches

WIDTH = 40  # every micro-batch padded to it: a multiple of 2 * cp for cp = 2 and 4


class PerTokenLM(nn.Module):
    """Logits of each position from its token and its position alone: no attention, so a
    shard's forward is exactly the full forward's rows, and ``input_pos`` must be right."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, 16)
        self.pos = nn.Embedding(WIDTH, 16)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        if input_pos is None:
            input_pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        return self.out(torch.tanh(self.tok(tokens) + self.pos(input_pos)))


class StandInMesh:
    """What the units and the context read of a cp mesh, for refusals that need no group."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def _padded(batch: dict[str, torch.Tensor], width: int = WIDTH) -> dict[str, torch.Tensor]:
    pad = width - batch["tokens"].shape[1]
    return {
        "tokens": nn.functional.pad(batch["tokens"], (0, pad)),
        "labels": nn.functional.pad(batch["labels"], (0, pad), value=IGNORE_INDEX),
    }


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    """make_rows' eight rows two at a time (the first label unmasked, a fully masked row), and
    one short row whose loss tokens all lie in cp rank 0's first chunk: rank 1's shard of it
    has none."""
    rows = make_rows()
    batches = [collate(rows[i : i + 2]) for i in range(0, len(rows), 2)]
    tokens = torch.arange(1, 6)
    batches.append(collate([(tokens, tokens.clone())]))
    return [_padded(batch) for batch in batches]


def _own_shard(batch: dict[str, torch.Tensor], cp: int, rank: int) -> dict[str, torch.Tensor]:
    """A prepared batch cut as the device cuts it (what torch's context_parallel does)."""
    keys = ("tokens", INPUT_POS, SHIFTED_LABELS)
    return {k: shard(v, cp, rank) if k in keys else v for k, v in batch.items()}


@pytest.mark.parametrize("cp", [2, 4])
def test_the_shards_are_torchs_head_tail_order_and_reassemble_the_batch(cp: int) -> None:
    tokens = torch.arange(3 * WIDTH).reshape(3, WIDTH)
    positions = [shard_positions(WIDTH, cp, rank) for rank in range(cp)]
    assert torch.equal(
        torch.cat(positions), _HeadTailLoadBalancer(WIDTH, cp, "cpu")._generate_indices()[0]
    )
    joined = torch.cat([shard(tokens, cp, rank) for rank in range(cp)], dim=1)
    assert torch.equal(joined[:, torch.cat(positions).argsort()], tokens)
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ranks_shifted_label_counts_sum_to_the_full_count(cp: int) -> None:
    loss_fn = nn.CrossEntropyLoss()
    for batch in _micro_batches():
        counts = [ContextParallelTokens(loss_fn, cp, rank).count(batch) for rank in range(cp)]
        assert sum(counts) == count_loss_tokens(batch["labels"])
        unshifted = [
            ContextParallelTokens(loss_fn, cp, r).count_unshifted(batch) for r in range(cp)
        ]
        assert sum(unshifted) == count_unshifted_tokens(batch["labels"])  # post_scale's
    short = _micro_batches()[-1]
    assert [ContextParallelTokens(loss_fn, 2, rank).count(short) for rank in (0, 1)] == [4, 0]


@pytest.mark.parametrize("cp", [2, 4])
def test_the_shards_mean_losses_weighed_by_their_counts_give_the_full_batch_mean(cp: int) -> None:
    """The real loss step on each shard, each mean weighed by ``u_r / U``: the full-batch mean
    over every loss token (its logits and gradient rows are the full forward's)."""
    model, loss_fn = PerTokenLM(), nn.CrossEntropyLoss()
    for batch in _micro_batches()[:-1]:  # every one with loss tokens on every cp rank
        full = mean_token_loss(model, loss_fn, dict(batch))
        total = count_loss_tokens(batch["labels"])
        weighed = torch.zeros(())
        for rank in range(cp):
            units = ContextParallelTokens(loss_fn, cp, rank)
            count = units.count(batch)
            prepared = _own_shard(units.prepare(batch, count, runs_empty=False), cp, rank)
            if count:
                weighed = weighed + mean_token_loss(model, loss_fn, prepared) * count / total
        assert torch.allclose(weighed, full, rtol=1e-6, atol=0), (weighed - full).item()  # ulps


def test_an_empty_shard_is_planted_inside_itself_and_its_loss_stays_finite() -> None:
    loss_fn = nn.CrossEntropyLoss()
    short = _micro_batches()[-1]
    units = ContextParallelTokens(loss_fn, 2, 1)
    prepared = units.prepare(short, units.count(short), runs_empty=True)
    own = _own_shard(prepared, 2, 1)
    assert int((own[SHIFTED_LABELS] != IGNORE_INDEX).sum()) == 1  # planted in rank 1's shard
    assert torch.isfinite(mean_token_loss(PerTokenLM(), loss_fn, own))
    assert torch.equal(short["labels"], _micro_batches()[-1]["labels"])  # the host copy as it was


def test_a_prepared_batch_indexes_the_loss_positions_of_its_shard() -> None:
    loss_fn = nn.CrossEntropyLoss()
    batch = _micro_batches()[0]
    units = ContextParallelTokens(loss_fn, 2, 1)
    prepared = units.prepare(batch, units.count(batch), runs_empty=False)
    own = _own_shard(prepared, 2, 1)
    scored = (own[SHIFTED_LABELS] != IGNORE_INDEX).reshape(-1).nonzero().squeeze(1)
    assert torch.equal(prepared[LOSS_POSITIONS], scored)
    assert torch.equal(prepared[INPUT_POS][0], torch.arange(WIDTH))
    emptied = units.emptied(prepared)  # a filler: counted and prepared again from its labels
    assert SHIFTED_LABELS not in emptied and units.count(emptied) == 0


def test_what_ring_attention_cannot_compute_is_refused() -> None:
    loss_fn = nn.CrossEntropyLoss()
    batch = _micro_batches()[0]
    with pytest.raises(ValueError, match="causal attention only"):
        ContextParallelTokens(loss_fn, 2, 0).count({**batch, "mask": torch.ones(2, 40, 40)})
    with pytest.raises(ValueError, match="pad them to a multiple of 8"):
        ContextParallelTokens(loss_fn, 4, 0).count(_padded(collate(make_rows()[:2]), 44))
    with pytest.raises(ValueError, match="RouterMicroBatches"):
        context_parallel_units(RouterMicroBatches(loss_fn), StandInMesh(2))
    with (
        pytest.raises(ValueError, match="not counted by its shards"),
        sharded_micro_batch(StandInMesh(2), batch),
    ):
        pass
    prepared = ContextParallelTokens(loss_fn, 2, 0).prepare(batch, 1, runs_empty=False)
    with pytest.raises(ValueError, match="without a cp mesh"), sharded_micro_batch(None, prepared):
        pass


def test_without_a_cp_mesh_nothing_changes() -> None:
    units = ShiftedTokens(nn.CrossEntropyLoss())
    assert context_parallel_units(units, None) is units
    assert context_parallel_units(units, StandInMesh(1)) is units
    batch = _micro_batches()[0]
    with sharded_micro_batch(None, batch):
        assert batch["tokens"].shape == (2, WIDTH)


# --- two gloo ranks: torch's context_parallel and the real step ---------------------------------


def _torch_cuts_as_we_do(rank: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    units = ContextParallelTokens(nn.CrossEntropyLoss(), 2, rank)
    batch = _micro_batches()[0]
    prepared = units.prepare(batch, units.count(batch), runs_empty=False)
    expected = _own_shard(prepared, 2, rank)
    full = {k: v.clone() for k, v in prepared.items()}
    with sharded_micro_batch(mesh["cp"], prepared):
        cut = all(torch.equal(prepared[k], expected[k]) for k in expected)
    restored = all(torch.equal(prepared[k], full[k]) for k in full)
    return cut and restored


def test_torchs_context_parallel_cuts_the_batch_as_the_count_does(two_ranks) -> None:
    assert two_ranks(_torch_cuts_as_we_do) == [True, True]


def _window_gradient_error(rank: int) -> dict[str, float]:
    """One window of five micro-batches on two cp ranks (dp = 1): the real units, step and
    context; the gradients then averaged over the ranks, as FSDP's reduction over dp x cp does.
    Compared with the full-batch gradient of the mean over every loss token."""
    from torch.distributed.device_mesh import init_device_mesh

    from exactga.accumulation.step import StepContext, TrainingWindow
    from exactga.config.profiler import ProfilerSettings
    from exactga.profiling import TrainingProfiler

    torch.set_num_threads(1)
    cp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"]
    model, loss_fn, cpu = PerTokenLM(), nn.CrossEntropyLoss(), torch.device("cpu")
    batches = _micro_batches()
    units = context_parallel_units(ShiftedTokens(loss_fn), cp_mesh)
    normalizer = GroupingNormalizer(
        loss_fn, len(batches), dp_group=cp_mesh.get_group(), units=units
    )
    profiler = TrainingProfiler(
        ProfilerSettings(log_timings=False, saved_latency_every_n_steps=0), cpu, model
    )
    context = StepContext(model, cpu, profiler, cp_mesh=cp_mesh)
    (window,) = [TrainingWindow(w, context, 1) for w in normalizer.windows(batches)]
    for batch in window:
        window.backward(mean_token_loss(model, loss_fn, batch))
    nonfinite = window.step(None).nonfinite  # an empty shard's loss kept finite
    grads = [p.grad.clone() for p in model.parameters()]
    for grad in grads:
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)

    reference = PerTokenLM()
    total = sum(count_loss_tokens(b["labels"]) for b in batches)
    summed = nn.CrossEntropyLoss(reduction="sum")
    loss = sum(summed(reference(b["tokens"]).flatten(0, 1), _shifted(b).flatten()) for b in batches)
    (loss / total).backward()
    errors = [
        float((g - p.grad).abs().max() / p.grad.abs().max())
        for g, p in zip(grads, reference.parameters(), strict=True)
    ]
    return {"grad_rel_err": max(errors), "units": window.num_global_units, "nonfinite": nonfinite}


def _shifted(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from exactga.accumulation.loss_units import shift_labels

    return shift_labels(batch["labels"])


def test_two_cp_ranks_train_the_full_batch_gradient(two_ranks) -> None:
    results = two_ranks(_window_gradient_error)
    total = sum(count_loss_tokens(b["labels"]) for b in _micro_batches())
    for result in results:
        assert result["units"] == total and not result["nonfinite"]
        assert result["grad_rel_err"] < 1e-6, result
