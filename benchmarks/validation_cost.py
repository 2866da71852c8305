"""What validation during training costs: one validation call against one optimizer step.

For each model it times, in this one process and side by side, (a) one training optimizer step
(for the loss families the fine-tuning recipes' exact step, written out plainly: each
micro-batch's mean token loss through ``exactga.sft.loss.mean_token_loss``, weighed by its share
of the window's tokens, backward; gradient clipping at 1.0; ``AdamW.step``; gradients zeroed;
for GRPO and PPO see below), and (b) one validation call as ``_validate_if_due`` makes it (the
loss families' ``exactga.sft.validation.validation_loss`` on a ``ValidationSet``), once over the
whole set and once bounded by ``max_val_batches``. It prints the validation time per call and
its share of training time when validating every ``run_val_every_n_steps`` = 50 steps:
``val_ms / (50 * step_ms)``; for the loss families also milliseconds per scored token,
training's and validation's, which say where the difference comes from.

- ``tiny``: configs/tiny/full_single_device.yaml's model (4 layers, width 256, vocabulary 2048,
  tied embeddings), fp32, ``batch_size`` 4 x ``gradient_accumulation_steps`` 2, the tiny
  tokenizer at ``max_seq_len`` 256; validation on 256 rows at ``batch_size_val`` 4, bounded by
  ``max_val_batches`` 8 (32 rows).
- ``1B``: torchtune's ``llama3_2_1b`` shape (16 layers, width 2048, vocabulary 128,256, 1.24B
  parameters), bf16 weights and optimizer state as torchtune's 1B configs train (``dtype:
  bf16``). On a CPU it runs short rows (the tiny tokenizer at ``max_seq_len`` 128, the
  shortest at which the first rows keep answer tokens after their masked prompts; its ids fit
  the large vocabulary) and few of them, so that it finishes in minutes: ``batch_size`` 1 x
  ``gradient_accumulation_steps`` 2; validation on 8 rows at ``batch_size_val`` 2, bounded by
  ``max_val_batches`` 1 (2 rows); one repeat of one step (a CPU step takes a minute or more).
- ``grpo`` and ``ppo``: configs/tiny/grpo_distributed.yaml and configs/tiny/ppo_single_device.yaml
  as they are (fp32, one device), whose validation is generation (``exactga.grpo.validation``,
  ``exactga.ppo.validation``). The step is the recipes' own, from the library as the GA parity
  report runs it (``make_rollouts`` or ``make_trajectories``, then ``train_window`` over the
  step's windows): one rollout step of ``batch_size`` prompts (GRPO: 4 x 8 completions, one
  optimizer step) or one trajectory step (PPO: 8 prompts, one response each, 4 optimizer steps),
  timed whole and divided by its optimizer steps, so an optimizer step carries its share of the
  generation; ``run_val_every_n_steps`` counts optimizer steps. Training reads the arithmetic
  file's rows before 400, validation the 100 after (``train[400:]``) at ``batch_size_val`` 4,
  bounded by ``max_val_batches`` 4 (16 prompts): ``held_out_rewards`` (8 completions of each
  prompt, scored) or ``held_out_ppo`` (one response each, the no-grad forwards of the four
  models, returns).

The loss families' rows take the loss of the tiny config, torchtune's
``CEWithChunkedOutputLoss`` (8 output chunks), and the rows of configs/tiny/data.json (alpaca
template, prompts masked): training windows from the file's start, the validation set from row
1,000 on, never shuffled. The models, their seed (0) and the rows are fixed. After one warm-up
of the step and of the bounded call, every repeat times ``--steps`` training steps (their mean),
the whole-set call and the bounded call, in an order reversed every other repeat so that a
change in machine load hits each alike; the table gives each one's median over ``--repeats``.
Validation tokenizes its rows on access, as the recipes' datasets do, and that time is in its
figure; the loss families' training window is collated once, outside the timed step, so their
share is if anything overstated.

Run from the repository root (default: every model; on 2 CPU cores the tiny model 20 s idle to
100 s under load, the 1B one 90 s or more, GRPO's and PPO's a few minutes)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/validation_cost.py

``--quick``: the tiny configs only (no 1B), 2 repeats. ``--device cuda`` runs on a GPU (the 1B
model then at ``max_seq_len`` 1024 unless ``--seq-len-1b`` says otherwise).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import Dataset, Subset
from torchtune import config, training, utils
from torchtune.datasets import alpaca_dataset
from torchtune.models.llama2 import llama2_tokenizer
from torchtune.models.llama3_2 import llama3_2, llama3_2_1b
from torchtune.modules.loss import CEWithChunkedOutputLoss

from exactga.accumulation.loss_units import IGNORE_INDEX, ShiftedTokens
from exactga.accumulation.normalization import LossNormalizer
from exactga.accumulation.step import train_window
from exactga.config.options import MasterWeights, NormMode
from exactga.config.validation import typed_settings, validate_config
from exactga.data.collation import micro_batch_collate
from exactga.data.loader import build_prompt_loader, load_dataset
from exactga.data.micro_batching import MicroBatchingSettings
from exactga.grpo.losses import build_policy_loss
from exactga.grpo.policy import grpo_micro_batch_loss, loss_units_for
from exactga.grpo.rewards import build_rewards
from exactga.grpo.rollout_step import StepSettings, make_rollouts
from exactga.grpo.schema import GrpoDistributedConfig
from exactga.grpo.validation import HeldOutPrompts, held_out_rewards
from exactga.grpo.windows import ppo_epoch_windows
from exactga.ppo.loss import ResponseTokens, collate_trajectories, ppo_micro_batch_loss
from exactga.ppo.models import PolicyAndValue
from exactga.ppo.schema import PpoFullFinetuneSingleDeviceConfig, loss_settings
from exactga.ppo.trajectory import (
    StepModels,
    TrajectorySettings,
    make_trajectories,
    ppo_batch_windows,
)
from exactga.ppo.validation import HeldOutPpoPrompts, held_out_ppo
from exactga.profiling.hook import setup_profiler
from exactga.runtime.precision import Precision
from exactga.sft.loss import mean_token_loss
from exactga.sft.validation import ValidationLoss, validation_loss
from exactga.validation.held_out import ValidationSet

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = REPO_ROOT / "configs/tiny/tokenizer.model"
DATA = REPO_ROOT / "configs/tiny/data.json"
VAL_EVERY = 50  # run_val_every_n_steps of the share column
VAL_START = 1000  # the validation rows are the file's from here on
OUTPUT_CHUNKS = 8  # CEWithChunkedOutputLoss's default
SEED = 0


@dataclass(frozen=True)
class Shape:
    """One model of the table and the sizes it is timed at."""

    name: str
    build: Callable[[], nn.Module]
    dtype: torch.dtype
    seq_len: int  # the tokenizer's max_seq_len
    batch_size: int
    grad_accum: int
    val_rows: int
    batch_size_val: int
    max_val_batches: int
    timed_once: bool = False  # one repeat of one step, whatever --repeats and --steps say


def tiny_model() -> nn.Module:
    """configs/tiny/full_single_device.yaml's ``model`` section."""
    return llama3_2(
        vocab_size=2048,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=256,
        intermediate_dim=768,
        max_seq_len=512,
        tie_word_embeddings=True,
    )


