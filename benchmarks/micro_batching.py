"""Length-aware micro-batching: stock torchtune 0.6.1 versus exactga's ``micro_batching`` modes.

Trains the same config ten ways, each a real ``tune run`` subprocess in its own output folder,
from the same seeded checkpoint, on the same samples in the same order (``seed``, and the
sampler's fixed seed 0), with the same global batch:

- ``stock``: torchtune's built-in ``full_finetune_single_device`` (post_scale normalisation,
  micro-batches of ``batch_size`` in the loader's order);
- ``fixed``, ``by_length``: ``recipes/full_finetune.py`` with that
  ``micro_batching``, ``batch_size x gradient_accumulation_steps`` as given;
- ``token_budget``: the same recipe with ``batch_size = bsz * ga`` and
  ``gradient_accumulation_steps: 1``, so each window holds the same samples and the budget
  (``micro_batch_tokens``) alone decides the split;
- ``packed``: ``bsz x ga`` with ``micro_batching: packed``: the window's samples packed whole
  into rows of ``--packed-row`` positions (one micro-batch shape), each document attended alone
  off CUDA (exactga.runtime.document_attention); ``packed_dense``: the same rows under the dense
  block-causal mask instead (``EXACTGA_DENSE_PACKED_MASK=1``, the path before per-document
  attention);
  ``packed_m<m>``: the same with ``pad_to_multiple_of: m`` (``--packed-multiple``), which trims
  each row's unfilled end to a multiple of ``m``: less padding, a few more shapes;
  ``packed_compiled``, ``packed_m<m>_compiled``, ``packed_dense_compiled``: those with
  ``compile: True`` (torch.compile with inductor; per-document attention stays outside each
  layer's graph, the dense mask's rows compile into one graph per layer: see [packed rows under
  compile] in exactga.runtime.document_attention); their first steps compile, which the warm-up
  steps leave out of the timing.
Every run gets ``model.max_seq_len`` of at least the packed row (a packed row is one sequence
to the model; the rotary cache is the only thing it sizes, so the weights are the same).

Per configuration it prints one table row: the median step time over the steps after warm-up
(differences of consecutive ``loss`` event wall times in TensorBoard, so start-up and
checkpointing are left out) and the speed-up over stock; the same in CPU time of the run's
process over those steps (sampled from ``/proc``), which a shared machine's load distorts far
less than wall time; loss tokens per second; the padding share of the positions processed
(the end-of-run ``exactga: padding was ...`` line); the distinct micro-batch shapes of the epoch
(the ``throughput/micro_batch_shapes`` scalar); a compiled run's graphs and graph breaks at
its end (the ``compile/graphs`` and ``compile/graph_breaks`` scalars); peak memory; and how far
the trained weights
land from the ``fixed`` run's, ``||w - w_fixed|| / ||w_fixed - w_init||``. Below the table,
``packed``'s speed against ``token_budget``'s and against ``packed_dense``'s, pair by pair.

Peak memory is the peak RSS of the ``tune`` process, read with ``os.wait4`` for that child alone
(``RUSAGE_CHILDREN`` would be the maximum over every child so far); on a GPU also the
allocator's peak (the ``peak_memory_alloc`` scalar: every run gets
``log_peak_memory_stats=True``, which both recipes turn off on CPU).

Run from the repository root (default: the tiny config at ``tokenizer.max_seq_len=512``, 8 x 8,
6 steps of which 2 are warm-up; 2 to 5 minutes on 2 CPU cores, depending on their load)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/micro_batching.py

``--config`` takes any full single-device config; ``--set KEY=VALUE`` adds an override to every
run (after the benchmark's own, so it wins); ``--skip NAME`` leaves a configuration out (not
``stock`` or ``fixed``, which the table measures against); ``--max-seq-len 0`` keeps the config's
``tokenizer.max_seq_len``; ``--repeats N`` runs each configuration N times, the order reversed
every other repeat (stock, fixed, by_length, token_budget, packed, then the reverse, ...) so that a
change in machine load hits every configuration alike; ``--out DIR`` keeps the run folders
and logs.

Our runs get ``loss_normalization=exact`` (the baselines accept only ``fixed``) and
``saved_latency_every_n_steps=0``: exactga's profiler otherwise times stock's gradient pass on
sampled steps, extra work that stock does not do.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from exactga.data.packing import DENSE_PACKED_MASK
from exactga.launch.registry import EXACTGA_ONLY_KEYS
from exactga.parity.scoring import relative_l2

REPO_ROOT = Path(__file__).resolve().parents[1]
STOCK_RECIPE = "full_finetune_single_device"
OUR_RECIPE = "recipes/full_finetune.py"
STOCK = "stock"
REFERENCE = "fixed"  # every run's weights are compared with this one's
PACKED = "packed"
PACKED_DENSE = "packed_dense"  # packed under the dense mask: per-document attention's baseline
BUDGET = "token_budget"  # packed's speed is also given against this one's
COMPILED = "_compiled"  # a packed run under compile: True, given against its eager twin
INIT_WEIGHTS = "base_model/model.safetensors"  # written by exactga.models.random_init_checkpointer
# exactga.data.micro_batching.PaddingMeter.summary's end-of-run line.
PADDING_LINE = re.compile(r"padding was ([\d.]+)% of the ([\d,]+) positions processed")
CPU_POLL_S = 0.05  # how often a run's CPU time is sampled; /proc counts in 10 ms ticks
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class RunSpec:
    """One configuration of the comparison: a recipe and the overrides that make it."""

    name: str
    recipe: str
    overrides: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the run's process


@dataclass(frozen=True)
class ChildUsage:
    """What the operating system saw of one run's process."""

    wall_s: float
    cpu_s: float  # user + system, the whole run
    max_rss_mib: float
    cpu_trace: list[tuple[float, float]]  # (epoch seconds, CPU seconds so far), sampled


