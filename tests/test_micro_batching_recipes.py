"""Length-aware micro-batching (issue #12) through the real ``tune run`` on CPU.

Tier (b) of docs/contributing.md point 9. Every run steps on the same 32 sequences per step (same
seed, same sampler order over the data's first 256 rows), 2 steps with SGD and 3 with AdamW; only
``micro_batching`` and the split differ:

- ``fixed`` 32x1, ``by_length`` 4x8, ``token_budget`` 32x1 (1024 padded positions per
  micro-batch) and ``packed`` 4x8 (rows of 512 positions) end within the parity bound of each
  other, full fine-tuning (SGD, AdamW) and LoRA (fp32, and fp64 for one pair), because the split
  is exact (see [regrouping is exact] in exactga.data.micro_batching, [packed rows are exact] in
  exactga.data.packing); the logged padding shows that the split really changed, and ``packed`` runs
  one micro-batch shape;
- on 2 gloo ranks, 16x1 ``token_budget`` and 2x8 ``packed`` (AdamW, and SGD for packed) end at
  the one-device weights (``by_length`` on 2 ranks: tests/test_recipe_full_distributed.py, whose
  distributed config regroups by length, and tests/test_ga_parity_distributed.py); under
  ``token_budget`` and ``packed`` the ranks plan different micro-batch counts, so the one with
  fewer runs zero-weight fillers (see [one collective per window] in
  exactga.accumulation.normalization);
- a run killed with SIGKILL after a mid-epoch step checkpoint resumes, in every mode (and on 2
  ranks with ``token_budget``), to the uninterrupted run's weights bit for bit, with the same
  losses. tests/test_resume.py kills at random steps under the default mode.

Each set of runs is made once per session (``run_once``): the one-device runs one after another
(tests/many_runs.py: each forked from the tests' server), the 2-rank ones likewise; the AdamW
runs are also the resume tests' uninterrupted runs, and the resumes run last among them, after
the kills (a launch each, two at a time). Run with ``-rP`` to see the measured distances.
"""

from __future__ import annotations

import itertools
import json
import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from many_runs import Run, launch_runs, run_of
from recipe_utils import (
    INITIAL,
    REPO_ROOT,
    SMALL_MODEL,
    TRAINED,
    launch_and_kill,
    load_adapters,
    load_weights,
    lora_tiny_args,
    read_scalars,
    relative_l2,
    tiny_args,
)

# The tests read the module's shared runs (one group: the fixtures are made once).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("micro_batching_recipes")]

DISTRIBUTED = "recipes/full_finetune.py"
DISTRIBUTED_CONFIG = "configs/tiny/full_distributed.yaml"
COUNTER = REPO_ROOT / "tests/collective_counter"
ADAPTERS = "epoch_0/adapter_model.pt"

# Steps per run, by optimizer. SGD's modes sit at their floor from the first step, so its runs,
# and LoRA's (SGD too), take 2, the fewest in which a second step starts from weights the first
# moved. AdamW's take 3: its floor falls with steps (see OPTIMIZERS), and the resume tests kill
# its runs after step 1 and need a step left after the next.
PARITY_STEPS = {"sgd": 2, "adamw": 3}
ADAMW_STEPS = PARITY_STEPS["adamw"]  # the steps of the runs the resume and filler tests read
BUDGET = 1024  # token_budget's padded positions per micro-batch: 4 sequences of max_seq_len 256
ROW = 512  # packed's positions per row: the tiny model's max_seq_len
# The data's first 256 rows, twice the 96 sequences a run reads (3 steps of 32): a 2-rank run's
# length index (rank_balancing: by_tokens) then tokenizes 128 rows on each rank at start-up
# instead of the shipped 2,069's half. Every run of the module and the planner below take it.
DATA = "train[:256]"
# The modes on one device, 32 sequences per step: (batch_size, gradient_accumulation_steps, mode).
MODES = {
    "fixed": (32, 1, {"micro_batching": "fixed"}),
    "by_length": (4, 8, {"micro_batching": "by_length"}),
    "token_budget": (32, 1, {"micro_batching": "token_budget", "micro_batch_tokens": BUDGET}),
    "packed": (4, 8, {"micro_batching": "packed", "micro_batch_tokens": ROW}),
}
# Two ranks, 32 sequences per step in all. On DATA's rows a budget of 640 plans the same counts
# on both ranks in the first three windows (5, 5, 5), 384 plans 7, 8, 8 on rank 0 and 7, 9, 7 on
# rank 1, so the filler path runs in the second and third. The token_budget run syncs
# gradients every micro-batch: the collective counter then sees how many micro-batches each
# rank ran (one reduce-scatter per FSDP unit per micro-batch). by_length on 2 ranks is the
# distributed config's default, trained against one device in tests/test_recipe_full_distributed.py.
TWO_RANKS = {
    "token_budget": (
        16,
        1,
        {
            "micro_batching": "token_budget",
            "micro_batch_tokens": 384,
            "gradient_sync": "every_micro_batch",
            # The default rank_balancing: by_tokens, under which the ranks still plan 8 and 9
            # micro-batches in the second window, so its fillers run with balanced ranks.
        },
    ),
    "packed": (2, 8, {"micro_batching": "packed", "micro_batch_tokens": ROW}),
}
# Two-rank runs beyond TWO_RANKS' AdamW ones: (mode, optimizer).
TWO_RANK_SGD = [("packed", "sgd")]
TWO_RANK_RUNS = [*((mode, "adamw") for mode in TWO_RANKS), *TWO_RANK_SGD]


