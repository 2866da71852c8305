"""The recipes' profiler hook: phase timings, the saved latency, throughput and traces.

One object, always present, used the same way by every recipe (a no-op where a feature is
off, so the training loop carries no ``if profiling:`` branches):

- phase timings (``time/data_ms``, ``time/forward_ms``, ``time/backward_ms``,
  ``time/optimizer_ms``, ``time/step_ms``), averaged per optimizer step over each logging
  interval. On CUDA they come from CUDA events that are read only when metrics are logged, so
  no micro-batch waits on the device; data loading is host work and is timed on the host.
- the saved latency (``normalization/saved_ms``, ``normalization/saved_fraction``): exact mode
  never scales gradients, so on a few sampled steps the hook times the very pass stock
  torchtune would run (``scale_grads`` by a factor of 1, which leaves every gradient
  bit-identical) on this model's real gradients. See [saved latency].
- throughput (``throughput/tokens_per_second``, ``throughput/mfu``): processed tokens,
  including padding, and model FLOPs utilisation from ``6 * params`` plus attention FLOPs per
  token over the device's peak (a small table, or the config key ``peak_flops``); what of it
  was padding (``throughput/padding_fraction``: padded positions over processed positions), the
  loss tokens trained per second (``throughput/loss_tokens_per_second``), all on this rank, and
  under data parallelism ``throughput/rank_imbalance`` (the interval's worst step's largest
  rank's processed positions over the ranks' mean). See [micro-batching modes].
- ``torch.profiler`` traces on torchtune's schedule keys, written as Chrome/Perfetto JSON
  (``trace_step_<n>.json``, open at https://ui.perfetto.dev), stepped once per *optimizer*
  step (stock torchtune steps per micro-batch); on CUDA with ``profile_memory`` also memory
  snapshots (``memory_snapshot_step_<n>.pickle``, open at https://pytorch.org/memory_viz),
  and a snapshot dump when training runs out of memory, before the error is re-raised.

Note [saved latency]
The measurement sits between the last backward and the optimizer step, synchronises the device
around the pass, and only on sampled steps (``saved_latency_every_n_steps``); those steps run
a little slower, the others not at all. Multiplying by exactly 1 changes no bit, so trained
weights are identical with the measurement on or off (a test checks this).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import utils

from exactga.micro_batching import PaddingMeter, WindowWork
from exactga.normalization import gradient_scaling_pass

log = utils.get_logger("INFO")

PHASES = ("data", "forward", "backward", "optimizer")

# Dense bf16 peak FLOP/s by device-name fragment (no sparsity). Override with profiler.peak_flops.
PEAK_FLOPS_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "4090": 165e12,
}


@dataclasses.dataclass
class ProfilerSection:
    """The ``profiler`` config section: torchtune 0.6.1's keys, with their one default.

    It is also the section's schema (``exactga.schemas``), so a misspelt key fails at start-up.
    """

    _component_: str = "torchtune.training.setup_torch_profiler"  # accepted, not used
    enabled: bool = False  # torch.profiler traces (and CUDA memory snapshots) on the schedule
    output_dir: Optional[str] = None  # default: <output_dir>/profiling_outputs
    cpu: bool = True
    cuda: bool = True
    xpu: bool = True
    profile_memory: bool = False
    with_stack: bool = False
    record_shapes: bool = True
    with_flops: bool = False
    wait_steps: int = 5
    warmup_steps: int = 3
    active_steps: int = 2
    num_cycles: int = 1


@dataclasses.dataclass
class ProfilerSettings(ProfilerSection):
    """What the profiler hook reads: the section, plus exactga's scalar knobs, which are
    top-level config keys (stock torchtune passes the section to its own profiler, which
    would reject extra keys there). Their defaults here are the schema's."""

    log_timings: bool = True  # time/*, throughput/* and normalization/* scalars
    saved_latency_every_n_steps: int = 10  # 0: never time the gradient-scaling pass
    peak_flops: Optional[float] = None  # per-device peak FLOP/s for throughput/mfu


# The top-level config keys that feed ProfilerSettings' exactga fields.
TOP_LEVEL_KEYS = ("log_timings", "saved_latency_every_n_steps", "peak_flops")


def parse_settings(
    cfg_profiler: DictConfig | None, default_output_dir: str, **top_level: Any
) -> ProfilerSettings:
    """Read the ``profiler`` section (torchtune's keys only), naming any key it does not know."""
    values = {} if cfg_profiler is None else OmegaConf.to_container(cfg_profiler, resolve=True)
    known = {f.name for f in dataclasses.fields(ProfilerSection)}
    for key in values:
        if key not in known:
            raise ValueError(f"unknown config key 'profiler.{key}'.")
    settings = ProfilerSettings(**values, **top_level)
    if settings.output_dir is None:
        settings.output_dir = os.path.join(default_output_dir, "profiling_outputs")
    if settings.saved_latency_every_n_steps < 0:
        raise ValueError("config key 'saved_latency_every_n_steps' must be >= 0.")
    return settings


