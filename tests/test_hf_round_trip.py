"""Outputs load right in the clients users load them with: transformers and PEFT (issue #23).

A tiny Llama made with transformers (``save_pretrained``) is fine-tuned through ``tune run`` with
torchtune's ``FullModelHFCheckpointer``: full (one device and 2 ranks), LoRA (one device and 2
ranks) and distillation (one device, and the distributed recipe on one rank). The epoch folder
is then loaded back three ways, and every way must give the fine-tuned model, within 1e-4
(relative L2 of the logits over 8 samples):

- ``AutoModelForCausalLM.from_pretrained(epoch_0)``: the merged (or fully trained) weights;
- ``PeftModel.from_pretrained(base, epoch_0/adapter)``: the base plus the adapter, once;
- torchtune's model built from the config, loaded from the same files (base and
  ``adapter_model.pt`` for LoRA, the epoch's safetensors for the full fine-tune).

The adapter is trained until it moves the logits by over 1% of their norm, so an adapter applied
twice (what transformers did with stock's layout) is a hundred times the bound. Runs: three groups
(the one-process runs, the 2-rank runs, and the epoch resume; tests/many_runs.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from many_runs import Run, launch_runs, run_of
from omegaconf import OmegaConf
from recipe_utils import (
    REPO_ROOT,
    SMALL_MODEL,
    load_adapters,
    lora_tiny_args,
    output_of,
    read_scalars,
    run_recipe,
)
from tiny_runs import recipe_script
from torchtune import config, training
from torchtune.training import FullModelHFCheckpointer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

BOUND = 1e-4  # relative L2 of the logits, fp32
DATA_ROWS = 64  # the runs' data: see _args
MIN_ADAPTER_EFFECT = 1e-2  # the tuned logits' distance from the base's, relative
VOCAB = 2048
HF_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": SMALL_MODEL["model.embed_dim"],
    "intermediate_size": SMALL_MODEL["model.intermediate_dim"],
    "num_hidden_layers": SMALL_MODEL["model.num_layers"],
    "num_attention_heads": SMALL_MODEL["model.num_heads"],
    "num_key_value_heads": SMALL_MODEL["model.num_kv_heads"],
    "head_dim": SMALL_MODEL["model.embed_dim"] // SMALL_MODEL["model.num_heads"],
    "max_position_embeddings": 131072,  # Llama 3.2's
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    # torchtune's llama3_2 builder: Llama 3.1 RoPE scaling, tied output projection.
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
}

# (recipe, config, nproc, trains adapters)
RUNS = {
    "full_single_device": ("full_finetune_single_device", "full_single_device", 1, False),
    "full_2_ranks": ("full_finetune_distributed", "full_distributed", 2, False),
    "lora_single_device": ("lora_finetune_single_device", "lora_single_device", 1, True),
    "lora_2_ranks": ("lora_finetune_distributed", "lora_distributed", 2, True),
    "kd_single_device": ("knowledge_distillation_single_device", "kd_single_device", 1, True),
    "kd_distributed_1_rank": ("knowledge_distillation_distributed", "kd_distributed", 1, True),
}
SMALL_TEACHER = [
    "teacher_model.num_layers=2",
    "teacher_model.embed_dim=128",
    "teacher_model.num_heads=4",
    "teacher_model.num_kv_heads=2",
    "teacher_model.intermediate_dim=256",
]


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A tiny Llama folder as transformers writes it (config.json, model.safetensors)."""
    return make_hf_base(tmp_path_factory.mktemp("hf_base"))


def make_hf_base(folder: Path) -> Path:
    """Write a seeded tiny Llama into ``folder`` with transformers' ``save_pretrained``."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG))
    model.save_pretrained(folder)
    return folder


def _hf_config(name: str, base: Path, folder: Path) -> Path:
    """The recipe's tiny config with torchtune's HF checkpointer reading ``base`` (the CLI
    cannot remove the tiny configs' ``checkpointer.model`` component, so a file is written)."""
    cfg = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / f"{RUNS[name][1]}.yaml")
    cfg.checkpointer = {
        "_component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpoint_dir": str(base),
        "checkpoint_files": ["model.safetensors"],
        "recipe_checkpoint": None,
        "output_dir": "${output_dir}",
        "model_type": "LLAMA3_2",
    }
    path = folder / f"{name}.yaml"
    OmegaConf.save(cfg, path)
    return path