def _two_rank_name(mode: str, optimizer: str) -> str:
    """A 2-rank run's folder: its mode (AdamW, also the resume tests' uninterrupted runs), or
    ``<optimizer>_<mode>``."""
    return mode if optimizer == "adamw" else f"{optimizer}_{mode}"


FSDP_UNITS = SMALL_MODEL["model.num_layers"] + 1  # the layers and the root

# No clipping and no warm-up, so the comparison is about the gradient alone and the first step
# moves the weights; fp32 whatever the config's default.
PARITY = {
    "dataset.split": DATA,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
    "dtype": "fp32",
}
OPTIMIZERS = {
    # Plain gradient descent: weight decay removed (a value of None removes the key); the lr
    # is large so the update dwarfs rounding.
    "sgd": {
        "optimizer._component_": "torch.optim.SGD",
        "optimizer.lr": 0.5,
        "~optimizer.weight_decay": None,
    },
    # The tiny config's AdamW(lr=1e-3, weight_decay=0.01) with eps 1e-6 instead of 1e-8. AdamW
    # divides each element's update by that element's own gradient scale, so in its first steps
    # an element whose gradient is near eps turns fp32 rounding into lr-sized differences: after
    # 3 steps the modes measured 0.9e-5 to 1.8e-5 apart with eps 1e-8 (1.2e-5 after 6 steps), and
    # 1.1e-6 with eps 1e-6 (64 sequences a step). With eps 1e-6, 32 sequences a step of DATA,
    # 3 steps, measured 2026-11-29: 1.23e-6 to 1.30e-6 on one device, 1.13e-6 and 1.44e-6 on 2
    # ranks; SGD after 2 steps 0.34e-6 to 0.36e-6 (2 ranks 0.34e-6). The larger eps keeps the
    # check on the normalisation, not on that amplification (tests/test_recipe_lora_single_device.py
    # does the same in fp64).
    "adamw": {"optimizer.eps": 1e-6},
}
TOLERANCE = 1e-5
# The AdamW runs also write a step checkpoint after every step: the resume tests go on from one.
RESUMABLE = {"save_every_n_steps": 1}

# LoRA with plain SGD (as above). Its B matrices start at zero, so AdamW's amplification of
# rounding is at its worst on the adapters: with the config's AdamW the fp32 modes measured
# 0.5e-6 to 2.2e-6 apart after 3 steps (at the bound), with SGD 0.84e-6 at 64 sequences a step
# and 0.71e-6 to 0.72e-6 at 32 (fp64: 1.3e-8 at 64, 2.9e-8 at 32); 2 steps of 32 of DATA
# measured 1.9e-7 to 2.3e-7 (fp64 3.8e-8) on 2026-11-29. fp64 uses torch's
# CrossEntropyLoss (the chunked loss upcasts to fp32 only). Each fp64 launch is the slowest of
# the module, so fp64 compares one pair.
LORA_PRECISIONS = {  # precision: (overrides, tolerance, modes)
    "fp32": ({}, 2e-6, tuple(MODES)),
    "fp64": (
        {"dtype": "fp64", "loss._component_": "torch.nn.CrossEntropyLoss"},
        1e-7,
        ("fixed", "by_length"),
    ),
}


