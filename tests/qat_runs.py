"""The QAT recipes' runs, made once per test session and read by every QAT test module.

tests/test_recipe_qat.py (splits, fake quantisation's switch, the convert step),
tests/test_qat_resume.py (a run killed with SIGKILL, resumed) and tests/test_qat_stock_configs.py
(two stock configs) read the folders ``make_all`` fills. Three groups, two side by side with
the third: the kill (a launch of its own: it needs a process killed), then every one-process run
one after another (tests/many_runs.py: each forked from the tests' server), the resumed run
last; beside them every 2-rank run, the stock configs' too, one after another on 2 ranks.
Nothing here is a test.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import stock_configs
from many_runs import Run, launch_runs, run_of
from recipe_utils import SMALL_MODEL, latest_step_checkpoint, launch_and_kill

FULL = ("recipes/qat_distributed.py", "configs/tiny/qat_distributed.yaml")
LORA = ("recipes/qat_lora_finetune_distributed.py", "configs/tiny/qat_lora_distributed.yaml")
PLAIN_FULL = ("recipes/full_finetune.py", "configs/tiny/full_distributed.yaml")
INT8_ACT_INT4_WEIGHT = "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer"
INT4_WEIGHT_ONLY = "torchtune.training.quantization.Int4WeightOnlyQATQuantizer"
STEPS = 6  # the AdamW runs: fake quantisation switched on after 4 steps still has steps to part
SPLIT_STEPS = 3  # the split runs, each step checkpointed: int8 activations part them at step 2
# The split runs' data: the first 64 rows, over twice the 24 sequences a run reads (3 steps of
# 8), the same rows for every split and its one-process reference; a 2-rank run's length index
# (``rank_balancing: by_tokens``) then tokenizes 64 rows, not 2,069.
SPLIT_ROWS = 64

# fp32, 6 AdamW steps, no clipping, no warm-up; fake quantisation from the first step, with a
# group size that divides the small model's widths (64, 128).
PARITY = {
    "dtype": "fp32",
    "max_steps_per_epoch": STEPS,
    "clip_grad_norm": "null",
    "lr_scheduler.num_warmup_steps": 0,
    "quantizer.groupsize": 32,
}
# The splits: plain SGD steps (large lr, so the update dwarfs rounding), each step's weights
# kept, so the tests can follow every step (docs/qat.md, "What is exact").
SPLIT = {
    **PARITY,
    "max_steps_per_epoch": SPLIT_STEPS,
    "optimizer._component_": "torch.optim.SGD",
    "optimizer.lr": 0.5,
    "~optimizer.weight_decay": None,
    "save_every_n_steps": 1,
    "keep_last_n_checkpoints": SPLIT_STEPS + 1,
    # Short rows, every token a label (the prompt alone would fill 64): the tests redo each
    # step's forward in-process.
    "tokenizer.max_seq_len": 64,
    "dataset.train_on_input": True,
    "dataset.split": f"train[:{SPLIT_ROWS}]",
}
FULL_ON = {"fake_quant_after_n_steps": "null"}
FULL_OFF = {"fake_quant_after_n_steps": SPLIT_STEPS}  # switched on after the run's last step
WEIGHT_ONLY = {**FULL_ON, "quantizer._component_": INT4_WEIGHT_ONLY, "quantizer.inner_k_tiles": 2}
# (ranks, batch_size, gradient_accumulation_steps): 8 sequences per step in every split.
SPLITS = {"1x8x1": (0, 8, 1), "1x2x4": (0, 2, 4), "2x4x1": (2, 4, 1), "2x1x4": (2, 1, 4)}
# The split runs' kinds: (recipe and config, settings, the splits each runs).
SPLIT_KINDS = {
    "full": (FULL, FULL_ON, list(SPLITS)),  # int8 activations, int4 weights, on from step 1
    "full_off": (FULL, FULL_OFF, ["1x8x1", "1x2x4", "2x4x1"]),  # never on within the run
    "full_4w": (FULL, WEIGHT_ONLY, ["1x8x1", "1x2x4", "2x4x1"]),  # int4 weights only
    "lora": (LORA, {}, list(SPLITS)),  # frozen base weights: only activations can flip
}


def _split_launches() -> dict[str, tuple[tuple[str, str], int, dict]]:
    launches = {}
    for kind, (recipe, settings, splits) in SPLIT_KINDS.items():
        for split in splits:
            nproc, batch, ga = SPLITS[split]
            split_keys = {"batch_size": batch, "gradient_accumulation_steps": ga}
            launches[f"{kind}_split_{split}"] = (recipe, nproc, {**SPLIT, **settings, **split_keys})
    return launches


# (recipe and config, ranks (0: no torchrun), overrides).
LAUNCHES = {
    "full_1x8x1": (FULL, 0, {**PARITY, **FULL_ON, "batch_size": 8}),
    **_split_launches(),
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
        {**PARITY, "batch_size": 8, **WEIGHT_ONLY, "fake_quant_after_n_steps": 2},
    ),
}

# Two of the six stock QAT configs in CI (all six: tools/stock_config_sweep.py --only qat):
STOCK_SELECTION = [
    # full: untied embeddings, custom_sharded_layers, activation checkpointing, fused AdamW
    ("qat_distributed", "llama3/8B_qat_full"),
    # LoRA: tied embeddings, 4 x 8 micro-batches per rank, a cosine schedule with warm-up
    ("qat_lora_finetune_distributed", "llama3_2/1B_qat_lora"),
]

# The resume scenario: AdamW with warm-up and a cosine schedule, clipping, 2 x 2 micro-batches,
# two epochs of 4 steps, a step checkpoint after each, fake quantisation switched on after 3
# steps (so a kill before step 3 resumes with it off, and the resumed run must switch it on).
RESUME_EPOCHS, RESUME_STEPS_PER_EPOCH = 2, 4
RESUME = {
    "dtype": "fp32",
    "quantizer.groupsize": 32,
    "fake_quant_after_n_steps": 3,
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "epochs": RESUME_EPOCHS,
    "max_steps_per_epoch": RESUME_STEPS_PER_EPOCH,
    "lr_scheduler.num_warmup_steps": 2,
    "save_every_n_steps": 1,
    "metric_logger._component_": "torchtune.training.metric_logging.DiskLogger",
}
KILL_TIMEOUT_S = 240

# The GA parity report on the QAT config, among the 2-rank runs: a one-device split and the two
# 2-rank ones, exact (every micro-batching) against the naive baseline the test reads, on the
# small model (the group size divides its widths too). docs/qat.md's table is the config's own
# command: every split and mode, width 128.
PARITY_CONFIG = "configs/tiny/ga_parity_qat.yaml"
PARITY_KEYS = ["parity.splits=[2x4,1x4x2,2x2x2]", "parity.modes=[naive,exact]"]


def overrides_of(settings: dict, output_dir: Path) -> list[str]:
    """``key=value`` overrides (``~key`` for a removal) on the small model."""
    overrides: dict[str, object] = {**SMALL_MODEL, "output_dir": output_dir, **settings}
    overrides.setdefault("gradient_accumulation_steps", 1)
    return [k if v is None else f"{k}={v}" for k, v in overrides.items()]


def _run(name: str, root: Path) -> tuple[int, Run]:
    (recipe, config), nproc, settings = LAUNCHES[name]
    args = ["--config", config, *overrides_of(settings, root / name)]
    return nproc, Run(recipe, args, root / name)


def resume_args(out: Path, **extra: object) -> list[str]:
    recipe, config = FULL
    return [recipe, "--config", config, *overrides_of({**RESUME, **extra}, out)]


def _kill(root: Path, seed: int) -> None:
    """The resume scenario launched and killed with SIGKILL (every rank) once a randomly drawn
    step's checkpoint exists, plus a random delay (mid-step or mid-save); its draw and the step
    it will resume from are kept in ``root/resume``."""
    folder = root / "resume"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{seed}/qat")
    total = RESUME_EPOCHS * RESUME_STEPS_PER_EPOCH
    kill_after, delay = rng.randint(1, total - 4), rng.uniform(0.0, 0.2)
    out = folder / "killed"
    try:
        launch_and_kill(
            resume_args(out),
            folder / "killed.txt",
            ready=lambda: latest_step_checkpoint(out) >= kill_after,
            timeout_s=KILL_TIMEOUT_S,
            delay_s=delay,
        )
    except BaseException:  # noqa: BLE001 - the resume test reports it
        (folder / "kill_failed").write_text(traceback.format_exc()[-8000:])
        return
    (folder / "draw").write_text(
        f"EXACTGA_KILL_SEED={seed}: killed after step {kill_after} + {delay:.2f} s"
    )
    (folder / "checkpoint").write_text(str(latest_step_checkpoint(out)))


def _one_process_runs(root: Path) -> list[Run]:
    """Every one-process run; the resume scenario's uninterrupted run, and its resumed run
    (after the kill, logging into a folder of its own) last."""
    runs = [run for nproc, run in (_run(name, root) for name in LAUNCHES) if nproc == 0]
    folder = root / "resume"
    runs.append(Run(*_split(resume_args(folder / "uninterrupted")), folder / "uninterrupted"))
    if not (folder / "kill_failed").exists():
        resumed = resume_args(
            folder / "killed",
            resume_from_checkpoint=True,
            **{"metric_logger.log_dir": folder / "resumed_logs"},
        )
        runs.append(Run(*_split(resumed), folder / "resumed"))
    return runs


def _split(args: list[str]) -> tuple[str, list[str]]:
    return args[0], args[1:]


def _two_rank_runs(root: Path) -> list[Run]:
    runs = [run for nproc, run in (_run(name, root) for name in LAUNCHES) if nproc == 2]
    parity = root / "ga_parity"
    args = ["--config", PARITY_CONFIG, f"output_dir={parity}", *PARITY_KEYS]
    args += [f"{key}={value}" for key, value in SMALL_MODEL.items()]
    runs.append(Run("recipes/ga_parity.py", args, parity))
    for recipe, name in STOCK_SELECTION:
        out = stock_folder(root, recipe, name)
        nproc, run = run_of(stock_configs.launch_args(name, recipe, out, sliced=True), out)
        assert nproc == 2  # these runs are launched on 2 ranks
        runs.append(run)
    return runs


def stock_folder(root: Path, recipe: str, name: str) -> Path:
    return root / "stock" / recipe / name


def make_all(root: Path, seed: int) -> None:
    """Every QAT run: the kill, then the one-process runs, beside the 2-rank runs."""

    def one_process() -> None:
        _kill(root, seed)
        launch_runs(_one_process_runs(root), nproc=0)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(one_process),
            pool.submit(launch_runs, _two_rank_runs(root), 2),
        ]
        for future in futures:
            future.result()


def kill_seed() -> int:
    """``EXACTGA_KILL_SEED`` replays a kill's draw; by default the clock's."""
    return int(os.environ.get("EXACTGA_KILL_SEED", time.time_ns() % 1_000_000))


def shared_runs(run_once) -> Path:
    """The folder of every QAT run, made on first use once per test session."""
    return run_once("qat_runs", lambda root: make_all(root, kill_seed()))
