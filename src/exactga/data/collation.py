"""How one micro-batch's samples are collated (the ``collate`` a window's split calls): packed
into one row (``micro_batching: packed``, exactga.data.packing), as torchtune collates its packs
(``dataset.packed: True``), or by the config's ``collate_fn``, the sequence length rounded up
to ``pad_to_multiple_of``. exactga.data.loader builds the loader with it; see [data order] there.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed

from exactga.config.options import MicroBatching
from exactga.data.micro_batching import MicroBatchingSettings
from exactga.data.packing import pack_window_samples

Collate = Callable[[list[Any]], dict[str, Any]]


# The collates a packed row replaces: it packs plain samples and preference pairs itself.
_PACKABLE_COLLATES = ("padded_collate_sft", "collate_pairs", "padded_collate_dpo")


def micro_batch_collate(
    settings: MicroBatchingSettings,
    collate_fn: str,
    padding_idx: int,
    ignore_idx: int,
    *,
    packed_data: bool = False,
    flex_attention: bool = False,
) -> Collate:
    """How one micro-batch's samples are collated: packs as torchtune collates them, whole
    samples packed into a row (``packed``), or the config's ``collate_fn``, its sequence length
    rounded up under ``pad_to_multiple_of``.

    Args:
        settings: the window's split (``micro_batching``, ``micro_batch_tokens``,
            ``pad_to_multiple_of``).
        collate_fn: the config's ``collate_fn`` (dotted path).
        padding_idx: the tokenizer's pad id.
        ignore_idx: the loss's ignore index, which padded labels take.
        packed_data: the dataset yields torchtune's packs (``dataset.packed: True``).
        flex_attention: packed rows carry flex attention's ``BlockMask`` (CUDA).

    Raises:
        ValueError: ``packed`` micro-batches meet packed data or a collate of the user's own.
    """
    if settings.mode is MicroBatching.PACKED:
        if packed_data:
            raise ValueError(
                "config keys 'micro_batching' and 'dataset.packed': micro_batching: packed packs "
                "a window's samples itself; set dataset.packed=False (or another micro_batching)."
            )
        if not collate_fn.endswith(_PACKABLE_COLLATES):
            raise ValueError(
                f"config keys 'micro_batching' and 'collate_fn': micro_batching: packed collates "
                f"rows itself and cannot call {collate_fn}; use the default collate_fn or "
                "another micro_batching."
            )
        assert settings.micro_batch_tokens is not None
        return partial(
            pack_window_samples,
            capacity=settings.micro_batch_tokens,
            padding_idx=padding_idx,
            ignore_idx=ignore_idx,
            pad_to_multiple_of=settings.pad_to_multiple_of,
            flex=flex_attention,
        )
    if packed_data:
        return padded_collate_packed
    collate = partial(
        _get_component_from_path(collate_fn), padding_idx=padding_idx, ignore_idx=ignore_idx
    )
    if not settings.pad_to_multiple_of:
        return collate
    return partial(
        collate_to_multiple,
        collate=collate,
        multiple=settings.pad_to_multiple_of,
        padding_idx=padding_idx,
        ignore_idx=ignore_idx,
    )


def collate_to_multiple(
    samples: list[Any],
    *,
    collate: Collate,
    multiple: int,
    padding_idx: int,
    ignore_idx: int,
) -> dict[str, Any]:
    """``collate(samples)`` with its sequence length rounded up to a multiple of ``multiple``
    (``pad_to_multiple_of``): ``tokens`` padded with ``padding_idx``, ``labels`` with
    ``ignore_idx``, so the added positions are padding that no loss scores.

    Raises:
        ValueError: the collate returned another entry along the sequence, which only it
            knows how to pad.
    """
    batch = collate(samples)
    length = batch["tokens"].size(-1)
    extra = -length % multiple
    if extra == 0:
        return batch
    others = [
        key
        for key, value in batch.items()
        if key not in ("tokens", "labels")
        and isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and value.size(-1) == length
    ]
    if others:
        raise ValueError(
            f"config key 'pad_to_multiple_of': the collate_fn's '{others[0]}' runs along the "
            "sequence, and only that collate knows how to pad it; remove pad_to_multiple_of."
        )
    padded = dict(batch)
    padded["tokens"] = F.pad(batch["tokens"], (0, extra), value=padding_idx)
    padded["labels"] = F.pad(batch["labels"], (0, extra), value=ignore_idx)
    return padded