def _cli(settings: dict[str, object]) -> list[str]:
    """Command-line overrides; a value of None removes the key (``~key``)."""
    return [key if value is None else f"{key}={value}" for key, value in settings.items()]


def _settings(split: tuple[int, int, dict[str, object]], optimizer: str) -> dict[str, object]:
    batch_size, ga, micro_batching = split
    settings = {
        **PARITY,
        "max_steps_per_epoch": PARITY_STEPS[optimizer],
        "batch_size": batch_size,
        "gradient_accumulation_steps": ga,
        **micro_batching,
        **OPTIMIZERS[optimizer],
    }
    if optimizer == "adamw":
        settings.update(RESUMABLE)
    return settings


def _full_args(out: Path, mode: str, optimizer: str = "adamw") -> list[str]:
    """Full fine-tuning on one device in ``mode``."""
    return tiny_args(out) + _cli(_settings(MODES[mode], optimizer))


def _two_rank_args(out: Path, mode: str, optimizer: str = "adamw") -> list[str]:
    """The distributed recipe on 2 ranks in ``mode`` (AdamW, as the one-device reference)."""
    head = ["--nproc_per_node", "2", DISTRIBUTED, "--config", DISTRIBUTED_CONFIG]
    return head + tiny_args(out)[3:] + _cli(_settings(TWO_RANKS[mode], optimizer))


# --- the runs: every set made once per session, the resume tests' kills first -------------

RESUME_CASES = [*((1, mode) for mode in MODES), (2, "token_budget"), (2, "packed")]


def _resume_name(num_ranks: int, mode: str) -> str:
    return f"resumed_{num_ranks}rank_{mode}"


def _launch_and_kill(args: list[str], out: Path, after_step: int) -> None:
    """Launch, and SIGKILL every process of it once step ``after_step``'s checkpoint exists
    (the checkpointer renames a complete folder into place, so that one is complete).

    ``kill_launch`` takes the ranks too, and returns once every one is gone.
    """
    checkpoint = out / "step_checkpoints" / f"step_{after_step:06d}"
    launch_and_kill(args, out.parent / f"{out.name}_killed.txt", ready=checkpoint.is_dir)
    assert not (out / "epoch_0").exists(), "the run was killed too late to test a resume"


def _killed_and_resumed(root: Path, num_ranks: int) -> list[Run]:
    """The resume cases on ``num_ranks`` ranks: each AdamW run launched and killed after step 1
    (a launch each, two at a time), and the runs that resume them, to run after
    the uninterrupted runs. A failed kill is kept in ``<case>/kill_failed`` for its test."""
    cases = [mode for ranks, mode in RESUME_CASES if ranks == num_ranks]
    args = _full_args if num_ranks == 1 else _two_rank_args

    def kill(mode: str) -> Run | None:
        folder = root / _resume_name(num_ranks, mode)
        folder.mkdir()
        out = folder / "run"
        try:
            _launch_and_kill(args(out, mode), out, after_step=1)
        except BaseException:  # noqa: BLE001 - the case's test reports it
            (folder / "kill_failed").write_text(traceback.format_exc()[-8000:])
            return None
        resume = ["resume_from_checkpoint=True", f"metric_logger.log_dir={folder / 'logs'}"]
        return run_of(args(out, mode) + resume, folder / "launch")[1]

    with ThreadPoolExecutor(max_workers=2) as pool:
        return [run for run in pool.map(kill, cases) if run is not None]


def _check_launched(root: Path, names: list[str]) -> None:
    for name in names:
        status = (root / name / "returncode").read_text()
        assert status == "0", f"{name}:\n{(root / name / 'output.txt').read_text()[-4000:]}"


