"""Exact GRPO: one optimizer step over rollouts against a full-batch oracle, per policy loss and
aggregation.

The oracle is written here in plain PyTorch, fp64, knowing nothing of exactga: every rollout
forwarded on its own (no padding), each completion token's ``log p`` at the positions whose
label after the one-position shift is a completion token, then each loss's formula token by
token (PPO-clip with asymmetric clipping and the k3 KL estimator; GSPO's sequence ratio
``exp(mean log-ratio)`` clipped once per completion, with k2; CISPO's clipped, detached weight
times ``log p``, with k1), then each aggregation in plain loops: over the step's completion tokens
(``token-mean``), each completion's own tokens then the completions (``seq-mean-token-mean``),
the completions of token sums (``seq-mean-token-sum``), of token sums over ``MAX_GENERATED``
(``seq-mean-token-sum-norm``), and the plain sum (``token-sum``). The rollouts' old and reference
log-probs are data (fp32, as generation records them); the old ones are the policy's own plus
noise, so clipping bites on both sides. SGD without momentum makes the step ``w - lr * g``,
compared with the trained weights directly, as in tests/test_preference.py.

The real path is a recipe's: ``collate_rollouts``, ``LossNormalizer(units=loss_units_for(...))``,
``train_window`` with ``grpo_micro_batch_loss`` (and ``Window.scale``), on one process and on 2 gloo
ranks under FSDP2. See [policy aggregations] in exactga.grpo.policy and [policy losses are local
to a completion] in exactga.grpo.losses.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from oracle_utils import flat, fp64, lr_for_unit_update, step_gap, trainable
from torch import nn
from torchtune.training import shard_model
from unit_utils import VOCAB, run_on_ranks, tiny_model

from exactga.accumulation import forward
from exactga.accumulation import step as training
from exactga.accumulation.loss_units import IGNORE_INDEX, LOSS_POSITIONS
from exactga.accumulation.normalization import LossNormalizer, NormMode
from exactga.data.micro_batching import SampleWindow
from exactga.grpo import losses, policy
from exactga.grpo.dynamic_sampling import dynamic_sampling
from exactga.grpo.losses import (
    CISPOLoss,
    GSPOLoss,
    PolicyTokens,
    PPOClipLoss,
    build_policy_loss,
    kl_estimate,
)
from exactga.grpo.policy import (
    ADVANTAGES,
    EMPTY,
    Completions,
    CompletionTokens,
    LossAggregation,
    collate_rollouts,
    group_advantages,
    grpo_micro_batch_loss,
    loss_units_for,
)
from exactga.grpo.rollouts import StepRollouts, assign_advantages
from exactga.grpo.schema import POLICY_LOSS_KEYS, STOCK_LOSSES, check_loss_section
from exactga.grpo.shaping import (
    OverlongShaping,
    groups_with_spread,
    kept_groups,
    kl_reward_penalties,
)
from exactga.profiling import ProfilerSettings, TrainingProfiler
from exactga.runtime.distributed import GradientSync, gradient_sync

CPU = torch.device("cpu")
KL_COEFF, MAX_GENERATED = 0.1, 32
AGGREGATIONS = [a.value for a in LossAggregation]  # veRL's five names
# Each loss with clip ranges the old log-probs' noise crosses on both sides, and its own KL
# estimator: (low, high) of the ratio (PPO-clip: DAPO's clip-higher) and the estimator.
LOSS_SETTINGS = {
    "ppoclip": (PPOClipLoss, 0.2, 0.28, "k3"),
    "gspo": (GSPOLoss, 0.05, 0.08, "k2"),
    "cispo": (CISPOLoss, 0.5, 0.2, "k1"),
}
LOSSES = list(LOSS_SETTINGS)
OBJECTIVES = [(loss, a) for loss in LOSSES for a in AGGREGATIONS]
# Relative L2 of the trained weights from the oracle step (an update as large as the weights).
# fp64: measured 4.0e-16 to 6.0e-16 over every loss and aggregation (summation order only).
# fp32: measured 2.2e-7 to 3.6e-7 on one process, 1.9e-7 to 3.2e-7 on 2 ranks. The naive
# weighting is 3.1 to 3.2 off under token-mean, 0.95 to 1.25 under the completion units, on the
# unequal split (pytest tests/test_policy.py -p no:xdist -rP).
ORACLE_BOUND = 2e-6
FP64_BOUND = 1e-12
BOUNDS = {torch.float32: ORACLE_BOUND, torch.float64: FP64_BOUND}

GROUP_SIZE = 4
# Per prompt: its length, then its group's completion lengths (1 to 30 tokens) and rewards. The
# last group's rewards are all equal: advantages 0, only the KL term moves it.
GROUPS = [
    (3, [1, 20, 6, 13], [1.0, 0.0, 0.5, 0.0]),
    (9, [25, 2, 9, 4], [0.2, 0.9, 0.9, 0.1]),
    (1, [7, 30, 3, 16], [1.0, 1.0, 1.0, 1.0]),
]
# Completion 4's completion holds two masked positions (say, a tool's output): not its tokens.
MASKED_IN_COMPLETION = (4, [5, 6])
# Micro-batches as completion indices: whole, one each, fixed, regrouped by length (shortest
# first, 5 + 4 + 3), and an unequal regrouping out of order (1, 5 and 6 completions).
SPLITS = {
    "12x1": [list(range(12))],
    "1x12": [[i] for i in range(12)],
    "3x4": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]],
    "by_length": [[0, 10, 8, 2, 5], [7, 3, 11, 6], [1, 9, 4]],
    "unequal": [[7], [0, 5, 11, 2, 9], [1, 3, 4, 6, 8, 10]],
}
# On two ranks: 8 and 4 completions (95 and 39 completion tokens), 2 and 1 micro-batches, so
# rank 1 runs one emptied filler.
RANK_GROUPS = [[[1, 4, 9, 0, 2], [5, 6, 7]], [[3, 8, 10, 11]]]


def policy_model() -> nn.Module:
    """The toy llama3_2 with its own output projection: next-token log-probs of a few nats, as
    a language model's are (tied to its unit-variance embeddings, its logits spread over tens
    of nats, and fp32 log-probs of tokens it is sure of lose most of their digits)."""
    return tiny_model(tie_word_embeddings=False)


def make_rollouts(policy: nn.Module, seed: int = 0) -> list[dict]:
    """Rollouts as generation leaves them, before the log-probs: tokens (completions sampled
    from ``policy`` at temperature 1), labels (prompt masked), each completion's group-relative
    advantage."""
    gen = torch.Generator().manual_seed(seed)
    rollouts, rewards = [], []
    for prompt_len, completion_lens, group_rewards in GROUPS:
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=gen).tolist()
        for length in completion_lens:
            tokens = list(prompt)
            for _ in range(length):
                probs = torch.softmax(policy(torch.tensor([tokens]))[0, -1], dim=-1)
                tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
            labels = [IGNORE_INDEX] * prompt_len + tokens[prompt_len:]
            rollouts.append({"tokens": tokens, "labels": labels})
        rewards += group_rewards
    index, masked = MASKED_IN_COMPLETION
    prompt_len = GROUPS[index // GROUP_SIZE][0]
    for position in masked:
        rollouts[index]["labels"][prompt_len + position] = IGNORE_INDEX
    advantages = group_advantages(torch.tensor(rewards), GROUP_SIZE)
    for rollout, advantage in zip(rollouts, advantages.tolist(), strict=True):
        rollout["advantage"] = advantage
    return rollouts


# --- the oracle: plain PyTorch, fp64, every rollout on its own ---------------------------------


def oracle_token_log_probs(model: nn.Module, rollout: dict) -> tuple[torch.Tensor, list[int]]:
    """``log p(token t + 1)`` at each scored position ``t`` of one rollout, and those ``t``."""
    logits = model(torch.tensor([rollout["tokens"]]))[0, :-1]
    log_probs = torch.log_softmax(logits, dim=-1)
    scored = [t for t, label in enumerate(rollout["labels"][1:]) if label != IGNORE_INDEX]
    targets = torch.tensor([rollout["tokens"][t + 1] for t in scored])
    return log_probs[scored].gather(1, targets[:, None]).squeeze(1), scored


def per_token_record(rollout: dict, values: torch.Tensor, scored: list[int]) -> list[float]:
    """Log-probs as generation records them: one per token of ``tokens``, 0 where none."""
    record = [0.0] * len(rollout["tokens"])
    for t, value in zip(scored, values.tolist(), strict=True):
        record[t + 1] = value
    return record


@functools.cache
def rollouts() -> tuple[dict, ...]:
    """The step's rollouts with their log-probs in fp32, as generation records them: the old
    policy's are the policy's plus noise of 0.3 nats (a later PPO epoch's, so the ratio leaves
    the clip range on both sides), the reference's the policy's plus noise of 0.5 nats (a
    reference some steps behind; another random model would sit nats away, where the k3
    estimator's ``exp`` swamps everything else)."""
    policy64 = policy_model().double()
    gen = torch.Generator().manual_seed(1)
    with fp64(), torch.no_grad():
        result = make_rollouts(policy64)
        for rollout in result:
            current, scored = oracle_token_log_probs(policy64, rollout)
            for key, spread in (("old_log_probs", 0.3), ("ref_log_probs", 0.5)):
                noise = spread * torch.randn(len(scored), generator=gen, dtype=torch.float64)
                recorded = (current + noise).to(torch.float32)  # not .float(): see fp64()
                rollout[key] = per_token_record(rollout, recorded, scored)
    return tuple(result)


def oracle_token_losses(loss: str, rollout: dict, log_probs: torch.Tensor, scored: list[int]):
    """Each completion token's loss under ``loss``, token by token."""
    _, low, high, _ = LOSS_SETTINGS[loss]
    advantage = rollout["advantage"]  # an fp32 value, as the batch carries it
    old = [rollout["old_log_probs"][t + 1] for t in scored]
    ref = [rollout["ref_log_probs"][t + 1] for t in scored]
    if loss == "gspo":  # one ratio for the completion, clipped once
        ratio = torch.exp(sum(lp - o for lp, o in zip(log_probs, old, strict=True)) / len(old))
        sequence = -torch.minimum(
            ratio * advantage, torch.clamp(ratio, 1 - low, 1 + high) * advantage
        )
    token_losses = []
    for log_prob, o, r in zip(log_probs, old, ref, strict=True):
        ratio = torch.exp(log_prob - o)
        if loss == "ppoclip":
            clipped = torch.clamp(ratio, 1 - low, 1 + high)
            surrogate = -torch.minimum(ratio * advantage, clipped * advantage)
            kl = torch.exp(r - log_prob) - (r - log_prob) - 1
        elif loss == "gspo":
            surrogate = sequence
            kl = 0.5 * (log_prob - r) ** 2
        else:  # cispo
            weight = torch.clamp(ratio, 1 - low, 1 + high).detach()
            surrogate = -weight * advantage * log_prob
            kl = log_prob - r
        token_losses.append(surrogate + KL_COEFF * kl)
    return token_losses


def oracle_loss(model: nn.Module, loss: str, aggregation: str) -> torch.Tensor:
    completion_losses, num_tokens = [], 0
    for rollout in rollouts():
        log_probs, scored = oracle_token_log_probs(model, rollout)
        token_losses = oracle_token_losses(loss, rollout, log_probs, scored)
        completion_losses.append(sum(token_losses))
        num_tokens += len(token_losses)
        if aggregation == "seq-mean-token-mean":
            completion_losses[-1] = completion_losses[-1] / len(token_losses)
        elif aggregation == "seq-mean-token-sum-norm":
            completion_losses[-1] = completion_losses[-1] / MAX_GENERATED
    if aggregation == "token-mean":
        return sum(completion_losses) / num_tokens
    if aggregation == "token-sum":
        return sum(completion_losses)
    return sum(completion_losses) / len(completion_losses)


@functools.cache
def oracle(loss: str, aggregation: str) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Initial trainable weights, the fp64 full-batch gradient, the SGD lr, the loss."""
    model = policy_model()
    initial = flat(trainable(model))
    policy64 = copy.deepcopy(model).double()
    with fp64():
        value = oracle_loss(policy64, loss, aggregation)
        value.backward()
    gradient = flat([p.grad for p in trainable(policy64)])
    return initial, gradient, lr_for_unit_update(initial, gradient), float(value.detach())


def policy_loss(loss: str):
    cls, low, high, estimator = LOSS_SETTINGS[loss]
    return cls(epsilon_low=low, epsilon_high=high, kl_coeff=KL_COEFF, kl_estimator=estimator)


class Case:
    """A fresh policy and what the oracle computes for it."""

    def __init__(
        self, aggregation: str, dtype: torch.dtype = torch.float32, loss: str = "ppoclip"
    ) -> None:
        self.aggregation, self.dtype, self.loss = aggregation, dtype, loss
        self.model = policy_model().to(dtype)
        self.initial, self.gradient, self.lr, self.oracle_loss = oracle(loss, aggregation)

    def precision(self) -> contextlib.AbstractContextManager[None]:
        return fp64() if self.dtype == torch.float64 else contextlib.nullcontext()

    def loss_step(self, batch: dict) -> torch.Tensor:
        return grpo_micro_batch_loss(
            self.model,
            batch,
            aggregation=self.aggregation,
            loss=policy_loss(self.loss),
            max_generated_tokens=MAX_GENERATED,
            num_completions=len(rollouts()),  # the step's, over every rank
        )

    def gap(self) -> float:
        trained = flat([_full(p) for p in trainable(self.model)])
        return step_gap(trained, self.initial, self.gradient, self.lr)


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


# --- the real step ----------------------------------------------------------------------------


def real_step(
    case: Case, groups: list[list[int]], mode: NormMode = NormMode.EXACT, by_budget: bool = False
) -> tuple[float, int]:
    """One SGD step of ``case.model`` over the completions in ``groups`` (this rank's
    micro-batches), as a GRPO recipe would take it; the logged loss and this rank's fillers."""
    group = dist.group.WORLD if dist.is_initialized() else None
    micro_batches = [collate_rollouts([rollouts()[i] for i in g]) for g in groups]
    sample_window = SampleWindow(micro_batches, sum(map(len, groups)), 0, 0, False, by_budget)
    units = loss_units_for(case.aggregation)
    normalizer = LossNormalizer(None, mode=mode, dp_group=group, units=units)
    (window,) = normalizer.windows([sample_window])
    settings = ProfilerSettings(log_timings=False, saved_latency_every_n_steps=0)
    with case.precision():
        training.train_window(
            window,
            model=case.model,
            loss_step=case.loss_step,
            optimizer=torch.optim.SGD(trainable(case.model), lr=case.lr),
            profiler=TrainingProfiler(settings, CPU, case.model),
            device=CPU,
            step=1,
            micro_batch_context=functools.partial(
                gradient_sync, case.model, GradientSync.ONCE_PER_WINDOW
            ),
        )
    return window.global_mean_loss(), window.num_filler_micro_batches()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is faster, and does not fight a suite run beside it."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64], ids=lambda d: str(d).removeprefix("torch.")
)


