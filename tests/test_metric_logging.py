"""A resumed run's TensorBoard curves go on in the run folder they started in, without the
steps the killed launch logged past its checkpoint; see [resumed TensorBoard run] in
exactga.run.metric_logging. Real TensorBoard writers and readers, in-process."""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import OmegaConf
from recipe_utils import logged_steps
from torch.utils.tensorboard import SummaryWriter
from torchtune.training.metric_logging import DiskLogger, TensorBoardLogger

from exactga.run.metric_logging import (
    AppendingTensorBoardLogger,
    flush_metric_logger,
    open_metric_logger,
)

TENSORBOARD = "torchtune.training.metric_logging.TensorBoardLogger"


def _cfg(log_dir: Path, component: str = TENSORBOARD, **extra):
    return OmegaConf.create({"_component_": component, "log_dir": str(log_dir), **extra})


def _killed_launch(log_dir: Path, last_step: int) -> Path:
    """A launch that logged loss = step at steps 1..last_step, and a profiling-report line in a
    run of its own below its folder, then died."""
    logger = open_metric_logger(_cfg(log_dir), resumed=False)
    for step in range(1, last_step + 1):
        logger.log_dict({"loss": float(step)}, step=step)
    report = SummaryWriter(str(Path(logger.log_dir) / "profiling_report" / "phases"))
    for step in range(1, last_step + 1):
        report.add_scalar("share", float(step), global_step=step, new_style=True)
    report.close()
    logger.close()
    time.sleep(0.01)  # the resumed launch's files are newer
    return Path(logger.log_dir)


def test_a_resumed_run_goes_on_in_its_run_folder_without_the_steps_it_trains_again(tmp_path):
    run_folder = _killed_launch(tmp_path / "logs", last_step=7)
    resumed = open_metric_logger(_cfg(tmp_path / "logs"), resumed=True)  # from checkpoint 5
    assert isinstance(resumed, AppendingTensorBoardLogger)
    assert Path(resumed.log_dir) == run_folder
    for step in range(6, 11):
        resumed.log_dict({"loss": 100.0 + step}, step=step)
    resumed.close()

    assert [p.name for p in (tmp_path / "logs").iterdir()] == [run_folder.name]
    # logged_steps fails on a step logged twice; the steps before 6 are the killed launch's.
    losses = logged_steps(run_folder)
    assert losses == {**{s: float(s) for s in range(1, 6)}, **{s: 100.0 + s for s in range(6, 11)}}
    assert list(logged_steps(run_folder / "profiling_report", tag="share")) == [1, 2, 3, 4, 5]


def test_the_newest_run_folder_is_the_one_resumed(tmp_path):
    _killed_launch(tmp_path / "logs", last_step=2)
    newest = _killed_launch(tmp_path / "logs", last_step=3)
    resumed = open_metric_logger(_cfg(tmp_path / "logs"), resumed=True)
    assert Path(resumed.log_dir) == newest
    resumed.close()


def test_fresh_runs_other_loggers_and_unorganized_logs_are_the_configs_logger(tmp_path):
    fresh = open_metric_logger(_cfg(tmp_path / "a"), resumed=True)  # nothing to append to
    assert type(fresh) is TensorBoardLogger
    fresh.close()
    _killed_launch(tmp_path / "b", last_step=1)
    started = open_metric_logger(_cfg(tmp_path / "b"), resumed=False)
    assert type(started) is TensorBoardLogger and len(list((tmp_path / "b").iterdir())) == 2
    started.close()
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
