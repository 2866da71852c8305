"""recipes/lora_finetune.py through the real ``tune run --nproc_per_node N`` on CPU.

Tier (b) of docs/contributing.md point 9, gloo ranks, offline. All runs are made once, in a module
fixture, by number of ranks (tests/many_runs.py: each run forked from the tests' server, still the
recipe as ``tune run`` starts it, one after another); each test then
reads what they wrote. Under ``pytest -n 2`` the fixture's runs are shared between the workers
through a file lock, so they are made once per session.
The one-rank reference is this recipe with ``--nproc_per_node 1``: the adapters start from the
same values whatever the number of ranks (``exactga.runtime.distributed.initialize_adapters``).

Parity runs are in fp64 with torch's CrossEntropyLoss and plain SGD. Even so, torchtune's RoPE
computes in fp32 (``x.float()`` in ``RotaryPositionalEmbeddings.forward``), so the splits'
different matmul shapes occasionally flip an fp32 rounding of q and k: that is the floor the
1e-7 checks sit on (2.4e-8 to 4.3e-8 printed for the splits after these 4 SGD steps, 2026-11-29;
8 steps printed 1.6e-8 to 2.7e-8).
AdamW, which amplifies the relative error of near-zero gradient entries, lands further: 9.8e-8
in fp64 after 12 steps of 2 ranks 2x2 in recipes/ga_parity.py (docs/lora_finetune_distributed.md),
which is why these checks use SGD. Run with ``-rP`` to see the distances.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from many_runs import Run, launch_runs
from recipe_utils import (
    SMALL_MODEL,
    load_adapters,
    load_weights,
    read_scalars,
    relative_l2,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lora_distributed")]

RECIPE = "recipes/lora_finetune.py"
CONFIG = "configs/tiny/lora_distributed.yaml"
SINGLE_RECIPE = "recipes/lora_finetune.py"
SINGLE_CONFIG = "configs/tiny/lora_single_device.yaml"
ADAPTERS = "epoch_0/adapter_model.pt"
PEFT_ADAPTERS = "epoch_0/adapter/adapter_model.safetensors"
ADAPTER_CONFIG = "epoch_0/adapter/adapter_config.json"
MERGED = "epoch_0/model-00001-of-00001.safetensors"
BASE = "base_model/model.safetensors"
PARITY_TOLERANCE = 1e-7

# fp64, no clipping, no warm-up, plain SGD with a large lr so the adapters move far beyond
# rounding; sequences cut to 128 tokens to keep each step cheap. 4 steps: a split's parity needs
# 2 (the later ones start from the weights the earlier made); the docstring has the distances.
# The runs read 32 samples (4 steps x 8): every run reads the data's first 128 rows, so each
# rank's length index (rank_balancing: by_tokens) tokenizes 128 rows, not all 2,069.
PARITY = {
    "dtype": "fp64",
    "loss._component_": "torch.nn.CrossEntropyLoss",
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "~optimizer.weight_decay": None,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
    "tokenizer.max_seq_len": 128,
    "max_steps_per_epoch": 4,
    "dataset.split": "train[:128]",
}


def _row(instruction: str, output: str) -> dict[str, str]:
    return {"instruction": instruction, "input": "", "output": output}


def empty_rank_rows() -> list[dict[str, str]]:
    """Eight rows per step; unshuffled, rank 0 reads the even rows and rank 1 the odd ones.

    step 0: rank 1 only prompts longer than max_seq_len: no loss token on that rank
    step 1: both ranks train
    step 2: no loss token on any rank: the step is skipped everywhere
    step 3: (2x2) rank 0's first micro-batch is empty, rank 1's second
    """
    short = _row("Say hi.", "Hi there, friend.")
    long = _row("Tell a story.", " ".join(["the quick brown fox jumps over the lazy dog"] * 3))
    masked = _row(" ".join(["describe the weather in a very long sentence"] * 30), "Sunny.")
    steps = [
        [short, masked] * 4,
        [long, short] * 4,
        [masked] * 8,
        [masked, short, masked, long, short, masked, long, masked],
    ]
    return [row for step in steps for row in step]


def _run(name: str, nproc: int, settings: dict[str, object], root: Path) -> Run:
    """A run of this recipe, or of the single-device recipe for ``nproc`` 0."""
    out = root / name
    merged = {**SMALL_MODEL, "output_dir": out, **settings}
    overrides = [k if v is None else f"{k}={v}" for k, v in merged.items()]
    if nproc == 0:
        return Run(SINGLE_RECIPE, ["--config", SINGLE_CONFIG, *overrides], out)
    return Run(RECIPE, ["--config", CONFIG, *overrides], out)


def _launch_all(root: Path) -> None:
    data = root / "empty_rank.json"
    data.write_text(json.dumps(empty_rank_rows()))
    EMPTY_RANK = {  # noqa: N806 - a table of settings, like PARITY
        **PARITY,
        "dataset.data_files": data,
        "dataset.split": "train",  # all 32 rows of its own
        "shuffle": False,
        "rank_balancing": "none",  # the rows are laid out for stock's deal: an empty rank
        "tokenizer.max_seq_len": 64,
        "max_steps_per_epoch": 4,
        "save_adapter_weights_only": True,
    }
    launches = {
        # name: (ranks, overrides); bs x ga per rank, 8 sequences per step in all
        "1rank_8x1": (1, {**PARITY, "batch_size": 8, "gradient_accumulation_steps": 1}),
        # The single-device recipe on the same run: adapters start and train the same.
        "single_device_8x1": (0, {**PARITY, "batch_size": 8, "gradient_accumulation_steps": 1}),
        "2ranks_4x1": (2, {**PARITY, "batch_size": 4, "gradient_accumulation_steps": 1}),
        "2ranks_1x4": (
            2,
            {
                **PARITY,
                "batch_size": 1,
                "gradient_accumulation_steps": 4,
                "gradient_sync": "once_per_window",
            },
        ),
        "2ranks_2x2": (2, {**PARITY, "batch_size": 2, "gradient_accumulation_steps": 2}),
        # Activation checkpointing, as most stock LoRA configs set it: wrapped layers must
        # still receive their initial adapters, and recomputation must not change numbers.
        "2ranks_2x2_ac": (
            2,
            {
                **PARITY,
                "batch_size": 2,
                "gradient_accumulation_steps": 2,
                "enable_activation_checkpointing": True,
            },
        ),
        # lr 0 for one step: the initial adapters, drawn on two ranks.
        "init_2ranks": (
            2,
            {**PARITY, "batch_size": 4, "max_steps_per_epoch": 1, "optimizer.lr": 0},
        ),
        "empty_rank_2ranks_2x2": (
            2,
            {**EMPTY_RANK, "batch_size": 2, "gradient_accumulation_steps": 2},
        ),
        # The same rows on one rank: ragged ranks must still give the one-rank adapters.
        "empty_rank_1rank_8x1": (
            1,
            {**EMPTY_RANK, "batch_size": 8, "gradient_accumulation_steps": 1},
        ),
    }
    # One group per number of ranks (2, 1, and the single-device recipe's), two side by side,
    # each running its runs one after another (tests/many_runs.py).
    by_ranks: dict[int, list[Run]] = {2: [], 1: [], 0: []}
    for name, (nproc, settings) in launches.items():
        by_ranks[nproc].append(_run(name, nproc, settings, root))
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(launch_runs, runs, nproc) for nproc, runs in by_ranks.items()]
        for future in futures:
            future.result()
    for name in launches:
        output = (root / name / "output.txt").read_text()
        assert (root / name / "returncode").read_text() == "0", f"{name}:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    """The runs' output folders, made once per test session for every xdist worker."""
    return run_once("lora_distributed_runs", _launch_all)


