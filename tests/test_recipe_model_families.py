"""Qwen3, Qwen3 MoE, Gemma 3 and gpt-oss fine-tuned through ``tune run``: exact splits, outputs
transformers and PEFT load as the fine-tuned model (issues #41, #65).

For each family a tiny random model made with transformers' own class (``save_pretrained``; Qwen3
tied as its small releases are, Gemma 3 with a local and a global layer and a window shorter than
the rows, gpt-oss with a sliding and a full layer, a window of 16 on longer rows, its sinks and
biases moved away from transformers' init) is read through exactga's checkpointer (``model_type:
QWEN3`` / ``QWEN3_MOE`` / ``GEMMA3`` / ``GPT_OSS``) and trained with the family's own tokenizer
(tiny files laid out as the release's, tests/tokenizer_files.py; gpt-oss: configs/tiny/'s, its
harmony tokenizer being another change's) on the bundled instruction data (its first 64 rows,
``DATA_ROWS``), full and LoRA, on one device and on 2 gloo ranks, with the loss the families'
configs use (the output projection fused with the loss, docs/large_vocab.md):

- split invariance at the fp32 floor: 2x2 on one device lands where 4x1 does, and so do 2 ranks
  (2x1 and 1x2 per rank): the distributed configs on one rank trained the one-device 4x1's
  weights bit for bit in every family (measured 2026-11-29), so that run is their full batch too
  and no one-rank run of them is made;
- every output folder loads back as the fine-tuned model, within 1e-4 (relative L2 of the logits):
  ``AutoModelForCausalLM.from_pretrained(epoch_0)`` and, for LoRA, ``PeftModel.from_pretrained(
  base, epoch_0/adapter)`` against our builder with the run's weights (gpt-oss's adapters on
  attention, experts and routers alike);
- the router's balance term (Qwen3 MoE, gpt-oss): on, it moves the step, 2 ranks still land where
  1 rank does (gpt-oss: full and LoRA); gpt-oss's sinks train, to the same values in every split;
- compiled (issue #66, under aot_eager): Qwen3's and Gemma 3's full 2x2 where their eager 4x1
  (the full batch) lands, Qwen3 MoE's 2 ranks where 1 rank does with the balance term on, each
  compiled run where its eager twin lands too and with no graph break (the MoE experts' loop
  included), on micro-batches of one shape, as compiled runs are meant to take them (Qwen3's,
  Qwen3 MoE's and Gemma 3's padded to the rows' 256, ``pad_to_multiple_of``): a graph per layer
  kind, no recompilation for a new length (recompiled, dynamic-length graphs:
  tests/test_compile_parity.py's Llama runs).

Runs: two groups (tests/many_runs.py): the one-device runs, and the 2-rank runs, shared
with tests/test_family_config_sweep.py's runs (tests/family_runs.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from family_runs import GROUP, family_runs
from many_runs import Run, run_of
from omegaconf import OmegaConf
from recipe_utils import COMPILE_WITHOUT_INDUCTOR, REPO_ROOT, assert_compiled
from safetensors.torch import load_file
from tiny_runs import recipe_script
from tokenizer_files import write_gemma3_folder, write_qwen3_folder
from torchtune import config, training

from exactga.models.checkpointer import FullModelHFCheckpointer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

# Two steps of 4 sequences: the second starts from the first's weights. Qwen3's vocabulary (about
# 152k) makes each token's loss the cost of these runs, so steps and sequences are few.
STEPS = 2
# Every run reads the data file's first 64 rows (8x the 2 x 4 samples a run trains on): a
# 2-rank run's start-up tokenizes the rows it may deal out (rank_balancing: by_tokens, the
# distributed configs' default): the whole file's 2,069 rows took 1.5-3.5 s of wall with Qwen3's
# tokenizer on a loaded machine, about 1 CPU-s a run; 64 take 0.05 s. Every run the tests compare
# reads the same rows.
DATA_ROWS = 64
PARITY_TOLERANCE = 1e-5  # relative L2 of the weight difference over the update, fp32
LOAD_BOUND = 1e-4  # relative L2 of the logits
MIN_EFFECT = 1e-2  # fine-tuning moves the logits at least this much, relative
LORA = {
    "lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"],
    "apply_lora_to_mlp": True,
    "lora_rank": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
}

# family -> (transformers class and config, our builder's arguments, tokenizer section,
# checkpointer model_type)
QWEN3_VOCAB = 151_936  # the tiny tokenizer keeps Qwen3's special-token ids (151643-151668)
# The Qwen3 models' width: their vocabulary makes the output projection (tokens x vocabulary x
# width, in the fused loss and its backward) and its weight, gathered by FSDP, most of their runs'
# CPU, so they are 32 wide (64 before: the Qwen3 and Qwen3 MoE runs took 1.7-2x the CPU-s); the
# heads keep their head_dim, so it is still not width / heads, as in the releases.
QWEN3_WIDTH = 32
ROW_POSITIONS = 256  # every family's tokenizer cuts rows to 256 tokens
TINY_VOCAB = 2048  # configs/tiny/tokenizer.model's 2000 pieces, rounded up
# gpt-oss's YaRN, rescaled to the tiny rows: positions past the original 64 are interpolated.
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150_000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "hf_class": "Qwen3ForCausalLM",
        "hf_config_class": "Qwen3Config",
        "hf_config": {
            "vocab_size": QWEN3_VOCAB,
            "hidden_size": QWEN3_WIDTH,
            "intermediate_size": 2 * QWEN3_WIDTH,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,  # not hidden / heads, as in the releases
            "max_position_embeddings": 512,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        "builder": "exactga.models.qwen3.qwen3",
        "model": {
            "vocab_size": QWEN3_VOCAB,
            "embed_dim": QWEN3_WIDTH,
            "intermediate_dim": 2 * QWEN3_WIDTH,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 32,
            "max_seq_len": 512,
            "rope_base": 1_000_000.0,
            "norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        "tokenizer": lambda folder: {
            "_component_": "exactga.models.qwen3.qwen3_tokenizer",
            "path": str(folder / "tokenizer.json"),
            "max_seq_len": ROW_POSITIONS,
        },
        "write_tokenizer": write_qwen3_folder,
        "model_type": "QWEN3",
        "pad_to_multiple_of": ROW_POSITIONS,  # one shape, as Gemma 3's (below)
    },
    "qwen3_moe": {
        "hf_class": "Qwen3MoeForCausalLM",
        "hf_config_class": "Qwen3MoeConfig",
        "hf_config": {
            "vocab_size": QWEN3_VOCAB,
            "hidden_size": QWEN3_WIDTH,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
        "builder": "exactga.models.qwen3_moe.qwen3_moe",
        "model": {
            "vocab_size": QWEN3_VOCAB,
            "embed_dim": QWEN3_WIDTH,
            "moe_intermediate_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 16,
            "max_seq_len": 512,
            "rope_base": 1_000_000.0,
            "norm_eps": 1e-6,
        },
        # PEFT cannot hold adapters on transformers' fused experts (docs/moe.md): attention's.
        "lora": {"apply_lora_to_mlp": False},
        "tokenizer": lambda folder: {
            "_component_": "exactga.models.qwen3.qwen3_tokenizer",
            "path": str(folder / "tokenizer.json"),
            "max_seq_len": ROW_POSITIONS,
        },
        "write_tokenizer": write_qwen3_folder,
        "model_type": "QWEN3_MOE",
        "pad_to_multiple_of": ROW_POSITIONS,  # one shape, as Gemma 3's (below)
    },
    "gpt_oss": {
        "hf_class": "GptOssForCausalLM",
        "hf_config_class": "GptOssConfig",
        "hf_config": {
            "vocab_size": TINY_VOCAB,
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,  # layer_types' default: a sliding layer, then a full one
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 16,  # shorter than the rows: the window matters
            "max_position_embeddings": 256,  # YaRN's factor times its original 64
            "rope_parameters": GPT_OSS_YARN,
        },
        "builder": "exactga.models.gpt_oss.gpt_oss",
        "model": {
            "vocab_size": TINY_VOCAB,
            "embed_dim": 64,
            "intermediate_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 16,
            "sliding_window": 16,
            "max_seq_len": 256,
            "rope_scaling_factor": GPT_OSS_YARN["factor"],
            "rope_original_max_seq_len": GPT_OSS_YARN["original_max_position_embeddings"],
        },
        # Adapters on attention, experts and the router too: PEFT holds them all (docs/moe.md).
        "lora": {"apply_lora_to_router": True},
        # transformers' init leaves every bias at zero: moved, so the runs train and save them.
        "perturb": "biases_and_sinks",
        # transformers runs gpt-oss's sinks in its eager attention (sdpa has no sink column).
        "hf_load": {"attn_implementation": "eager"},
        # The harmony tokenizer is another change's: the tiny tokenizer of configs/tiny/.
        "tokenizer": lambda folder: {
            "_component_": "torchtune.models.llama2.llama2_tokenizer",
            "path": str(REPO_ROOT / "configs" / "tiny" / "tokenizer.model"),
            "max_seq_len": ROW_POSITIONS,
            "prompt_template": None,
        },
        "write_tokenizer": lambda folder: folder,
        "model_type": "GPT_OSS",
    },
    "gemma3": {
        "hf_class": "Gemma3ForCausalLM",
        "hf_config_class": "Gemma3TextConfig",
        "hf_config": {
            "vocab_size": 1024,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "sliding_window": 16,  # shorter than the rows: the window matters
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rms_norm_eps": 1e-6,
        },
        "builder": "exactga.models.gemma3.gemma3",
        "model": {
            "vocab_size": 1024,
            "embed_dim": 64,
            "intermediate_dim": 128,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 16,
            "max_seq_len": 512,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 16,
            "rope_base": 1_000_000.0,
            "local_rope_base": 10_000.0,
            "norm_eps": 1e-6,
        },
        "tokenizer": lambda folder: {
            "_component_": "exactga.models.gemma3.gemma3_tokenizer",
            "path": str(folder / "tokenizer.json"),
            "max_seq_len": ROW_POSITIONS,
        },
        "write_tokenizer": write_gemma3_folder,
        "model_type": "GEMMA3",
        # Every micro-batch padded to the rows' 256 positions (padding no loss scores; a split
        # still pads inside its micro-batches): one shape, so the compiled run compiles a graph
        # per layer kind (the window is each layer's constant) and no more, where two lengths made
        # it compile again and then once more with the length dynamic (docs/micro_batching.md,
        # "Compiled": fixed shapes are how to compile). The Qwen3 families' too: most of their
        # rows fill the 256, not all (Qwen3's compiled 2x2 on the 64 rows' samples: 3 graphs, one
        # of them recompiled for a micro-batch of 194).
        "pad_to_multiple_of": ROW_POSITIONS,
    },
}

# kind -> (recipe, tiny config it starts from, trains adapters)
KINDS = {
    "full": ("full_finetune_single_device", "full_single_device", False),
    "full_distributed": ("full_finetune_distributed", "full_distributed", False),
    "lora": ("lora_finetune_single_device", "lora_single_device", True),
    "lora_distributed": ("lora_finetune_distributed", "lora_distributed", True),
}
# (kind, ranks, batch_size, gradient_accumulation_steps): 4 sequences a step in every split; 2x2
# pads inside each micro-batch and accumulates over two.
# The full batch (4x1) is the one-device recipe's: the distributed configs on one rank trained
# the very same weights, bit for bit, in every family, full and LoRA (measured 2026-11-29), their
# keys beyond the one-device configs' (gradient_sync, rank_balancing, FSDP's) acting only between
# ranks; so the 2-rank splits are held to the one-device 4x1 as well.
ONE_PROCESS = [("full", 1, 4, 1), ("full", 1, 2, 2), ("lora", 1, 4, 1), ("lora", 1, 2, 2)]
TWO_RANKS = [("full_distributed", 2, 2, 1), ("lora_distributed", 2, 1, 2)]
# split -> the split it must land on
PARITY = {
    ("full", 1, 2, 2): ("full", 1, 4, 1),
    ("full_distributed", 2, 2, 1): ("full", 1, 4, 1),
    ("lora", 1, 2, 2): ("lora", 1, 4, 1),
    ("lora_distributed", 2, 1, 2): ("lora", 1, 4, 1),
}
OUTPUTS = [("full", 1, 4, 1), ("full_distributed", 2, 2, 1), ("lora", 1, 4, 1)]
OUTPUTS += [("lora_distributed", 2, 1, 2)]


# The router balance term of Qwen3 MoE and gpt-oss (docs/moe.md, [router balance as a loss
# term]): runs with the term on, name -> (family, split, router_balance). global_batch balances
# each micro-batch over every rank, so 2 ranks x 2 samples take the step 1 rank x 4 samples
# takes; micro_batch balances each rank's 2 alone, and 1 x 4 on one device balances 1 at a time.
# One rank is the one-device recipe (as PARITY's full batch), so each run with the term on has an
# LM-only twin of the same config among the family runs.
ROUTER_COEF = 0.05  # large enough that the term's gradient shows above fp32 rounding
ROUTER_RUNS = {
    "global-1rank-4x1": ("qwen3_moe", ("full", 1, 4, 1), "global_batch"),
    "global-2rank-2x1": ("qwen3_moe", ("full_distributed", 2, 2, 1), "global_batch"),
    "micro-2rank-2x1": ("qwen3_moe", ("full_distributed", 2, 2, 1), "micro_batch"),
    "global-1rank-1x4": ("qwen3_moe", ("full", 1, 1, 4), "global_batch"),
    "gpt_oss-global-1rank-4x1": ("gpt_oss", ("full", 1, 4, 1), "global_batch"),
    "gpt_oss-global-2rank-2x1": ("gpt_oss", ("full_distributed", 2, 2, 1), "global_batch"),
    "gpt_oss-lora-global-1rank-4x1": ("gpt_oss", ("lora", 1, 4, 1), "global_batch"),
    "gpt_oss-lora-global-2rank-2x1": ("gpt_oss", ("lora_distributed", 2, 2, 1), "global_batch"),
}
# gpt-oss with the term on: split -> the split it must land on (as PARITY, the term off).
GPT_OSS_ROUTER_PARITY = {
    "gpt_oss-global-2rank-2x1": "gpt_oss-global-1rank-4x1",
    "gpt_oss-lora-global-2rank-2x1": "gpt_oss-lora-global-1rank-4x1",
}

# Compiled (issue #66): splits run again with ``compile=True`` under ``aot_eager`` (dynamo's and
# AOT autograd's graphs without inductor's code generation, recipe_utils.COMPILE_WITHOUT_INDUCTOR),
# among the same runs: Qwen3's and Gemma 3's full 2x2 on one device against their eager 4x1 (the
# full batch), and Qwen3 MoE with the balance term on, 2 ranks x 2 against one device x 4
# (global_batch), eager; each also against its eager twin. tests/test_compile_parity.py: the
# recipes'.
COMPILED_FAMILIES = ("qwen3", "gemma3")
COMPILED_SPLITS = {("full", 1, 2, 2): ("full", 1, 4, 1)}
COMPILED_ROUTER = {"global-2rank-2x1": "global-1rank-4x1"}
COMPILED = "compiled-"  # the folder name's prefix of a compiled run


def _split_id(split: tuple[str, int, int, int]) -> str:
    kind, ranks, bs, ga = split
    return f"{kind}-{ranks}rank-{bs}x{ga}"


def _write_hf_base(family: str, folder: Path) -> Path:
    """A seeded tiny model of ``family`` as transformers writes it."""
    spec = FAMILIES[family]
    torch.manual_seed(0)
    hf_config = getattr(transformers, spec["hf_config_class"])(**spec["hf_config"])
    model = getattr(transformers, spec["hf_class"])(hf_config)
    if spec.get("perturb") == "biases_and_sinks":
        _perturb_biases_and_sinks(model)
    model.save_pretrained(folder)
    return folder


def _perturb_biases_and_sinks(model: torch.nn.Module) -> None:
    """Every bias and sink random (transformers initialises the biases at zero)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                scale = 1.0 if name.endswith("sinks") else 0.1
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator))


