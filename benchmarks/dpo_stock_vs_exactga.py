"""LoRA DPO: stock torchtune 0.6.1's ``lora_dpo_single_device`` and exactga's, side by side.

Every run is a real ``tune run`` subprocess on CPU, fp32, with ``OMP_NUM_THREADS=1``, on the 300
variable-length preference pairs of configs/tiny/preference_data.json, from the same seeded base
checkpoint and in the same data order (``seed``, and the sampler's fixed seed 0). Both recipes
read configs written from configs/tiny/lora_dpo_single_device.yaml with ``lr_scheduler: null``
(a constant learning rate); stock's copy leaves out the keys only exactga reads. Three parts:

1. **Parity.** The small tiny model (2 layers, dim 64: ``SMALL_MODEL``) trained as 8x1, 1x8 and
   2x4 (pairs per micro-batch x accumulation) by each recipe, and by exactga also as 4x2 cut by
   ``token_budget`` (1024 positions) and, where an epoch ends on a partial window, as 1x8 with
   ``drop_partial_window=True``; exactga's splits use its default ``micro_batching: by_length``.
   Two cases: 296 pairs, 1 epoch (every window full), and 44 pairs, 2 epochs (each epoch ends on
   4 leftover pairs: stock's 8x1 loader drops them, stock's 1x8 and 2x4 run them backward without
   a step, so their gradient joins the next epoch's first step; exactga's 1x8, 2x4 and 4x2 step
   on them, its 8x1 drops them, being one micro-batch of 8). Each with plain gradient descent
   (SGD, lr 0.1, no weight decay) and with the config's AdamW (lr 5e-4, weight decay 0.05). It
   prints ``||a - a_ref|| / ||a_ref - a_init||`` over the adapters after the last step
   (exactga.parity.scoring.relative_l2). ``a_init``: stock's from a one-step run at learning
   rate 0 (stock draws its adapters from the global generator while building the model);
   exactga's drawn in-process by the library call its recipe makes (exactga.lora.adapters).
2. **Padding**, the share of the positions processed that are padding, at each speed setting:
   stock's computed here from its own loader (``DistributedSampler`` with seed 0, a
   ``drop_last`` loader, ``padded_collate_dpo``: ``2B`` rows padded to the longest of both
   sides); exactga's from the end-of-run line of each of its speed runs.
3. **Speed.** The shipped tiny model (4 layers, dim 256) on the first 288 pairs (a multiple of
   every window below, so no run has a leftover), 1 epoch, as 8x1, 2x4 and 8x4: stock, and
   exactga with ``micro_batching`` fixed, by_length and token_budget (1024 positions). One run
   at a time, in rounds; within a round the four run back to back, in an order rotated every
   round. Per run: seconds per optimizer step, wall and CPU (the process's user + system time,
   sampled from /proc), the mean over steps 3..n (consecutive ``loss`` event wall times, so
   start-up and checkpointing are left out); then stock's time over each run's, taken within
   each round and given as the median (min-max) over rounds.

Every run sets ``save_adapter_weights_only=True``: on CPU stock's merged save adds the adapters
into the model's own base in place (docs/lora_finetune_single_device.md), so a second stock epoch
would train over, and take its reference from, a changed base. exactga's runs set
``clip_grad_norm=null`` (stock's DPO recipe does not clip) and ``saved_latency_every_n_steps=0``
(that sampling times an extra gradient pass stock does not do).

Run from the repository root (on 2 CPU cores shared with other work, load average 1 to 5: 57
minutes; ``--quick``, a smoke check with fewer pairs, SGD only, 1 round of 4 steps on the small
model: 6 minutes)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/dpo_stock_vs_exactga.py

``--rounds N`` sets the speed rounds (default 3); ``--sgd-lr`` the parity runs' SGD learning rate
(default 0.1: at 0.5 the loss of 37 steps swings between 0.5 and 1.1 and the splits of both
recipes drift apart far above rounding); ``--out DIR`` keeps the run folders, each run's output
and the two configs (default: a temporary folder, deleted afterwards).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path

import numpy
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "src"))
from exactga.parity.scoring import relative_l2  # noqa: E402

CONFIG = REPO_ROOT / "configs/tiny/lora_dpo_single_device.yaml"
STOCK_RECIPE = "lora_dpo_single_device"
OUR_RECIPE = "recipes/lora_dpo.py"
# Keys that only exactga's recipe reads; stock's config leaves out those the tiny config has.
OUR_KEYS = (
    "loss_normalization",
    "drop_partial_window",
    "micro_batching",
    "micro_batch_tokens",
    "precompute_reference_logprobs",
    "clip_grad_norm",
    "log_timings",
    "saved_latency_every_n_steps",
    "peak_flops",
    "profiler",
)
COMMON = ("save_adapter_weights_only=True", "max_steps_per_epoch=null", "log_every_n_steps=1")
OURS_ONLY = ("clip_grad_norm=null", "saved_latency_every_n_steps=0")
SMALL_MODEL = (
    "model.num_layers=2",
    "model.embed_dim=64",
    "model.intermediate_dim=128",
    "model.num_heads=4",
    "model.num_kv_heads=2",
)
MICRO_BATCH_TOKENS = 1024  # 2 x 512: one longest pair alone, or several short ones
BUDGET = ("micro_batching=token_budget", f"micro_batch_tokens={MICRO_BATCH_TOKENS}")
# The parity runs' optimizers; SGD's learning rate is --sgd-lr.
OPTIMIZERS = {
    "SGD": (
        "optimizer._component_=torch.optim.SGD",
        "optimizer.weight_decay=0",
    ),
    "AdamW": (
        "optimizer._component_=torch.optim.AdamW",
        "optimizer.lr=5e-4",
        "optimizer.weight_decay=0.05",
    ),
}
STOCK_SPLITS = {"8x1": (8, 1), "1x8": (1, 8), "2x4": (2, 4)}
# exactga's runs: (batch_size, gradient_accumulation_steps, extra overrides).
OUR_SPLITS = {
    "8x1": (8, 1, ()),
    "1x8": (1, 8, ()),
    "2x4": (2, 4, ()),
    "4x2 token_budget": (4, 2, BUDGET),
    "1x8 drop_partial_window": (1, 8, ("drop_partial_window=True",)),
}
ADAPTERS = "adapter_model.pt"
# The parity rows: (case, run, reference run, what the two do with an epoch's leftover pairs,
# whether stock has both runs).
COMPARISONS = (
    ("full", "1x8", "8x1", "no leftover", True),
    ("full", "2x4", "8x1", "no leftover", True),
    ("full", "4x2 token_budget", "8x1", "no leftover", False),
    ("partial", "1x8", "8x1", "1x8 trains on them (*), 8x1 drops them", True),
    ("partial", "2x4", "1x8", "both train on them (*)", True),
    ("partial", "4x2 token_budget", "1x8", "both train on them (*)", False),
    ("partial", "1x8 drop_partial_window", "8x1", "both drop them", False),
)
SPEED_SETTINGS = {"8x1": (8, 1), "2x4": (2, 4), "8x4": (8, 4)}
SPEED_VARIANTS = ("stock", "fixed", "by_length", "token_budget")
SPEED_PAIRS = 288
WARMUP_STEPS = 2
PADDING_LINE = re.compile(r"padding was ([\d.]+)% of the ([\d,]+) positions processed")
CPU_POLL_S = 0.05  # /proc counts CPU time in 10 ms ticks
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Settings:
    """What one invocation runs: the full benchmark or ``--quick``."""

    full_pairs: int  # pairs of the every-window-full case (a multiple of 8)
    optimizers: tuple[str, ...]
    speed_settings: tuple[str, ...]
    speed_model: tuple[str, ...]
    speed_max_steps: str  # max_steps_per_epoch of the speed runs
    rounds: int


FULL = Settings(296, ("SGD", "AdamW"), tuple(SPEED_SETTINGS), (), "null", 3)
QUICK = Settings(48, ("SGD",), ("8x1", "2x4"), SMALL_MODEL, "4", 1)
CASES = {"full": ("every window full", 1), "partial": ("44 pairs, 2 epochs", 2)}


def write_configs(root: Path) -> dict[str, Path]:
    """The two recipes' configs: the tiny DPO config at a constant learning rate, and for stock
    the same without exactga's keys."""
    cfg = OmegaConf.load(CONFIG)
    cfg.lr_scheduler = None
    ours, stock = root / "exactga.yaml", root / "stock.yaml"
    OmegaConf.save(cfg, ours)
    for key in OUR_KEYS:
        cfg.pop(key, None)
    OmegaConf.save(cfg, stock)
    return {"stock": stock, "exactga": ours}


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a running process, from /proc (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def launch(recipe: str, config: Path, output_dir: Path, overrides: tuple[str, ...]) -> list:
    """``tune run`` one recipe, its output in ``output_dir``.log; returns its CPU-time trace,
    ``[(epoch seconds, CPU seconds so far)]``."""
    tune = Path(sys.executable).with_name("tune")
    command = [str(tune), "run", recipe, "--config", str(config), f"output_dir={output_dir}"]
    command += [*COMMON, *overrides]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log_path = output_dir.with_suffix(".log")
    trace = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=log)
        try:
            while proc.poll() is None:
                cpu_s = process_cpu_s(proc.pid)
                if cpu_s is not None:
                    trace.append((time.time(), cpu_s))  # TensorBoard's clock
                time.sleep(CPU_POLL_S)
        except BaseException:  # do not leave a run training alone
            proc.kill()
            proc.wait()
            raise
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(command)}\nfailed (exit {proc.returncode}):\n{tail}")
    return trace


