"""Unit tier: step checkpoints are written atomically, verified on load, and refuse to resume
another run.

A tiny Llama from torchtune's builders and an AdamW that has taken a step supply real tensors
and optimizer state. Damage is done to the files on disk the way disks and interrupted copies do
it (truncation, a flipped byte, a missing file, a crash mid-save), and the checkpointer must fall
back to the previous checkpoint, naming the file at fault. See [atomic step checkpoints] and
[what a resume may change] in ``exactga.run.resume``.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import unit_utils
from omegaconf import OmegaConf
from torch import nn
from unit_utils import VOCAB

from exactga.models.model_state import load_model_state
from exactga.run.checkpointing import (
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    CorruptCheckpointError,
    StepCheckpointer,
)
from exactga.run.resume import (
    ResumeFrom,
    capture_rng_state,
    check_resume_fingerprint,
    find_resume_point,
    restore_rng_state,
    run_fingerprint,
)

CPU = torch.device("cpu")
RANK_FILE = "rank_0.pt"


def tiny_model(embed_dim: int = 16, num_layers: int = 1, seed: int = 0) -> nn.Module:
    """Smaller than the normalisation tests' model: only its tensors are saved and loaded."""
    return unit_utils.tiny_model(
        embed_dim=embed_dim, num_layers=num_layers, intermediate_dim=32, max_seq_len=32, seed=seed
    )


def train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int = 1) -> None:
    """One AdamW step on random tokens, so the optimizer has state to save."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=gen)
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trained(seed: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_one_step(model, optimizer, seed)
    return model, optimizer


def save_step(
    checkpointer: StepCheckpointer,
    step: int,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """What a recipe saves at ``step``: weights, optimizer, counters, this rank's RNG/position."""
    if model is None:
        model, optimizer = trained(seed=step)
    return checkpointer.save(
        step,
        model_state=model.state_dict(),
        optimizer_state=None if optimizer is None else optimizer.state_dict(),
        trainer_state={"global_step": step, "epochs_run": 0, "fingerprint": {"batch_size": 2}},
        rank_state={"rng": capture_rng_state(CPU), "dataloader": {"samples_seen": 10 * step}},
    )