@pytest.fixture(scope="module")
def one_device_runs(run_once) -> Path:
    """Every one-device run, once per session, one after another, each forked
    from the tests' server (tests/many_runs.py: still the recipe as ``tune run`` starts it), the
    resumes of the one-device resume cases last (checked by their tests): full fine-tuning
    ``<optimizer>_<mode>``; LoRA with SGD ``<precision>_<mode>``, and ``<precision>_init``, the
    seeded adapter initialisation (one step at learning rate 0 leaves it untouched)."""

    def make(root: Path) -> None:
        resumes = _killed_and_resumed(root, 1)
        named = {
            f"{opt}_{mode}": _full_args(root / f"{opt}_{mode}", mode, opt)
            for opt in OPTIMIZERS
            for mode in MODES
        }
        for precision, (overrides, _, modes) in LORA_PRECISIONS.items():
            runs = {mode: _settings(MODES[mode], "sgd") for mode in modes}
            runs["init"] = {
                **runs["fixed"],
                "batch_size": 1,
                "max_steps_per_epoch": 1,
                "optimizer.lr": 0,
            }
            for name, settings in runs.items():
                out = root / f"{precision}_{name}"
                named[out.name] = lora_tiny_args(out) + _cli({**settings, **overrides})
        runs = [run_of(args, root / name)[1] for name, args in named.items()]
        launch_runs([*runs, *resumes], nproc=0)
        _check_launched(root, list(named))

    return run_once("micro_batching_one_device", make)


@pytest.fixture(scope="module")
def full_runs(one_device_runs) -> Path:
    """Full fine-tuning on one device, ``<optimizer>_<mode>``."""
    return one_device_runs


@pytest.fixture(scope="module")
def lora_runs(one_device_runs) -> Path:
    """LoRA on one device with SGD: ``<precision>_<mode>`` and ``<precision>_init``."""
    return one_device_runs


@pytest.fixture(scope="module")
def two_rank_runs(run_once) -> Path:
    """The distributed recipe on 2 ranks in each mode of TWO_RANKS, collectives counted
    (``<mode>_collectives/rank<r>.json``, see tests/collective_counter), and TWO_RANK_SGD's
    runs, once per session one after another (tests/many_runs.py), the resumes of the 2-rank
    resume cases last (checked by their tests)."""

    def make(root: Path) -> None:
        resumes = _killed_and_resumed(root, 2)
        runs = []
        for mode in TWO_RANKS:
            counts = root / f"{mode}_collectives"
            counts.mkdir()
            run = run_of(_two_rank_args(root / mode, mode), root / mode)[1]
            runs.append(run._replace(env={"EXACTGA_COUNT_COLLECTIVES_DIR": str(counts)}))
        for mode, optimizer in TWO_RANK_SGD:
            name = _two_rank_name(mode, optimizer)
            runs.append(run_of(_two_rank_args(root / name, mode, optimizer), root / name)[1])
        # The counter needs its variable at start-up; each counted run then names its folder.
        python_path = os.pathsep.join(filter(None, [str(COUNTER), os.environ.get("PYTHONPATH")]))
        other = root / "other_collectives"
        other.mkdir()
        counter = {"PYTHONPATH": python_path, "EXACTGA_COUNT_COLLECTIVES_DIR": str(other)}
        launch_runs([*runs, *resumes], nproc=2, extra_env=counter)
        _check_launched(root, [run.folder.name for run in runs])

    return run_once("micro_batching_two_ranks", make)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_modes_end_at_the_same_weights(full_runs, optimizer):
    """by_length 4x8, token_budget 32x1 and packed 4x8 train to the weights of fixed 32x1
    (relative L2 <= 1e-5) on the same 32 sequences per step, with the same losses."""
    reference = full_runs / f"{optimizer}_fixed"
    w_ref, w_init = load_weights(reference / TRAINED), load_weights(reference / INITIAL)
    ref_scalars = read_scalars(reference / "logs")
    assert len(ref_scalars["loss"]) == PARITY_STEPS[optimizer]
    for mode in ("by_length", "token_budget", "packed"):
        run = full_runs / f"{optimizer}_{mode}"
        scalars = read_scalars(run / "logs")
        assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]  # the same sequences
        rel = relative_l2(load_weights(run / TRAINED), w_ref, w_init)
        print(f"full {optimizer} {mode} vs fixed 32x1: relative L2 {rel:.3e}")
        assert rel <= TOLERANCE, f"{mode} differs from fixed by {rel:.3e}"
        assert scalars["loss"] == pytest.approx(ref_scalars["loss"], rel=1e-6)


