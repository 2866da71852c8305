"""recipes/qat_distributed.py and recipes/qat_lora_finetune_distributed.py through the real
``tune run``, on one process and on 2 gloo ranks, with torchao's fake quantisation on.

Every run is made once per session (tests/qat_runs.py: the runs without torchrun and those with
``--nproc_per_node 2``, side by side, shared with the QAT resume and stock-config tests). Each
test reads what they wrote; the split runs keep every step's weights, which the tests load into
the fake-quantised model in-process to follow each step. Run with ``-rP`` to see the measured
distances (docs/qat.md quotes them).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from qat_runs import PARITY, SPLIT_KINDS, SPLIT_STEPS, shared_runs
from recipe_utils import SMALL_MODEL, load_weights, logged_steps, read_scalars, relative_l2

from exactga.run.checkpointing import step_checkpoint_weights

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("qat")]

TRAINED = "epoch_0/model-00001-of-00001.safetensors"  # full weights; merged ones for LoRA
INITIAL = "base_model/model.safetensors"
PARITY_TOLERANCE = 1e-5
# A step's logged loss against the full-batch loss of the weights it started from, computed
# here: the same sum of token losses in another order (fp32).
LOSS_TOLERANCE = 1e-6
# A drift that is no rounding: the splits' weights part by this much once a value flips.
DRIFT = 1e-4


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    return shared_runs(run_once)


def _distance(runs: Path, name: str, reference: str) -> float:
    """Relative L2 of ``name``'s trained (LoRA: merged) weights from ``reference``'s, over
    ``reference``'s update from the initial weights."""
    return relative_l2(
        load_weights(runs / name / TRAINED),
        load_weights(runs / reference / TRAINED),
        load_weights(runs / reference / INITIAL),
    )


# --- following the split runs step by step ----------------------------------------------------


@functools.cache
def _config(run: Path):
    """The run's resolved config, read once (every step and split asks for it; treat as
    read-only)."""
    return OmegaConf.load(run / "resolved_config.yaml")


def _is_lora(run: Path) -> bool:
    return "lora_rank" in _config(run).model


@functools.cache
def _initial(run: Path) -> dict[str, torch.Tensor]:
    """The run's initial weights under the model's own names, read once (treat as read-only)."""
    return _tune_layout(load_weights(run / INITIAL))


def _tune_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF checkpoint (the initial weights) under the model's own names, as step
    checkpoints hold them."""
    from torchtune.models.convert_weights import hf_to_tune

    sizes = {k.split(".")[1]: v for k, v in SMALL_MODEL.items()}
    return hf_to_tune(
        weights,
        num_heads=sizes["num_heads"],
        num_kv_heads=sizes["num_kv_heads"],
        dim=sizes["embed_dim"],
    )


def _state_after(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The model's trainable state after ``step`` optimizer steps (0: the initial weights):
    the full weights, or for LoRA the adapters (none at 0: every split starts from the same
    seeded ones, which no checkpoint holds)."""
    if step == 0:
        return {} if _is_lora(run) else dict(_initial(run))
    return step_checkpoint_weights(run / "step_checkpoints" / f"step_{step:06d}")


@functools.cache
def _comparable(run: Path, step: int) -> dict[str, torch.Tensor]:
    """Weights to measure a step by: the full weights, or LoRA's merged ones (base plus
    ``alpha / rank`` B A on each adapted linear; the base, unchanged, at step 0). Made once per
    run and step (the reference's serves each of its splits; treat as read-only)."""
    state = _state_after(run, step)
    if not _is_lora(run):
        return state
    merged = dict(_initial(run))
    model = _config(run).model
    scale = model.lora_alpha / model.lora_rank
    for key in [k for k in state if k.endswith("lora_a.weight")]:
        module = key.removesuffix(".lora_a.weight")
        update = state[f"{module}.lora_b.weight"] @ state[key]
        merged[f"{module}.weight"] = merged[f"{module}.weight"] + scale * update
    return merged


def _distance_at(run: Path, reference: Path, step: int) -> float:
    return relative_l2(
        _comparable(run, step), _comparable(reference, step), _comparable(reference, 0)
    )


