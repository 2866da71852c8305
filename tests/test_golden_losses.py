"""Golden loss curves (docs/contributing.md point 9c): every training recipe's tiny config, 8
steps, against the per-step losses recorded in tests/assets/losses/<name>.json: full and LoRA
fine-tuning and knowledge distillation, each on one device and on 2 ranks.

The runs are those of tests/assets/losses/regenerate.py (imported from there, so the two cannot
drift): the shipped tiny config with the small model, its fixed seed, 8 optimizer steps, the
distributed recipes on 2 gloo ranks. They are made once per session by one module fixture, in two
groups side by side: the one-device runs one after another, the 2-rank runs one after another
(tests/many_runs.py: each a run as ``tune run`` starts it, its ranks forked from a server that
imported torch and torchtune once). A change that is meant to move the losses regenerates the files
with that script and shows the new curves.

Tolerance: relative 1e-6 per step (``pytest.approx(rel=1e-6, abs=0)``). On one machine the
losses repeat bit for bit, and ``regenerate.py --check`` shows that; the tolerance is for other
CPUs. Forcing other kernels on the machine that made the files (``ATEN_CPU_CAPABILITY=avx2`` or
``default``, MKL and oneDNN held to AVX2 or SSE4, or two threads per process instead of one)
moved the 8 losses by at most 1.3e-7 relative (9.5e-7 absolute, about 2 float32 ulps at a loss of
7.5), so 1e-6 leaves a margin of 8. The distillation curves, made on an AVX2 machine, moved as
little under ``ATEN_CPU_CAPABILITY=default``: 9.5e-7 (one device) and 2.8e-7 (2 ranks) absolute.
The smallest deliberate change tried stays well outside it: a learning rate 0.1 % higher moved
the full fine-tuning curve by 2e-5 relative by step 8, another seed the LoRA curves by 1e-4 to
1e-3. (The first two losses are those of the initial weights, since warm-up gives the first step
a learning rate of 0; for LoRA and distillation, whose B starts at zero, they are the base
model's whatever the seed.)
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from many_runs import Run, launch_runs, run_of
from recipe_utils import REPO_ROOT

# The group keeps these tests on one xdist worker (tests/conftest.py makes groups work under
# pytest 9.2); the file lock in ``run_once`` is what launches the runs once in any case.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("golden_losses")]

RTOL = 1e-6
_spec = importlib.util.spec_from_file_location(
    "regenerate_losses", REPO_ROOT / "tests/assets/losses/regenerate.py"
)
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def _launch_all(root: Path) -> None:
    """Every run of regenerate.py, with its arguments, grouped by number of ranks."""
    by_ranks: dict[int, list[Run]] = {}
    for name in golden.RUNS:
        nproc, run = run_of(golden.launch_args(name, root / name), root / name)
        by_ranks.setdefault(nproc, []).append(run)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(launch_runs, runs, nproc) for nproc, runs in by_ranks.items()]
        for future in futures:
            future.result()


@pytest.fixture(scope="module")
def runs(run_once) -> Path:
    """The runs' folders, made once per session whichever worker asks."""
    return run_once("golden_losses", _launch_all)


@pytest.mark.parametrize("name", list(golden.RUNS))
def test_losses_match_the_golden_curve(runs, name):
    recorded = golden.recorded(name)
    settings = golden.run_settings(name)
    assert {key: recorded[key] for key in settings} == settings, (
        f"tests/assets/losses/{name}.json was made with other run settings: run "
        "tests/assets/losses/regenerate.py"
    )
    out = runs / name
    output = (out / "output.txt").read_text()
    assert (out / "returncode").read_text() == "0", f"{name}:\n{output[-4000:]}"
    losses = golden.read_losses(out / "logs")
    assert losses == pytest.approx(recorded["loss"], rel=RTOL, abs=0), (
        f"{name}: the losses moved from tests/assets/losses/{name}.json (made with "
        f"{recorded['made_with']}). If that is intended, run tests/assets/losses/regenerate.py "
        "and show the new curve.\n"
        + "\n".join(
            f"step {step}: {new!r} recorded {old!r} ({(new - old) / old:+.2e})"
            for step, (new, old) in enumerate(zip(losses, recorded["loss"], strict=True), 1)
        )
    )