def _model_section(family: str, adapters: bool) -> dict[str, Any]:
    spec = FAMILIES[family]
    builder = spec["builder"]
    if adapters:
        module, name = builder.rsplit(".", 1)
        return {
            "_component_": f"{module}.lora_{name}",
            **spec["model"],
            **LORA,
            **spec.get("lora", {}),
        }
    return {"_component_": builder, **spec["model"]}


def _config(family: str, kind: str, base: Path, tokenizer: Path, folder: Path) -> Path:
    """The kind's tiny config with the family's model, tokenizer and checkpointer."""
    _, tiny, adapters = KINDS[kind]
    cfg = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / f"{tiny}.yaml")
    cfg.model = _model_section(family, adapters)
    cfg.tokenizer = FAMILIES[family]["tokenizer"](tokenizer)
    if "pad_to_multiple_of" in FAMILIES[family]:
        cfg.pad_to_multiple_of = FAMILIES[family]["pad_to_multiple_of"]
    # As the shipped configs of these families: the projection computed with the loss.
    cfg.loss = {"_component_": "exactga.accumulation.linear_cross_entropy.LinearCrossEntropyLoss"}
    cfg.checkpointer = {
        "_component_": "exactga.models.checkpointer.FullModelHFCheckpointer",
        "checkpoint_dir": str(base),
        "checkpoint_files": ["model.safetensors"],
        "recipe_checkpoint": None,
        "output_dir": "${output_dir}",
        "model_type": FAMILIES[family]["model_type"],
    }
    path = folder / f"{family}_{kind}.yaml"
    OmegaConf.save(cfg, path)
    return path