def _model(run: Path, state: dict[str, torch.Tensor], steps_done: int) -> torch.nn.Module:
    """The run's fake-quantised model as the recipe builds it (exactga.qat.fake_quant), with
    ``state`` loaded and fake quantisation as it was for the step after ``steps_done``."""
    from torchtune import config

    from exactga.qat.fake_quant import FakeQuantSchedule, prepare_for_qat, quantizer_from_config

    cfg = _config(run)
    lora = _is_lora(run)
    model = config.instantiate(cfg.model)
    model = prepare_for_qat(model, quantizer_from_config(cfg.quantizer, torch.float32), lora=lora)
    base = _initial(run)
    if lora:
        assert state, f"{run}: no checkpoint holds the initial adapters (see _state_after)"
        missing, unexpected = model.load_state_dict({**base, **state}, strict=False)
        assert not unexpected and not [k for k in missing if "lora" not in k], missing
    else:
        model.load_state_dict(state)
    FakeQuantSchedule(model, cfg.get("fake_quant_after_n_steps")).before_window(steps_done)
    return model.eval()


@functools.cache
def _windows(reference: Path) -> list[list[dict[str, torch.Tensor]]]:
    """The reference run's windows (the full batch of each step: 8 sequences, one micro-batch),
    read by the library's loader from its resolved config, as the recipe read them."""
    from torchtune import config

    from exactga.data.loader import dataloader_from_settings, load_dataset
    from exactga.data.micro_batching import MicroBatchingSettings

    cfg = _config(reference)
    tokenizer = config.instantiate(cfg.tokenizer)
    dataset = load_dataset(cfg.dataset, tokenizer, cfg.model.vocab_size)
    loader = dataloader_from_settings(
        dataset,
        cfg,  # the resolved config stands in for the settings: the same keys
        MicroBatchingSettings.from_settings(cfg),
        padding_idx=tokenizer.pad_id,
        ignore_idx=-100,
    )
    windows = []
    for window in loader:
        windows.append(window.micro_batches)
        if len(windows) == SPLIT_STEPS:
            return windows
    raise AssertionError(f"{reference}: fewer than {SPLIT_STEPS} windows")


Values = list[tuple[torch.Tensor, int]]  # each fake quantizer's output, by rows, and levels


def _forward(run: Path, step: int, window: list[dict[str, torch.Tensor]]) -> tuple[float, Values]:
    """Step ``step`` of ``run`` redone in one forward of its window on the weights it started
    from: the window's loss (the sum of its token losses over its loss tokens, after the shift,
    with the run's loss function and the recipes' forward), and every fake quantizer's output
    in that forward (weights and activations) in call order, by the rows it quantises in (a
    weight group, a token), with its number of levels."""
    from torchtune import config

    from exactga.qat.fake_quant import fake_quantizers
    from exactga.sft.loss import causal_lm_loss

    model = _model(run, _state_after(run, step - 1), step - 1)
    loss_fn = config.instantiate(_config(run).loss)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    values: Values = []

    def record(module, inputs, output) -> None:
        if module.enabled:
            fq_config = module.config
            group = getattr(fq_config.granularity, "group_size", None) or inputs[0].shape[-1]
            bits = int("".join(c for c in str(fq_config.dtype) if c.isdigit()))
            values.append((output.detach().reshape(-1, group), 2**bits))

    hooks = [fq.register_forward_hook(record) for fq in fake_quantizers(model)]
    total, tokens = 0.0, 0
    try:
        with torch.no_grad():
            for batch in window:
                count = int((batch["labels"][:, 1:] != loss_fn.ignore_index).sum())
                total += float(causal_lm_loss(model, loss_fn, dict(batch)).main) * count
                tokens += count
    finally:
        for hook in hooks:
            hook.remove()
    return total / tokens, values


# Note [flipped values]
# A fake-quantised value is a grid point: an integer code times its row's scale (plus a zero
# point). Between two runs whose inputs differ by fp32 rounding, a value keeps its code and
# moves only as its scale does, in the scale's last bits: about 1e-5 of a grid step at most
# (int8's 255 levels times fp32's 1e-7). It moves by a whole grid step when its code flips (the
# input sat on a rounding boundary), and by 2^-8 of the scale times its code when a scale or
# zero point rounded to bf16 (``Int4WeightOnlyQATQuantizer``'s) lands on the neighbouring bf16
# value. ``GRID_MOVE`` counts both and nothing of the first kind; ``CODE_FLIP`` only codes.
GRID_MOVE, CODE_FLIP = 1e-3, 0.25  # in grid steps: see [flipped values]