@dataclass(frozen=True)
class RunResult:
    """What one finished run measured; its weights stay on disk in ``output_dir``."""

    spec: RunSpec
    repeat: int
    output_dir: Path
    usage: ChildUsage
    step_ms: list[float]  # wall time of each timed step
    step_cpu_ms: list[float] | None  # CPU time of each timed step; None without /proc
    loss_tokens: list[float] | None  # loss tokens of each timed step; None where not logged
    gpu_peak_gib: float | None
    padding: tuple[float, int] | None  # (fraction, positions processed) over the whole run
    num_shapes: int | None  # distinct micro-batch shapes in the epoch; None where not logged
    compiled: tuple[int, int] | None  # dynamo's graphs and graph breaks at the end; None: eager


def run_specs(args: argparse.Namespace) -> list[RunSpec]:
    """The configurations not ``--skip``-ped, each with the same global batch of ``bsz * ga``
    samples."""
    split = (f"batch_size={args.batch_size}", f"gradient_accumulation_steps={args.ga}")
    ours = ("loss_normalization=exact", "log_timings=True", "saved_latency_every_n_steps=0")
    budget = (
        f"batch_size={args.batch_size * args.ga}",
        "gradient_accumulation_steps=1",
        "micro_batching=token_budget",
        f"micro_batch_tokens={args.micro_batch_tokens}",
    )
    packed = (*split, *ours, "micro_batching=packed", f"micro_batch_tokens={args.packed_row}")
    trimmed = (*packed, f"pad_to_multiple_of={args.packed_multiple}")
    specs = [
        RunSpec(STOCK, STOCK_RECIPE, split),
        RunSpec(REFERENCE, OUR_RECIPE, (*split, *ours, "micro_batching=fixed")),
        RunSpec("by_length", OUR_RECIPE, (*split, *ours, "micro_batching=by_length")),
        RunSpec("token_budget", OUR_RECIPE, (*budget, *ours)),
        RunSpec(PACKED, OUR_RECIPE, packed),
        RunSpec(PACKED_DENSE, OUR_RECIPE, packed, env=((DENSE_PACKED_MASK, "1"),)),
        RunSpec(f"{PACKED}_m{args.packed_multiple}", OUR_RECIPE, trimmed),
        RunSpec(f"{PACKED}{COMPILED}", OUR_RECIPE, (*packed, "compile=True")),
        RunSpec(
            f"{PACKED_DENSE}{COMPILED}",
            OUR_RECIPE,
            (*packed, "compile=True"),
            env=((DENSE_PACKED_MASK, "1"),),
        ),
        RunSpec(
            f"{PACKED}_m{args.packed_multiple}{COMPILED}", OUR_RECIPE, (*trimmed, "compile=True")
        ),
    ]
    return [spec for spec in specs if spec.name not in args.skip]


