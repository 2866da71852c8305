"""A QAT run killed with SIGKILL at a random step resumes to the uninterrupted run's weights,
bit for bit.

recipes/qat_distributed.py on one process (tests/qat_runs.py, ``RESUME``): AdamW with warm-up
and a cosine schedule, clipping, 2 x 2 micro-batches, two epochs of 4 steps with a step
checkpoint after each, fake quantisation off for the first 3 steps. The kill lands after a
randomly drawn step's checkpoint (plus a random delay, so mid-step or mid-save); a kill before
step 3 resumes with fake quantisation off, and the resumed run must switch it on at step 3 from
the step count (``FakeQuantSchedule``), where stock's resume would keep it on. The resumed run,
logging into a folder of its own, trains exactly the steps after its checkpoint, with the
uninterrupted run's losses. ``EXACTGA_KILL_SEED`` replays the draw (printed with ``-rP``).

Launches: the kill, a launch of its own; the uninterrupted and the resumed runs share the QAT
tests' one-process launch (tests/qat_runs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qat_runs import RESUME, RESUME_EPOCHS, RESUME_STEPS_PER_EPOCH, shared_runs
from recipe_utils import load_weights, logged_steps

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("qat")]

FINAL = f"epoch_{RESUME_EPOCHS - 1}/model-00001-of-00001.safetensors"
TOTAL_STEPS = RESUME_EPOCHS * RESUME_STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def resume(run_once) -> Path:
    folder = shared_runs(run_once) / "resume"
    if (folder / "kill_failed").exists():
        pytest.fail(f"the kill failed:\n{(folder / 'kill_failed').read_text()}")
    print((folder / "draw").read_text())
    return folder


def _launched(folder: Path) -> str:
    output = (folder / "output.txt").read_text()
    assert (folder / "returncode").read_text() == "0", output[-4000:]
    return output


def test_killed_qat_run_resumes_to_the_uninterrupted_weights_bit_for_bit(resume: Path) -> None:
    reference = resume / "uninterrupted"
    _launched(reference)
    output = _launched(resume / "resumed")
    assert "Resuming from step checkpoint" in output
    checkpoint = int((resume / "checkpoint").read_text())
    switch = RESUME["fake_quant_after_n_steps"]
    if checkpoint < switch:  # resumed with fake quantisation off: the run switches it on
        assert f"Step {checkpoint}: Disabling fake quant" in output, output[-4000:]
        assert f"Step {switch}: Enabling fake quant" in output, output[-4000:]
    else:  # resumed past the switch: on from its first step
        assert f"Step {checkpoint}: Enabling fake quant" in output, output[-4000:]
        assert "Disabling fake quant" not in output

    final, expected = load_weights(resume / "killed" / FINAL), load_weights(reference / FINAL)
    assert final.keys() == expected.keys()
    differing = [name for name in expected if not torch.equal(final[name], expected[name])]
    print(f"killed after step {checkpoint}: {len(differing)} of {len(expected)} tensors differ")
    assert not differing

    resumed, full = logged_steps(resume / "resumed_logs"), logged_steps(reference / "logs")
    assert list(full) == list(range(1, TOTAL_STEPS + 1))
    assert list(resumed) == list(range(checkpoint + 1, TOTAL_STEPS + 1))
    for step, loss in resumed.items():
        assert loss == full[step], step  # the same step, the same numbers
