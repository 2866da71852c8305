"""Rollouts that do not depend on the rank layout (exactga.generation.sampling).

A group's completions must be a function of (seed, step, prompt index, sample index) and the
weights: the same whether the group is generated alone, after others or in another order, with
early stop or at full length and cut on the host, and on 2 gloo ranks under FSDP2 (where the
ranks' groups would stop after different numbers of forwards) exactly what one unsharded
process generates. The KV cache is checked against torchtune's generate without one. See
[rollouts independent of the rank layout].
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtune.generation import generate
from torchtune.training import shard_model
from unit_utils import run_on_ranks, tiny_model

from exactga.accumulation.loss_units import IGNORE_INDEX, shift_labels
from exactga.generation.sampling import (
    RolloutGroup,
    SamplingSettings,
    check_prompt,
    generate_group,
    rollout_seed,
)
from exactga.grpo.policy import collate_rollouts

CPU = torch.device("cpu")
SEED, NUM_SAMPLES, MAX_GENERATED = 7, 4, 12
# 8 of the 64 ids: a completion stops after 1 to 12 tokens, or runs to the end.
STOPS = tuple(range(0, 64, 8))
SAMPLING = SamplingSettings(max_generated_tokens=MAX_GENERATED, stop_tokens=STOPS)
# Lengths 1, 3, 7 and 12. With SEED at step 0 the groups of prompts 1 and 3 all stop before
# MAX_GENERATED (after 9 and 10 forwards on the machine this was written on), those of 0 and 2
# do not; the tests read the counts rather than assume them (see early_forwards).
PROMPTS = [
    [5],
    [3, 9, 27],
    [11, 2, 40, 33, 7, 19, 8],
    [60, 1, 2, 3, 50, 51, 52, 9, 10, 44, 45, 46],
]


def sampling_model() -> nn.Module:
    """The toy llama3_2 with its own output projection, scaled so the next-token distribution
    is peaked (entropy 2.2 nats of a possible 4.2): the model's logits, not only the random
    draws, decide the tokens, so a wrong cache or a wrong prompt changes the completions."""
    model = tiny_model(tie_word_embeddings=False)
    with torch.no_grad():
        model.output.weight.mul_(4.0)
    return model


def group(
    model: nn.Module,
    prompt_index: int,
    *,
    step: int = 0,
    run_full_length: bool = False,
    sampling: SamplingSettings = SAMPLING,
) -> RolloutGroup:
    return generate_group(
        model,
        PROMPTS[prompt_index],
        num_samples=NUM_SAMPLES,
        sampling=sampling,
        seed=SEED,
        step=step,
        prompt_index=prompt_index,
        run_full_length=run_full_length,
        device=CPU,
    )


def completions(rollouts: list[dict]) -> list[list[int]]:
    return [r["completion"] for r in rollouts]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is faster, and does not fight a suite run beside it."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def alone() -> dict[int, RolloutGroup]:
    """Each group generated alone, on a fresh model, with early stop: the reference."""
    return {index: group(sampling_model(), index) for index in range(len(PROMPTS))}


@pytest.fixture(scope="module")
def early_forwards() -> list[int]:
    """The forwards each group takes with early stop, generated alone; some fewer than
    MAX_GENERATED, or the early-stop and FSDP tests would show nothing."""
    counts = []
    for index in range(len(PROMPTS)):
        model = sampling_model()
        calls = _count_forwards(model)
        group(model, index)
        counts.append(calls[0])
    print(f"forwards with early stop, per prompt: {counts}")
    assert min(counts) < MAX_GENERATED, "no group stops early: pick other STOPS or SEED"
    return counts


# --- (a) the same group whatever else is generated ---------------------------------------------


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0], [1, 3, 1]])
def test_a_group_is_the_same_alone_after_other_groups_and_in_any_batch(alone, order) -> None:
    """One model generating several groups in turn, in several orders and numbers (one
    twice), gives each group what it gives alone, bit for bit."""
    model = sampling_model()
    for index in order:
        assert group(model, index).rollouts == alone[index].rollouts, index


def test_rollouts_are_ready_for_collate_rollouts(alone) -> None:
    """Prompt then completion; after the shift exactly the completion tokens are scored;
    ``stopped`` says the completion ends with its one stop token."""
    rollouts = [r for index in range(len(PROMPTS)) for r in alone[index].rollouts]
    for r in rollouts:
        prompt, completion = PROMPTS[r["prompt_index"]], r["completion"]
        assert r["tokens"] == prompt + completion
        assert r["labels"] == [IGNORE_INDEX] * len(prompt) + completion
        assert 1 <= len(completion) <= MAX_GENERATED
        assert [t in STOPS for t in completion].count(True) == int(r["stopped"])
        assert r["stopped"] == (completion[-1] in STOPS)
    assert [r["sample_index"] for r in alone[2].rollouts] == list(range(NUM_SAMPLES))
    assert {r["stopped"] for r in rollouts} == {True, False}  # both kinds occur here
    batch = collate_rollouts([{**r, "advantage": 0.0} for r in rollouts])
    scored = shift_labels(batch["labels"]) != IGNORE_INDEX
    assert scored.sum(dim=1).tolist() == [len(r["completion"]) for r in rollouts]
    targets = shift_labels(batch["labels"])[scored]
    assert targets.tolist() == [t for r in rollouts for t in r["completion"]]


def test_the_model_is_left_as_it_was() -> None:
    """Training flags back (one submodule in eval stays so), no KV cache left."""
    model = sampling_model()
    model.train()
    model.layers[1].eval()
    group(model, 1)
    assert model.training and model.layers[0].training and not model.layers[1].training
    assert not model.caches_are_setup()


# --- (b) the seed of a group -------------------------------------------------------------------


def test_step_and_prompt_index_change_the_completions_and_the_samples_differ(alone) -> None:
    """The same prompt at another step, or under another index, is another draw; the samples
    of one group are not copies of each other."""
    model = sampling_model()
    other_step = group(model, 0, step=1).rollouts
    other_index = generate_group(
        model,
        PROMPTS[0],
        num_samples=NUM_SAMPLES,
        sampling=SAMPLING,
        seed=SEED,
        step=0,
        prompt_index=17,
        run_full_length=False,
        device=CPU,
    ).rollouts
    other_seed = generate_group(
        model,
        PROMPTS[0],
        num_samples=NUM_SAMPLES,
        sampling=SAMPLING,
        seed=SEED + 1,
        step=0,
        prompt_index=0,
        run_full_length=False,
        device=CPU,
    ).rollouts
    reference = completions(alone[0].rollouts)
    for other in (other_step, other_index, other_seed):
        assert completions(other) != reference
    for index in range(len(PROMPTS)):
        rows = completions(alone[index].rollouts)
        assert len({tuple(row) for row in rows}) > 1, index
    seeds = {rollout_seed(s, t, i) for s in (0, 1) for t in (0, 1) for i in (0, 1, 10)}
    assert len(seeds) == 12


def test_the_seed_is_the_same_in_every_process() -> None:
    """A fixed value (blake2b), where a hash salted per process (Python's ``hash`` of a str)
    would change from run to run; and always a valid ``manual_seed``."""
    assert rollout_seed(SEED, 3, 5) == 8747471978726154842
    assert 0 <= rollout_seed(2**40, 10**6, 10**9) < 2**63


# --- (c) early stop against full length and the cut on the host --------------------------------


def _count_forwards(model: nn.Module) -> list[int]:
    calls = [0]

    def count(module, args):
        calls[0] += 1

    model.register_forward_pre_hook(count)
    return calls


def test_full_length_and_the_host_cut_give_the_early_stop_completions(
    alone, early_forwards
) -> None:
    """Every group runs MAX_GENERATED forwards at full length, and the cut completions equal
    the early-stopping ones, where some groups stop sooner."""
    model = sampling_model()
    calls = _count_forwards(model)
    for index in range(len(PROMPTS)):
        before = calls[0]
        full = group(model, index, run_full_length=True)
        assert calls[0] - before == MAX_GENERATED
        assert full.num_generated_tokens == NUM_SAMPLES * MAX_GENERATED
        assert alone[index].num_generated_tokens == NUM_SAMPLES * early_forwards[index]
        assert full.rollouts == alone[index].rollouts, index


def test_without_stop_tokens_every_completion_is_full_length() -> None:
    no_stops = SamplingSettings(max_generated_tokens=5)
    rollouts = group(sampling_model(), 1, sampling=no_stops).rollouts
    assert [len(r["completion"]) for r in rollouts] == [5] * NUM_SAMPLES
    assert not any(r["stopped"] for r in rollouts)


# --- (d) the KV cache --------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [None, 5])
def test_cached_generation_is_torchtunes_generation_without_a_cache(top_k) -> None:
    """torchtune's generate without a KV cache (each step a forward over the whole sequence),
    handed the group's generator, samples the same tokens; row i is sample i."""
    sampling = SamplingSettings(max_generated_tokens=6, temperature=0.7, top_k=top_k)
    model = sampling_model()
    for index in (0, 3):
        cached = generate_group(
            model,
            PROMPTS[index],
            num_samples=NUM_SAMPLES,
            sampling=sampling,
            seed=SEED,
            step=2,
            prompt_index=index,
            run_full_length=True,
            device=CPU,
        )
        rng = torch.Generator().manual_seed(rollout_seed(SEED, 2, index))
        rows = torch.tensor([PROMPTS[index]] * NUM_SAMPLES)
        model.eval()
        uncached, _ = generate(
            model, rows, max_generated_tokens=6, pad_id=-1, temperature=0.7, top_k=top_k, rng=rng
        )
        assert completions(cached.rollouts) == uncached[:, len(PROMPTS[index]) :].tolist()


# --- (e) two ranks under FSDP2 -----------------------------------------------------------------


def _is_layer(name: str, module: nn.Module) -> bool:
    return name.startswith("layers.") and name.count(".") == 1


def _sharded_worker(rank: int, rank_prompts: list[list[int]]) -> dict[str, list[list[dict]]]:
    """The rank's groups, with the units resharded after each forward or kept unsharded
    (torchtune's ``fsdp_reshard_after_forward: False``): either way every parameter is sharded
    again afterwards, as the optimizer step needs."""
    torch.set_num_threads(1)
    results = {}
    for reshard_after_forward in (True, False):
        model = sampling_model()
        shard_model(
            model, [_is_layer], cpu_offload=False, reshard_after_forward=reshard_after_forward
        )
        model.train()
        groups = [group(model, index, run_full_length=True) for index in rank_prompts[rank]]
        assert model.training
        assert all(isinstance(p, DTensor) for p in model.parameters())
        results[str(reshard_after_forward)] = [g.rollouts for g in groups]
    return results


def test_two_sharded_ranks_generate_what_one_unsharded_process_does(
    alone, early_forwards, tmp_path
) -> None:
    """Each rank generates its own prompts at full length under FSDP2: no rank waits on
    another, though with early stop their groups would take different numbers of forwards,
    and each group is what one unsharded process generates for it with early stop."""
    # The groups that stop soonest on rank 1 (shortest first), the others on rank 0.
    by_forwards = sorted(range(len(PROMPTS)), key=lambda i: early_forwards[i])
    rank_prompts = [by_forwards[2:], by_forwards[:2]]
    totals = [sum(early_forwards[i] for i in prompts) for prompts in rank_prompts]
    print(f"prompts per rank {rank_prompts}: {totals} forwards with early stop")
    assert totals[0] != totals[1]  # what would hang without run_full_length
    results = run_on_ranks(_sharded_worker, (rank_prompts,), tmp_path)
    for rank, prompts in enumerate(rank_prompts):
        for reshard_after_forward, groups in results[rank].items():
            for index, rollouts in zip(prompts, groups, strict=True):
                assert rollouts == alone[index].rollouts, (rank, reshard_after_forward, index)


# --- (f) bad input -----------------------------------------------------------------------------


def test_a_prompt_too_long_for_the_model_is_named_with_the_fixes() -> None:
    model = sampling_model()  # max_seq_len 64
    with pytest.raises(ValueError) as error:
        check_prompt(model, [1] * 60, prompt_index=3, max_generated_tokens=5)
    message = str(error.value)
    print(message)
    for part in ("prompt 3", "60 tokens", "max_generated_tokens=5", "max_seq_len=64"):
        assert part in message
    for fix in ("Shorten the prompt", "lower max_generated_tokens", "larger max_seq_len"):
        assert fix in message
    check_prompt(model, [1] * 59, prompt_index=3, max_generated_tokens=5)  # exactly fits
    with pytest.raises(ValueError, match="prompt 9 has 60 tokens"):
        generate_group(
            model,
            [1] * 60,
            num_samples=2,
            sampling=SamplingSettings(max_generated_tokens=5),
            seed=0,
            step=0,
            prompt_index=9,
            run_full_length=True,
            device=CPU,
        )
    assert not model.caches_are_setup()


@pytest.mark.parametrize(
    ("prompt", "match"),
    [([], "prompt 4 is empty"), ([1, 64], "prompt 4 holds token id 64, outside the model's")],
)
def test_an_empty_prompt_or_a_token_outside_the_vocabulary_is_named(prompt, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_prompt(sampling_model(), prompt, prompt_index=4, max_generated_tokens=5)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"max_generated_tokens": 0}, "max_generated_tokens=0"),
        ({"max_generated_tokens": 4, "temperature": -1.0}, "temperature=-1.0"),
        ({"max_generated_tokens": 4, "temperature": float("nan")}, "temperature=nan"),
        ({"max_generated_tokens": 4, "top_k": 0}, "top_k=0"),
        ({"max_generated_tokens": 4, "stop_tokens": [3, -2]}, r"stop_tokens=\[3, -2\]"),
    ],
)
def test_bad_sampling_settings_are_named(settings, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingSettings(**settings)


def test_stop_tokens_from_a_config_list_become_a_tuple() -> None:
    assert SamplingSettings(max_generated_tokens=3, stop_tokens=[2, 9]).stop_tokens == (2, 9)
