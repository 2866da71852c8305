"""torchtune 0.6.1's stock distributed configs, adapted to run on CPU with tiny local assets.

Shared by tests/test_stock_distributed_configs.py and tools/stock_config_sweep.py; nothing here
is a test, nor imports one. exactga's own distributed configs (``OUR_CONFIGS``, named by their
path from the repository root, ``configs/llama3_1/8B_full``) are adapted the same way. An
adapted config is the shipped YAML with only these sections replaced:

- ``model``: a tiny model of the same family, built with the family's own component builder
  (``torchtune.models.gemma2.lora_gemma2``, ``torchtune.models.qwen2.qwen2``, ...) and every
  argument the stock builder passes it (RoPE base and scaling, norm eps, tied embeddings,
  soft-capping, the config's LoRA keys, ``use_dora``, ``quantize_base`` of ``qlora_*``) except
  the sizes: 2 layers, width 64, vocabulary 2048. Families without a component builder of their
  own use the one their stock builders call (llama3_3 -> llama3_1, phi4 -> phi3,
  qwen2_5 -> qwen2). A sliding window (Gemma 2's, Gemma 3's) is shorter than the sequences, and
  Gemma 3's layer pattern gives the two tiny layers one local and one global.
- ``checkpointer``: ``exactga.models.random_init_checkpointer.initialized_hf_checkpointer`` with the
  stock ``model_type``, which writes seeded random weights of the plain model in that family's
  HF layout on first use (``llama3/8B_full``'s Meta-format checkpointer becomes this HF one
  too).
- ``tokenizer``: configs/tiny/tokenizer.model through ``llama2_tokenizer``, 64 tokens.
- ``dataset``: configs/tiny/data.json through ``alpaca_dataset``; the stock section's other keys
  (``packed``) are kept. GRPO keeps its shipped prompts (the bundled configs/tiny/
  arithmetic_data.json), and its ``ref_checkpointer`` reads the same initial weights; its
  completions are cut to ``MAX_GENERATED_TOKENS``, a size like the others.
- ``device: cpu``, ``output_dir``, ``epochs: 1``, ``max_steps_per_epoch: 2``.

Everything else (dtype, optimizer with ``fused``, compile, activation checkpointing,
``custom_sharded_layers``, ``fsdp_cpu_offload``, clipping, loss, scheduler, profiler, metric
logger, batch size, accumulation) stays as shipped; in our configs also exactga's keys and their
TensorBoard logger.

exactga's Qwen3, Qwen3 MoE, Gemma 3 and gpt-oss configs (tests/test_family_config_sweep.py) are
adapted the same way, on the single-device SFT recipes (``SINGLE_DEVICE_RECIPES``) and GRPO too;
a mixture of experts' tiny layers have 4 experts of width 32, 2 per token; gpt-oss's two tiny
layers are its sliding one and its full one, the window half the sequences.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torchtune
from omegaconf import DictConfig, OmegaConf
from tiny_runs import recipe_script
from torchtune._recipe_registry import get_all_recipes
from torchtune.config._utils import _get_component_from_path

REPO_ROOT = Path(__file__).resolve().parents[1]
STOCK_CONFIGS = Path(torchtune.__file__).resolve().parents[1] / "recipes" / "configs"
RECIPES = ("full_finetune_distributed", "lora_finetune_distributed")
FULL, LORA = RECIPES
# Quantisation-aware training (tests/test_recipe_qat.py, docs/qat.md): its 6 stock configs,
# on models wide enough (``QAT_WIDTH``) that their ``quantizer.groupsize: 256`` divides every
# linear's input width, as on the released models (a width it does not divide would leave a
# full model's linears unquantised and fail a LoRA one's).
QAT_RECIPES = ("qat_distributed", "qat_lora_finetune_distributed")
# exactga's own distributed configs, (recipe, config): configs/<family>/<name>.yaml for models
# of Llama 3.1, 3.2 and Qwen2.5 (tests/test_distributed_model_configs.py keeps the list equal
# to the files).
OUR_CONFIGS = [
    (FULL, "configs/llama3_1/8B_full"),
    (LORA, "configs/llama3_1/8B_lora"),
    (FULL, "configs/llama3_1/70B_full"),
    (LORA, "configs/llama3_1/70B_lora"),
    (FULL, "configs/llama3_2/3B_full"),
    (LORA, "configs/llama3_2/3B_lora"),
    (FULL, "configs/qwen2_5/7B_full"),
    (LORA, "configs/qwen2_5/7B_lora"),
    (FULL, "configs/qwen2_5/32B_full"),  # no stock config of its own: see its header
    (LORA, "configs/qwen2_5/32B_lora"),
]
# Knowledge distillation (tests/test_kd_stock_configs.py): the teacher is adapted as the model
# is, twice as wide, with its own initial checkpoint under output_dir.
KD_RECIPES = ("knowledge_distillation_single_device", "knowledge_distillation_distributed")
# The single-device SFT recipes and GRPO, which only exactga's own configs are adapted for here
# (torchtune 0.6.1's stock configs of them are not swept).
SINGLE_DEVICE_RECIPES = ("full_finetune_single_device", "lora_finetune_single_device")
GRPO = "grpo_full_finetune_distributed"
TOKENIZER = REPO_ROOT / "configs" / "tiny" / "tokenizer.model"
DATA = REPO_ROOT / "configs" / "tiny" / "data.json"
PROMPTS = REPO_ROOT / "configs" / "tiny" / "arithmetic_data.json"  # GRPO's, shipped in its configs
TOKENIZER_MAX_SEQ_LEN = 64
MAX_STEPS_PER_EPOCH = 2
# GRPO's completions at most: a tiny random model rarely samples a stop token, so each of a
# step's completions runs to the limit; 16 tokens keep the KV-cache path and a fourth of the cost.
MAX_GENERATED_TOKENS = 16

# The tiny sizes. NF4 quantises in blocks of 64 values with scalers in blocks of 256, so a
# QLoRA model's quantised weights need multiples of 16384 elements: width 256 there.
WIDTH, QLORA_WIDTH = 64, 256
QAT_WIDTH = 256
NUM_HEADS = 4
TINY_SIZES = {"vocab_size": 2048, "num_layers": 2, "max_seq_len": 2 * TOKENIZER_MAX_SEQ_LEN}
# A mixture of experts' tiny layers: each token through 2 of 4 experts (the released 8 of 128
# would leave most experts without a token in a tiny batch).
TINY_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2}

# Arguments of a LoRA component builder that its plain counterpart does not take.
LORA_KEYS = (
    "lora_attn_modules",
    "apply_lora_to_mlp",
    "apply_lora_to_output",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "use_dora",
    "quantize_base",
)


def stock_config_names(recipe: str) -> list[str]:
    """The stock configs of ``recipe`` in torchtune's registry, vision models left out."""
    (entry,) = [r for r in get_all_recipes() if r.name == recipe]
    return [c.name for c in entry.configs if "vision" not in c.name]


