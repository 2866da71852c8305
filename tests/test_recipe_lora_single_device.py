"""recipes/lora_finetune_single_device.py run through the real ``tune run`` on CPU.

Tier (b) of STYLE.md point 9: the tiny LoRA config with a smaller model, on the shipped data, in
a subprocess, offline. The recipe is never imported; everything is read back from what a run
writes (adapter checkpoints and TensorBoard events).

Run the parity tests with ``-rP`` to see the measured distances, which docs/ quotes.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from recipe_utils import (
    EMPTY_WINDOW_RUN,
    QLORA_TINY_CONFIG,
    load_adapters,
    load_weights,
    lora_tiny_args,
    output_of,
    read_scalars,
    rows_with_an_empty_window,
    run_tune,
)

pytestmark = pytest.mark.slow

ADAPTERS = "epoch_0/adapter_model.pt"  # torchtune's names; the PEFT copy is .safetensors
PEFT_ADAPTERS = "epoch_0/adapter/adapter_model.safetensors"
ADAPTER_CONFIG = "epoch_0/adapter/adapter_config.json"
MERGED = "epoch_0/model-00001-of-00001.safetensors"
BASE = "base_model/model.safetensors"

# Twelve steps of 8 sequences, no clipping, no warm-up (a zero first lr would waste a step).
PARITY_STEPS = 12
SPLITS = [(8, 1), (1, 8), (2, 4)]  # batch_size x gradient_accumulation_steps
OPTIMIZERS = {
    # Plain gradient descent; the lr is large so the adapters move far beyond fp32 rounding.
    "sgd": ["optimizer._component_=torch.optim.SGD", "optimizer.lr=0.5", "~optimizer.weight_decay"],
    "adamw": ["optimizer.lr=3e-3"],  # the tiny LoRA config's AdamW, weight_decay 0.01
}
# Precision of the parity runs: (extra overrides, tolerance). In fp32 the splits differ by the
# rounding of their different matmul shapes and summation orders, measured at 3e-7 to 1.1e-6
# after 12 steps (AdamW 2x4 worst), whatever the normalisation; the fp32 case checks that floor
# with 2e-6. In fp64 (with torch's CrossEntropyLoss: the chunked loss upcasts to fp32 only) that
# rounding is about 1e-8, so there the check is the 1e-7 the issue asks for. The negative
# control below shows a normalisation error is orders of magnitude larger than either.
# AdamW divides each element's update by that element's own gradient scale, so elements whose
# gradient nearly cancels turn even fp64's residue (torchtune's RMSNorm and RoPE compute in fp32
# whatever the dtype) into lr-sized differences: fp64 2x4 measured 1.05e-6 with eps 1e-8,
# 2.0e-7 with 1e-6 and 5.8e-8 with 1e-5. The fp64 AdamW cases use eps 1e-5 so the check
# measures the normalisation, not that amplification; SGD needs no such change.
PRECISIONS = {
    "fp32": ([], 2e-6),
    "fp64": (["dtype=fp64", "loss._component_=torch.nn.CrossEntropyLoss"], 1e-7),
}
FP64_ADAMW = ["optimizer.eps=1e-5"]
PARITY_CASES = [  # (precision, optimizer, train_on_input)
    *(("fp64", opt, toi) for opt in OPTIMIZERS for toi in (True, False)),
    ("fp32", "adamw", True),
]


def _train(output_dir: Path, batch_size: int, ga: int, extra: list[str], **overrides) -> Path:
    """Train PARITY_STEPS steps with this split; returns ``output_dir`` after checking success."""
    args = lora_tiny_args(
        output_dir,
        batch_size=batch_size,
        gradient_accumulation_steps=ga,
        max_steps_per_epoch=PARITY_STEPS,
        clip_grad_norm="null",
        lr_scheduler__num_warmup_steps=0,
        **overrides,
    )
    proc = run_tune(args + extra)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    return output_dir


def _initial_adapters(out: Path, extra: list[str]) -> dict[str, torch.Tensor]:
    """The seeded adapter initialisation: one step at learning rate 0 leaves it untouched."""
    _train(out, 8, 1, OPTIMIZERS["sgd"] + ["optimizer.lr=0", *extra])
    return load_adapters(out / ADAPTERS)


@pytest.fixture(scope="module")
def initial_adapters_at(run_once):
    """``precision -> initial adapters``, each trained once per session (the test workers of
    ``pytest -n`` share them)."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(precision: str) -> dict[str, torch.Tensor]:
        if precision not in cache:
            extra = PRECISIONS[precision][0]
            out = run_once(f"lora_init_{precision}", lambda out: _initial_adapters(out, extra))
            cache[precision] = load_adapters(out / ADAPTERS)
        return cache[precision]

    return get


