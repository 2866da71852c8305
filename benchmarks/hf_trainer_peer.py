"""Hugging Face's Trainer on our rows: the peer row of the GPU report (issue #46).

The runs of benchmarks/gpu_1b_variable_length.py, trained by ``transformers.Trainer`` instead:
the same samples in the same order (the tiny config's bundled instruction data at its
``tokenizer.max_seq_len``, ordered as our loader's sampler orders them, seed 0 and epoch 0, and
read in that order by a sequential sampler), the same model shape (``LlamaForCausalLM`` shaped as
Llama 3.2 1B, randomly initialised by transformers with a fixed seed; ``--size tiny`` takes the
small shape of benchmarks/ga_parity_stock_vs_exactga.py, for CPU), the same global batch
(per-device batch 8 x gradient accumulation 8), bf16 autocast over fp32 weights on CUDA, AdamW
(fused on CUDA) with the tiny config's learning rate, weight decay and warm-up, no clipping. Two
collations:

- ``hf_padded``: each micro-batch padded to its longest sample (labels -100 and attention mask
  0 on the padding), SDPA;
- ``hf_padding_free``: ``DataCollatorWithFlattening``, the micro-batch as one row with
  ``position_ids`` restarting per sample, with ``flash_attention_2`` where ``flash_attn`` is
  installed, else SDPA.

Timed as ours: a callback reads the clock at each optimizer step's end (after
``torch.cuda.synchronize()``); ms/step is the median over the steps after warm-up, tokens/s
counts the samples' own tokens over those steps' time, MFU their FLOPs
(gpu_1b_variable_length's ``6 N T + 12 L d T^2`` per sample) over the device's bf16 peak; also the
padding share of the positions trained on and the allocator's peak. ``--splits`` adds split
invariance: the Trainer in fp32 (TF32 off) with SGD, as batch 8 x 1 and 1 x 8 from the same
weights, on ga_parity_stock_vs_exactga's small shape, data, learning rate and step count, scored
as there (relative L2 of the trained weights over the update), for both collations and for the
Trainer's old normalisation (a mean of micro-batch means) as a contrast; beside them exactga's
own figure from that benchmark's two ``tune run`` s (about 25 s on CPU; ``--no-ours`` skips it).
SGD, as our parity tests use it: AdamW's per-weight normalisation hides a mis-scaled gradient.

What transformers does here (read in 5.24, the same in 5.17):

- Padding-free with SDPA keeps documents apart. ``masking_utils.create_causal_mask`` calls
  ``_preprocess_mask_arguments``, which, given ``position_ids`` and neither an attention mask nor
  a cache, finds the documents with ``find_packed_sequence_indices`` (a position that does not
  follow its predecessor starts one) and ands ``packed_sequence_mask_function`` into the causal
  mask. Two catches. The mask is dense over the whole flattened row, so SDPA runs a masked kernel
  over ``(sum T)^2`` positions, not ``sum T^2``. And it holds only without a cache:
  ``LlamaModel.forward`` makes a ``DynamicCache`` whenever ``use_cache`` is on, which is
  ``LlamaConfig``'s default, and then documents attend to each other; ``Trainer.__init__`` sets
  ``model.config.use_cache = args.use_cache`` (False by default), so under the Trainer they do
  not. The script measures this before training (the "documents apart" line).
- The accumulation window is token-weighted, counted after the shift, as ours.
  ``Trainer.get_batch_samples`` fetches the window's micro-batches first and
  ``_get_num_items_in_batch`` counts ``labels[..., 1:] != -100`` for causal LMs
  (``_loss_shifts_labels``); ``compute_loss`` hands that count to the model
  (``model_accepts_loss_kwargs``: ``LlamaForCausalLM.forward`` takes ``**kwargs``), whose
  ``loss.loss_utils.ForCausalLMLoss`` sums the token losses and divides by it, and
  ``training_step`` then does not divide by the accumulation steps. ``DataCollatorWithFlattening``
  sets each sample's first label to -100, so the prediction across a document boundary is not
  scored and both collations count the same tokens.
- As shipped, the Trainer computes the gradient norm every step even without clipping
  (``_get_grad_norm``), reads each micro-batch's loss on the host (``logging_nan_inf_filter``),
  and exempts biases and norm weights from weight decay (``get_decay_parameter_names``); the
  timings include the first two, as a user's run does.

Run from the repository root (on an H100 or H200 the two 1B runs should take well under 3
minutes, not yet measured; each run prints its time)::

    python benchmarks/hf_trainer_peer.py [--splits] [--json out.json]
    .venv/bin/python benchmarks/hf_trainer_peer.py --size tiny --steps 4 --warmup-steps 1 --splits

Without CUDA it measures nothing unless ``--size tiny``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib.util
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import SequentialSampler
from torchtune.data import padded_collate_sft
from transformers import (
    DataCollatorWithFlattening,
    LlamaConfig,
    LlamaForCausalLM,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ga_parity_stock_vs_exactga as parity_bench  # noqa: E402
import gpu_1b_variable_length as gpu_1b  # noqa: E402

from exactga.data.loader import build_dataloader  # noqa: E402
from exactga.parity.scoring import relative_l2  # noqa: E402
from exactga.profiling import device_peak_flops  # noqa: E402
from exactga.runtime.threads import use_cpu_threads  # noqa: E402

COLLATIONS = ("padded", "padding_free")
IGNORE_INDEX = -100  # labels the loss skips, in torchtune's data and transformers' loss alike
SEED = 0  # the models' initialisation
# transformers' names for the optimizers our configs name.
HF_OPTIMIZERS = {"torch.optim.AdamW": "adamw_torch", "torch.optim.SGD": "sgd"}
# torchtune's llama3_2 builder: rope_base 500,000 with Llama 3.1's scaling (scale_factor 32).
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer and schedule of one of our configs, in the Trainer's terms."""

    optim: str
    learning_rate: float
    weight_decay: float
    warmup_steps: int


