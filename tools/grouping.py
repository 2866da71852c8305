"""Windows of already-collated micro-batches, for the tests and benchmarks that make them by hand.

The recipes' windows come from ``exactga.data.loader``'s loader, the one owner of the window
settings (``gradient_accumulation_steps``, ``micro_batching``, ``drop_partial_window``): see [data
order] there. Tests and benchmarks that build their own collated micro-batches group them here,
``gradient_accumulation_steps`` at a time in their order, into the same :class:`SampleWindow`s
the loader yields, and hand those to :class:`exactga.accumulation.normalization.LossNormalizer`.
:class:`GroupingNormalizer` does both in one object, with the old constructor's arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import torch
from torch import nn

from exactga.accumulation.normalization import LossNormalizer, Window
from exactga.data.micro_batching import SampleWindow


def check_window_size(gradient_accumulation_steps: int) -> None:
    if gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be at least 1, got {gradient_accumulation_steps}."
        )


def group_windows(
    batches: Iterable[Any], gradient_accumulation_steps: int, drop_partial_window: bool = False
) -> Iterator[SampleWindow]:
    """Collated micro-batches, ``gradient_accumulation_steps`` at a time; windows of samples
    pass through. The samples' own lengths are unknown here (0 tells ``Window.work``)."""
    check_window_size(gradient_accumulation_steps)
    iterator = iter(batches)
    for first in iterator:
        if isinstance(first, SampleWindow):
            yield first
            continue
        group = [first, *islice(iterator, gradient_accumulation_steps - 1)]
        if len(group) < gradient_accumulation_steps and drop_partial_window:
            return
        yield SampleWindow(group, 0, 0, 0, False)


def num_windows(
    num_batches: int, gradient_accumulation_steps: int, drop_partial_window: bool
) -> int:
    """Windows :func:`group_windows` makes of ``num_batches`` micro-batches."""
    full, rest = divmod(num_batches, gradient_accumulation_steps)
    return full + (1 if rest and not drop_partial_window else 0)


class GroupingNormalizer(LossNormalizer):
    """A :class:`LossNormalizer` that groups collated micro-batches itself (tests, benchmarks)."""

    def __init__(
        self,
        loss_fn: nn.Module,
        gradient_accumulation_steps: int,
        drop_partial_window: bool = False,
        **kwargs: Any,
    ) -> None:
        check_window_size(gradient_accumulation_steps)
        super().__init__(loss_fn, **kwargs)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.drop_partial_window = drop_partial_window

    def num_windows(self, num_batches: int) -> int:
        return num_windows(num_batches, self.gradient_accumulation_steps, self.drop_partial_window)

    def windows(
        self,
        batches: Iterable[SampleWindow] | Iterable[dict[str, torch.Tensor]],
        max_windows: int | None = None,
    ) -> Iterator[Window]:
        grouped = group_windows(batches, self.gradient_accumulation_steps, self.drop_partial_window)
        return super().windows(grouped, max_windows)