def _args(name: str, base: Path, out: Path) -> list[str]:
    recipe, _, nproc, adapters = RUNS[name]
    head = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    out.mkdir(parents=True, exist_ok=True)
    args = [
        *head,
        recipe_script(recipe),
        "--config",
        str(_hf_config(name, base, out.parent)),
        *(f"{key}={value}" for key, value in SMALL_MODEL.items()),
        f"output_dir={out}",
        "max_steps_per_epoch=2",
        # The data's first 64 rows, four times the 16 samples a run reads (2 steps of 8 in
        # every config): a torchrun launch's length index (``rank_balancing: by_tokens``)
        # tokenizes 64 rows, not 2,069; the claims are of the saved files, not of the data.
        f"dataset.split=train[:{DATA_ROWS}]",
        # Large enough steps that the adapter visibly moves the logits; see the docstring.
        f"optimizer.lr={0.02 if adapters else 1e-3}",
        "lr_scheduler.num_warmup_steps=0",
    ]
    if recipe.startswith("knowledge"):
        args += SMALL_TEACHER
    return args


# Runs beside RUNS, among the same runs: (name, the tune run args of a folder).
EXTRA_RUNS = {
    "adapter_only": lambda base, out: (
        _args("lora_single_device", base, out) + ["save_adapter_weights_only=True"]
    ),
    # Two epochs with no step checkpoints: the epoch-resume test goes on from its epoch 0.
    "two_epochs": lambda base, out: lora_tiny_args(out, **TWO_EPOCHS),
}
TWO_EPOCHS = {"epochs": 2, "max_steps_per_epoch": 2, "save_every_n_steps": "null"}


@pytest.fixture(scope="module")
def runs(hf_base, tmp_path_factory) -> dict[str, Path]:
    """Every recipe fine-tuned from the same transformers folder, and EXTRA_RUNS: the one-process
    runs one after another, the 2-rank ones one after another, each run forked from the tests'
    server (tests/many_runs.py: still the recipe as ``tune run`` starts it). Every run must
    succeed."""
    root = tmp_path_factory.mktemp("hf_round_trip")
    planned = {name: _args(name, hf_base, root / name) for name in RUNS}
    planned |= {name: make(hf_base, root / name) for name, make in EXTRA_RUNS.items()}
    by_ranks: dict[int, list[Run]] = {}
    for name, args in planned.items():
        nproc, run = run_of(args, root / name)
        by_ranks.setdefault(nproc, []).append(run)
    for nproc, group in by_ranks.items():
        launch_runs(group, nproc=nproc)
    for name in planned:
        output = (root / name / "output.txt").read_text()
        assert (root / name / "returncode").read_text() == "0", f"{name}:\n{output[-4000:]}"
    return {name: root / name for name in planned}


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 2000, (8, 48), generator=generator)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def _hf_logits(model) -> torch.Tensor:
    return model.eval()(_tokens()).logits


@torch.no_grad()
def _torchtune_logits(name: str, base: Path, out: Path) -> torch.Tensor:
    return _torchtune_model(name, base, out).eval()(_tokens())


def _torchtune_model(name: str, base: Path, out: Path) -> torch.nn.Module:
    """torchtune's model of the run's config, from the same files the run wrote or read."""
    _, cfg_name, _, adapters = RUNS[name]
    cfg = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / f"{cfg_name}.yaml")
    for key, value in SMALL_MODEL.items():
        OmegaConf.update(cfg, key, value)
    model = config.instantiate(cfg.model)
    if adapters:
        reader = FullModelHFCheckpointer(
            checkpoint_dir=str(base),
            checkpoint_files=["model.safetensors"],
            model_type="LLAMA3_2",
            output_dir=str(out / "reread"),
        )
        state = reader.load_checkpoint()[training.MODEL_KEY]
        state.update(torch.load(out / "epoch_0" / "adapter_model.pt", weights_only=True))
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not missing, (missing, unexpected)
    else:
        reader = FullModelHFCheckpointer(
            checkpoint_dir=str(out / "epoch_0"),
            checkpoint_files=["model-00001-of-00001.safetensors"],
            model_type="LLAMA3_2",
            output_dir=str(out / "reread"),
        )
        model.load_state_dict(reader.load_checkpoint()[training.MODEL_KEY])
    return model


