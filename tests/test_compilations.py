"""The torch.compile meter (exactga.profiling.compilations) in one process, on tiny functions.

Dynamo's ``eager`` backend keeps each compilation to milliseconds: the meter reads dynamo's
books (graphs captured, compilation records, graph-break reasons), which every backend fills
alike. Through ``tune run``: tests/test_compile_launch.py.
"""

from __future__ import annotations

import torch
from unit_utils import tiny_model

from exactga.data.micro_batching import WindowWork
from exactga.profiling import ProfilerSettings, TrainingProfiler
from exactga.profiling.compilations import CompilationMeter

CPU = torch.device("cpu")


def _compiled(fn):
    return torch.compile(fn, backend="eager")


def test_a_new_shape_is_one_recompilation_then_the_size_is_dynamic() -> None:
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2

    compiled = _compiled(scale)
    meter = CompilationMeter()
    compiled(torch.randn(4))
    compiled(torch.randn(4))  # the same shape: the guards pass
    meter.step(1)
    assert meter.metrics() == {
        "compile/graphs": 1.0,
        "compile/recompilations": 0.0,
        "compile/graph_breaks": 0.0,
    }
    compiled(torch.randn(7))  # a new size: recompiled, with that size dynamic
    compiled(torch.randn(9))  # covered by the dynamic graph
    meter.step(2)
    counts = meter.counts()
    assert (counts.graphs, counts.recompilations, counts.graph_breaks) == (2, 1, 0)
    summary = meter.summary()
    assert summary.startswith(
        "exactga: torch.compile: 2 graphs (1 after step 1), 1 recompilation (1 after step 1), "
        "0 graph breaks; recompiled for: "
    )
    assert "size mismatch at index 0. expected 4, actual 7" in summary


def test_a_data_dependent_branch_is_a_graph_break_with_its_reason() -> None:
    def branchy(x: torch.Tensor) -> torch.Tensor:
        y = x.cos()
        if y.sum() > 0:  # data-dependent: dynamo breaks the graph here
            return y + 1
        return y - 1

    compiled = _compiled(branchy)
    meter = CompilationMeter()
    compiled(torch.ones(3))
    meter.step(1)
    counts = meter.counts()
    assert counts.graph_breaks == 1
    assert counts.graphs == 2  # the graph before the break and the one after it
    assert counts.recompilations == 0
    assert '1 graph break ("Data-dependent branching" x1)' in meter.summary()


def test_counts_start_with_the_meter() -> None:
    compiled = _compiled(lambda x: x.tan() + 3)
    compiled(torch.randn(5))  # before the run: not the run's
    meter = CompilationMeter()
    compiled(torch.randn(5))
    assert meter.counts().graphs == 0
    assert meter.summary() == (
        "exactga: torch.compile: 0 graphs (0 after step 1), 0 recompilations (0 after step 1), "
        "0 graph breaks."
    )


def test_the_hook_logs_compile_scalars_and_line_only_with_compile_on() -> None:
    model = tiny_model()
    settings = ProfilerSettings(log_timings=False)  # compile/* are counts, logged anyway
    plain = TrainingProfiler(settings, CPU, model)
    with TrainingProfiler(settings, CPU, model, compiled=True) as profiler:
        _compiled(lambda x: x.exp() - 1)(torch.randn(2))
        plain.step(WindowWork(num_positions=2))
        profiler.step(WindowWork(num_positions=2))
        assert profiler.metrics() == {
            "compile/graphs": 1.0,
            "compile/recompilations": 0.0,
            "compile/graph_breaks": 0.0,
        }
        assert plain.metrics() == {}
    assert "torch.compile: 1 graph (0 after step 1)" in profiler.summary()
    assert "**torch.compile**: 1 graph (0 after step 1)" in profiler.report_markdown()
    assert "torch.compile" not in plain.summary() + plain.report_markdown()
