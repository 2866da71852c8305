"""``exactga.runtime.precision``: ``dtype`` and ``master_weights`` in every tensor of a step, on
CPU.

Unit tier (docs/contributing.md point 9a): the library calls the recipes make (cast the trainable
parameters, autocast the forward, shard with a mixed-precision policy, write weights in
``dtype``) on torchtune's tiny Llama, checked tensor by tensor: the dtypes of parameters,
gradients and optimizer state, that the forward really computes in bf16, what is saved, and the
bytes each choice keeps per parameter (docs/precision.md's table). The recipes' numbers are in
tests/test_precision_recipes.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torchtune.models.llama3_2 import lora_llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from unit_utils import VOCAB, collate, make_rows, tiny_model

from exactga.config.schemas import (
    FullFinetuneDistributedConfig,
    FullFinetuneSingleDeviceConfig,
    LoraFinetuneDistributedConfig,
    LoraFinetuneSingleDeviceConfig,
)
from exactga.config.validation import validate_config
from exactga.runtime.precision import MasterWeights, Precision
from exactga.sft.loss import causal_lm_loss

CPU = torch.device("cpu")
BF16 = torch.bfloat16
MASTER = Precision.from_config(BF16, "fp32", CPU)
PURE = Precision.from_config(BF16, "none", CPU)


def _tiny_lora(dtype: torch.dtype = BF16) -> nn.Module:
    torch.manual_seed(0)
    model = lora_llama3_2(
        lora_attn_modules=["q_proj", "v_proj"],
        apply_lora_to_mlp=True,
        lora_rank=4,
        lora_alpha=8,
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=32,
        max_seq_len=64,
        intermediate_dim=64,
    ).to(dtype)
    for module in model.modules():  # lora_b starts at zero: give it a gradient path
        if hasattr(module, "lora_b"):
            nn.init.normal_(module.lora_b.weight, std=0.02)
    set_trainable_params(model, get_adapter_params(model))
    return model


def _step(model: nn.Module, precision: Precision, optimizer: torch.optim.Optimizer) -> None:
    """One forward under the precision, backward, optimizer step (gradients kept)."""
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    batch = collate(make_rows()[:4])
    causal_lm_loss(model, loss_fn, batch, precision=precision).backward()
    optimizer.step()


@pytest.mark.parametrize(
    ("dtype", "master", "param_dtype", "mixed"),
    [
        (BF16, "fp32", torch.float32, True),
        (BF16, "none", BF16, False),
        (torch.float32, "fp32", torch.float32, False),  # at least fp32 already: nothing to do
        (torch.float64, "fp32", torch.float64, False),
        (torch.float32, "none", torch.float32, False),
    ],
)
def test_param_dtype_follows_dtype_and_master_weights(dtype, master, param_dtype, mixed):
    precision = Precision.from_config(dtype, master, CPU)
    assert precision.compute_dtype == dtype
    assert precision.param_dtype == param_dtype
    assert precision.mixed is mixed


def test_a_bad_value_names_the_key():
    with pytest.raises(ValueError, match="config key 'master_weights'='fp16': choose one of fp32"):
        Precision.from_config(BF16, "fp16", CPU)


def test_full_master_weights_keep_params_grads_and_adamw_state_in_fp32_under_bf16_compute():
    model = tiny_model(BF16)
    buffers_before = {name: b.dtype for name, b in model.named_buffers()}
    MASTER.cast_trainable(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {name: b.dtype for name, b in model.named_buffers()} == buffers_before  # untouched

    # The forward computes in bf16: every Linear's output, and the logits.
    outputs: list[torch.dtype] = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, i, out: outputs.append(out.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, MASTER, optimizer)
    assert outputs and set(outputs) == {BF16}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and {t.dtype for t in states} == {torch.float32}
    assert not torch.is_autocast_enabled("cpu")  # left on exit


def test_none_keeps_stock_pure_bf16():
    model = tiny_model(BF16)
    PURE.cast_trainable(model)
    assert {p.dtype for p in model.parameters()} == {BF16}
    assert PURE.mp_policy() is None
    with PURE.autocast():
        assert not torch.is_autocast_enabled("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, PURE, optimizer)
    assert {p.grad.dtype for p in model.parameters()} == {BF16}


def test_lora_master_weights_make_adapters_fp32_over_the_bf16_base():
    model = _tiny_lora()
    adapters = get_adapter_params(model)
    MASTER.cast_trainable(model)
    for name, param in model.named_parameters():
        expected = torch.float32 if name in adapters else BF16
        assert param.dtype == expected, name
    assert all(param is adapters[name] for name, param in get_adapter_params(model).items())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, MASTER, optimizer)
    for name, param in model.named_parameters():
        assert (param.grad is not None) == (name in adapters), name
        if param.grad is not None:
            assert param.grad.dtype == torch.float32, name
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and {t.dtype for t in states} == {torch.float32}


def test_lora_without_autocast_would_fail_on_mixed_dtypes():
    """Why the forward needs the autocast: fp32 adapters meet bf16 activations."""
    model = _tiny_lora()
    MASTER.cast_trainable(model)
    batch = collate(make_rows()[:2])
    batch.pop("labels")
    with pytest.raises(RuntimeError, match="dtype"):
        model(**batch)


def test_weights_for_saving_are_in_dtype_and_the_rest_untouched():
    adapter_config = {"r": 4, "lora_alpha": 8, "peft_type": "LORA"}
    optimizer_state = {"state": {0: {"exp_avg": torch.zeros(3)}}}
    ckpt = {
        "model": {"w": torch.ones(2), "base": torch.ones(2, dtype=BF16)},
        "adapter": {"a": torch.ones(2)},
        "adapter_config": adapter_config,
        "optimizer": optimizer_state,
        "epochs_run": 1,
    }
    saved = MASTER.weights_for_saving(ckpt)
    assert saved["model"]["w"].dtype == BF16 and saved["model"]["base"].dtype == BF16
    assert saved["adapter"]["a"].dtype == BF16
    assert saved["adapter_config"] is adapter_config
    assert saved["optimizer"] is optimizer_state  # resume state keeps fp32
    assert ckpt["model"]["w"].dtype == torch.float32  # the caller's dictionary is unchanged
    assert PURE.weights_for_saving(ckpt)["model"]["w"] is ckpt["model"]["w"]


class _Checkpointer:
    def __init__(self) -> None:
        self.saved: dict | None = None
        self.kwargs: dict | None = None
        self._output_dir = "out"

    def save_checkpoint(self, state_dict, epoch, **kwargs):
        self.saved, self.kwargs = state_dict, {"epoch": epoch, **kwargs}


def test_a_checkpointer_saving_in_dtype_casts_weights_and_passes_the_rest_through():
    inner = _Checkpointer()
    checkpointer = MASTER.saving_in_dtype(inner)
    checkpointer.save_checkpoint({"model": {"w": torch.ones(2)}}, epoch=0, adapter_only=True)
    assert inner.saved["model"]["w"].dtype == BF16
    assert inner.kwargs == {"epoch": 0, "adapter_only": True}
    assert checkpointer._output_dir == "out"
    assert PURE.saving_in_dtype(inner) is inner


def test_mp_policy_gathers_in_bf16_and_reduces_in_fp32():
    policy = MASTER.mp_policy()
    assert policy.param_dtype == BF16 and policy.reduce_dtype == torch.float32


def _fsdp_worker(rank: int, lora: bool) -> dict:
    """Shard a tiny model with fp32 master weights over 2 gloo ranks, step AdamW, and report
    the dtypes FSDP holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtune import training

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    model = _tiny_lora() if lora else tiny_model(BF16)
    MASTER.cast_trainable(model)
    MASTER.shard_model(
        model,
        [training.get_shard_conditions],
        cpu_offload=False,
        dp_mesh=mesh,
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _step(model, MASTER, optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return {
        "trainable": sorted({str(p.to_local().dtype) for p in trainable}),
        "grads": sorted({str(p.grad.to_local().dtype) for p in trainable}),
        "frozen": sorted({str(p.to_local().dtype) for p in frozen}),
        "state": sorted(
            {
                str(t.to_local().dtype)
                for s in optimizer.state.values()
                for t in s.values()
                if hasattr(t, "to_local")  # the moments; "step" is a plain scalar
            }
        ),
        "finite": all(bool(torch.isfinite(p.to_local()).all()) for p in trainable),
    }


def _fsdp_both(rank: int) -> dict:
    return {"full": _fsdp_worker(rank, lora=False), "lora": _fsdp_worker(rank, lora=True)}


def test_fsdp_keeps_fp32_shards_and_fp32_gradients(two_ranks):
    for per_rank in two_ranks(_fsdp_both):  # one process group for both models: ranks are slow
        for kind, result in per_rank.items():
            assert result["trainable"] == ["torch.float32"], kind
            assert result["grads"] == ["torch.float32"], kind
            assert result["frozen"] == (["torch.bfloat16"] if kind == "lora" else []), kind
            assert result["state"] == ["torch.float32"], kind
            assert result["finite"], kind


def _eager_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao compiles its optimizer step on first use (40 s on 2 CPU cores, torchao's own
    business); the same step runs eagerly here, as ``TORCHDYNAMO_DISABLE=1`` does in a launch."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


def _bytes_per_trainable_param(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes kept per trainable parameter after a step (gradients not yet zeroed)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in trainable)
    states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {
        "weights": sum(p.numel() * p.element_size() for p in trainable) / count,
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in trainable) / count,
        "optimizer": sum(t.numel() * t.element_size() for t in states) / count,
    }


# docs/precision.md, "Memory per parameter": bytes per trainable parameter (AdamW).
MEMORY_TABLE = {
    "fp32": (torch.float32, "none", torch.optim.AdamW, {}, (4, 4, 8)),
    "bf16": (BF16, "none", torch.optim.AdamW, {}, (2, 2, 4)),
    "bf16_master": (BF16, "fp32", torch.optim.AdamW, {}, (4, 4, 8)),
    "bf16_sr": (BF16, "none", "torchao", {"bf16_stochastic_round": True}, (2, 2, 4)),
}


@pytest.mark.parametrize("row", list(MEMORY_TABLE))
def test_bytes_per_parameter_match_the_docs_table(row, monkeypatch):
    dtype, master, optimizer_cls, kwargs, expected = MEMORY_TABLE[row]
    if optimizer_cls == "torchao":
        _eager_torchao(monkeypatch)
        from torchao.optim import _AdamW as optimizer_cls
    precision = Precision.from_config(dtype, master, CPU)
    model = tiny_model(dtype)
    precision.cast_trainable(model)
    optimizer = optimizer_cls(model.parameters(), lr=1e-3, **kwargs)
    _step(model, precision, optimizer)
    measured = _bytes_per_trainable_param(model, optimizer)
    assert (measured["weights"], measured["gradients"], measured["optimizer"]) == expected


def test_bf16_stochastic_rounding_keeps_updates_that_pure_bf16_rounds_away(monkeypatch):
    """AdamW steps of 1e-4 on weights of 1: bf16's spacing there is 2^-7, so every plain bf16
    step rounds back to 1; torchao's stochastic rounding lands on the fp32 result on average."""
    from torchao.optim import _AdamW

    _eager_torchao(monkeypatch)
    torch.manual_seed(0)
    steps, lr = 100, 1e-4
    plain = nn.Parameter(torch.ones(4096, dtype=BF16))
    rounded = nn.Parameter(torch.ones(4096, dtype=BF16))
    optimizers = [
        (plain, torch.optim.AdamW([plain], lr=lr, weight_decay=0.0)),
        (rounded, _AdamW([rounded], lr=lr, weight_decay=0.0, bf16_stochastic_round=True)),
    ]
    for _ in range(steps):
        for param, optimizer in optimizers:
            param.grad = torch.ones_like(param)
            optimizer.step()
    exact = 1.0 - steps * lr  # Adam's step is lr when every gradient is the same
    assert float(plain.detach().float().mean()) == 1.0  # the whole 1e-2 lost
    # Each element walks on bf16's grid (std about 6e-3 after 100 steps), its mean over 4096
    # elements to about 1e-4 of the fp32 result; 1e-3 is 10 % of what plain bf16 loses.
    assert abs(float(rounded.detach().float().mean()) - exact) < 1e-3


def _validate(schema: type, path: str, **overrides: object):
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.create(overrides))
    return validate_config(cfg, schema, "recipe")