def assert_same_tensors(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def fix_manifest(checkpoint: Path, name: str) -> None:
    """Record ``name``'s current size and CRC32 in the manifest, as if it had been saved so."""
    manifest_path = checkpoint / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    del manifest["manifest_crc32"]  # the manifest's own check, over the rest of it
    manifest["manifest_crc32"] = zlib.crc32(json.dumps(manifest, sort_keys=True).encode())
    manifest_path.write_text(json.dumps(manifest))


# --- round trip and pruning ------------------------------------------------------------------


def test_save_then_load_latest_round_trips_every_part(tmp_path: Path) -> None:
    model, optimizer = trained()
    checkpointer = StepCheckpointer(tmp_path / "ckpt", keep_last_n=2)
    rng = capture_rng_state(CPU)
    expected_torch, expected_python = torch.rand(5), random.random()
    trainer_state = {"global_step": 3, "epochs_run": 1, "fingerprint": {"model": {"a": [1, 2]}}}
    path = checkpointer.save(
        3,
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        trainer_state=trainer_state,
        rank_state={"rng": rng, "dataloader": {"samples_seen": 30}},
    )
    torch.manual_seed(1234)  # what the run does after saving: draws move on
    random.seed(1234)

    loaded = checkpointer.load_latest()

    assert loaded is not None
    assert loaded.step == 3 and loaded.path == path
    assert loaded.trainer_state == trainer_state
    assert loaded.rank_state["dataloader"] == {"samples_seen": 30}
    assert_same_tensors(loaded.model_state, model.state_dict())
    restore_rng_state(loaded.rank_state["rng"], CPU)
    assert torch.equal(torch.rand(5), expected_torch)
    assert random.random() == expected_python

    # The optimizer state is complete: a fresh model and optimizer restored from the checkpoint
    # take the next step bit-for-bit as the original ones do.
    resumed = tiny_model(seed=99)
    load_model_state(resumed, loaded.model_state, str(loaded.path / MODEL_FILE))
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_optimizer.load_state_dict(loaded.optimizer_state)
    train_one_step(model, optimizer, seed=7)
    train_one_step(resumed, resumed_optimizer, seed=7)
    assert_same_tensors(resumed.state_dict(), model.state_dict())


def test_checkpoint_without_optimizer_loads_none_for_it(tmp_path: Path) -> None:
    checkpointer = StepCheckpointer(tmp_path, keep_last_n=2)
    model = tiny_model()
    save_step(checkpointer, 1, model, optimizer=None)
    loaded = checkpointer.load_latest()
    assert loaded.optimizer_state is None
    assert_same_tensors(loaded.model_state, model.state_dict())


@pytest.mark.parametrize("keep_last_n", [2, 3])
def test_keep_last_n_prunes_older_checkpoints(tmp_path: Path, keep_last_n: int) -> None:
    checkpointer = StepCheckpointer(tmp_path, keep_last_n=keep_last_n)
    model = tiny_model()
    for step in range(1, 6):
        save_step(checkpointer, step, model)
    kept = list(range(6 - keep_last_n, 6))
    assert checkpointer.list_steps() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_{s:06d}" for s in kept]


@pytest.mark.parametrize("keep_last_n", [1, 0])
def test_keep_last_n_below_two_is_refused_naming_the_key(tmp_path: Path, keep_last_n) -> None:
    with pytest.raises(ValueError, match="'keep_last_n_checkpoints'"):
        StepCheckpointer(tmp_path, keep_last_n=keep_last_n)


def test_no_checkpoint_loads_none(tmp_path: Path) -> None:
    assert StepCheckpointer(tmp_path / "absent", keep_last_n=2).load_latest() is None
    assert StepCheckpointer(tmp_path, keep_last_n=2).load_latest() is None


# --- damage ------------------------------------------------------------------------------------


DAMAGES = {
    "truncate": truncate,
    "flip_byte": flip_byte,
    "delete": Path.unlink,
}


@pytest.mark.parametrize(
    "damage, name",
    [
        ("truncate", MODEL_FILE),
        ("truncate", OPTIMIZER_FILE),
        ("truncate", RANK_FILE),
        ("flip_byte", MODEL_FILE),
        ("flip_byte", OPTIMIZER_FILE),
        ("flip_byte", RANK_FILE),
        ("delete", OPTIMIZER_FILE),
        ("delete", RANK_FILE),
        ("delete", MANIFEST_FILE),
        ("truncate", MANIFEST_FILE),
    ],
)
def test_damaged_latest_falls_back_to_the_previous_one_naming_the_file(
    tmp_path: Path, damage: str, name: str
) -> None:
    checkpointer = StepCheckpointer(tmp_path, keep_last_n=3)
    previous_model, _ = trained(seed=1)
    save_step(checkpointer, 1, *trained(seed=1))
    latest = save_step(checkpointer, 2, *trained(seed=2))
    DAMAGES[damage](latest / name)

    with pytest.warns(UserWarning, match=re.escape(str(latest / name))):
        loaded = checkpointer.load_latest()

    assert loaded.step == 1
    assert_same_tensors(loaded.model_state, previous_model.state_dict())
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(latest / name))):
        checkpointer.load(latest)


def test_every_checkpoint_damaged_raises_naming_each_file(tmp_path: Path) -> None:
    checkpointer = StepCheckpointer(tmp_path, keep_last_n=2)
    model = tiny_model()
    first = save_step(checkpointer, 1, model)
    second = save_step(checkpointer, 2, model)
    (first / MANIFEST_FILE).unlink()
    truncate(second / MODEL_FILE)

    with pytest.warns(UserWarning), pytest.raises(CorruptCheckpointError) as err:
        checkpointer.load_latest()

    assert str(first / MANIFEST_FILE) in str(err.value)
    assert str(second / MODEL_FILE) in str(err.value)


