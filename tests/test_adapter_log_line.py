"""The PEFT adapter's save line names the folder it ends in, ``epoch_N/adapter/`` (issue #62):
torchtune logs ``epoch_N/adapter_model.safetensors``, which then moves (see [adapter folder])."""

from __future__ import annotations

import logging
from pathlib import Path

from torchtune.utils import get_logger

from exactga.lora.adapters import _adapter_logged_where_it_ends


def test_torchtunes_adapter_line_names_the_adapter_folder(caplog):
    logger = get_logger("INFO")
    epoch_dir = Path("/runs/out/epoch_0")
    with caplog.at_level(logging.INFO, logger=logger.name):
        with _adapter_logged_where_it_ends(epoch_dir):
            logger.info(
                "Adapter checkpoint of size 0.01 GiB saved to "
                f"{epoch_dir}/adapter_model.safetensors"
            )
            logger.info(
                f"Adapter checkpoint of size 0.00 GiB saved to {epoch_dir}/adapter_config.json"
            )
        logger.info(f"saved to {epoch_dir}/adapter_model.safetensors")  # after: left alone
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0].endswith("/runs/out/epoch_0/adapter/adapter_model.safetensors")
    assert lines[1].endswith("/runs/out/epoch_0/adapter/adapter_config.json")
    assert lines[2].endswith("/runs/out/epoch_0/adapter_model.safetensors")