# --- (a) one process, every split -------------------------------------------------------------


@pytest.mark.parametrize("split", list(SPLITS))
def test_one_step_is_the_full_batch_grpo_step_under_every_split(split: str) -> None:
    """PPO-clip under token-mean, every split (one micro-batch, one completion each, fixed,
    regrouped by length, unequal)."""
    case = Case("token-mean")
    loss, _ = real_step(case, SPLITS[split])
    gap = case.gap()
    print(f"ppoclip token-mean {split}: relative L2 to the oracle step {gap:.2e}")
    assert gap <= ORACLE_BOUND
    assert loss == pytest.approx(case.oracle_loss, rel=1e-6)


@DTYPES
@pytest.mark.parametrize("loss,aggregation", OBJECTIVES)
def test_every_loss_and_aggregation_is_the_full_batch_step(
    loss: str, aggregation: str, dtype: torch.dtype
) -> None:
    """Every loss x aggregation on the unequal regrouping (1, 5 and 6 completions), at the
    precision's floor."""
    case = Case(aggregation, dtype, loss)
    value, _ = real_step(case, SPLITS["unequal"])
    gap = case.gap()
    print(f"{loss} {aggregation} unequal {dtype}: relative L2 to the oracle step {gap:.2e}")
    assert gap <= BOUNDS[dtype]
    # CISPO's value, -w A log p summed, is a small difference of terms of a nat or so, and the
    # window's logged loss is summed in fp32: hence the absolute slack (measured 4.8e-8).
    assert value == pytest.approx(case.oracle_loss, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("loss,aggregation", OBJECTIVES)
def test_the_naive_mean_of_micro_batch_means_is_far_off(loss: str, aggregation: str) -> None:
    """Each micro-batch's own mean over the micro-batch count (the wrong reference of a
    per-micro-batch mean), on the unequal regrouping: the oracle sees it, so the checks above
    can fail."""
    case = Case(aggregation, loss=loss)
    real_step(case, SPLITS["unequal"], mode=NormMode.NAIVE)
    gap = case.gap()
    print(f"{loss} {aggregation} naive unequal: {gap:.2e}")
    assert gap > 1000 * ORACLE_BOUND


def test_the_aggregations_are_different_losses() -> None:
    """On rollouts of unequal lengths ``seq-mean-token-mean`` points elsewhere than
    ``token-mean``; the three token sums are ``token-mean`` times ``T / C``, ``T / (C G)`` and
    ``T`` within a step (their scale does not move with the step's lengths, which one step
    cannot show)."""
    token, sequence = (
        oracle("ppoclip", "token-mean")[1],
        oracle("ppoclip", "seq-mean-token-mean")[1],
    )
    cosine = float(token @ sequence / (token.norm() * sequence.norm()))
    print(f"token-mean / seq-mean-token-mean gradients: cosine {cosine:.4f}")
    assert cosine < 0.95
    num_tokens = sum(len(oracle_token_log_probs(policy_model(), r)[1]) for r in rollouts())
    num_completions = len(rollouts())
    scales = {
        "seq-mean-token-sum": num_tokens / num_completions,
        "seq-mean-token-sum-norm": num_tokens / (num_completions * MAX_GENERATED),
        "token-sum": float(num_tokens),
    }
    for aggregation, scale in scales.items():
        _, gradient, _, value = oracle("ppoclip", aggregation)
        assert value / oracle("ppoclip", "token-mean")[3] == pytest.approx(scale, rel=1e-9)
        assert float((gradient - scale * token).norm() / token.norm()) < 1e-9


def test_the_three_losses_are_different_losses() -> None:
    """PPO-clip, GSPO and CISPO point in different directions on the same rollouts."""
    gradients = {loss: oracle(loss, "seq-mean-token-mean")[1] for loss in LOSSES}
    for a, b in (("ppoclip", "gspo"), ("ppoclip", "cispo"), ("gspo", "cispo")):
        cosine = float(gradients[a] @ gradients[b] / (gradients[a].norm() * gradients[b].norm()))
        print(f"{a} / {b} gradients: cosine {cosine:.4f}")
        assert cosine < 0.99


# --- (b) two ranks under FSDP2, unequal completion tokens, one emptied filler -----------------


# On two ranks: both units, the sum that multiplies by C, and GSPO and CISPO under their own.
RANK_OBJECTIVES = [
    ("ppoclip", "token-mean"),
    ("ppoclip", "token-sum"),
    ("gspo", "seq-mean-token-mean"),
    ("cispo", "seq-mean-token-sum-norm"),
]


def _two_rank_worker(rank: int) -> dict:
    """Every two-rank check of this module in one process group (a group costs seconds): each
    objective's step on unequal ranks with a filler, and the dynamic sampling step."""
    torch.set_num_threads(1)
    results = {}
    for loss_name, aggregation in RANK_OBJECTIVES:
        case = Case(aggregation, loss=loss_name)
        shard_model(case.model, [_is_layer], cpu_offload=False, reshard_after_forward=True)
        loss, num_fillers = real_step(case, RANK_GROUPS[rank], by_budget=True)
        results[f"{loss_name} {aggregation}"] = {
            "gap": case.gap(),
            "loss": loss,
            "oracle_loss": case.oracle_loss,
            "fillers": num_fillers,
        }
    indices, trained, rounds = _dynamic_step(rank, 2)
    results["dynamic sampling"] = {
        "indices": indices,
        "trained": trained.tolist(),
        "rounds": rounds,
    }
    return results


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> list[dict]:
    return run_on_ranks(_two_rank_worker, (), tmp_path_factory.mktemp("two_ranks"))


def _is_layer(name: str, module: nn.Module) -> bool:
    return name.startswith("layers.") and name.count(".") == 1


@pytest.mark.xdist_group("policy_two_ranks")  # one worker makes the module fixture once
def test_two_ranks_with_unequal_completions_and_a_filler_take_the_full_batch_step(
    two_rank_results,
) -> None:
    results = two_rank_results
    for loss_name, aggregation in RANK_OBJECTIVES:
        on_rank = [r[f"{loss_name} {aggregation}"] for r in results]
        assert [r["fillers"] for r in on_rank] == [0, 1]
        assert on_rank[0]["gap"] == on_rank[1]["gap"]  # the same full weights on both ranks
        print(
            f"{loss_name} {aggregation} 2 ranks (8 + 4 completions, one filler): "
            f"{on_rank[0]['gap']:.2e}"
        )
        assert on_rank[0]["gap"] <= ORACLE_BOUND
        assert on_rank[0]["loss"] == pytest.approx(on_rank[0]["oracle_loss"], rel=1e-6)


# --- (c) the filler, the advantages, bad input -------------------------------------------------


@pytest.mark.parametrize("units", [CompletionTokens(), Completions()], ids=lambda u: u.name)
def test_an_emptied_micro_batch_has_no_unit_a_finite_loss_and_a_zero_gradient(units) -> None:
    """Its loss reaches every weight (so FSDP's collectives pair up) and, weighed 0 by the
    normaliser, leaves every gradient exactly 0."""
    case = Case("seq-mean-token-mean")
    batch = collate_rollouts(rollouts()[:3])
    for source in (batch, {k: v[-1:] for k, v in batch.items()}):  # as filler_micro_batch cuts
        emptied = units.emptied(source)
        assert units.count(emptied) == 0 and emptied["tokens"].size(0) == 1
        prepared = units.prepare(emptied, 0, runs_empty=True)
        sample_window = SampleWindow([batch, emptied], 6, 0, 0, False, True)
        (window,) = LossNormalizer(None, units=units).windows([sample_window])
        case.model.zero_grad(set_to_none=True)
        loss = case.loss_step(prepared).main
        assert torch.isfinite(loss) and EMPTY not in prepared and LOSS_POSITIONS not in prepared
        window.scale(loss, window.micro_batches[1]).backward()
        grads = [p.grad for p in trainable(case.model)]
        assert all(g is not None for g in grads)  # every weight took part
        assert all(bool((g == 0).all()) for g in grads)


def test_group_advantages_are_each_groups_standardised_rewards() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.9, 0.1, 3.0, 3.0, 3.0, 3.0])
    advantages = group_advantages(rewards, GROUP_SIZE)
    for g in range(3):
        group = rewards[g * GROUP_SIZE : (g + 1) * GROUP_SIZE].tolist()
        mean = sum(group) / GROUP_SIZE
        std = (sum((r - mean) ** 2 for r in group) / (GROUP_SIZE - 1)) ** 0.5
        for i, r in enumerate(group):
            assert float(advantages[g * GROUP_SIZE + i]) == pytest.approx((r - mean) / (std + 1e-4))
    with pytest.raises(ValueError, match=r"rewards of shape \(3, 4\): expected one reward per"):
        group_advantages(rewards.view(3, 4), GROUP_SIZE)
    with pytest.raises(ValueError, match="whole groups of 5"):
        group_advantages(rewards, 5)
    with pytest.raises(ValueError, match="group_size=1"):
        group_advantages(rewards, 1)
    with pytest.raises(ValueError, match="reward of completion 2 is nan"):
        group_advantages(torch.tensor([1.0, 0.0, float("nan"), 1.0]), 2)