def _args(cfg: Path, split: tuple[str, int, int, int], out: Path) -> list[str]:
    kind, ranks, bs, ga = split
    recipe, _, adapters = KINDS[kind]
    head = ["--nproc_per_node", str(ranks)] if ranks > 1 else []
    return [
        *head,
        recipe_script(recipe),
        "--config",
        str(cfg),
        f"output_dir={out}",
        f"batch_size={bs}",
        f"gradient_accumulation_steps={ga}",
        f"max_steps_per_epoch={STEPS}",
        f"dataset.split=train[:{DATA_ROWS}]",
        "clip_grad_norm=null",
        "lr_scheduler.num_warmup_steps=0",
        # Plain gradient descent with steps large enough that the update dwarfs fp32 rounding
        # and the adapters visibly move the logits.
        "optimizer._component_=torch.optim.SGD",
        f"optimizer.lr={0.5 if adapters else 0.2}",
        "~optimizer.weight_decay",
    ]


def planned_runs(root: Path) -> tuple[list[Run], list[Run]]:
    """The one-device runs and the 2-rank runs, for tests/family_runs.py to
    launch (the base models, tokenizers and configs they read are written here)."""
    one, two, configs_of = [], [], {}
    for family in FAMILIES:
        base = _write_hf_base(family, root / family / "hf_base")
        tokenizer = FAMILIES[family]["write_tokenizer"](_mkdir(root / family / "tokenizer"))
        configs = {kind: _config(family, kind, base, tokenizer, root / family) for kind in KINDS}
        configs_of[family] = configs
        for splits, runs in ((ONE_PROCESS, one), (TWO_RANKS, two)):
            for split in splits:
                out = root / family / _split_id(split)
                runs.append(run_of(_args(configs[split[0]], split, out), out)[1])
        if family in COMPILED_FAMILIES:
            for split in COMPILED_SPLITS:
                out = root / family / (COMPILED + _split_id(split))
                one.append(_compiled(run_of(_args(configs[split[0]], split, out), out)[1]))
    for name, (family, split, objective) in ROUTER_RUNS.items():
        router = [f"router_aux_loss_coef={ROUTER_COEF}", f"router_balance={objective}"]
        runs = two if split[1] > 1 else one
        for prefix in ("", COMPILED) if name in COMPILED_ROUTER else ("",):
            out = root / "router" / (prefix + name)
            run = run_of(_args(configs_of[family][split[0]], split, out) + router, out)[1]
            runs.append(_compiled(run) if prefix else run)
    return one, two


