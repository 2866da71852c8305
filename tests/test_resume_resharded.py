"""A step checkpoint written on one mesh resumes on another: 2 ranks -> 4 (full fine-tuning on
HSDP 2 x 2, LoRA on 4 shards), 2 -> 1, 1 -> 4, and HSDP -> 2 plain ranks.

Tier (b) of docs/contributing.md point 9: the real recipes under ``tune run --nproc_per_node N`` on
CPU (gloo), offline, every run on the data's first 64 rows (``DATA_SLICE``). An uninterrupted
2-rank run (full fine-tuning, and LoRA) keeps a step checkpoint of every step; the resumed runs
start in folders holding only its initial weights and its mid-epoch checkpoint of step 2 of 4, as
tests/test_resume_trains_what_is_left.py does, with the same global batch split otherwise (4 ranks
x 1 x 2, 1 rank x 4 x 2 for 2 x 2 x 2). A resumed run must log exactly the steps after its
checkpoint, each on the uninterrupted step's samples (its loss-token count, an integer, equal; its
loss at the fp32 floor) and end at the uninterrupted weights to the fp32 floor (docs/reliability.md
gives the figures: another mesh sums each window's gradient in another order, so bit-identity is
not expected; the same mesh is bit-identical, tests/test_resume.py). The 1-rank run's own step
checkpoint of step 3 then resumes on 4 ranks, and the HSDP run's checkpoint of step 3 on 2 plain
ranks, and those runs too end at the uninterrupted weights: a checkpoint of a resharded run
reshards again. A changed global batch is refused, naming the key.

Runs by rank count (tests/many_runs.py), in order: 2 ranks (the uninterrupted runs), 1 rank (the
resumes from 2), 4 ranks (the resumes from 2 and from 1, then the refusal), 2 ranks (from HSDP).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from many_runs import launch_runs, run_of
from recipe_utils import SMALL_MODEL, load_weights, logged_steps, relative_l2

# Every test reads the module's shared runs.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume_resharded")]

# Steps before the checkpoint, after it, and after the resumed runs' own (CHECKPOINT + 1).
STEPS, CHECKPOINT = 4, 2
FINAL = "epoch_0/model-00001-of-00001.safetensors"
LORA_FINAL = "epoch_0/adapter_model.pt"
INITIAL = "base_model"
# Measured (docs/reliability.md): relative L2 to the uninterrupted weights of 2.7e-7 to 3.0e-7
# (LoRA's adapters 2e-8 to 3e-8), and logged losses within 5e-8 relative. A run that trained
# other samples lands about 1e-2 away.
TOLERANCE = 1e-6
LOSS_TOLERANCE = 1e-6

RECIPES = {
    "full": ["recipes/full_finetune.py", "--config", "configs/tiny/full_distributed.yaml"],
    "lora": ["recipes/lora_finetune.py", "--config", "configs/tiny/lora_distributed.yaml"],
}
# The same global batch of 8 (2 ranks x 2 x 2) split over each mesh.
BATCH_SIZE = {1: 4, 2: 2, 4: 1}
# Every run trains on the data's first 64 rows: 2x the 32 samples of the uninterrupted run, so
# the checkpoint of step 2 (and 3) stays mid-epoch (the epoch ends at max_steps_per_epoch, not
# at the data's end), and the rows' lengths vary (69 to 1,296 characters), so a resumed run at
# another data position logs other loss-token counts. The length index of each distributed run
# reads these 64 rows, not all 2,069.
DATA_SLICE = "train[:64]"
DISK_LOGGER = "torchtune.training.metric_logging.DiskLogger"
HSDP = {"data_parallel_replicate_dim": 2}  # on 4 ranks: 2 replicas, each sharded over 2


def _args(kind: str, ranks: int, out: Path, **overrides: object) -> list[str]:
    settings = {
        **SMALL_MODEL,
        "max_steps_per_epoch": STEPS,
        "epochs": 1,
        "save_every_n_steps": 1,
        "keep_last_n_checkpoints": STEPS,
        "batch_size": BATCH_SIZE[ranks],
        "dataset.split": DATA_SLICE,
        "metric_logger._component_": DISK_LOGGER,
        "output_dir": out,
        **overrides,
    }
    launcher = ["--nproc_per_node", str(ranks)]
    return [*launcher, *RECIPES[kind], *(f"{key}={value}" for key, value in settings.items())]


def _resume_args(kind: str, ranks: int, out: Path, **overrides: object) -> list[str]:
    logs = {"metric_logger.log_dir": out.parent / "resumed_logs"}
    return _args(kind, ranks, out, resume_from_checkpoint=True, **logs, **overrides)


def _seed_folder(source: Path, step: int, out: Path) -> None:
    """``out`` holding only ``source``'s initial weights and its step checkpoint ``step``."""
    checkpoint = f"step_checkpoints/step_{step:06d}"
    shutil.copytree(source / INITIAL, out / INITIAL)
    shutil.copytree(source / checkpoint, out / checkpoint)


