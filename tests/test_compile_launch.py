"""``compile: True`` through ``tune run``: packed rows compile in step 1 only, the compilations are
reported, and the compiled run trains the eager run's weights.

Two runs, one after another (tests/many_runs.py), the tiny model under ``micro_batching: packed``,
rows of one shape, 3 steps: eager, then compiled with inductor (compiling on 2 CPU cores is slow:
most of the run is step 1's compilation). Every graph is compiled in step 1:
``compile/graphs`` read from TensorBoard stays where step 1 left it, and the end-of-run line says
so; its graph breaks are per-document attention's alone, left out of the graph by design
([packed rows under compile] in exactga.runtime.document_attention). In-process tests of the
meter: tests/test_compilations.py; of each family's compiled packed row:
tests/test_document_attention.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from many_runs import Run, launch_runs
from recipe_utils import (
    INITIAL,
    RECIPE,
    TRAINED,
    compile_line,
    load_weights,
    read_scalars,
    tiny_args,
)

from exactga.parity.scoring import relative_l2

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile_launch")]

STEPS = 3
ROW = 512  # packed's positions per row: the tiny model's max_seq_len
DISABLED_FUNCTION = '"Skip calling `torch.compiler.disable()`d function"'  # dynamo's reason
# Inductor's kernels against eager's, fp32, 3 steps: measured 9.5e-7 with
# ``pytest tests/test_compile_launch.py -p no:xdist -rP`` (fused kernels sum in another order; a
# wrong mask or a lost loss term moves the weights by O(1)).
BOUND = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """``{"eager": folder, "compiled": folder}``: the two runs, one after another."""
    root = tmp_path_factory.mktemp("compile_launch")
    folders = {name: root / name for name in ("eager", "compiled")}
    planned = [
        Run(RECIPE, _args(folder, compile=name == "compiled")[1:], folder)
        for name, folder in folders.items()
    ]
    launch_runs(planned, nproc=0, timeout_per_run=600)
    for folder in folders.values():
        status = (folder / "returncode").read_text().strip()
        assert status == "0", (folder / "output.txt").read_text()[-4000:]
    return folders


def _args(folder: Path, compile: bool) -> list[str]:
    return tiny_args(
        folder / "out",
        compile=compile,
        micro_batching="packed",
        micro_batch_tokens=ROW,
        max_steps_per_epoch=STEPS,
    )


def test_packed_rows_compile_in_step_1_and_break_only_around_attention(
    runs: dict[str, Path],
) -> None:
    text = (runs["compiled"] / "output.txt").read_text()
    scalars = read_scalars(runs["compiled"] / "out" / "logs")
    graphs = scalars["compile/graphs"]
    recompilations = scalars["compile/recompilations"]
    assert len(graphs) == STEPS
    assert graphs[0] > 0  # each layer's graph, and the loss's
    assert graphs[1] == graphs[0] and graphs[2] == graphs[0]  # one shape: nothing new
    assert recompilations[1] == recompilations[0] == recompilations[2]
    breaks = scalars["compile/graph_breaks"]
    assert breaks[0] > 0 and breaks[1] == breaks[0] and breaks[2] == breaks[0]
    line = compile_line(text)
    assert (line.graphs, line.graph_breaks) == (graphs[-1], breaks[-1]), line.text
    assert f"{line.graphs} graphs (0 after step 1)" in line.text
    # Every break is the per-document function's, which dynamo skips.
    per_document = f"({DISABLED_FUNCTION} x{line.graph_breaks})"
    assert f"{line.graph_breaks} graph breaks {per_document}" in line.text, line.text


def test_the_compiled_run_trains_the_eager_runs_weights(runs: dict[str, Path]) -> None:
    eager, compiled = (load_weights(runs[name] / "out" / TRAINED) for name in runs)
    initial = load_weights(runs["eager"] / "out" / INITIAL)
    distance = relative_l2(compiled, eager, initial)
    print(f"compiled (inductor) against eager, packed rows: relative L2 {distance:.2e}")
    assert distance < BOUND