def all_stock_configs(recipes: tuple[str, ...] = RECIPES) -> list[tuple[str, str]]:
    """Every ``(recipe, config name)`` pair of ``recipes`` (both SFT distributed recipes)."""
    return [(recipe, name) for recipe in recipes for name in stock_config_names(recipe)]


def config_path(name: str) -> Path:
    """The YAML file of config ``name``: ours (``configs/...``) in this repository, any other
    one among torchtune's stock configs."""
    if name.startswith("configs/"):
        return REPO_ROOT / f"{name}.yaml"
    return STOCK_CONFIGS / f"{name}.yaml"


def stock_config(name: str) -> DictConfig:
    """Config ``name`` as shipped: torchtune's, or ours for a name in ``configs/``."""
    cfg = OmegaConf.load(config_path(name))
    assert isinstance(cfg, DictConfig)
    return cfg


def data_slice_override(name: str, ranks: int) -> str:
    """The command-line override that trains stock config ``name`` on ``ranks`` ranks on the
    data's first rows: twice what its ``MAX_STEPS_PER_EPOCH`` steps read (batch size x
    accumulation x ranks per step), at least 64. For runs whose claim is that the config runs
    its steps, nothing of the whole set: a multi-rank run's length index (``rank_balancing:
    by_tokens``) then tokenizes these rows, not the whole dataset."""
    cfg = stock_config(name)
    per_step = cfg.batch_size * cfg.get("gradient_accumulation_steps", 1) * ranks
    return f"dataset.split=train[:{max(64, 2 * per_step * MAX_STEPS_PER_EPOCH)}]"


