"""GRPO's validation (exactga.grpo.validation), in-process on the toy model: the held-out reward
mean and success rate are those of a plain reference (each prompt's completions generated one
by one with the same seeds, scored, averaged over every completion), the same for any
``batch_size_val`` and on 2 gloo ranks under FSDP2 (one of them with a filler group), while a
mean of per-batch means is off where batches are unequal; validating draws nothing from the
training RNG and leaves the model as it was. See [GRPO validation].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from grpo_rewards import VowelShare
from torch import nn
from torchtune.training import shard_model
from unit_utils import run_on_ranks, tiny_model

from exactga.config.options import MicroBatching
from exactga.generation.sampling import VALIDATION_STEP, SamplingSettings, generate_group
from exactga.grpo.rollout_step import StepSettings
from exactga.grpo.validation import HeldOutPrompts, held_out_rewards
from exactga.runtime.precision import Precision

CPU = torch.device("cpu")
SEED, SAMPLES = 11, 3
SAMPLING = SamplingSettings(max_generated_tokens=6, stop_tokens=tuple(range(0, 64, 8)))
SETTINGS = StepSettings.of(
    num_prompts=1,
    grpo_samples=SAMPLES,
    sampling=SAMPLING,
    ppo_epochs=1,
    gradient_accumulation_steps=1,
    micro_batching=MicroBatching.FIXED,
    micro_batch_tokens=None,
    forward_batch_size=None,
    pad_id=0,
)
# Five held-out prompts of unequal lengths: 2 ranks hold 3 and 2 (and a filler).
PROMPTS = [[5], [3, 9, 27], [11, 2, 40, 33], [60, 1, 2, 3, 50], [7, 7]]


class Letters:
    """A tokenizer's decode: token ``t`` is letter ``t mod 26``."""

    vocab_size = 64

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


class HasVowelE:
    """A success-defining reward: 1 for a completion with an ``e`` in it."""

    name = "has_e"
    defines_success = True

    def __call__(self, prompts, completions, answers) -> torch.Tensor:
        return torch.tensor([float("e" in text) for text in completions])


REWARDS = [VowelShare(), HasVowelE()]


def held_out_items() -> list[dict]:
    return [
        {"prompt_tokens": tokens, "prompt": f"q{i}", "answer": "0", "index": i}
        for i, tokens in enumerate(PROMPTS)
    ]


@dataclass
class CpuRuntime:
    """What held_out_rewards reads of a recipe's runtime, on CPU ranks."""

    dp_size: int = 1
    dp_group: object = None
    device: torch.device = CPU
    precision: Precision | None = None


def validation_model() -> nn.Module:
    model = tiny_model(tie_word_embeddings=False)
    with torch.no_grad():
        model.output.weight.mul_(4.0)  # peaked: the logits, not only the draws, pick tokens
    return model


ONE_RANK = CpuRuntime()


def figure(model: nn.Module, batch_size: int, runtime: CpuRuntime = ONE_RANK, rank: int = 0):
    held_out = HeldOutPrompts(
        held_out_items(), batch_size=batch_size, num_replicas=runtime.dp_size, rank=rank
    )
    return held_out_rewards(
        model,
        held_out,
        settings=SETTINGS,
        reward_components=REWARDS,
        tokenizer=Letters(),
        seed=SEED,
        runtime=runtime,
    )


def reference_rewards() -> list[list[tuple[float, bool]]]:
    """Per prompt, each completion's (reward, success): generated prompt by prompt with the
    seed of (SEED, VALIDATION_STEP, row), decoded and scored one completion at a time."""
    model = validation_model()
    per_prompt = []
    for row, tokens in enumerate(PROMPTS):
        group = generate_group(
            model,
            tokens,
            num_samples=SAMPLES,
            sampling=SAMPLING,
            seed=SEED,
            step=VALIDATION_STEP,
            prompt_index=row,
            run_full_length=False,
            device=CPU,
        )
        scored = []
        for rollout in group.rollouts:
            kept = [t for t in rollout["completion"] if t not in SAMPLING.stop_tokens]
            text = Letters().decode(kept)
            letters = [c for c in text if c.isalpha()]
            vowels = sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
            # score_completions' total: each reward in fp32, summed, returned in fp32.
            total = float(torch.tensor(vowels, dtype=torch.float32)) + ("e" in text)
            scored.append((float(torch.tensor(total, dtype=torch.float32)), "e" in text))
        per_prompt.append(scored)
    return per_prompt


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def reference() -> list[list[tuple[float, bool]]]:
    return reference_rewards()


def test_the_figures_are_the_plain_reference_for_any_batch_size(reference) -> None:
    completions = [c for prompt in reference for c in prompt]
    mean = sum(r for r, _ in completions) / len(completions)
    success_rate = sum(s for _, s in completions) / len(completions)
    assert 0.0 < success_rate < 1.0, "every completion alike: pick another SEED"
    for batch_size in (1, 2, len(PROMPTS)):
        metrics = figure(validation_model(), batch_size).metrics()
        assert metrics["val/reward_mean"] == pytest.approx(mean, rel=1e-12), batch_size
        assert metrics["val/success_rate"] == success_rate, batch_size
        print(f"batch_size_val {batch_size}: {metrics}")


def test_a_mean_of_batch_means_is_off_where_batches_are_unequal(reference) -> None:
    """Batches of 2, 2 and 1 prompts: the mean of their means weighs the last prompt's
    completions twice as much, which the figure does not."""
    rewards = [[r for r, _ in prompt] for prompt in reference]
    batches = [rewards[0] + rewards[1], rewards[2] + rewards[3], rewards[4]]
    mean_of_means = sum(sum(b) / len(b) for b in batches) / len(batches)
    exact = figure(validation_model(), batch_size=2).metrics()["val/reward_mean"]
    print(f"figure {exact:.6f}, mean of batch means {mean_of_means:.6f}")
    assert abs(mean_of_means - exact) > 1e-4


def test_validating_leaves_the_training_rng_and_the_model_as_they_were() -> None:
    model = validation_model()
    model.train()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    state = torch.get_rng_state()
    figure(model, batch_size=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(module.training for module in model.modules())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def _is_layer(name: str, module: nn.Module) -> bool:
    return name.startswith("layers.") and name.count(".") == 1


def _sharded_worker(rank: int) -> dict[str, float]:
    torch.set_num_threads(1)
    model = validation_model()
    shard_model(model, [_is_layer], cpu_offload=False, reshard_after_forward=True)
    runtime = CpuRuntime(dp_size=2, dp_group=dist.group.WORLD)
    return figure(model, batch_size=1, runtime=runtime, rank=rank).metrics()


def test_two_sharded_ranks_give_the_one_rank_figures(tmp_path) -> None:
    """Rank 0 generates 3 prompts' groups, rank 1 2 and a filler: both report one rank's
    figures over all 15 completions."""
    one_rank = figure(validation_model(), batch_size=len(PROMPTS)).metrics()
    results = run_on_ranks(_sharded_worker, (), tmp_path)
    print(f"1 rank {one_rank}, 2 ranks {results}")
    for metrics in results:
        assert metrics["val/reward_mean"] == pytest.approx(one_rank["val/reward_mean"], rel=1e-12)
        assert metrics["val/success_rate"] == one_rank["val/success_rate"]
