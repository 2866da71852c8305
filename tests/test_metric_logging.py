"""The TensorBoard runs the recipes' logger writes: one run per launch with a readable name,
the Overview copies first in the default tab, the report's lines in a group that sorts last,
and a resumed launch going on in its own run without the steps the killed launch logged past
its checkpoint; see [one TensorBoard run per launch], [resumed TensorBoard run] and [dashboard
order] in exactga.run.metric_logging. Real TensorBoard writers and readers, in-process."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from recipe_utils import logged_steps, read_scalars
from torchtune.training.metric_logging import DiskLogger, TensorBoardLogger

from exactga.profiling.report import REPORT_LINES, REPORT_RUN, ReportFile
from exactga.run.checkpointing import MANIFEST_FILE, STEP_CHECKPOINT_SUBDIR
from exactga.run.metric_logging import (
    OVERVIEW_COPIES,
    RUN_RECORD,
    RunLogger,
    flush_metric_logger,
    open_metric_logger,
)

TENSORBOARD = "torchtune.training.metric_logging.TensorBoardLogger"
# What the recipes log at a step with the profiler on (a subset, the Overview's sources in it).
PAYLOAD = {
    "loss": 7.5,
    "val/loss": 7.75,
    "lr": 1e-3,
    "grad_norm": 2.0,
    "throughput/tokens_per_second": 900.0,
    "throughput/tokens_per_second_so_far": 1000.0,
    "throughput/padding_fraction": 0.2,
    "throughput/padding_fraction_so_far": 0.25,
    "normalization/saved_ms": 1.5,
    "normalization/saved_fraction": 0.01,
}


def _cfg(log_dir: Path, component: str = TENSORBOARD, **extra):
    return OmegaConf.create({"_component_": component, "log_dir": str(log_dir), **extra})


def _save_step_checkpoint(output_dir: Path, step: int, crc: int) -> None:
    """What the recipes' step checkpointer leaves that the logger reads: a manifest's CRC."""
    folder = output_dir / STEP_CHECKPOINT_SUBDIR / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / MANIFEST_FILE).write_text(json.dumps({"step": step, "manifest_crc32": crc}))


def _launch(log_dir: Path, output_dir: Path, steps: range, resumed: bool = False, every: int = 5):
    """A launch logging loss = 100 * launch + step and a report line at ``steps``, saving a
    step checkpoint every ``every`` steps (then flushing, as the recipes do); its run folder."""
    logger = open_metric_logger(_cfg(log_dir), resumed=resumed, output_dir=str(output_dir))
    assert isinstance(logger, RunLogger)
    report = ReportFile.for_logger(logger)
    assert report is not None
    for step in steps:
        logger.log_dict({**PAYLOAD, "loss": float(step)}, step=step)
        report.write_lines({"": {f"{REPORT_LINES}/saved": float(step)}}, step=step)
        if step % every == 0:
            _save_step_checkpoint(output_dir, step, crc=hash((str(log_dir), time.time(), step)))
            flush_metric_logger(logger)
    report.close()
    logger.close()
    time.sleep(0.01)  # the next launch's files are newer
    return Path(logger.log_dir)


def _report_steps(run: Path) -> list[int]:
    """The steps of the report's line in ``run``, over its files (one per launch), each once."""
    steps = []
    for path in sorted((run / REPORT_RUN).glob("exactga_report.tfevents.*")):
        steps += logged_steps(path, tag=f"{REPORT_LINES}/saved")
    assert len(steps) == len(set(steps)), steps
    return sorted(steps)


def test_each_launch_is_a_run_of_its_own_with_a_readable_name(tmp_path):
    logs = tmp_path / "logs"
    first = _launch(logs, tmp_path / "out", range(1, 4))
    second = _launch(logs, tmp_path / "out", range(1, 4))  # within the same second, often
    assert first != second
    assert sorted(p.name for p in logs.iterdir()) == sorted([first.name, second.name])
    for folder in (first, second):
        assert re.fullmatch(r"run_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d(_\d+)?", folder.name), folder
        record = json.loads((folder / RUN_RECORD).read_text())
        assert record["output_dir"] == str((tmp_path / "out").resolve())


def test_the_run_folder_holds_the_overview_first_and_the_report_lines_last(tmp_path):
    """Which tags in which run folder: the launch's run holds the logged scalars under their
    names and the Overview copies, none empty; the report's lines are in the report's run,
    in the group that TensorBoard's tag order puts last."""
    run = _launch(tmp_path / "logs", tmp_path / "out", range(1, 7))
    scalars = read_scalars(run)  # the launch's own events.out.tfevents file
    overview = {tag for tag in scalars if tag.startswith("Overview/")}
    assert overview == {tag for tag, _ in OVERVIEW_COPIES.values()}
    assert set(PAYLOAD) <= set(scalars)
    assert all(len(values) == 6 for values in scalars.values())  # no empty series
    for name, (tag, factor) in OVERVIEW_COPIES.items():
        expected = [float(s) for s in range(1, 7)] if name == "loss" else [PAYLOAD[name]] * 6
        assert scalars[tag] == pytest.approx([factor * v for v in expected], rel=1e-6), tag
    assert not any(tag.startswith(REPORT_LINES) for tag in scalars)
    assert _report_steps(run) == list(range(1, 7))
    # TensorBoard's order of tag groups (its natural sort: code units): Overview first, the
    # report's lines after every lower-case group.
    groups = sorted({tag.split("/")[0] for tag in [*scalars, f"{REPORT_LINES}/saved"]})
    assert groups[0] == "Overview" and groups[-1] == REPORT_LINES


