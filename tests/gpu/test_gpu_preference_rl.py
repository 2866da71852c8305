"""DPO, GRPO and packed rows on CUDA in bf16 over fp32 master weights, through ``tune run``.

- The three DPO recipes finish with finite losses and finite DPO metrics; the distributed two run
  under torchrun with one process and the NCCL backend, and LoRA DPO on that one rank trains the
  pairs of the single-device recipe, step by step, to bf16 rounding.
- GRPO on one rank finishes with finite losses; its generation and training speeds are logged
  apart, and the library's generation path decodes one token per forward from a bf16 KV cache.
- Packed rows (``micro_batching: packed``, flex attention's block mask on CUDA) against
  ``token_budget`` on the same windows of the same checkpoint: the same loss tokens, weights
  within the bf16 floor measured on this run (see [bf16 floor of a regrouped run]).

Every launch sets ``master_weights: fp32`` (a key of every recipe's schema; the LoRA recipes'
default, not the full ones').
"""

from __future__ import annotations

import math
import statistics

import pytest
from cuda_runs import (
    BF16_CURVE_RTOL,
    DEVICE,
    FULL_SINGLE,
    INITIAL,
    Launch,
    Run,
    all_finite,
    cuda_only,
    launch_all,
    max_relative_difference,
)
from recipe_utils import REPO_ROOT, load_weights, relative_l2

from exactga.parity.scoring import PRECISION_FLOOR_FACTOR

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu_preference_rl")]

LORA_DPO_SINGLE = ("recipes/lora_dpo.py", "configs/tiny/lora_dpo_single_device.yaml")
LORA_DPO_DISTRIBUTED = (
    "recipes/lora_dpo.py",
    "configs/tiny/lora_dpo_distributed.yaml",
)
FULL_DPO_DISTRIBUTED = (
    "recipes/full_dpo_distributed.py",
    "configs/tiny/full_dpo_distributed.yaml",
)
GRPO = ("recipes/grpo_full_finetune_distributed.py", "configs/tiny/grpo_distributed.yaml")

BF16_MASTER = {"dtype": "bf16", "master_weights": "fp32", "log_peak_memory_stats": True}
NCCL_LOG = {"NCCL_DEBUG": "INFO"}

DPO_STEPS = 6
# The same split for the three DPO recipes (their configs ship 4x2 and 2x2): 2 pairs x 2
# micro-batches per step on one rank.
DPO_LAUNCH = {
    **BF16_MASTER,
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_steps_per_epoch": DPO_STEPS,
}
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")

# GRPO counts rollout steps (num_steps), each ppo_epochs (1) optimizer steps.
GRPO_STEPS = 4
GRPO_LAUNCH = {**BF16_MASTER, "num_steps": GRPO_STEPS}

# Packed rows against token_budget: the same 16-sample windows (the same seed and shuffle) cut
# two ways into micro-batches of at most 512 positions. save_every_n_steps keeps the weights as
# the run holds them (fp32 master weights): the epoch's files are rounded to bf16 for users, and
# after four warm-up steps that rounding is a sizeable part of the update (in the CPU rehearsal
# it put packed 1.8e-2 from token_budget instead of 4.5e-3).
PACKED_STEPS = 4
PACK = {
    "batch_size": 4,
    "gradient_accumulation_steps": 4,
    "micro_batch_tokens": 512,
    "max_steps_per_epoch": PACKED_STEPS,
    "save_every_n_steps": PACKED_STEPS,
    "saved_latency_every_n_steps": 0,  # no timed gradient pass between the runs' steps
}
STEP_WEIGHTS = f"step_checkpoints/step_{PACKED_STEPS:06d}/model.safetensors"