def test_regrouping_lowers_the_logged_padding(full_runs):
    """The modes really split differently: ``throughput/padding_fraction`` is lower under
    by_length, token_budget and packed than under fixed at every step, and each run logs it,
    ``throughput/loss_tokens_per_second`` and ``throughput/micro_batch_shapes`` at every step:
    packed runs one shape, by_length one per longest sample of a micro-batch."""
    padding, shapes = {}, {}
    for mode in MODES:
        scalars = read_scalars(full_runs / f"adamw_{mode}" / "logs")
        tags = (
            "throughput/padding_fraction",
            "throughput/loss_tokens_per_second",
            "throughput/micro_batch_shapes",
        )
        for tag in tags:
            assert len(scalars.get(tag, [])) == ADAMW_STEPS, (mode, tag, scalars.get(tag))
        assert min(scalars["throughput/loss_tokens_per_second"]) > 0
        padding[mode] = scalars["throughput/padding_fraction"]
        shapes[mode] = scalars["throughput/micro_batch_shapes"]
        assert all(0 <= p < 1 for p in padding[mode]), (mode, padding[mode])
    print(f"padding fraction per step: {padding}; distinct shapes so far: {shapes}")
    for mode in ("by_length", "token_budget", "packed"):
        assert all(p < f for p, f in zip(padding[mode], padding["fixed"], strict=True)), mode
    assert shapes["packed"] == [1.0] * ADAMW_STEPS
    by_length = shapes["by_length"]  # 8 micro-batches a step, each its longest sample's length
    assert by_length == sorted(by_length) and by_length[-1] > 1


# --- LoRA, one device ----------------------------------------------------------------------


@pytest.mark.parametrize("precision", list(LORA_PRECISIONS))
def test_lora_modes_end_at_the_same_adapters(lora_runs, precision):
    """The modes train to the adapters of fixed 32x1: fp32 within 2e-6 (by_length 4x8,
    token_budget 32x1 and packed 4x8), fp64 within 1e-7 (by_length 4x8)."""
    _, tolerance, modes = LORA_PRECISIONS[precision]
    reference = lora_runs / f"{precision}_fixed"
    a_ref = load_adapters(reference / ADAPTERS)
    a_init = load_adapters(lora_runs / f"{precision}_init" / ADAPTERS)
    assert a_ref.keys() == a_init.keys()
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[precision]
    assert all(tensor.dtype == dtype for tensor in a_ref.values())
    ref_scalars = read_scalars(reference / "logs")
    assert len(ref_scalars["loss"]) == PARITY_STEPS["sgd"]
    for mode in (mode for mode in modes if mode != "fixed"):
        run = lora_runs / f"{precision}_{mode}"
        assert read_scalars(run / "logs")["loss_tokens"] == ref_scalars["loss_tokens"]
        rel = relative_l2(load_adapters(run / ADAPTERS), a_ref, a_init)
        print(f"lora sgd {precision} {mode} vs fixed 32x1: relative L2 {rel:.3e}")
        assert rel <= tolerance, f"{mode} differs from fixed by {rel:.3e}"


# --- two ranks ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "optimizer"), TWO_RANK_RUNS)
def test_two_ranks_end_at_the_one_device_weights(full_runs, two_rank_runs, mode, optimizer):
    """2 ranks x (16x1 token_budget, 2x8 packed; and packed with SGD) train to
    the weights of one device's fixed 32x1 run with the same optimizer: the same sampler order
    and initial checkpoint, as in tests/test_recipe_full_distributed.py (relative L2 <= 1e-5)."""
    reference = full_runs / f"{optimizer}_fixed"
    run = two_rank_runs / _two_rank_name(mode, optimizer)
    scalars, ref_scalars = read_scalars(run / "logs"), read_scalars(reference / "logs")
    assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]
    rel = relative_l2(
        load_weights(run / TRAINED),
        load_weights(reference / TRAINED),
        load_weights(reference / INITIAL),
    )
    print(f"2 ranks {mode} {optimizer} vs 1 device fixed 32x1: relative L2 {rel:.3e}")
    assert rel <= TOLERANCE
    assert scalars["loss"] == pytest.approx(ref_scalars["loss"], rel=1e-6)