@pytest.mark.parametrize("name", ["2ranks_4x1", "2ranks_1x4", "2ranks_2x2", "2ranks_2x2_ac"])
def test_rank_and_accumulation_splits_match_one_rank(runs, name):
    """2 ranks x (4x1, 1x4 once_per_window, 2x2 every_micro_batch, 2x2 with activation
    checkpointing) train to the adapters of 1 rank 8x1 (fp64, relative L2 <= 1e-7)."""
    reference, initial = runs / "1rank_8x1", load_adapters(runs / "init_2ranks" / ADAPTERS)
    scalars, ref_scalars = read_scalars(runs / name / "logs"), read_scalars(reference / "logs")
    assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]  # the same 8 sequences per step
    assert len(scalars["loss"]) == PARITY["max_steps_per_epoch"]
    rel = relative_l2(
        load_adapters(runs / name / ADAPTERS), load_adapters(reference / ADAPTERS), initial
    )
    print(f"{name} vs 1 rank 8x1: relative L2 {rel:.3e}")
    assert rel <= PARITY_TOLERANCE
    # The logged loss is the exact window loss over both ranks, as on one rank.
    assert scalars["loss"] == pytest.approx(ref_scalars["loss"], rel=1e-6)


def test_activation_checkpointing_changes_no_number(runs):
    """The same 2x2 run with and without activation checkpointing: same losses, and adapters
    within the parity bound. Recomputing a layer's forward in backward repeats the same ops on
    the same inputs, so nothing but rounding may differ."""
    plain, checkpointed = runs / "2ranks_2x2", runs / "2ranks_2x2_ac"
    resolved = (checkpointed / "resolved_config.yaml").read_text()  # the run's whole config
    assert "enable_activation_checkpointing: true" in resolved
    initial = load_adapters(runs / "init_2ranks" / ADAPTERS)
    rel = relative_l2(
        load_adapters(checkpointed / ADAPTERS), load_adapters(plain / ADAPTERS), initial
    )
    print(f"2x2 with vs without activation checkpointing: relative L2 {rel:.3e}")
    assert rel <= PARITY_TOLERANCE
    losses = read_scalars(checkpointed / "logs")["loss"]
    assert losses == pytest.approx(read_scalars(plain / "logs")["loss"], rel=1e-12)


