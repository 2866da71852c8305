"""recipes/qat_distributed.py and recipes/qat_lora_finetune_distributed.py through the real
``tune run``, on one process and on 2 gloo ranks, with torchao's fake quantisation on.

Every run is made once, in a module fixture: one launch without torchrun and one with
``--nproc_per_node 2`` (tests/many_runs.py), side by side. Each test reads what they wrote. Run
with ``-rP`` to see the measured distances (docs/qat.md quotes them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from many_runs import Run, launch_runs
from recipe_utils import SMALL_MODEL, load_weights, read_scalars, relative_l2

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("qat")]

FULL = ("recipes/qat_distributed.py", "configs/tiny/qat_distributed.yaml")
LORA = ("recipes/qat_lora_finetune_distributed.py", "configs/tiny/qat_lora_distributed.yaml")
PLAIN_FULL = ("recipes/full_finetune_distributed.py", "configs/tiny/full_distributed.yaml")
TRAINED = "epoch_0/model-00001-of-00001.safetensors"  # full weights; merged ones for LoRA
INITIAL = "base_model/model.safetensors"
PARITY_TOLERANCE = 1e-5
STEPS = 12
INT8_ACT_INT4_WEIGHT = "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer"
INT4_WEIGHT_ONLY = "torchtune.training.quantization.Int4WeightOnlyQATQuantizer"

# fp32, 12 AdamW steps, no clipping, no warm-up; fake quantisation from the first step, with a
# group size that divides the small model's widths (64, 128).
PARITY = {
    "dtype": "fp32",
    "max_steps_per_epoch": STEPS,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
    "quantizer.groupsize": 32,
}
# The splits: one plain SGD step (large lr, so the update dwarfs rounding) with fake quantisation
# on. Later steps are not at the fp32 floor: see [fake quantisation amplifies rounding] in
# docs/qat.md (torchao's quantisation primitives refuse fp64, so no run can go below fp32).
SPLIT = {
    **PARITY,
    "max_steps_per_epoch": 1,
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "~optimizer.weight_decay": None,
}
FULL_ON = {"fake_quant_after_n_steps": "null"}
# (recipe and config, ranks (0: no torchrun), overrides): 8 sequences per step in every run.
LAUNCHES = {
    "full_1x8x1": (FULL, 0, {**PARITY, **FULL_ON, "batch_size": 8}),
    "lora_1x8x1": (LORA, 0, {**PARITY, "batch_size": 8}),
    "full_split_1x8x1": (FULL, 0, {**SPLIT, **FULL_ON, "batch_size": 8}),
    "full_split_1x2x4": (
        FULL,
        0,
        {**SPLIT, **FULL_ON, "batch_size": 2, "gradient_accumulation_steps": 4},
    ),
    "full_split_2x4x1": (FULL, 2, {**SPLIT, **FULL_ON, "batch_size": 4}),
    "full_split_2x1x4": (
        FULL,
        2,
        {**SPLIT, **FULL_ON, "batch_size": 1, "gradient_accumulation_steps": 4},
    ),
    "lora_split_1x8x1": (LORA, 0, {**SPLIT, "batch_size": 8}),
    "lora_split_1x2x4": (LORA, 0, {**SPLIT, "batch_size": 2, "gradient_accumulation_steps": 4}),
    "lora_split_2x4x1": (LORA, 2, {**SPLIT, "batch_size": 4}),
    "lora_split_2x1x4": (LORA, 2, {**SPLIT, "batch_size": 1, "gradient_accumulation_steps": 4}),
    # fake_quant_after_n_steps: on after 4 steps; never within the run; and the plain recipe.
    "full_fq_after_4": (FULL, 0, {**PARITY, "batch_size": 8, "fake_quant_after_n_steps": 4}),
    "full_fq_never": (FULL, 0, {**PARITY, "batch_size": 8, "fake_quant_after_n_steps": STEPS}),
    "full_no_qat": (
        PLAIN_FULL,
        0,
        {
            **{k: v for k, v in PARITY.items() if not k.startswith("quantizer")},
            "batch_size": 8,
            "gradient_accumulation_steps": 1,
        },
    ),
    # torchao's int4 weight-only quantizer (tinygemm's layout: widths multiples of 16 x tiles),
    # switched on after 2 steps, which stock's own switch cannot do under torchao 0.15.
    "full_4w_after_2": (
        FULL,
        0,
        {
            **PARITY,
            "batch_size": 8,
            "quantizer._component_": INT4_WEIGHT_ONLY,
            "quantizer.inner_k_tiles": 2,
            "fake_quant_after_n_steps": 2,
        },
    ),
}


def _run(name: str, root: Path) -> tuple[int, Run]:
    (recipe, config), nproc, settings = LAUNCHES[name]
    overrides: dict[str, object] = {**SMALL_MODEL, "output_dir": root / name, **settings}
    overrides.setdefault("gradient_accumulation_steps", 1)
    args = ["--config", config, *(k if v is None else f"{k}={v}" for k, v in overrides.items())]
    return nproc, Run(recipe, args, root / name)


def _launch_all(root: Path) -> None:
    by_ranks: dict[int, list[Run]] = {0: [], 2: []}
    for name in LAUNCHES:
        nproc, run = _run(name, root)
        by_ranks[nproc].append(run)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(launch_runs, runs, nproc) for nproc, runs in by_ranks.items()]
        for future in futures:
            future.result()
    for name in LAUNCHES:
        output = (root / name / "output.txt").read_text()
        assert (root / name / "returncode").read_text() == "0", f"{name}:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    return run_once("qat_runs", _launch_all)


def _distance(runs: Path, name: str, reference: str) -> float:
    """Relative L2 of ``name``'s trained (LoRA: merged) weights from ``reference``'s, over
    ``reference``'s update from the initial weights."""
    return relative_l2(
        load_weights(runs / name / TRAINED),
        load_weights(runs / reference / TRAINED),
        load_weights(runs / reference / INITIAL),
    )