# [bf16 floor of a regrouped run]
# Packed rows and token_budget micro-batches train the same step (see [packed rows are exact] in
# exactga.data.packing and [regrouping is exact] in exactga.data.micro_batching): in fp32 they
# land at summation order (1e-6 over a few steps). In bf16 each run carries its own rounding,
# in every matrix product and in the attention kernels (flex attention on a packed row, SDPA on
# a padded batch), and its size depends on the optimizer, learning rate and length (1.6e-3 with
# SGD to 1.4e-2 with AdamW on the tiny config, docs/precision.md). So the floor is measured on
# this run, as the GA parity report measures it (see [parity floor below fp32] in
# exactga.parity.scoring): d, token_budget bf16's relative L2 to token_budget fp32 from the same
# fp32 weights, and the floor 2 d: two independent roundings of one trajectory, each about d from
# fp32, land about sqrt(2) d apart (the CPU rehearsal: 4.5e-3 apart with d = 1.4e-2, 0.33 d).
# The floor catches a fault larger than bf16's rounding (a row attending across its documents:
# 0.13 of a one-step update in the fp32 oracle checks of docs/micro_batching.md); a smaller one
# may hide under it, which the CPU oracle tests are for. A row that kept its samples' first
# labels scores one more token a sample: the loss tokens, compared exactly, show it.


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    launches = {
        "lora_dpo_single_device": Launch(LORA_DPO_SINGLE, DPO_LAUNCH),
        "lora_dpo_distributed": Launch(LORA_DPO_DISTRIBUTED, DPO_LAUNCH, nproc=1, env=NCCL_LOG),
        "full_dpo_distributed": Launch(FULL_DPO_DISTRIBUTED, DPO_LAUNCH, nproc=1, env=NCCL_LOG),
        "grpo": Launch(GRPO, GRPO_LAUNCH, nproc=1, env=NCCL_LOG),
        "packed": Launch(FULL_SINGLE, {**BF16_MASTER, **PACK, "micro_batching": "packed"}),
        "token_budget": Launch(
            FULL_SINGLE, {**BF16_MASTER, **PACK, "micro_batching": "token_budget"}
        ),
        "token_budget_fp32": Launch(
            FULL_SINGLE, {"dtype": "fp32", **PACK, "micro_batching": "token_budget"}
        ),
    }
    return launch_all(launches, tmp_path_factory.mktemp("gpu_preference_rl"))


def after_warm_up(values: list[float]) -> list[float]:
    """A run's per-step figures without its first step, which pays for allocator growth and
    kernel selection (and, with flex attention, compilation)."""
    return values[1:] if len(values) > 1 else values


# --- DPO -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe", ["lora_dpo_single_device", "lora_dpo_distributed", "full_dpo_distributed"]
)
def test_dpo_bf16_run_finishes_with_finite_loss_and_metrics(runs, recipe, record_property):
    scalars = runs[recipe].scalars()
    assert len(scalars["loss"]) == DPO_STEPS and all_finite(scalars["loss"])
    for name in DPO_METRICS:
        assert len(scalars[name]) == DPO_STEPS and all_finite(scalars[name]), name
    assert scalars["pairs"] == [2.0 * 2] * DPO_STEPS  # batch_size x micro-batches, one rank
    record_property("final_loss", f"{scalars['loss'][-1]:.4f}")
    record_property("final_reward_accuracy", f"{scalars['rewards/accuracies'][-1]:.3f}")
    record_property("final_reward_margin", f"{scalars['rewards/margins'][-1]:.3e}")
    pairs_per_second = after_warm_up(scalars["throughput/pairs_per_second"])
    record_property("pairs_per_second", f"{statistics.median(pairs_per_second):.1f}")


def test_lora_dpo_on_one_rank_trains_the_single_device_pairs(runs, record_property):
    single, distributed = runs["lora_dpo_single_device"], runs["lora_dpo_distributed"]
    assert distributed.scalars()["pairs"] == single.scalars()["pairs"]
    difference = max_relative_difference(distributed.losses(), single.losses())
    record_property("max_relative_loss_difference", f"{difference:.2e}")
    assert difference <= BF16_CURVE_RTOL  # See [bf16 curve tolerance] in cuda_runs.py


# --- GRPO ------------------------------------------------------------------------------------


