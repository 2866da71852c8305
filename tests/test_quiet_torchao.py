"""torchao's start-up warning about skipped C++ extensions is dropped, and nothing else is.

See ``src/_exactga_quiet_torchao.py``: installed by ``pip install -e .`` as a start-up hook.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch

from _exactga_quiet_torchao import TorchaoExtensionsWarningFilter

SKIPPED = "Skipping import of cpp extensions due to incompatible torch version"


def import_torchao(**env: str) -> str:
    """What a fresh interpreter prints on ``import torchao``."""
    result = subprocess.run(
        [sys.executable, "-c", "import torchao"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout + result.stderr


def test_import_prints_no_extensions_warning_unless_asked():
    assert SKIPPED not in import_torchao()
    # Under the torch release torchao was built for there is nothing to hide; under the
    # default pins (torch 2.13) the switch shows the record, so the hook is what drops it.
    if torch.__version__.startswith("2.13"):
        assert SKIPPED in import_torchao(EXACTGA_SHOW_TORCHAO_WARNING="1")


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("torchao", logging.WARNING, __file__, 1, message, None, None)


def test_filter_drops_only_that_record():
    quiet = TorchaoExtensionsWarningFilter()
    assert not quiet.filter(record(f"{SKIPPED} 2.13.0+cpu for torchao version 0.15.0"))
    assert quiet.filter(record("Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP"))
    assert quiet.filter(record("some other torchao warning"))
