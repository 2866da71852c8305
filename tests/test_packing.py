"""Unit tier: packed micro-batches (``micro_batching: packed``, exactga.data.packing) and
``pad_to_multiple_of``.

The step a packed window trains is checked against the fp64 full-batch oracle in
tests/test_oracle.py (full, LoRA, distillation; 1 process and 2 ranks with fillers) and
tests/test_preference.py / tests/test_dpo_token_terms.py (DPO pairs, RPO); the recipes through
``tune run`` in tests/test_micro_batching_recipes.py. Here: what a packed row holds, that each
sample computes what it computes alone, the placement, the loader on the bundled data, the
shape metric and the messages for settings that cannot work. See [packed rows are exact].
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from omegaconf import OmegaConf
from unit_utils import make_rows, rel_err, tiny_model

from exactga.accumulation.loss_units import IGNORE_INDEX, count_loss_tokens, shift_labels
from exactga.config.schemas import FullFinetuneSingleDeviceConfig
from exactga.config.validation import validate_config
from exactga.data.collation import collate_to_multiple
from exactga.data.loader import build_dataloader
from exactga.data.micro_batching import (
    MicroBatching,
    MicroBatchingSettings,
    PaddingMeter,
    WindowWork,
    first_fit_decreasing,
)
from exactga.data.packing import DENSE_PACKED_MASK, PACKED_SEQUENCES, pack_pairs, pack_samples
from exactga.dpo.preference import collate_pairs, response_lengths
from exactga.dpo.schema import LoraDpoSingleDeviceConfig
from exactga.grpo.schema import GrpoDistributedConfig
from exactga.parity.grpo_schema import GrpoParityConfig
from exactga.parity.schema import GaParityConfig
from exactga.runtime.precision import Precision
from exactga.sft.loss import causal_lm_loss

SAMPLES = [{"tokens": t.tolist(), "labels": lab.tolist()} for t, lab in make_rows(0)]
ROW = 64  # the tiny model's max_seq_len


# --- placement ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_first_fit_decreasing_places_every_item_once_within_the_capacity(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.randint(1, 300) for _ in range(64)]
    rows = first_fit_decreasing(sizes, 256)
    assert sorted(i for row in rows for i in row) == list(range(64))
    for row in rows:
        assert sum(sizes[i] for i in row) <= 256 or len(row) == 1  # only a long item alone
    # First fit: an item opened a new row only when no earlier row had room for it then.
    fill = {r: 0 for r in range(len(rows))}
    order = sorted(range(64), key=lambda i: -sizes[i])
    row_of = {i: r for r, row in enumerate(rows) for i in row}
    for i in order:
        earlier = [r for r in range(row_of[i]) if fill[r] and fill[r] + sizes[i] <= 256]
        assert not earlier, f"item {i} skipped row {earlier[0]} that had room"
        fill[row_of[i]] += sizes[i]
    assert len(rows) <= 2 * -(-sum(min(s, 256) for s in sizes) // 256)


def test_first_fit_decreasing_is_deterministic_and_keeps_ties_in_order() -> None:
    assert first_fit_decreasing([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert first_fit_decreasing([3, 9, 4, 20], 10) == [[3], [1], [2, 0]]


# --- a packed row -------------------------------------------------------------------------------


def test_a_packed_row_scores_exactly_the_samples_shifted_labels() -> None:
    """See [packed rows are exact]: the row's shifted labels are the samples' shifted labels
    end to end, so the loss terms and their count are the samples'."""
    samples = SAMPLES[1:4]  # 5, 23 and 12 tokens; the 12 have no loss token
    row = pack_samples(samples, capacity=ROW)
    assert row["tokens"].shape == row["labels"].shape == row["input_pos"].shape == (1, ROW)
    expected = torch.cat(
        [shift_labels(torch.tensor([s["labels"]])).reshape(-1) for s in samples]
        + [torch.full((ROW - 40,), IGNORE_INDEX)]
    )
    assert torch.equal(shift_labels(row["labels"]).reshape(-1), expected)
    assert count_loss_tokens(row["labels"]) == sum(
        count_loss_tokens(torch.tensor([s["labels"]])) for s in samples
    )
    assert row["input_pos"][0].tolist() == [*range(5), *range(23), *range(12), *[0] * 24]