def test_grpo_bf16_run_finishes_with_finite_loss(runs, record_property):
    scalars = runs["grpo"].scalars()
    assert len(scalars["loss"]) == GRPO_STEPS and all_finite(scalars["loss"])
    for name in ("policy/kl", "rewards/mean", "grad_norm"):
        assert all_finite(scalars[name]), name
    record_property("final_loss", f"{scalars['loss'][-1]:.3e}")
    record_property("final_policy_kl", f"{scalars['policy/kl'][-1]:.3e}")


def test_grpo_logs_generation_and_training_speed_apart(runs, record_property):
    scalars = runs["grpo"].scalars()
    # 4 prompts x 8 completions x at most 8 tokens a step; generate stops early only when
    # every row of a group has stopped, so a step generates at least one token a row.
    generated = scalars["completions/generated_tokens"]
    assert all(4 * 8 <= tokens <= 4 * 8 * 8 for tokens in generated), generated
    generation = after_warm_up(scalars["throughput/generated_tokens_per_second"])
    training = after_warm_up(scalars["throughput/training_tokens_per_second"])
    assert all_finite(generation) and min(generation) > 0
    assert all_finite(training) and min(training) > 0
    record_property("generated_tokens_per_step", f"{statistics.mean(generated):.0f}")
    record_property("generation_tokens_per_second", f"{statistics.median(generation):.0f}")
    record_property("training_tokens_per_second", f"{statistics.median(training):.0f}")
    record_property(
        "generate_ms_per_step", f"{statistics.mean(after_warm_up(scalars['time/generate_ms'])):.1f}"
    )
    record_property("step_ms", f"{statistics.mean(after_warm_up(scalars['time/step_ms'])):.1f}")


def test_grpo_generation_decodes_from_a_bf16_kv_cache(record_property):
    """The recipe logs no word about its cache, so the library's generation call (the one
    make_rollouts makes) runs here on the tiny GRPO model, as the recipe holds it: fp32
    trainable weights, bf16 autocast. With the cache each forward after the prompt's takes one
    token per row; without it, the whole sequence so far."""
    import torch
    from omegaconf import OmegaConf
    from torchtune import config, training

    from exactga.generation.sampling import SamplingSettings
    from exactga.grpo.rollouts import generate_rollouts
    from exactga.runtime.precision import Precision

    device = torch.device(DEVICE)
    with training.set_default_dtype(torch.bfloat16), device:
        model = config.instantiate(OmegaConf.load(REPO_ROOT / GRPO[1]).model)
    precision = Precision.from_config(torch.bfloat16, "fp32", device)
    precision.cast_trainable(model)
    calls: list[tuple[int, bool, torch.dtype | None]] = []

    def record_call(module, args, kwargs):
        cache = module.layers[0].attn.kv_cache
        cache_dtype = cache.k_cache.dtype if cache is not None else None
        calls.append((args[0].shape[1], module.caches_are_enabled(), cache_dtype))

    hook = model.register_forward_pre_hook(record_call, with_kwargs=True)
    prompt, num_samples, max_generated = [1, 17, 42, 99, 7], 4, 8
    try:
        rollouts, num_generated = generate_rollouts(
            model,
            [{"prompt_tokens": prompt, "index": 0}],
            grpo_samples=num_samples,
            sampling=SamplingSettings(max_generated_tokens=max_generated),
            seed=0,
            step=0,
            device=device,
            run_full_length=True,  # as on several ranks: every forward runs
            precision=precision,
        )
    finally:
        hook.remove()
    assert [length for length, _, _ in calls] == [len(prompt)] + [1] * (max_generated - 1)
    assert all(enabled and dtype == torch.bfloat16 for _, enabled, dtype in calls), calls
    assert num_generated == num_samples * max_generated
    assert [len(r["completion"]) for r in rollouts] == [max_generated] * num_samples
    assert not model.caches_are_enabled(), "the cache is the generation's, not the model's"
    record_property("forwards_per_group", str(len(calls)))


# --- packed rows against token_budget ------------------------------------------------------