def write_stock_config(config: str, out_root: Path) -> Path:
    """``config`` without exactga's keys, for stock's recipe: exactga's launcher refuses to run
    torchtune's own recipe on a config that carries them (it would ignore them silently)."""
    cfg = OmegaConf.load(config)
    for key in EXACTGA_ONLY_KEYS:
        cfg.pop(key, None)
    stock_config = out_root / "stock_config.yaml"
    OmegaConf.save(cfg, stock_config)
    return stock_config


def tune_command(spec: RunSpec, args: argparse.Namespace, output_dir: Path) -> list[str]:
    """The ``tune run`` command line of one run; ``--set`` comes last so that it wins. Stock
    runs the config without exactga's keys (:func:`write_stock_config`, next to the runs)."""
    common = [
        f"output_dir={output_dir}",
        "epochs=1",
        f"max_steps_per_epoch={args.max_steps}",
        "log_every_n_steps=1",  # one loss event per step: the step timer
        # TensorBoard whatever the config logs to (it takes and ignores another logger's keys).
        "metric_logger._component_=torchtune.training.metric_logging.TensorBoardLogger",
        f"metric_logger.log_dir={output_dir}/logs",
        "log_peak_memory_stats=True",
    ]
    if args.max_seq_len:
        common.append(f"tokenizer.max_seq_len={args.max_seq_len}")
    common.append(f"model.max_seq_len={max(args.max_seq_len, args.packed_row)}")
    tune = Path(sys.executable).with_name("tune")
    overrides = [*common, *spec.overrides, *args.set]
    config = args.config
    if spec.name == STOCK:
        config = write_stock_config(args.config, output_dir.parent)
    return [str(tune), "run", spec.recipe, "--config", str(config), *overrides]


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a running process (all its threads), from ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None  # not Linux, or the process is gone
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14, 15


def launch(
    command: list[str],
    log_path: Path,
    omp_threads: int,
    extra_env: tuple[tuple[str, str], ...] = (),
) -> ChildUsage:
    """Run ``command`` with its output in ``log_path`` and ``extra_env`` added to its
    environment, sampling its CPU time as it runs.

    ``os.wait4`` reaps this child alone and returns its own resource usage, so ``ru_maxrss`` is
    this run's peak and not the largest of every run so far.
    """
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(omp_threads),
        "PYTHONUNBUFFERED": "1",
        **dict(extra_env),
    }
    trace: list[tuple[float, float]] = []
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # Output goes to a file, not a pipe: nothing would read a pipe while we poll.
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=log)
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                cpu_s = process_cpu_s(proc.pid)
                if cpu_s is not None:
                    trace.append((time.time(), cpu_s))  # time.time(): TensorBoard's wall clock
                time.sleep(CPU_POLL_S)
        except BaseException:  # Ctrl-C or an error here: do not leave the run training alone
            proc.kill()
            proc.wait()
            raise
    wall_s = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{shlex.join(command)}\nfailed (exit {proc.returncode}):\n{tail}")
    return ChildUsage(
        wall_s=wall_s,
        cpu_s=usage.ru_utime + usage.ru_stime,
        max_rss_mib=usage.ru_maxrss / 1024,  # KiB on Linux
        cpu_trace=trace,
    )


def cpu_ms_between(trace: list[tuple[float, float]], start: float, end: float) -> float | None:
    """CPU milliseconds a process spent between two wall times, interpolating its trace."""
    if len(trace) < 2 or start < trace[0][0] or end > trace[-1][0]:
        return None
    times, cpu = zip(*trace, strict=True)
    return float(numpy.interp(end, times, cpu) - numpy.interp(start, times, cpu)) * 1e3


