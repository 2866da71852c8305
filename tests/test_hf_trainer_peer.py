"""benchmarks/hf_trainer_peer.py on CPU at its tiny size: Hugging Face's Trainer on our rows.

In-process, no ``tune run``: the benchmark's own functions, imported from the file, on the small
shape and a few steps. What it checks is what the GPU report will rest on: the Trainer sees our
samples in our order, both collations train, padding-free SDPA keeps documents apart (and the
one setting that makes it so), HF's accumulation is split-invariant where the old mean of means
is not, and the step timer reads the clock it is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "hf_trainer_peer", REPO_ROOT / "benchmarks/hf_trainer_peer.py"
)
peer = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = peer  # its dataclasses look their module up there
_spec.loader.exec_module(peer)

FP32_FLOOR = 1e-5  # relative, as docs/ga_parity.md's noise floor
SPLIT_STEPS = 2
# 2 x 2 per step, 3 steps of which 1 warm-up: 12 samples.
SMALL_RUN = argparse.Namespace(size="tiny", batch_size=2, ga=2, steps=3, warmup_steps=1)


@pytest.fixture(scope="module")
def samples() -> tuple[list[dict], int]:
    """Enough samples in our order for the split runs (8 a step), and the pad id."""
    return peer.ordered_samples(peer.max_seq_len("tiny"), 8 * SPLIT_STEPS)


def test_samples_come_in_our_loaders_order(samples):
    rows, _ = samples
    ours = peer.gpu_1b.sample_lengths(
        argparse.Namespace(max_seq_len=peer.max_seq_len("tiny"), batch_size=2, ga=4, steps=2)
    )
    assert [len(s["input_ids"]) for s in rows] == [n for step in ours for n in step]


def _clock(times: list[float]):
    """A clock that returns ``times`` in turn, and fails if read once more."""
    readings = iter(times)
    return lambda: next(readings)


@pytest.mark.parametrize("collation", peer.COLLATIONS)
def test_both_collations_train(samples, collation, tmp_path):
    rows, pad_id = samples
    device = torch.device("cpu")
    model = peer.new_model(peer.model_shape("tiny"), peer.attention_for(collation), device)
    initial = peer.trained_weights(model)
    arguments = peer.trainer_arguments(
        str(tmp_path),
        batch_size=2,
        ga=2,
        num_steps=2,
        optimizer=peer.optimizer_settings([], device),
        bf16=False,
        tf32=None,
    )
    outcome = peer.train(model, rows, collation, arguments, pad_id, _clock([0.0, 0.5, 0.75]))

    assert len(outcome.losses) == 2 and all(math.isfinite(loss) for loss in outcome.losses)
    moved = sum(float((w - initial[n]).norm()) for n, w in peer.trained_weights(model).items())
    assert moved > 0
    assert outcome.step_seconds == [0.5, 0.25]
    assert outcome.tokens == sum(len(s["input_ids"]) for s in rows[:8])
    if collation == "padded":
        assert outcome.positions > outcome.tokens  # the samples differ in length
    else:
        assert outcome.positions == outcome.tokens


def test_row_reads_the_injected_clock(samples):
    rows, pad_id = samples
    # train begins, then 3 step ends: steps of 4, 0.2 and 0.4 s; the first is warm-up.
    row = peer.measure("padded", rows, pad_id, SMALL_RUN, clock=_clock([0.0, 4.0, 4.2, 4.6]))

    timed_tokens = sum(len(s["input_ids"]) for s in rows[4:12])
    assert row.ms_per_step == pytest.approx(300.0)
    assert row.tokens_per_s == pytest.approx(timed_tokens / 0.6)
    assert row.mfu is None and row.peak_gib is None  # CPU
    assert 0 < row.padding < 1


def test_flattened_sdpa_keeps_documents_apart(samples):
    rows, pad_id = samples
    assert peer.attention_for("padding_free") == "sdpa"  # no flash_attn here
    assert peer.document_separation(rows, pad_id) < FP32_FLOOR


def test_flattened_documents_mix_with_the_cache_on(samples):
    """The catch the separation rests on: LlamaConfig's default ``use_cache=True`` makes a
    cache in every forward, and with one transformers skips the packed-sequence mask. The
    Trainer turns the cache off; a model called as configured lets documents attend across."""
    rows, _ = samples
    model = peer.new_model(peer.model_shape("tiny"), "sdpa", torch.device("cpu"))
    assert model.config.use_cache
    assert peer.flattened_logit_gap(model, rows[:3]) > 1e-3


def test_hf_accumulation_is_split_invariant(samples):
    rows, pad_id = samples
    padded = peer.split_gap("padded", rows, pad_id, SPLIT_STEPS)
    padding_free = peer.split_gap("padding_free", rows, pad_id, SPLIT_STEPS)
    mean_of_means = peer.split_gap("padded", rows, pad_id, SPLIT_STEPS, mean_of_means=True)
    print(
        f"padded {padded:.1e}, padding_free {padding_free:.1e}, mean of means {mean_of_means:.1e}"
    )

    assert padded < FP32_FLOOR
    assert padding_free < FP32_FLOOR
    assert mean_of_means > 1000 * max(padded, padding_free)  # the measure can tell them apart


def test_step_flops_are_gpu_1b_variable_lengths():
    model = peer.new_model(peer.model_shape("1b"), "sdpa", torch.device("meta"))
    lengths = [74, 134, 1024]
    assert peer.step_flops(lengths, model) == peer.gpu_1b.step_flops(lengths)


def test_main_writes_the_report(tmp_path):
    out = tmp_path / "peer.json"
    argv = ["--size", "tiny", "--batch-size", "2", "--ga", "2", "--steps", "2"]
    assert peer.main([*argv, "--warmup-steps", "1", "--json", str(out)]) == 0

    report = json.loads(out.read_text())
    padded, padding_free = report["rows"]
    assert (padded["run"], padding_free["run"]) == ("hf_padded", "hf_padding_free")
    assert padded["padding"] > 0 and padding_free["padding"] == 0
    assert report["splits"] == []
    assert "| hf_padding_free | sdpa |" in report["markdown"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on CUDA")
def test_without_cuda_the_1b_size_measures_nothing(tmp_path, capsys):
    out = tmp_path / "peer.json"
    assert peer.main(["--json", str(out)]) == 0
    assert "no CUDA device; nothing measured" in capsys.readouterr().out
    assert json.loads(out.read_text())["markdown"] == "No CUDA device: nothing measured."