def stock_component_call(model_cfg: DictConfig) -> tuple[str, dict[str, Any]]:
    """The component builder a stock model section ends in, and the arguments it gets.

    The stock builder (``lora_llama3_1_70b``, ``qlora_llama2_7b`` = ``partial(lora_llama2_7b,
    quantize_base=True)``, ...) is called with the section's keys while every component
    builder it can see is replaced by a recorder, so nothing is built.
    """
    kwargs = OmegaConf.to_container(model_cfg, resolve=True)
    assert isinstance(kwargs, dict)
    builder = _get_component_from_path(kwargs.pop("_component_"))
    func = builder.func if isinstance(builder, partial) else builder
    calls: list[tuple[Callable, dict[str, Any]]] = []

    def recorder(component: Callable) -> Callable:
        def record(*args: Any, **kw: Any) -> None:
            bound = inspect.signature(component).bind(*args, **kw)
            calls.append((component, dict(bound.arguments)))

        return record

    recorders = {
        name: recorder(value)
        for name, value in func.__globals__.items()
        if inspect.isfunction(value) and value.__module__.endswith("._component_builders")
    }
    with mock.patch.dict(func.__globals__, recorders):
        builder(**kwargs)
    ((component, arguments),) = calls
    return _public_path(component), arguments


def _public_path(component: Callable) -> str:
    """``torchtune.models.qwen2._component_builders.qwen2`` -> ``torchtune.models.qwen2.qwen2``."""
    package = component.__module__.rsplit(".", 1)[0]
    path = f"{package}.{component.__name__}"
    assert _get_component_from_path(path) is component, path
    return path


