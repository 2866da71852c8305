"""Validation of a preference run (exactga.dpo.validation), in-process on tiny torchtune models.

``val/loss`` (the per-pair loss over every pair / their number), ``val/rewards/accuracy`` (a
count of pairs over their number) and the reward means must equal the fp64 oracle of
tests/test_preference.py (each sequence on its own; the LoRA policy's reference its base
weights, full DPO's a frozen model of other weights) for any ``batch_size_val``, on one process
and on 2 gloo ranks under FSDP2 (a rank with fewer pairs runs an emptied filler); a mean of each
batch's loss and of each batch's accuracy must miss them, so the comparison can fail. KTO's
loss over every example against the set's one reference point must equal tests/test_kto.py's
oracle, on 2 ranks too, where a reference point per batch does not.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from test_preference import BETA, PAIRS, Case, oracle_pair_losses

from exactga.dpo.log_probs import frozen_model_reference
from exactga.dpo.preference import PreferencePairs, collate_pairs
from exactga.dpo.validation import PreferenceValidationLoss, preference_validation_loss
from exactga.validation.held_out import ValidationSet

CPU = torch.device("cpu")
LOSS_TOL = 1e-6  # relative, fp32 against the fp64 oracle
REWARD_TOL = 1e-6  # absolute: rewards are beta x log-prob differences, near 0


def _validation_set(pairs: list, batch_size: int, num_replicas: int = 1, rank: int = 0):
    return ValidationSet(
        pairs,
        batch_size=batch_size,
        collate=partial(collate_pairs, padding_idx=0),
        num_replicas=num_replicas,
        rank=rank,
        emptied=PreferencePairs().emptied,
        dp_group=dist.group.WORLD if num_replicas > 1 else None,
    )


def _oracle(case: Case, pairs: slice = slice(None)) -> dict[str, float]:
    """The figures of ``pairs`` of PAIRS as one batch, from the oracle's fp64 log-probs."""
    policy, reference = case.log_probs[pairs], case.ref_log_probs[pairs]
    chosen = BETA * (policy[:, 0] - reference[:, 0])
    rejected = BETA * (policy[:, 1] - reference[:, 1])
    return {
        "loss": float(oracle_pair_losses(policy, reference, "dpo").mean()),
        "num_correct": int((chosen > rejected).sum()),
        "num_pairs": len(policy),
        "margin": float((chosen - rejected).mean()),
        "chosen": float(chosen.mean()),
        "rejected": float(rejected.mean()),
    }


def _check(figure, oracle: dict[str, float]) -> float:
    """``figure`` against ``oracle``; returns the loss's relative difference."""
    rel = abs(figure.loss - oracle["loss"]) / oracle["loss"]
    assert rel <= LOSS_TOL, (figure.loss, oracle["loss"])
    assert figure.num_pairs == oracle["num_pairs"]
    assert figure.num_correct == oracle["num_correct"]
    assert figure.accuracy == oracle["num_correct"] / oracle["num_pairs"]
    assert abs(figure.margin - oracle["margin"]) <= REWARD_TOL
    assert abs(figure.chosen_reward - oracle["chosen"]) <= REWARD_TOL
    assert abs(figure.rejected_reward - oracle["rejected"]) <= REWARD_TOL
    return rel


@pytest.fixture(scope="module", params=["lora", "full"])
def case(request) -> Case:
    return Case(request.param)


@pytest.mark.parametrize("batch_size", [1, 3, len(PAIRS)])
def test_preference_figures_are_the_full_set_figures(case: Case, batch_size: int) -> None:
    figure = preference_validation_loss(
        case.model, case.loss_fn, _validation_set(PAIRS, batch_size), case.reference(), device=CPU
    )
    rel = _check(figure, _oracle(case))
    print(f"{case.kind} bs {batch_size}: {figure.line(0)}; loss relative to the oracle {rel:.1e}")
    assert set(figure.metrics()) == {
        "val/loss",
        "val/rewards/accuracy",
        "val/rewards/margins",
        "val/rewards/chosen",
        "val/rewards/rejected",
    }
    assert case.model.training  # its own mode back


def test_means_of_batch_means_miss_them() -> None:
    """At batch size 3 (batches of 3, 3 and 2 pairs) the mean of the batches' losses and the
    mean of the batches' accuracies are not the set's: the count over all pairs is."""
    case = Case("full")
    figure = preference_validation_loss(
        case.model, case.loss_fn, _validation_set(PAIRS, 3), case.reference(), device=CPU
    )
    full = _oracle(case)
    batches = [_oracle(case, slice(start, start + 3)) for start in range(0, len(PAIRS), 3)]
    mean_loss = sum(batch["loss"] for batch in batches) / len(batches)
    mean_accuracy = sum(b["num_correct"] / b["num_pairs"] for b in batches) / len(batches)
    accuracy = full["num_correct"] / full["num_pairs"]
    print(
        f"loss: ours {figure.loss!r}, oracle {full['loss']!r}, mean of batch means {mean_loss!r}; "
        f"accuracy: ours {figure.accuracy!r} ({figure.num_correct} of {figure.num_pairs}), "
        f"mean of batch accuracies {mean_accuracy!r}"
    )
    assert abs(mean_loss - full["loss"]) / full["loss"] > 1000 * LOSS_TOL
    assert figure.accuracy == accuracy and abs(mean_accuracy - accuracy) > 1e-3


