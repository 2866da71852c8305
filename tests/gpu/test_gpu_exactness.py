"""fp32 on CUDA through ``tune run``: paths that must not change the numbers.

- ``optimizer_in_bwd``: one AdamW per parameter stepped inside backward trains the same
  weights as one AdamW stepped after it.
- Packed data with flex attention: one step on packs equals one step on the same rows
  unpacked (the same loss tokens, the same loss, the same update).

Both compare in fp32, where the only differences left are the order of floating-point sums,
so the bounds are those of the CPU parity tests (docs/math.md), not bf16's.
"""

from __future__ import annotations

import pytest
from cuda_runs import FULL_SINGLE, INITIAL, Launch, launch_all, max_relative_difference
from recipe_utils import REPO_ROOT, relative_l2

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu_exactness")]

# The fp32 parity bound of the CPU tests: two runs whose only difference is summation order
# land about 1e-7 to 1e-6 apart after a few AdamW steps.
FP32_PARITY = 1e-5
ADAMW_STEPS = 6
OPTIMIZER = {
    "dtype": "fp32",
    "gradient_accumulation_steps": 1,
    "clip_grad_norm": "null",
    "max_steps_per_epoch": ADAMW_STEPS,
}

# Packing: the rows of the first PACKS packs of 1024 tokens, one SGD step, no shuffling, so
# both runs see the same rows. With train_on_input False every row's first label (its prompt)
# is masked, so the label a pack's row boundary shifts in is masked too: the loss tokens match.
PACK_LEN = 1024
PACKS = 4
# Flex attention and the unpacked run's SDPA kernel sum in different orders over 1024 keys;
# fp32 keeps that under 1e-6 relative, and one plain SGD step (lr 0.5, no state) passes the
# gradient's error into the update unchanged.
PACKED_LOSS_RTOL = 1e-5
PACKED_UPDATE_RTOL = 1e-4
SGD_ONE_STEP = {
    "dtype": "fp32",
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "~optimizer.weight_decay": None,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
    "gradient_accumulation_steps": 1,
    "max_steps_per_epoch": 1,
    "shuffle": False,
    "tokenizer.max_seq_len": PACK_LEN,
    "model.max_seq_len": PACK_LEN,
}


def rows_in_first_packs(num_packs: int) -> int:
    """How many dataset rows torchtune's packer puts in the first ``num_packs`` packs.

    Every row starts at position 0; the padding at a pack's end continues the positions
    (torchtune's ``PackedDataset``), so the zeros of ``input_pos`` count the rows.
    """
    from torchtune.datasets import alpaca_dataset
    from torchtune.models.llama2 import llama2_tokenizer

    tokenizer = llama2_tokenizer(
        str(REPO_ROOT / "configs/tiny/tokenizer.model"), max_seq_len=PACK_LEN, prompt_template=None
    )
    packs = alpaca_dataset(
        tokenizer,
        source="json",
        data_files=str(REPO_ROOT / "configs/tiny/data.json"),
        split="train",
        train_on_input=False,
        packed=True,
    )
    return sum(int((packs[i]["input_pos"] == 0).sum()) for i in range(num_packs))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    num_rows = rows_in_first_packs(PACKS)
    launches = {
        "optimizer_step": Launch(FULL_SINGLE, OPTIMIZER),
        "optimizer_in_bwd": Launch(FULL_SINGLE, {**OPTIMIZER, "optimizer_in_bwd": True}),
        "packed": Launch(
            FULL_SINGLE, {**SGD_ONE_STEP, "dataset.packed": True, "batch_size": PACKS}
        ),
        "unpacked": Launch(FULL_SINGLE, {**SGD_ONE_STEP, "batch_size": num_rows}),
    }
    return launch_all(launches, tmp_path_factory.mktemp("gpu_exactness"))


def test_optimizer_in_backward_equals_the_optimizer_step(runs, record_property):
    in_bwd, step = runs["optimizer_in_bwd"], runs["optimizer_step"]
    distance = relative_l2(in_bwd.weights(), step.weights(), step.weights(INITIAL))
    record_property("relative_l2", f"{distance:.2e}")
    loss_difference = max_relative_difference(in_bwd.losses(), step.losses())
    record_property("max_relative_loss_difference", f"{loss_difference:.2e}")
    assert distance <= FP32_PARITY
    assert loss_difference <= FP32_PARITY


def test_packed_flex_attention_is_exact_against_unpacked(runs, record_property):
    from torchtune.utils._import_guard import _SUPPORTS_FLEX_ATTENTION

    assert _SUPPORTS_FLEX_ATTENTION, "torchtune would pack with a dense mask on this GPU"
    packed, unpacked = runs["packed"], runs["unpacked"]
    assert packed.scalars()["loss_tokens"] == unpacked.scalars()["loss_tokens"]
    loss_difference = max_relative_difference(packed.losses(), unpacked.losses())
    update = relative_l2(packed.weights(), unpacked.weights(), unpacked.weights(INITIAL))
    record_property("relative_loss_difference", f"{loss_difference:.2e}")
    record_property("relative_l2_of_update", f"{update:.2e}")
    assert loss_difference <= PACKED_LOSS_RTOL
    assert update <= PACKED_UPDATE_RTOL