def tiny_model(
    stock_model: DictConfig, width: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tiny ``model`` section for ``stock_model`` and its plain base model (the same as the
    model for full fine-tuning; without the LoRA keys for a LoRA builder); ``width`` by
    default ``WIDTH`` (``QLORA_WIDTH`` for QLoRA)."""
    path, arguments = stock_component_call(stock_model)
    if width is None:
        width = QLORA_WIDTH if arguments.get("quantize_base") else WIDTH
    head_dim = width // NUM_HEADS
    stock_heads, stock_kv_heads = arguments["num_heads"], arguments["num_kv_heads"]
    sizes: dict[str, Any] = {
        **TINY_SIZES,
        "embed_dim": width,
        "num_heads": NUM_HEADS,
        # Multi-head, multi-query or grouped-query attention, as the stock model.
        "num_kv_heads": NUM_HEADS if stock_kv_heads == stock_heads else min(stock_kv_heads, 2),
    }
    if arguments.get("intermediate_dim") is not None:
        sizes["intermediate_dim"] = 2 * width
    if "head_dim" in arguments:  # gemma, gemma2
        sizes["head_dim"] = head_dim
    if arguments.get("query_pre_attn_scalar") is not None:  # gemma2 27B: scaled by width / heads
        sizes["query_pre_attn_scalar"] = head_dim
    if "sliding_window_size" in arguments:  # gemma2: a window shorter than the sequences
        sizes["sliding_window_size"] = TOKENIZER_MAX_SEQ_LEN // 2
    if "sliding_window_pattern" in arguments:  # gemma3
        sizes.update(_tiny_gemma3_layers(arguments))
    elif "sliding_window" in arguments:  # gpt_oss: its sliding layers alternate with full ones
        assert arguments.get("layer_types") is None, "a layer_types list would need its own sizing"
        sizes["sliding_window"] = TOKENIZER_MAX_SEQ_LEN // 2
    if "num_experts" in arguments:  # qwen3_moe, gpt_oss: a few narrow experts, top-k of several
        # Qwen3 MoE's experts have a width of their own; gpt-oss's are intermediate_dim wide.
        widths = ("moe_intermediate_dim", "intermediate_dim")
        expert_width = next(key for key in widths if key in arguments)
        sizes.update(TINY_EXPERTS, **{expert_width: width // 2})
    model = {"_component_": path, **arguments, **sizes}

    base_path = path.replace(".lora_", ".")
    base_params = inspect.signature(_get_component_from_path(base_path)).parameters
    base = {k: v for k, v in model.items() if k in base_params and k not in LORA_KEYS}
    return model, {"_component_": base_path, **base}


def _tiny_gemma3_layers(arguments: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's window and layer pattern for the tiny model: a window shorter than the
    sequences, so that it masks something, and a pattern that makes the last of the tiny layers
    the one global layer (layer ``i`` is global iff ``(i + 1) % pattern == 0``), so that both
    kinds run; the released pattern (6) would make 2 layers both local."""
    assert arguments.get("layer_types") is None, "a layer_types list would need its own sizing"
    return {
        "sliding_window": TOKENIZER_MAX_SEQ_LEN // 2,
        "sliding_window_pattern": TINY_SIZES["num_layers"],
    }


def adapted_config(name: str, recipe: str, output_dir: Path | str) -> DictConfig:
    """Stock config ``name`` with tiny model, tokenizer, data and checkpointer, on CPU."""
    assert recipe in RECIPES + SINGLE_DEVICE_RECIPES + KD_RECIPES + QAT_RECIPES + (GRPO,), recipe
    cfg = stock_config(name)
    model, base_model = tiny_model(cfg.model, QAT_WIDTH if recipe in QAT_RECIPES else None)
    is_lora = recipe.startswith(("lora", "knowledge_distillation", "qat_lora"))
    if recipe in KD_RECIPES:
        _adapt_teacher(cfg)
    assert is_lora == any(k in model for k in LORA_KEYS), (name, recipe)

    cfg.output_dir = str(output_dir)
    cfg.device = "cpu"
    cfg.epochs = 1
    cfg.max_steps_per_epoch = MAX_STEPS_PER_EPOCH
    cfg.model = model
    cfg.tokenizer = {
        "_component_": "torchtune.models.llama2.llama2_tokenizer",
        "path": str(TOKENIZER),
        "max_seq_len": TOKENIZER_MAX_SEQ_LEN,
        "prompt_template": None,
    }
    if recipe == GRPO:
        _check_grpo_prompts(cfg, name)
        cfg.max_generated_tokens = min(cfg.max_generated_tokens, MAX_GENERATED_TOKENS)
    else:
        dataset = OmegaConf.to_container(cfg.dataset)
        assert isinstance(dataset, dict), f"{name}: one dataset section expected"
        dataset.update(
            _component_="torchtune.datasets.alpaca_dataset",
            source="json",
            data_files=str(DATA),
            split="train",
        )
        cfg.dataset = dataset
    checkpointer = {
        "_component_": "exactga.models.random_init_checkpointer.initialized_hf_checkpointer",
        # The base model the weights are drawn for: the plain builder for a LoRA model.
        "model": base_model if is_lora else "${model}",
        "init_seed": 0,
        "checkpoint_dir": "${output_dir}/base_model",
        "checkpoint_files": ["model.safetensors"],
        "recipe_checkpoint": None,
        "output_dir": "${output_dir}",
        "model_type": cfg.checkpointer.model_type,
    }
    cfg.checkpointer = checkpointer
    if recipe == GRPO:  # the reference: the same initial weights, read again
        cfg.ref_checkpointer = {**checkpointer, "model_type": cfg.ref_checkpointer.model_type}
    leftover = _paths_outside(cfg, Path(output_dir))
    assert not leftover, f"{name}: paths left outside output_dir: {leftover}"
    return cfg


def _check_grpo_prompts(cfg: DictConfig, name: str) -> None:
    """GRPO's configs read the bundled prompts (nothing to download), so the section stays as
    shipped; only check that it does read them."""
    data_files = OmegaConf.select(cfg, "dataset.data_files")  # ${exactga_file:...}, resolved
    assert data_files == str(PROMPTS), f"{name}: GRPO prompts other than {PROMPTS}: {data_files}"


def _adapt_teacher(cfg: DictConfig) -> None:
    """The stock ``teacher_model`` as a tiny model of its family, twice the student's width,
    and ``teacher_checkpointer`` writing its seeded weights on first use."""
    teacher, _ = tiny_model(cfg.teacher_model)
    width = 2 * WIDTH
    teacher.update(embed_dim=width, intermediate_dim=2 * width)
    if "head_dim" in teacher:
        teacher["head_dim"] = width // NUM_HEADS
    if teacher.get("query_pre_attn_scalar") is not None:  # gemma3: scaled as its head_dim
        teacher["query_pre_attn_scalar"] = width // NUM_HEADS
    cfg.teacher_model = teacher
    cfg.teacher_checkpointer = {
        "_component_": "exactga.models.random_init_checkpointer.initialized_hf_checkpointer",
        "model": "${teacher_model}",
        "init_seed": 1,
        "checkpoint_dir": "${output_dir}/teacher_model",
        "checkpoint_files": ["model.safetensors"],
        "recipe_checkpoint": None,
        "output_dir": "${output_dir}",
        "model_type": cfg.teacher_checkpointer.model_type,
    }


def _paths_outside(cfg: DictConfig, output_dir: Path) -> list[str]:
    """Absolute paths in ``cfg`` that are neither under ``output_dir`` nor tiny assets."""
    allowed = (str(output_dir), str(TOKENIZER), str(DATA), str(PROMPTS))
    found: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)
        elif isinstance(node, str) and node.startswith("/") and not node.startswith(allowed):
            found.append(node)

    visit(OmegaConf.to_container(cfg, resolve=True))
    return found