def _two_rank_worker(rank: int) -> list[dict]:
    """Seven pairs (4 and 3 on the two ranks) at ``batch_size_val`` 1 and 3, the policy and the
    frozen reference sharded with FSDP2 over both ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    case = Case("full")
    mesh = init_device_mesh("cpu", (2,))
    for model in (case.model, case.ref_model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    results = []
    for batch_size in (1, 3):
        validation_set = _validation_set(PAIRS[:7], batch_size, num_replicas=2, rank=rank)
        figure = preference_validation_loss(
            case.model,
            case.loss_fn,
            validation_set,
            case.reference(),
            device=CPU,
        )
        results.append(
            {"batch_size": batch_size, "figure": vars(figure), "own": validation_set.indices}
        )
    return results


def test_two_ranks_give_the_full_set_figures(two_ranks) -> None:
    oracle = _oracle(Case("full"), slice(0, 7))
    for rank, results in enumerate(two_ranks(_two_rank_worker)):
        for result in results:
            assert len(result["own"]) == [4, 3][rank]  # rank 1 runs a filler at size 1
            rel = _check(PreferenceValidationLoss(**result["figure"]), oracle)
            print(f"2 ranks, rank {rank}, bs {result['batch_size']}: loss relative {rel:.1e}")


@pytest.mark.parametrize("batch_size", [1, 3])
def test_kto_is_the_full_set_loss_against_the_sets_reference_point(batch_size: int) -> None:
    """KTO over all 8 examples of tests/test_kto.py against their one z, as its fp64 oracle;
    a z per validation batch of 3 (TRL's per-device estimate) gives another loss."""
    import test_kto

    case = test_kto.Case()
    validation_set = ValidationSet(
        test_kto.EXAMPLES,
        batch_size=batch_size,
        collate=partial(collate_pairs, padding_idx=0),
        emptied=case.terms.units().emptied,
    )
    figure = preference_validation_loss(
        case.model,
        case.loss_fn,
        validation_set,
        frozen_model_reference(case.ref_model),
        terms=case.terms,
        device=CPU,
    )
    rel = abs(figure.loss - case.oracle_loss) / case.oracle_loss
    batches = [list(range(i, min(i + 3, len(test_kto.EXAMPLES)))) for i in range(0, 8, 3)]
    per_batch = test_kto.Case(wrong_groups=batches).oracle_loss
    print(
        f"KTO bs {batch_size}: {figure.line(0)}; loss relative to the oracle {rel:.1e}, z "
        f"{figure.kl!r} (oracle {case.oracle_z!r}); a z per batch of 3: {per_batch!r}"
    )
    assert rel <= 2e-6 and figure.num_examples == len(test_kto.EXAMPLES)
    assert figure.kl == pytest.approx(case.oracle_z, rel=1e-5, abs=1e-6)
    assert abs(per_batch - case.oracle_loss) / case.oracle_loss > 1e-3
    assert set(figure.metrics()) == {"val/loss", "val/kl"}


def _kto_two_rank_worker(rank: int) -> list[dict]:
    """7 KTO examples (4 and 3: batches of 3 and 1, and 3 and a filler) at ``batch_size_val``
    3, both models sharded with FSDP2 over both ranks."""
    import test_kto
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    case = test_kto.Case()
    mesh = init_device_mesh("cpu", (2,))
    for model in (case.model, case.ref_model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    validation_set = ValidationSet(
        test_kto.EXAMPLES[:7],
        batch_size=3,
        collate=partial(collate_pairs, padding_idx=0),
        num_replicas=2,
        rank=rank,
        emptied=case.terms.units().emptied,
        dp_group=dist.group.WORLD,
    )
    figure = preference_validation_loss(
        case.model,
        case.loss_fn,
        validation_set,
        frozen_model_reference(case.ref_model),
        terms=case.terms,
        device=CPU,
    )
    return [vars(figure)]


def test_kto_on_two_ranks_is_the_one_process_figure(two_ranks) -> None:
    import test_kto

    case = test_kto.Case()
    one = preference_validation_loss(
        case.model,
        case.loss_fn,
        ValidationSet(
            test_kto.EXAMPLES[:7], batch_size=7, collate=partial(collate_pairs, padding_idx=0)
        ),
        frozen_model_reference(case.ref_model),
        terms=case.terms,
        device=CPU,
    )
    for rank, (figure,) in enumerate(two_ranks(_kto_two_rank_worker)):
        print(f"KTO 2 ranks, rank {rank}: loss {figure['loss']!r} z {figure['kl']!r}; one {one}")
        assert figure["num_examples"] == 7
        assert figure["loss"] == pytest.approx(one.loss, rel=1e-6)
        assert figure["kl"] == pytest.approx(one.kl, rel=1e-6)