@dataclass
class Outcome:
    """What one Trainer run left: the trained model and what the callbacks saw."""

    model: torch.nn.Module
    losses: list[float]
    step_seconds: list[float]  # each optimizer step's wall time
    positions: int  # positions the steps trained on, padding included
    tokens: int  # the samples' own tokens among them


@dataclass(frozen=True)
class Row:
    run: str
    attention: str
    ms_per_step: float
    tokens_per_s: float
    mfu: float | None
    padding: float
    peak_gib: float | None
    losses: list[float]  # each step's, as the Trainer logs it


@dataclass(frozen=True)
class SplitGap:
    run: str
    rel_l2: float | None  # None: not measured here (see ``note``)
    note: str


def tiny_config(overrides: list[str]) -> DictConfig:
    """The tiny config as ``tune run`` reads it with ``overrides`` (``~key`` deletes a key)."""
    cfg = OmegaConf.load(gpu_1b.mb.REPO_ROOT / parity_bench.CONFIG)
    for item in overrides:
        if item.startswith("~"):
            parent, _, leaf = item[1:].rpartition(".")
            OmegaConf.select(cfg, parent).pop(leaf)
    sets = [item for item in overrides if not item.startswith("~")]
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(sets))


def model_shape(size: str) -> dict[str, Any]:
    """Llama 3.2 1B's shape, or the small one ga_parity_stock_vs_exactga trains, in the keys of
    torchtune's llama3_2 builder."""
    if size == "1b":
        return gpu_1b.LLAMA_3_2_1B
    model = tiny_config(parity_bench.SMALL_MODEL).model
    return {key: model[key] for key in gpu_1b.LLAMA_3_2_1B}


