"""PPO's validation (exactga.ppo.validation), in-process on toy models: the held-out reward mean
and value loss are those of a plain reference (each prompt's response generated, scored and
given its returns alone, with the same seed; the sums over every prompt and every value
position, divided once), the same for any ``batch_size_val`` to the fp32 floor, while a mean of
per-batch means is off where batches are unequal; validating draws nothing from the training
RNG and leaves the models as they were. See [PPO validation].
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from exactga.config.options import MicroBatching
from exactga.data.micro_batching import MicroBatchingSettings
from exactga.generation.sampling import SamplingSettings
from exactga.ppo.loss import OLD_VALUES, RETURNS
from exactga.ppo.trajectory import (
    StepModels,
    TrajectorySettings,
    assign_advantages,
    generate_responses,
    record_forwards,
)
from exactga.ppo.validation import HeldOutPpoPrompts, held_out_ppo

CPU = torch.device("cpu")
SEED = 5
SETTINGS = TrajectorySettings(
    sampling=SamplingSettings(max_generated_tokens=6, stop_tokens=tuple(range(0, 64, 8))),
    forward_batch_size=64,
    pad_id=0,
    kl_coeff=0.1,
    gamma=1.0,
    lmbda=0.95,
    whiten_rewards=True,  # validation's returns are never whitened: see [PPO validation]
    min_response_length=None,
    penalise_no_eos=True,
    reward_penalty=-3.0,
    ppo_epochs=1,
    ppo_batch_size=1,
    micro_batching=MicroBatchingSettings(MicroBatching.FIXED, batch_size=1),
)
PROMPTS = [[5], [3, 9, 27], [11, 2, 40, 33], [60, 1, 2, 3, 50], [7, 7]]


def _decoder(seed: int, classifier: bool) -> nn.Module:
    from torchtune.models.mistral import mistral
    from torchtune.models.mistral._component_builders import mistral_classifier

    sizes = {"vocab_size": 64, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2}
    sizes.update(embed_dim=32, intermediate_dim=64, max_seq_len=32)
    torch.manual_seed(seed)
    model = mistral_classifier(num_classes=1, **sizes) if classifier else mistral(**sizes)
    for module in model.modules():  # weights that move the figures
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.3)
    return model


def step_models() -> StepModels:
    return StepModels(
        policy=_decoder(0, classifier=False),
        value=_decoder(1, classifier=True),
        reference=_decoder(2, classifier=False),
        reward=_decoder(3, classifier=True),
    )


def items() -> list[dict]:
    return [{"tokens": tokens} for tokens in PROMPTS]


def figures(models: StepModels, batch_size: int) -> dict[str, float]:
    held_out = HeldOutPpoPrompts(items(), batch_size=batch_size, max_batches=None)
    figure = held_out_ppo(models, held_out, settings=SETTINGS, seed=SEED, device=CPU)
    return figure.metrics()


def per_prompt() -> list[tuple[float, list[float]]]:
    """Each prompt's (score, value losses per value position), its response generated,
    recorded and given returns alone (unwhitened rewards), seeded by its row."""
    models = step_models()
    alone = []
    for row, tokens in enumerate(PROMPTS):
        (trajectory,) = generate_responses(
            models.policy,
            [{"tokens": tokens}],
            sampling=SETTINGS.sampling,
            seed=SEED,
            step=-1,
            device=CPU,
            prompt_indices=[row],
        )
        record_forwards(models, [trajectory], settings=SETTINGS, device=CPU)
        scored = assign_advantages([trajectory], replace(SETTINGS, whiten_rewards=False))
        errors = trajectory[OLD_VALUES] - trajectory[RETURNS]
        alone.append((float(scored.scores[0]), (0.5 * errors**2).tolist()))
    return alone


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, list[float]]]:
    return per_prompt()


def test_the_figures_are_the_plain_reference_for_any_batch_size(reference) -> None:
    scores = [score for score, _ in reference]
    losses = [loss for _, prompt in reference for loss in prompt]
    assert len({len(prompt) for _, prompt in reference}) > 1, "value positions all alike"
    expected = {
        "val/reward_mean": sum(scores) / len(scores),
        "val/value_loss": sum(losses) / len(losses),
    }
    for batch_size in (1, 2, len(PROMPTS)):
        got = figures(step_models(), batch_size)
        print(f"batch_size_val {batch_size}: {got} (reference {expected})")
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-5), (name, batch_size)


def test_a_mean_of_batch_means_is_off_where_batches_are_unequal(reference) -> None:
    """Batches of 2, 2 and 1 prompts: the mean of the batches' value-loss means weighs each
    batch alike, whatever its value positions."""
    batches = [reference[0:2], reference[2:4], reference[4:5]]
    means = []
    for batch in batches:
        losses = [loss for _, prompt in batch for loss in prompt]
        means.append(sum(losses) / len(losses))
    exact = figures(step_models(), batch_size=2)["val/value_loss"]
    mean_of_means = sum(means) / len(means)
    print(f"val/value_loss {exact:.6f}, mean of batch means {mean_of_means:.6f}")
    assert abs(mean_of_means - exact) > 1e-3 * abs(exact)


def test_validating_leaves_the_training_rng_and_the_models_as_they_were() -> None:
    models = step_models()
    models.policy.train()
    models.value.train()
    weights = {k: v.clone() for k, v in models.policy.state_dict().items()}
    torch.manual_seed(3)
    state = torch.get_rng_state()
    figures(models, batch_size=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(m.training for m in (*models.policy.modules(), *models.value.modules()))
    assert all(torch.equal(v, weights[k]) for k, v in models.policy.state_dict().items())