def shapes(args: argparse.Namespace) -> list[Shape]:
    tiny = Shape("tiny", tiny_model, torch.float32, 256, 4, 2, 256, 4, 8)
    one_b = Shape("1B", llama3_2_1b, torch.bfloat16, args.seq_len_1b, 1, 2, 8, 2, 1, True)
    return [tiny] if args.quick else [tiny, one_b]


def dataset(seq_len: int) -> Dataset:
    """configs/tiny's training data, tokenized on access by the tiny tokenizer."""
    tokenizer = llama2_tokenizer(str(TOKENIZER), max_seq_len=seq_len, prompt_template=None)
    return alpaca_dataset(
        tokenizer, source="json", data_files=str(DATA), split="train", train_on_input=False
    )


def collate_for(batch_size: int) -> Callable:
    return micro_batch_collate(
        MicroBatchingSettings(batch_size=batch_size),
        "torchtune.data.padded_collate_sft",
        padding_idx=0,
        ignore_idx=IGNORE_INDEX,
    )


class TrainingStep:
    """The exact optimizer step on a fixed window, repeated: the window is collated once."""

    def __init__(self, model: nn.Module, loss_fn: nn.Module, shape: Shape, data: Dataset):
        self.model = model
        self.loss_fn = loss_fn
        self.units = ShiftedTokens(loss_fn)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
        collate = collate_for(shape.batch_size)
        self.micro_batches = [
            collate([data[i] for i in range(start, start + shape.batch_size)])
            for start in range(0, shape.batch_size * shape.grad_accum, shape.batch_size)
        ]
        self.counts = [self.units.count(batch) for batch in self.micro_batches]
        self.tokens = sum(self.counts)

    def run(self, device: torch.device) -> None:
        self.model.train()
        for batch, count in zip(self.micro_batches, self.counts, strict=True):
            batch = self.units.prepare(batch, count, runs_empty=False)
            utils.batch_to_device(batch, device)
            loss = mean_token_loss(self.model, self.loss_fn, batch)
            (loss * (count / self.tokens)).backward()  # the window's token mean
        nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Row:
    name: str
    step_ms: float
    step_tokens: int
    val_ms: float
    val_rows: int
    val_tokens: int