def _planned_micro_batches() -> list[list[int]]:
    """How many micro-batches each rank's first ADAMW_STEPS windows of the 2-rank token_budget run
    split into, from the loader every recipe builds (exactga.data.loader) on the runs' data."""
    from omegaconf import OmegaConf
    from torchtune import config

    from exactga.config.options import RankBalancing
    from exactga.data.loader import build_dataloader, load_dataset
    from exactga.data.micro_batching import MicroBatching, MicroBatchingSettings

    batch_size, ga, settings = TWO_RANKS["token_budget"]
    cfg = OmegaConf.load(REPO_ROOT / DISTRIBUTED_CONFIG)
    cfg.tokenizer.path = str(REPO_ROOT / cfg.tokenizer.path)
    cfg.dataset.data_files = str(REPO_ROOT / cfg.dataset.data_files)
    cfg.dataset.split = DATA
    tokenizer = config.instantiate(cfg.tokenizer)
    budget = MicroBatchingSettings(
        MicroBatching.TOKEN_BUDGET, batch_size, settings["micro_batch_tokens"]
    )
    dataset = load_dataset(cfg.dataset, tokenizer, cfg.model.vocab_size)

    def planned(rank: int) -> list[int]:
        loader = build_dataloader(
            dataset,
            batch_size=batch_size,
            gradient_accumulation_steps=ga,
            micro_batching=budget,
            shuffle=cfg.shuffle,
            collate_fn="torchtune.data.padded_collate_sft",
            padding_idx=tokenizer.pad_id,
            ignore_idx=-100,
            num_replicas=2,
            rank=rank,
            rank_balancing=RankBalancing.BY_TOKENS,  # the distributed recipes' default
        )
        loader.sampler.set_epoch(0)
        return [len(window.micro_batches) for window in itertools.islice(loader, ADAMW_STEPS)]

    return [planned(rank) for rank in range(2)]


def test_token_budget_ranks_with_fewer_micro_batches_run_fillers(two_rank_runs):
    """Under token_budget the ranks plan different micro-batch counts; every rank then runs as
    many as the busiest (the counter sees one reduce-scatter per FSDP unit per micro-batch
    run), so the other runs zero-weight fillers, and the parity test above shows they weigh
    nothing. The ranks' positions differ too: ``throughput/rank_imbalance`` > 1."""
    planned = _planned_micro_batches()
    print(f"micro-batches planned per step: rank 0 {planned[0]}, rank 1 {planned[1]}")
    busiest = [max(counts) for counts in zip(*planned, strict=True)]
    assert planned[0] != planned[1], "no window with fillers: the test would not test them"
    counts = two_rank_runs / "token_budget_collectives"
    for rank in range(2):
        steps = json.loads((counts / f"rank{rank}.json").read_text())
        ran = [step.get("reduce_scatter", 0) / FSDP_UNITS for step in steps]
        assert ran == busiest, f"rank {rank} ran {ran} micro-batches per step"
    imbalance = read_scalars(two_rank_runs / "token_budget" / "logs")["throughput/rank_imbalance"]
    print(f"token_budget throughput/rank_imbalance per step: {imbalance}")
    assert len(imbalance) == ADAMW_STEPS and max(imbalance) > 1


# --- resume --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_ranks", "mode"), RESUME_CASES, ids=[f"{n}rank-{m}" for n, m in RESUME_CASES]
)
def test_killed_run_resumes_bit_identical(request, num_ranks, mode):
    """Killed after step 1 of 3, resumed from that mid-epoch step checkpoint: the next windows
    are regrouped as in the uninterrupted AdamW run (on 2 ranks with token_budget, fillers
    included), so the weights are equal bit for bit and the resumed steps log the same losses."""
    if num_ranks == 1:  # only the runs this case needs
        root = request.getfixturevalue("full_runs")
        uninterrupted = root / f"adamw_{mode}"
    else:
        root = request.getfixturevalue("two_rank_runs")
        uninterrupted = root / mode
    folder = root / _resume_name(num_ranks, mode)
    if (folder / "kill_failed").exists():
        pytest.fail(f"the kill failed:\n{(folder / 'kill_failed').read_text()}")
    output = (folder / "launch" / "output.txt").read_text()
    status = (folder / "launch" / "returncode").read_text()
    assert status == "0", f"resumed {num_ranks} rank {mode}:\n{output[-4000:]}"
    assert "Resuming from step checkpoint" in output
    out = folder / "run"

    losses = read_scalars(folder / "logs")["loss"]
    expected = read_scalars(uninterrupted / "logs")["loss"]
    assert 1 <= len(losses) < ADAMW_STEPS, losses  # went on mid-epoch, from step 1 or 2
    resumed_after = ADAMW_STEPS - len(losses)
    print(f"{num_ranks} rank {mode}: resumed after step {resumed_after}; losses {losses}")
    assert losses == expected[-len(losses) :]
    final, reference = load_weights(out / TRAINED), load_weights(uninterrupted / TRAINED)
    assert final.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(final[key], tensor), key