def max_seq_len(size: str) -> int:
    """gpu_1b_variable_length's ``tokenizer.max_seq_len`` for 1B; the tiny config's own else."""
    if size == "1b":
        return gpu_1b.parse_args([]).max_seq_len
    return tiny_config([]).tokenizer.max_seq_len


def optimizer_settings(overrides: list[str], device: torch.device) -> OptimizerSettings:
    cfg = tiny_config(overrides)
    optim = HF_OPTIMIZERS[cfg.optimizer._component_]
    if optim == "adamw_torch" and device.type == "cuda":
        optim = "adamw_torch_fused"  # ours runs optimizer.fused=True on CUDA
    return OptimizerSettings(
        optim=optim,
        learning_rate=cfg.optimizer.lr,
        weight_decay=cfg.optimizer.weight_decay if "weight_decay" in cfg.optimizer else 0.0,
        warmup_steps=cfg.lr_scheduler.num_warmup_steps,
    )


def run_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def attention_for(collation: str) -> str:
    if collation == "padding_free" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"  # varlen kernels from the flattened position_ids
    return "sdpa"


def hf_config(shape: dict[str, Any], attention: str) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["embed_dim"],
        intermediate_size=shape["intermediate_dim"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["embed_dim"] // shape["num_heads"],
        tie_word_embeddings=shape["tie_word_embeddings"],
        max_position_embeddings=131_072,  # Llama 3.2's
        rms_norm_eps=1e-5,
        rope_parameters=dict(ROPE),
        attn_implementation=attention,
    )


def new_model(shape: dict[str, Any], attention: str, device: torch.device) -> LlamaForCausalLM:
    """A randomly initialised fp32 model, the same weights for every call with the same shape."""
    transformers.set_seed(SEED)
    with device:  # built where it trains: no 1B initialisation on the host, then a copy over
        return LlamaForCausalLM(hf_config(shape, attention))


def ordered_samples(seq_len: int, count: int) -> tuple[list[dict[str, list[int]]], int]:
    """The first ``count`` samples in our loader's order, and the tokenizer's pad id.

    The order is the sampler's of exactga.data.loader (seed 0, epoch 0), which windows of any
    ``batch_size x gradient_accumulation_steps`` cut in turn; our ``fixed`` micro-batches are its
    consecutive runs of ``batch_size``, which a sequential sampler hands the Trainer too.
    """
    dataset, tokenizer = gpu_1b.bundled_data(argparse.Namespace(max_seq_len=seq_len))
    loader = build_dataloader(
        dataset,
        batch_size=1,
        gradient_accumulation_steps=1,
        shuffle=True,
        collate_fn="torchtune.data.padded_collate_sft",
        padding_idx=tokenizer.pad_id,
        ignore_idx=IGNORE_INDEX,
    )
    loader.sampler.set_epoch(0)
    order = list(loader.sampler)[:count]
    samples = [
        {"input_ids": list(dataset[i]["tokens"]), "labels": [int(x) for x in dataset[i]["labels"]]}
        for i in order
    ]
    return samples, tokenizer.pad_id


