"""Kernels per micro-batch: the operators one micro-batch's forward and backward dispatch, eager
and compiled, for the Llama 3.2 1B shape, on the meta device or the CPU (issue #66, "launches
counted").

Round two's H100 run (docs/gpu_report_round_two.md) found the 1B step host-bound: 2,204 kernel
launches a micro-batch, 28 ms of GPU time against 111 ms of host time. A launch costs the host
about the same whatever the tensor's size, so the count is what the host pays, and it can be
followed here, between GPU rounds, without a GPU.

The micro-batch is the recipe's (recipes/full_finetune_single_device.py): the model from
torchtune's ``llama3_2`` builder at the 1B shape of benchmarks/gpu_1b_variable_length.py (fewer
layers: the count is a fixed part plus a part per layer, measured at 1 and 2 layers and checked
at 16 on meta), the config's loss (``CEWithChunkedOutputLoss``, or ``--loss fused``, exactga's
``LinearCrossEntropyLoss``, built by ``exactga.model_build.trained.build_loss``), the forward and
mean loss of ``exactga.sft.loss.causal_lm_loss``, the loss weighed by its share of the window as
``Window.scale`` does (``loss * u_m / U``), and backward. One micro-batch runs first (uncounted:
it compiles, and makes the ``.grad`` that the counted one accumulates into, as every micro-batch
but a window's first does).

- Eager: a ``TorchDispatchMode`` counts every aten operator dispatched, split by phase. Views
  and allocations (``view``, ``t``, ``expand``, ``detach``, ``empty``, ...) are dispatched but
  launch no GPU kernel: "launching" leaves them out, and is what compares with the GPU's count.
  On the meta device (no memory, no compute) at the full 1B width; on the CPU at a narrow width
  (``--cpu-width``: same layer structure, smaller matrices) as a cross-check: the count does not
  depend on the widths or on the batch's shape.
- Compiled: the recipe's ``compile: True`` (torchtune's ``compile_model``: each decoder layer
  compiled; ``compile_loss``: the chunked loss's cross-entropy compiled), on the CPU at the
  narrow width. What runs is inductor's generated kernels (counted at run time: profiler events
  of ``torch._inductor.config.cpp.enable_kernel_profile``) plus the aten operators still
  dispatched (the same mode, with ``ignore_compile_internals``: the compiled graphs' extern
  calls, such as matmuls and attention, and everything outside the graphs). Also reported: the
  kernels inductor generated (``torch._inductor.metrics.generated_kernel_count``), the graphs
  and the graph breaks (``torch._dynamo.utils.counters``).

Run from the repository root (``--quick``: meta counts only, seconds)::

    python benchmarks/kernel_counts.py [--quick] [--batch 2 --seq 64] [--loss fused]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.utils
import torch._inductor.config
import torch._inductor.metrics
from omegaconf import OmegaConf
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torchtune import training
from torchtune.models.llama3_2 import llama3_2

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_1b_variable_length import LLAMA_3_2_1B  # noqa: E402

from exactga.model_build.trained import build_loss, init_rope  # noqa: E402
from exactga.runtime.precision import Precision  # noqa: E402
from exactga.sft.loss import causal_lm_loss  # noqa: E402

LOSSES = {
    "chunked": "torchtune.modules.loss.CEWithChunkedOutputLoss",
    "fused": "exactga.accumulation.linear_cross_entropy.LinearCrossEntropyLoss",
}
PHASES = ("forward", "backward")
# Dispatched, but no kernel on a GPU: metadata (views) and allocations.
NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "_unsafe_view",
    "lift_fresh",
    "resolve_conj",
    "resolve_neg",
    "_local_scalar_dense",  # a read back to the host, not a launch
}
GPU_ROUND_TWO = 2204  # launches a micro-batch, H100, docs/gpu_report_round_two.md


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether an aten operator launches a kernel on a GPU: views and allocations do not."""
    return not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL


class OperatorCount(TorchDispatchMode):
    """Counts the aten operators dispatched, by phase (``phase`` is set by the caller).

    ``ignore_compile_internals``: a compiled region is not traced back into eager operators
    (as a mode otherwise makes it); its compiled artifact runs, and only the operators it still
    dispatches (extern calls) reach this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = PHASES[0]
        self.dispatched: dict[str, Counter[str]] = {p: Counter() for p in PHASES}
        self.launching: dict[str, Counter[str]] = {p: Counter() for p in PHASES}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        self.dispatched[self.phase][name] += 1
        if launches_kernel(func):
            self.launching[self.phase][name] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Count:
    """One micro-batch's count: aten operators (all, launching) and inductor kernels by phase."""

    dispatched: dict[str, int]
    launching: dict[str, int]
    inductor: dict[str, int]  # none when nothing is compiled
    operators: Counter[str]  # the launching ones, both phases

    def kernels(self, phase: str | None = None) -> int:
        """Launches: the launching aten operators and inductor's kernels."""
        phases = PHASES if phase is None else (phase,)
        return sum(self.launching[p] + self.inductor[p] for p in phases)


@dataclass(frozen=True)
class Setting:
    device: str
    layers: int
    width: dict[str, int]
    loss: str
    precision: str  # bf16 | fp32 | bf16-master (bf16 autocast over fp32 weights, as round two)
    batch: int
    seq: int
    compiled: bool = False


def narrow_shape(width: int) -> dict[str, int]:
    """The 1B shape's structure (heads, tied vocabulary) with smaller matrices, for the CPU."""
    return {
        **LLAMA_3_2_1B,
        "embed_dim": width,
        "intermediate_dim": 4 * width,
        "vocab_size": 8 * width,
    }


def precision_of(setting: Setting) -> Precision:
    compute = torch.float32 if setting.precision == "fp32" else torch.bfloat16
    master = "fp32" if setting.precision == "bf16-master" else "none"
    return Precision.from_config(compute, master, torch.device(setting.device))


def build(setting: Setting) -> tuple[torch.nn.Module, torch.nn.Module, Precision]:
    """The model and loss as the recipe builds them (``build_model``'s order: built in the
    compute dtype, trainable weights cast, compiled; ``build_loss``, compiled with it)."""
    precision = precision_of(setting)
    shape = {**setting.width, "num_layers": setting.layers}
    with training.set_default_dtype(precision.compute_dtype), torch.device(setting.device):
        model = llama3_2(**shape, max_seq_len=setting.seq)
    if setting.device == "meta":  # RoPE's cache is not built on meta: built on the CPU, moved
        init_rope(model, precision.compute_dtype, torch.device("cpu"))
        model.to("meta")
    precision.cast_trainable(model)
    if setting.compiled:
        training.compile_model(model, verbose=False)
    cfg_loss = OmegaConf.create({"_component_": LOSSES[setting.loss]})
    loss_fn = build_loss(cfg_loss, model, compile_loss=setting.compiled)
    return model, loss_fn, precision


