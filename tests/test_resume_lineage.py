"""Unit tier of the resume lineage (issue #62): a launch that starts over moves an earlier
launch's step checkpoints aside (never deleting them), a save moves aside checkpoints of later
steps than its own, and a resumed launch's TensorBoard events go on in the run of the launch
whose checkpoint it resumes. See [retired step checkpoints] in exactga.run.checkpointing and
[resumed TensorBoard run] in exactga.run.metric_logging. In-process, on real step checkpoints;
the whole lineage through ``tune run`` (stop, start over, stop, resume) is in
tests/test_resume.py.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import torch
import unit_utils
from omegaconf import OmegaConf

from exactga.run.checkpointing import (
    MANIFEST_FILE,
    RETIRED_SUBDIR,
    STEP_CHECKPOINT_SUBDIR,
    StepCheckpointer,
)
from exactga.run.metric_logging import (
    RUN_RECORD,
    RunLogger,
    flush_metric_logger,
    open_metric_logger,
)
from exactga.run.resume import ResumeFrom, capture_rng_state, find_resume_point, run_fingerprint

CPU = torch.device("cpu")
TENSORBOARD = "torchtune.training.metric_logging.TensorBoardLogger"


def _weights(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(step))}


def _save(checkpointer: StepCheckpointer, step: int, fingerprint: dict | None = None) -> Path:
    return checkpointer.save(
        step,
        model_state=_weights(step),
        optimizer_state=None,
        trainer_state={"global_step": step, "fingerprint": fingerprint or {"batch_size": 2}},
        rank_state={"rng": capture_rng_state(CPU), "dataloader": None},
    )


def _config(output_dir: Path, **overrides: object):
    cfg = {
        "output_dir": str(output_dir),
        "batch_size": 2,
        "gradient_accumulation_steps": 4,
        "resume_from_checkpoint": False,
        "resume_allow_changed_keys": [],
        "checkpointer": {"output_dir": str(output_dir), "recipe_checkpoint": None},
    }
    return OmegaConf.create({**cfg, **overrides})


def _checkpointer(output_dir: Path, keep_last_n: int = 2, rank: int = 0, world_size: int = 1):
    return StepCheckpointer(output_dir / STEP_CHECKPOINT_SUBDIR, keep_last_n, rank, world_size)


# --- a launch that starts over ---------------------------------------------------------------


def test_starting_over_moves_every_earlier_checkpoint_aside_intact(tmp_path, monkeypatch):
    """The earlier launch's checkpoints (the issue's step 24 among them) go, whole and readable,
    into one new retired folder, and one line says where and how to go on from them; the
    launch's own first checkpoint is then the only one, and the one a resume goes on from."""
    from exactga.run import resume

    lines: list[str] = []
    monkeypatch.setattr(resume.log, "info", lines.append)
    earlier = _checkpointer(tmp_path)
    for step in (16, 24):
        _save(earlier, step)
    (earlier.root / ".step_000025.tmp").mkdir()  # a save the earlier launch did not finish
    cfg = _config(tmp_path)
    fingerprint = run_fingerprint(cfg)
    now = _checkpointer(tmp_path)
    assert find_resume_point(cfg, now, fingerprint).source is ResumeFrom.START

    (retired,) = (tmp_path / RETIRED_SUBDIR).iterdir()
    assert sorted(p.name for p in retired.iterdir()) == [
        ".step_000025.tmp",
        "step_000016",
        "step_000024",
    ]
    assert not now.root.exists()
    moved = StepCheckpointer(retired, keep_last_n=2).load_latest()  # intact where it went
    assert (
        moved is not None
        and moved.step == 24
        and torch.equal(moved.model_state["w"], _weights(24)["w"])
    )
    assert len(lines) == 1
    newest = "(the newest, step_000024, is a step checkpoint of a run with another config)"
    assert f"in {now.root} {newest}" in lines[0]
    assert f"to {retired}, " in lines[0] and f"put {retired} back as {now.root}" in lines[0]

    _save(now, 20, fingerprint)  # the rerun, stopped at step 20
    resumed = find_resume_point(_config(tmp_path, resume_from_checkpoint=True), now, fingerprint)
    assert (
        resumed.step_checkpoint is not None and resumed.step_checkpoint.path.name == "step_000020"
    )


def test_starting_over_in_an_empty_folder_moves_nothing_and_says_nothing(tmp_path, monkeypatch):
    from exactga.run import resume

    lines: list[str] = []
    monkeypatch.setattr(resume.log, "info", lines.append)
    checkpointer = _checkpointer(tmp_path)
    checkpointer.root.mkdir()
    (checkpointer.root / ".step_000003.tmp").mkdir()  # no checkpoint: a staging folder only
    find_resume_point(_config(tmp_path), checkpointer, {})
    assert lines == [] and not (tmp_path / RETIRED_SUBDIR).exists()


def test_two_launches_starting_over_in_one_second_retire_into_two_folders(tmp_path):
    first, second = _checkpointer(tmp_path), _checkpointer(tmp_path)
    _save(first, 4)
    retired_first = first.retire_all()
    _save(second, 4)
    retired_second = second.retire_all()
    assert retired_first is not None and retired_second is not None
    assert retired_first != retired_second  # same second, most likely: "_2"
    assert (retired_first / "step_000004").is_dir() and (retired_second / "step_000004").is_dir()