def launch_args(
    name: str,
    recipe: str,
    output_dir: Path | str,
    nproc_per_node: int = 2,
    sliced: bool = False,
) -> list[str]:
    """``tune run`` arguments for the adapted config, written to ``output_dir/config.yaml``; the
    one-device PPO recipe runs without torchrun. ``sliced`` adds :func:`data_slice_override` for
    the ranks launched, on the command line (the config as written keeps the whole dataset)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config_path = output_dir / "config.yaml"
    if recipe == PPO:
        OmegaConf.save(adapted_ppo_config(name, output_dir), config_path)
        args = [f"recipes/{recipe}.py", "--config", str(config_path)]
        return [*args, data_slice_override(name, 1)] if sliced else args
    OmegaConf.save(adapted_config(name, recipe, output_dir), config_path)
    args = [
        "--nproc_per_node",
        str(nproc_per_node),
        recipe_script(recipe),
        "--config",
        str(config_path),
    ]
    return [*args, data_slice_override(name, nproc_per_node)] if sliced else args


def logged_losses(output_dir: Path | str) -> list[float]:
    """The ``loss`` of every logged step under ``logs``, in step order: from the stock
    ``DiskLogger`` files, or from the TensorBoard events our configs' logger writes."""
    from tiny_runs import logged_steps

    logs = Path(output_dir) / "logs"
    return list(logged_steps(logs).values()) if logs.is_dir() else []


def all_finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def weight_files_not_finite(output_dir: Path | str, cfg: DictConfig) -> list[str]:
    """The weight files among ``expected_artefacts(cfg)`` (safetensors, ``adapter_model.pt``)
    holding a tensor with a value that is not finite: a step that wrote NaN or inf into the
    weights, which the loss of that same step (computed before the update) cannot show."""
    import torch
    from safetensors.torch import load_file

    bad = []
    for name in expected_artefacts(cfg):
        path = Path(output_dir) / name
        if path.suffix == ".safetensors":
            tensors = load_file(str(path))
        elif path.suffix == ".pt":
            tensors = torch.load(path, weights_only=True)
        else:
            continue
        if not all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()):
            bad.append(name)
    return bad


# The PEFT adapter's files, in its own folder (exactga.run.checkpointing, Note [adapter folder]).
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")


def expected_artefacts(cfg: DictConfig) -> list[str]:
    """Files the run must leave in ``checkpointer.output_dir``: merged or full weights, and for
    LoRA the adapters (PEFT's format too, except for Phi, which torchtune saves only in its
    own). PPO saves its value model too, through its own checkpointer (in ``value/``)."""
    files = []
    if "policy_model" in cfg:
        return [
            "epoch_0/model-00001-of-00001.safetensors",
            "value/epoch_0/model-00001-of-00001.safetensors",
        ]
    if not cfg.get("save_adapter_weights_only", False):
        files.append("epoch_0/model-00001-of-00001.safetensors")
    if "lora_rank" in cfg.model:
        files.append("epoch_0/adapter_model.pt")
        if cfg.checkpointer.model_type not in ("PHI3_MINI", "PHI4"):
            files += [f"epoch_0/adapter/{name}" for name in PEFT_FILES]
    return files