def test_stale_staging_folder_is_ignored_then_removed_by_the_next_save(tmp_path: Path) -> None:
    checkpointer = StepCheckpointer(tmp_path, keep_last_n=2)
    model = tiny_model()
    save_step(checkpointer, 5, model)
    # A crash just before the rename leaves a staging folder that looks complete inside.
    stale = tmp_path / ".step_000007.tmp"
    shutil.copytree(tmp_path / "step_000005", stale)

    assert checkpointer.list_steps() == [5]
    assert checkpointer.load_latest().step == 5

    save_step(checkpointer, 6, model)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005", "step_000006"]


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    checkpointer = StepCheckpointer(tmp_path, keep_last_n=2)
    first_model, first_optimizer = trained(seed=1)
    second_model, second_optimizer = trained(seed=2)
    save_step(checkpointer, 4, first_model, first_optimizer)
    save_step(checkpointer, 4, second_model, second_optimizer)

    loaded = checkpointer.load_latest()

    assert loaded.step == 4
    assert_same_tensors(loaded.model_state, second_model.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]


@pytest.mark.parametrize("saved_world_size, world_size", [(2, 1), (1, 4)])
def test_another_world_size_reads_rank_zeros_state_and_says_who_wrote_it(
    tmp_path: Path, saved_world_size: int, world_size: int
) -> None:
    """A resume on another number of ranks (see [resharded resume] in exactga.run.resume):
    every rank reads rank 0's RNG states; the checkpoint names the world size that wrote it."""
    save_step(StepCheckpointer(tmp_path, 2, rank=0, world_size=saved_world_size), 1, tiny_model())
    checkpointer = StepCheckpointer(tmp_path, 2, rank=world_size - 1, world_size=world_size)
    loaded = checkpointer.load_latest()
    assert loaded.world_size == saved_world_size
    assert loaded.rank_state["dataloader"] == {"samples_seen": 10}


# --- nothing unpickles code --------------------------------------------------------------------


def _leave_marker(path: str) -> None:
    Path(path).write_text("code ran")


class _Payload:
    """Runs ``_leave_marker`` when unpickled by a loader that allows arbitrary globals."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_leave_marker, (self.marker,))


@pytest.mark.parametrize("name", [OPTIMIZER_FILE, RANK_FILE])
def test_pickled_code_in_a_checkpoint_is_refused_without_running(tmp_path: Path, name: str) -> None:
    root = tmp_path / "ckpt"
    checkpointer = StepCheckpointer(root, keep_last_n=2)
    model = tiny_model()
    save_step(checkpointer, 1, model, torch.optim.AdamW(model.parameters()))
    latest = save_step(checkpointer, 2, model, torch.optim.AdamW(model.parameters()))
    marker = tmp_path / "marker"
    torch.save({"state": {}, "param_groups": [], "payload": _Payload(marker)}, latest / name)
    fix_manifest(latest, name)  # only the unpickling is at fault, not size or CRC

    with pytest.raises(CorruptCheckpointError, match=re.escape(str(latest / name))):
        checkpointer.load(latest)
    with pytest.warns(UserWarning, match=re.escape(str(latest / name))):
        assert checkpointer.load_latest().step == 1
    assert not marker.exists()

    # The payload is real: a loader that unpickles code does run it.
    torch.load(latest / name, weights_only=False)
    assert marker.exists()


def test_pickled_code_in_a_sharded_checkpoint_is_refused_without_running(tmp_path: Path) -> None:
    """torch.distributed.checkpoint unpickles its non-tensor entries with weights_only=False;
    exactga's planner reads each with weights_only=True first."""
    import torch.distributed.checkpoint as dcp

    from exactga.checkpoints.contents import load_sharded_train_state, sharded_train_state

    model, optimizer = trained()
    state = sharded_train_state(model, optimizer)
    marker = tmp_path / "marker"
    state["optimizer"]["param_groups"][0]["lr"] = _Payload(marker)
    dcp.save(state, checkpoint_id=tmp_path / "sharded", no_dist=True)

    with pytest.raises(CorruptCheckpointError, match="param_groups.0.lr"):
        load_sharded_train_state(model, optimizer, tmp_path / "sharded")
    assert not marker.exists()