def _grid_steps(reference: Values) -> list[torch.Tensor]:
    """Each row's grid step in the reference's values: the row's range over its levels."""
    return [
        (ref.amax(1, keepdim=True) - ref.amin(1, keepdim=True)) / (n - 1) for ref, n in reference
    ]


def _flips(reference: Values, grid_steps: list[torch.Tensor], values: Values) -> tuple[int, int]:
    """Fake-quantised values that differ from the reference's by ``GRID_MOVE`` grid steps
    (``_grid_steps``) or more, and by ``CODE_FLIP`` or more; see [flipped values]."""
    moved = on_another_point = 0
    for (ref, _), grid_step, (value, _) in zip(reference, grid_steps, values, strict=True):
        gap = (ref - value).abs()
        moved += int((gap > GRID_MOVE * grid_step).sum())
        on_another_point += int((gap > CODE_FLIP * grid_step).sum())
    return moved, on_another_point


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_forward(run: Path, reference: Path, step: int) -> bool:
    """Whether ``_forward(run, step, ...)`` is ``_forward(reference, step, ...)``: the same
    model, quantizer, loss and fake-quantisation switch, and bit-identical weights before the
    step (the full recipes' first step: every split starts from the same initial weights)."""
    keys = ("model", "quantizer", "loss", "fake_quant_after_n_steps")
    if any(_config(run).get(k) != _config(reference).get(k) for k in keys):
        return False
    return _equal(_initial(run), _initial(reference)) and _equal(
        _state_after(run, step - 1), _state_after(reference, step - 1)
    )


def _follow(runs: Path, kind: str) -> dict[str, list[dict[str, float]]]:
    """Each step ``k`` of each split run of ``kind`` beside the one-process full batch: the
    distance of their weights after it, the fake-quantised values of step ``k``'s forward that
    moved between the two (``flips``; ``code_flips``: those on another grid point; see
    [flipped values]), and the run's logged loss against the full-batch loss
    of the weights it held (``loss_gap``; for LoRA from step 2: no checkpoint holds the initial
    adapters; not for ``full_off``). One forward per run and step; the reference's serves all
    its splits, and stands for a split's own where that is the same forward
    (``_same_forward``)."""
    reference = runs / f"{kind}_split_1x8x1"
    names = [f"{kind}_split_{split}" for split in SPLIT_KINDS[kind][2] if split != "1x8x1"]
    logged = {name: list(logged_steps(runs / name / "logs").values()) for name in names}
    windows = _windows(reference)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for step in range(1, SPLIT_STEPS + 1):
        # Fake quantisation off: nothing to flip, and the plain model's steps are
        # tests/test_recipe_full_distributed.py's.
        redo = (step > 1 or not _is_lora(reference)) and kind != "full_off"
        ref_loss, ref_values = _forward(reference, step, windows[step - 1]) if redo else (0.0, [])
        grid_steps = _grid_steps(ref_values)
        for name in names:
            run = runs / name
            row = {"distance": _distance_at(run, reference, step), "loss_gap": 0.0}
            row.update(flips=0.0, code_flips=0.0)
            if redo:
                if _same_forward(run, reference, step):
                    loss, values = ref_loss, ref_values
                else:
                    loss, values = _forward(run, step, windows[step - 1])
                row["loss_gap"] = abs(logged[name][step - 1] - loss) / abs(loss)
                moved, on_another_point = _flips(ref_values, grid_steps, values)
                row["flips"], row["code_flips"] = float(moved), float(on_another_point)
            rows[name].append(row)
            print(
                f"{name} step {step}: relative L2 {row['distance']:.2e}, "
                f"values moved in its forward {int(row['flips'])} "
                f"(on another grid point {int(row['code_flips'])}), "
                f"logged loss vs its weights' full batch {row['loss_gap']:.1e}"
            )
    return rows


@pytest.fixture(scope="module")
def followed(runs: Path):
    """``followed(name)``: the rows of split run ``name`` (``_follow``), each kind followed
    once."""
    cache: dict[str, dict[str, list[dict[str, float]]]] = {}

    def get(name: str) -> list[dict[str, float]]:
        kind = name.split("_split_")[0]
        if kind not in cache:
            cache[kind] = _follow(runs, kind)
        return cache[kind][name]

    return get


SPLIT_RUNS = [
    f"{kind}_split_{split}"
    for kind, (_, _, splits) in SPLIT_KINDS.items()
    for split in splits
    if split != "1x8x1"
]