def padded_collate(features: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """A micro-batch right-padded to its longest sample by torchtune's ``padded_collate_sft``,
    the collator of our stock runs, in the Trainer's keys."""
    pairs = [{"tokens": f["input_ids"], "labels": f["labels"]} for f in features]
    batch = padded_collate_sft(pairs, padding_idx=pad_id, ignore_idx=IGNORE_INDEX)
    lengths = torch.tensor([len(f["input_ids"]) for f in features])
    positions = torch.arange(batch["tokens"].shape[1])
    return {
        "input_ids": batch["tokens"],
        "labels": batch["labels"],
        # What a user's collator passes; it also keeps SDPA off its mask-free kernel.
        "attention_mask": (positions < lengths[:, None]).long(),
    }


class PositionCounter:
    """A collator that notes, per micro-batch, the positions it hands the model and the
    samples' own tokens among them."""

    def __init__(self, collate: Callable[[list[dict]], dict[str, torch.Tensor]]) -> None:
        self.collate = collate
        self.micro_batches: list[tuple[int, int]] = []  # (positions, tokens)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collate(features)
        tokens = sum(len(f["input_ids"]) for f in features)
        self.micro_batches.append((batch["input_ids"].numel(), tokens))
        return batch


def collator(collation: str, pad_id: int) -> PositionCounter:
    if collation == "padded":
        return PositionCounter(functools.partial(padded_collate, pad_id=pad_id))
    return PositionCounter(DataCollatorWithFlattening(return_tensors="pt"))


class StepClock(TrainerCallback):
    """The clock at the start of training and at each optimizer step's end; the logged losses."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times: list[float] = []
        self.losses: list[float] = []

    def _mark(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the step's kernels are done, not only queued
        self.times.append(self.clock())

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._mark()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._mark()

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "loss" in logs:  # the end of training logs ``train_loss`` instead
            self.losses.append(logs["loss"])


class OrderedTrainer(Trainer):
    """The Trainer reading its dataset in order: the samples come in our loader's order."""

    # Named so, with this signature, in transformers 5.17 and 5.24 (older releases took none).
    def _get_train_sampler(self, train_dataset=None) -> SequentialSampler:
        return SequentialSampler(self.train_dataset if train_dataset is None else train_dataset)


def trainer_arguments(
    output_dir: str,
    *,
    batch_size: int,
    ga: int,
    num_steps: int,
    optimizer: OptimizerSettings,
    bf16: bool,
    tf32: bool | None,
) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=ga,
        max_steps=num_steps,
        optim=optimizer.optim,
        learning_rate=optimizer.learning_rate,
        weight_decay=optimizer.weight_decay,
        lr_scheduler_type="cosine",  # torchtune's get_cosine_schedule_with_warmup, as configured
        warmup_steps=optimizer.warmup_steps,
        max_grad_norm=0.0,  # ours runs clip_grad_norm=null in both benchmarks
        bf16=bf16,
        tf32=tf32,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        logging_steps=1,  # the loss every step, read on the host as our runs log it
        disable_tqdm=True,
        remove_unused_columns=False,  # our samples are plain dicts; nothing to drop
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),  # pinning warns without a GPU
        seed=SEED,
    )


