"""A step's rollouts as windows for the one normaliser: ``ppo_epochs`` passes over them, each
cut into micro-batches by ``micro_batching`` like any window. See [a GRPO step] in
exactga.grpo.rollout_step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

from exactga.accumulation.normalization import LossNormalizer, Window
from exactga.data.micro_batching import MicroBatchingSettings, WindowCollator
from exactga.grpo.policy import collate_rollouts
from exactga.grpo.rollout_step import StepSettings
from exactga.grpo.rollouts import Rollout, StepRollouts


def rollout_window(rollouts: Sequence[Rollout], settings: MicroBatchingSettings, pad_id: int):
    """One pass over the step's rollouts as a window of samples (collated afresh each pass:
    the loss step consumes its batch), for ``LossNormalizer.windows``."""
    collate = partial(collate_rollouts, padding_idx=pad_id)
    samples = [
        {k: v for k, v in r.items() if k not in ("completion", "prompt_index", "sample_index")}
        for r in rollouts
    ]
    return WindowCollator(settings, len(samples), collate)(samples)


def ppo_epoch_windows(
    rollouts: StepRollouts, settings: StepSettings, normalizer: LossNormalizer
) -> Iterator[Window]:
    """``ppo_epochs`` windows over the same rollouts, each collated afresh and counted by
    ``normalizer``: one optimizer step each."""
    for _ in range(settings.ppo_epochs):
        sample_window = rollout_window(rollouts.samples, settings.micro_batching, settings.pad_id)
        yield from normalizer.windows([sample_window])
