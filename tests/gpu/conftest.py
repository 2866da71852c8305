"""GPU tests: every test in this folder is skipped unless a CUDA device is available.

They carry the ``gpu`` marker (pyproject.toml), so ``pytest -m gpu tests/gpu`` selects them and
``make test`` on a CPU machine collects them and reports them as skipped. ``make gpu-check``
(tools/gpu_check.py) runs them and writes docs/gpu_report.md.

``EXACTGA_GPU_DRY_RUN=1`` runs them on the CPU instead (``cuda_runs.DEVICE``): a rehearsal that
finds a broken launch, key or import before a GPU machine's minutes are spent on it. A test of
CUDA itself (peak GPU memory, NCCL, kernels) marked ``cuda_runs.cuda_only`` skips there; round
two's modules mark none, and their CUDA assertions fail there, as a rehearsal expects.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

# The shared launch helpers live one folder up (tests/recipe_utils.py); pytest puts only this
# folder on sys.path for the modules here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import recipe_utils  # noqa: E402
from cuda_runs import DRY_RUN  # noqa: E402

if not recipe_utils.TUNE.exists() and shutil.which("tune"):
    # An install without a virtual environment (tools/gpu_check.py --no-venv: packages under
    # PYTHONPATH) puts the ``tune`` script on PATH, not next to the interpreter.
    recipe_utils.TUNE = Path(shutil.which("tune"))

CUDA_AVAILABLE = torch.cuda.is_available()
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's tests without CUDA. A skip marker acts before any fixture is set up,
    so the module fixtures that launch runs never start on a CPU machine."""
    if CUDA_AVAILABLE or DRY_RUN:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)
