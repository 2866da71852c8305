"""recipes/knowledge_distillation.py run through the real ``tune run`` on CPU.

Tier (b) of docs/contributing.md point 9: the tiny KD config (a teacher twice as wide as the small
student), on the shipped data, in a subprocess, offline. The recipe is never imported; everything
is read back from what a run writes. Run with ``-rP`` to see the measured distances docs/ quotes.

Launches: a killed run, and one for the rest (tests/kd_utils.py): the six parity runs (two cases
x 8x1, 1x8, 2x4, one after another: see tests/many_runs.py; the 8x1 runs are shared with
tests/test_recipe_kd_distributed.py), the run with an empty window and the killed run's resume:
two.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from kd_utils import (
    ADAPTER_CONFIG,
    ADAPTERS,
    BASE,
    CASES,
    EMPTY_WINDOW,
    KILLED,
    MERGED,
    ONE_DEVICE_SPLITS,
    PARITY_STEPS,
    PEFT_ADAPTERS,
    RESUME_CASE,
    VALIDATED_STEPS,
    VALIDATION_TAGS,
    initial_adapters,
    one_device_folder,
    one_rank_run,
)
from profiling_utils import read_reports
from recipe_utils import (
    load_adapters,
    load_weights,
    logged_steps,
    read_scalars,
    relative_l2,
)

from exactga.profiling import REPORT_CATEGORY

# The tests read the KD modules' shared runs (tests/kd_utils.py): one group.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("kd_recipes")]

SPLITS = ONE_DEVICE_SPLITS


@pytest.fixture(scope="module")
def parity_runs(run_once) -> dict[tuple[str, tuple[int, int]], Path]:
    """Every case under every split, made once per session one after another."""
    keys = [(case, split) for case in CASES for split in SPLITS]
    return {key: one_rank_run(run_once, *key) for key in keys}


@pytest.mark.parametrize("case", list(CASES))
def test_accumulation_splits_match_full_batch(parity_runs, case):
    """8x1, 1x8 and 2x4 distil into the same student adapters (fp64 <= 1e-7, fp32 <= 2e-6)."""
    tolerance = CASES[case][1]
    reference = parity_runs[(case, SPLITS[0])]
    a_ref, a_init = load_adapters(reference / ADAPTERS), initial_adapters(case)
    assert a_ref.keys() == a_init.keys()
    ref_scalars = read_scalars(reference / "logs")
    assert len(ref_scalars["loss"]) == PARITY_STEPS
    for split in SPLITS[1:]:
        run = parity_runs[(case, split)]
        scalars = read_scalars(run / "logs")
        assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]
        rel = relative_l2(load_adapters(run / ADAPTERS), a_ref, a_init)
        print(f"{case} {split[0]}x{split[1]} vs 8x1: relative L2 {rel:.3e}")
        assert rel <= tolerance, f"{split} differs from 8x1 by {rel:.3e}"
        for name in ("loss", "class_loss", "kd_loss"):  # the same window means, to rounding
            for ours, ref in zip(scalars[name], ref_scalars[name], strict=True):
                assert math.isclose(ours, ref, rel_tol=1e-5), (name, ours, ref)


def test_metrics_are_stocks_and_ours_and_loss_mixes_both(parity_runs):
    """Stock's names (``loss``, ``class_loss``, ``kd_loss``, ``lr``,
    ``tokens_per_second_per_gpu``) and ours on every step; ``loss`` is the kd_ratio mix."""
    scalars = read_scalars(parity_runs[(RESUME_CASE, (8, 1))] / "logs")
    names = ("loss", "class_loss", "kd_loss", "lr", "tokens_per_second_per_gpu")
    ours = ("loss_tokens", "skipped_steps", "time/step_ms", "time/forward_ms")
    for name in names + ours:
        assert len(scalars.get(name, [])) == PARITY_STEPS, f"metric {name!r}"
    for loss, ce, kd in zip(
        scalars["loss"], scalars["class_loss"], scalars["kd_loss"], strict=True
    ):
        assert math.isclose(loss, 0.5 * ce + 0.5 * kd, rel_tol=1e-6)
        assert ce > 0 and kd > 0 and ce != kd


def test_validation_reports_the_students_losses_at_every_split(parity_runs):
    """The fp32 case validates after steps 2, 4 and 6: ``val/loss`` is the kd_ratio mix of
    ``val/class_loss`` and ``val/kd_loss``, ``val/perplexity`` is exp of the class loss, and
    8x1, 1x8 and 2x4 (adapters within 3.5e-7 of each other) report the same figures."""
    figures = {
        split: {
            tag: logged_steps(parity_runs[(RESUME_CASE, split)] / "logs", tag)
            for tag in VALIDATION_TAGS
        }
        for split in SPLITS
    }
    reference = figures[SPLITS[0]]
    assert list(reference["val/loss"]) == VALIDATED_STEPS
    for step in VALIDATED_STEPS:
        loss, ce, kd = (reference[tag][step] for tag in VALIDATION_TAGS[:3])
        print(f"step {step}: val/loss {loss:.6f} class {ce:.6f} kd {kd:.6f}")
        assert math.isclose(loss, 0.5 * ce + 0.5 * kd, rel_tol=1e-6) and ce != kd
        assert math.isclose(reference["val/perplexity"][step], math.exp(ce), rel_tol=1e-5)
    for split in SPLITS[1:]:
        for tag in VALIDATION_TAGS:
            ours = figures[split][tag]
            assert list(ours) == VALIDATED_STEPS, (split, tag)
            for step, value in ours.items():
                assert math.isclose(value, reference[tag][step], rel_tol=1e-5), (split, tag)


def test_profiling_report_is_written_to_tensorboard(parity_runs):
    """The SFT recipes' TensorBoard report: the custom-scalars layout and the text summary."""
    ((_, report),) = read_reports(parity_runs[(RESUME_CASE, (8, 1))] / "logs").items()
    (category,) = report["layout"]["category"]
    assert category["title"] == REPORT_CATEGORY and len(category["chart"]) == 4
    assert "**Saved latency**" in report["markdown"] and "| forward |" in report["markdown"]


