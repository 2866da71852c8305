"""Helpers for the tests that launch no recipe: a tiny model, hand-made rows, the recipes' loss
step, packed rows under flex attention on the CPU, the 2-rank gloo harness, and the config
files.

Plain functions, imported by name (``from unit_utils import make_rows``), for two reasons: the
rank processes of the 2-rank harness import them as well, and tests/gpu/conftest.py replaces the
module named ``conftest`` while pytest collects that folder, so a test cannot import from
tests/conftest.py. The fixtures built on these (``two_ranks``) are in tests/conftest.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import launcher
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchtune
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torchtune._recipe_registry import get_all_recipes
from torchtune.models.llama3_2 import llama3_2, lora_llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from exactga.accumulation.loss_units import IGNORE_INDEX, shift_labels
from exactga.runtime.document_attention import accept_document_lengths

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"
STOCK_CONFIGS = Path(torchtune.__file__).resolve().parents[1] / "recipes" / "configs"

# --- a tiny model on hand-made rows ------------------------------------------------------------

VOCAB = 64
EXACT_TOL = 1e-6  # relative, fp32


def tiny_model(
    dtype: torch.dtype = torch.float32,
    *,
    num_layers: int = 2,
    embed_dim: int = 32,
    intermediate_dim: int = 64,
    max_seq_len: int = 64,
    seed: int | None = 0,
    **kwargs: Any,
) -> nn.Module:
    """torchtune's llama3_2 at toy size (vocabulary of 64, 2 heads, 1 KV head).

    Its weights are drawn after ``torch.manual_seed(seed)``, so two calls build the same model;
    ``seed=None`` leaves the global generator alone. ``kwargs`` go to the builder.
    """
    if seed is not None:
        torch.manual_seed(seed)
    model = llama3_2(
        vocab_size=VOCAB,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        intermediate_dim=intermediate_dim,
        **kwargs,
    )
    return accept_document_lengths(model.to(dtype))  # packed rows' mask, as a recipe's model


def tiny_lora() -> nn.Module:
    """LoRA on every projection of a toy llama3_2 (tiny_model's shape), base and adapters drawn
    from fixed seeds, only the adapters trainable.

    ``lora_b`` is drawn too (a fresh adapter's is zero, which leaves ``lora_a`` without a
    gradient on the first step and the policy equal to its reference), so every adapter weight
    takes part in the one step a test compares.
    """
    torch.manual_seed(0)
    model = lora_llama3_2(
        lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
        apply_lora_to_mlp=True,
        lora_rank=4,
        lora_alpha=8,
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=32,
        intermediate_dim=64,
        max_seq_len=64,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:
                param.normal_(std=0.05)
    set_trainable_params(model, get_adapter_params(model))
    return accept_document_lengths(model)  # packed rows' mask, as a recipe's model


def make_rows(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Eight (tokens, labels) rows: lengths 3..40, prompts masked or not, one fully masked."""
    gen = torch.Generator().manual_seed(seed)
    specs = [  # (length, number of masked prompt tokens)
        (40, 0),  # first label unmasked, as with train_on_input: True
        (5, 2),
        (23, 20),
        (12, 12),  # every label masked: a zero-token row
        (31, 0),
        (3, 1),
        (17, 4),
        (9, 0),
    ]
    rows = []
    for length, num_masked in specs:
        tokens = torch.randint(1, VOCAB, (length,), generator=gen)
        labels = tokens.clone()
        labels[:num_masked] = IGNORE_INDEX
        rows.append((tokens, labels))
    return rows


def masked(rows: list) -> list:
    """``rows`` with every label masked: rows without a loss token."""
    return [(tokens, torch.full_like(tokens, IGNORE_INDEX)) for tokens, _ in rows]


def prompt_masked_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    """Four right-padded rows of different prompt and answer lengths: most positions unscored
    (one row's prompt starts at 0, one's answer is two tokens)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab_size, (4, 24), generator=generator)
    labels = tokens.clone()
    for row, (prompt, length) in enumerate([(3, 24), (10, 15), (0, 6), (20, 22)]):
        labels[row, :prompt] = IGNORE_INDEX
        labels[row, length:] = IGNORE_INDEX
        tokens[row, length:] = 0
    return {"tokens": tokens, "labels": labels}


def collate(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row, as torchtune's padded_collate_sft does."""
    width = max(len(tokens) for tokens, _ in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (row_tokens, row_labels) in enumerate(rows):
        tokens[i, : len(row_tokens)] = row_tokens
        labels[i, : len(row_labels)] = row_labels
    return {"tokens": tokens, "labels": labels}


def split(rows: list, batch_size: int) -> list[dict[str, torch.Tensor]]:
    return [collate(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


def make_loss(kind: str, model: nn.Module) -> nn.Module:
    """``"chunked"``: torchtune's chunked cross-entropy (and the model set to chunk its output);
    anything else: torch's ``CrossEntropyLoss``."""
    if kind == "chunked":
        loss_fn = CEWithChunkedOutputLoss(num_output_chunks=4)
        model.set_num_output_chunks(4)
        return loss_fn
    return nn.CrossEntropyLoss()


def micro_batch_loss(model: nn.Module, loss_fn: nn.Module, batch: dict) -> torch.Tensor:
    """What the recipes' loss step does: forward, shift, mean loss."""
    logits = model(batch["tokens"])
    labels = shift_labels(batch["labels"], loss_fn.ignore_index)
    if not isinstance(logits, list):
        labels = labels.reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
    return loss_fn(logits, labels)


def reference_window_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The full-batch loss written out: token-loss sum over the window's loss tokens."""
    shifted = labels[..., 1:].reshape(-1)
    logits = logits[..., :-1, :].reshape(-1, logits.size(-1)).float()
    token_losses = nn.functional.cross_entropy(
        logits, shifted, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return token_losses.sum() / (shifted != IGNORE_INDEX).sum()


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])


def full_batch_grad(model: nn.Module, rows: list) -> torch.Tensor:
    """The gradient of the reference loss over all ``rows`` in one batch; leaves no gradient."""
    model.zero_grad(set_to_none=True)
    batch = collate(rows)
    logits = model(batch["tokens"])
    if isinstance(logits, list):
        logits = torch.cat(logits, dim=1)
    reference_window_loss(logits, batch["labels"]).backward()
    grad = flat_grad(model)
    model.zero_grad(set_to_none=True)
    return grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --- packed rows under flex attention, on the CPU ------------------------------------------------


def cpu_document_block_mask(lengths: list[int], block_size: int = 128) -> BlockMask:
    """One packed row's flex-attention ``BlockMask`` as packed rows carry it on CUDA (causal
    within each document of ``lengths``), made on the CPU: torchtune's
    ``packed_block_causal_mask`` makes one only where CUDA runs flex attention. A smaller
    ``block_size`` gives a short row full, partial and skipped blocks."""
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]

    def block_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document[b, q_idx] == document[b, kv_idx])

    size = sum(lengths)
    return create_block_mask(block_causal, 1, None, size, size, device="cpu", BLOCK_SIZE=block_size)


def allow_flex_backward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lift torch 2.13's refusal of flex attention's backward on a CPU (``_validate_device``),
    which it makes for want of a fused CPU kernel: flex attention's unfused implementation, which
    eager runs and ``aot_eager`` traces, has a backward on every device. CUDA's path then runs
    on the CPU up to the kernels."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda query, key, value: None)


def compiled_layers(model: nn.Module, fullgraph: bool, backend: str = "aot_eager") -> nn.Module:
    """``model`` with each layer compiled as torchtune's ``compile_model`` compiles it; by
    default under ``aot_eager``: forward and backward traced as inductor would, without
    generating kernels (seconds, not minutes, on a CPU); ``fullgraph`` fails on any graph
    break."""
    torch._dynamo.reset()
    for layer in model.layers:
        layer.compile(backend=backend, fullgraph=fullgraph)
    return model


def probe_gradients(model: nn.Module, ids, mask, positions) -> tuple[torch.Tensor, dict]:
    """One row's logits and every parameter's gradient of a fixed random weighting of them, on
    the model's device."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, mask=mask, input_pos=positions)
    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    (logits * probe.to(logits.device)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


# --- the 2-rank harness ------------------------------------------------------------------------


def run_on_ranks(
    worker: Callable[..., Any],
    args: tuple,
    out_dir: Path,
    world_size: int = 2,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``worker(rank, *args)`` in ``world_size`` CPU processes joined in one gloo group.

    Returns what each rank's call returned (JSON-serialisable), in rank order; a failure on any
    rank fails the call with that rank's traceback. ``worker`` must be a module-level function
    (the processes import it by name). ``out_dir`` holds the group's rendezvous file and the
    results.

    ``"forkserver"``: the ranks are forked from one server process per test process, which has
    imported torch, torchtune and exactga once and run nothing (tests/launcher.py's, shared with
    the recipe runs), so a rank starts in a fraction of the seconds a ``"spawn"`` takes to
    import them again. A plain
    ``"fork"`` of the test process itself inherits its intra-op threads' state and can hang; a
    worker forked so must set one thread first (tests/test_nonfinite.py's does).
    """
    if start_method == "forkserver":
        launcher.forkserver()  # started once, with what every rank imports
    mp.start_processes(
        _rank_main,
        args=(worker, args, str(out_dir), world_size),
        nprocs=world_size,
        join=True,
        start_method=start_method,
    )
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def _rank_main(rank: int, worker: Callable[..., Any], args: tuple, out_dir: str, world_size: int):
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/init", rank=rank, world_size=world_size
    )
    try:
        result = worker(rank, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# --- config files ------------------------------------------------------------------------------


def tiny_config(name: str, **overrides: object) -> DictConfig:
    """``configs/tiny/<name>.yaml`` with ``overrides`` merged on top (not yet validated)."""
    cfg = OmegaConf.load(CONFIGS / "tiny" / f"{name}.yaml")
    return OmegaConf.merge(cfg, OmegaConf.create(overrides))


def stock_configs(recipe_name: str) -> list[Path]:
    """The config files torchtune 0.6.1's registry lists for its recipe ``recipe_name``."""
    (recipe,) = [r for r in get_all_recipes() if r.name == recipe_name]
    return [STOCK_CONFIGS / config.file_path for config in recipe.configs]


def load_config(name: str) -> DictConfig:
    """``configs/<name>.yaml``; ``name`` has no suffix (``llama3_2/1B_full_single_device``)."""
    cfg = OmegaConf.load(CONFIGS / f"{name}.yaml")
    assert isinstance(cfg, DictConfig)
    return cfg


def config_header(name: str) -> str:
    """The comment block ``configs/<name>.yaml`` opens with (leading '#' lines, blank lines
    allowed)."""
    header = []
    for line in (CONFIGS / f"{name}.yaml").read_text().splitlines():
        if line.startswith("#"):
            header.append(line)
        elif line.strip():
            break
    return "\n".join(header)


# Top-level keys our per-model configs add or change relative to torchtune 0.6.1's stock config.
EXACTGA_KEYS = {"loss_normalization", "drop_partial_window", "micro_batching", "master_weights"}
CHANGED_KEYS = {"output_dir", "metric_logger"}


def assert_matches_stock_config(name: str) -> None:
    """``configs/<name>.yaml`` equals torchtune's stock config of that name, apart from
    ``EXACTGA_KEYS`` (added), ``CHANGED_KEYS`` and the metric logger's component; skips if the
    stock config is not installed."""
    stock_path = STOCK_CONFIGS / f"{name}.yaml"
    if not stock_path.is_file():
        pytest.skip(f"stock torchtune config not installed at {stock_path}")
    ours = OmegaConf.to_container(load_config(name), resolve=False)
    stock = OmegaConf.to_container(OmegaConf.load(stock_path), resolve=False)
    assert set(ours) == set(stock) | EXACTGA_KEYS
    for key in stock:
        if key not in CHANGED_KEYS:
            assert ours[key] == stock[key], key
    ours_logger = {k: v for k, v in ours["metric_logger"].items() if k != "_component_"}
    stock_logger = {k: v for k, v in stock["metric_logger"].items() if k != "_component_"}
    assert ours_logger == stock_logger