def loss_wall_times(log_dir: Path) -> dict[int, float]:
    """Step -> wall time of the ``loss`` event of every logged step."""
    times = {}
    for event_file in sorted(log_dir.rglob("events.out.tfevents.*")):
        ea = EventAccumulator(str(event_file), size_guidance={"tensors": 0, "scalars": 0})
        ea.Reload()
        tags = ea.Tags()
        events = ea.Tensors("loss") if "loss" in tags.get("tensors", []) else []
        events += ea.Scalars("loss") if "loss" in tags.get("scalars", []) else []
        times.update({e.step: e.wall_time for e in events})
    if not times:
        raise FileNotFoundError(f"no loss events under {log_dir}")
    return times


def load_adapters(output_dir: Path, epoch: int) -> dict[str, torch.Tensor]:
    return torch.load(
        output_dir / f"epoch_{epoch}" / ADAPTERS, map_location="cpu", weights_only=True
    )


def our_initial_adapters() -> dict[str, torch.Tensor]:
    """exactga's starting adapters on the small model: the recipe's own library call
    (``initialize_adapters`` from the config's seed) on a model built on the meta device."""
    from torchtune import config

    from exactga.lora.adapters import initialize_adapters

    cfg = OmegaConf.load(CONFIG)
    for override in SMALL_MODEL:
        key, value = override.split("=")
        OmegaConf.update(cfg, key, int(value))
    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    drawn: dict[str, torch.Tensor] = {}
    initialize_adapters(
        model, dtype=torch.float32, seed=cfg.seed, load=lambda _, sd: drawn.update(sd)
    )
    return drawn