# --- what a resume may change ------------------------------------------------------------------


def run_config(**overrides) -> dict:
    cfg = {
        "dim": 16,
        "base_batch_size": 2,
        "model": {
            "_component_": "torchtune.models.llama3_2.llama3_2",
            "num_layers": 1,
            "embed_dim": "${dim}",
        },
        "tokenizer": {"path": "/models/tokenizer.model"},
        "dataset": [{"source": "a"}, {"source": "b"}],
        "batch_size": "${base_batch_size}",
        "gradient_accumulation_steps": 4,
        "shuffle": True,
        "loss_normalization": "exact",
        "max_steps_per_epoch": None,
        "optimizer": {"lr": 1e-3},
        "epochs": 1,
        "resume_from_checkpoint": True,
        "resume_allow_changed_keys": [],
    }
    for key, value in overrides.items():
        section, _, leaf = key.rpartition(".")
        (cfg[section] if section else cfg)[leaf] = value
    return OmegaConf.create(cfg)


def test_run_fingerprint_resolves_interpolations_and_ignores_free_keys() -> None:
    fingerprint = run_fingerprint(run_config(), dp_size=2)
    assert fingerprint["samples_per_step"] == 2 * 4 * 2  # batch x accumulation x ranks
    assert "batch_size" not in fingerprint and "gradient_accumulation_steps" not in fingerprint
    assert fingerprint["model"]["embed_dim"] == 16
    assert fingerprint["dataset"] == [{"source": "a"}, {"source": "b"}]
    assert "optimizer" not in fingerprint and "epochs" not in fingerprint

    # a change reached only through an interpolation still changes the fingerprint
    assert run_fingerprint(run_config(dim=32))["model"]["embed_dim"] == 32
    # learning rate and epochs may change freely
    free = run_fingerprint(run_config(**{"optimizer.lr": 1.0, "epochs": 9}), dp_size=2)
    assert free == fingerprint


def test_changed_keys_are_refused_naming_keys_and_values() -> None:
    saved = run_fingerprint(run_config())
    current = run_fingerprint(run_config(batch_size=4, **{"model.num_layers": 2}))

    with pytest.raises(ValueError) as err:
        check_resume_fingerprint(saved, current, [], Path("/out/step_000010"))

    message = str(err.value)
    assert (
        "'samples_per_step' (batch_size x gradient_accumulation_steps x data-parallel ranks): "
        "8 in the checkpoint, 16 now" in message
    )
    assert "'model': num_layers 1 in the checkpoint, 2 now" in message
    assert "/out/step_000010" in message
    assert "resume_allow_changed_keys" in message


def test_allowed_changes_only_warn_and_the_rest_are_still_refused() -> None:
    saved = run_fingerprint(run_config())
    current = run_fingerprint(run_config(batch_size=4, **{"model.num_layers": 2}))

    with pytest.warns(UserWarning) as record:
        check_resume_fingerprint(saved, current, ["samples_per_step", "model"], Path("/out/step_1"))
    messages = " | ".join(str(w.message) for w in record)
    assert "'samples_per_step'" in messages and "'model'" in messages

    with pytest.raises(ValueError) as err:
        check_resume_fingerprint(saved, current, ["samples_per_step"], Path("/out/step_1"))
    assert "'model'" in str(err.value)
    assert "'samples_per_step'" not in str(err.value)


def test_the_global_batch_split_another_way_resumes_silently() -> None:
    """Ranks, batch size and accumulation may change together; see [resharded resume]."""
    saved = run_fingerprint(run_config(), dp_size=2)  # 2 x 4 x 2 ranks
    for split, ranks in (({"batch_size": 1}, 4), ({"batch_size": 4}, 1), ({}, 2)):
        current = run_fingerprint(run_config(**split), dp_size=ranks)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_resume_fingerprint(saved, current, [], Path("/out/step_1"))