_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*)$")


def first_error_line(output: str) -> str:
    """The first exception line a failed launch printed (a rank's, not torchrun's summary)."""
    for line in output.splitlines():
        match = _ERROR_LINE.match(line.strip())
        if match and "ChildFailedError" not in line:
            return match.group(1)[:200]
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


# PPO (tests/test_recipe_ppo.py, docs/ppo.md): its one stock config, on one device.
PPO = "ppo_full_finetune_single_device"
# bitsandbytes' paged optimizers need CUDA (and the package); on CPU the stock optimizer is
# swapped for torch's AdamW with the same settings, the one change besides the tiny shapes.
PPO_CPU_OPTIMIZERS = {"bitsandbytes.optim.PagedAdamW": "torch.optim.AdamW"}


def adapted_ppo_config(name: str, output_dir: Path | str) -> DictConfig:
    """Stock PPO config ``name`` on tiny models, the tiny tokenizer and the bundled prompts,
    on CPU: ``policy_model`` a tiny model of its family; ``reward_and_value_model`` the stock
    classifier builder with tiny sizes; the four checkpointers writing seeded weights on first
    use (the reference reads the policy's, the value model the reward model's, as stock's
    comments ask); ``text_completion_dataset`` over configs/tiny/arithmetic_data.json (column
    ``question``); one trajectory step (``num_steps: batch_size``). Everything else as shipped
    (bf16, ``compile``, ``optimizer_in_bwd``, activation checkpointing, batch sizes, generation,
    penalties, GAE and loss settings), but the optimizer on CPU (``PPO_CPU_OPTIMIZERS``)."""
    cfg = stock_config(name)
    policy, _ = tiny_model(cfg.policy_model)
    classifier = OmegaConf.to_container(cfg.reward_and_value_model)
    classifier.update(
        vocab_size=TINY_SIZES["vocab_size"],
        num_layers=TINY_SIZES["num_layers"],
        max_seq_len=TINY_SIZES["max_seq_len"],
        embed_dim=WIDTH,
        intermediate_dim=2 * WIDTH,
        num_heads=NUM_HEADS,
        num_kv_heads=min(classifier["num_kv_heads"], 2),
    )
    cfg.output_dir = str(output_dir)
    cfg.device = "cpu"
    cfg.num_steps = cfg.batch_size
    cfg.policy_model = policy
    cfg.reward_and_value_model = classifier
    optimizer = cfg.optimizer._component_
    cfg.optimizer._component_ = PPO_CPU_OPTIMIZERS.get(optimizer, optimizer)
    cfg.tokenizer = {
        "_component_": "torchtune.models.llama2.llama2_tokenizer",
        "path": str(TOKENIZER),
        "max_seq_len": TOKENIZER_MAX_SEQ_LEN,
        "prompt_template": None,
    }
    dataset = OmegaConf.to_container(cfg.dataset)
    dataset.update(source="json", data_files=str(PROMPTS), column="question", split="train")
    cfg.dataset = dataset

    def checkpointer(key: str, model: str, folder: str, seed: int) -> dict[str, Any]:
        return {
            "_component_": "exactga.models.random_init_checkpointer.initialized_hf_checkpointer",
            "model": f"${{{model}}}",
            "init_seed": seed,
            "checkpoint_dir": f"${{output_dir}}/{folder}",
            "checkpoint_files": ["model.safetensors"],
            "output_dir": cfg[key].output_dir,
            "model_type": cfg[key].model_type,
        }

    cfg.checkpointer = checkpointer("checkpointer", "policy_model", "base_policy", 0)
    cfg.ref_policy_checkpointer = checkpointer(
        "ref_policy_checkpointer", "policy_model", "base_policy", 0
    )
    for key in ("value_checkpointer", "reward_checkpointer"):
        cfg[key] = checkpointer(key, "reward_and_value_model", "base_reward", 1)
    leftover = _paths_outside(cfg, Path(output_dir))
    assert not leftover, f"{name}: paths left outside output_dir: {leftover}"
    return cfg
