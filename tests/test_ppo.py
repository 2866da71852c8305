"""PPO's step is the full-PPO-batch step under any split (exactga.ppo, docs/ppo.md).

In process: a PPO batch of trajectories with responses and value positions of varied lengths,
trained through the one normaliser and ``ppo_micro_batch_loss`` as the recipe trains it, split
several ways, lands on the step of an fp64 oracle of stock's PPO loss written plainly below (the
policy term a mean over the batch's response tokens, the value term over its value positions), at
the fp32 floor; a wrong reference (stock's mean of micro-batch means) is far from it, and the
``naive`` baseline lands on that wrong reference instead.

Through the recipe (``tests/test_recipe_ppo.py``): the same through ``tune run``, kill -9 resume.
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
from oracle_utils import flat, fp64, lr_for_unit_update, step_gap

from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.step import train_window
from exactga.config.options import MicroBatching, NormMode
from exactga.data.micro_batching import MicroBatchingSettings, WindowCollator
from exactga.ppo.loss import ResponseTokens, collate_trajectories, ppo_micro_batch_loss
from exactga.ppo.models import PolicyAndValue
from exactga.profiling import ProfilerSettings, TrainingProfiler

CPU = torch.device("cpu")
VOCAB, MAX_GENERATED = 64, 6
LOSS = {"epsilon": 0.2, "value_clip_range": 0.2, "value_coeff": 0.1}
TEMPERATURE = 0.7
NUM_TRAJECTORIES = 8
SPLITS = {  # name -> micro-batching of the PPO batch of 8 trajectories
    "ga1": MicroBatchingSettings(MicroBatching.FIXED, batch_size=8),
    "ga2": MicroBatchingSettings(MicroBatching.FIXED, batch_size=4),
    "ga4": MicroBatchingSettings(MicroBatching.FIXED, batch_size=2),
    "ga8": MicroBatchingSettings(MicroBatching.FIXED, batch_size=1),
    "ga4_by_length": MicroBatchingSettings(MicroBatching.BY_LENGTH, batch_size=2),
    "token_budget": MicroBatchingSettings(
        MicroBatching.TOKEN_BUDGET, batch_size=1, micro_batch_tokens=24
    ),
}


def _models() -> PolicyAndValue:
    from torchtune.models.mistral import mistral
    from torchtune.models.mistral._component_builders import mistral_classifier

    sizes = {"vocab_size": VOCAB, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2}
    sizes.update(embed_dim=32, intermediate_dim=64, max_seq_len=32)
    torch.manual_seed(0)
    policy, value = mistral(**sizes), mistral_classifier(num_classes=1, **sizes)
    for module in (*policy.modules(), *value.modules()):  # weights that move the losses
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.2)
    return PolicyAndValue(policy, value)


def _trajectories(models: PolicyAndValue) -> list[dict]:
    """Trajectories as ``exactga.ppo.trajectory`` hands them to the step: prompts of 2-5
    tokens, responses of 1-6, stock's value positions (one past the response when it stopped
    early), old log-probs near the policy's (so ratios leave the clip range), random
    advantages, old values and returns (fp64, as recorded once per step)."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    trajectories = []
    for _ in range(NUM_TRAJECTORIES):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))]
        response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, MAX_GENERATED))]
        last = len(response) - 1  # stock's seq_lens
        num_values = last + 2 if 0 < last < MAX_GENERATED - 1 else last + 1
        num_values = min(num_values, len(response) + 1)
        tokens = prompt + response
        with torch.no_grad():
            logits = models.policy(torch.tensor([tokens]))[0].double() / TEMPERATURE
        log_probs = logits.log_softmax(-1)
        own = torch.stack(
            [log_probs[len(prompt) - 1 + t, response[t]] for t in range(len(response))]
        )
        trajectories.append(
            {
                "tokens": tokens,
                "labels": [-100] * len(prompt) + response,
                "prompt_length": len(prompt),
                "old_log_probs": own + 0.3 * torch.randn(len(response), generator=gen).double(),
                "advantages": torch.randn(len(response), generator=gen).double(),
                "old_values": 0.5 * torch.randn(num_values, generator=gen).double(),
                "returns": torch.randn(num_values, generator=gen).double(),
            }
        )
    return trajectories