@pytest.mark.parametrize("name", [n for n in SPLIT_RUNS if n.startswith(("full_split", "lora"))])
def test_first_step_matches_one_process_with_fake_quantisation_on(runs: Path, name: str) -> None:
    """GA 4 on one process, and 2 gloo ranks x (4x1, 1x4), step to the weights of one process
    8x1 with fake quantisation on: the first step, from the same weights, at the fp32 floor
    (relative L2 <= 1e-5), with the same loss."""
    reference = name.rsplit("_", 1)[0] + "_1x8x1"
    scalars, ref_scalars = (
        read_scalars(runs / name / "logs"),
        read_scalars(runs / reference / "logs"),
    )
    assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]  # the same 8 sequences per step
    assert len(scalars["loss"]) == SPLIT_STEPS
    rel = _distance_at(runs / name, runs / reference, 1)
    print(f"{name} vs {reference}, step 1: relative L2 {rel:.3e}")
    assert rel <= PARITY_TOLERANCE
    assert scalars["loss"][0] == pytest.approx(ref_scalars["loss"][0], rel=1e-5)


@pytest.mark.parametrize("name", SPLIT_RUNS)
def test_every_step_is_the_full_batch_step_of_its_weights(followed, name: str) -> None:
    """Whatever the weights (after values have flipped too), each step of each split logs the
    full-batch loss of the window on the weights it held (recomputed here in one forward of
    the 8 sequences); and the split stays at the fp32 floor from the full batch for as long as
    no fake-quantised value of its forwards has moved to another grid point or grid (see
    [flipped values]): a split parts only at or after a step whose forward had one."""
    rows = followed(name)
    for step, row in enumerate(rows, start=1):
        assert row["loss_gap"] <= LOSS_TOLERANCE, (step, row)
        if all(r["flips"] == 0 for r in rows[:step]):
            assert row["distance"] <= PARITY_TOLERANCE, (step, row)


@pytest.mark.parametrize("name", [n for n in SPLIT_RUNS if n.startswith("full_split")])
def test_with_int8_activations_the_splits_part_by_far_more_than_rounding(followed, name) -> None:
    """Int8-activation, int4-weight fake quantisation over 3 steps: once values flip (at step 2),
    the splits part by far more than rounding (so the rule above is not vacuous)."""
    rows = followed(name)
    assert max(row["distance"] for row in rows) > DRIFT, rows
    assert max(row["code_flips"] for row in rows) > 0, rows


@pytest.mark.parametrize("name", [n for n in SPLIT_RUNS if n.startswith("full_off")])
def test_with_fake_quantisation_off_the_splits_stay_at_the_floor(followed, name: str) -> None:
    """The same splits stay at the fp32 floor over every step when fake quantisation stays off
    (``fake_quant_after_n_steps`` past the run): the drift is fake quantisation's."""
    rows = followed(name)
    assert max(row["distance"] for row in rows) <= PARITY_TOLERANCE, rows


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
    weights_dir: Path, quantizer, out: Path, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The saved weights read back as ``tune run quantize`` reads them (the HF checkpointer),
    into the tiny model in ``dtype`` prepared by ``quantizer``, then converted by it; with the
    logits of a forward before the convert step without and with fake quantisation
    (``plain``, ``fake_quantised``) and after it (``quantised``)."""
    from torchtune import training
    from torchtune.models.llama3_2 import llama3_2

    from exactga.qat.fake_quant import set_fake_quant

    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(weights_dir),
        checkpoint_files=[Path(TRAINED).name],
        model_type="LLAMA3_2",
        output_dir=str(out),
    )
    state = checkpointer.load_checkpoint()[training.MODEL_KEY]
    sizes = {k.split(".")[1]: v for k, v in SMALL_MODEL.items()}
    with training.set_default_dtype(dtype):
        model = llama3_2(vocab_size=2048, max_seq_len=512, tie_word_embeddings=True, **sizes)
    prepared = quantizer.prepare(model)
    prepared.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = {}
    with torch.no_grad():
        set_fake_quant(prepared, False)
        logits["plain"] = prepared(tokens).float()
        set_fake_quant(prepared, True)
        logits["fake_quantised"] = prepared(tokens).float()
        converted = quantizer.convert(prepared)
        logits["quantised"] = converted(tokens).float()
    return converted, logits


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_saved_weights_convert_and_the_converted_model_runs(runs: Path, tmp_path: Path) -> None:
    """What stock's quantize recipe does with a QAT run's output: prepare, load the saved
    weights, ``quantizer.convert``; the converted model (torchao's int8-activation, int4-weight
    linears) runs a forward with the fake-quantised model's numbers, and not the unquantised
    model's (the comparison can fail)."""
    from torchtune.training.quantization import Int8DynActInt4WeightQATQuantizer

    groupsize = PARITY["quantizer.groupsize"]
    # LoRA's merged weights are plain weights too: the LoRA split runs' full batch (3 SGD
    # steps) stands for any LoRA QAT run's.
    for name in ("full_1x8x1", "lora_split_1x8x1"):
        converted, logits = _prepared_and_converted(
            runs / name / "epoch_0", Int8DynActInt4WeightQATQuantizer(groupsize), tmp_path / name
        )
        kinds = {type(m).__name__ for m in converted.modules()}
        assert "Int8DynActInt4WeightLinear" in kinds, kinds
        assert torch.isfinite(logits["quantised"]).all()
        to_fake, to_plain = (
            _relative(logits["quantised"], logits["fake_quantised"]),
            _relative(logits["quantised"], logits["plain"]),
        )
        print(f"{name}: converted vs fake-quantised {to_fake:.1e}, vs unquantised {to_plain:.1e}")
        torch.testing.assert_close(
            logits["quantised"], logits["fake_quantised"], rtol=1e-4, atol=1e-4
        )
        assert to_plain > 100 * to_fake


