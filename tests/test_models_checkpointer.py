"""exactga's Hugging Face checkpointer (exactga.models.checkpointer): a family torchtune 0.6.1
cannot name (QWEN3) read from and written to sharded safetensors with their index, as
transformers writes and reads them; stock types left to torchtune; a config naming torchtune's
checkpointer for such a type is one message; an interrupted write leaves no half file.

In-process and small: a tiny Qwen3 made with transformers' own class, saved in two shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import training

from exactga.config.validation import EXACTGA_MODEL_TYPES, check_input_files
from exactga.models import checkpointer as checkpointer_module
from exactga.models.checkpointer import FullModelHFCheckpointer
from exactga.models.hf_format import FORMATS
from exactga.models.qwen3 import qwen3

transformers = pytest.importorskip("transformers")

SIZES = {
    "vocab_size": 96,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 32,
    "intermediate_dim": 64,
    "max_seq_len": 64,
    "head_dim": 8,
    "tie_word_embeddings": False,
}
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
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def sharded_qwen3(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A random Qwen3 saved by transformers in two safetensors shards with their index."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**HF_CONFIG)).eval()
    folder = tmp_path / "hf"
    model.save_pretrained(folder, max_shard_size="40KB")
    assert len(list(folder.glob("model-*.safetensors"))) >= 2  # the test is about shards
    return folder, model


def _checkpointer(folder: Path, output_dir: Path) -> FullModelHFCheckpointer:
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    return FullModelHFCheckpointer(
        checkpoint_dir=str(folder),
        checkpoint_files=shards,
        model_type="QWEN3",
        output_dir=str(output_dir),
    )


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def test_shards_load_into_the_builder_and_save_back_for_transformers(sharded_qwen3, tmp_path):
    folder, hf_model = sharded_qwen3
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    ckpt = _checkpointer(folder, tmp_path / "out")

    ours = qwen3(**SIZES).eval()
    ours.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY], strict=True)
    assert _rel(_logits(ours, tokens), _logits(hf_model, tokens)) < 1e-5

    ckpt.save_checkpoint({training.MODEL_KEY: ours.state_dict()}, epoch=0)
    epoch = tmp_path / "out" / "epoch_0"
    index = json.loads((epoch / "model.safetensors.index.json").read_text())
    written = {p.name for p in epoch.glob("model-*.safetensors")}
    assert set(index["weight_map"].values()) == written  # every key's file exists
    assert len(written) == len(list(folder.glob("model-*.safetensors")))  # as many as read
    assert not list(epoch.glob(".*partial"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(epoch).eval()
    assert _rel(_logits(reloaded, tokens), _logits(hf_model, tokens)) < 1e-6


def test_a_stock_model_type_is_torchtunes_checkpointer(tmp_path):
    torch.manual_seed(0)
    config = {**HF_CONFIG, "head_dim": 8}
    config.pop("rope_theta")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    llama.save_pretrained(tmp_path / "hf")
    kwargs = {
        "checkpoint_dir": str(tmp_path / "hf"),
        "checkpoint_files": ["model.safetensors"],
        "model_type": "LLAMA3_2",
        "output_dir": str(tmp_path / "out"),
    }
    ours = FullModelHFCheckpointer(**kwargs)
    stock = training.FullModelHFCheckpointer(**kwargs)
    assert ours.hf_format is None
    a, b = ours.load_checkpoint()[training.MODEL_KEY], stock.load_checkpoint()[training.MODEL_KEY]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_types_the_config_check_knows_are_the_formats_there_are():
    assert set(EXACTGA_MODEL_TYPES) == set(FORMATS)


def test_torchtunes_checkpointer_with_a_family_it_lacks_is_one_message(sharded_qwen3, tmp_path):
    folder, _ = sharded_qwen3
    cfg = OmegaConf.create(
        {
            "dataset": {"_component_": "torchtune.datasets.alpaca_dataset"},
            "checkpointer": {
                "_component_": "torchtune.training.FullModelHFCheckpointer",
                "checkpoint_dir": str(folder),
                "checkpoint_files": ["model-00001-of-00002.safetensors"],
                "model_type": "QWEN3",
                "output_dir": str(tmp_path / "out"),
            },
        }
    )
    with pytest.raises(ValueError, match="checkpointer.model_type") as err:
        check_input_files(cfg)
    assert "exactga.models.checkpointer.FullModelHFCheckpointer" in str(err.value)


def test_an_interrupted_save_leaves_the_previous_file_and_no_partial_one(
    sharded_qwen3, tmp_path, monkeypatch
):
    folder, _ = sharded_qwen3
    ckpt = _checkpointer(folder, tmp_path / "out")
    weights = ckpt.load_checkpoint()[training.MODEL_KEY]
    ckpt.save_checkpoint({training.MODEL_KEY: weights}, epoch=0)
    epoch = tmp_path / "out" / "epoch_0"
    before = {p.name: p.read_bytes() for p in epoch.glob("model-*.safetensors")}

    def dies_half_way(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(checkpointer_module, "save_file", dies_half_way)
    changed = {k: v + 1 for k, v in weights.items()}
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint({training.MODEL_KEY: changed}, epoch=0)
    assert {p.name: p.read_bytes() for p in epoch.glob("model-*.safetensors")} == before
    assert not [p for p in epoch.iterdir() if p.name.startswith(".")]


GEMMA3_TEXT = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 8,
}
TINY_VISION = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}


def test_a_multimodal_gemma3_release_saves_its_text_decoder_for_transformers(tmp_path):
    """Gemma 3 4B and up ship as ``Gemma3ForConditionalGeneration``: the text decoder is read
    out of it, trained, and written as a ``Gemma3ForCausalLM`` folder (its config, its keys,
    in files of its own) that transformers loads as the same decoder."""
    from exactga.models.gemma3 import gemma3

    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=GEMMA3_TEXT, vision_config=TINY_VISION, mm_tokens_per_image=4
    )
    multimodal = transformers.Gemma3ForConditionalGeneration(config).eval()
    multimodal.save_pretrained(tmp_path / "hf")
    ckpt = FullModelHFCheckpointer(
        checkpoint_dir=str(tmp_path / "hf"),
        checkpoint_files=["model.safetensors"],
        model_type="GEMMA3",
        output_dir=str(tmp_path / "out"),
    )
    ours = gemma3(
        vocab_size=128,
        num_layers=2,
        num_heads=4,
        head_dim=8,
        num_kv_heads=2,
        embed_dim=32,
        intermediate_dim=64,
        max_seq_len=64,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=8,
    ).eval()
    ours.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY], strict=True)
    tokens = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = multimodal(input_ids=tokens).logits
    assert _rel(_logits(ours, tokens), expected) < 1e-5

    ckpt.save_checkpoint({training.MODEL_KEY: ours.state_dict()}, epoch=0)
    epoch = tmp_path / "out" / "epoch_0"
    saved = json.loads((epoch / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForCausalLM"]
    index = json.loads((epoch / "model.safetensors.index.json").read_text())
    assert not [k for k in index["weight_map"] if "vision" in k or "language_model" in k]
    text_only = transformers.AutoModelForCausalLM.from_pretrained(epoch).eval()
    assert type(text_only).__name__ == "Gemma3ForCausalLM"
    assert _rel(_logits(text_only, tokens), expected) < 1e-5