class _PhaseClock:
    """Accumulates the time of each phase since the last read, without host syncs on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host_ms = dict.fromkeys(PHASES, 0.0)
        self._events: dict[str, list[tuple[Any, Any]]] = {phase: [] for phase in PHASES}

    @contextlib.contextmanager
    def time(self, phase: str, on_host: bool = False) -> Iterator[None]:
        if self._cuda and not on_host:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[phase].append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self._host_ms[phase] += (time.perf_counter() - t0) * 1e3

    def read_ms(self) -> dict[str, float]:
        """Milliseconds per phase since the last read (waits for the device once, here)."""
        totals = dict(self._host_ms)
        for phase, pairs in self._events.items():
            if pairs:
                pairs[-1][1].synchronize()
                totals[phase] += sum(start.elapsed_time(end) for start, end in pairs)
                pairs.clear()
        self._host_ms = dict.fromkeys(PHASES, 0.0)
        return totals


class TrainingProfiler:
    """The profiler hook; create with :func:`setup_profiler`, enter once around training."""

    def __init__(
        self,
        settings: ProfilerSettings,
        device: torch.device,
        model: nn.Module,
        micro_batching: str = "fixed",
    ) -> None:
        self.settings = settings
        self._micro_batching = micro_batching  # named in the end-of-run padding line
        self._device = device
        self._clock = _PhaseClock(device)
        self._flops_per_token = model_flops_per_token(model)
        self._peak_flops = settings.peak_flops or device_peak_flops(device)
        self._trace: torch.profiler.profile | None = None
        self._step = 0
        self._steps_since_read = 0
        self._tokens_since_read = 0
        self._padding = PaddingMeter()
        self._t_last_read = time.perf_counter()
        self._saved_ms: list[float] = []
        self._step_ms_total = 0.0
        self._t_last_step = time.perf_counter()
        self._recording_memory = False

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> TrainingProfiler:
        self._t_last_read = self._t_last_step = time.perf_counter()
        self._start_memory_history()
        if self.settings.enabled:
            self._trace = self._start_trace()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            self._dump_memory_snapshot("oom_memory_snapshot.pickle")
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
        if self._trace is not None:
            self._trace.stop()
            self._trace = None
        # never swallow the exception: returning None re-raises it

    def _start_trace(self) -> torch.profiler.profile:
        s = self.settings
        activities = [torch.profiler.ProfilerActivity.CPU] if s.cpu else []
        if s.cuda and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if s.xpu and hasattr(torch, "xpu") and torch.xpu.is_available():
            activities.append(torch.profiler.ProfilerActivity.XPU)
        schedule = torch.profiler.schedule(
            wait=s.wait_steps, warmup=s.warmup_steps, active=s.active_steps, repeat=s.num_cycles
        )
        Path(s.output_dir).mkdir(parents=True, exist_ok=True)
        trace = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._write_trace,
            profile_memory=s.profile_memory,
            with_stack=s.with_stack,
            record_shapes=s.record_shapes,
            with_flops=s.with_flops,
        )
        trace.start()
        return trace

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        path = Path(self.settings.output_dir) / f"trace_step_{self._step}.json"
        prof.export_chrome_trace(str(path))
        log.info(f"Profiler trace written to {path} (open it at https://ui.perfetto.dev)")
        self._dump_memory_snapshot(f"memory_snapshot_step_{self._step}.pickle")

    def _start_memory_history(self) -> None:
        """With ``profile_memory`` on CUDA, record allocations from the start (for snapshots)."""
        if self.settings.profile_memory and self._device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._recording_memory = True

    def _dump_memory_snapshot(self, name: str) -> None:
        if not self._recording_memory:
            return
        path = Path(self.settings.output_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        log.info(
            f"CUDA memory snapshot written to {path} (open it at https://pytorch.org/memory_viz)"
        )

    # -- per step ----------------------------------------------------------------------------

    def timed(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from ``iterable``, timing each fetch as the ``data`` phase (host time)."""
        iterator = iter(iterable)
        while True:
            with self._clock.time("data", on_host=True):
                item = next(iterator, _END)
            if item is _END:
                return
            yield item

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a block as ``forward``, ``backward`` or ``optimizer``."""
        if not self.settings.log_timings:
            return contextlib.nullcontext()
        return self._clock.time(name)

    @property
    def saved_ms_samples(self) -> list[float]:
        """Every timed gradient-scaling pass of the run, in milliseconds."""
        return list(self._saved_ms)

    def sample_gradient_pass(self, model: nn.Module) -> None:
        """On sampled steps, time the gradient pass exact mode avoids; see [saved latency]."""
        every = self.settings.saved_latency_every_n_steps
        step = self._step + 1
        if not self.settings.log_timings or every == 0 or (step != 2 and step % every != 0):
            return
        if not any(p.grad is not None for p in model.parameters()):
            return  # optimizer_in_bwd consumed the gradients: nothing to scale
        self._saved_ms.append(time_gradient_pass(model, self._device))

    def step(self, work: WindowWork) -> None:
        """Close an optimizer step (``Window.work()``: its processed positions, padding included,
        and its loss tokens)."""
        now = time.perf_counter()
        self._step_ms_total += (now - self._t_last_step) * 1e3
        self._t_last_step = now
        self._step += 1
        self._steps_since_read += 1
        self._tokens_since_read += work.num_positions
        self._padding.add(work)
        if self._trace is not None:
            self._trace.step()

    def metrics(self) -> dict[str, float]:
        """Scalars for the steps since the last call; the only device read of the hook."""
        if not self.settings.log_timings or self._steps_since_read == 0:
            return {}
        phase_ms = self._clock.read_ms()
        elapsed_s = time.perf_counter() - self._t_last_read
        steps = self._steps_since_read
        step_ms = elapsed_s * 1e3 / steps
        metrics = {f"time/{phase}_ms": phase_ms[phase] / steps for phase in PHASES}
        metrics["time/step_ms"] = step_ms
        tokens_per_second = self._tokens_since_read / elapsed_s
        metrics["throughput/tokens_per_second"] = tokens_per_second
        metrics.update(self._padding.read_interval(elapsed_s))
        if self._peak_flops:
            metrics["throughput/mfu"] = tokens_per_second * self._flops_per_token / self._peak_flops
        if self._saved_ms:
            metrics["normalization/saved_ms"] = self._saved_ms[-1]
            metrics["normalization/saved_fraction"] = self._saved_ms[-1] / step_ms
        self._steps_since_read = 0
        self._tokens_since_read = 0
        self._t_last_read = time.perf_counter()
        return metrics

    def summary(self) -> str:
        """Lines for the end of the run: the saved latency, and the padding."""
        padding = self._padding.summary(self._micro_batching)
        return self._saved_latency_summary() + (f"\n{padding}" if padding else "")

    def _saved_latency_summary(self) -> str:
        if not self._saved_ms or self._step == 0 or self._step_ms_total == 0:
            return "exactga: no gradient-scaling pass was timed in this run."
        saved = sum(self._saved_ms) / len(self._saved_ms)
        step_ms = self._step_ms_total / self._step
        return (
            f"exactga: skipping the gradient-scaling pass saved {saved:.2f} ms per optimizer step "
            f"({100 * saved / step_ms:.1f}% of {step_ms:.1f} ms; measured on "
            f"{len(self._saved_ms)} sampled steps), about {saved * self._step / 1e3:.1f} s "
            f"over {self._step} steps."
        )


_END = object()


def time_gradient_pass(model: nn.Module, device: torch.device) -> float:
    """Milliseconds of stock torchtune's gradient-scaling pass over ``model``'s gradients.

    The factor is 1, so no gradient changes; the device is synchronised around the pass.
    """
    _synchronize(device)
    t0 = time.perf_counter()
    gradient_scaling_pass(model, 1.0)
    _synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token: matmul weights, plus attention scores.

    Each matmul weight costs 2 FLOPs per token forward and 2 for the input gradient; 2 more for
    its own gradient when it trains (``6 * params`` for full fine-tuning, about ``4 * params``
    for LoRA). An untied input embedding is a lookup, not a matmul, and is left out (a tied one
    is the output projection). The attention term (``12 * layers * dim * context``, PaLM
    appendix B) uses the model's ``max_seq_len`` as context, an upper bound for padded batches.
    """
    lookup_only = _untied_embedding(model)
    params = [p for p in model.parameters() if p is not lookup_only]
    num_params = sum(p.numel() for p in params)
    num_trainable = sum(p.numel() for p in params if p.requires_grad)
    layers = getattr(model, "layers", None)
    embed = getattr(model, "tok_embeddings", None)
    context = getattr(model, "max_seq_len", None)
    attention = 0.0
    if layers is not None and embed is not None and context is not None:
        attention = 12.0 * len(layers) * embed.embedding_dim * context
    return 4.0 * num_params + 2.0 * num_trainable + attention


def _untied_embedding(model: nn.Module) -> torch.Tensor | None:
    """The input embedding's weight when the output projection has weights of its own."""
    embed, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    # torchtune's TiedLinear is a plain object over the embedding, not a module with weights.
    if embed is None or not isinstance(output, nn.Module):
        return None
    if next(output.parameters(), None) is None:
        return None
    return embed.weight


def device_peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known CUDA device, else None (MFU is then not logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, flops in PEAK_FLOPS_BF16.items():
        if fragment in name:
            return flops
    return None


def setup_profiler(cfg: DictConfig, device: torch.device, model: nn.Module) -> TrainingProfiler:
    """The recipe's profiler hook from a validated recipe config.

    Reads the ``profiler`` section (may be absent), ``output_dir``, ``micro_batching`` and the
    top-level ``log_timings``, ``saved_latency_every_n_steps`` and ``peak_flops``.
    """
    top_level = {key: cfg[key] for key in TOP_LEVEL_KEYS if key in cfg}
    settings = parse_settings(cfg.get("profiler"), cfg.output_dir, **top_level)
    return TrainingProfiler(settings, device, model, micro_batching=cfg.micro_batching)