def side_by_side(
    train: Callable[[], float], validations: dict[str, Callable[[], float]], repeats: int
) -> dict[str, list[float]]:
    """Each timer's seconds per repeat (``"step"``: training's), in an order reversed every
    other repeat so that a change in machine load hits each alike."""
    timers = {"step": train, **validations}
    times: dict[str, list[float]] = {name: [] for name in timers}
    for repeat in range(repeats):
        order = list(timers) if repeat % 2 == 0 else list(reversed(timers))
        for name in order:
            times[name].append(timers[name]())
    return times


def measure(shape: Shape, args: argparse.Namespace, device: torch.device) -> list[Row]:
    """The shape's step and its two validation calls, timed side by side."""
    repeats, steps = (1, 1) if shape.timed_once else (args.repeats, args.steps)
    torch.manual_seed(SEED)
    with training.set_default_dtype(shape.dtype), device:
        model = shape.build()
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=OUTPUT_CHUNKS)
    model.set_num_output_chunks(OUTPUT_CHUNKS)
    data = dataset(shape.seq_len)
    step = TrainingStep(model, loss_fn, shape, data)
    val_rows = Subset(data, range(VAL_START, VAL_START + shape.val_rows))
    sets = {
        "whole set": ValidationSet(
            val_rows, batch_size=shape.batch_size_val, collate=collate_for(shape.batch_size_val)
        ),
        f"max_val_batches={shape.max_val_batches}": ValidationSet(
            val_rows,
            batch_size=shape.batch_size_val,
            collate=collate_for(shape.batch_size_val),
            max_batches=shape.max_val_batches,
        ),
    }
    figures: dict[str, ValidationLoss] = {}

    def validate(name: str) -> float:
        def call() -> None:
            figures[name] = validation_loss(model, loss_fn, sets[name], device=device)

        return seconds(call, device)

    def train() -> float:
        return sum(seconds(lambda: step.run(device), device) for _ in range(steps)) / steps

    step.run(device)  # warm-up: the optimizer's state made
    validate(list(sets)[-1])  # warm-up, on the bounded (smaller) set
    times = side_by_side(
        train, {name: (lambda name=name: validate(name)) for name in sets}, repeats
    )
    step_ms = statistics.median(times["step"]) * 1e3
    return [
        Row(
            name=f"{shape.name}, {name}",
            step_ms=step_ms,
            step_tokens=step.tokens,
            val_ms=statistics.median(times[name]) * 1e3,
            val_rows=figures[name].num_samples,
            val_tokens=figures[name].num_tokens,
        )
        for name in sets
    ]