def _retire_on_rank(rank: int, output_dir: str) -> list:
    """One rank of a 2-rank launch starting over: rank 0 arrives late, so a rank that did not
    wait for its move would find the checkpoints still in place."""
    if rank == 0:
        time.sleep(0.5)
    checkpointer = _checkpointer(Path(output_dir), rank=rank, world_size=2)
    retired = checkpointer.retire_all()
    return [None if retired is None else str(retired), checkpointer.root.exists()]


def test_under_two_ranks_rank_0_moves_and_the_other_waits(tmp_path):
    _save(_checkpointer(tmp_path / "out"), 7)
    (tmp_path / "ranks").mkdir()
    results = unit_utils.run_on_ranks(
        _retire_on_rank, (str(tmp_path / "out"),), tmp_path / "ranks", world_size=2
    )
    (retired,) = (tmp_path / "out" / RETIRED_SUBDIR).iterdir()
    assert results == [[str(retired), False], [None, False]]
    assert (retired / "step_000007" / MANIFEST_FILE).is_file()


# --- a save of an earlier step than one in the folder ----------------------------------------


def test_a_save_moves_later_steps_aside_so_the_newest_is_the_one_just_saved(tmp_path):
    """A run resumed from step 4 because step 6 was damaged, then stopped after step 5: its
    stop saves step 5, and step 6 (not of its line) is moved aside rather than kept in place
    of step 2 by pruning, and standing newest."""
    checkpointer = _checkpointer(tmp_path, keep_last_n=3)
    for step in (2, 4, 6):
        _save(checkpointer, step)
    model_file = checkpointer.root / "step_000006" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:10])  # truncated
    with pytest.warns(UserWarning, match="falling back"):
        assert checkpointer.load_latest().step == 4
    with pytest.warns(
        UserWarning, match="moved step checkpoint step_000006 to .* a resume goes on from step 5"
    ):
        _save(checkpointer, 5)
    assert checkpointer.list_steps() == [2, 4, 5]
    (retired,) = (tmp_path / RETIRED_SUBDIR).iterdir()
    assert [p.name for p in retired.iterdir()] == ["step_000006"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is skipped any more
        assert checkpointer.load_latest().step == 5


def test_resaving_the_newest_step_moves_nothing(tmp_path):
    checkpointer = _checkpointer(tmp_path)
    _save(checkpointer, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _save(checkpointer, 3)  # a stop right after a periodic save at the same step
        _save(checkpointer, 4)
    assert checkpointer.list_steps() == [3, 4] and not (tmp_path / RETIRED_SUBDIR).exists()


# --- the TensorBoard run a resumed launch goes on in -----------------------------------------


def _launch_logging(log_dir: Path, out: Path, steps: range, saves: list[int], resumed=False):
    """A launch of the tiny model's checkpoints logging ``loss = step`` at ``steps`` and saving
    a step checkpoint (then flushing, as the recipes do) after each step in ``saves``."""
    logger = open_metric_logger(
        OmegaConf.create({"_component_": TENSORBOARD, "log_dir": str(log_dir)}),
        resumed=resumed,
        output_dir=str(out),
    )
    assert isinstance(logger, RunLogger)
    checkpointer = _checkpointer(out)
    for step in steps:
        logger.log("loss", float(step), step=step)
        if step in saves:
            _save(checkpointer, step)
            flush_metric_logger(logger)
    logger.close()
    time.sleep(0.01)  # the next launch starts later
    return Path(logger.log_dir)


def _record(run: Path) -> dict:
    return json.loads((run / RUN_RECORD).read_text())


def test_a_resumed_launch_goes_on_in_the_run_of_the_launch_that_started_over(tmp_path):
    """The issue's case: A saved steps 2 and 4 and stopped; B (same config, so bit-identical
    checkpoints: the same identities) started over, moving A's aside, and stopped after step
    2. B's resume goes on in B's run, though A's run recorded the very same checkpoint."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    run_a = _launch_logging(logs, out, range(1, 5), saves=[2, 4])
    _checkpointer(out).retire_all()  # B starts over
    run_b = _launch_logging(logs, out, range(1, 3), saves=[2])
    (step_2_id,) = _record(run_b)["step_checkpoints"]
    assert step_2_id in _record(run_a)["step_checkpoints"]  # the same checkpoint
    resumed = _launch_logging(logs, out, range(3, 5), saves=[4], resumed=True)
    assert resumed == run_b != run_a


def test_the_record_holds_every_checkpoint_of_the_line_not_only_the_newest(tmp_path):
    """A resumed launch that skipped a damaged newer checkpoint records the one it saved."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    checkpointer = _checkpointer(out, keep_last_n=3)
    run = _launch_logging(logs, out, range(1, 3), saves=[1, 2])
    assert len(_record(run)["step_checkpoints"]) == 2
    _save(checkpointer, 3)  # written after the logger's last flush (a kill in between)
    resumed = _launch_logging(logs, out, range(4, 5), saves=[4], resumed=True)
    assert resumed == run and len(_record(run)["step_checkpoints"]) == 4