def test_one_rank_trains_bit_identically_to_the_single_device_recipe(runs):
    """The same config on one rank of this recipe and on the single-device recipe: the same
    initial adapters (drawn from the seed alone, see [adapter init] in exactga.lora.adapters),
    the same logged losses and the same trained adapters, to the bit."""
    one_rank, single = runs / "1rank_8x1", runs / "single_device_8x1"
    adapters, single_adapters = load_adapters(one_rank / ADAPTERS), load_adapters(single / ADAPTERS)
    assert adapters.keys() == single_adapters.keys()
    for key, tensor in adapters.items():
        assert torch.equal(tensor, single_adapters[key]), key
    assert read_scalars(one_rank / "logs")["loss"] == read_scalars(single / "logs")["loss"]


def test_initial_adapters_are_lora_init(runs):
    """B starts at zero and A does not. That the init does not depend on the number of ranks
    is what the parity test shows: its distances are relative to these two-rank initial
    adapters, taken against a one-rank run."""
    initial = load_adapters(runs / "init_2ranks" / ADAPTERS)
    lora_a = {k: v for k, v in initial.items() if "lora_a" in k}
    lora_b = {k: v for k, v in initial.items() if "lora_b" in k}
    assert lora_a and len(lora_a) == len(lora_b)
    assert all(float(v.abs().max()) == 0.0 for v in lora_b.values())
    assert all(float(v.abs().max()) > 0.0 for v in lora_a.values())


def test_ragged_and_empty_ranks_match_one_rank(runs):
    """Very different token counts per rank, a rank with no loss token and a window empty on
    both: still the adapters of one rank reading the same rows (fp64, <= 1e-7)."""
    initial = load_adapters(runs / "init_2ranks" / ADAPTERS)
    reference = load_adapters(runs / "empty_rank_1rank_8x1" / ADAPTERS)
    rel = relative_l2(load_adapters(runs / "empty_rank_2ranks_2x2" / ADAPTERS), reference, initial)
    print(f"ragged 2 ranks 2x2 vs 1 rank 8x1: relative L2 {rel:.3e}")
    assert rel <= PARITY_TOLERANCE


def test_window_empty_on_one_rank_keeps_adapters_finite(runs):
    """A rank with no loss token in a window, a window empty on every rank, a rank whose first
    micro-batch is empty: adapters finite, the all-empty window skipped once, on both ranks."""
    run = runs / "empty_rank_2ranks_2x2"
    scalars = read_scalars(run / "logs")
    assert scalars["loss_tokens"][2] == 0
    assert all(n > 0 for i, n in enumerate(scalars["loss_tokens"]) if i != 2)
    assert scalars["skipped_steps"][-1] == 1
    assert all(math.isfinite(v) for v in scalars["loss"])
    adapters = load_adapters(run / ADAPTERS)
    for name, tensor in adapters.items():
        assert torch.isfinite(tensor).all(), f"{name} is not finite"
    assert any(float(v.abs().max()) > 0 for k, v in adapters.items() if "lora_b" in k)
    assert (run / "output.txt").read_text().count("no loss token in this accumulation window") == 1
    # save_adapter_weights_only: adapters and their config, no merged weights.
    assert (run / PEFT_ADAPTERS).is_file() and (run / ADAPTER_CONFIG).is_file()
    assert not (run / MERGED).exists()


def test_artefacts_match_stock_layout(runs):
    """Written by rank 0 as stock writes them: adapters in torchtune's and PEFT's format,
    adapter config, merged weights that differ from the base only where LoRA applies."""
    run = runs / "2ranks_4x1"
    adapters, peft = load_adapters(run / ADAPTERS), load_weights(run / PEFT_ADAPTERS)
    assert len(peft) == len(adapters) and all(k.startswith("base_model.model.") for k in peft)
    adapter_config = json.loads((run / ADAPTER_CONFIG).read_text())
    assert adapter_config["peft_type"] == "LORA"
    assert adapter_config["r"] == 8 and adapter_config["lora_alpha"] == 16
    merged, base = load_weights(run / MERGED), load_weights(run / BASE)
    assert merged.keys() == base.keys()
    changed = {k for k in merged if not torch.equal(merged[k].to(base[k].dtype), base[k])}
    assert changed and all("proj" in k for k in changed), sorted(changed)
    assert not any("k_proj" in k or "embed" in k for k in changed)
    # Rank 0 alone logs and writes: one TensorBoard run, one progress bar.
    assert len(list((run / "logs").rglob("events.out.tfevents.*"))) == 1
    assert "epoch 1: 100%" in (run / "output.txt").read_text()