# The RL recipes' tiny configs, whose validation is generation.
GRPO_CONFIG = REPO_ROOT / "configs/tiny/grpo_distributed.yaml"
PPO_CONFIG = REPO_ROOT / "configs/tiny/ppo_single_device.yaml"
RL_TRAIN_SPLIT, RL_VAL_SPLIT = "train[:400]", "train[400:]"  # the arithmetic file's 500 rows
RL_BATCH_SIZE_VAL, RL_MAX_VAL_BATCHES = 4, 4


@dataclass(frozen=True)
class RlRow:
    name: str
    step_ms: float  # one optimizer step, with its share of its rollout step's generation
    val_ms: float
    val_prompts: int
    val_completions: int


@dataclass(frozen=True)
class OneDevice:
    """What the rollouts and GRPO's validation read of a recipe's runtime, on one device."""

    device: torch.device
    precision: Precision
    dp_size: int = 1
    dp_group: Any = None


def rl_config(path: Path, schema: type, recipe: str) -> tuple[DictConfig, Any]:
    """The tiny config, validated as its recipe validates it, and its typed settings."""
    cfg = validate_config(OmegaConf.load(path), schema, recipe)
    return cfg, typed_settings(cfg, schema)


def with_split(section: DictConfig, split: str) -> DictConfig:
    return OmegaConf.merge(section, {"split": split})


def frozen_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).eval().requires_grad_(False)


def timed_rl(
    name: str,
    rollout_step: Callable[[int], None],
    optimizer_steps: int,
    validations: dict[str, Callable[[], tuple[int, int]]],
    args: argparse.Namespace,
    device: torch.device,
) -> list[RlRow]:
    """``rollout_step`` (its optimizer steps) and each validation timed side by side, as
    :func:`measure` times the loss families'."""
    counts: dict[str, tuple[int, int]] = {}
    clock = iter(range(1_000_000))  # each rollout step its own step number, as in a run

    def validate(which: str) -> float:
        def call() -> None:
            counts[which] = validations[which]()

        return seconds(call, device)

    def train() -> float:
        total = sum(seconds(lambda: rollout_step(next(clock)), device) for _ in range(args.steps))
        return total / args.steps / optimizer_steps

    rollout_step(next(clock))  # warm-up: the optimizer's state made
    validate(list(validations)[-1])  # warm-up, on the bounded (smaller) set
    runs = {which: (lambda which=which: validate(which)) for which in validations}
    times = side_by_side(train, runs, args.repeats)
    step_ms = statistics.median(times["step"]) * 1e3
    return [
        RlRow(
            f"{name}, {which}",
            step_ms,
            statistics.median(times[which]) * 1e3,
            *counts[which],
        )
        for which in validations
    ]


def held_out_sets(make: Callable[[int | None], Any]) -> dict[str, Any]:
    return {
        "whole set": make(None),
        f"max_val_batches={RL_MAX_VAL_BATCHES}": make(RL_MAX_VAL_BATCHES),
    }