def test_int4_weight_only_converts_and_runs_in_bf16_on_cpu(runs: Path, tmp_path: Path) -> None:
    """The int4 weight-only run's saved weights, converted as stock's quantize recipe does in
    bf16 (its configs' dtype): torchao's tinygemm-layout linears (``WeightOnlyInt4Linear``) run
    on CPU too, through torch's CPU int4 kernel, in bf16 only (fp32 fails in the kernel:
    ``expected scalar type Float but found BFloat16``); their logits are the fake-quantised
    model's up to bf16 rounding. tests/gpu/test_gpu_qat_convert.py runs both quantizers on
    CUDA."""
    from torchtune.training.quantization import Int4WeightOnlyQATQuantizer

    quantizer = Int4WeightOnlyQATQuantizer(groupsize=PARITY["quantizer.groupsize"], inner_k_tiles=2)
    converted, logits = _prepared_and_converted(
        runs / "full_4w_after_2" / "epoch_0", quantizer, tmp_path / "4w", dtype=torch.bfloat16
    )
    assert "WeightOnlyInt4Linear" in {type(m).__name__ for m in converted.modules()}
    to_fake, to_plain = (
        _relative(logits["quantised"], logits["fake_quantised"]),
        _relative(logits["quantised"], logits["plain"]),
    )
    print(
        f"int4 weight-only, bf16: converted vs fake-quantised {to_fake:.1e}, "
        f"vs unquantised {to_plain:.1e}"
    )
    assert to_fake <= 2e-2  # bf16 logits
    assert to_plain > 3 * to_fake


def test_the_parity_report_shows_qat_split_invariance_and_the_baselines_gap(runs: Path) -> None:
    """recipes/ga_parity.py on configs/tiny/ga_parity_qat.yaml over 2 gloo ranks: every exact
    split (one device and data-parallel, every micro-batching) at the fp32 floor from the full
    batch with fake quantisation on; the naive baseline parts from it; the report says what
    every run trained under."""
    folder = runs / "ga_parity"
    output = (folder / "output.txt").read_text()
    assert (folder / "returncode").read_text() == "0", output[-4000:]
    summary = json.loads((folder / "parity" / "summary.json").read_text())
    assert summary["fake_quantisation"]["quantizer"] == "Int8DynActInt4WeightQATQuantizer"
    by_mode: dict[str, list[float]] = {}
    for run in summary["runs"]:
        by_mode.setdefault(run["mode"], []).append(run["relative_l2"])
        print(f"{run['mode']}/{run['micro_batching']} {run['split']}: {run['relative_l2']:.2e}")
    assert {run["split"] for run in summary["runs"]} >= {"1x4x2", "2x2x2"}
    assert max(by_mode["exact"]) <= summary["noise_floor"], by_mode
    assert min(by_mode["naive"]) > 10 * summary["noise_floor"], by_mode
    report = (folder / "parity" / "report.md").read_text()
    assert "Fake quantisation: Int8DynActInt4WeightQATQuantizer" in report