@pytest.mark.xdist_group("hf_round_trip")
@pytest.mark.parametrize("name", list(RUNS))
def test_every_way_of_loading_gives_the_fine_tuned_model(runs, hf_base, name):
    out = runs[name]
    epoch = out / "epoch_0"
    tuned = _torchtune_logits(name, hf_base, out)
    base = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(hf_base))
    effect = _rel(tuned, base)
    merged = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(epoch))
    gaps = {"from_pretrained(epoch_0)": _rel(merged, tuned)}
    if RUNS[name][3]:
        adapter = epoch / "adapter"
        assert not (epoch / "adapter_config.json").exists()  # would be applied on top
        adapter_config = json.loads((adapter / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == str(hf_base.resolve())
        with_adapter = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(hf_base), adapter
        )
        gaps["PeftModel(base, epoch_0/adapter)"] = _rel(_hf_logits(with_adapter), tuned)
    print(f"{name}: fine-tuning moved the logits by {effect:.2e}; gaps {gaps}")
    assert effect >= MIN_ADAPTER_EFFECT
    for way, gap in gaps.items():
        assert gap <= BOUND, (way, gap)


@pytest.mark.xdist_group("hf_round_trip")
def test_the_layout_is_what_keeps_the_adapter_from_applying_twice(runs, tmp_path):
    """The check above can fail: put the adapter back beside the merged weights (stock's
    layout) and transformers no longer gives the fine-tuned model. With a PEFT that its
    integration supports, it attaches the adapter on top of the merged weights (issue #23
    measured 11%); with the PEFT that torchao 0.15 allows here (0.18), it fails to load."""
    stock_layout = tmp_path / "epoch_0"
    shutil.copytree(runs["lora_single_device"] / "epoch_0", stock_layout)
    for path in (stock_layout / "adapter").iterdir():
        shutil.copy(path, stock_layout / path.name)
    ours = _hf_logits(
        transformers.AutoModelForCausalLM.from_pretrained(runs["lora_single_device"] / "epoch_0")
    )
    try:
        stock = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(stock_layout))
    except (ImportError, ValueError) as failure:
        print(f"stock layout: from_pretrained(epoch_0) fails: {failure!r}")
        return
    gap = _rel(stock, ours)
    print(f"stock layout: from_pretrained(epoch_0) is {gap:.2e} from the fine-tuned model")
    assert gap > 100 * BOUND


@pytest.mark.xdist_group("hf_round_trip")
def test_adapter_only_writes_the_adapter_alone(runs, hf_base):
    """``save_adapter_weights_only: True`` writes no merged weights; the adapter still loads
    into the base with PEFT (its config names the base folder)."""
    out = runs["adapter_only"]
    epoch = out / "epoch_0"
    assert not list(epoch.glob("model*.safetensors"))
    assert sorted(p.name for p in (epoch / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    tuned = _torchtune_logits("lora_single_device", hf_base, out)
    base_name = json.loads((epoch / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ]
    with_adapter = peft.AutoPeftModelForCausalLM.from_pretrained(epoch / "adapter")
    assert base_name == str(hf_base.resolve())
    assert _rel(_hf_logits(with_adapter), tuned) <= BOUND


@pytest.mark.xdist_group("hf_round_trip")
def test_epoch_resume_finds_the_adapter_where_torchtune_looks(runs, tmp_path):
    """torchtune's epoch resume (no step checkpoints) still reads ``epoch_N/adapter_model.pt``:
    a LoRA run stopped after its first of two epochs goes on with the second only and ends on
    the uninterrupted run's adapters, each epoch's PEFT adapter in its own folder."""
    uninterrupted, stopped = runs["two_epochs"], tmp_path / "stopped"
    shutil.copytree(uninterrupted, stopped)
    settings = TWO_EPOCHS
    # As if the run had stopped after epoch 0: its epoch-1 outputs and logs are gone.
    shutil.rmtree(stopped / "epoch_1")
    shutil.rmtree(stopped / "logs")
    proc = run_recipe([*lora_tiny_args(stopped, **settings), "resume_from_checkpoint=True"])
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert len(read_scalars(stopped / "logs")["loss"]) == 2  # epoch 1's steps, not 4
    for epoch in ("epoch_0", "epoch_1"):
        assert (stopped / epoch / "adapter" / "adapter_config.json").is_file()
    resumed = load_adapters(stopped / "epoch_1" / "adapter_model.pt")
    expected = load_adapters(uninterrupted / "epoch_1" / "adapter_model.pt")
    assert resumed.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(resumed[key], tensor), key