def _compiled(run: Run) -> Run:
    """``run`` with ``compile=True``, under aot_eager (set for this run alone: the backend is
    read when the run compiles, so its ranks still fork, tests/launcher.py)."""
    return run._replace(args=[*run.args, "compile=True"], env=COMPILE_WITHOUT_INDUCTOR)


def _mkdir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def runs(run_once):
    """``(family, split) -> output folder``, every run checked to have succeeded."""
    root = family_runs(run_once, "families")

    def get(family: str, split: tuple[str, int, int, int]) -> Path:
        out = root / family / _split_id(split)
        output = (out / "output.txt").read_text()
        assert (out / "returncode").read_text() == "0", output[-4000:]
        return out

    get.root = root
    return get


def _trained(out: Path, adapters: bool) -> dict[str, torch.Tensor]:
    epoch = out / "epoch_0"
    if adapters:
        return torch.load(epoch / "adapter_model.pt", weights_only=True)
    return load_file(epoch / "model-00001-of-00001.safetensors")


def _initial(family: str, root: Path, adapters: bool, like: dict) -> dict[str, torch.Tensor]:
    if adapters:  # LoRA's B starts at zero, A is seeded: the first step's update is B's alone
        return {k: torch.zeros_like(v) if "lora_b" in k else v for k, v in like.items()}
    return load_file(root / family / "hf_base" / "model.safetensors")


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("split", list(PARITY), ids=_split_id)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_split_lands_where_the_full_batch_does(runs, family, split):
    adapters = KINDS[split[0]][2]
    reference = _trained(runs(family, PARITY[split]), adapters)
    got = _trained(runs(family, split), adapters)
    gap = _update_gap(got, reference, _initial(family, runs.root, adapters, reference), adapters)
    print(f"{family} {_split_id(split)}: relative L2 {gap:.3e}")
    assert gap <= PARITY_TOLERANCE