@pytest.mark.parametrize("units", [CompletionTokens(), Completions()], ids=lambda u: u.name)
def test_a_completion_without_a_completion_token_is_named(units) -> None:
    bad = [dict(r) for r in rollouts()[:3]]
    bad[1]["labels"] = [IGNORE_INDEX] * len(bad[1]["labels"])
    with pytest.raises(ValueError, match="completion 1 of a micro-batch of 3: no completion token"):
        units.count(collate_rollouts(bad))
    # A completion whose one label sits at position 0 has none after the shift.
    zeros = {"old_log_probs": [0.0, 0.0], "ref_log_probs": [0.0, 0.0], "advantage": 0.0}
    bad = [{"tokens": [5, 6], "labels": [5, IGNORE_INDEX], **zeros}]
    with pytest.raises(ValueError, match="completion 0 of a micro-batch of 1: no completion"):
        units.count(collate_rollouts(bad))


@pytest.mark.parametrize("units", [CompletionTokens(), Completions()], ids=lambda u: u.name)
def test_advantages_of_the_wrong_shape_are_named(units) -> None:
    batch = collate_rollouts(rollouts()[:3])
    for advantages in (torch.zeros(2), torch.zeros(3, 1)):
        with pytest.raises(ValueError, match=r"advantages of shape .* expected \(3,\), one per"):
            units.count({**batch, ADVANTAGES: advantages})
    with pytest.raises(ValueError, match=r"ref_log_probs of shape \(3, 5\)"):
        units.count({**batch, "ref_log_probs": torch.zeros(3, 5)})
    with pytest.raises(ValueError, match="loss_aggregation 'seq-mean-token-sum-norm' divides"):
        grpo_micro_batch_loss(policy_model(), batch, aggregation="constant", loss=PPOClipLoss())
    with pytest.raises(ValueError, match="loss_aggregation 'token-sum' needs num_completions"):
        grpo_micro_batch_loss(policy_model(), batch, aggregation="token-sum", loss=PPOClipLoss())
    with pytest.raises(ValueError, match="config key 'loss_aggregation'='mean': choose one of"):
        loss_units_for("mean")