def test_a_one_device_run_resumes_a_distributed_runs_checkpoint_and_back() -> None:
    """A one-device fingerprint has no ``tensor_parallel_dim``: it reads as size 1."""
    distributed = run_fingerprint(run_config(batch_size=1), dp_size=2, tensor_parallel_dim=1)
    one_device = run_fingerprint(run_config())
    check_resume_fingerprint(distributed, one_device, [], Path("/out/step_1"))
    check_resume_fingerprint(one_device, distributed, [], Path("/out/step_1"))
    with pytest.raises(ValueError, match="'tensor_parallel_dim': 1 in the checkpoint, 2 now"):
        check_resume_fingerprint(one_device, {**distributed, "tensor_parallel_dim": 2}, [], "x")


def test_a_fingerprint_of_the_batch_split_and_world_size_reads_as_its_global_batch() -> None:
    """A checkpoint written before ``samples_per_step`` resumes as it did."""
    current = run_fingerprint(run_config(), dp_size=2, tensor_parallel_dim=1)
    older = {k: v for k, v in current.items() if k != "samples_per_step"}
    older.update(batch_size=2, gradient_accumulation_steps=4, world_size=2)
    check_resume_fingerprint(older, current, [], Path("/out/step_1"))
    older["world_size"] = 1
    with pytest.raises(ValueError, match="'samples_per_step'.*8 in the checkpoint, 16 now"):
        check_resume_fingerprint(older, current, [], Path("/out/step_1"))


def test_fingerprint_read_back_from_a_checkpoint_matches_the_same_config(tmp_path: Path) -> None:
    cfg = run_config()
    fingerprint = run_fingerprint(cfg)
    checkpointer = StepCheckpointer(tmp_path / "step_checkpoints", keep_last_n=2)
    model = tiny_model()
    checkpointer.save(
        3,
        model_state=model.state_dict(),
        optimizer_state=None,
        trainer_state={"fingerprint": fingerprint},
        rank_state={"rng": capture_rng_state(CPU)},
    )

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same config resumes silently
        found = find_resume_point(cfg, checkpointer, run_fingerprint(cfg))
    assert found.source is ResumeFrom.STEP_CHECKPOINT and found.step_checkpoint.step == 3

    no_step_checkpoints = StepCheckpointer(tmp_path / "none", keep_last_n=2)
    epoch_run = tmp_path / "epoch_run"
    (epoch_run / "recipe_state").mkdir(parents=True)
    (epoch_run / "recipe_state" / "recipe_state.pt").write_bytes(b"state")
    cfg.checkpointer = {"output_dir": str(epoch_run), "recipe_checkpoint": None}
    fallback = find_resume_point(cfg, no_step_checkpoints, run_fingerprint(cfg))
    assert fallback.source is ResumeFrom.EPOCH_CHECKPOINT  # torchtune's resume, as stock
    changed = run_config(gradient_accumulation_steps=8)
    with pytest.raises(ValueError, match="'samples_per_step'.*8 in the checkpoint, 16 now"):
        find_resume_point(changed, checkpointer, run_fingerprint(changed))
    resume_off = run_config(resume_from_checkpoint=False)  # starts over: moves step 3 aside
    assert find_resume_point(resume_off, checkpointer, {}).source is ResumeFrom.START


def test_nothing_to_resume_names_both_folders_and_the_keys_that_write_one(tmp_path) -> None:
    cfg = run_config()
    cfg.checkpointer = {"output_dir": str(tmp_path / "run"), "recipe_checkpoint": None}
    empty = StepCheckpointer(tmp_path / "run" / "step_checkpoints", keep_last_n=2)
    with pytest.raises(ValueError) as err:
        find_resume_point(cfg, empty, run_fingerprint(cfg))
    message = str(err.value)
    assert str(tmp_path / "run" / "step_checkpoints") in message
    assert str(tmp_path / "run" / "recipe_state" / "recipe_state.pt") in message
    assert "save_every_n_steps" in message and "checkpointer.output_dir" in message


# --- loading weights into the configured model ---------------------------------------------