@pytest.mark.parametrize(
    ("schema", "path", "default"),
    [
        (FullFinetuneSingleDeviceConfig, "configs/tiny/full_single_device.yaml", "none"),
        (FullFinetuneDistributedConfig, "configs/tiny/full_distributed.yaml", "none"),
        (LoraFinetuneSingleDeviceConfig, "configs/tiny/lora_single_device.yaml", "fp32"),
        (LoraFinetuneDistributedConfig, "configs/tiny/lora_distributed.yaml", "fp32"),
    ],
)
def test_defaults_fp32_for_lora_none_for_full(schema, path, default):
    cfg = OmegaConf.load(path)
    cfg.pop("master_weights", None)
    assert validate_config(cfg, schema, "recipe").master_weights == default
    with pytest.raises(ValueError, match="config key 'master_weights'='fp8': choose one of"):
        _validate(schema, path, master_weights="fp8")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3_2/1B_full_single_device", "fp32"),
        ("llama3_2/3B_full_single_device", "fp32"),
        ("qwen2_5/0.5B_full_single_device", "fp32"),
        ("qwen2_5/1.5B_full_single_device", "fp32"),
        ("qwen2_5/7B_full_single_device", "none"),
        ("llama3_1/8B_full_single_device", "none"),
        ("llama3_1/8B_lora_single_device", "fp32"),
        ("llama3_2/1B_qlora_single_device", "fp32"),
    ],
)
def test_shipped_configs_up_to_3b_keep_fp32_master_weights(name, expected):
    assert OmegaConf.load(f"configs/{name}.yaml").master_weights == expected


def test_stochastic_rounding_over_fp32_master_weights_warns_that_it_is_ignored():
    overrides = {
        "dtype": "bf16",
        "optimizer": {"_component_": "torchao.optim._AdamW", "bf16_stochastic_round": True},
    }
    with pytest.warns(UserWarning, match="'optimizer.bf16_stochastic_round' is ignored"):
        _validate(
            LoraFinetuneSingleDeviceConfig, "configs/tiny/lora_single_device.yaml", **overrides
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _validate(
            LoraFinetuneSingleDeviceConfig,
            "configs/tiny/lora_single_device.yaml",
            master_weights=MasterWeights.NONE.value,
            **overrides,
        )
