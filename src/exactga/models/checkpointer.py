"""torchtune's Hugging Face checkpointer, for the model families exactga adds as well.

``exactga.models.checkpointer.FullModelHFCheckpointer`` takes the arguments of torchtune's
``torchtune.training.FullModelHFCheckpointer`` and writes the same files in the same folders
(``epoch_N/model-0000k-of-0000n.safetensors`` and the index, ``adapter_model.pt``, the PEFT
``adapter_model.safetensors`` and ``adapter_config.json``, the model folder's other files,
``recipe_state/recipe_state.pt``). For a stock ``model_type`` it *is* torchtune's checkpointer;
for one of :data:`exactga.models.hf_format.FORMATS` (``QWEN3``, ``GEMMA3``, ``QWEN3_MOE``,
``GPT_OSS``) it converts with that family's :class:`~exactga.models.hf_format.HFFormat`, which
torchtune 0.6.1's fixed ``ModelType`` enum cannot name. Its own files are written through a
temporary name and renamed, so an interrupted save leaves the previous file or none, never half
of one.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torchtune import training
from torchtune.models import convert_weights
from torchtune.training import FullModelHFCheckpointer as _TorchtuneHFCheckpointer
from torchtune.training.checkpointing._utils import (
    ADAPTER_CONFIG_FNAME,
    ADAPTER_MODEL_FNAME,
    RECIPE_STATE_DIRNAME,
    SAFETENSOR_INDEX_FNAME,
    SHARD_FNAME,
    SUFFIXES_TO_NOT_COPY,
    TORCH_INDEX_FNAME,
    copy_files,
    safe_torch_load,
)
from torchtune.utils import get_logger

from exactga.models.hf_format import HFFormat, hf_format

log = get_logger("INFO")

# Stands in for an exactga family in torchtune's constructor, which looks the name up in its
# enum; nothing of that type's conversion runs (both conversions are overridden below).
_STAND_IN_MODEL_TYPE = "LLAMA3"


class FullModelHFCheckpointer(_TorchtuneHFCheckpointer):
    """torchtune's ``FullModelHFCheckpointer`` that also reads and writes ``QWEN3``, ``GEMMA3``,
    ``QWEN3_MOE`` and ``GPT_OSS`` checkpoints; see the module docstring. Arguments as
    torchtune's."""

    def __init__(
        self,
        checkpoint_dir: str,
        checkpoint_files: Any,
        model_type: str,
        output_dir: str,
        **kwargs: Any,
    ) -> None:
        self.hf_format: HFFormat | None = hf_format(model_type)
        self.model_type_name = model_type
        stock_type = _STAND_IN_MODEL_TYPE if self.hf_format is not None else model_type
        super().__init__(checkpoint_dir, checkpoint_files, stock_type, output_dir, **kwargs)

    def load_checkpoint(self) -> dict[str, Any]:
        """The weights of every checkpoint file, merged and in torchtune's names, plus the
        adapter and recipe state a resume reads; torchtune's method for a stock type."""
        if self.hf_format is None:
            return super().load_checkpoint()
        merged = self._read_checkpoint_files()
        state: dict[str, Any] = {
            training.MODEL_KEY: self.hf_format.hf_to_tune(merged, self._config)
        }
        if self._adapter_checkpoint:
            state[training.ADAPTER_KEY] = safe_torch_load(self._adapter_checkpoint)
        if self._should_load_recipe_state:
            state.update(safe_torch_load(self._recipe_checkpoint, mmap=False))
        return state

    def save_checkpoint(
        self,
        state_dict: dict[str, Any],
        epoch: int,
        intermediate_checkpoint: bool = False,
        adapter_only: bool = False,
    ) -> None:
        """Write an epoch's files as torchtune's checkpointer does (its method for a stock
        type); ``state_dict`` is torchtune's checkpoint dictionary."""
        if self.hf_format is None:
            super().save_checkpoint(state_dict, epoch, intermediate_checkpoint, adapter_only)
            return
        epoch_dir = self._output_dir / f"epoch_{epoch}"
        epoch_dir.mkdir(parents=True, exist_ok=True)
        saved_config = self.hf_format.saved_config(self._config)  # of what is written
        if not adapter_only:
            self._write_model_shards(state_dict[training.MODEL_KEY], epoch_dir, saved_config)
        if training.ADAPTER_KEY in state_dict:
            self._write_adapter(state_dict[training.ADAPTER_KEY], epoch_dir)
        elif adapter_only:
            raise ValueError(
                "save_checkpoint(adapter_only=True) was handed no adapter weights "
                f"('{training.ADAPTER_KEY}')."
            )
        if training.ADAPTER_CONFIG in state_dict:
            peft_config = self.hf_format.peft_config(
                convert_weights.tune_to_peft_adapter_config(
                    adapter_config=state_dict[training.ADAPTER_CONFIG],
                    base_model_name_or_path=self.repo_id,
                ),
                state_dict.get(training.ADAPTER_KEY, {}),
            )
            path = (epoch_dir / ADAPTER_CONFIG_FNAME).with_suffix(".json")
            _write_atomically(path, lambda tmp: tmp.write_text(json.dumps(peft_config)))
        # The model folder's other files (config.json, tokenizer, ...): the epoch folder is a
        # model folder transformers can load.
        copy_files(self._checkpoint_dir, epoch_dir, ignore_suffixes=SUFFIXES_TO_NOT_COPY)
        if not adapter_only and saved_config != self._config:  # the weights are another model's
            config_path = epoch_dir / "config.json"
            text = json.dumps(saved_config, indent=2)
            _write_atomically(config_path, lambda tmp: tmp.write_text(text))
        if intermediate_checkpoint:
            recipe_state = {
                key: value
                for key, value in state_dict.items()
                if key not in (training.MODEL_KEY, training.ADAPTER_KEY, training.ADAPTER_CONFIG)
            }
            path = self._output_dir / RECIPE_STATE_DIRNAME / "recipe_state.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, lambda tmp: torch.save(recipe_state, tmp))
        log.info(f"{self.model_type_name} checkpoint of epoch {epoch} written to {epoch_dir}")

    def _read_checkpoint_files(self) -> dict[str, torch.Tensor]:
        """Every checkpoint file's tensors in one dictionary; records which file held each
        key (``_weight_map``), so a save splits the weights into files the same way."""
        self._weight_map = {}
        merged: dict[str, torch.Tensor] = {}
        # torchtune sorted the paths: file k of n is the k-th here.
        for index, path in enumerate(self._checkpoint_paths):
            weights = safe_torch_load(path)
            for key, value in weights.items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"checkpoint file {path}: '{key}' is a {type(value).__name__}, not a "
                        "tensor; a Hugging Face weights file holds tensors only."
                    )
                self._weight_map[key] = f"{index + 1:04}"
            merged.update(weights)
            del weights
            gc.collect()  # one file's tensors at a time beside the merged ones
        return merged

    def _write_model_shards(
        self,
        tune_weights: dict[str, torch.Tensor],
        epoch_dir: Path,
        saved_config: dict[str, Any],
    ) -> None:
        """The weights in HF's names, in the files they were read from (or, when the keys are
        not those read, e.g. a multimodal release's text decoder, in files of at most
        ``MAX_SHARD_BYTES``), the index naming the file of each key, and the config of what was
        written."""
        hf_weights = self.hf_format.tune_to_hf(tune_weights, saved_config)
        shard_of = self._shards_as_read(hf_weights) or _shards_by_size(hf_weights)
        suffix = ".safetensors" if self._safe_serialization else ".bin"
        count = f"{len(set(shard_of.values()))}".zfill(5)
        file_of_shard = {
            index: SHARD_FNAME.format(cpt_idx=index.zfill(5), num_shards=count) + suffix
            for index in set(shard_of.values())
        }
        shards: dict[str, dict[str, torch.Tensor]] = {}
        for key, weight in hf_weights.items():
            shards.setdefault(shard_of[key], {})[key] = weight
        for index, weights in shards.items():
            _write_weights(epoch_dir / file_of_shard[index], weights, self._safe_serialization)
        index_name = SAFETENSOR_INDEX_FNAME if self._safe_serialization else TORCH_INDEX_FNAME
        total_size = sum(w.numel() * w.element_size() for w in hf_weights.values())
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": {key: file_of_shard[i] for key, i in shard_of.items()},
        }
        _write_atomically(
            epoch_dir / index_name, lambda tmp: tmp.write_text(json.dumps(index, indent=2))
        )

    def _shards_as_read(self, hf_weights: dict[str, torch.Tensor]) -> dict[str, str] | None:
        """Each key's file as it was read (torchtune's layout), if the keys are those read."""
        if set(hf_weights) != set(self._weight_map):
            return None
        return dict(self._weight_map)

    def _write_adapter(self, adapter: dict[str, torch.Tensor], epoch_dir: Path) -> None:
        """torchtune's adapter file (what a resume reads) and PEFT's (what users load)."""
        torchtune_path = (epoch_dir / ADAPTER_MODEL_FNAME).with_suffix(".pt")
        _write_atomically(torchtune_path, lambda tmp: torch.save(adapter, tmp))
        peft_weights = self.hf_format.adapter_to_peft(adapter, self._config)
        suffix = ".safetensors" if self._safe_serialization else ".bin"
        peft_path = (epoch_dir / ADAPTER_MODEL_FNAME).with_suffix(suffix)
        _write_weights(peft_path, peft_weights, self._safe_serialization)


# The largest file a save writes when it cannot keep the files it read (transformers' default).
MAX_SHARD_BYTES = 5 * 1024**3


def _shards_by_size(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each key's file ("0001", "0002", ...): keys in order, a new file when the current one
    would pass ``MAX_SHARD_BYTES``."""
    shard_of, index, size = {}, 1, 0
    for key, weight in weights.items():
        nbytes = weight.numel() * weight.element_size()
        if size and size + nbytes > MAX_SHARD_BYTES:
            index, size = index + 1, 0
        shard_of[key] = f"{index:04}"
        size += nbytes
    return shard_of


def _write_weights(path: Path, weights: dict[str, torch.Tensor], safetensors: bool) -> None:
    if safetensors:  # torchtune's metadata, which transformers checks for
        _write_atomically(path, lambda tmp: save_file(weights, tmp, metadata={"format": "pt"}))
    else:
        _write_atomically(path, lambda tmp: torch.save(weights, tmp))


def _write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """``write`` to a temporary name beside ``path``, then rename over it: a reader sees the
    old file or the whole new one."""
    staging = path.with_name(f".{path.name}.partial")
    try:
        write(staging)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