def test_weights_of_another_size_name_the_weight_and_both_shapes() -> None:
    model = tiny_model(embed_dim=16)
    other = tiny_model(embed_dim=32).state_dict()

    with pytest.raises(ValueError) as err:
        load_model_state(model, other, "/ckpt/model.safetensors")

    message = str(err.value)
    assert "/ckpt/model.safetensors" in message
    assert "config key 'model'" in message
    shapes = r"weight '([^']+)' has shape (\([^)]*\)) in the checkpoint and (\([^)]*\))"
    found = re.search(shapes, message)
    assert found, message
    key, in_checkpoint, in_model = found.groups()
    assert in_checkpoint == str(tuple(other[key].shape))
    assert in_model == str(tuple(model.state_dict()[key].shape))
    assert in_checkpoint != in_model


def test_missing_or_extra_weights_under_strict_name_the_source() -> None:
    model = tiny_model()
    state = model.state_dict()
    missing = {k: v for k, v in state.items() if k != "norm.scale"}
    with pytest.raises(ValueError, match=r"/ckpt/model\.safetensors does not fit config key"):
        load_model_state(model, missing, "/ckpt/model.safetensors")

    deeper = tiny_model(num_layers=2).state_dict()
    with pytest.raises(ValueError, match=r"/ckpt/deeper\.safetensors does not fit config key"):
        load_model_state(model, deeper, "/ckpt/deeper.safetensors")


def test_matching_weights_load_and_non_strict_tolerates_missing_keys() -> None:
    source = tiny_model(seed=3)
    model = tiny_model(seed=4)
    load_model_state(model, source.state_dict(), "source")
    assert_same_tensors(model.state_dict(), source.state_dict())

    partial = {k: v for k, v in tiny_model(seed=5).state_dict().items() if k != "norm.scale"}
    result = load_model_state(model, partial, "partial", strict=False)
    assert list(result.missing_keys) == ["norm.scale"]

    calls = []
    load_model_state(model, source.state_dict(), "custom", load=lambda m, sd: calls.append(sd))
    assert len(calls) == 1


def test_custom_loader_errors_are_reported_as_another_model() -> None:
    def failing_load(model: nn.Module, state_dict: dict) -> None:
        raise RuntimeError("size mismatch for a sharded parameter\nmore detail")

    with pytest.raises(ValueError, match="sharded does not fit config key 'model'"):
        load_model_state(tiny_model(), tiny_model().state_dict(), "sharded", load=failing_load)


# --- the manifest checks itself; load errors name the keys ---------------------------------


def test_bit_flip_in_the_manifest_counters_falls_back(tmp_path: Path) -> None:
    checkpointer = StepCheckpointer(tmp_path, keep_last_n=2)
    model = tiny_model()
    save_step(checkpointer, 2, model)
    latest = save_step(checkpointer, 3, model)
    manifest = latest / MANIFEST_FILE
    data = bytearray(manifest.read_bytes())
    digit = data.index(b'"global_step": 3') + len(b'"global_step": ')
    data[digit] ^= 0x01  # '3' -> '2': still valid JSON
    manifest.write_bytes(bytes(data))

    with pytest.warns(UserWarning, match=re.escape(str(manifest))):
        loaded = checkpointer.load_latest()
    assert loaded.step == 2


def test_missing_weights_are_named() -> None:
    model = tiny_model()
    missing = {k: v for k, v in model.state_dict().items() if k != "norm.scale"}
    with pytest.raises(ValueError, match="norm.scale"):
        load_model_state(model, missing, "/ckpt/model.safetensors")