# --- (d) the old policy, and logits only at completion positions --------------------------------


def test_without_old_log_probs_the_old_policy_is_the_current_one() -> None:
    """``ppo_epochs: 1``: the same loss and gradient as old log-probs recorded from the policy
    itself (ratio 1, the surrogate's gradient ``-A grad logp``)."""
    model = policy_model()
    batch = CompletionTokens().prepare(collate_rollouts(rollouts()[:4]), 0, runs_empty=False)
    with torch.no_grad():
        current = policy.token_log_probs(
            model, {"tokens": batch["tokens"]}, batch[LOSS_POSITIONS], _targets(batch)
        )
    recorded = torch.zeros_like(batch["ref_log_probs"]).reshape(-1)
    recorded[batch[LOSS_POSITIONS] + 1] = current
    recorded = recorded.view_as(batch["ref_log_probs"])

    def loss_and_grads(batch):
        model.zero_grad()
        loss = grpo_micro_batch_loss(
            model, dict(batch), aggregation="token_mean", loss=PPOClipLoss()
        ).main
        loss.backward()
        return float(loss.detach()), flat([p.grad for p in model.parameters()])

    without = {k: v for k, v in batch.items() if k != "old_log_probs"}
    loss, grads = loss_and_grads(without)
    recorded_loss, recorded_grads = loss_and_grads({**batch, "old_log_probs": recorded})
    assert loss == pytest.approx(recorded_loss, rel=1e-6)
    assert float((grads - recorded_grads).norm() / recorded_grads.norm()) < 1e-6