SPLITS = ["1x2x4", "2x4x1", "2x1x4"]


@pytest.mark.parametrize("name", [f"{kind}_split_{s}" for kind in ("full", "lora") for s in SPLITS])
def test_splits_match_one_process_with_fake_quantisation_on(runs: Path, name: str) -> None:
    """GA 4 on one process, and 2 gloo ranks x (4x1, 1x4), step to the weights of one process
    8x1 with fake quantisation on (fp32, relative L2 <= 1e-5)."""
    reference = name.rsplit("_", 1)[0] + "_1x8x1"
    scalars, ref_scalars = (
        read_scalars(runs / name / "logs"),
        read_scalars(runs / reference / "logs"),
    )
    assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]  # the same 8 sequences per step
    assert len(scalars["loss"]) == 1
    rel = _distance(runs, name, reference)
    print(f"{name} vs {reference}: relative L2 {rel:.3e}")
    assert rel <= PARITY_TOLERANCE
    assert scalars["loss"] == pytest.approx(ref_scalars["loss"], rel=1e-5)


def test_fake_quantisation_changes_training(runs: Path) -> None:
    """Fake quantisation is on in the forward: the QAT run's first loss differs from the plain
    recipe's on the same weights and data, and so do its trained weights."""
    qat, plain = (
        read_scalars(runs / "full_1x8x1" / "logs"),
        read_scalars(runs / "full_no_qat" / "logs"),
    )
    assert qat["loss"][0] != pytest.approx(plain["loss"][0], rel=1e-6)
    rel = _distance(runs, "full_1x8x1", "full_no_qat")
    print(f"QAT vs plain full fine-tuning: relative L2 {rel:.3e}")
    assert rel > 1e-3


