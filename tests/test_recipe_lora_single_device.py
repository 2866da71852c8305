"""recipes/lora_finetune.py run through the real ``tune run`` on CPU.

Tier (b) of docs/contributing.md point 9: the tiny LoRA config with a smaller model, on the shipped
data, in a subprocess, offline. The recipe is never imported; everything is read back from what a
run writes (adapter checkpoints and TensorBoard events).

Run the parity tests with ``-rP`` to see the measured distances, which docs/ quotes.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from many_runs import launch_runs, run_of
from recipe_utils import (
    EMPTY_WINDOW_RUN,
    QLORA_TINY_CONFIG,
    SMALL_MODEL,
    load_adapters,
    load_weights,
    lora_tiny_args,
    read_scalars,
    rows_with_an_empty_window,
)

# Every run of the module is made by one fixture (``runs``), so its tests are one xdist group.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lora_single_device")]

ADAPTERS = "epoch_0/adapter_model.pt"  # torchtune's names; the PEFT copy is .safetensors
PEFT_ADAPTERS = "epoch_0/adapter/adapter_model.safetensors"
ADAPTER_CONFIG = "epoch_0/adapter/adapter_config.json"
MERGED = "epoch_0/model-00001-of-00001.safetensors"
BASE = "base_model/model.safetensors"

# Steps of 8 sequences, no clipping, no warm-up (a zero first lr would waste a step). SGD's
# splits sit at their floor from the first steps (fp64 <= 3.5e-8 after 4 steps, 3.2e-8 after 6),
# so 6 steps, which move the adapters twice MIN_MOVED (4 moved 0.033). AdamW keeps 12: its first
# updates divide near-zero gradients by their own scale, so fewer steps raise its floor (fp64
# masked 2x4 measured 1.32e-7 after 4 steps and 1.03e-7 after 8, over the 1e-7 bound).
PARITY_STEPS = {"sgd": 6, "adamw": 12}
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
# How far the 8x1 run's adapters move from their initialisation in PARITY_STEPS steps,
# ||a - a_init|| / ||a_init|| (B starts at zero, so the norm is A's): the parity bounds above
# are relative to a real move. Measured with ``pytest tests/test_recipe_lora_single_device.py
# -p no:xdist -rP -k accumulation_splits``: SGD 0.049 and 0.066 (6 steps; 0.081 and 0.088 after
# 12), AdamW 0.19 to 0.28 (over both precisions and train_on_input); the bounds are 2x (SGD) and
# 3x (AdamW) below the smallest.
MIN_MOVED = {"sgd": 2.5e-2, "adamw": 6e-2}
PARITY_CASES = [  # (precision, optimizer, train_on_input)
    *(("fp64", opt, toi) for opt in OPTIMIZERS for toi in (True, False)),
    ("fp32", "adamw", True),
]


def _train_args(
    output_dir: Path,
    batch_size: int,
    ga: int,
    extra: list[str],
    steps: int,
    **overrides,
) -> list[str]:
    """The ``tune run`` arguments of ``steps`` steps with this split."""
    args = lora_tiny_args(
        output_dir,
        batch_size=batch_size,
        gradient_accumulation_steps=ga,
        max_steps_per_epoch=steps,
        clip_grad_norm="null",
        lr_scheduler__num_warmup_steps=0,
        **overrides,
    )
    return args + extra


def _case_id(precision: str, optimizer: str, train_on_input: bool) -> str:
    return f"{precision}-{optimizer}-{'train_on_input' if train_on_input else 'masked_input'}"


def _case_extra(precision: str, optimizer: str) -> list[str]:
    extra = OPTIMIZERS[optimizer] + PRECISIONS[precision][0]
    if precision == "fp64" and optimizer == "adamw":
        extra += FP64_ADAMW
    return extra


# The runs the module reads that succeed, besides the parity runs: name -> tune run arguments
# (made in ``_launch_all``, which knows the folder).
SEEDS = {"same_seed": [], "other_seed": ["seed=4321"]}
NAIVE = [
    *OPTIMIZERS["sgd"],
    "loss_normalization=naive",
    "micro_batching=fixed",
    "dataset.train_on_input=True",
]
# torchtune's llama3_2 builder has no LoRA arguments: the recipe must name the config key.
NON_LORA_MODEL = "model._component_=torchtune.models.llama3_2.llama3_2"
NOT_LORA_KEYS = [
    "~model.lora_attn_modules",
    "~model.apply_lora_to_mlp",
    "~model.apply_lora_to_output",
    "~model.lora_rank",
    "~model.lora_alpha",
    "~model.lora_dropout",
]
QLORA_SIZES = {"num_layers": 1, "embed_dim": 256, "intermediate_dim": 768}
QLORA_SIZES |= {"num_heads": 4, "num_kv_heads": 2}


def _init_args(out: Path, extra: list[str]) -> list[str]:
    """The seeded adapter initialisation: one step at learning rate 0 leaves it untouched."""
    return _train_args(out, 8, 1, OPTIMIZERS["sgd"] + ["optimizer.lr=0", *extra], steps=1)


def _launch_all(root: Path) -> None:
    """Every run of the module, in two groups side by side (tests/many_runs.py: each run
    forked from the tests' server, still the recipe as ``tune run`` starts it): the parity runs
    with the initial adapters of each precision in one, the other runs in the other; a failing
    run (the non-LoRA model must fail) fails no other, each keeping its own status and output.
    The seed test compares runs of two processes, so it sees two processes draw the same
    adapters."""
    parity = []
    for precision, optimizer, train_on_input in PARITY_CASES:
        for bs, ga in SPLITS:
            out = root / _case_id(precision, optimizer, train_on_input) / f"{bs}x{ga}"
            args = _train_args(
                out,
                bs,
                ga,
                _case_extra(precision, optimizer),
                PARITY_STEPS[optimizer],
                dataset__train_on_input=train_on_input,
            )
            parity.append(run_of(args, out))
    for precision, (extra, _) in PRECISIONS.items():
        parity.append(
            run_of(_init_args(root / f"init_{precision}", extra), root / f"init_{precision}")
        )

    data = root / "empty_window.json"
    data.write_text(json.dumps(rows_with_an_empty_window()))
    others = {name: _init_args(root / name, extra) for name, extra in SEEDS.items()}
    others |= {
        f"naive_{bs}x{ga}": _train_args(
            root / f"naive_{bs}x{ga}", bs, ga, NAIVE, PARITY_STEPS["sgd"]
        )
        for bs, ga in ((8, 1), (1, 8))
    }
    others["empty_window"] = lora_tiny_args(
        root / "empty_window",
        dataset__data_files=data,
        save_adapter_weights_only=True,
        **EMPTY_WINDOW_RUN,
    )
    others["artefacts"] = lora_tiny_args(root / "artefacts", max_steps_per_epoch=2)
    others["qlora"] = lora_tiny_args(
        root / "qlora",
        config=QLORA_TINY_CONFIG,
        max_steps_per_epoch=2,
        **{f"model__{key}": value for key, value in QLORA_SIZES.items()},
    )
    others["dora"] = lora_tiny_args(root / "dora", **DORA_RUN)
    others["non_lora_model"] = [
        *lora_tiny_args(root / "non_lora_model"),
        NON_LORA_MODEL,
        *NOT_LORA_KEYS,
    ]
    rest = [run_of(args, root / name) for name, args in others.items()]

    assert all(nproc == 0 for nproc, _ in parity + rest)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(launch_runs, [run for _, run in parity], nproc=0),
            pool.submit(launch_runs, [run for _, run in rest], nproc=0),
        ]
        for future in futures:
            future.result()


@pytest.fixture(scope="module")
def runs(run_once):
    """``runs(name, ok=True)``: the folder of the run ``name`` (a parity run's is
    ``<case id>/<bs>x<ga>``), with its status checked: 0, or with ``ok=False`` not 0."""
    root = run_once("lora_single_device_runs", _launch_all)

    def get(name: str, ok: bool = True) -> Path:
        out = root / name
        output = (out / "output.txt").read_text()
        status = (out / "returncode").read_text()
        assert (status == "0") == ok, f"{name}: status {status}\n{output[-4000:]}"
        return out

    return get


def parity_runs_of(runs, case_id: str) -> dict[tuple[int, int], Path]:
    """``(bs, ga) -> folder`` of a parity case, every run checked to have succeeded."""
    return {(bs, ga): runs(f"{case_id}/{bs}x{ga}") for bs, ga in SPLITS}


@pytest.fixture(scope="module")
def initial_adapters_at(runs):
    """``precision -> initial adapters``."""
    return lambda precision: load_adapters(runs(f"init_{precision}") / ADAPTERS)


@pytest.fixture(scope="module")
def initial_adapters(initial_adapters_at) -> dict[str, torch.Tensor]:
    return initial_adapters_at("fp32")


def test_adapter_init_is_seeded_and_b_starts_at_zero(runs, initial_adapters):
    """The config's ``seed`` draws the adapters: a second launch with it draws them again bit
    for bit, another seed draws other A matrices. B starts at zero whatever the seed."""
    drawn = {name: load_adapters(runs(name) / ADAPTERS) for name in SEEDS}
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
    ids=[_case_id(*case) for case in PARITY_CASES],
)
def test_accumulation_splits_match_full_batch(
    runs, initial_adapters_at, precision, optimizer, train_on_input
):
    """8x1, 1x8 and 2x4 train to the same adapters (fp64: relative L2 <= 1e-7)."""
    from recipe_utils import relative_l2

    tolerance = PRECISIONS[precision][1]
    initial_adapters = initial_adapters_at(precision)
    splits = parity_runs_of(runs, _case_id(precision, optimizer, train_on_input))
    reference = splits[SPLITS[0]]
    a_ref = load_adapters(reference / ADAPTERS)
    ref_scalars = read_scalars(reference / "logs")
    assert len(ref_scalars["loss"]) == PARITY_STEPS[optimizer]
    moved = relative_l2(a_ref, initial_adapters, {k: torch.zeros_like(v) for k, v in a_ref.items()})
    print(f"{optimizer} train_on_input={train_on_input}: ||a - a_init|| / ||a_init|| = {moved:.3f}")
    assert moved > MIN_MOVED[optimizer]

    for (bs, ga), run_dir in splits.items():
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


def test_naive_normalization_breaks_parity(runs, initial_adapters):
    """Negative control: the mean of micro-batch means moves 1x8 far from 8x1."""
    from recipe_utils import relative_l2

    full, accumulated = runs("naive_8x1"), runs("naive_1x8")
    rel = relative_l2(
        load_adapters(accumulated / ADAPTERS), load_adapters(full / ADAPTERS), initial_adapters
    )
    print(f"naive sgd train_on_input=True 1x8 vs 8x1: relative L2 {rel:.3e}")
    assert rel > 1e-4


def test_windows_without_loss_tokens_leave_adapters_finite(runs):
    """Prompts longer than max_seq_len leave every label masked; such a window skips its step."""
    run = runs("empty_window")
    assert "no loss token in this accumulation window" in (run / "output.txt").read_text()
    scalars = read_scalars(run / "logs")
    assert scalars["skipped_steps"][-1] >= 1
    assert scalars["loss_tokens"][0] == 0
    for name, tensor in load_adapters(run / ADAPTERS).items():
        assert torch.isfinite(tensor).all(), f"{name} is not finite"
    # save_adapter_weights_only: adapters and their config, no merged weights.
    assert (run / PEFT_ADAPTERS).is_file()
    assert not (run / MERGED).exists()


def test_artefacts_match_stock_layout(runs):
    """Adapters in torchtune's and PEFT's format, adapter config, merged weights; B starts at 0
    so after training the merged weights differ from the base only where LoRA applies."""
    out = runs("artefacts")
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
    # One sample of the gradient pass LoRA skips (step 2) is too few for a figure (see [saved
    # latency on a busy machine]); tests/test_recipe_profiling.py logs one for LoRA.
    assert "normalization/saved_ms" not in scalars
    assert all(math.isfinite(v) for v in scalars["loss"])


# QLoRA: B starts at exactly zero; after 2 steps (warm-up: the first at learning rate 0) the
# largest element of each B measured 6.0e-4 (``-rP`` prints it); bounded 6x below.
QLORA_MIN_LORA_B = 1e-4


def test_qlora_trains_on_an_nf4_base_on_cpu(runs):
    """The tiny QLoRA config (``quantize_base: True``) trains on CPU with its frozen base in NF4
    (torchao), and the adapters move. Kept at the config's sizes: NF4 needs weights in multiples
    of 16384 elements.

    What shows the run's base was NF4: the base projection without an adapter (``k_proj``;
    ``lora_attn_modules`` are q, v and output) comes out in the merged weights as exactly
    torchao's NF4 round trip of the initial weight, ``to_nf4(w).get_original_weight()``, not
    ``w`` itself, as a plain LoRA run writes it (test_artefacts_match_stock_layout): the model
    the run trained held it as an ``NF4Tensor``. Compared in torchtune's layout, where the
    model quantised it (the HF layout permutes q and k rows, which regroups NF4's blocks).
    """
    from torchao.dtypes.nf4tensor import to_nf4
    from torchtune.models.convert_weights import hf_to_tune

    sizes = QLORA_SIZES
    out = runs("qlora")
    layout = {"num_heads": 4, "num_kv_heads": 2, "dim": 256}
    base = hf_to_tune(load_weights(out / BASE), **layout)
    merged = hf_to_tune(load_weights(out / MERGED), **layout)  # dequantised base, bf16
    frozen = [key for key in base if key.endswith("attn.k_proj.weight")]
    assert len(frozen) == sizes["num_layers"]
    for key in frozen:
        nf4 = to_nf4(base[key]).get_original_weight()
        assert torch.equal(merged[key], nf4.to(merged[key].dtype)), key
        assert not torch.equal(merged[key].float(), base[key]), key  # NF4's rounding shows
    adapters = load_adapters(out / ADAPTERS)
    for name, tensor in adapters.items():
        assert torch.isfinite(tensor).all(), name
    lora_b = {k: float(v.abs().max()) for k, v in adapters.items() if "lora_b" in k}
    print(
        f"QLoRA largest |B| element per adapter: {min(lora_b.values()):.2e} to "
        f"{max(lora_b.values()):.2e}"
    )
    assert len(lora_b) == 6 * sizes["num_layers"]  # q, v, output, w1, w2, w3
    assert all(value > QLORA_MIN_LORA_B for value in lora_b.values()), lora_b


# DoRA: 3 steps of AdamW at 3e-3 without warm-up, fp32, so the magnitudes move well beyond
# rounding: measured ||m - m_init|| / ||m_init|| 1.9e-2 to 3.3e-2 per adapted linear; the bound
# is a factor 3 below the smallest. The saved adapters rebuild the merged weights bit for bit
# (measured 0); the bound allows fp32 rounding.
DORA_RUN = {
    "model__use_dora": True,
    "max_steps_per_epoch": 3,
    "optimizer__lr": 3e-3,
    "lr_scheduler__num_warmup_steps": 0,
}
DORA_MIN_MOVED = 6e-3
DORA_ROUND_TRIP = 1e-6


@pytest.fixture(scope="module")
def dora_run(runs) -> Path:
    return runs("dora")


def _in_torchtune_layout(path: Path) -> dict[str, torch.Tensor]:
    """An HF-layout checkpoint of the small model in torchtune's names and q/k row order."""
    from torchtune.models.convert_weights import hf_to_tune

    return hf_to_tune(
        load_weights(path),
        num_heads=SMALL_MODEL["model.num_heads"],
        num_kv_heads=SMALL_MODEL["model.num_kv_heads"],
        dim=SMALL_MODEL["model.embed_dim"],
    )


def test_dora_trains_magnitudes_that_rebuild_the_merged_weights(dora_run):
    """``model.use_dora=True``: every adapted linear saves a magnitude, which starts as the row
    norms of the loaded base weight (B starts at zero; checked on stock's DoRA config in
    tests/test_stock_distributed_configs.py) and trains away from them; the saved adapters on
    the base weights, by DoRA's formula ``m * (W + s B A) / ||W + s B A||`` per row, give the
    merged weights the run wrote."""
    adapters = load_adapters(dora_run / ADAPTERS)
    base = _in_torchtune_layout(dora_run / BASE)
    merged = _in_torchtune_layout(dora_run / MERGED)
    magnitudes = [key for key in adapters if key.endswith(".magnitude")]
    assert len(magnitudes) == 6 * SMALL_MODEL["model.num_layers"]  # q, v, output, w1, w2, w3
    scale = 16 / 8  # lora_alpha / lora_rank of the tiny config
    for key in magnitudes:
        module = key.removesuffix(".magnitude")
        weight = base[f"{module}.weight"]
        initial = torch.linalg.norm(weight, dim=1)
        moved = float((adapters[key] - initial).norm() / initial.norm())
        print(f"{module}: magnitude moved {moved:.2e} relative")
        assert moved > DORA_MIN_MOVED, module
        lora_b, lora_a = adapters[f"{module}.lora_b.weight"], adapters[f"{module}.lora_a.weight"]
        adapted = weight + scale * lora_b @ lora_a
        expected = adapted * (adapters[key] / torch.linalg.norm(adapted, dim=1)).view(-1, 1)
        rebuilt = float((merged[f"{module}.weight"] - expected).norm() / expected.norm())
        assert rebuilt <= DORA_ROUND_TRIP, (module, rebuilt)


def test_dora_peft_adapter_rebuilds_the_merged_weights(dora_run):
    """``PeftModel.from_pretrained(base, epoch_0/adapter)``, merged, gives the merged weights
    the run wrote, as it does for LoRA (tests/test_hf_round_trip.py): the config says
    ``use_dora`` and q_proj's magnitudes are in HF's row order (Note [DoRA in PEFT] in
    src/exactga/lora/adapters.py). Before that fix: 2.1e-2 to 3.3e-2 off; measured 0 since."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    assert json.loads((dora_run / ADAPTER_CONFIG).read_text())["use_dora"] is True
    base = transformers.AutoModelForCausalLM.from_pretrained(dora_run / "base_model")
    with_adapter = peft.PeftModel.from_pretrained(base, dora_run / "epoch_0" / "adapter")
    rebuilt = with_adapter.merge_and_unload().state_dict()
    merged = load_weights(dora_run / MERGED)
    for key, tensor in merged.items():
        distance = float((rebuilt[key] - tensor).norm() / tensor.norm())
        assert distance <= 1e-5, (key, distance)


def test_peft_dora_magnitudes_get_the_rotary_row_order_of_hf_weights():
    """Unit check of the permutation, on q_proj and on a k_proj with fewer (grouped) heads,
    which the tiny run does not adapt: DoRA's merged weight has row norms equal to its
    magnitudes, so in the PEFT file each q/k magnitude must equal the row norms of the merged
    weight that torchtune's own ``tune_to_hf`` puts in HF's order. Other magnitudes and the
    LoRA matrices are left as torchtune wrote them."""
    from torchtune.models.convert_weights import tune_to_hf, tune_to_peft_adapter_weights

    from exactga.lora.adapters import peft_magnitudes_in_hf_order

    num_heads, num_kv_heads, head_dim, dim, rank = 4, 2, 8, 32, 2
    generator = torch.Generator().manual_seed(0)
    adapters, merged = {}, {}
    for name, num in (("q_proj", num_heads), ("k_proj", num_kv_heads), ("v_proj", num_kv_heads)):
        module = f"layers.0.attn.{name}"
        out_dim = num * head_dim
        weight = torch.randn(out_dim, dim, generator=generator)
        lora_a = torch.randn(rank, dim, generator=generator)
        lora_b = torch.randn(out_dim, rank, generator=generator)
        magnitude = torch.rand(out_dim, generator=generator) + 0.5
        adapted = weight + lora_b @ lora_a
        merged[f"{module}.weight"] = adapted * (magnitude / adapted.norm(dim=1)).view(-1, 1)
        adapters |= {
            f"{module}.lora_a.weight": lora_a,
            f"{module}.lora_b.weight": lora_b,
            f"{module}.magnitude": magnitude,
        }
    heads = {"num_heads": num_heads, "num_kv_heads": num_kv_heads}
    written = tune_to_peft_adapter_weights(adapters, dim=num_heads * head_dim, **heads)
    fixed = peft_magnitudes_in_hf_order(written, head_dim=head_dim, **heads)
    hf_merged = tune_to_hf(merged, dim=num_heads * head_dim, **heads)

    for name in ("q_proj", "k_proj", "v_proj"):
        key = f"base_model.model.model.layers.0.self_attn.{name}.lora_magnitude_vector"
        hf_norms = hf_merged[f"model.layers.0.self_attn.{name}.weight"].norm(dim=1)
        torch.testing.assert_close(fixed[key], hf_norms)
        if name != "v_proj":  # torchtune's own output has them in the wrong order
            assert not torch.allclose(written[key], hf_norms), name
    for key, tensor in written.items():
        if not key.endswith(("q_proj.lora_magnitude_vector", "k_proj.lora_magnitude_vector")):
            assert fixed[key] is tensor, key


def test_non_lora_model_fails_naming_the_key(runs):
    output = (runs("non_lora_model", ok=False) / "output.txt").read_text()
    assert "config key 'model'" in output and "model.lora_rank" in output