@pytest.fixture(scope="module")
def initial_adapters(initial_adapters_at) -> dict[str, torch.Tensor]:
    return initial_adapters_at("fp32")


def test_adapter_init_is_seeded_and_b_starts_at_zero(tmp_path, initial_adapters):
    """The config's ``seed`` draws the adapters: a second launch with it draws them again bit
    for bit, another seed draws other A matrices. B starts at zero whatever the seed."""
    launches = {"same_seed": [], "other_seed": ["seed=4321"]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(_initial_adapters, tmp_path / name, extra)
            for name, extra in launches.items()
        }
        drawn = {name: future.result() for name, future in futures.items()}
    assert drawn["same_seed"].keys() == initial_adapters.keys()
    for key, tensor in initial_adapters.items():
        assert torch.equal(drawn["same_seed"][key], tensor), key
    for adapters in (initial_adapters, drawn["other_seed"]):
        lora_b = {k: v for k, v in adapters.items() if "lora_b" in k}
        lora_a = {k: v for k, v in adapters.items() if "lora_a" in k}
        assert lora_a and lora_b and len(lora_a) == len(lora_b)
        assert all(float(v.abs().max()) == 0.0 for v in lora_b.values())
        assert all(float(v.abs().max()) > 0.0 for v in lora_a.values())
    other = drawn["other_seed"]
    assert all(not torch.equal(other[k], v) for k, v in initial_adapters.items() if "lora_a" in k)


@pytest.mark.parametrize(
    ("precision", "optimizer", "train_on_input"),
    PARITY_CASES,
    ids=[f"{p}-{o}-{'train_on_input' if t else 'masked_input'}" for p, o, t in PARITY_CASES],
)
def test_accumulation_splits_match_full_batch(
    tmp_path, initial_adapters_at, precision, optimizer, train_on_input
):
    """8x1, 1x8 and 2x4 train to the same adapters (fp64: relative L2 <= 1e-7)."""
    from recipe_utils import relative_l2

    dtype_overrides, tolerance = PRECISIONS[precision]
    initial_adapters = initial_adapters_at(precision)
    extra = OPTIMIZERS[optimizer] + dtype_overrides
    if precision == "fp64" and optimizer == "adamw":
        extra += FP64_ADAMW
    runs = {
        (bs, ga): _train(
            tmp_path / f"{bs}x{ga}", bs, ga, extra, dataset__train_on_input=train_on_input
        )
        for bs, ga in SPLITS
    }
    reference = runs[SPLITS[0]]
    a_ref = load_adapters(reference / ADAPTERS)
    ref_scalars = read_scalars(reference / "logs")
    assert len(ref_scalars["loss"]) == PARITY_STEPS
    moved = relative_l2(a_ref, initial_adapters, {k: torch.zeros_like(v) for k, v in a_ref.items()})
    print(f"{optimizer} train_on_input={train_on_input}: ||a - a_init|| / ||a|| = {moved:.3f}")

    for (bs, ga), run_dir in runs.items():
        if run_dir == reference:
            continue
        scalars = read_scalars(run_dir / "logs")
        assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]
        rel = relative_l2(load_adapters(run_dir / ADAPTERS), a_ref, initial_adapters)
        print(
            f"{precision} {optimizer} train_on_input={train_on_input} {bs}x{ga} vs 8x1: "
            f"relative L2 {rel:.3e}"
        )
        assert rel <= tolerance, f"{bs}x{ga} differs from 8x1 by {rel:.3e}"


def test_naive_normalization_breaks_parity(tmp_path, initial_adapters):
    """Negative control: the mean of micro-batch means moves 1x8 far from 8x1."""
    from recipe_utils import relative_l2

    extra = [
        *OPTIMIZERS["sgd"],
        "loss_normalization=naive",
        "micro_batching=fixed",
        "dataset.train_on_input=True",
    ]
    full = _train(tmp_path / "8x1", 8, 1, extra)
    accumulated = _train(tmp_path / "1x8", 1, 8, extra)
    rel = relative_l2(
        load_adapters(accumulated / ADAPTERS), load_adapters(full / ADAPTERS), initial_adapters
    )
    print(f"naive sgd train_on_input=True 1x8 vs 8x1: relative L2 {rel:.3e}")
    assert rel > 1e-4