def trained_and_initial(run: Run) -> tuple[dict, dict]:
    """The weights a run held after its last step (torchtune's names, fp32 under fp32 master
    weights) and the checkpoint it started from, in the same names and layout."""
    from omegaconf import OmegaConf
    from torchtune.models.convert_weights import hf_to_tune

    model = OmegaConf.load(REPO_ROOT / FULL_SINGLE[1]).model
    initial = hf_to_tune(
        load_weights(run.output_dir / INITIAL),
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        dim=model.embed_dim,
    )
    return load_weights(run.output_dir / STEP_WEIGHTS), initial


def test_packed_rows_train_the_token_budget_step(runs, record_property):
    packed, budget, budget_fp32 = runs["packed"], runs["token_budget"], runs["token_budget_fp32"]
    assert packed.scalars()["loss_tokens"] == budget.scalars()["loss_tokens"]
    packed_weights, initial = trained_and_initial(packed)
    budget_weights, budget_initial = trained_and_initial(budget)
    fp32_weights, _ = trained_and_initial(budget_fp32)
    assert all(initial[name].equal(budget_initial[name]) for name in initial), "not one checkpoint"
    distance = relative_l2(packed_weights, budget_weights, initial)
    bf16_rounding = relative_l2(budget_weights, fp32_weights, initial)
    floor = PRECISION_FLOOR_FACTOR * bf16_rounding  # See [bf16 floor of a regrouped run]
    loss_difference = max_relative_difference(packed.losses(), budget.losses())
    record_property("relative_l2_packed_to_token_budget", f"{distance:.2e}")
    record_property("relative_l2_token_budget_bf16_to_fp32", f"{bf16_rounding:.2e}")
    record_property("bf16_floor", f"{floor:.2e}")
    record_property("max_relative_loss_difference", f"{loss_difference:.2e}")
    assert distance <= floor
    assert loss_difference <= BF16_CURVE_RTOL  # See [bf16 curve tolerance] in cuda_runs.py


def test_packed_rows_padding_and_shapes(runs, record_property):
    for name in ("packed", "token_budget"):
        scalars = runs[name].scalars()
        padding = scalars["throughput/padding_fraction"]
        assert len(padding) == PACKED_STEPS and all(0.0 <= p < 1.0 for p in padding), padding
        record_property(f"{name}_padding_fraction", f"{statistics.mean(padding):.3f}")
        shapes = max(scalars["throughput/micro_batch_shapes"])
        record_property(f"{name}_micro_batch_shapes", f"{shapes:.0f}")
    # Rows of micro_batch_tokens positions, without pad_to_multiple_of: one shape, so flex
    # attention compiles once.
    assert max(runs["packed"].scalars()["throughput/micro_batch_shapes"]) == 1


# --- what only CUDA shows --------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize(
    "recipe",
    ["lora_dpo_single_device", "lora_dpo_distributed", "full_dpo_distributed", "grpo", "packed"],
)
def test_peak_gpu_memory_is_logged(runs, recipe, record_property):
    peaks = runs[recipe].scalars()["peak_memory_alloc"]
    assert peaks and all(value > 0 for value in peaks)
    record_property("peak_memory_alloc_gib", f"{max(peaks):.3f}")


@cuda_only
@pytest.mark.parametrize("recipe", ["lora_dpo_distributed", "full_dpo_distributed", "grpo"])
def test_distributed_run_reduces_through_nccl(runs, recipe):
    assert "NCCL INFO" in runs[recipe].output, "no NCCL communicator was created"


@cuda_only
def test_packed_rows_carry_a_flex_attention_block_mask():
    from exactga.data.packing import uses_flex_attention

    assert uses_flex_attention(DEVICE), "packed rows would carry a dense mask on this GPU"


def test_every_run_kept_finite_losses(runs):
    """No launch of the module skipped a step for a non-finite loss (``nonfinite_loss: skip``
    would otherwise hide one)."""
    for name, run in runs.items():
        scalars = run.scalars()
        assert not any(scalars.get("nonfinite_steps", [])), name
        assert all(math.isfinite(v) for v in scalars["loss"]), name
