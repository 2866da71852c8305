"""How one GRPO step's rollouts become a window (exactga.grpo.windows), in-process."""

from __future__ import annotations

import pytest

from exactga.config.options import MicroBatching
from exactga.grpo.rollout_step import micro_batching_for_rollouts
from exactga.grpo.windows import rollout_window


def _rollouts(num: int) -> list[dict]:
    """Rollouts of a 3-token prompt and 2 to 8 completion tokens."""
    rollouts = []
    for index in range(num):
        length = 5 + index % 7
        rollouts.append(
            {
                "tokens": [1] * length,
                "labels": [-100] * 3 + [1] * (length - 3),
                "advantage": float(index),
                "ref_log_probs": [0.0] * length,
                "completion": [1] * (length - 3),
            }
        )
    return rollouts


@pytest.mark.parametrize("ga", [1, 3, 5, 64])
def test_token_budget_trains_every_rollout_whatever_ga(ga: int) -> None:
    settings = micro_batching_for_rollouts(MicroBatching.TOKEN_BUDGET, 32, ga, 48)
    window = rollout_window(_rollouts(32), settings, pad_id=0)
    assert window.num_samples == 32
    advantages = sorted(float(a) for mb in window.micro_batches for a in mb["advantages"])
    assert advantages == [float(i) for i in range(32)]
    assert all(mb["tokens"].numel() <= 48 or len(mb["tokens"]) == 1 for mb in window.micro_batches)


@pytest.mark.parametrize("mode", [MicroBatching.FIXED, MicroBatching.BY_LENGTH])
def test_ga_equal_micro_batches(mode: MicroBatching) -> None:
    window = rollout_window(_rollouts(32), micro_batching_for_rollouts(mode, 32, 4, None), 0)
    assert [len(mb["tokens"]) for mb in window.micro_batches] == [8, 8, 8, 8]
    assert window.num_samples == 32