def _tokens(vocab: int) -> torch.Tensor:
    """Two rows of 40 random tokens (longer than gpt-oss's and Gemma 3's windows): Qwen3's
    logits of them are 12M numbers, and their comparisons most of the outputs test's time."""
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 of ``a - b`` over ``b``, summed in float64 (no float64 copy of the logits:
    a difference of fp32 values within a factor 2 of each other is exact in fp32)."""
    diff = torch.linalg.vector_norm(a - b, dtype=torch.float64)
    return (diff / torch.linalg.vector_norm(b, dtype=torch.float64)).item()


@torch.no_grad()
def _our_logits(family: str, root: Path, out: Path, adapters: bool, tokens) -> torch.Tensor:
    """Our builder with the run's weights: the trained files read by our checkpointer (full), or
    the base plus the run's ``adapter_model.pt`` (LoRA)."""
    model = config.instantiate(OmegaConf.create(_model_section(family, adapters)))
    folder = root / family / "hf_base" if adapters else out / "epoch_0"
    files = ["model.safetensors"] if adapters else ["model-00001-of-00001.safetensors"]
    reader = FullModelHFCheckpointer(
        checkpoint_dir=str(folder),
        checkpoint_files=files,
        model_type=FAMILIES[family]["model_type"],
        output_dir=str(out / "reread"),
    )
    state = reader.load_checkpoint()[training.MODEL_KEY]
    if adapters:
        state.update(torch.load(out / "epoch_0" / "adapter_model.pt", weights_only=True))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()(tokens)


