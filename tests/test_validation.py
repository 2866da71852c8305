"""Validation during training (exactga.validation.held_out, exactga.sft.validation): the loss of
the whole validation set as one batch, in-process on a tiny torchtune model.

The figure must equal a plainly written full-set reference (tests/oracle_utils.py: every scored
token after the shift, summed, over their number) within the fp32 floor for any
``batch_size_val``, on one process and on 2 gloo ranks under FSDP2 (a rank with fewer samples
runs fillers); a mean of batch means and a count taken before the shift must miss it by far more,
so the comparison can fail. Validating between two training steps must change nothing in the
training (eval mode, RNG restored). The launches with ``dataset_val`` are in tests/test_resume.py
(the ``lora`` scenario: the validation series of a killed and resumed run).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from oracle_utils import reference_loss
from unit_utils import EXACT_TOL, make_loss, make_rows, tiny_config, tiny_model

from exactga.accumulation.loss_units import IGNORE_INDEX, count_unshifted_tokens
from exactga.config.schemas import FullFinetuneSingleDeviceConfig
from exactga.config.validation import validate_config
from exactga.data.collation import micro_batch_collate
from exactga.data.micro_batching import MicroBatchingSettings
from exactga.grpo.schema import GrpoDistributedConfig
from exactga.ppo.schema import PpoFullFinetuneSingleDeviceConfig
from exactga.sft.validation import validation_loss
from exactga.validation.held_out import Validation, ValidationSet

CPU = torch.device("cpu")


def _rows() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """15 rows of 3 to 40 tokens: prompts masked or not, first labels live or masked, one row
    without a scored token (an odd number, so 2 ranks hold 8 and 7)."""
    return (make_rows(0) + make_rows(1))[:15]


def _samples(rows: list) -> list[dict[str, list[int]]]:
    """The rows as a dataset's samples (what a torchtune SFT dataset yields)."""
    return [{"tokens": tokens.tolist(), "labels": labels.tolist()} for tokens, labels in rows]


def _validation_set(rows: list, batch_size: int, num_replicas: int = 1, rank: int = 0):
    collate = micro_batch_collate(
        MicroBatchingSettings(batch_size=batch_size),
        "torchtune.data.padded_collate_sft",
        padding_idx=0,
        ignore_idx=IGNORE_INDEX,
    )
    return ValidationSet(
        _samples(rows),
        batch_size=batch_size,
        collate=collate,
        num_replicas=num_replicas,
        rank=rank,
        dp_group=dist.group.WORLD if num_replicas > 1 else None,
    )


def _reference(rows: list) -> float:
    """The full-set loss, written plainly, in fp32 as the model runs."""
    model = tiny_model()
    with torch.no_grad():
        return float(reference_loss(model, rows))


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("loss_kind", ["chunked", "cross_entropy"])
@pytest.mark.parametrize("batch_size", [1, 3, 15])
def test_validation_loss_is_the_full_set_loss(batch_size: int, loss_kind: str) -> None:
    rows = _rows()
    model = tiny_model()
    loss_fn = make_loss(loss_kind, model)
    figure = validation_loss(model, loss_fn, _validation_set(rows, batch_size), device=CPU)
    reference = _reference(rows)
    print(f"bs {batch_size} {loss_kind}: ours {figure.loss!r} reference {reference!r}")
    assert _relative(figure.loss, reference) <= EXACT_TOL
    assert figure.num_samples == len(rows)
    assert figure.num_tokens == sum(int((labels[1:] != IGNORE_INDEX).sum()) for _, labels in rows)
    assert figure.perplexity == pytest.approx(math.exp(reference), rel=1e-5)


def test_mean_of_batch_means_and_the_pre_shift_count_miss_it() -> None:
    """The figures of Hugging Face's Trainer (a mean of each batch's mean) and torchtune main
    (the token count taken before the shift) are off by far more than the floor."""
    rows = _rows()
    reference = _reference(rows)
    model = tiny_model()
    figure = validation_loss(
        model, make_loss("chunked", model), _validation_set(rows, 3), device=CPU
    )
    batches = [rows[i : i + 3] for i in range(0, len(rows), 3)]
    mean_of_means = sum(_reference(batch) for batch in batches) / len(batches)
    pre_shift_count = sum(count_unshifted_tokens(labels) for _, labels in rows)
    pre_shift = figure.loss * figure.num_tokens / pre_shift_count
    ours = _relative(figure.loss, reference)
    by_means, by_count = _relative(mean_of_means, reference), _relative(pre_shift, reference)
    print(
        f"relative to the reference: ours {ours:.1e}, mean of batch means {by_means:.1e}, "
        f"pre-shift count {by_count:.1e} ({pre_shift_count} tokens, not {figure.num_tokens})"
    )
    assert by_means > 1000 * EXACT_TOL and by_count > 1000 * EXACT_TOL
    assert ours <= EXACT_TOL


