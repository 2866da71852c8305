"""torchao's 8-bit AdamW in recipes/lora_finetune.py, through the real ``tune run``.

The LoRA docs and configs/tiny/qlora_single_device.yaml offer
``optimizer._component_=torchao.optim.AdamW8bit``. What exactga does with it is what is tested:
the recipe builds it from the config section over the adapters, steps it, saves its 8-bit state
in a step checkpoint, and a resume loads that state (``weights_only=True``) and ends on the
adapters of the run it resumes, bit for bit, having trained only the step after its checkpoint
(a run retrained from step 0 would end on the same adapters; the steps it logs tell it apart).

torchao compiles its optimizer step with ``torch.compile`` on first use, which on our 2 CPU cores
takes 40 s with an empty compile cache (and minutes beside other tests) and is torchao's own
business; ``TORCHDYNAMO_DISABLE=1`` runs the same step eagerly.
"""

from __future__ import annotations

import pytest
import torch
from recipe_utils import load_adapters, logged_steps, lora_tiny_args, output_of, run_tune

pytestmark = pytest.mark.slow

ADAPTERS = "epoch_0/adapter_model.pt"
STEPS = 3
EAGER = {"TORCHDYNAMO_DISABLE": "1"}
# torchao keeps 8-bit moments only for tensors of at least 4096 elements: rank 64 on the small
# model's width of 64 makes the attention and MLP adapters that large.
RUN = {"model__lora_rank": 64, "max_steps_per_epoch": STEPS, "save_every_n_steps": 1}
OPTIMIZER = "optimizer._component_=torchao.optim.AdamW8bit"


def test_adamw8bit_trains_saves_8bit_state_and_resumes_bit_identically(tmp_path):
    out = tmp_path / "run"
    args = [*lora_tiny_args(out, **RUN), OPTIMIZER]
    proc = run_tune(args, extra_env=EAGER)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    uninterrupted = load_adapters(out / ADAPTERS)
    lora_b = [v for k, v in uninterrupted.items() if "lora_b" in k]
    assert lora_b and all(float(v.abs().max()) > 0 for v in lora_b)  # trained away from B = 0
    assert all(torch.isfinite(v).all() for v in uninterrupted.values())

    # The state a resume loads: 8-bit moments for the large adapters, fp32 for the others.
    import torchao.optim  # noqa: F401 - allows its state's tensor types under weights_only

    checkpoints = out / "step_checkpoints"
    state = torch.load(checkpoints / "step_000002" / "optimizer.pt", weights_only=True)["state"]
    kinds = {type(s["exp_avg"]).__name__ for s in state.values() if s["exp_avg"].numel() >= 4096}
    assert kinds == {"OptimState8bit"}, kinds

    # As if the run had stopped after step 2: resume from there to the end.
    for step in range(3, STEPS + 1):
        for path in sorted((checkpoints / f"step_{step:06d}").iterdir()):
            path.unlink()
        (checkpoints / f"step_{step:06d}").rmdir()
    (out / ADAPTERS).unlink()
    resumed_logs = out / "resumed_logs"
    resume = ["resume_from_checkpoint=True", f"metric_logger.log_dir={resumed_logs}"]
    proc = run_tune([*args, *resume], extra_env=EAGER)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert "Resuming from step checkpoint" in output_of(proc)
    resumed = load_adapters(out / ADAPTERS)
    assert resumed.keys() == uninterrupted.keys()
    for key, tensor in uninterrupted.items():
        assert torch.equal(resumed[key], tensor), key
    losses = logged_steps(resumed_logs)  # step 3 alone, with the uninterrupted run's loss
    assert list(losses) == [3], f"the resumed run logged steps {list(losses)}"
    assert losses[3] == logged_steps(out / "logs")[3]