# ---------------------------------------------------------------------------------------------
# 1. Parity


def parity_runs(settings: Settings, configs: dict[str, Path], root: Path, sgd_lr: float) -> dict:
    """Every parity run, two at a time; returns (recipe, optimizer, case, split) -> its
    trained adapters, and ("stock", "init") -> stock's initial ones."""
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for optimizer, case in itertools.product(settings.optimizers, CASES):
            pairs = settings.full_pairs if case == "full" else 44
            epochs = CASES[case][1]
            data = (f"dataset.split=train[:{pairs}]", f"epochs={epochs}", *SMALL_MODEL)
            data += OPTIMIZERS[optimizer]
            data += (f"optimizer.lr={sgd_lr}",) if optimizer == "SGD" else ()
            for split, (bsz, ga) in STOCK_SPLITS.items():
                out = root / f"parity-stock-{optimizer}-{case}-{split}"
                args = (*data, f"batch_size={bsz}", f"gradient_accumulation_steps={ga}")
                jobs["stock", optimizer, case, split] = (
                    pool.submit(launch, STOCK_RECIPE, configs["stock"], out, args),
                    out,
                    epochs,
                )
            for split, (bsz, ga, extra) in OUR_SPLITS.items():
                if split.endswith("drop_partial_window") and case == "full":
                    continue
                out = root / f"parity-exactga-{optimizer}-{case}-{split.replace(' ', '-')}"
                args = (*data, f"batch_size={bsz}", f"gradient_accumulation_steps={ga}")
                jobs["exactga", optimizer, case, split] = (
                    pool.submit(
                        launch, OUR_RECIPE, configs["exactga"], out, (*args, *extra, *OURS_ONLY)
                    ),
                    out,
                    epochs,
                )
        out = root / "parity-stock-init"
        init_args = ("batch_size=8", "max_steps_per_epoch=1", *SMALL_MODEL, *OPTIMIZERS["SGD"])
        init_args += ("optimizer.lr=0",)
        jobs["stock", "init"] = (
            pool.submit(launch, STOCK_RECIPE, configs["stock"], out, init_args),
            out,
            1,
        )
        for future, _, _ in jobs.values():
            future.result()
    return {key: load_adapters(out, epochs - 1) for key, (_, out, epochs) in jobs.items()}