def _targets(batch: dict) -> torch.Tensor:
    labels = batch["labels"]
    shifted = torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)), 1)
    return shifted.reshape(-1)[batch[LOSS_POSITIONS]]


def test_the_projection_sees_only_completion_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    model = policy_model()
    rows_projected: list[int] = []
    model.output.register_forward_hook(
        lambda module, args, out: rows_projected.append(args[0].reshape(-1, 32).size(0))
    )
    batch = Completions().prepare(collate_rollouts(rollouts()), 12, runs_empty=False)
    num_completion_tokens = sum(
        sum(label != IGNORE_INDEX for label in r["labels"][1:]) for r in rollouts()
    )
    assert len(batch[LOSS_POSITIONS]) == num_completion_tokens
    assert num_completion_tokens < batch["tokens"].numel() / 2  # most are prompt or padding

    def loss_and_grads():
        model.zero_grad()
        loss = grpo_micro_batch_loss(
            model, dict(batch), aggregation="sequence_mean", loss=PPOClipLoss()
        ).main
        loss.backward()
        return float(loss.detach()), flat([p.grad for p in model.parameters()])

    cut_loss, cut_grads = loss_and_grads()
    assert rows_projected == [num_completion_tokens]
    monkeypatch.setattr(forward, "projecting_only", _never_cut)  # where the log-probs project
    full_loss, full_grads = loss_and_grads()
    assert rows_projected[-1] == batch["tokens"].numel()  # every position
    assert cut_loss == pytest.approx(full_loss, rel=1e-6)
    assert float((cut_grads - full_grads).norm() / full_grads.norm()) < 1e-6


