"""The fast tier's resume check: a run resumed from a mid-epoch step checkpoint trains only the
steps after it, and ends where the uninterrupted run ends, bit for bit.

No kill here (tests/test_resume.py kills runs at random points, in the slow tier): the
uninterrupted run keeps a step checkpoint of every step, and the resumed run starts in a folder
holding only its initial weights and the checkpoint of step 2 of 3. A run that printed
"Resuming" and then trained from step 0 would end on the same weights (same seed, same data);
only the steps it logged, into a folder of its own, tell it apart.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from recipe_utils import (
    INITIAL,
    TRAINED,
    load_weights,
    logged_steps,
    output_of,
    run_recipe,
    tiny_args,
)

# One worker makes the module fixture under ``pytest -n``, not each (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("resume_fast")

STEPS = 3
RESUME_AFTER = 2


def _args(output_dir: Path) -> list[str]:
    return tiny_args(output_dir, max_steps_per_epoch=STEPS, epochs=1, save_every_n_steps=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """(uninterrupted run, resumed run) output folders; the resumed one logs to ``logs_resumed``."""
    root = tmp_path_factory.mktemp("resume_fast")
    uninterrupted, resumed = root / "uninterrupted", root / "resumed"
    proc = run_recipe(_args(uninterrupted))
    assert proc.returncode == 0, output_of(proc)[-4000:]
    step = f"step_checkpoints/step_{RESUME_AFTER:06d}"
    shutil.copytree(uninterrupted / Path(INITIAL).parent, resumed / Path(INITIAL).parent)
    shutil.copytree(uninterrupted / step, resumed / step)
    logs = ["resume_from_checkpoint=True", f"metric_logger.log_dir={resumed / 'logs_resumed'}"]
    proc = run_recipe(_args(resumed) + logs)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    return uninterrupted, resumed


def test_a_resumed_run_trains_only_the_steps_after_its_checkpoint(runs) -> None:
    uninterrupted, resumed = runs
    expected = logged_steps(uninterrupted / "logs")
    assert sorted(expected) == list(range(1, STEPS + 1))
    losses = logged_steps(resumed / "logs_resumed")
    print(f"resumed after step {RESUME_AFTER}: logged {losses}")
    assert losses == {step: expected[step] for step in range(RESUME_AFTER + 1, STEPS + 1)}


def test_a_resumed_run_ends_on_the_uninterrupted_weights_bit_for_bit(runs) -> None:
    uninterrupted, resumed = runs
    final, reference = load_weights(resumed / TRAINED), load_weights(uninterrupted / TRAINED)
    assert final.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(final[key], tensor), key