def build_trainer(
    model: torch.nn.Module,
    samples: list[dict],
    counter: PositionCounter,
    arguments: TrainingArguments,
    clock: Callable[[], float],
    *,
    mean_of_means: bool = False,
) -> tuple[Trainer, StepClock]:
    step_clock = StepClock(clock)
    trainer = OrderedTrainer(
        model=model,
        args=arguments,
        train_dataset=samples,
        data_collator=counter,
        callbacks=[step_clock],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every step's log dict
    if mean_of_means:
        # The Trainer before num_items_in_batch (4.46): each micro-batch's mean loss over ga.
        trainer.model_accepts_loss_kwargs = False
    return trainer, step_clock


def train(
    model: torch.nn.Module,
    samples: list[dict],
    collation: str,
    arguments: TrainingArguments,
    pad_id: int,
    clock: Callable[[], float] = time.perf_counter,
    *,
    mean_of_means: bool = False,
) -> Outcome:
    counter = collator(collation, pad_id)
    trainer, step_clock = build_trainer(
        model, samples, counter, arguments, clock, mean_of_means=mean_of_means
    )
    trainer.train()
    # The loader collates one micro-batch ahead, which no step trains.
    trained = counter.micro_batches[: arguments.max_steps * arguments.gradient_accumulation_steps]
    return Outcome(
        model=trainer.model,
        losses=step_clock.losses,
        step_seconds=[end - start for start, end in itertools.pairwise(step_clock.times)],
        positions=sum(positions for positions, _ in trained),
        tokens=sum(tokens for _, tokens in trained),
    )


def step_flops(lengths: list[int], model: torch.nn.Module) -> float:
    """gpu_1b_variable_length's FLOPs of samples of these lengths (a step's, or several steps'
    chained: the count is a sum over samples) for the model the Trainer ran."""
    num_params = sum(p.numel() for p in model.parameters())  # tied: the projection once
    config = model.config
    return gpu_1b.samples_flops(lengths, num_params, config.num_hidden_layers, config.hidden_size)


def measure(
    collation: str,
    samples: list[dict],
    pad_id: int,
    args: argparse.Namespace,
    clock: Callable[[], float] = time.perf_counter,
) -> Row:
    """One timed run of ``args.steps`` steps of ``args.batch_size x args.ga`` samples."""
    device = run_device()
    attention = attention_for(collation)
    model = new_model(model_shape(args.size), attention, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="hf_peer_") as out:
        arguments = trainer_arguments(
            out,
            batch_size=args.batch_size,
            ga=args.ga,
            num_steps=args.steps,
            optimizer=optimizer_settings([], device),
            bf16=device.type == "cuda",  # autocast over fp32 weights, as ours
            tf32=None,  # torch's default, as ours
        )
        outcome = train(model, samples, collation, arguments, pad_id, clock)
    window = args.batch_size * args.ga
    timed = outcome.step_seconds[args.warmup_steps :]
    timed_lengths = [
        [len(s["input_ids"]) for s in samples[step * window : (step + 1) * window]]
        for step in range(args.warmup_steps, args.steps)
    ]
    seconds = sum(timed)
    # The FLOPs are a sum over samples: one call counts the model's parameters once, not per step.
    flops = step_flops(list(itertools.chain.from_iterable(timed_lengths)), outcome.model)
    peak = device_peak_flops(device)
    row = Row(
        run=f"hf_{collation}",
        attention=attention,
        ms_per_step=statistics.median(timed) * 1e3,
        tokens_per_s=sum(map(sum, timed_lengths)) / seconds,
        mfu=flops / seconds / peak if peak else None,
        padding=1 - outcome.tokens / outcome.positions,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        losses=outcome.losses,
    )
    del outcome, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next run's peak starts from nothing
    return row


def flattened_logit_gap(model: torch.nn.Module, features: list[dict]) -> float:
    """Largest difference between the logits of ``features`` flattened into one row and those of
    each sample alone, relative to the largest logit: round-off when documents stay apart."""
    device = next(model.parameters()).device
    batch = DataCollatorWithFlattening(return_tensors="pt")(features)
    # flash_attn kernels take no fp32; SDPA is compared in fp32.
    low_precision = model.config._attn_implementation.startswith("flash")
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=low_precision):
        flat = model(
            input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device)
        ).logits[0]
        alone = [
            model(input_ids=torch.tensor([f["input_ids"]], device=device)).logits[0]
            for f in features
        ]
        alone = torch.cat(alone)
    return float((flat - alone).abs().max() / alone.abs().max())


def document_separation(samples: list[dict], pad_id: int) -> float:
    """:func:`flattened_logit_gap` of a tiny model as the padding-free runs' Trainer leaves it
    (``Trainer.__init__`` switches the cache off, and with it on documents would mix)."""
    device = run_device()
    model = new_model(model_shape("tiny"), attention_for("padding_free"), device)
    with tempfile.TemporaryDirectory(prefix="hf_peer_") as out:
        arguments = trainer_arguments(
            out,
            batch_size=1,
            ga=1,
            num_steps=1,
            optimizer=optimizer_settings([], device),
            bf16=False,
            tf32=None,
        )
        counter = collator("padding_free", pad_id)
        trainer, _ = build_trainer(model, samples, counter, arguments, time.perf_counter)
    return flattened_logit_gap(trainer.model, samples[:3])


def trained_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # named_parameters, not state_dict: a tied embedding is counted once.
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}