def micro_batch(setting: Setting) -> dict[str, torch.Tensor]:
    """A padded batch as the collate makes it: tokens, and labels with the prompt ignored."""
    vocab = setting.width["vocab_size"]
    tokens = torch.randint(0, vocab, (setting.batch, setting.seq), device=setting.device)
    labels = tokens.clone()
    labels[:, : setting.seq // 4] = -100
    return {"tokens": tokens, "labels": labels}


def run_micro_batch(
    model: torch.nn.Module,
    loss_fn: torch.nn.Module,
    precision: Precision,
    batch: dict[str, torch.Tensor],
    on_phase: Callable[[str], contextlib.AbstractContextManager[Any]],
) -> None:
    """Forward, the loss weighed as ``Window.scale`` weighs it, and backward."""
    share = 0.125  # u_m / U: a micro-batch's share of its window's loss tokens (any number)
    with on_phase("forward"):
        loss = causal_lm_loss(model, loss_fn, dict(batch), precision=precision)
        scaled = loss.term_means() * share
    with on_phase("backward"):
        scaled.backward()


PhaseRun = Callable[[Callable[[str], contextlib.AbstractContextManager[Any]]], None]


def count(setting: Setting) -> Count:
    """One micro-batch's operators and kernels, after an uncounted one."""
    model, loss_fn, precision = build(setting)
    batch = micro_batch(setting)
    return count_run(
        lambda on_phase: run_micro_batch(model, loss_fn, precision, batch, on_phase),
        profile_kernels=setting.compiled,
    )


def count_run(run: PhaseRun, *, profile_kernels: bool) -> Count:
    """What ``run(on_phase)`` dispatches (and, with ``profile_kernels``, the inductor kernels
    it launches) in each phase it enters with ``on_phase(name)``, after an uncounted run."""
    run(lambda _: contextlib.nullcontext())
    mode = OperatorCount()
    inductor = dict.fromkeys(PHASES, 0)

    @contextlib.contextmanager
    def on_phase(phase: str) -> Iterator[None]:
        mode.phase = phase
        if not profile_kernels:
            yield
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        inductor[phase] = sum(1 for e in prof.events() if "cpp_fused" in e.name)

    with mode:
        run(on_phase)
    return Count(
        dispatched={p: sum(mode.dispatched[p].values()) for p in PHASES},
        launching={p: sum(mode.launching[p].values()) for p in PHASES},
        inductor=inductor,
        operators=mode.launching["forward"] + mode.launching["backward"],
    )


@dataclass
class Row:
    label: str
    setting: Setting
    count: Count
    seconds: float


def measure(label: str, setting: Setting) -> Row:
    start = time.perf_counter()
    result = count(setting)
    row = Row(label, setting, result, time.perf_counter() - start)
    print(f"  {label}, {setting.layers} layers: {row.seconds:.1f} s", file=sys.stderr, flush=True)
    return row


def per_layer(rows: list[Row], label: str) -> tuple[float, float]:
    """(fixed part, part per layer) of a row's launches, from its 1- and 2-layer counts."""
    one, two = (next(r for r in rows if r.label == label and r.setting.layers == n) for n in (1, 2))
    layer = two.count.kernels() - one.count.kernels()
    return one.count.kernels() - layer, layer


def row_record(row: Row) -> dict[str, Any]:
    count = row.count
    return {
        "run": row.label,
        **dataclasses.asdict(row.setting),
        "dispatched": count.dispatched,
        "launching": count.launching,
        "inductor": count.inductor,
        "operators": dict(count.operators),  # (asdict would rebuild the Counter from pairs)
        "launches": count.kernels(),
        "wall_s": row.seconds,
    }


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| run | device | layers | precision | dispatched fwd / bwd | launching fwd / bwd | "
        "inductor kernels fwd / bwd | launches | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        c, s = row.count, row.setting
        lines.append(
            f"| {row.label} | {s.device} | {s.layers} | {s.precision} | "
            f"{c.dispatched['forward']} / {c.dispatched['backward']} | "
            f"{c.launching['forward']} / {c.launching['backward']} | "
            f"{c.inductor['forward']} / {c.inductor['backward']} | {c.kernels()} | "
            f"{row.seconds:.1f} |"
        )
    return lines


def scaling(rows: list[Row], layers: int) -> list[str]:
    """Fixed part, part per layer, and the estimate at ``layers`` of each run measured at 1 and
    2 layers; and eager over compiled."""
    lines = [
        "",
        f"| run | fixed part | per layer | estimate at {layers} layers |",
        "|---|---|---|---|",
    ]
    estimates = {}
    for label in dict.fromkeys(r.label for r in rows):
        if {1, 2} <= {r.setting.layers for r in rows if r.label == label}:
            fixed, layer = per_layer(rows, label)
            estimates[label] = fixed + layers * layer
            lines.append(f"| {label} | {fixed:.0f} | {layer:.0f} | {estimates[label]:.0f} |")
    eager, compiled = estimates.get("eager cpu"), estimates.get("compiled cpu")
    if eager and compiled:
        verdict = "reaches" if compiled <= eager / 4 else "does not reach"
        lines += [
            "",
            f"compiled / eager launches at {layers} layers: {compiled:.0f} / {eager:.0f} = "
            f"{compiled / eager:.2f} ({verdict} a quarter); round two's H100 count: "
            f"{GPU_ROUND_TWO} a micro-batch.",
        ]
    return lines


def top_operators(rows: list[Row], label: str, how_many: int) -> list[str]:
    """The most launched operators of a run at its most layers, and those one layer adds."""
    deepest = max((r for r in rows if r.label == label), key=lambda r: r.setting.layers)
    ops = deepest.count.operators
    lines = [
        f"- {label} ({deepest.setting.layers} layers), {len(ops)} kinds: {listed(ops, how_many)}"
    ]
    by_layers = {r.setting.layers: r.count.operators for r in rows if r.label == label}
    if {1, 2} <= set(by_layers):
        lines.append(f"  - one layer adds: {listed(by_layers[2] - by_layers[1], how_many)}")
    return lines


def listed(operators: Counter[str], how_many: int) -> str:
    return ", ".join(f"{name} {n}" for name, n in operators.most_common(how_many))


def settings(args: argparse.Namespace) -> list[tuple[str, Setting]]:
    """Meta at the 1B width (1, 2 and ``--layers`` layers); the CPU at the narrow width, eager
    and compiled, at 1 and 2 layers. ``--quick``: meta at 1 and 2 layers only. exactga's fused
    loss asks autocast about the device, which meta is not: with it, no meta runs (and
    ``--quick`` counts the CPU's eager runs)."""
    full = {"width": LLAMA_3_2_1B, "loss": args.loss, "batch": args.batch, "seq": args.seq}
    narrow = {**full, "width": narrow_shape(args.cpu_width)}
    meta_layers = (1, 2) if args.quick else (1, 2, args.layers)
    runs = []
    if args.loss != "fused":
        runs += [("eager meta", Setting("meta", n, precision="bf16", **full)) for n in meta_layers]
    for label, compiled in (("eager cpu", False), ("compiled cpu", True)):
        if not args.quick or (args.loss == "fused" and not compiled):
            runs += [
                (label, Setting("cpu", n, precision=args.precision, compiled=compiled, **narrow))
                for n in (1, 2)
            ]
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="eager counts at 1 and 2 layers")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16, help="the 1B model's (estimated)")
    parser.add_argument("--loss", choices=list(LOSSES), default="chunked")
    parser.add_argument("--cpu-width", type=int, default=256, help="the CPU runs' embed_dim")
    parser.add_argument(
        "--precision",
        choices=("bf16-master", "bf16", "fp32"),
        default="bf16",
        help="the CPU runs' (meta's: bf16; round two's profile: bf16)",
    )
    parser.add_argument("--top", type=int, default=12, help="operators listed per run")
    parser.add_argument("--json", type=Path, help="also write the table here (tools/gpu_check.py)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Inductor's CPU kernels as profiler events, so that the compiled runs count them.
    torch._inductor.config.cpp.enable_kernel_profile = True
    torch._inductor.metrics.reset()
    torch._dynamo.utils.counters.clear()
    rows = [measure(label, setting) for label, setting in settings(args)]
    counters = torch._dynamo.utils.counters
    lines = [
        f"# kernel_counts: {' '.join(sys.argv[1:]) or '(defaults)'}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; batch {args.batch} x {args.seq} tokens, loss "
        f"{args.loss}; meta at the 1B width, CPU at embed_dim {args.cpu_width}",
        "",
        *table(rows),
        *scaling(rows, args.layers),
        "",
        "Top launching operators (forward and backward):",
    ]
    for label in dict.fromkeys(r.label for r in rows):
        lines += top_operators(rows, label, args.top)
    if any(r.setting.compiled for r in rows):
        lines += [
            "",
            f"Compiled: inductor generated {torch._inductor.metrics.generated_kernel_count} "
            f"kernels; dynamo graphs {counters['stats']['unique_graphs']}, graph breaks "
            f"{sum(counters['graph_break'].values())} {dict(counters['graph_break'])}",
        ]
    text = "\n".join(lines)
    print(text)
    if args.json:
        payload = {"rows": [row_record(r) for r in rows], "markdown": text}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