@contextlib.contextmanager
def _never_cut(model, positions):
    yield False


# --- (e) the loss components, the reward shaping, dynamic sampling ------------------------------


def test_the_loss_table_of_the_schema_is_the_classes_signatures() -> None:
    """Config validation checks ``loss`` keys from a table (it imports no torch); it must be
    what the classes take. Stock's names train PPO-clip; an unknown key or class is named."""
    for component, keys in POLICY_LOSS_KEYS.items():
        assert tuple(inspect.signature(losses.POLICY_LOSSES[component]).parameters) == keys
    assert type(build_policy_loss({"_component_": STOCK_LOSSES[1], "epsilon": 0.3})) is PPOClipLoss
    ppo = build_policy_loss({"epsilon": 0.2, "epsilon_high": 0.28})
    assert (ppo.epsilon_low, ppo.epsilon_high) == (0.2, 0.28)  # DAPO's clip-higher
    with pytest.raises(ValueError, match="config key 'loss.epsilon': GSPOLoss takes epsilon_low"):
        build_policy_loss({"_component_": "exactga.grpo.losses.GSPOLoss", "epsilon": 0.2})
    with pytest.raises(ValueError, match="config key 'loss._component_'='my.Loss': choose one"):
        build_policy_loss({"_component_": "my.Loss"})
    section = OmegaConf.create(
        {"_component_": "exactga.grpo.losses.CISPOLoss", "kl_estimator": "k4"}
    )
    with pytest.raises(ValueError, match="config key 'loss.kl_estimator'='k4': choose one of k1"):
        check_loss_section(section, "loss")