def measure_grpo(args: argparse.Namespace, device: torch.device) -> list[RlRow]:
    """configs/tiny/grpo_distributed.yaml: its rollout step and ``held_out_rewards``."""
    cfg, typed = rl_config(GRPO_CONFIG, GrpoDistributedConfig, "grpo_full_finetune_distributed")
    torch.manual_seed(SEED)
    tokenizer = config.instantiate(cfg.tokenizer)
    with device:
        model = config.instantiate(cfg.model)
    reference = frozen_copy(model)
    loss = build_policy_loss(cfg.loss)
    settings = StepSettings.from_settings(
        typed, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id, loss=loss
    )
    rewards = build_rewards(cfg.rewards)
    runtime = OneDevice(device, Precision.from_config(torch.float32, MasterWeights.NONE, device))
    prompts = config.instantiate(with_split(cfg.dataset, RL_TRAIN_SPLIT), tokenizer)
    held_out = config.instantiate(with_split(cfg.dataset, RL_VAL_SPLIT), tokenizer)
    loader = build_prompt_loader(prompts, batch_size=cfg.batch_size, shuffle=True)
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    normalizer = LossNormalizer(
        None, mode=NormMode.EXACT, units=loss_units_for(cfg.loss_aggregation)
    )
    optimizer = config.instantiate(cfg.optimizer, list(model.parameters()))
    profiler = setup_profiler(None, device, model, output_dir="unused", log_timings=False)
    loss_step = partial(
        grpo_micro_batch_loss,
        model,
        aggregation=cfg.loss_aggregation,
        loss=loss,
        max_generated_tokens=cfg.max_generated_tokens,
        num_completions=cfg.batch_size * cfg.grpo_samples,
        precision=runtime.precision,
    )

    def rollout_step(step: int) -> None:
        rollouts = make_rollouts(
            model,
            reference,
            next(batches),
            settings=settings,
            reward_components=rewards,
            tokenizer=tokenizer,
            step=step,
            seed=SEED,
            runtime=runtime,
        )
        for window in ppo_epoch_windows(rollouts, settings, normalizer):
            train_window(
                window,
                model=model,
                loss_step=loss_step,
                optimizer=optimizer,
                profiler=profiler,
                device=device,
                step=step + 1,
                clip_grad_norm=cfg.clip_grad_norm,
            )

    sets = held_out_sets(
        lambda bound: HeldOutPrompts(held_out, batch_size=RL_BATCH_SIZE_VAL, max_batches=bound)
    )

    def validation(held: HeldOutPrompts) -> Callable[[], tuple[int, int]]:
        def call() -> tuple[int, int]:
            figure = held_out_rewards(
                model,
                held,
                settings=settings,
                reward_components=rewards,
                tokenizer=tokenizer,
                seed=SEED,
                runtime=runtime,
            )
            return held.num_prompts, figure.num_completions

        return call

    validations = {which: validation(held) for which, held in sets.items()}
    return timed_rl("grpo", rollout_step, cfg.ppo_epochs, validations, args, device)