def test_fake_quant_after_n_steps_switches_it_on_at_that_step(runs: Path) -> None:
    """Off for the first n steps: the losses equal the plain recipe's until step n, then part;
    a run whose n is past its last step trains exactly as the plain recipe."""
    plain = read_scalars(runs / "full_no_qat" / "logs")["loss"]
    after_4 = read_scalars(runs / "full_fq_after_4" / "logs")["loss"]
    assert after_4[:4] == pytest.approx(plain[:4], rel=1e-6)
    assert after_4[4] != pytest.approx(plain[4], rel=1e-6)
    output = (runs / "full_fq_after_4" / "output.txt").read_text()
    assert "Step 0: Disabling fake quant" in output and "Step 4: Enabling fake quant" in output
    rel_never = _distance(runs, "full_fq_never", "full_no_qat")
    rel_after = _distance(runs, "full_fq_after_4", "full_1x8x1")
    print(f"fake quant never on vs plain: {rel_never:.3e}; on after 4 vs from 0: {rel_after:.3e}")
    assert rel_never <= 1e-6
    assert rel_after > 1e-3


def test_int4_weight_only_switches_on_after_n_steps(runs: Path) -> None:
    """torchao's int4 weight-only QAT quantizer trains, off then on from step 2."""
    plain = read_scalars(runs / "full_no_qat" / "logs")["loss"]
    losses = read_scalars(runs / "full_4w_after_2" / "logs")["loss"]
    assert losses[:2] == pytest.approx(plain[:2], rel=1e-6)
    assert losses[2] != pytest.approx(plain[2], rel=1e-6)


def _prepared_and_converted(
    weights_dir: Path, groupsize: int, out: Path
) -> tuple[torch.nn.Module, ...]:
    """The saved weights read back as ``tune run quantize`` reads them (the HF checkpointer),
    into the QAT-prepared tiny model, then converted by the same quantizer."""
    from torchtune import training
    from torchtune.models.llama3_2 import llama3_2
    from torchtune.training.quantization import Int8DynActInt4WeightQATQuantizer

    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(weights_dir),
        checkpoint_files=[Path(TRAINED).name],
        model_type="LLAMA3_2",
        output_dir=str(out),
    )
    state = checkpointer.load_checkpoint()[training.MODEL_KEY]
    sizes = {k.split(".")[1]: v for k, v in SMALL_MODEL.items()}
    model = llama3_2(vocab_size=2048, max_seq_len=512, tie_word_embeddings=True, **sizes)
    quantizer = Int8DynActInt4WeightQATQuantizer(groupsize=groupsize)
    prepared = quantizer.prepare(model)
    prepared.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fake_quantised = prepared(tokens)
        converted = quantizer.convert(prepared)
        quantised = converted(tokens)
    return converted, fake_quantised, quantised


def test_the_saved_weights_convert_and_the_converted_model_runs(runs: Path, tmp_path: Path) -> None:
    """What stock's quantize recipe does with a QAT run's output: prepare, load the saved
    weights, ``quantizer.convert``; the converted model (torchao's int8-activation, int4-weight
    linears) runs a forward with the fake-quantised model's numbers."""
    converted, fake_quantised, quantised = _prepared_and_converted(
        runs / "full_1x8x1" / "epoch_0", PARITY["quantizer.groupsize"], tmp_path / "full"
    )
    kinds = {type(m).__name__ for m in converted.modules()}
    assert "Int8DynActInt4WeightLinear" in kinds, kinds
    assert torch.isfinite(quantised).all()
    torch.testing.assert_close(quantised, fake_quantised, rtol=1e-4, atol=1e-4)
    # The LoRA run's merged weights are plain weights too: they convert the same way.
    _, lora_fake, lora_quantised = _prepared_and_converted(
        runs / "lora_1x8x1" / "epoch_0", PARITY["quantizer.groupsize"], tmp_path / "lora"
    )
    torch.testing.assert_close(lora_quantised, lora_fake, rtol=1e-4, atol=1e-4)
