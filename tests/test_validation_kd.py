"""Validation of a distillation run (exactga.kd.validation), in-process on tiny torchtune models.

``val/class_loss``, ``val/kd_loss`` and ``val/loss`` must each equal a plainly written full-set
reference (tests/oracle_utils.py ``reference_loss``: every scored token after the shift, summed,
over their number; the teacher's forward KL as torchtune writes it) within the fp32 floor for
any ``batch_size_val``, on one process and on 2 gloo ranks with both models under FSDP2 (a rank
with fewer samples runs fillers); a mean of batch means must miss them by far more, so the
comparison can fail. The rows and the validation set are test_validation.py's.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from oracle_utils import reference_loss
from test_validation import _relative, _rows, _validation_set
from torch import nn
from torchtune.modules.loss import (
    CEWithChunkedOutputLoss,
    ForwardKLLoss,
    ForwardKLWithChunkedOutputLoss,
)
from unit_utils import EXACT_TOL, tiny_config, tiny_model

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.config.validation import validate_config
from exactga.kd.distillation import Distiller
from exactga.kd.schema import KnowledgeDistillationSingleDeviceConfig
from exactga.kd.validation import distillation_validation_loss
from exactga.model_build.frozen import freeze_model
from exactga.runtime.precision import Precision

CPU = torch.device("cpu")
KD_RATIO = 0.4


def _models() -> tuple[nn.Module, nn.Module]:
    """A student and a frozen teacher of other weights (seeds 0 and 1). The toy models' output
    distributions are sharply peaked on the same tokens (a class loss near 30, a KD loss near
    5e-4, where fp32 rounding is relatively large); the teacher's (tied) embeddings scaled down
    spread its distribution, so the KD loss is of the class loss's size."""
    teacher = tiny_model(seed=1)
    with torch.no_grad():
        teacher.tok_embeddings.weight.mul_(0.1)
    return tiny_model(seed=0), freeze_model(teacher)


def _distiller(student: nn.Module, teacher: nn.Module, chunked: bool) -> Distiller:
    if chunked:
        loss_fn = CEWithChunkedOutputLoss(num_output_chunks=4)
        kd_loss_fn = ForwardKLWithChunkedOutputLoss(num_output_chunks=4)
        student.set_num_output_chunks(4)
        teacher.set_num_output_chunks(4)
    else:
        loss_fn, kd_loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX), ForwardKLLoss()
    return Distiller(
        student,
        teacher,
        loss_fn,
        kd_loss_fn,
        KD_RATIO,
        precision=Precision.from_config(torch.float32, "none", CPU),
        device=CPU,
    )


def _references(rows: list) -> tuple[float, float, float]:
    """(class loss, KD loss, their mix) of ``rows`` as one batch, written plainly in fp32."""
    student, teacher = _models()
    with torch.no_grad():
        return tuple(
            float(reference_loss(student, rows, teacher, kd_ratio))
            for kd_ratio in (0.0, 1.0, KD_RATIO)
        )


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "plain"])
@pytest.mark.parametrize("batch_size", [1, 3, 15])
def test_distillation_figures_are_the_full_set_losses(batch_size: int, chunked: bool) -> None:
    rows = _rows()
    student, teacher = _models()
    distiller = _distiller(student, teacher, chunked)
    figure = distillation_validation_loss(distiller, _validation_set(rows, batch_size))
    class_ref, kd_ref, mix_ref = _references(rows)
    print(
        f"bs {batch_size} chunked={chunked}: class {figure.class_loss!r} ({class_ref!r}), "
        f"kd {figure.kd_loss!r} ({kd_ref!r}), loss {figure.loss!r} ({mix_ref!r})"
    )
    assert _relative(figure.class_loss, class_ref) <= EXACT_TOL
    assert _relative(figure.kd_loss, kd_ref) <= EXACT_TOL
    assert _relative(figure.loss, mix_ref) <= EXACT_TOL
    assert figure.num_tokens == sum(int((labels[1:] != IGNORE_INDEX).sum()) for _, labels in rows)
    assert figure.perplexity == pytest.approx(math.exp(class_ref), rel=1e-5)
    assert set(figure.metrics()) == {"val/loss", "val/class_loss", "val/kd_loss", "val/perplexity"}
    assert student.training and not teacher.training  # each model's own mode back


def test_a_mean_of_batch_means_misses_them() -> None:
    rows = _rows()
    distiller = _distiller(*_models(), chunked=True)
    figure = distillation_validation_loss(distiller, _validation_set(rows, 3))
    references = _references(rows)
    batches = [rows[i : i + 3] for i in range(0, len(rows), 3)]
    by_batch = [_references(batch) for batch in batches]
    for part, ours in enumerate((figure.class_loss, figure.kd_loss, figure.loss)):
        mean_of_means = sum(batch[part] for batch in by_batch) / len(batches)
        off, missed = _relative(ours, references[part]), _relative(mean_of_means, references[part])
        print(f"part {part}: ours {off:.1e}, mean of batch means {missed:.1e}")
        assert off <= EXACT_TOL and missed > 1000 * EXACT_TOL


def _two_rank_worker(rank: int) -> list[dict]:
    """This rank's share of the rows at ``batch_size_val`` 1 and 3, student and teacher sharded
    with FSDP2 over both ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    student, teacher = _models()
    mesh = init_device_mesh("cpu", (2,))
    for model in (student, teacher):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    distiller = _distiller(student, teacher, chunked=True)
    results = []
    for batch_size in (1, 3):
        validation_set = _validation_set(_rows(), batch_size, num_replicas=2, rank=rank)
        figure = distillation_validation_loss(distiller, validation_set)
        results.append(
            {
                "batch_size": batch_size,
                "parts": (figure.class_loss, figure.kd_loss, figure.loss),
                "own_samples": len(validation_set.indices),
            }
        )
    return results


def test_two_ranks_give_the_full_set_losses(two_ranks) -> None:
    references = _references(_rows())
    for rank, results in enumerate(two_ranks(_two_rank_worker)):
        for result in results:
            assert result["own_samples"] == [8, 7][rank]  # rank 1 runs a filler at size 1
            print(f"2 ranks, rank {rank}, bs {result['batch_size']}: {result['parts']!r}")
            for ours, reference in zip(result["parts"], references, strict=True):
                assert _relative(ours, reference) <= EXACT_TOL
    print(f"references {references!r}")


def test_distillation_recipes_take_dataset_val() -> None:
    cfg = tiny_config("kd_single_device", run_val_every_n_steps=2)
    cfg.dataset_val = OmegaConf.to_container(cfg.dataset)
    validate_config(
        cfg, KnowledgeDistillationSingleDeviceConfig, "knowledge_distillation_single_device"
    )