@functools.cache
@torch.no_grad()
def _hf_base_logits(family: str, base_folder: Path) -> torch.Tensor:
    """transformers' logits of the family's base model on ``_tokens``: one load per family
    for the four outputs compared with it."""
    load = FAMILIES[family].get("hf_load", {})
    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder, **load).eval()
    return model(_tokens(FAMILIES[family]["hf_config"]["vocab_size"])).logits


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("split", OUTPUTS, ids=_split_id)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_outputs_load_in_transformers_and_peft_as_the_fine_tuned_model(runs, family, split):
    out = runs(family, split)
    adapters = KINDS[split[0]][2]
    tokens = _tokens(FAMILIES[family]["hf_config"]["vocab_size"])
    base_folder = runs.root / family / "hf_base"
    tuned = _our_logits(family, runs.root, out, adapters, tokens)
    auto = transformers.AutoModelForCausalLM
    load = FAMILIES[family].get("hf_load", {})
    base = _hf_base_logits(family, base_folder)
    with torch.no_grad():
        merged = auto.from_pretrained(out / "epoch_0", **load).eval()(tokens).logits
    gaps = {"from_pretrained(epoch_0)": _rel(merged, tuned)}
    if adapters:
        with_adapter = peft.PeftModel.from_pretrained(
            auto.from_pretrained(base_folder, **load), out / "epoch_0" / "adapter"
        ).eval()
        with torch.no_grad():
            gaps["PeftModel(base, epoch_0/adapter)"] = _rel(with_adapter(tokens).logits, tuned)
    effect = _rel(tuned, base)
    print(f"{family} {_split_id(split)}: moved {effect:.2e}; gaps {gaps}")
    assert effect >= MIN_EFFECT
    for way, gap in gaps.items():
        assert gap <= LOAD_BOUND, (way, gap)