def test_windows_without_loss_tokens_leave_adapters_finite(tmp_path):
    """Prompts longer than max_seq_len leave every label masked; such a window skips its step."""
    data = tmp_path / "data.json"
    data.write_text(json.dumps(rows_with_an_empty_window()))
    args = lora_tiny_args(
        tmp_path / "out",
        dataset__data_files=data,
        save_adapter_weights_only=True,
        **EMPTY_WINDOW_RUN,
    )
    proc = run_tune(args)
    out = output_of(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "no loss token in this accumulation window" in out
    scalars = read_scalars(tmp_path / "out/logs")
    assert scalars["skipped_steps"][-1] >= 1
    assert scalars["loss_tokens"][0] == 0
    for name, tensor in load_adapters(tmp_path / "out" / ADAPTERS).items():
        assert torch.isfinite(tensor).all(), f"{name} is not finite"
    # save_adapter_weights_only: adapters and their config, no merged weights.
    assert (tmp_path / "out" / PEFT_ADAPTERS).is_file()
    assert not (tmp_path / "out" / MERGED).exists()


def test_artefacts_match_stock_layout(tmp_path):
    """Adapters in torchtune's and PEFT's format, adapter config, merged weights; B starts at 0
    so after training the merged weights differ from the base only where LoRA applies."""
    out = tmp_path / "out"
    proc = run_tune(lora_tiny_args(out, max_steps_per_epoch=2))
    assert proc.returncode == 0, output_of(proc)[-4000:]
    adapters = load_adapters(out / ADAPTERS)
    peft = load_weights(out / PEFT_ADAPTERS)
    assert len(peft) == len(adapters)
    assert all(k.startswith("base_model.model.") for k in peft)
    adapter_config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert adapter_config["peft_type"] == "LORA"
    assert adapter_config["r"] == 8 and adapter_config["lora_alpha"] == 16
    assert set(adapter_config["target_modules"]) == {
        "q_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    merged, base = load_weights(out / MERGED), load_weights(out / BASE)
    assert merged.keys() == base.keys()
    changed = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert changed and all(("proj" in k) for k in changed), sorted(changed)
    assert not any("k_proj" in k or "embed" in k for k in changed)
    scalars = read_scalars(out / "logs")
    stock = ("loss", "lr", "tokens_per_second_per_gpu", "loss_tokens", "skipped_steps")
    hook = ("time/step_ms", "time/forward_ms", "time/backward_ms", "throughput/tokens_per_second")
    for name in stock + hook:
        assert len(scalars.get(name, [])) == 2, f"metric {name!r}: {scalars.get(name)}"
    # The profiler hook timed the gradient pass LoRA skips (step 2 is always sampled).
    assert scalars["normalization/saved_ms"][-1] > 0
    assert all(math.isfinite(v) for v in scalars["loss"])


def test_qlora_nf4_runs_on_cpu(tmp_path):
    """The tiny QLoRA config (NF4 base through torchao) trains on CPU and writes adapters.
    Kept at the config's sizes: NF4 needs weights in multiples of 16384 elements."""
    out = tmp_path / "out"
    args = lora_tiny_args(
        out,
        config=QLORA_TINY_CONFIG,
        max_steps_per_epoch=2,
        model__num_layers=1,
        model__embed_dim=256,
        model__intermediate_dim=768,
        model__num_heads=4,
        model__num_kv_heads=2,
    )
    proc = run_tune(args)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert "NF4" in output_of(proc) or (out / ADAPTERS).is_file()
    for name, tensor in load_adapters(out / ADAPTERS).items():
        assert torch.isfinite(tensor).all(), name
    assert (out / MERGED).is_file()  # dequantised base plus merged adapters (bf16)


@pytest.mark.parametrize("bad", ["model._component_=torchtune.models.llama3_2.llama3_2"])
def test_non_lora_model_fails_naming_the_key(tmp_path, bad):
    args = lora_tiny_args(tmp_path / "out") + [
        bad,
        "~model.lora_attn_modules",
        "~model.apply_lora_to_mlp",
        "~model.apply_lora_to_output",
        "~model.lora_rank",
        "~model.lora_alpha",
        "~model.lora_dropout",
    ]
    proc = run_tune(args)
    assert proc.returncode != 0
    assert "config key 'model'" in output_of(proc) and "model.lora_rank" in output_of(proc)
