"""Frozen models (exactga.model_build.frozen): the rule every teacher and reference model follows.

A frozen forward builds no graph and keeps no activations, and it runs under FSDP2 on any
number of ranks, one included (issue #22: inference mode crashed FSDP2's unshard there). The
sharded cases run the distillation step of the library (``Distiller.loss_step``) with a teacher
sharded by torchtune's ``shard_model``, tied and untied, on 1 and 2 gloo ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss, ForwardKLWithChunkedOutputLoss
from torchtune.training import shard_model
from unit_utils import prompt_masked_batch, run_on_ranks

from exactga.kd.distillation import Distiller
from exactga.model_build import frozen
from exactga.model_build.frozen import freeze_model, frozen_forward
from exactga.runtime.precision import Precision

VOCAB = 64
REPO = Path(__file__).resolve().parents[1]


def _decoder(embed_dim: int, seed: int, tied: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return llama3_2(
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=embed_dim,
        intermediate_dim=2 * embed_dim,
        max_seq_len=64,
        tie_word_embeddings=tied,
    )


def _count_saved_tensors(run) -> int:
    """How many tensors autograd saves for backward while ``run()`` runs."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return len(saved)


def test_a_frozen_forward_builds_no_graph_and_saves_no_activation():
    """The same forward saves activations when run as a trained model would, none when run
    frozen, and its output carries no graph: the teacher's memory is its weights and logits."""
    teacher = freeze_model(_decoder(32, seed=1))
    tokens = prompt_masked_batch(VOCAB)["tokens"]
    assert not any(p.requires_grad for p in teacher.parameters())
    assert not teacher.training
    # With a trainable input (as a LoRA student's frozen base has) autograd saves activations.
    embedded = teacher.tok_embeddings(tokens).detach().requires_grad_(True)

    def run_layers() -> None:
        hidden = embedded
        for layer in teacher.layers:
            hidden = layer(hidden)

    assert _count_saved_tensors(run_layers) > 0
    with frozen_forward():
        assert _count_saved_tensors(run_layers) == 0
        logits = teacher(tokens)
    assert logits.grad_fn is None and not logits.requires_grad


def _sharded_kd_worker(rank: int, tied: bool) -> dict:
    torch.set_num_threads(1)
    world_size = dist.get_world_size()
    teacher = freeze_model(_decoder(48, seed=1, tied=tied))
    reference_teacher = freeze_model(_decoder(48, seed=1, tied=tied))
    shard_model(
        teacher,
        [lambda name, module: isinstance(module, type(teacher.layers[0]))],
        cpu_offload=False,
        reshard_after_forward=True,
    )
    student = _decoder(32, seed=0)
    loss_fn, kd_loss_fn = CEWithChunkedOutputLoss(), ForwardKLWithChunkedOutputLoss()
    for model in (student, teacher, reference_teacher):
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    distiller = Distiller(
        student,
        teacher,
        loss_fn,
        kd_loss_fn,
        kd_ratio=0.5,
        precision=Precision.from_config(torch.float32, "none", torch.device("cpu")),
        device=torch.device("cpu"),
    )
    batch = prompt_masked_batch(VOCAB)
    loss = distiller.loss_step(dict(batch)).main
    loss.backward()
    with frozen_forward():
        sharded = torch.cat(distiller.teacher_logits({"tokens": batch["tokens"]}), dim=1)
        plain = torch.cat(reference_teacher(batch["tokens"]), dim=1)
    return {
        "world_size": world_size,
        "loss_finite": bool(torch.isfinite(loss).item()),
        "student_has_grads": all(
            p.grad is not None and torch.isfinite(p.grad).all().item() for p in student.parameters()
        ),
        "teacher_grads": sum(p.grad is not None for p in teacher.parameters()),
        "sharded_vs_plain": (sharded - plain).abs().max().item(),
    }


@pytest.mark.parametrize("world_size", [1, 2], ids=["one_rank", "two_ranks"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_sharded_teacher_distils_on_any_number_of_ranks(tmp_path, world_size, tied):
    """One rank is the case issue #22 crashed on; the teacher's logits equal the unsharded
    teacher's and no teacher parameter gets a gradient."""
    results = run_on_ranks(_sharded_kd_worker, (tied,), tmp_path, world_size=world_size)
    for result in results:
        assert result["world_size"] == world_size
        assert result["loss_finite"] and result["student_has_grads"]
        assert result["teacher_grads"] == 0
        assert result["sharded_vs_plain"] <= 1e-5


def test_inference_mode_is_what_broke_one_rank(tmp_path, monkeypatch):
    """The test above can fail: with inference mode back in the one rule, the one-rank sharded
    teacher fails as issue #22 reported. (Kept to show why the rule is ``no_grad``.)"""
    monkeypatch.setattr(frozen, "frozen_forward", torch.inference_mode)
    monkeypatch.setattr("exactga.kd.distillation.frozen_forward", torch.inference_mode)
    with pytest.raises(Exception) as failure:  # noqa: B017 - the rank's error is re-raised
        run_on_ranks(_sharded_kd_worker, (True,), tmp_path, world_size=1, start_method="fork")
    assert "Inference tensors do not track version counter" in str(failure.value)


def test_no_other_module_picks_its_own_frozen_forward():
    """Every frozen forward goes through exactga.model_build.frozen: no other grad mode is chosen
    for a teacher or reference model anywhere in the library or the recipes."""
    offenders = []
    for path in [*(REPO / "src" / "exactga").rglob("*.py"), *(REPO / "recipes").glob("*.py")]:
        if path.name == "frozen.py":
            continue
        if "inference_mode" in path.read_text():
            offenders.append(path.name)
    assert not offenders, f"choose a frozen forward through exactga.model_build.frozen: {offenders}"
