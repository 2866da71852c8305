"""``precompute_reference_logprobs``: every pair's reference log-probs computed once before
training, then looked up; see [precomputed reference] in exactga.dpo.reference_logprobs. In-process
on test_preference's pairs and models, against its fp64 oracle, on one rank and on 2 gloo
ranks with a sharded reference."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from test_preference import PAIRS, Case, _is_layer
from torchtune.training import shard_model
from unit_utils import run_on_ranks

from exactga.dpo.loss import dpo_micro_batch_loss
from exactga.dpo.preference import PreferencePairs, collate_pairs
from exactga.dpo.reference_logprobs import (
    PAIR_INDEX,
    IndexedPairs,
    ReferenceTable,
    precompute_reference,
    with_precomputed_reference,
)

# The module's cases are made once, on one worker (they cost an fp64 oracle each).
pytestmark = pytest.mark.xdist_group("reference_logprobs")

# fp32 forwards summed in fp64: a reference sum of ~-900 nats lands within ~1e-4 of the fp64
# oracle's, whatever the grouping (measured 1.5e-5 at most).
ABS = 2e-4


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    """One case of each kind for the module: nothing here trains or changes a model."""
    return {kind: Case(kind) for kind in ("lora", "full")}


def _table(case: Case, batch_size: int, dp_group=None) -> ReferenceTable:
    return precompute_reference(
        case.reference(),
        PAIRS,
        collate=collate_pairs,
        batch_size=batch_size,
        device=torch.device("cpu"),
        dp_group=dp_group,
    )


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_table_holds_every_pairs_reference_log_probs(cases, kind: str, batch_size: int):
    case = cases[kind]
    table = _table(case, batch_size)
    assert table.table.shape == (len(PAIRS), 2) and table.table.dtype == torch.float64
    assert table.table == pytest.approx(case.ref_log_probs, abs=ABS)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_step_on_looked_up_log_probs_is_the_step_on_live_ones(cases, kind: str) -> None:
    case = cases[kind]
    table, indexed = with_precomputed_reference(
        case.reference(), PAIRS, collate=collate_pairs, batch_size=4, device=torch.device("cpu")
    )
    group = [5, 0, 3]
    looked_up = collate_pairs([indexed[i] for i in group])
    assert looked_up[PAIR_INDEX].tolist() == group
    live = collate_pairs([PAIRS[i] for i in group])
    loss_looked_up = dpo_micro_batch_loss(case.model, case.loss_fn, looked_up, table)
    loss_live = dpo_micro_batch_loss(case.model, case.loss_fn, live, case.reference())
    assert loss_looked_up.main.item() == pytest.approx(loss_live.main.item(), rel=1e-6)
    assert PAIR_INDEX not in looked_up  # popped before the policy's forward


def test_an_emptied_filler_looks_up_its_one_pair(cases) -> None:
    case = cases["lora"]
    table = _table(case, 4)
    units = PreferencePairs()
    batch = collate_pairs([IndexedPairs(PAIRS)[i] for i in (2, 6)])
    emptied = units.emptied(batch)
    assert emptied[PAIR_INDEX].tolist() == [6] and units.count(emptied) == 0
    loss = dpo_micro_batch_loss(case.model, case.loss_fn, units.prepare(emptied, 0, True), table)
    assert torch.isfinite(loss.main)


def test_a_table_without_the_pairs_indices_is_refused(cases) -> None:
    case = cases["full"]
    with pytest.raises(ValueError, match="pairs' indices"):
        dpo_micro_batch_loss(case.model, case.loss_fn, collate_pairs(PAIRS[:2]), _table(case, 8))


def _two_rank_worker(rank: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    tables = {}
    for kind in ("full", "lora"):
        case = Case(kind)
        for model in (case.model, case.ref_model):
            if model is not None:
                shard_model(model, [_is_layer], cpu_offload=False, reshard_after_forward=True)
        # 8 pairs, 4 a rank, 3 a micro-batch: 2 micro-batches each (the second short).
        tables[kind] = _table(case, 3, dp_group=dist.group.WORLD).table.tolist()
        tables[f"{kind}_oracle"] = case.ref_log_probs.tolist()
    return tables


def test_two_ranks_share_one_table_of_every_pair(tmp_path) -> None:
    first, second = run_on_ranks(_two_rank_worker, (), tmp_path)
    for kind in ("full", "lora"):
        assert first[kind] == second[kind]  # gathered: the same table on every rank
        oracle = torch.tensor(first[f"{kind}_oracle"])
        assert torch.tensor(first[kind]) == pytest.approx(oracle, abs=ABS)


def test_ranks_with_unequal_shares_run_as_many_micro_batches(monkeypatch) -> None:
    """7 pairs on 2 ranks, 2 a micro-batch: rank 1 holds 3 pairs (2 micro-batches) and rank 0 4
    (2); with 3 a micro-batch rank 1 has one and repeats it, so FSDP's collectives pair up."""
    calls = []

    def reference(inputs, positions, targets):
        calls.append(inputs["tokens"].size(0) // 2)
        return torch.zeros(calls[-1]), torch.zeros(calls[-1])

    class Group:
        def size(self) -> int:
            return 2

    monkeypatch.setattr("torch.distributed.get_rank", lambda group: 1)
    monkeypatch.setattr("torch.distributed.all_gather", _fake_gather)
    precompute_reference(
        reference,
        PAIRS[:7],
        collate=partial(collate_pairs),
        batch_size=3,
        device=torch.device("cpu"),
        dp_group=Group(),
    )
    assert calls == [3, 3]  # rank 1's 3 pairs once, then again to match rank 0's 2


def _fake_gather(gathered, padded, group) -> None:
    """Rank 0's rows (pairs 0, 2, 4, 6) and this rank's."""
    other = padded.new_full(padded.shape, -1.0)
    other[:4, 0] = torch.tensor([0.0, 2.0, 4.0, 6.0])
    gathered[0].copy_(other)
    gathered[1].copy_(padded)


def test_the_table_is_the_same_bit_for_bit_when_computed_again(cases) -> None:
    """What a resumed run relies on: its pre-pass recomputes the uninterrupted run's table."""
    case = cases["full"]
    assert torch.equal(_table(case, 3).table, _table(case, 3).table)