def parity_table(settings: Settings, adapters: dict) -> list[str]:
    initial = {"stock": adapters["stock", "init"], "exactga": our_initial_adapters()}
    header = "| case | run vs reference | an epoch's 4 leftover pairs |"
    header += "".join(f" {opt}: stock 0.6.1 | {opt}: exactga |" for opt in settings.optimizers)
    lines = [header, "|---|---|---|" + "---|---|" * len(settings.optimizers)]
    for case, run, reference, leftover, stock_has_it in COMPARISONS:
        label = f"{settings.full_pairs} pairs, 1 epoch" if case == "full" else CASES[case][0]
        cells = []
        for optimizer in settings.optimizers:
            for recipe in ("stock", "exactga"):
                if recipe == "stock" and not stock_has_it:
                    cells.append("no such run")
                    continue
                gap = relative_l2(
                    adapters[recipe, optimizer, case, run],
                    adapters[recipe, optimizer, case, reference],
                    initial[recipe],
                )
                cells.append(f"{gap:.2e}")
        lines.append(f"| {label} | {run} vs {reference} | {leftover} | " + " | ".join(cells) + " |")
    return lines


# ---------------------------------------------------------------------------------------------
# 2. Padding of stock's loader


def stock_padding(bsz: int, ga: int, max_steps: int | None) -> tuple[float, int]:
    """(padding share, positions) of the micro-batches stock's recipe runs on the first
    ``SPEED_PAIRS`` pairs: its own sampler, ``drop_last`` loader and ``padded_collate_dpo``."""
    from torch.utils.data import DataLoader, DistributedSampler
    from torchtune import config
    from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_dpo

    cfg = OmegaConf.load(CONFIG)
    cfg.dataset.split = f"train[:{SPEED_PAIRS}]"
    tokenizer = config.instantiate(cfg.tokenizer)
    dataset = config.instantiate(cfg.dataset, tokenizer=tokenizer)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    collate = partial(
        padded_collate_dpo, padding_idx=tokenizer.pad_id, ignore_idx=CROSS_ENTROPY_IGNORE_IDX
    )

    def collate_and_count(samples):  # stock's batch, and its real (unpadded) positions
        real = sum(len(s["chosen_input_ids"]) + len(s["rejected_input_ids"]) for s in samples)
        return collate(samples), real

    loader = DataLoader(
        dataset, sampler=sampler, batch_size=bsz, drop_last=True, collate_fn=collate_and_count
    )
    positions = real = 0
    for index, ((tokens, _), num_real) in enumerate(loader):
        if max_steps is not None and index // ga == max_steps:
            break  # stock's own stopping test
        positions += tokens.numel()
        real += num_real
    return 1 - real / positions, positions


