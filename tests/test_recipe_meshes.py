"""The mesh keys through the real ``tune run`` (docs/meshes.md): HSDP and tensor x data parallelism
on 4 gloo CPU ranks train what one rank trains on the whole batch.

Every distributed recipe that takes the keys runs HSDP 2 x 2 (``data_parallel_replicate_dim=2``: two
replicas of a model sharded over two ranks), and the one that takes tensor parallelism (full
fine-tuning) runs tp 2 x dp 2 and tp 2 x 2 replicas; each must land on its recipe's 1-rank
full-batch run (8 sequences, ga 1) at the fp32 floor. Full fine-tuning also runs each mesh with
packed rows, length-balanced ranks and validation after every step, unclipped, against a 1-rank
run that validates the same rows: the same weights, and the same validation figures. The 4-rank
runs run one after another, the references beside them (tests/many_runs.py). The data are the
tiny variable-length sets with masked prompts, their first 64 rows (``DATA_SLICE``: the length
index each 4-rank run builds reads only those); two SGD steps (AdamW's first updates divide tiny
gradients by their own magnitude and would magnify rounding). Full fine-tuning's unpacked runs
clip where it bites: under tensor parallelism over data-parallel ranks its gradients are DTensors
of two meshes (exactga.accumulation.step.clip_grad_norm_over_meshes); the packed runs' gradients
have the same layout on each mesh, so they do not clip again (the first clip on a 2-D mesh
costs most of a 2-step run's CPU). The unpacked tensor-parallel runs pad every micro-batch to
one length (``ONE_LENGTH``: DTensor's sharding cache, keyed by shapes, then serves every
micro-batch after the first); the rows keep their varied lengths and masked prompts. Run with
``-rP`` to see the measured distances (docs/meshes.md quotes them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from many_runs import Run, launch_runs
from recipe_utils import INITIAL, SMALL_MODEL, TRAINED, load_weights, read_scalars, relative_l2
from tiny_runs import SMALL_TEACHER

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("meshes")]

TOLERANCE = 1e-5  # the fp32 floor of the other distributed parity tests
CLIP = 0.7  # full fine-tuning's clip_grad_norm: below its gradients' norms (0.77, 1.05)
STEPS = 2
GLOBAL_BATCH = 8  # sequences (or pairs) per step, in every run
GA = 2  # micro-batches per rank in the 4-rank runs

# recipe file, tiny distributed config, and whether the recipe takes tensor parallelism.
RECIPES = {
    "full": ("recipes/full_finetune.py", "configs/tiny/full_distributed.yaml", True),
    "lora": ("recipes/lora_finetune.py", "configs/tiny/lora_distributed.yaml", False),
    "kd": ("recipes/knowledge_distillation.py", "configs/tiny/kd_distributed.yaml", False),
    "lora_dpo": ("recipes/lora_dpo.py", "configs/tiny/lora_dpo_distributed.yaml", False),
    "full_dpo": (
        "recipes/full_dpo_distributed.py",
        "configs/tiny/full_dpo_distributed.yaml",
        False,
    ),
    "qat": ("recipes/qat_distributed.py", "configs/tiny/qat_distributed.yaml", False),
    "qat_lora": (
        "recipes/qat_lora_finetune_distributed.py",
        "configs/tiny/qat_lora_distributed.yaml",
        False,
    ),
}
# The tests' small tiny model (and KD's teacher twice as wide): 4 ranks share 2 cores.
SMALL = [f"{key}={value}" for key, value in SMALL_MODEL.items()]
# The data's first 64 rows (every run, references too): 4x the 16 samples a run reads (the 12
# validated among them); the SFT rows' lengths vary (69 to 1,296 characters), the preference
# pairs' two sides differ in length in all 64. Each 4-rank run's length index tokenized the
# whole set before (2,069 SFT rows, 300 pairs).
DATA_SLICE = "dataset.split=train[:64]"
COMMON = [
    DATA_SLICE,
    f"max_steps_per_epoch={STEPS}",
    "clip_grad_norm=null",
    "lr_scheduler.num_warmup_steps=0",
    "optimizer._component_=torch.optim.SGD",
    "optimizer.lr=0.5",
    "~optimizer.weight_decay",
]
# Each recipe's own keys: torchtune 0.6.1's Llama plan shards the output projection as a
# Linear, so the full runs (which share one reference) are untied, as in
# tests/test_recipe_full_distributed_extra.py. QAT LoRA fake-quantises its frozen base with int4
# weights only: with int8 activations a value may land on another grid point in one split and
# not the other from the second step on, and the splits part by far more than rounding
# (docs/qat.md, "What is exact"); full QAT's config switches fake quantisation on after step 5.
OWN_KEYS = {
    # Clipped where it bites (the unclipped norm is above it at both steps), on every mesh:
    # tensor parallelism over data-parallel ranks puts the gradients on two meshes.
    "full": ["model.tie_word_embeddings=False", f"clip_grad_norm={CLIP}"],
    "qat_lora": [
        "quantizer._component_=torchtune.training.quantization.Int4WeightOnlyQATQuantizer",
        "quantizer.inner_k_tiles=2",
    ],
}
TP_PLAN = "tensor_parallel_plan._component_=torchtune.models.llama3.base_llama_tp_plan"
# The 4-rank runs' mesh keys, and their data-parallel ranks (each loads other samples).
MESHES = {
    "hsdp": (["data_parallel_replicate_dim=2"], 4),  # dp 4 = 2 replicas x 2 shards
    "tp": (["tensor_parallel_dim=2", TP_PLAN], 2),  # dp 2 x tp 2
    # 2 replicas x tp 2: FSDP's 2-D mesh (its shard dimension 1) over the TP-sharded layers
    "hsdp_tp": (["data_parallel_replicate_dim=2", "tensor_parallel_dim=2", TP_PLAN], 2),
}
# Validation after every step, on the training rows' first 12 (4 batches of 3).
VALIDATED = ["dataset_val=${dataset}", "run_val_every_n_steps=1", "batch_size_val=3"]
VALIDATED += ["max_val_batches=4"]
# Packed rows (of the tiny model's max_seq_len), the ranks length-balanced (the default) and
# validation, on every mesh: full fine-tuning, against its 1-rank reference that validates.
# Unclipped: the clip over the meshes is the unpacked runs' claim, on gradients of the same
# layout (each mesh's DTensors are the plan's, whatever the rows), and on a 2-D mesh the first
# clip pays DTensor's uncached propagation for its foreach ops over every gradient (seconds of
# CPU per rank: most of a 2-step run's).
UNCLIPPED = ["clip_grad_norm=null"]
PACKED_VALIDATED = ["micro_batching=packed", "micro_batch_tokens=512", *VALIDATED, *UNCLIPPED]
# Tensor parallelism sends every linear through DTensor's dispatch, whose sharding cache is keyed
# by shapes: each micro-batch of a new sequence length paid the uncached propagation again. So
# the unpacked TP runs pad every micro-batch to one length, the tokenizer's max_seq_len (exact:
# padding is masked; the rows keep their lengths and masked prompts). Packed rows are 512 long.
ONE_LENGTH = ["pad_to_multiple_of=256"]


def _run(root: Path, recipe: str, name: str, keys: list[str], batch_size: int, ga: int) -> Run:
    recipe_file, config, _ = RECIPES[recipe]
    out = root / name
    args = ["--config", config, f"output_dir={out}", f"batch_size={batch_size}"]
    args += [f"gradient_accumulation_steps={ga}", *COMMON, *SMALL]
    if recipe == "kd":
        args += [f"{key}={value}" for key, value in SMALL_TEACHER.items()]
    return Run(recipe_file, [*args, *OWN_KEYS.get(recipe, []), *keys], out)  # keys last: they win


def _four_rank_runs(root: Path) -> list[Run]:
    runs = []
    for recipe, (_, _, takes_tp) in RECIPES.items():
        for mesh, (keys, dp) in MESHES.items():
            if "tp" in mesh and not takes_tp:
                continue
            batch_size = GLOBAL_BATCH // (dp * GA)
            keys = [*keys, *(ONE_LENGTH if "tp" in mesh else [])]
            runs.append(_run(root, recipe, f"{recipe}_{mesh}", keys, batch_size, GA))
    for mesh, (keys, dp) in MESHES.items():  # full fine-tuning on every mesh, packed, validated
        batch_size = GLOBAL_BATCH // (dp * GA)
        keys = [*keys, *PACKED_VALIDATED]
        runs.append(_run(root, "full", f"full_{mesh}_packed", keys, batch_size, GA))
    return runs


def _launch_all(root: Path) -> None:
    # One rank, no torchrun: each distributed recipe trains as one rank (its own group).
    references = [_run(root, recipe, f"{recipe}_ref", [], GLOBAL_BATCH, 1) for recipe in RECIPES]
    validated = [*VALIDATED, *UNCLIPPED]
    references.append(_run(root, "full", "full_ref_validated", validated, GLOBAL_BATCH, 1))
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(launch_runs, _four_rank_runs(root), nproc=4),
            pool.submit(launch_runs, references, nproc=0),
        ]
        for future in futures:
            future.result()


@pytest.fixture(scope="module")
def runs(run_once):
    root = run_once("mesh_runs", _launch_all)

    def get(name: str) -> Path:
        out = root / name
        assert (out / "returncode").read_text() == "0", (out / "output.txt").read_text()[-4000:]
        return out

    return get


CASES = [(recipe, "hsdp") for recipe in RECIPES] + [("full", "tp"), ("full", "hsdp_tp")]


@pytest.mark.parametrize(("recipe", "mesh"), CASES)
def test_mesh_trains_what_one_rank_trains_on_the_whole_batch(runs, recipe, mesh):
    """HSDP 2 x 2 (every recipe), tp 2 x dp 2 and tp 2 x 2 replicas (full) against 8 x 1 on
    one rank: the trained (merged) weights within the fp32 floor, and the same logged losses."""
    run, reference = runs(f"{recipe}_{mesh}"), runs(f"{recipe}_ref")
    rel = relative_l2(
        load_weights(run / TRAINED),
        load_weights(reference / TRAINED),
        load_weights(reference / INITIAL),
    )
    print(f"{recipe} {mesh} on 4 ranks vs {GLOBAL_BATCH}x1 on one rank: relative L2 {rel:.3e}")
    assert rel <= TOLERANCE
    losses, expected = read_scalars(run / "logs")["loss"], read_scalars(reference / "logs")["loss"]
    assert len(losses) == STEPS
    assert losses == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mesh", MESHES)
def test_packed_balanced_ranks_and_validation_train_and_validate_as_one_rank(runs, mesh):
    """Each mesh with packed rows, length-balanced ranks and validation after every step: the
    1-rank full batch's weights at the fp32 floor, and its validation figures (the whole set,
    counted over the count group) to rounding."""
    run, reference = runs(f"full_{mesh}_packed"), runs("full_ref_validated")
    rel = relative_l2(
        load_weights(run / TRAINED),
        load_weights(reference / TRAINED),
        load_weights(reference / INITIAL),
    )
    print(f"full {mesh}, packed and validated, vs {GLOBAL_BATCH}x1: relative L2 {rel:.3e}")
    assert rel <= TOLERANCE
    ours, expected = read_scalars(run / "logs"), read_scalars(reference / "logs")
    assert len(ours["val/loss"]) == STEPS  # and once more at the epoch's end, on its last step
    assert ours["val/loss"] == pytest.approx(expected["val/loss"], rel=1e-5)
    assert ours["loss"] == pytest.approx(expected["loss"], rel=1e-5)


def test_the_full_runs_clip_where_it_bites(runs):
    """Full fine-tuning's gradient norm is above its clip at every step, so every mesh's run
    clips (the weights above would part otherwise), and each logs the 1-rank run's norm."""
    expected = read_scalars(runs("full_ref") / "logs")["grad_norm"]
    assert min(expected) > CLIP
    for mesh in MESHES:
        norms = read_scalars(runs(f"full_{mesh}") / "logs")["grad_norm"]
        assert norms == pytest.approx(expected, rel=1e-5), mesh
