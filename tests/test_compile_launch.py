"""``compile: True`` through ``tune run``: the compilations are bounded, and reported.

One launch (compiling on 2 CPU cores is slow: about 75 s of wall time, most of it step 1's
compilation): the tiny model under ``micro_batching: packed``, rows of one shape, 3 steps. Every
graph is compiled in step 1: ``compile/graphs`` read from TensorBoard stays where step 1 left it,
and the end-of-run line says so. In-process tests of the meter: tests/test_compilations.py.
"""

from __future__ import annotations

import re

import pytest
from recipe_utils import output_of, read_scalars, run_tune, tiny_args

pytestmark = pytest.mark.slow

STEPS = 3
ROW = 512  # packed's positions per row: the tiny model's max_seq_len


def test_packed_rows_compile_in_step_1_only(tmp_path):
    out = tmp_path / "out"
    args = tiny_args(
        out,
        compile=True,
        micro_batching="packed",
        micro_batch_tokens=ROW,
        max_steps_per_epoch=STEPS,
    )
    proc = run_tune(args, timeout=600)
    text = output_of(proc)
    assert proc.returncode == 0, text[-4000:]
    scalars = read_scalars(out / "logs")
    graphs = scalars["compile/graphs"]
    recompilations = scalars["compile/recompilations"]
    assert len(graphs) == STEPS
    assert graphs[0] > 0  # each layer's graphs, and the loss's
    assert graphs[1] == graphs[0] and graphs[2] == graphs[0]  # one shape: nothing new
    assert recompilations[1] == recompilations[0] == recompilations[2]
    line = re.search(r"exactga: torch\.compile: .*", text)
    assert line, text[-4000:]
    assert f"{int(graphs[-1])} graphs (0 after step 1)" in line.group()
    assert "recompilations (0 after step 1)" in line.group() or (
        "recompilation (0 after step 1)" in line.group()
    )
