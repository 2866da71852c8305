"""A window statistic (exactga.accumulation.window_statistics) is summed over the window's
micro-batches before the first backward, handed to the statistic once, and leaves the window's
batches to the loss step; a micro-batch without a unit adds nothing. KTO's use of it, on 1 and 2
ranks against an oracle: tests/test_kto.py. See [window statistics]."""

from __future__ import annotations

import torch
from unit_utils import make_rows, split
from unit_utils import tiny_model as make_model

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.step import train_window
from exactga.config.profiler import ProfilerSettings
from exactga.data.micro_batching import SampleWindow
from exactga.profiling import TrainingProfiler

CPU = torch.device("cpu")


class TokensAndIds:
    """A toy statistic: the window's loss tokens and the sum of their token ids."""

    size = 2

    def __init__(self, events: list[str]) -> None:
        self.events, self.value = events, None

    def contribution(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.events.append("contribution")
        scored = batch.pop("labels")[:, 1:] != IGNORE_INDEX  # the copy's: the step keeps its own
        return torch.stack([scored.sum(), batch["tokens"][:, 1:][scored].sum()]).double()

    def update(self, sums: torch.Tensor, window) -> None:
        self.events.append("update")
        self.value = sums.tolist()


def test_the_statistic_is_the_windows_before_the_first_backward() -> None:
    model, events = make_model(), []
    statistic = TokensAndIds(events)
    micro_batches = split(make_rows(), 1)  # one row each; one row has no loss token
    loss_fn = torch.nn.CrossEntropyLoss()
    normalizer = LossNormalizer(loss_fn, statistics=[statistic])
    (window,) = normalizer.windows([SampleWindow(micro_batches, 8, 0, 0, False)])

    def loss_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        events.append(f"loss {statistic.value is not None}")
        labels = batch.pop("labels")  # still there: the statistic's pass took copies
        logits = model(batch["tokens"])[:, :-1]
        return loss_fn(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))

    train_window(
        window,
        model=model,
        loss_step=loss_step,
        optimizer=None,
        profiler=TrainingProfiler(ProfilerSettings(log_timings=False), CPU, model),
        device=CPU,
        step=1,
    )
    labels = torch.cat([mb["labels"][:, 1:].reshape(-1) for mb in micro_batches])
    tokens = torch.cat([mb["tokens"][:, 1:].reshape(-1) for mb in micro_batches])
    scored = labels != IGNORE_INDEX
    assert statistic.value == [float(scored.sum()), float(tokens[scored].sum())]
    num_run = sum(1 for mb in micro_batches if (mb["labels"][:, 1:] != IGNORE_INDEX).any())
    assert num_run == 7  # the row without a loss token is skipped on one rank, statistic and all
    assert events == ["contribution"] * num_run + ["update"] + ["loss True"] * num_run