def test_a_packed_row_masks_each_sample_from_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    samples = [{"tokens": [1, 2], "labels": [1, 2]}, {"tokens": [3], "labels": [3]}]
    row = pack_samples(samples, capacity=4)
    # The documents, attended each alone, then the padding, not attended at all.
    assert row["mask"].tolist() == [[2, 1, -1]]
    monkeypatch.setenv(DENSE_PACKED_MASK, "1")
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool
    )
    dense = pack_samples(samples, capacity=4)["mask"]
    assert torch.equal(dense, expected.unsqueeze(0))  # under a mask the padding sees itself


def test_each_packed_sample_computes_what_it_computes_alone() -> None:
    model = tiny_model().eval()
    samples = SAMPLES[:3]  # 40, 5 and 23 tokens: two rows of 64
    rows = first_fit_decreasing([len(s["tokens"]) for s in samples], ROW)
    with torch.no_grad():
        for row in rows:
            batch = pack_samples([samples[i] for i in row], capacity=ROW)
            packed = model(batch["tokens"], mask=batch["mask"], input_pos=batch["input_pos"])
            start = 0
            for i in row:
                alone = model(torch.tensor([samples[i]["tokens"]]))
                end = start + len(samples[i]["tokens"])
                torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-5, atol=1e-5)
                start = end


def test_a_sample_longer_than_the_row_gets_a_row_as_long_as_it() -> None:
    long = {"tokens": list(range(1, 71)), "labels": list(range(1, 71))}
    assert pack_samples([long], capacity=ROW)["tokens"].shape == (1, 70)
    assert pack_samples([long], capacity=ROW, pad_to_multiple_of=32)["tokens"].shape == (1, 96)


def test_pad_to_multiple_of_trims_a_packed_rows_unfilled_end() -> None:
    row = pack_samples(SAMPLES[1:3], capacity=ROW, pad_to_multiple_of=16)  # 28 positions
    assert row["tokens"].shape == (1, 32)
    assert sum(map(abs, row["mask"].tolist()[0])) == 32  # the padding span fills the row


def test_a_packed_pair_row_marks_each_side_and_counts_its_response() -> None:
    pairs = []
    for prompt, chosen, rejected in [(3, 4, 2), (2, 1, 5)]:
        item = {}
        for side, length in (("chosen", chosen), ("rejected", rejected)):
            item[f"{side}_input_ids"] = list(range(1, prompt + length + 1))
            item[f"{side}_labels"] = [IGNORE_INDEX] * prompt + list(range(1, length + 1))
        pairs.append(item)
    row = pack_pairs(pairs, capacity=32)
    sides = row[PACKED_SEQUENCES]
    assert sides.shape == (4, 32)
    assert sides.sum(dim=1).tolist() == [7, 3, 5, 7]  # chosen 0, chosen 1, rejected 0, rejected 1
    assert not sides.any(dim=0)[7 + 5 + 3 + 7 :].any()  # padding is no one's
    assert torch.equal(response_lengths(row), response_lengths(collate_pairs(pairs)))


def test_a_packed_row_under_bf16_over_fp32_master_weights_is_the_padded_micro_batch() -> None:
    """``master_weights: fp32`` with ``dtype: bf16``: the packed row's loss and gradient are the
    padded micro-batch's to bf16 rounding (bf16 compute, fp32 weights and gradients)."""
    samples = SAMPLES[1:4]  # 5, 23 and 12 tokens: one row of 64
    precision = Precision.from_config(torch.bfloat16, "fp32", torch.device("cpu"))
    grads, losses = [], []
    for batch in (pack_samples(samples, capacity=ROW), _lists(samples)):
        model = tiny_model()
        loss_fn = torch.nn.CrossEntropyLoss()
        loss = causal_lm_loss(model, loss_fn, dict(batch), precision=precision).main
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert torch.allclose(losses[0], losses[1], rtol=1e-2)
    assert rel_err(grads[0], grads[1]) < 5e-2  # bf16 compute: a few of its 3-digit ulps


# --- pad_to_multiple_of in the padded modes ----------------------------------------------------


def _lists(samples):
    width = max(len(s["tokens"]) for s in samples)
    tokens = torch.tensor([s["tokens"] + [0] * (width - len(s["tokens"])) for s in samples])
    labels = torch.tensor(
        [s["labels"] + [IGNORE_INDEX] * (width - len(s["labels"])) for s in samples]
    )
    return {"tokens": tokens, "labels": labels}


