"""The recipes' profiler hook: phase timings, the saved latency, throughput and traces.

One object, always present, used the same way by every recipe (a no-op where a feature is
off, so the training loop carries no ``if profiling:`` branches): :func:`setup_profiler`
builds it from the few config values it reads, :class:`TrainingProfiler` is entered once
around training. One idea a module:

- :mod:`~exactga.config.profiler`: the ``profiler`` section and the top-level knobs
  (``log_timings``, ``saved_latency_every_n_steps``, ``peak_flops``), one default each.
- :mod:`~exactga.profiling.phase_clock`: phase timings (``time/data_ms``,
  ``time/forward_ms``, ``time/backward_ms``, ``time/optimizer_ms``, ``time/step_ms``),
  averaged per optimizer step over each logging interval. On CUDA they come from CUDA events
  that are read only when metrics are logged, so no micro-batch waits on the device; data
  loading is host work and is timed on the host.
- :mod:`~exactga.profiling.saved_latency`: the saved latency (``normalization/saved_ms``,
  ``normalization/saved_fraction``): exact mode never scales gradients, so on a few sampled
  steps after warm-up the hook times the pass stock torchtune would run (``scale_grads`` by a
  factor of 1, which leaves every gradient bit-identical) on a tenth of this model's real
  gradients and scales the time up by element count; the run reports the samples' median and
  range. See [saved latency].
- :mod:`~exactga.profiling.flops`: training FLOPs per token (``6 * params`` plus attention)
  and the device's peak (a small table, or the config key ``peak_flops``), for model FLOPs
  utilisation (``throughput/mfu``). Beside it the hook logs throughput
  (``throughput/tokens_per_second``: processed tokens, including padding), what of it was
  padding (``throughput/padding_fraction``: padded positions over processed positions), the
  loss tokens trained per second (``throughput/loss_tokens_per_second``), all on this rank,
  and under data parallelism ``throughput/rank_imbalance`` (the interval's worst step's
  largest rank's processed positions over the ranks' mean). See [micro-batching modes].
- :mod:`~exactga.profiling.traces`: ``torch.profiler`` traces on torchtune's schedule keys,
  written as Chrome/Perfetto JSON (``trace_step_<n>.json``, open at https://ui.perfetto.dev),
  stepped once per *optimizer* step (stock torchtune steps per micro-batch) and numbered so
  that ``ProfilerStep#<k>`` is optimizer step ``k`` and ``<n>`` the last step in the file; the
  phases and the sampled pass are labelled regions (``exactga/data`` ...
  ``exactga/saved_latency_sample``). On CUDA with ``profile_memory`` also memory snapshots
  (``memory_snapshot_step_<n>.pickle``, open at https://pytorch.org/memory_viz), and a
  snapshot dump when training runs out of memory, before the error is re-raised.
- :mod:`~exactga.profiling.report`: a report in TensorBoard when the recipe's
  ``metric_logger`` is torchtune's ``TensorBoardLogger``: a custom-scalars layout written when
  training starts (the phases as shares of the step, stacked; the saved latency as a share of
  the step; throughput; MFU; what was processed), its lines at every logged step, each line a
  run of its own so that each gets its own colour (see [report charts]), and a markdown
  summary in the TEXT tab when training ends. Other loggers get no report and no error.
- :mod:`~exactga.profiling.compilations`: with ``compile: True``, what ``torch.compile`` did
  since training started, from dynamo's own counters (no device read): ``compile/graphs``,
  ``compile/recompilations``, ``compile/graph_breaks`` at every logged step, and an end-of-run
  line with the counts after step 1 and the first reasons of the breaks and recompilations.
- :mod:`~exactga.profiling.hook`: the hook itself, which calls the pieces above.

The benchmarks' and tests' own helpers (timing the whole gradient pass, reading a report back)
live in ``tools/profiling_utils.py``.
"""

import importlib
from typing import Any

# Public name -> the module that defines it. Loaded on first use (PEP 562), so that reading one
# constant of the package does not load the hook and, through it, the runtime.
_HOMES = {
    "PEAK_FLOPS_BF16": "exactga.profiling.flops",
    "device_peak_flops": "exactga.profiling.flops",
    "model_flops_per_token": "exactga.profiling.flops",
    "TrainingProfiler": "exactga.profiling.hook",
    "setup_profiler": "exactga.profiling.hook",
    "profiler_from_settings": "exactga.profiling.hook",
    "PHASES": "exactga.profiling.phase_clock",
    "REPORT_CATEGORY": "exactga.profiling.report",
    "REPORT_RUN": "exactga.profiling.report",
    "REPORT_TAG": "exactga.profiling.report",
    "SAVED_LATENCY_FRACTION": "exactga.profiling.saved_latency",
    "SAVED_LATENCY_NUM_SAMPLES": "exactga.profiling.saved_latency",
    "SavedLatency": "exactga.profiling.saved_latency",
    "SavedLatencySample": "exactga.profiling.saved_latency",
    "sample_gradients": "exactga.profiling.saved_latency",
    "time_scaling_pass": "exactga.profiling.saved_latency",
    "ProfilerSection": "exactga.config.profiler",
    "ProfilerSettings": "exactga.config.profiler",
    "parse_settings": "exactga.config.profiler",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'exactga.profiling' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = [
    "PEAK_FLOPS_BF16",
    "PHASES",
    "REPORT_CATEGORY",
    "REPORT_RUN",
    "REPORT_TAG",
    "SAVED_LATENCY_FRACTION",
    "SAVED_LATENCY_NUM_SAMPLES",
    "ProfilerSection",
    "ProfilerSettings",
    "SavedLatency",
    "SavedLatencySample",
    "TrainingProfiler",
    "device_peak_flops",
    "model_flops_per_token",
    "parse_settings",
    "sample_gradients",
    "profiler_from_settings",
    "setup_profiler",
    "time_scaling_pass",
]
