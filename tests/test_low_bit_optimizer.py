"""torchao's 8-bit AdamW in recipes/lora_finetune.py, through the real ``tune run``.

The LoRA docs and configs/tiny/qlora_single_device.yaml offer
``optimizer._component_=torchao.optim.AdamW8bit``. What exactga does with it is what is tested:
the recipe builds it from the config section over the adapters, steps it, saves its 8-bit state
in a step checkpoint, and a resume loads that state (``weights_only=True``) and ends on the
adapters of the run it resumes, bit for bit, having trained only the step after its checkpoint
(a run retrained from step 0 would end on the same adapters; the steps it logs tell it apart).

The runs (uninterrupted, stopped after step 2, resumed) run one after another with
tests/test_precision_recipes.py's stochastic-rounding runs (tests/torchao_eager_runs.py, which
says why they run torchao's optimizer step eagerly).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from many_runs import Run
from recipe_utils import load_adapters, logged_steps, lora_tiny_args
from torchao_eager_runs import GROUP, STOPPED_STATUS, eager_runs, stopped_and_resumed

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(GROUP)]

ADAPTERS = "epoch_0/adapter_model.pt"
STEPS = 3
STOP_AFTER = STEPS - 1
# torchao keeps 8-bit moments only for tensors of at least 4096 elements: rank 64 on the small
# model's width of 64 makes the attention and MLP adapters that large.
RUN = {"model__lora_rank": 64, "max_steps_per_epoch": STEPS, "save_every_n_steps": 1}
OPTIMIZER = "optimizer._component_=torchao.optim.AdamW8bit"


def planned_runs(root: Path) -> list[Run]:
    """This module's runs, for tests/torchao_eager_runs.py's launch."""
    return stopped_and_resumed(
        root, lambda out: [*lora_tiny_args(out, **RUN), OPTIMIZER], STOP_AFTER
    )


def _status_and_output(folder: Path) -> tuple[int, str]:
    return int((folder / "returncode").read_text()), (folder / "output.txt").read_text()


def test_adamw8bit_trains_saves_8bit_state_and_resumes_bit_identically(run_once):
    root = eager_runs(run_once, "adamw8bit")
    status, output = _status_and_output(root / "uninterrupted")
    assert status == 0, output[-4000:]
    uninterrupted = load_adapters(root / "uninterrupted" / "out" / ADAPTERS)
    lora_b = [v for k, v in uninterrupted.items() if "lora_b" in k]
    assert lora_b and all(float(v.abs().max()) > 0 for v in lora_b)  # trained away from B = 0
    assert all(torch.isfinite(v).all() for v in uninterrupted.values())

    status, output = _status_and_output(root / "stopped")
    assert status == STOPPED_STATUS, output[-4000:]
    # The state the resume loads: 8-bit moments for the large adapters, fp32 for the others.
    import torchao.optim  # noqa: F401 - allows its state's tensor types under weights_only

    checkpoint = root / "stopped" / "out" / "step_checkpoints" / f"step_{STOP_AFTER:06d}"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    kinds = {type(s["exp_avg"]).__name__ for s in state.values() if s["exp_avg"].numel() >= 4096}
    assert kinds == {"OptimState8bit"}, kinds

    status, output = _status_and_output(root / "resumed")
    assert status == 0, output[-4000:]
    assert "Resuming from step checkpoint" in output
    resumed = load_adapters(root / "stopped" / "out" / ADAPTERS)
    assert resumed.keys() == uninterrupted.keys()
    for key, tensor in uninterrupted.items():
        assert torch.equal(resumed[key], tensor), key
    losses = logged_steps(root / "resumed" / "logs")  # step 3 alone, with the uninterrupted loss
    assert list(losses) == [STEPS], f"the resumed run logged steps {list(losses)}"
    assert losses[STEPS] == logged_steps(root / "uninterrupted" / "out" / "logs")[STEPS]