def _router_run(runs, name: str) -> Path:
    out = runs.root / "router" / name
    assert (out / "returncode").read_text() == "0", (out / "output.txt").read_text()[-4000:]
    return out


def _weights_gap(runs, got: str, reference: str) -> float:
    """Relative L2 of two router runs' trained weights (LoRA: the adapters' ``lora_b``, the
    first step's update), over the reference's update; a name may be a compiled run's."""
    family, (kind, *_), _ = ROUTER_RUNS[reference.removeprefix(COMPILED)]
    adapters = KINDS[kind][2]
    ref = _trained(_router_run(runs, reference), adapters)
    new = _trained(_router_run(runs, got), adapters)
    return _update_gap(new, ref, _initial(family, runs.root, adapters, ref), adapters)


def _update_gap(got: dict, reference: dict, initial: dict, adapters: bool, keys=None) -> float:
    """Relative L2 of ``got - reference`` over ``reference - initial``, on ``keys`` (default
    every key, LoRA's ``lora_b`` only)."""
    if keys is None:
        keys = sorted(k for k in reference if not adapters or "lora_b" in k)
    diff = torch.cat([(got[k] - reference[k]).flatten().double() for k in keys]).norm()
    update = torch.cat([(reference[k] - initial[k]).flatten().double() for k in keys]).norm()
    assert update > 0, keys
    return (diff / update).item()


@pytest.mark.xdist_group(GROUP)
def test_global_batch_balance_takes_the_same_step_on_two_ranks_as_on_one(runs):
    gap = _weights_gap(runs, "global-2rank-2x1", "global-1rank-4x1")
    print(f"router global_batch: 2 ranks x 2 vs 1 rank x 4: relative L2 {gap:.3e}")
    assert gap <= PARITY_TOLERANCE


@pytest.mark.xdist_group(GROUP)
def test_the_balance_term_moves_the_step_and_its_objectives_differ_where_documented(runs):
    """The term is on (without it one device's 4x1 is the LM-only run of the family tests), and the
    objectives that balance other tokens take measurably other steps."""
    lm_only = runs("qwen3_moe", ("full", 1, 4, 1))
    ref = _trained(_router_run(runs, "global-1rank-4x1"), adapters=False)
    plain = _trained(lm_only, adapters=False)
    moved = max((ref[k] - plain[k]).abs().max().item() for k in ref if ".mlp.gate." in k)
    assert moved > 0, "the balance term changed no router weight"
    for other in ("micro-2rank-2x1", "global-1rank-1x4"):
        gap = _weights_gap(runs, other, "global-1rank-4x1")
        print(f"router {other} vs global-1rank-4x1: relative L2 {gap:.3e}")
        assert gap > 10 * PARITY_TOLERANCE, other


@pytest.mark.xdist_group(GROUP)
def test_expert_load_metrics_are_logged(runs):
    from recipe_utils import read_scalars

    scalars = read_scalars(_router_run(runs, "global-2rank-2x1") / "logs")
    for layer in range(2):
        ratios = scalars[f"router/load_ratio/layer_{layer}"]
        assert len(ratios) == STEPS and all(1.0 <= r <= 8 / 2 for r in ratios)
        entropies = scalars[f"router/entropy/layer_{layer}"]
        assert all(0.0 < e <= torch.log(torch.tensor(8.0)).item() + 1e-6 for e in entropies)
    balance = scalars["router/balance_loss"]
    assert len(balance) == STEPS and all(b > 0 for b in balance)