def measure_ppo(args: argparse.Namespace, device: torch.device) -> list[RlRow]:
    """configs/tiny/ppo_single_device.yaml: its trajectory step and ``held_out_ppo``."""
    cfg, typed = rl_config(
        PPO_CONFIG, PpoFullFinetuneSingleDeviceConfig, "ppo_full_finetune_single_device"
    )
    torch.manual_seed(SEED)
    tokenizer = config.instantiate(cfg.tokenizer)
    with device:
        policy = config.instantiate(cfg.policy_model)
        value = config.instantiate(cfg.reward_and_value_model)
    # The configs' reference is the policy's initial weights, the value model the reward's.
    models = StepModels(policy, value, reference=frozen_copy(policy), reward=frozen_copy(value))
    trained = PolicyAndValue(policy, value)
    settings = TrajectorySettings.from_settings(typed, tokenizer)
    precision = Precision.from_config(torch.float32, MasterWeights.NONE, device)
    vocab = policy.tok_embeddings.num_embeddings
    prompts = load_dataset(with_split(cfg.dataset, RL_TRAIN_SPLIT), tokenizer, vocab)
    held_out = load_dataset(with_split(cfg.dataset, RL_VAL_SPLIT), tokenizer, vocab)
    loader = build_prompt_loader(prompts, batch_size=cfg.batch_size, shuffle=True)
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    normalizer = LossNormalizer(None, mode=NormMode.EXACT, units=ResponseTokens())
    optimizer = config.instantiate(cfg.optimizer, list(trained.parameters()))
    profiler = setup_profiler(None, device, trained, output_dir="unused", log_timings=False)
    loss_step = partial(
        ppo_micro_batch_loss,
        policy,
        value,
        temperature=cfg.temperature,
        precision=precision,
        **loss_settings(cfg),
    )
    collate = partial(collate_trajectories, padding_idx=settings.pad_id)
    optimizer_steps = cfg.ppo_epochs * (cfg.batch_size // cfg.ppo_batch_size)

    def trajectory_step(step: int) -> None:
        trajectories = make_trajectories(
            models,
            next(batches),
            settings=settings,
            seed=SEED,
            step=step,
            device=device,
            precision=precision,
        )
        windows = ppo_batch_windows(
            trajectories, settings, normalizer, seed=SEED, step=step, collate=collate
        )
        for index, window in enumerate(windows):
            train_window(
                window,
                model=trained,
                loss_step=loss_step,
                optimizer=optimizer,
                profiler=profiler,
                device=device,
                step=step * optimizer_steps + index + 1,
                clip_grad_norm=cfg.clip_grad_norm,
            )

    sets = held_out_sets(
        lambda bound: HeldOutPpoPrompts(held_out, batch_size=RL_BATCH_SIZE_VAL, max_batches=bound)
    )

    def validation(held: HeldOutPpoPrompts) -> Callable[[], tuple[int, int]]:
        def call() -> tuple[int, int]:
            figure = held_out_ppo(
                models, held, settings=settings, seed=SEED, device=device, precision=precision
            )
            return figure.num_prompts, figure.num_prompts  # one response each

        return call

    validations = {which: validation(held) for which, held in sets.items()}
    return timed_rl("ppo", trajectory_step, optimizer_steps, validations, args, device)


def conditions(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    return (
        f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs; load average before {load}"
    )


def print_table(rows: list[Row]) -> None:
    header = (
        "| model, validation set | step ms | val ms per call | val / step | share at every "
        f"{VAL_EVERY} steps | rows, tokens validated | ms/token train | ms/token val |"
    )
    print(header)
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        share = r.val_ms / (VAL_EVERY * r.step_ms)
        print(
            f"| {r.name} | {r.step_ms:,.1f} | {r.val_ms:,.1f} | {r.val_ms / r.step_ms:.2f} | "
            f"{share:.2%} | {r.val_rows}, {r.val_tokens:,} | {r.step_ms / r.step_tokens:.3f} | "
            f"{r.val_ms / r.val_tokens:.3f} |"
        )


def print_rl_table(rows: list[RlRow]) -> None:
    print(
        "| config, validation set | optimizer step ms | val ms per call | val / step | share at "
        f"every {VAL_EVERY} steps | prompts, completions validated | ms per completion |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        share = r.val_ms / (VAL_EVERY * r.step_ms)
        print(
            f"| {r.name} | {r.step_ms:,.1f} | {r.val_ms:,.1f} | {r.val_ms / r.step_ms:.2f} | "
            f"{share:.2%} | {r.val_prompts}, {r.val_completions} | "
            f"{r.val_ms / r.val_completions:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="training steps per repeat")
    parser.add_argument("--quick", action="store_true", help="tiny configs only, 2 repeats")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq-len-1b", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    if args.seq_len_1b is None:
        args.seq_len_1b = 128 if device.type == "cpu" else 1024
    print(conditions(device), flush=True)
    rows: list[Row] = []
    for shape in shapes(args):
        started = time.perf_counter()
        rows += measure(shape, args, device)
        print(f"{shape.name}: measured in {time.perf_counter() - started:.0f} s", flush=True)
    rl_rows: list[RlRow] = []
    for name, measure_rl in (("grpo", measure_grpo), ("ppo", measure_ppo)):
        started = time.perf_counter()
        rl_rows += measure_rl(args, device)
        print(f"{name}: measured in {time.perf_counter() - started:.0f} s", flush=True)
    once = "" if args.quick else "; 1B: one repeat of one step"
    print(f"tiny: median of {args.repeats} repeats, a step the mean of {args.steps}{once}")
    print_table(rows)
    print(
        f"grpo, ppo: median of {args.repeats} repeats, a step the mean of {args.steps} rollout "
        "(trajectory) steps over their optimizer steps"
    )
    print_rl_table(rl_rows)


if __name__ == "__main__":
    main()