def test_kl_estimators_and_kl_in_the_reward_leave_the_loss_without_it() -> None:
    log_probs, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    x = log_probs - ref
    assert torch.equal(kl_estimate(log_probs, ref, "k1"), x)
    assert torch.equal(kl_estimate(log_probs, ref, "k2"), 0.5 * x * x)
    assert torch.allclose(kl_estimate(log_probs, ref, "k3"), torch.exp(-x) + x - 1)
    tokens = PolicyTokens(
        log_probs=log_probs.double(),
        old_log_probs=log_probs.double(),
        ref_log_probs=ref.double(),
        advantages=torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64),
        positions=torch.tensor([0, 1, 2]),
        num_rows=1,
        seq_len=3,
    )
    in_loss = PPOClipLoss(kl_coeff=0.5, kl_estimator="k2").token_losses(tokens)[0]
    in_reward = PPOClipLoss(kl_coeff=0.5, kl_estimator="k2", kl_in_reward=True)
    surrogate = in_reward.token_losses(tokens)[0]
    assert torch.allclose(
        in_loss - surrogate, 0.5 * kl_estimate(tokens.log_probs, tokens.ref_log_probs, "k2")
    )
    # In the reward: kl_coeff times each completion's summed estimate, from the recorded
    # log-probs of its completion tokens only.
    penalties = kl_reward_penalties(
        rollouts()[:2], "old_log_probs", "ref_log_probs", kl_coeff=0.5, estimator="k1"
    )
    for rollout, penalty in zip(rollouts()[:2], penalties.tolist(), strict=True):
        scored = [
            t for t in range(1, len(rollout["labels"])) if rollout["labels"][t] != IGNORE_INDEX
        ]
        plain = sum(rollout["old_log_probs"][t] - rollout["ref_log_probs"][t] for t in scored)
        assert penalty == pytest.approx(0.5 * plain, rel=1e-12)