def test_a_resumed_launch_goes_on_in_its_own_run_without_the_steps_it_trains_again(tmp_path):
    logs, out = tmp_path / "logs", tmp_path / "out"
    killed = _launch(logs, out, range(1, 8))  # checkpoint at step 5, killed after step 7
    # A launch of another run in the same log_dir since: the newest folder, not the one to go on.
    other = _launch(logs, tmp_path / "elsewhere", range(1, 3))
    resumed = _launch(logs, out, range(6, 11), resumed=True)
    assert resumed == killed != other
    assert len(list(logs.iterdir())) == 2
    # logged_steps fails on a step logged twice; the steps before 6 are the killed launch's.
    assert logged_steps(killed) == {s: float(s) for s in range(1, 11)}
    assert _report_steps(killed) == list(range(1, 11))
    record = json.loads((killed / RUN_RECORD).read_text())
    assert len(record["step_checkpoints"]) == 2  # step 5, then the resumed launch's step 10


def test_a_resumed_launch_does_not_go_on_in_a_fresh_rerun_of_its_output_folder(tmp_path):
    """The issue's case: a run killed after its checkpoint, then a fresh rerun into the same
    output folder killed before its first checkpoint; resuming goes on from the first run's
    checkpoint, so in the first run's folder."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    killed = _launch(logs, out, range(1, 8))
    _launch(logs, out, range(1, 3))  # the rerun: no checkpoint
    assert _launch(logs, out, range(6, 9), resumed=True) == killed


def test_a_resumed_launch_without_a_recorded_run_starts_its_own(tmp_path):
    logs, out = tmp_path / "logs", tmp_path / "out"
    old = logs / "run_0_1795585991.7634"  # written before the records existed
    torchtune = TensorBoardLogger(log_dir=str(old), organize_logs=False)
    torchtune.log("loss", 1.0, step=1)
    torchtune.close()
    _save_step_checkpoint(out, 5, crc=1)
    resumed = _launch(logs, out, range(6, 8), resumed=True)
    assert resumed != old and logged_steps(old) == {1: 1.0}


def test_other_loggers_and_unorganized_logs_are_the_configs_logger(tmp_path):
    flat = open_metric_logger(_cfg(tmp_path / "b", organize_logs=False), resumed=True)
    assert type(flat) is TensorBoardLogger and flat.log_dir == str(tmp_path / "b")
    flat.close()
    disk = open_metric_logger(
        _cfg(tmp_path / "c", "torchtune.training.metric_logging.DiskLogger"), resumed=True
    )
    assert type(disk) is DiskLogger
    disk.close()


def test_flushing_puts_the_logged_steps_on_disk_before_the_writer_closes(tmp_path):
    logger = open_metric_logger(_cfg(tmp_path), resumed=False)
    logger.log_dict({"loss": 1.0}, step=1)
    flush_metric_logger(logger)
    assert logged_steps(tmp_path) == {1: 1.0}  # read while the writer is still open
    logger.close()
    flush_metric_logger(None)  # ranks without a logger


def test_the_config_summary_is_three_lines_and_the_whole_config_is_on_disk(
    tmp_path, capsys, monkeypatch
) -> None:
    from omegaconf import OmegaConf
    from unit_utils import tiny_config

    from exactga.run.metric_logging import log_config_summary

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = tiny_config("full_single_device", output_dir=str(tmp_path / "out"))
    path = log_config_summary("full_finetune_single_device", cfg)
    assert path == tmp_path / "out" / "resolved_config.yaml"
    assert OmegaConf.load(path) == OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"full_finetune_single_device: model llama3_2, data alpaca_dataset (json: "
        f"{cfg.dataset.data_files}), fp32 on cpu",
        "training: 1 epoch, at most 40 steps per epoch; each step batch_size 4 x "
        "gradient_accumulation_steps 2 x 2 ranks",
        f"outputs: {tmp_path / 'out'} (the full resolved config: {path})",
    ]
    monkeypatch.setenv("RANK", "1")  # the other ranks print and write nothing
    assert log_config_summary("full_finetune_single_device", cfg) is None
    assert capsys.readouterr().err == ""


def test_the_config_summary_names_what_grpo_has_instead() -> None:
    from unit_utils import tiny_config

    from exactga.run.metric_logging import config_summary

    cfg = tiny_config("grpo_distributed")
    lines = config_summary("grpo_full_finetune_distributed", cfg, "c.yaml")
    assert "rollout steps" in lines[1] and len(lines) == 3
