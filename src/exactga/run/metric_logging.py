"""The run's metric logger: the config's, and for a resumed run its TensorBoard curves go on in
the run folder they started in.

Note [resumed TensorBoard run]
torchtune's ``TensorBoardLogger`` writes each launch into a folder of its own
(``<log_dir>/run_<rank>_<time>``), so a run killed and resumed showed as two runs in
TensorBoard, its curves cut in two, and the killed half ran past the checkpoint the second half
starts from. A resumed run (``resume_from_checkpoint`` that found something to resume) therefore
writes into the newest ``run_<rank>_*`` folder of ``log_dir``, and at its first scalar drops
from the event files the killed launch left there (the profiling report's included) every
event at that scalar's step or later: the steps the resumed launch trains again. Each file is
rewritten beside itself and moved over it, so a kill then leaves the old file or the new one.
A ``SessionLog.START`` event would ask TensorBoard to do the same when it reads, but its
Python reader and ``EventAccumulator`` ignore it for the tensors scalars are stored as; files
that hold one curve suit every reader. Other loggers, ``organize_logs: False`` and fresh runs
are the config's logger as it is.

TensorBoard's writer keeps events in memory for up to two minutes, so a run killed before it
flushed lost the curve it had drawn, past every checkpoint. :func:`flush_metric_logger` runs with
each step checkpoint: what a resumed run does not train again is on disk.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torchtune import config
from torchtune.training.metric_logging import TensorBoardLogger

from exactga.runtime.distributed import is_rank_zero, log_rank_zero

_TENSORBOARD_COMPONENTS = {
    "torchtune.training.metric_logging.TensorBoardLogger",
    "torchtune.training.TensorBoardLogger",
}


def open_metric_logger(cfg_metric_logger: DictConfig, resumed: bool) -> Any:
    """The config's metric logger; a TensorBoard one of a ``resumed`` run appends to the run
    folder it resumes (see [resumed TensorBoard run])."""
    run_folder = _run_folder_to_append_to(cfg_metric_logger) if resumed else None
    if run_folder is None:
        return config.instantiate(cfg_metric_logger)
    kwargs = OmegaConf.to_container(cfg_metric_logger, resolve=True)
    assert isinstance(kwargs, dict)
    for key in ("_component_", "log_dir", "organize_logs"):
        kwargs.pop(key, None)
    return AppendingTensorBoardLogger(run_folder, **kwargs)


def open_run_logger(cfg: DictConfig, resumed: bool) -> Any | None:
    """The run's metric logger with the config logged to it, on global rank 0; ``None`` on
    the other ranks, which write no metrics. See [resumed TensorBoard run] for ``resumed``."""
    if not is_rank_zero():
        return None
    metric_logger = open_metric_logger(cfg.metric_logger, resumed=resumed)
    metric_logger.log_config(cfg)
    return metric_logger


RESOLVED_CONFIG_FILE = "resolved_config.yaml"


def log_config_summary(recipe_name: str, cfg: DictConfig) -> Path | None:
    """Three lines on what the run trains, on what, how and where, on global rank 0, and the
    full resolved config written to ``<output_dir>/resolved_config.yaml`` (its path returned):
    in place of torchtune's ``config.log_config``, which prints the whole config (about 100
    lines) before every run. Call it after validation; before the process group exists, rank
    is torchrun's ``RANK``."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    path = Path(cfg.output_dir) / RESOLVED_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True))
    for line in config_summary(recipe_name, cfg, path):
        print(line, file=sys.stderr, flush=True)
    return path


def config_summary(recipe_name: str, cfg: DictConfig, config_path: Path) -> list[str]:
    """The lines of :func:`log_config_summary`. A key a recipe's schema does not have (GRPO's
    ``num_steps``, another's ``max_steps_per_epoch``) is left out of the line, not defaulted."""
    present = OmegaConf.select  # None where the recipe has no such key
    dataset = cfg.dataset
    datasets = list(dataset) if OmegaConf.is_list(dataset) else [dataset]
    data = ", ".join(_component_name(section) for section in datasets)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    step = (
        f"batch_size {cfg.batch_size} x gradient_accumulation_steps "
        f"{present(cfg, 'gradient_accumulation_steps')} x {ranks} rank{'s' if ranks > 1 else ''}"
    )
    length = [f"{cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''}"]
    if present(cfg, "max_steps_per_epoch") is not None:
        length.append(f"at most {cfg.max_steps_per_epoch} steps per epoch")
    if present(cfg, "num_steps") is not None:
        length.append(f"at most {cfg.num_steps} rollout steps")
    return [
        f"{recipe_name}: model {_component_name(cfg.model)}, data {data}, "
        f"{present(cfg, 'dtype')} on {present(cfg, 'device')}",
        f"training: {', '.join(length)}; each step {step}",
        f"outputs: {cfg.output_dir} (the full resolved config: {config_path})",
    ]


