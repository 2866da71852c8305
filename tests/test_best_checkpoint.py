"""keep_best_checkpoint's folder (see [the best checkpoint] in exactga.run.steps): the files of
an epoch folder, through the run's own checkpointer, with the step and figure beside them;
replaced whole; loadable by transformers as the epoch folder is. In-process and small: a tiny
Llama made with transformers' own class. (Resume keeps the best: tests/test_steps.py,
tests/test_progress.py and the LoRA scenario of tests/test_resume.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchtune import training

from exactga.checkpoints.contents import BEST_RECORD, BEST_SUBDIR, RunCheckpoints
from exactga.run.progress import TrainingProgress
from exactga.runtime.precision import _SavesInDtype

transformers = pytest.importorskip("transformers")

HF_CONFIG = {
    "vocab_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "head_dim": 8,
    "tie_word_embeddings": False,
}
WEIGHTS = "model-00001-of-00001.safetensors"


class Weights:
    """Stands in for the trained model: what a checkpoint reads of it."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state


class SameDtype:
    """A ``Precision`` whose weights for saving are the weights (the wrapper is the point)."""

    def weights_for_saving(self, state_dict):
        return state_dict


def _run(tmp_path: Path) -> tuple[RunCheckpoints, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).save_pretrained(
        tmp_path / "hf"
    )
    writer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(tmp_path / "hf"),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA3_2",
        output_dir=str(tmp_path / "out"),
    )
    state = writer.load_checkpoint()[training.MODEL_KEY]
    progress = TrainingProgress(seed=0, total_epochs=1, max_steps_per_epoch=None)
    checkpoints = RunCheckpoints(
        progress, None, {}, torch.device("cpu"), epoch_writer=_SavesInDtype(writer, SameDtype())
    )
    return checkpoints, state


def test_the_best_folder_is_an_epoch_folder_with_its_step_and_figure(tmp_path) -> None:
    checkpoints, state = _run(tmp_path)
    out = tmp_path / "out"
    checkpoints.save_epoch(Weights(state), None, 0)  # the run's last epoch: weights only
    best = checkpoints.save_best(Weights(state), 4, "val/loss", 2.5)
    assert best == out / BEST_SUBDIR
    epoch_files = {p.name for p in (out / "epoch_0").iterdir()}
    assert {p.name for p in best.iterdir()} == epoch_files | {BEST_RECORD}
    assert json.loads((best / BEST_RECORD).read_text())["step"] == 4
    ours, epochs = load_file(best / WEIGHTS), load_file(out / "epoch_0" / WEIGHTS)
    assert ours.keys() == epochs.keys() and all(torch.equal(ours[k], epochs[k]) for k in ours)
    assert transformers.AutoModelForCausalLM.from_pretrained(best) is not None
    assert not (out / "recipe_state").exists()  # no resume state: weights for users


def test_a_new_best_replaces_the_folder_whole(tmp_path) -> None:
    checkpoints, state = _run(tmp_path)
    checkpoints.save_best(Weights(state), 4, "val/loss", 2.5)
    later = {key: value + 1 for key, value in state.items()}
    best = checkpoints.save_best(Weights(later), 8, "val/loss", 2.0)
    assert json.loads((best / BEST_RECORD).read_text()) == {
        "step": 8,
        "epoch": 0,
        "val/loss": 2.0,
    }
    saved = load_file(best / WEIGHTS)
    hf_names = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).state_dict()
    assert saved.keys() == hf_names.keys()  # Hugging Face's names, as in an epoch folder
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(best).state_dict()
    assert torch.equal(reloaded["lm_head.weight"], state["output.weight"] + 1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [BEST_SUBDIR]  # no leftover