def split_gap(
    collation: str,
    samples: list[dict],
    pad_id: int,
    num_steps: int,
    *,
    mean_of_means: bool = False,
) -> float:
    """Relative L2 of the 1x8 run's trained weights to the 8x1 run's, over the update: the
    Trainer in fp32 with SGD, on the small shape, from the same initial weights."""
    device = run_device()
    settings = optimizer_settings(parity_bench.OPTIMIZERS["sgd"], device)
    base = new_model(model_shape("tiny"), attention_for(collation), device)
    initial = trained_weights(base)
    trained = {}
    for split, (batch_size, ga) in parity_bench.SPLITS.items():
        with tempfile.TemporaryDirectory(prefix="hf_peer_") as out:
            arguments = trainer_arguments(
                out,
                batch_size=batch_size,
                ga=ga,
                num_steps=num_steps,
                optimizer=settings,
                bf16=False,
                tf32=False,  # fp32 throughout, as our parity runs
            )
            model = copy.deepcopy(base)
            outcome = train(
                model, samples, collation, arguments, pad_id, mean_of_means=mean_of_means
            )
        trained[split] = trained_weights(outcome.model)
    return relative_l2(trained["1x8"], trained["8x1"], initial)


def ours_split_gap(root: Path) -> float | None:
    """exactga's own 8x1 against 1x8 on the same shape, data and SGD: the two ``tune run`` s of
    benchmarks/ga_parity_stock_vs_exactga.py; None where its ``tune`` is not installed."""
    if not Path(sys.executable).with_name("tune").exists():  # where that benchmark runs it from
        return None
    train_on_input = bool(tiny_config([]).dataset.train_on_input)
    for split in parity_bench.SPLITS:
        run = parity_bench.Run("exactga", train_on_input, "sgd", split)
        parity_bench.launch(run, root / run.name)
    return parity_bench.parity(root, "exactga", train_on_input, "sgd")


def split_gaps(args: argparse.Namespace) -> list[SplitGap]:
    window = max(b * g for b, g in parity_bench.SPLITS.values())
    samples, pad_id = ordered_samples(max_seq_len("tiny"), window * parity_bench.NUM_STEPS)
    gaps = []
    for collation in COLLATIONS:
        start = time.perf_counter()
        gap = split_gap(collation, samples, pad_id, parity_bench.NUM_STEPS)
        print(f"splits/hf_{collation}: {time.perf_counter() - start:.0f} s", flush=True)
        how = f"Trainer, {attention_for(collation)}, on {run_device().type}"
        gaps.append(SplitGap(f"hf_{collation}", gap, how))
    naive = split_gap("padded", samples, pad_id, parity_bench.NUM_STEPS, mean_of_means=True)
    how = "the same, each micro-batch's mean over ga (the Trainer before num_items_in_batch)"
    gaps.append(SplitGap("hf_padded_mean_of_means", naive, how))
    source = "benchmarks/ga_parity_stock_vs_exactga.py --train-on-input false --optimizer sgd"
    if args.no_ours:
        gaps.append(SplitGap("exactga", None, f"not run here (--no-ours): {source}"))
        return gaps
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_peer_ours_") as tmp:
        ours = ours_split_gap(Path(tmp))
    print(f"splits/exactga: {time.perf_counter() - start:.0f} s", flush=True)
    note = "its two tune runs, on CPU" if ours is not None else f"no tune here: {source}"
    gaps.append(SplitGap("exactga", ours, note))
    return gaps