def test_artefacts_match_stock_layout(parity_runs):
    """Student adapters (torchtune's and PEFT's format), adapter config and merged student
    weights; the merged weights differ from the student's base only where LoRA applies, and
    nothing of the teacher is written beside them."""
    out = parity_runs[(RESUME_CASE, (8, 1))]
    adapters, peft = load_adapters(out / ADAPTERS), load_weights(out / PEFT_ADAPTERS)
    assert len(peft) == len(adapters) and all(k.startswith("base_model.model.") for k in peft)
    adapter_config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 8
    merged, base = load_weights(out / MERGED), load_weights(out / BASE)
    assert merged.keys() == base.keys()
    assert all(merged[k].shape == base[k].shape for k in merged)  # the student's, not teacher's
    changed = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert changed and all("proj" in k for k in changed), sorted(changed)
    # The epoch folder is the merged model alone: its PEFT adapter is in adapter/, where
    # transformers does not attach it to the merged weights a second time (issue #23).
    assert sorted(p.name for p in (out / "epoch_0").glob("*.safetensors")) == [
        "model-00001-of-00001.safetensors"
    ]
    assert not (out / "epoch_0" / "adapter_config.json").exists()
    assert adapter_config["base_model_name_or_path"] == str((out / "base_model").resolve())


def test_killed_run_resumes_bit_identically(run_once):
    """SIGKILL once a random step's checkpoint exists (plus a random delay, so mid-step or
    mid-save); the resumed run ends with exactly the uninterrupted run's adapters, and trains
    only the steps after its checkpoint: a run retrained from step 0 would end on the same
    adapters too (same seed, same data), and only the steps it logs tell it apart."""
    reference = one_rank_run(run_once, RESUME_CASE, (8, 1))  # the uninterrupted run
    folder = one_device_folder(run_once, KILLED)
    print((folder / "draw").read_text())
    if (folder / "kill_failed").exists():
        pytest.fail(f"the kill failed:\n{(folder / 'kill_failed').read_text()}")
    checkpoint = int((folder / "checkpoint").read_text())  # what the resumed run went on from
    output = (folder / "launch" / "output.txt").read_text()
    assert (folder / "launch" / "returncode").read_text() == "0", output[-4000:]
    assert "Resuming from step checkpoint" in output
    resumed = load_adapters(folder / "run" / ADAPTERS)
    uninterrupted = load_adapters(reference / ADAPTERS)
    assert resumed.keys() == uninterrupted.keys()
    for key, tensor in uninterrupted.items():
        assert torch.equal(resumed[key], tensor), key
    # The steps after the checkpoint and no other, each with the uninterrupted run's loss.
    losses, expected = logged_steps(folder / "logs"), logged_steps(reference / "logs")
    print(f"resumed after step {checkpoint}: logged steps {list(losses)}")
    assert list(losses) == list(range(checkpoint + 1, PARITY_STEPS + 1))
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], rel=1e-6), step
    # Validation: the uninterrupted run's steps after the checkpoint, with its figures.
    validated = logged_steps(folder / "logs", "val/loss")
    reference_figures = logged_steps(reference / "logs", "val/loss")
    assert list(validated) == [step for step in VALIDATED_STEPS if step > checkpoint]
    for step, loss in validated.items():
        assert loss == pytest.approx(reference_figures[step], rel=1e-6), step


def test_window_without_loss_tokens_skips_its_step(run_once):
    """Prompts longer than max_seq_len leave every label masked: that window skips its step
    (the teacher is never asked), the others train, and the adapters stay finite."""
    folder = one_device_folder(run_once, EMPTY_WINDOW)
    output = (folder / "output.txt").read_text()
    assert (folder / "returncode").read_text() == "0", output[-4000:]
    assert "no loss token in this accumulation window" in output
    out = folder / "out"
    scalars = read_scalars(out / "logs")
    assert scalars["skipped_steps"] == [1.0, 1.0, 1.0]
    assert scalars["loss_tokens"][0] == 0
    assert len(scalars["kd_loss"]) == len(scalars["class_loss"]) == 2  # none for the empty one
    assert all(math.isfinite(v) for v in scalars["kd_loss"] + scalars["class_loss"])
    for name, tensor in load_adapters(out / ADAPTERS).items():
        assert torch.isfinite(tensor).all(), name
