"""A dense reward for the GRPO recipe tests (imported by the launched ranks: tests/ is on their
path). A randomly initialised model's completions almost never hold a digit, so the shipped
rewards are 0 for nearly every group and the first steps would not move the weights; the share
of a completion's letters that are vowels differs between almost any two completions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

VOWELS = frozenset("aeiouAEIOU")


class VowelShare:
    name = "vowel_share"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]
    ) -> torch.Tensor:
        shares = []
        for text in completions:
            letters = [c for c in text if c.isalpha()]
            shares.append(sum(c in VOWELS for c in letters) / len(letters) if letters else 0.0)
        return torch.tensor(shares, dtype=torch.float32)


class NaNReward:
    """A broken reward: NaN for every second completion (the bad-input test's)."""

    name = "nan_reward"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]
    ) -> torch.Tensor:
        rewards = torch.zeros(len(completions))
        rewards[1::2] = float("nan")
        return rewards