def cell(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(
    rows: list[Row],
    splits: list[SplitGap],
    separation: float,
    args: argparse.Namespace,
    device: str,
) -> str:
    shape = model_shape(args.size)
    precision = "bf16 autocast over fp32 weights" if torch.cuda.is_available() else "fp32"
    lines = [
        f"Measured on {device}; torch {torch.__version__}, transformers {transformers.__version__}."
        f" Hugging Face's Trainer, Llama-shaped ({args.size}: {shape['num_layers']} layers, width "
        f"{shape['embed_dim']}), {args.batch_size} x {args.ga} per step, tokenizer.max_seq_len="
        f"{max_seq_len(args.size)}, {args.steps} steps of which {args.warmup_steps} warm-up; "
        f"{precision}, {optimizer_settings([], run_device()).optim}, no clipping; "
        "our samples in our loader's order.",
        "",
        "| run | attention | ms/step | tokens/s | MFU | padding | peak GPU GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            row.run,
            row.attention,
            f"{row.ms_per_step:.0f}",
            f"{row.tokens_per_s:,.0f}",
            cell(row.mfu, ".3f"),
            f"{100 * row.padding:.1f}%",
            cell(row.peak_gib, ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"- Documents apart under flattening ({attention_for('padding_free')}): the flattened "
        f"rows' logits differ from each sample's alone by {separation:.1e} of the largest logit "
        "(tiny model; in fp32 round-off is about 1e-6, and documents that see each other, as "
        "with the cache on, give about 0.5).",
        "- tokens/s and MFU count the samples' own tokens; MFU's FLOPs are `6 N T + 12 L d T^2` "
        "per sample of T tokens over the dense bf16 peak, as gpu_1b_variable_length's.",
    ]
    if splits:
        lines += [
            "",
            f"Split invariance: batch 8 x ga 1 against 1 x 8, {parity_bench.NUM_STEPS} steps of "
            "SGD in fp32 on the small shape (relative L2 of the trained weights over the update).",
            "",
            "| run | rel-L2 8x1 vs 1x8 | how |",
            "|---|---|---|",
        ]
        lines += [f"| {s.run} | {cell(s.rel_l2, '.1e')} | {s.note} |" for s in splits]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ours = gpu_1b.parse_args([])  # our side's defaults are the peer's
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["1b", "tiny"], default="1b")
    parser.add_argument("--batch-size", type=int, default=ours.batch_size)
    parser.add_argument("--ga", type=int, default=ours.ga)
    parser.add_argument("--steps", type=int, default=ours.steps, help="warm-up included")
    parser.add_argument("--warmup-steps", type=int, default=ours.warmup_steps)
    parser.add_argument("--splits", action="store_true", help="also 8x1 against 1x8 in fp32")
    parser.add_argument("--no-ours", action="store_true", help="skip exactga's split runs")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if not 1 <= args.warmup_steps < args.steps:
        parser.error("--warmup-steps must be at least 1 and below --steps")
    return args


def write_json(path: Path | None, device: str | None, rows, splits, text: str) -> None:
    if path:
        payload = {
            "device": device,
            "rows": [vars(r) for r in rows],
            "splits": [vars(s) for s in splits],
            "markdown": text,
        }
        path.write_text(json.dumps(payload, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() and args.size != "tiny":
        print("hf_trainer_peer: no CUDA device; nothing measured.")
        write_json(args.json, None, [], [], "No CUDA device: nothing measured.")
        return 0
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = "CPU"
        print(use_cpu_threads(None), flush=True)  # as our recipes pick it; see [cpu threads]
    window = args.batch_size * args.ga
    samples, pad_id = ordered_samples(max_seq_len(args.size), window * args.steps)
    separation = document_separation(samples, pad_id)
    rows = []
    for collation in COLLATIONS:
        start = time.perf_counter()
        rows.append(measure(collation, samples, pad_id, args))
        print(f"hf_{collation}: {time.perf_counter() - start:.0f} s", flush=True)
    text = markdown(rows, [], separation, args, device)
    write_json(args.json, device, rows, [], text)  # kept if the split runs fail
    splits = split_gaps(args) if args.splits else []
    text = markdown(rows, splits, separation, args, device)
    print(text, flush=True)
    write_json(args.json, device, rows, splits, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