# ---------------------------------------------------------------------------------------------
# 3. Speed


@dataclass(frozen=True)
class SpeedRun:
    setting: str
    variant: str
    round: int
    wall_s: float  # mean seconds per optimizer step, steps 3..n
    cpu_s: float | None
    padding: tuple[float, int] | None  # exactga's end-of-run line


def speed_run(
    settings: Settings, configs: dict[str, Path], root: Path, setting: str, variant: str, rnd: int
) -> SpeedRun:
    bsz, ga = SPEED_SETTINGS[setting]
    args = (f"dataset.split=train[:{SPEED_PAIRS}]", "epochs=1", *settings.speed_model)
    args += (f"batch_size={bsz}", f"gradient_accumulation_steps={ga}")
    if variant != "stock":
        args += (
            *OURS_ONLY,
            *(BUDGET if variant == "token_budget" else (f"micro_batching={variant}",)),
        )
    args += (f"max_steps_per_epoch={settings.speed_max_steps}",)  # after COMMON's null: it wins
    out = root / f"speed-{setting}-{variant}-{rnd}"
    recipe, config = (
        (STOCK_RECIPE, configs["stock"]) if variant == "stock" else (OUR_RECIPE, configs["exactga"])
    )
    trace = launch(recipe, config, out, args)
    times = loss_wall_times(out / "logs")
    steps = [s for s in sorted(times) if s > WARMUP_STEPS]
    start, end = times[steps[0] - 1], times[steps[-1]]
    num_steps = len(steps)
    cpu_s = None
    if len(trace) > 1 and trace[0][0] <= start and end <= trace[-1][0]:
        clock, cpu = zip(*trace, strict=True)
        cpu_s = float(numpy.interp(end, clock, cpu) - numpy.interp(start, clock, cpu)) / num_steps
    match = PADDING_LINE.search(out.with_suffix(".log").read_text(errors="replace"))
    padding = (float(match[1]) / 100, int(match[2].replace(",", ""))) if match else None
    return SpeedRun(setting, variant, rnd, (end - start) / num_steps, cpu_s, padding)