def _oracle_loss(models: PolicyAndValue, trajectories: list[dict], groups=None) -> torch.Tensor:
    """Stock's PPO loss written plainly: the clipped policy loss's mean over the response tokens
    plus ``value_coeff`` times the clipped value loss's mean over the value positions, over
    ``groups`` of trajectories (default: one group, the whole PPO batch), the groups' losses
    averaged (stock's per-micro-batch means over gradient_accumulation_steps)."""
    eps, clip, coeff = LOSS["epsilon"], LOSS["value_clip_range"], LOSS["value_coeff"]
    groups = groups or [list(range(len(trajectories)))]
    total = 0.0
    for group in groups:
        policy_losses, value_losses = [], []
        for i in group:
            t = trajectories[i]
            tokens, first = torch.tensor([t["tokens"]]), t["prompt_length"] - 1
            log_probs = (models.policy(tokens)[0] / TEMPERATURE).log_softmax(-1)
            values = models.value(tokens)[0, :, 0]
            # Response token k is predicted at position first + k; value position k sits there.
            responses = torch.arange(len(t["advantages"])) + first
            targets = torch.tensor(t["tokens"])[responses + 1]
            ratios = torch.exp(log_probs[responses, targets] - t["old_log_probs"])
            advantages = t["advantages"]
            clipped = torch.clamp(ratios, 1 - eps, 1 + eps)
            policy_losses.append(torch.maximum(-advantages * ratios, -advantages * clipped))
            value = values[torch.arange(len(t["old_values"])) + first]
            old, ret = t["old_values"], t["returns"]
            clipped = torch.clamp(value, old - clip, old + clip)
            value_losses.append(0.5 * torch.maximum((value - ret) ** 2, (clipped - ret) ** 2))
        total = total + torch.cat(policy_losses).mean() + coeff * torch.cat(value_losses).mean()
    return total / len(groups)


def _oracle_gradient(models: PolicyAndValue, trajectories: list[dict], groups=None) -> torch.Tensor:
    double = copy.deepcopy(models).double()
    with fp64():
        _oracle_loss(double, trajectories, groups).backward()
    return flat([p.grad for p in double.parameters()])


def _trained(
    models: PolicyAndValue,
    trajectories: list[dict],
    split: MicroBatchingSettings,
    lr: float,
    mode: NormMode = NormMode.EXACT,
) -> torch.Tensor:
    """The weights after one SGD step on the PPO batch, cut by ``split``, as the recipe trains."""
    models = copy.deepcopy(models)
    collate = functools.partial(collate_trajectories, padding_idx=0)
    sample_window = WindowCollator(split, len(trajectories), collate)(trajectories)
    normalizer = LossNormalizer(None, mode=mode, units=ResponseTokens())
    (window,) = normalizer.windows([sample_window])
    loss_step = functools.partial(
        ppo_micro_batch_loss, models.policy, models.value, temperature=TEMPERATURE, **LOSS
    )
    settings = ProfilerSettings(log_timings=False, saved_latency_every_n_steps=0)
    train_window(
        window,
        model=models,
        loss_step=loss_step,
        optimizer=torch.optim.SGD(models.parameters(), lr=lr),
        profiler=TrainingProfiler(settings, CPU, models),
        device=CPU,
        step=1,
    )
    return flat(list(models.parameters()))


@pytest.fixture(scope="module")
def batch():
    models = _models()
    trajectories = _trajectories(models)
    gradient = _oracle_gradient(models, trajectories)
    initial = flat(list(models.parameters()))
    return models, trajectories, initial, gradient, lr_for_unit_update(initial, gradient)