def test_pad_to_multiple_of_rounds_a_padded_micro_batch_up_with_ignored_labels() -> None:
    batch = collate_to_multiple(
        SAMPLES[1:3], collate=_lists, multiple=16, padding_idx=0, ignore_idx=IGNORE_INDEX
    )
    assert batch["tokens"].shape == (2, 32)
    assert (batch["labels"][:, 23:] == IGNORE_INDEX).all()
    assert count_loss_tokens(batch["labels"]) == count_loss_tokens(_lists(SAMPLES[1:3])["labels"])


def test_pad_to_multiple_of_refuses_a_collate_with_another_sequence_entry() -> None:
    def with_mask(samples):
        batch = _lists(samples)
        return {**batch, "mask": torch.ones_like(batch["tokens"], dtype=torch.bool)}

    with pytest.raises(ValueError, match="'pad_to_multiple_of': the collate_fn's 'mask'"):
        collate_to_multiple(
            SAMPLES[1:3], collate=with_mask, multiple=16, padding_idx=0, ignore_idx=IGNORE_INDEX
        )


# --- the loader on the bundled data ------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled(bundled_dataset):
    return bundled_dataset[0]


@functools.cache
def _epoch(dataset, mode, tokens=None, multiple=None, collate_fn="padded_collate_sft"):
    """One epoch's windows of ``dataset`` under a setting, drawn once for the module (the tests
    only read them: ``by_length`` is the baseline of two)."""
    loader = build_dataloader(
        dataset,
        batch_size=8,
        gradient_accumulation_steps=8,
        micro_batching=MicroBatchingSettings(mode, 8, tokens, pad_to_multiple_of=multiple),
        shuffle=True,
        collate_fn=f"torchtune.data.{collate_fn}",
        padding_idx=0,
        ignore_idx=IGNORE_INDEX,
    )
    return list(loader)


def _padding_and_shapes(windows) -> tuple[float, set]:
    positions = sum(mb["tokens"].numel() for w in windows for mb in w.micro_batches)
    samples = sum(w.num_sample_positions for w in windows)
    shapes = {tuple(mb["tokens"].shape) for w in windows for mb in w.micro_batches}
    return 1 - samples / positions, shapes


def test_packed_windows_hold_the_fixed_windows_samples_in_one_shape(bundled) -> None:
    """bsz 8 x ga 8, rows of 1024: every window's samples are the fixed loader's, in rows of
    one shape; the padding is what whole samples of one window leave (measured 6.8%: a
    window's 10.6k positions on average fill 10.3 rows of 1024, so the last row is part
    empty), where ``by_length`` pads 14% and ``fixed`` 50%."""
    packed = _epoch(bundled, MicroBatching.PACKED, 1024)
    fixed = _epoch(bundled, MicroBatching.FIXED)
    assert len(packed) == len(fixed)
    for p, f in zip(packed, fixed, strict=True):
        assert p.num_sample_positions == f.num_sample_positions
        assert p.by_budget and p.num_fixed_positions == f.num_fixed_positions
        loss_tokens = sum(count_loss_tokens(mb["labels"]) for mb in p.micro_batches)
        assert loss_tokens == sum(count_loss_tokens(mb["labels"]) for mb in f.micro_batches)
    padding, shapes = _padding_and_shapes(packed)
    assert shapes == {(1, 1024)}
    last_rows = sum(1 - (w.num_sample_positions / 1024) % 1 for w in packed) * 1024
    floor = last_rows / sum(len(w.micro_batches) * 1024 for w in packed)
    print(f"packed 1024: padding {padding:.2%}, floor of a part-filled last row {floor:.2%}")
    assert padding < 0.08
    assert padding < _padding_and_shapes(_epoch(bundled, MicroBatching.BY_LENGTH))[0] / 2


def test_pad_to_multiple_of_brings_packed_padding_under_two_percent(bundled) -> None:
    padding, shapes = _padding_and_shapes(_epoch(bundled, MicroBatching.PACKED, 1024, 64))
    print(f"packed 1024, multiple 64: padding {padding:.2%}, {len(shapes)} shapes")
    assert padding <= 0.02
    assert all(shape[1] % 64 == 0 and shape[1] <= 1024 for shape in shapes)


def test_pad_to_multiple_of_bounds_the_padded_modes_shapes(bundled) -> None:
    windows = _epoch(bundled, MicroBatching.BY_LENGTH, multiple=128)
    _, shapes = _padding_and_shapes(windows)
    assert {length for _, length in shapes} <= {128, 256, 384, 512}
    _, unbounded = _padding_and_shapes(_epoch(bundled, MicroBatching.BY_LENGTH))
    assert len(shapes) < len(unbounded)