def speed_table(settings: Settings, runs: list[SpeedRun]) -> list[str]:
    max_steps = None if settings.speed_max_steps == "null" else int(settings.speed_max_steps)
    lines = [
        "| setting | run | padding | positions | s/step wall | s/step CPU "
        "| stock / run, wall | stock / run, CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setting in settings.speed_settings:
        by_variant = {
            v: [r for r in runs if r.setting == setting and r.variant == v] for v in SPEED_VARIANTS
        }
        stock_by_round = {r.round: r for r in by_variant["stock"]}
        for variant in SPEED_VARIANTS:
            mine = by_variant[variant]
            if variant == "stock":
                fraction, positions = stock_padding(*SPEED_SETTINGS[setting], max_steps)
            else:
                fraction, positions = mine[0].padding
            wall = statistics.median(r.wall_s for r in mine)
            cpus = [r.cpu_s for r in mine if r.cpu_s is not None]
            cpu = f"{statistics.median(cpus):.3f}" if cpus else "n/a"
            ratios = []
            for field in ("wall_s", "cpu_s"):
                values = [
                    getattr(stock_by_round[r.round], field) / getattr(r, field)
                    for r in mine
                    if getattr(r, field) and getattr(stock_by_round[r.round], field)
                ]
                ratios.append(_median_range(values) if variant != "stock" else "1")
            lines.append(
                f"| {setting} | {'stock 0.6.1' if variant == 'stock' else 'exactga ' + variant} "
                f"| {100 * fraction:.1f}% | {positions:,} | {wall:.3f} | {cpu} "
                f"| {ratios[0]} | {ratios[1]} |"
            )
    return lines


def _median_range(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke check of every part")
    parser.add_argument("--rounds", type=int, default=None, help="speed rounds (default 3)")
    parser.add_argument("--sgd-lr", type=float, default=0.1, help="the parity runs' SGD lr")
    parser.add_argument("--out", type=Path, default=None, help="keep the run folders here")
    opts = parser.parse_args()
    settings = QUICK if opts.quick else FULL
    if opts.rounds:
        settings = Settings(**{**settings.__dict__, "rounds": opts.rounds})
    root = (opts.out or Path(tempfile.mkdtemp(prefix="dpo_bench_"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.chdir(REPO_ROOT)  # the configs name the tokenizer and data relative to it
    started, load_before = time.perf_counter(), os.getloadavg()
    configs = write_configs(root)

    adapters = parity_runs(settings, configs, root, opts.sgd_lr)
    parity_s = time.perf_counter() - started
    print(f"# parity runs done in {parity_s / 60:.1f} min", file=sys.stderr, flush=True)
    speed: list[SpeedRun] = []
    speed_load: list[float] = []
    for rnd in range(settings.rounds):
        for setting in settings.speed_settings:
            shift = rnd % len(SPEED_VARIANTS)
            for variant in SPEED_VARIANTS[shift:] + SPEED_VARIANTS[:shift]:
                speed_load.append(os.getloadavg()[0])
                speed.append(speed_run(settings, configs, root, setting, variant, rnd))
                print(
                    f"# {setting} {variant} round {rnd}: {speed[-1].wall_s:.3f} s/step",
                    file=sys.stderr,
                    flush=True,
                )
    total_s = time.perf_counter() - started
    load_after = os.getloadavg()

    print(
        "## Parity: ||a - a_ref|| / ||a_ref - a_init|| over the LoRA adapters after the last step\n"
    )
    print("\n".join(parity_table(settings, adapters)))
    print(
        "\nSmall tiny model (" + " ".join(SMALL_MODEL) + "), fp32, constant lr, no clipping; "
        f"SGD lr {opts.sgd_lr}, AdamW lr 5e-4 weight decay 0.05; exactga splits by_length "
        "unless named. (*) stock runs them backward without a step, so their gradient joins "
        "the next epoch's first step; exactga steps on them.\n"
    )
    model = "small tiny model" if settings.speed_model else "tiny model (4 layers, dim 256)"
    print(f"## Padding and speed: the {model}, first {SPEED_PAIRS} pairs, 1 epoch, AdamW\n")
    print("\n".join(speed_table(settings, speed)))
    print(
        f"\ns/step: mean over steps {WARMUP_STEPS + 1}..n, median over {settings.rounds} "
        "round(s); ratios taken within each round, median (min-max). Load average (1 min) at "
        f"the start of the speed runs: {min(speed_load):.2f} to {max(speed_load):.2f}.\n"
    )
    print(
        f"Conditions: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} CPU cores shared with other work, load average (1 min) "
        f"{load_before[0]:.2f} before and {load_after[0]:.2f} after; torch {torch.__version__}, "
        f"torchtune {metadata.version('torchtune')}; OMP_NUM_THREADS=1; parity two runs at a "
        f"time, speed one at a time. Took {total_s / 60:.1f} min (parity {parity_s / 60:.1f})."
    )
    if opts.out is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