# --- gpt-oss: its sinks, and exact splits with the balance term on ----------------------------


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("split", [s for s in PARITY if not KINDS[s[0]][2]], ids=_split_id)
def test_gpt_oss_sinks_train_and_their_step_is_split_invariant(runs, split):
    """Full fine-tuning moves every layer's sinks (plain SGD: the step is the gradient, so the
    gradient is non-zero) to the same place under any split."""
    reference = _trained(runs("gpt_oss", PARITY[split]), adapters=False)
    got = _trained(runs("gpt_oss", split), adapters=False)
    initial = _initial("gpt_oss", runs.root, False, reference)
    sinks = sorted(k for k in reference if k.endswith(".sinks"))
    assert len(sinks) == FAMILIES["gpt_oss"]["hf_config"]["num_hidden_layers"]
    for key in sinks:
        assert (reference[key] - initial[key]).abs().min() > 0, f"a head's sink did not move: {key}"
    gap = _update_gap(got, reference, initial, adapters=False, keys=sinks)
    print(f"gpt_oss sinks {_split_id(split)}: relative L2 {gap:.3e}")
    assert gap <= PARITY_TOLERANCE


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("split", list(GPT_OSS_ROUTER_PARITY))
def test_gpt_oss_splits_land_together_with_the_balance_term_on(runs, split):
    reference = GPT_OSS_ROUTER_PARITY[split]
    gap = _weights_gap(runs, split, reference)
    family, (kind, *_), _ = ROUTER_RUNS[reference]
    plain = _trained(runs(family, ROUTER_RUNS[reference][1]), KINDS[kind][2])
    term = _trained(_router_run(runs, reference), KINDS[kind][2])
    moved = max((term[k] - plain[k]).abs().max().item() for k in term)
    print(f"router {split} vs {reference}: relative L2 {gap:.3e}; the term moved {moved:.2e}")
    assert moved > 0, "the balance term changed nothing"
    assert gap <= PARITY_TOLERANCE


@pytest.mark.xdist_group(GROUP)
def test_gpt_oss_lora_trains_the_expert_and_router_adapters(runs):
    adapter = _trained(runs("gpt_oss", ("lora", 1, 4, 1)), adapters=True)
    for part in (".mlp.experts.w1.", ".mlp.experts.w2.", ".mlp.experts.w3.", ".mlp.router.gate."):
        trained = [v for k, v in adapter.items() if part in k and "lora_b" in k]
        assert len(trained) == 2 and all(v.abs().max() > 0 for v in trained), part


# --- compiled: the same splits under compile: True (issue #66) --------------------------------


def _compiled_output(out: Path) -> Path:
    """A compiled run's folder, after checking it succeeded, compiled, and broke no graph."""
    output = (out / "output.txt").read_text()
    assert (out / "returncode").read_text() == "0", output[-4000:]
    print(f"{out.parent.name}/{out.name}: {assert_compiled(output)}")
    return out


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("split", list(COMPILED_SPLITS), ids=_split_id)
@pytest.mark.parametrize("family", COMPILED_FAMILIES)
def test_compiled_split_lands_where_the_full_batch_does(runs, family, split):
    """And where its eager twin lands."""
    compiled = _compiled_output(runs.root / family / (COMPILED + _split_id(split)))
    initial = _initial(family, runs.root, False, None)
    trained = _trained(compiled, adapters=False)
    gaps = {}
    for against, of in (("full batch", COMPILED_SPLITS[split]), ("eager twin", split)):
        eager = _trained(runs(family, of), adapters=False)
        gaps[f"{against} {_split_id(of)}"] = _update_gap(trained, eager, initial, False)
    print(f"{family} compiled {_split_id(split)}: relative L2 {_shown(gaps)}")
    assert max(gaps.values()) <= PARITY_TOLERANCE, gaps


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("split", list(COMPILED_ROUTER))
def test_compiled_moe_splits_land_together_with_the_balance_term_on(runs, split):
    """Qwen3 MoE, router term on: 2 ranks compiled where 1 rank lands, and where its eager twin
    does."""
    _compiled_output(runs.root / "router" / (COMPILED + split))
    gaps = {
        f"1 rank {COMPILED_ROUTER[split]}": _weights_gap(
            runs, COMPILED + split, COMPILED_ROUTER[split]
        ),
        f"eager twin {split}": _weights_gap(runs, COMPILED + split, split),
    }
    print(f"router compiled {split}: relative L2 {_shown(gaps)}")
    assert max(gaps.values()) <= PARITY_TOLERANCE, gaps


def _shown(gaps: dict[str, float]) -> str:
    return ", ".join(f"{against} {gap:.3e}" for against, gap in gaps.items())