def _component_name(section: DictConfig) -> str:
    """``alpaca_dataset (json: data.json)`` for ``torchtune.datasets.alpaca_dataset`` reading
    a local file; the builder's last name otherwise."""
    name = str(section.get("_component_", "?")).rsplit(".", 1)[-1]
    files = section.get("data_files")
    if files is None:
        source = section.get("source")
        return name if source is None else f"{name} ({source})"
    listed = files if isinstance(files, str) else ", ".join(map(str, _as_list(files)))
    return f"{name} ({section.get('source')}: {listed})"


def _as_list(value: Any) -> list[Any]:
    if OmegaConf.is_dict(value):
        return [item for nested in value.values() for item in _as_list(nested)]
    return list(value) if OmegaConf.is_list(value) else [value]


def report_outputs(
    profiler_summary: str, checkpoint_dir: str, metric_logger: Any | None, what: str
) -> None:
    """The run's closing lines, on rank 0: the profiler's summary, where ``what`` (its
    checkpoints) were written and where its TensorBoard logs are."""
    log_rank_zero(profiler_summary)
    log_rank_zero(f"{what} are in {checkpoint_dir}")
    log_dir = getattr(metric_logger, "log_dir", None)
    if log_dir is not None:
        log_rank_zero(f"TensorBoard logs are in {log_dir} (tensorboard --logdir <that>)")


def close_metric_logger(metric_logger: Any | None) -> None:
    """Close the run's metric logger, on the rank that has one."""
    if metric_logger is not None:
        metric_logger.close()


def flush_metric_logger(metric_logger: Any | None) -> None:
    """Write what the logger holds to disk (TensorBoard's writer), so a step checkpoint's
    steps are never lost with a killed process; see [resumed TensorBoard run]."""
    writer = getattr(metric_logger, "_writer", None)  # torchtune's TensorBoardLogger's
    if writer is not None and hasattr(writer, "flush"):
        writer.flush()


def _run_folder_to_append_to(cfg_metric_logger: DictConfig) -> str | None:
    """The newest ``run_<rank>_*`` folder of the config's ``log_dir``, or None."""
    if cfg_metric_logger.get("_component_") not in _TENSORBOARD_COMPONENTS:
        return None
    if not cfg_metric_logger.get("organize_logs", True):
        return None  # one folder for every launch already
    rank = int(os.environ.get("RANK", "0"))
    pattern = os.path.join(glob.escape(str(cfg_metric_logger.log_dir)), f"run_{rank}_*")
    folders = [path for path in glob.glob(pattern) if os.path.isdir(path)]
    if not folders:
        return None
    return max(folders, key=_started_at)


def _started_at(folder: str) -> float:
    """The launch time torchtune put in the folder's name (``run_0_1795585991.76``)."""
    try:
        return float(os.path.basename(folder).split("_", 2)[2])
    except (IndexError, ValueError):
        return os.path.getmtime(folder)


class AppendingTensorBoardLogger(TensorBoardLogger):
    """torchtune's ``TensorBoardLogger`` writing into an existing run folder, the killed
    launch's steps from its first scalar on dropped; see [resumed TensorBoard run]."""

    def __init__(self, run_folder: str, **kwargs: Any) -> None:
        self._opened_at = time.time()  # files older than this are the killed launch's
        super().__init__(log_dir=run_folder, organize_logs=False, **kwargs)
        self._drop_pending = True

    def log(self, name: str, data: Any, step: int) -> None:
        self._drop_killed_steps(step)
        super().log(name, data, step)

    def log_dict(self, payload: Any, step: int) -> None:
        self._drop_killed_steps(step)
        super().log_dict(payload, step)

    def _drop_killed_steps(self, first_step: int) -> None:
        if not self._drop_pending:
            return
        self._drop_pending = False
        if self._writer is None:  # ranks other than 0 write nothing
            return
        for path in sorted(Path(self.log_dir).rglob("events.out.tfevents.*")):
            if path.stat().st_mtime < self._opened_at:
                drop_steps_from(path, first_step)


def drop_steps_from(event_file: Path, first_step: int) -> int:
    """Rewrite ``event_file`` without its events at ``first_step`` or later (atomically);
    return how many it dropped. See [resumed TensorBoard run]."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    records = list(RawEventFileLoader(str(event_file)).Load())
    kept = [record for record in records if Event.FromString(record).step < first_step]
    if len(kept) == len(records):
        return 0
    partial = event_file.with_name(f".{event_file.name}.partial")  # TensorBoard skips it
    with open(partial, "wb") as out:
        writer = RecordWriter(out)
        for record in kept:
            writer.write(record)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, event_file)
    return len(records) - len(kept)