def read_scalars(log_dir: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """Every TensorBoard scalar under ``log_dir``: tag -> step -> (wall time, value)."""
    event_files = sorted(log_dir.rglob("events.out.tfevents.*"))
    if not event_files:
        raise FileNotFoundError(f"no TensorBoard events under {log_dir}")
    series: dict[str, dict[int, tuple[float, float]]] = {}
    for event_file in event_files:
        ea = EventAccumulator(str(event_file), size_guidance={"tensors": 0, "scalars": 0})
        ea.Reload()
        # torchtune's TensorBoardLogger writes scalars as tensor summaries; older ones as scalars.
        for tag in ea.Tags().get("tensors", []):
            for e in ea.Tensors(tag):
                if e.tensor_proto.string_val:  # text and layouts, not scalars
                    continue
                value = float(tensor_util.make_ndarray(e.tensor_proto))
                series.setdefault(tag, {})[e.step] = (e.wall_time, value)
        for tag in ea.Tags().get("scalars", []):
            for e in ea.Scalars(tag):
                series.setdefault(tag, {})[e.step] = (e.wall_time, e.value)
    return series


def timed_steps(loss: dict[int, tuple[float, float]], warmup_steps: int) -> list[int]:
    """The steps after warm-up whose duration is known (the step before was logged too)."""
    steps = [s for s in sorted(loss) if s > warmup_steps and s - 1 in loss]
    if not steps:
        raise ValueError(f"no logged step after {warmup_steps} warm-up steps; raise --max-steps")
    return steps


def measure(spec: RunSpec, repeat: int, args: argparse.Namespace, out_root: Path) -> RunResult:
    """Train one run and read back what it measured."""
    output_dir = out_root / f"{spec.name}-{repeat}"
    log_path = out_root / f"{spec.name}-{repeat}.log"
    usage = launch(tune_command(spec, args, output_dir), log_path, args.omp_threads, spec.env)
    scalars = read_scalars(output_dir / "logs")
    loss = scalars["loss"]
    steps = timed_steps(loss, args.warmup_steps)
    intervals = [(loss[s - 1][0], loss[s][0]) for s in steps]
    step_cpu_ms = [cpu_ms_between(usage.cpu_trace, *interval) for interval in intervals]
    tokens = scalars.get("loss_tokens")  # stock does not log it
    gpu_peak = scalars.get("peak_memory_alloc")
    shapes = scalars.get("throughput/micro_batch_shapes")  # nor this
    graphs, breaks = scalars.get("compile/graphs"), scalars.get("compile/graph_breaks")
    match = PADDING_LINE.search(log_path.read_text(errors="replace"))
    return RunResult(
        spec=spec,
        repeat=repeat,
        output_dir=output_dir,
        usage=usage,
        step_ms=[(end - start) * 1e3 for start, end in intervals],
        step_cpu_ms=None if None in step_cpu_ms else step_cpu_ms,
        loss_tokens=[tokens[s][1] for s in steps] if tokens else None,
        gpu_peak_gib=max(v for _, v in gpu_peak.values()) if gpu_peak else None,
        padding=(float(match[1]) / 100, int(match[2].replace(",", ""))) if match else None,
        num_shapes=int(max(v for _, v in shapes.values())) if shapes else None,
        compiled=(int(last_value(graphs)), int(last_value(breaks))) if graphs and breaks else None,
    )


def last_value(scalar: dict[int, tuple[float, float]]) -> float:
    """A logged scalar's value at its last step."""
    return scalar[max(scalar)][1]


def load_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    """The trained weights of a run: its last epoch checkpoint, every shard."""
    epochs = sorted(output_dir.glob("epoch_*"), key=lambda p: int(p.name.split("_")[1]))
    if not epochs:
        raise FileNotFoundError(f"no epoch checkpoint under {output_dir}")
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(epochs[-1].glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    return weights


def weight_gaps(results: list[RunResult]) -> dict[tuple[str, int], float]:
    """Each run's ``||w - w_fixed|| / ||w_fixed - w_init||`` against its repeat's fixed run.

    Loads two runs' weights at a time, so that a large model's runs need not all fit in memory.
    """
    gaps = {}
    for reference in (r for r in results if r.spec.name == REFERENCE):
        initial = load_file(str(reference.output_dir / INIT_WEIGHTS))
        reference_weights = load_weights(reference.output_dir)
        for result in results:
            if result.repeat == reference.repeat and result is not reference:
                weights = load_weights(result.output_dir)
                gaps[result.spec.name, result.repeat] = relative_l2(
                    weights, reference_weights, initial
                )
    return gaps


def median_over(runs: list[RunResult], value: Callable[[RunResult], float]) -> float:
    """The median of ``value`` over one configuration's repeats."""
    return statistics.median(value(run) for run in runs)


def table_row(
    runs: list[RunResult],
    fixed: list[RunResult],
    stock: list[RunResult],
    gap: float | None,
    gpu_column: bool,
) -> list[str]:
    """One configuration's cells. Stock logs neither loss tokens nor padding: it trains the
    fixed run's micro-batches, so those come from the fixed run of the same repeat (marked)."""
    is_stock = runs[0].spec.name == STOCK
    counted = fixed if is_stock else runs
    mark = "†" if is_stock else ""
    step_ms = median_over(runs, lambda r: statistics.median(r.step_ms))
    stock_ms = median_over(stock, lambda r: statistics.median(r.step_ms))
    loss_tokens = {r.repeat: sum(r.loss_tokens) for r in counted if r.loss_tokens}
    tokens_per_s = (
        median_over(runs, lambda r: loss_tokens[r.repeat] / sum(r.step_ms) * 1e3)
        if len(loss_tokens) == len(counted)
        else None
    )
    cells = [runs[0].spec.name, f"{step_ms:.0f}", f"{stock_ms / step_ms:.2f}x"]
    if all(r.step_cpu_ms for r in [*runs, *stock]):
        cpu_ms = median_over(runs, lambda r: statistics.median(r.step_cpu_ms))
        stock_cpu_ms = median_over(stock, lambda r: statistics.median(r.step_cpu_ms))
        cells += [f"{cpu_ms:.0f}", f"{stock_cpu_ms / cpu_ms:.2f}x"]
    else:
        cells += ["n/a", "n/a"]
    padding = counted[0].padding
    cells += [
        "n/a" if tokens_per_s is None else f"{tokens_per_s:.0f}{mark}",
        f"{100 * padding[0]:.1f}%{mark}" if padding else "n/a",
        f"{padding[1]:,}{mark}" if padding else "n/a",
        f"{counted[0].num_shapes}{mark}" if counted[0].num_shapes else "n/a",
        compilations(runs),
        f"{max(r.usage.max_rss_mib for r in runs):.0f}",
    ]
    gpu_peaks = [r.gpu_peak_gib for r in runs if r.gpu_peak_gib is not None]
    if gpu_column:
        cells.append(f"{max(gpu_peaks):.2f}" if gpu_peaks else "n/a")
    cells.append("0 (reference)" if gap is None else f"{gap:.2e}")
    return cells


def compilations(runs: list[RunResult]) -> str:
    """A compiled configuration's graphs and graph breaks (the most over its repeats), "eager"
    for the others."""
    counts = [r.compiled for r in runs if r.compiled is not None]
    if not counts:
        return "eager"
    return f"{max(graphs for graphs, _ in counts)} ({max(breaks for _, breaks in counts)})"


def format_table(results: list[RunResult], specs: list[RunSpec]) -> list[str]:
    """The markdown table: one row per configuration, medians over repeats, the worst rel-L2."""
    by_name = {s.name: [r for r in results if r.spec.name == s.name] for s in specs}
    gaps = weight_gaps(results)
    gpu_column = any(r.gpu_peak_gib is not None for r in results)
    header = [
        "run",
        "ms/step",
        "speed-up vs stock",
        "CPU ms/step",
        "CPU speed-up vs stock",
        "loss tok/s",
        "padding",
        "positions",
        "shapes",
        "graphs (breaks)",
        "peak RSS MiB",
        *(["peak GPU alloc GiB"] if gpu_column else []),
        "rel-L2 to fixed",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for spec in specs:
        runs = by_name[spec.name]
        run_gaps = [gaps[spec.name, r.repeat] for r in runs if (spec.name, r.repeat) in gaps]
        gap = max(run_gaps) if run_gaps else None
        cells = table_row(runs, by_name[REFERENCE], by_name[STOCK], gap, gpu_column)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def packed_against_budget(results: list[RunResult]) -> list[str]:
    """Each packed run's step time as a share of the same repeat's token_budget run's (wall and
    CPU), the median over repeats: above 1, packing costs more than the padding it saves; and
    ``packed``'s as a share of ``packed_dense``'s: what per-document attention saves."""
    names = dict.fromkeys(r.spec.name for r in results if r.spec.name.startswith(PACKED))
    return [
        *(step_time_ratio(results, name, BUDGET) for name in names),
        step_time_ratio(results, PACKED, PACKED_DENSE),
        *(
            step_time_ratio(results, name, name.removesuffix(COMPILED))
            for name in names
            if name.endswith(COMPILED)
        ),
        step_time_ratio(results, f"{PACKED_DENSE}{COMPILED}", PACKED),
    ]


def step_time_ratio(results: list[RunResult], name: str, baseline: str) -> str:
    """``name``'s step time over ``baseline``'s, each repeat's pair, the median over repeats."""
    base = {r.repeat: r for r in results if r.spec.name == baseline}
    pairs = [(r, base[r.repeat]) for r in results if r.spec.name == name and r.repeat in base]
    if not pairs:
        return f"- {name} / {baseline}: not both run"
    wall = [statistics.median(r.step_ms) / statistics.median(b.step_ms) for r, b in pairs]
    text = f"- {name} / {baseline}, ms/step: {statistics.median(wall):.2f}x"
    if all(r.step_cpu_ms and b.step_cpu_ms for r, b in pairs):
        cpu = [
            statistics.median(r.step_cpu_ms) / statistics.median(b.step_cpu_ms) for r, b in pairs
        ]
        text += f"; CPU ms/step: {statistics.median(cpu):.2f}x"
    return text + f" ({len(pairs)} pair(s))"


def footnotes(args: argparse.Namespace, results: list[RunResult]) -> list[str]:
    """What the columns mean, and why stock's rel-L2 is what it is."""
    global_batch = args.batch_size * args.ga
    num_steps = len(results[0].step_ms)
    runs = ", ".join(
        f"{r.spec.name} #{r.repeat} {r.usage.wall_s:.0f} s ({r.usage.cpu_s:.0f} s CPU)"
        for r in results
    )
    return [
        f"- ms/step: median over the {num_steps} steps after {args.warmup_steps} warm-up steps "
        "of the time between consecutive `loss` events (data, forward, backward, optimizer, "
        "logging); CPU ms/step: the run process's CPU time (all threads) over the same steps. "
        "With --repeats, medians of the runs' medians. speed-up = stock's / the run's.",
        f"- token_budget runs batch_size={global_batch} gradient_accumulation_steps=1 "
        f"micro_batch_tokens={args.micro_batch_tokens}: the same {global_batch}-sample windows "
        f"as {args.batch_size} x {args.ga}, split by the budget instead of by count.",
        "- loss tok/s: loss tokens of the timed steps (the `loss_tokens` scalar) over their "
        "summed wall time. padding: padded positions over positions processed, and positions "
        "processed, over every step of the run (the recipe's end-of-run `exactga: padding "
        "was ...` line).",
        f"- packed runs {args.batch_size} x {args.ga} with micro_batch_tokens={args.packed_row} "
        f"(positions per row); packed_m{args.packed_multiple} adds pad_to_multiple_of="
        f"{args.packed_multiple}; packed_dense runs packed's rows under the dense block-causal "
        "mask (EXACTGA_DENSE_PACKED_MASK=1) where packed attends each document alone; "
        "the _compiled runs add compile=True (inductor; step 1 compiles). shapes: "
        "the distinct micro-batch shapes in the epoch (the "
        "`throughput/micro_batch_shapes` scalar's last value).",
        "- †: stock logs neither loss tokens nor padding; these are the fixed run's, which "
        "trains the same samples in the same order cut into the same micro-batches (its loss "
        "tok/s divides them by stock's own step times).",
        "- peak RSS: the `tune` process's own high-water mark (os.wait4), start-up and "
        "checkpoint saving included; libraries, data, model and optimizer are a floor common "
        "to every run.",
        "- rel-L2 to fixed: ||w - w_fixed|| / ||w_fixed - w_init|| over all trained weights, "
        "in float64. by_length, token_budget and packed train exactly the fixed run's steps, so "
        "theirs is floating-point rounding (summation order). Stock's post_scale weights each "
        "micro-batch by its loss tokens counted before the label shift and divides the "
        "gradients after backward (docs/math.md, section 3): the same objective as exact only "
        "where no row's first label is a loss token (true of the bundled data, "
        "train_on_input: False), so its gap is rounding there and systematic elsewhere.",
        f"- runs, in order: {runs}.",
    ]


def conditions(args: argparse.Namespace) -> str:
    """The machine and software a table was measured on."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), flags=re.M)
        cpu = names[0] if names else cpu
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "; ".join(
        [
            f"date {datetime.datetime.now().astimezone().isoformat(timespec='minutes')}",
            f"{cores} cores usable ({cpu})",
            f"torch {metadata.version('torch')}, torchtune {metadata.version('torchtune')}",
            f"Python {platform.python_version()}",
            f"OMP_NUM_THREADS={args.omp_threads}",
            f"CUDA {'available' if torch.cuda.is_available() else 'not available'}",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny/full_single_device.yaml")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--ga", type=int, default=8, help="gradient_accumulation_steps")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024, help="token_budget's")
    parser.add_argument("--packed-row", type=int, default=1024, help="packed's positions per row")
    parser.add_argument(
        "--packed-multiple", type=int, default=64, help="pad_to_multiple_of of packed_m<m>"
    )
    parser.add_argument(
        "--max-seq-len", type=int, default=512, help="tokenizer.max_seq_len; 0: the config's"
    )
    parser.add_argument("--max-steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out of timing")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration")
    parser.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of runs")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra override, all runs"
    )
    parser.add_argument("--out", type=Path, default=None, help="keep run folders here")
    parser.add_argument(
        "--skip", action="append", default=[], metavar="NAME", help="leave this run out"
    )
    args = parser.parse_args(argv)
    if {STOCK, REFERENCE} & set(args.skip):
        parser.error(f"the table measures every run against {STOCK} and {REFERENCE}")
    if args.warmup_steps < 1 or args.max_steps <= args.warmup_steps:
        # Step 1's start is not logged, so it cannot be timed: warm-up covers it.
        parser.error("need 1 <= --warmup-steps < --max-steps")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    specs = run_specs(args)
    load_before = os.getloadavg()
    start = time.perf_counter()
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="micro_batching_") as tmp:
        out_root = (args.out or Path(tmp)).resolve()
        out_root.mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            for spec in specs if repeat % 2 == 0 else specs[::-1]:
                result = measure(spec, repeat, args, out_root)
                results.append(result)
                median_ms = statistics.median(result.step_ms)
                print(f"{spec.name} #{repeat}: {median_ms:.0f} ms/step", file=sys.stderr)
        table = format_table(results, specs)  # reads the weights: inside the folder's life
    load_after = os.getloadavg()
    argv_text = shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"# benchmarks/micro_batching.py {argv_text}".rstrip())
    print(
        f"# {args.config}, {args.batch_size} x {args.ga} (global batch "
        f"{args.batch_size * args.ga}), tokenizer.max_seq_len="
        f"{args.max_seq_len or '(the config value)'}, {args.max_steps} steps, "
        f"{args.repeats} repeat(s)" + (f", --set {' '.join(args.set)}" if args.set else "")
    )
    print(f"# {conditions(args)}")
    print(
        "# load average (1, 5, 15 min): before "
        + ", ".join(f"{x:.2f}" for x in load_before)
        + "; after "
        + ", ".join(f"{x:.2f}" for x in load_after)
        + f"; total wall time {time.perf_counter() - start:.0f} s"
    )
    print("\n".join(table))
    print("")
    print("\n".join(packed_against_budget(results)))
    print("\n".join(footnotes(args, results)))


if __name__ == "__main__":
    main()