def test_the_batch_has_responses_and_value_positions_of_varied_lengths(batch) -> None:
    _, trajectories, *_ = batch
    lengths = {len(t["advantages"]) for t in trajectories}
    extra = {len(t["old_values"]) - len(t["advantages"]) for t in trajectories}
    assert len(lengths) >= 4 and extra == {0, 1}, (lengths, extra)


@pytest.mark.parametrize("split", list(SPLITS))
def test_every_split_takes_the_fp64_oracle_step(batch, split: str) -> None:
    models, trajectories, initial, gradient, lr = batch
    trained = _trained(models, trajectories, SPLITS[split], lr)
    assert step_gap(trained, initial, gradient, lr) < 1e-5


def test_a_wrong_reference_fails_and_naive_is_that_reference(batch) -> None:
    """Stock's weighting (each micro-batch's two means over gradient_accumulation_steps) is a
    wrong reference for the exact step, far above the fp32 floor; the ``naive`` baseline
    takes exactly it, so its gap to the oracle is the split's error."""
    models, trajectories, initial, gradient, lr = batch
    groups = [[0, 1], [2, 3], [4, 5], [6, 7]]  # fixed micro-batches of 2, in order
    wrong = _oracle_gradient(models, trajectories, groups)
    exact = _trained(models, trajectories, SPLITS["ga4"], lr)
    naive = _trained(models, trajectories, SPLITS["ga4"], lr, NormMode.NAIVE)
    assert step_gap(exact, initial, wrong, lr) > 1e-2
    assert step_gap(naive, initial, wrong, lr) < 1e-5
    assert step_gap(naive, initial, gradient, lr) > 1e-2


def test_the_loss_step_matches_the_oracle_in_fp64(batch) -> None:
    """In fp64 the exact split's update equals the oracle's to fp64 rounding."""
    models, trajectories, initial, gradient, lr = batch
    double = copy.deepcopy(models).double()
    with fp64():
        trained = _trained(double, trajectories, SPLITS["ga4_by_length"], lr)
    assert step_gap(trained, initial, gradient, lr) < 1e-10


# ---------------------------------------------------------------------------------------------
# The keys: stock's config accepted unchanged, bad combinations named at start-up.


def _validate(cfg):
    from exactga.config.validation import validate_config
    from exactga.ppo.schema import PpoFullFinetuneSingleDeviceConfig

    return validate_config(
        cfg, PpoFullFinetuneSingleDeviceConfig, "ppo_full_finetune_single_device"
    )


def test_the_stock_config_is_accepted_unchanged() -> None:
    from omegaconf import OmegaConf
    from unit_utils import stock_configs

    (path,) = stock_configs("ppo_full_finetune_single_device")
    cfg = _validate(OmegaConf.load(path))
    assert cfg.loss_normalization is NormMode.EXACT  # our keys get their defaults
    assert cfg.ppo_batch_size == 128 and cfg.loss.value_coeff == 0.1


BAD_KEYS = {
    # overrides of the tiny config -> what the one message names
    "ppo_batch_size": ({"ppo_batch_size": 3}, "'batch_size' and 'ppo_batch_size'"),
    "forward_batch_size": ({"forward_batch_size": 3}, "'forward_batch_size'"),
    "ga": ({"gradient_accumulation_steps": 3}, "'gradient_accumulation_steps'"),
    "num_steps": ({"num_steps": 4}, "'num_steps'"),
    "post_scale": (
        {"loss_normalization": "post_scale", "micro_batching": "fixed"},
        "'loss_normalization'",
    ),
    "loss_key": ({"loss": {"kl_coeff": 0.1}}, "'loss.kl_coeff'"),
}


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_bad_keys_are_named(case: str) -> None:
    from unit_utils import tiny_config

    overrides, words = BAD_KEYS[case]
    with pytest.raises(ValueError, match=words):
        _validate(tiny_config("ppo_single_device", **overrides))