def _launch(runs: dict[str, list[str]], root: Path, ranks: int) -> None:
    planned = []
    for name, args in runs.items():
        nproc, run = run_of(args, root / name / "launch")
        assert nproc == ranks
        planned.append(run)
    launch_runs(planned, nproc=ranks)


@pytest.fixture(scope="module")
def runs(run_once):
    """The module's runs, each in ``root / name`` (``run``: its output folder; ``launch``: its
    ``output.txt`` and ``returncode``; ``resumed_logs``)."""

    def make(root: Path) -> None:
        _launch({kind: _args(kind, 2, root / kind / "run") for kind in RECIPES}, root, 2)
        for kind in RECIPES:
            for ranks in (1, 4):
                _seed_folder(root / kind / "run", CHECKPOINT, root / f"{kind}_2to{ranks}" / "run")
        _launch(
            {
                f"{kind}_2to1": _resume_args(kind, 1, root / f"{kind}_2to1" / "run")
                for kind in RECIPES
            },
            root,
            1,
        )
        _seed_folder(root / "full_2to1" / "run", CHECKPOINT + 1, root / "full_1to4" / "run")
        refused = root / "refused" / "run"
        _seed_folder(root / "full" / "run", CHECKPOINT, refused)
        resumes = {
            # Full fine-tuning resumes on HSDP 2 x 2 (2 replicas of 2 shards), LoRA on 4 shards.
            "full_2to4": _resume_args("full", 4, root / "full_2to4" / "run", **HSDP),
            "lora_2to4": _resume_args("lora", 4, root / "lora_2to4" / "run"),
            "full_1to4": _resume_args("full", 4, root / "full_1to4" / "run"),
            # A global batch of 4 x 2 x 2 = 16: another run. Last: it fails, failing no other run.
            "refused": _resume_args("full", 4, refused, batch_size=2),
        }
        _launch(resumes, root, 4)
        # And back: the HSDP run's own checkpoint of step 3 on 2 plain FSDP ranks.
        _seed_folder(root / "full_2to4" / "run", CHECKPOINT + 1, root / "full_hsdp_to2" / "run")
        _launch({"full_hsdp_to2": _resume_args("full", 2, root / "full_hsdp_to2" / "run")}, root, 2)

    def get(name: str) -> Path:
        return run_once("resume_resharded", make) / name

    return get


def _finished(folder: Path) -> str:
    output = (folder / "launch" / "output.txt").read_text()
    assert (folder / "launch" / "returncode").read_text() == "0", output[-4000:]
    return output


def _weights(kind: str, run: Path) -> dict[str, torch.Tensor]:
    if kind == "full":
        return load_weights(run / FINAL)
    return torch.load(run / LORA_FINAL, map_location="cpu", weights_only=True)


RESUMES = [
    ("full", "full_2to4", CHECKPOINT),
    ("full", "full_2to1", CHECKPOINT),
    ("full", "full_1to4", CHECKPOINT + 1),
    ("full", "full_hsdp_to2", CHECKPOINT + 1),
    ("lora", "lora_2to4", CHECKPOINT),
    ("lora", "lora_2to1", CHECKPOINT),
]


@pytest.mark.parametrize(("kind", "name", "after_step"), RESUMES, ids=[r[1] for r in RESUMES])
def test_a_resharded_resume_trains_the_same_samples_to_the_same_weights(
    runs, kind: str, name: str, after_step: int
) -> None:
    reference, folder = runs(kind), runs(name)
    _finished(reference)
    output = _finished(folder)
    assert "resharded" in output, output[-4000:]
    expected_tokens = logged_steps(reference / "run" / "logs", tag="loss_tokens")
    expected_losses = logged_steps(reference / "run" / "logs")
    tokens = logged_steps(folder / "resumed_logs", tag="loss_tokens")
    losses = logged_steps(folder / "resumed_logs")
    later = range(after_step + 1, STEPS + 1)
    # The same samples: every later step's loss-token count, and no other step logged.
    assert tokens == {step: expected_tokens[step] for step in later}
    loss_gaps = {step: abs(losses[step] / expected_losses[step] - 1) for step in later}
    weights, expected = _weights(kind, folder / "run"), _weights(kind, reference / "run")
    initial = {key: torch.zeros_like(value) for key, value in expected.items()}
    if kind == "full":
        initial = load_weights(reference / "run" / INITIAL / "model.safetensors")
    distance = relative_l2(weights, expected, initial)
    print(f"{name}: relative L2 {distance:.3g}, loss gaps {loss_gaps}")
    assert max(loss_gaps.values()) <= LOSS_TOLERANCE
    assert distance <= TOLERANCE


def test_a_changed_global_batch_is_refused_naming_the_key(runs) -> None:
    folder = runs("refused")
    assert (folder / "launch" / "returncode").read_text() != "0"
    output = (folder / "launch" / "output.txt").read_text()
    assert (
        "'samples_per_step' (batch_size x gradient_accumulation_steps x data-parallel ranks): "
        "8 in the checkpoint, 16 now" in output
    ), output[-4000:]
    assert not (folder / "run" / "epoch_0").exists()