def test_packed_data_and_a_collate_of_ones_own_are_refused(bundled) -> None:
    from torchtune.datasets import PackedDataset

    class Packed(PackedDataset):
        def __init__(self):  # only the type matters to the check
            pass

    with pytest.raises(ValueError, match="'micro_batching' and 'dataset.packed'"):
        _epoch(Packed(), MicroBatching.PACKED, 1024)
    with pytest.raises(ValueError, match="'micro_batching' and 'collate_fn'"):
        _epoch(bundled, MicroBatching.PACKED, 1024, collate_fn="padded_collate_tiled_images")


# --- the shape metric --------------------------------------------------------------------------


def test_the_shape_metric_counts_an_epochs_distinct_shapes() -> None:
    meter = PaddingMeter()
    meter.add(WindowWork(num_positions=8, shapes=((2, 4), (1, 8))))
    meter.add(WindowWork(num_positions=8, shapes=((2, 4),)))
    assert meter.read_interval(1.0)["throughput/micro_batch_shapes"] == 2
    meter.open_epoch()
    meter.add(WindowWork(num_positions=8, shapes=((1, 8),)))
    assert meter.read_interval(1.0)["throughput/micro_batch_shapes"] == 1
    assert meter.most_shapes_in_an_epoch == 2


# --- settings that cannot work, named at start-up ----------------------------------------------

FULL = "configs/tiny/full_single_device.yaml"


def _validate(schema, path, **overrides):
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.create(overrides))
    return validate_config(cfg, schema, "recipe")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"micro_batching": "packed"},
            "'micro_batch_tokens' is needed with micro_batching: packed",
        ),
        (
            {"micro_batching": "packed", "micro_batch_tokens": 1024},
            "'micro_batch_tokens' and 'model.max_seq_len': a packed row of 1024",
        ),
        ({"pad_to_multiple_of": 0}, "'pad_to_multiple_of' must be null or at least 1"),
    ],
)
def test_packed_settings_that_cannot_work_name_their_keys(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        _validate(FullFinetuneSingleDeviceConfig, FULL, **overrides)


def test_a_packed_setting_that_fits_is_accepted() -> None:
    cfg = _validate(
        FullFinetuneSingleDeviceConfig,
        FULL,
        micro_batching="packed",
        micro_batch_tokens=512,
        pad_to_multiple_of=64,
    )
    assert cfg.micro_batching is MicroBatching.PACKED


def test_a_packed_pair_longer_than_the_model_names_both_lengths() -> None:
    """The tiny DPO config's sides take 512 tokens each, its model 512 positions: a pair of
    two full sides could not be one row."""
    with pytest.raises(ValueError, match="'tokenizer.max_seq_len' and 'model.max_seq_len'"):
        _validate(
            LoraDpoSingleDeviceConfig,
            "configs/tiny/lora_dpo_single_device.yaml",
            micro_batching="packed",
            micro_batch_tokens=512,
        )
    cfg = _validate(
        LoraDpoSingleDeviceConfig,
        "configs/tiny/lora_dpo_single_device.yaml",
        micro_batching="packed",
        micro_batch_tokens=1024,
        model={"max_seq_len": 1024},
    )
    assert cfg.micro_batching is MicroBatching.PACKED


def test_grpo_and_its_parity_report_refuse_packed() -> None:
    with pytest.raises(ValueError, match="'micro_batching': packed is for the fine-tuning"):
        _validate(
            GrpoDistributedConfig,
            "configs/tiny/grpo_distributed.yaml",
            micro_batching="packed",
            micro_batch_tokens=64,
        )
    with pytest.raises(ValueError, match="'parity.micro_batching': packed is for the fine-tun"):
        _validate(
            GrpoParityConfig,
            "configs/tiny/ga_parity_grpo.yaml",
            parity={"micro_batching": ["fixed", "packed"]},
        )


def test_the_parity_report_names_a_packed_row_longer_than_the_model() -> None:
    with pytest.raises(ValueError, match="'parity.micro_batch_tokens' and 'model.max_seq_len'"):
        _validate(
            GaParityConfig,
            "configs/tiny/ga_parity_full.yaml",
            parity={"micro_batching": ["fixed", "packed"], "micro_batch_tokens": 4096},
        )