def test_overlong_shaping_is_dapos_soft_penalty() -> None:
    shaping = OverlongShaping(max_generated_tokens=32, buffer=8, penalty_factor=0.5)
    penalties = shaping.penalties([1, 24, 25, 28, 32]).tolist()
    assert penalties == [0.0, 0.0, -0.5 / 8, -0.5 * 4 / 8, -0.5]
    with pytest.raises(ValueError, match="config key 'overlong_buffer'=40: must be between 1"):
        OverlongShaping(max_generated_tokens=32, buffer=40)


# Dynamic sampling over the groups of ``rollouts()`` as prompts: group 2's rewards are all equal,
# so it is dropped. The data order deals 2 prompts a step (one a rank on two ranks); its first
# round holds groups 2 and 0, so a second round (groups 2 and 1) refills the step.
DATA_ORDER = [2, 0, 2, 1, 0, 1]
STEP_PROMPTS = 2


def _prompt_batches(rank: int, world_size: int):
    per_rank = STEP_PROMPTS // world_size
    for start in range(0, len(DATA_ORDER), STEP_PROMPTS):
        step = DATA_ORDER[start : start + STEP_PROMPTS]
        yield [{"index": step[j * world_size + rank]} for j in range(per_rank)]


def _generate_and_score(batch) -> StepRollouts:
    """The groups of ``rollouts()`` the prompts name, as generation and scoring leave them."""
    samples, rewards = [], []
    for prompt in batch:
        group = prompt["index"]
        rows = range(group * GROUP_SIZE, (group + 1) * GROUP_SIZE)
        samples += [{**copy.deepcopy(rollouts()[i]), "index": i} for i in rows]
        rewards += GROUPS[group][2]
    scored = StepRollouts(
        samples=samples,
        rewards=torch.tensor(rewards, dtype=torch.float64),
        reward_components={},
        successes=None,
        num_generated_tokens=len(samples),
        group_size=GROUP_SIZE,
    )
    assign_advantages(scored)
    return scored


def _dynamic_step(rank: int, world_size: int) -> tuple[list[int], torch.Tensor, int]:
    """This rank's kept rollouts (indices into ``rollouts()``), after one SGD step over them
    (FSDP2 on two ranks), the full trained weights, and the sampling rounds."""
    group = dist.group.WORLD if world_size > 1 else None
    batches = _prompt_batches(rank, world_size)
    kept = dynamic_sampling(
        next(batches),
        _generate_and_score,
        lambda: next(batches, None),
        max_rounds=4,
        dp_group=group,
    )
    indices = [sample["index"] for sample in kept.samples]
    expected = [rollouts()[i]["advantage"] for i in indices]  # fp32 rewards there, fp64 here
    assert [s["advantage"] for s in kept.samples] == pytest.approx(expected, rel=1e-6)
    case = Case("token-mean")
    if world_size > 1:
        shard_model(case.model, [_is_layer], cpu_offload=False, reshard_after_forward=True)
    real_step(case, [indices[: GROUP_SIZE // 2], indices[GROUP_SIZE // 2 :]], by_budget=True)
    trained = flat([_full(p) for p in trainable(case.model)])
    return indices, trained, kept.num_sampling_rounds


@pytest.mark.xdist_group("policy_two_ranks")
def test_dynamic_sampling_keeps_the_same_groups_and_takes_the_same_step_on_two_ranks(
    two_rank_results,
) -> None:
    """Group 2 (all rewards equal) is dropped and refilled from the next round on one rank and
    on two; the two ranks hold groups 0 and 1 (rank 0's generated on rank 1) and their step is
    the one rank's step, at the fp32 floor."""
    indices, trained, rounds = _dynamic_step(0, 1)
    assert indices == list(range(2 * GROUP_SIZE)) and rounds == 2  # groups 0 and 1, in order
    results = [r["dynamic sampling"] for r in two_rank_results]
    assert [r["indices"] for r in results] == [list(range(GROUP_SIZE)), list(range(4, 8))]
    assert [r["rounds"] for r in results] == [2, 2]
    initial = flat(trainable(policy_model()))
    for result in results:
        gap = float((torch.tensor(result["trained"], dtype=torch.float64) - trained).norm())
        gap /= float((trained - initial).norm())
        print(f"dynamic sampling, 2 ranks against 1: relative L2 {gap:.2e}")
        assert gap <= ORACLE_BOUND
    with_spread = groups_with_spread(torch.tensor([1.0, 1.0, 0.0, 0.5]), 2)
    assert with_spread.tolist() == [False, True]
    # Too few groups with a spread: the first without fill up the step, in global order.
    spreads = [torch.tensor([False, True]), torch.tensor([False, False])]
    assert kept_groups(spreads, 2) == [(0, 0), (0, 1)]