def _two_rank_worker(rank: int) -> list[dict]:
    """This rank's share of the rows at ``batch_size_val`` 1 and 3, on a tiny model sharded with
    FSDP2 over both ranks (one launch of the ranks for both sizes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    model = tiny_model()
    loss_fn = make_loss("chunked", model)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    results = []
    for batch_size in (1, 3):
        validation_set = _validation_set(_rows(), batch_size, num_replicas=2, rank=rank)
        figure = validation_loss(model, loss_fn, validation_set, device=CPU)
        results.append(
            {
                "batch_size": batch_size,
                "loss": figure.loss,
                "num_tokens": figure.num_tokens,
                "own_samples": len(validation_set.indices),
            }
        )
    return results


def test_two_ranks_give_the_full_set_loss(two_ranks) -> None:
    rows = _rows()
    reference = _reference(rows)
    by_rank = two_ranks(_two_rank_worker)
    for rank, results in enumerate(by_rank):
        for result in results:
            # Rank 1 holds 7 samples to rank 0's 8: at batch size 1 it runs one filler.
            assert result["own_samples"] == [8, 7][rank]
            print(f"2 ranks, rank {rank}, bs {result['batch_size']}: ours {result['loss']!r}")
            assert _relative(result["loss"], reference) <= EXACT_TOL
            assert result["num_tokens"] == by_rank[0][0]["num_tokens"]
    print(f"reference {reference!r}")


def test_max_val_batches_reads_the_first_rows() -> None:
    rows = _rows()
    collate = micro_batch_collate(
        MicroBatchingSettings(batch_size=2), "torchtune.data.padded_collate_sft", 0, IGNORE_INDEX
    )
    capped = ValidationSet(_samples(rows), batch_size=2, collate=collate, max_batches=3)
    model = tiny_model()
    figure = validation_loss(model, make_loss("chunked", model), capped, device=CPU)
    assert figure.num_samples == 6
    assert _relative(figure.loss, _reference(rows[:6])) <= EXACT_TOL


def test_validating_between_steps_leaves_training_unchanged() -> None:
    """With attention dropout, two SGD steps with a validation between them end on the same
    weights, bit for bit, as two without: eval mode draws nothing, the RNG state is restored."""
    rows = _rows()

    def train(validate: bool) -> tuple[torch.Tensor, bool]:
        torch.manual_seed(0)
        model = tiny_model(attn_dropout=0.5)
        loss_fn = make_loss("cross_entropy", model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            model.train()
            optimizer.zero_grad()
            reference_loss(model, rows[step * 4 : step * 4 + 4]).backward()
            optimizer.step()
            if validate:
                validation_loss(model, loss_fn, _validation_set(rows, 4), device=CPU)
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return weights, model.training

    plain, _ = train(validate=False)
    validated, still_training = train(validate=True)
    assert still_training
    assert torch.equal(plain, validated)


def test_validation_is_due_every_n_steps_and_once_at_an_epoch_end() -> None:
    validation = Validation(_validation_set(_rows(), 4), every_n_steps=2, metric_logger=None)
    due = []
    for step in range(1, 6):
        if validation.due(step):
            due.append(step)
            validation._last_step = step
    assert due == [2, 4]
    assert not validation.due(4, epoch_end=True)  # validated after step 4 already
    assert validation.due(5, epoch_end=True)


def test_validation_keys_need_dataset_val() -> None:
    cfg = tiny_config("full_single_device", run_val_every_n_steps=2)
    with pytest.raises(ValueError, match="'run_val_every_n_steps' needs dataset_val"):
        validate_config(cfg, FullFinetuneSingleDeviceConfig, "full_finetune_single_device")
    with_val = tiny_config("full_single_device", run_val_every_n_steps=2, max_val_batches=0)
    with_val.dataset_val = OmegaConf.to_container(with_val.dataset)
    with pytest.raises(ValueError, match="'max_val_batches' must be null or at least 1"):
        validate_config(with_val, FullFinetuneSingleDeviceConfig, "full_finetune_single_device")
    best = tiny_config("full_single_device", keep_best_checkpoint=True)
    with pytest.raises(ValueError, match="'keep_best_checkpoint' needs dataset_val.*=false"):
        validate_config(best, FullFinetuneSingleDeviceConfig, "full_finetune_single_device")
    for name, schema, recipe in (
        ("grpo_distributed", GrpoDistributedConfig, "grpo_full_finetune_distributed"),
        ("ppo_single_device", PpoFullFinetuneSingleDeviceConfig, "ppo_full_finetune_single_device"),
    ):
        rl = tiny_config(name, keep_best_checkpoint=True)
        with pytest.raises(ValueError, match="'keep_best_checkpoint' needs dataset_val"):
            validate_config(rl, schema, recipe)
        rl.dataset_val = OmegaConf.to_container(rl.dataset)
        validate_config(rl, schema, recipe)  # GRPO and PPO keep the best too


def test_a_split_of_the_training_data_is_disjoint_from_it_and_covers_it() -> None:
    """docs/validation.md: ``dataset_val`` as a split of the training data, through the builder's
    own ``split`` key (Hugging Face's split slicing), on the tiny configs' JSON file: training
    ``train[:90%]`` and validation ``train[90%:]`` are, in order, the whole file, no row in both."""
    from torchtune import config

    cfg = tiny_config("full_single_device")
    tokenizer = config.instantiate(cfg.tokenizer)

    def rows(split: str) -> list[dict]:
        section = OmegaConf.merge(cfg.dataset, {"split": split})
        return list(config.instantiate(section, tokenizer)._data)  # the source rows

    training, validation, whole = rows("train[:90%]"), rows("train[90%:]"), rows("train")
    print(f"{len(training)} training rows, {len(validation)} validation rows of {len(whole)}")
    assert len(training) == round(0.9 * len(whole)) and validation
    assert training + validation == whole  # disjoint by position, and nothing left out