def test_a_launch_that_starts_over_beside_a_checkpoint_of_its_run_says_how_to_go_on(
    tmp_path: Path, monkeypatch
) -> None:
    """One line, naming the checkpoint, where it went and the key; see also
    tests/test_resume_lineage.py for another run's checkpoints."""
    from exactga.run import resume

    lines: list[str] = []
    monkeypatch.setattr(resume.log, "info", lines.append)
    cfg = run_config(resume_from_checkpoint=False)
    fingerprint = run_fingerprint(cfg)
    checkpointer = StepCheckpointer(tmp_path / "step_checkpoints", keep_last_n=2)
    checkpointer.save(
        5,
        model_state=tiny_model().state_dict(),
        optimizer_state=None,
        trainer_state={"global_step": 5, "fingerprint": fingerprint},
        rank_state={"rng": capture_rng_state(CPU)},
    )
    assert find_resume_point(cfg, checkpointer, fingerprint).source is ResumeFrom.START
    (retired,) = (tmp_path / "retired_step_checkpoints").iterdir()
    assert len(lines) == 1 and str(tmp_path / "step_checkpoints") in lines[0]
    assert "(the newest, step_000005, is a step checkpoint of this run)" in lines[0]
    assert f"to {retired}" in lines[0]
    assert "this launch starts over" in lines[0] and "resume_from_checkpoint=True" in lines[0]
    assert checkpointer.list_steps() == [] and (retired / "step_000005").is_dir()


# --- a sharded run's checkpoint, on another mesh (see [resharded resume]) ----------------------


def _save_sharded(checkpointer: StepCheckpointer, step: int, seed: int) -> nn.Module:
    """A sharded run's step checkpoint (its ``sharded/`` files), written by one process."""
    from exactga.checkpoints.contents import sharded_train_state

    model, optimizer = trained(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        checkpointer.save(
            step,
            model_state=None,
            optimizer_state=None,
            sharded_state=sharded_train_state(model, optimizer),
            trainer_state={"global_step": step, "fingerprint": {}},
            rank_state={"rng": capture_rng_state(CPU), "dataloader": None},
        )
    return model


def test_a_damaged_shard_falls_back_and_the_weights_read_back_whole(tmp_path: Path) -> None:
    from exactga.run.checkpointing import SHARDED_SUBDIR, step_checkpoint_weights

    checkpointer = StepCheckpointer(tmp_path, keep_last_n=2)
    first = _save_sharded(checkpointer, 1, seed=1)
    _save_sharded(checkpointer, 2, seed=2)
    (shard,) = (tmp_path / "step_000002" / SHARDED_SUBDIR).glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:-10])

    with pytest.warns(UserWarning, match=rf"{re.escape(str(shard))} has \d+ bytes"):
        loaded = checkpointer.load_latest()
    assert loaded.step == 1 and loaded.model_state is None and loaded.sharded is not None
    assert_same_tensors(step_checkpoint_weights(loaded.path), first.state_dict())


def _resume_point(saved_world_size: int, world_size: int, position: dict) -> object:
    from exactga.run.checkpointing import StepCheckpoint
    from exactga.run.resume import ResumePoint

    found = StepCheckpoint(
        path=Path("/out/step_000003"),
        step=3,
        trainer_state={"data_position": position},
        model_state=None,
        optimizer_state=None,
        rank_state={"dataloader": {"loader": "rank 0's"}},
        world_size=saved_world_size,
    )
    return ResumePoint(ResumeFrom.STEP_CHECKPOINT, found, world_size)


def test_a_recipes_own_loader_and_another_epoch_length_refuse_another_mesh() -> None:
    position = {"data_parallel_ranks": 2, "samples_in_epoch": 24, "windows_per_epoch": 6}
    same = _resume_point(2, 2, position)
    assert not same.resharded and same.dataloader_state({}) == {"loader": "rank 0's"}
    same.check_epoch_length(7)  # the same mesh: its own loader state, nothing to compare

    resharded = _resume_point(2, 4, position)
    assert resharded.resharded and resharded.samples_done_in_epoch == 24
    with pytest.raises(ValueError, match="written by 2 ranks and this launch has 4"):
        resharded.dataloader_state({})  # GRPO's and PPO's loaders
    resharded.check_epoch_length(6)
    with pytest.raises(ValueError, match="on 4 ranks an epoch has 7 optimizer steps.*had 6"):
        resharded.check_epoch_length(7)
    with pytest.raises(ValueError, match="holds no data position over all ranks"):
        _ = _resume_point(2, 4, None).samples_done_in_epoch
