"""The run's metric logger: the config's; a TensorBoard one writes each launch as a run of its
own with a readable name, its headline charts first, and a resumed launch goes on in its run.

Note [one TensorBoard run per launch]
torchtune's ``TensorBoardLogger`` names a launch's folder ``run_<rank>_<unix time>``
(``run_0_1795585991.7634``), which says nothing to a reader and, in TensorBoard's run list,
is cut off before its end. A launch here writes into ``<log_dir>/run_<date>_<time>``
(``run_2026-11-27_06-40-12``, local time; ``_2``, ``_3`` ... when a launch in the same second
took the name), on rank 0, the only rank that logs. Beside its event files the folder holds
``exactga_run.json`` (TensorBoard reads only files whose name holds ``tfevents``): the output
folder the launch trained into, when it started, and the identity (the manifest's CRC32) of
every step checkpoint of its line in that folder, recorded each time one is written
(:func:`flush_metric_logger` runs with each step checkpoint): all those there, not only the
newest by step, so one skipped as damaged cannot stand for the one just written. They are all
of its line, since a launch that starts over first moves an earlier launch's aside (see
[retired step checkpoints] in exactga.run.checkpointing).

Note [resumed TensorBoard run]
A run killed and resumed used to show as two runs in TensorBoard, its curves cut in two, and
the killed half ran past the checkpoint the second half starts from; appending instead into
the newest run folder of ``log_dir`` appended into another launch's run whenever one had
started there in between (a fresh rerun into the same output folder, say). A resumed run
(``resume_from_checkpoint`` that found something to resume) therefore writes into the run
folder that *recorded the step checkpoint it resumes from* (see [one TensorBoard run per
launch]): the newest step checkpoint of ``<output_dir>/step_checkpoints`` that a run folder
recorded (the newest one itself unless a kill came between writing it and recording it), and
of the run folders that recorded it, the one whose launch started last. Two launches of one
config write bit-identical checkpoints, so one identity may be in the records of an earlier
launch and of the launch that started over after it; the checkpoints in the folder are the
later one's, the earlier one's having been moved aside, so the later launch's run is the one
that goes on (issue #62);
without step checkpoints (an epoch resume), the newest run folder recorded for the same output
folder; and a run of its own when no folder qualifies (logs written before these records, or a
resumed launch given another ``log_dir``), never another launch's. At its first scalar it drops
from the event files the killed launch left there (the profiling report's included) every
event at that scalar's step or later: the steps the resumed launch trains again. Each file is
rewritten beside itself and moved over it, so a kill then leaves the old file or the new one.
A ``SessionLog.START`` event would ask TensorBoard to do the same when it reads, but its
Python reader and ``EventAccumulator`` ignore it for the tensors scalars are stored as; files
that hold one curve suit every reader. Other loggers and ``organize_logs: False`` (one folder
for every launch) are the config's logger as it is.

TensorBoard's writer keeps events in memory for up to two minutes, so a run killed before it
flushed lost the curve it had drawn, past every checkpoint. :func:`flush_metric_logger` runs with
each step checkpoint: what a resumed run does not train again is on disk.

Note [dashboard order]
TensorBoard opens on its TIME SERIES tab, which draws a card per tag, groups the cards by the
tag's part before its first ``/`` (a tag without one is a group of its own: ``loss``, ``lr``),
orders the tags with its natural sort (digits and ``/`` before every other character, then
character codes: upper-case letters before ``_`` before lower-case ones) and expands only the
first two groups. The recipes' scalars (``grad_norm``, ``loss``, ``lr``, ``throughput/...``)
made eleven groups, ``loss`` and ``lr`` collapsed behind ``exactga_report`` and ``grad_norm``.
So the logger also writes the figures a reader looks for first, each a copy of a logged
scalar at the same step, into the group ``Overview`` (upper case: it sorts first):
``Overview/loss``, ``Overview/loss_validation`` (``val/loss``, in runs that validate: see
docs/validation.md), ``Overview/lr``, ``Overview/padding_%_so_far`` (``100 *
padding_fraction_so_far``, the end-of-run line's figure), ``Overview/saved_latency_ms`` (the
samples' median so far) and ``Overview/tokens_per_second_so_far`` (processed, padding
included; the TEXT summary's figure). The figures are the run's so far rather than the
interval's, which on a shared machine jump from step to step: TensorBoard fits a chart's y
axis to the 5 % to 95 % quantiles of its smoothed line ("Ignore outliers in chart scaling",
on by default), padded by 5 % of that range, and cuts off the rest, which cut the interval's
padding and throughput in the demo at many steps. A figure so far can still leave its first
one or two points below or above the chart, when they are that far from the rest. The logged
scalars keep their names, so scripts and the SCALARS tab read what they read before; the
report's chart lines, which exist for the CUSTOM SCALARS tab, are in the group
``~report_lines``, which sorts last (see [report charts] in exactga.profiling.report).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torchtune import config
from torchtune.training.metric_logging import TensorBoardLogger

from exactga.config.schemas import SingleDeviceRecipeConfig
from exactga.config.validation import torchtune_config
from exactga.run.checkpointing import MANIFEST_FILE, STEP_CHECKPOINT_SUBDIR
from exactga.runtime.distributed import is_rank_zero, log_rank_zero

_TENSORBOARD_COMPONENTS = {
    "torchtune.training.metric_logging.TensorBoardLogger",
    "torchtune.training.TensorBoardLogger",
}
RUN_RECORD = "exactga_run.json"  # beside a run's event files; see [one TensorBoard run per launch]
_STEP_FOLDER = re.compile(r"^step_(\d+)$")  # exactga.run.checkpointing's step folders

# Logged scalar -> (its copy in the Overview group, the factor it is copied with); see
# [dashboard order].
OVERVIEW_COPIES = {
    "loss": ("Overview/loss", 1.0),
    "val/loss": ("Overview/loss_validation", 1.0),  # beside the training loss, same step axis
    "lr": ("Overview/lr", 1.0),
    "throughput/tokens_per_second_so_far": ("Overview/tokens_per_second_so_far", 1.0),
    "normalization/saved_ms": ("Overview/saved_latency_ms", 1.0),
    "throughput/padding_fraction_so_far": ("Overview/padding_%_so_far", 100.0),
}


def _organize_logs(cfg_metric_logger: DictConfig) -> bool:
    """The section's ``organize_logs``, else the default of torchtune's ``TensorBoardLogger``
    (read from its signature, not restated here)."""
    if "organize_logs" in cfg_metric_logger:
        return bool(cfg_metric_logger.organize_logs)
    return inspect.signature(TensorBoardLogger).parameters["organize_logs"].default


def open_metric_logger(
    cfg_metric_logger: DictConfig, resumed: bool, output_dir: str | None = None
) -> Any:
    """The config's metric logger; a TensorBoard one is a :class:`RunLogger` writing a run of
    its own, or for a ``resumed`` run the run it resumes, of the launch training into
    ``output_dir`` (see [one TensorBoard run per launch], [resumed TensorBoard run])."""
    if cfg_metric_logger.get("_component_") not in _TENSORBOARD_COMPONENTS or not (
        _organize_logs(cfg_metric_logger)
    ):
        return config.instantiate(cfg_metric_logger)
    kwargs = OmegaConf.to_container(cfg_metric_logger, resolve=True)
    assert isinstance(kwargs, dict)
    log_dir = Path(kwargs.pop("log_dir"))
    for key in ("_component_", "organize_logs"):
        kwargs.pop(key, None)
    own_run = resumed_run_folder(log_dir, output_dir) if resumed else None
    run_folder = own_run if own_run is not None else new_run_folder(log_dir)
    return RunLogger(run_folder, output_dir, appending=own_run is not None, **kwargs)


def open_run_logger(settings: SingleDeviceRecipeConfig, resumed: bool) -> Any | None:
    """The run's metric logger with the config logged to it, on global rank 0; ``None`` on
    the other ranks, which write no metrics. See [resumed TensorBoard run] for ``resumed``."""
    if not is_rank_zero():
        return None
    metric_logger = open_metric_logger(
        settings.metric_logger, resumed=resumed, output_dir=settings.output_dir
    )
    metric_logger.log_config(torchtune_config(settings))  # torchtune's loggers take a config
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
    # PPO derives its epochs from num_steps (its ``epochs`` is None) and names its model
    # policy_model.
    epochs = present(cfg, "epochs")
    length = [f"{epochs} epoch{'s' if epochs != 1 else ''}"] if epochs is not None else []
    if present(cfg, "max_steps_per_epoch") is not None:
        length.append(f"at most {cfg.max_steps_per_epoch} steps per epoch")
    if present(cfg, "num_steps") is not None:
        unit = "trajectories" if present(cfg, "policy_model") is not None else "rollout steps"
        length.append(f"at most {cfg.num_steps} {unit}")
    model = present(cfg, "model") or present(cfg, "policy_model")
    return [
        f"{recipe_name}: model {_component_name(model)}, data {data}, "
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
    checkpoints) were written and the command that shows its TensorBoard run."""
    log_rank_zero(profiler_summary)
    log_rank_zero(f"{what} are in {checkpoint_dir}")
    log_dir = getattr(metric_logger, "log_dir", None)
    if log_dir is None:
        return
    if isinstance(metric_logger, RunLogger):  # its folder is one run among the log_dir's
        runs = Path(log_dir).parent
        log_rank_zero(
            f"TensorBoard: run {Path(log_dir).name} in {runs} (tensorboard --logdir {runs})"
        )
    else:
        log_rank_zero(f"TensorBoard logs are in {log_dir} (tensorboard --logdir <that>)")


def close_metric_logger(metric_logger: Any | None) -> None:
    """Close the run's metric logger, on the rank that has one."""
    if metric_logger is not None:
        metric_logger.close()


def flush_metric_logger(metric_logger: Any | None) -> None:
    """Write what the logger holds to disk (TensorBoard's writer), so a step checkpoint's
    steps are never lost with a killed process, and record the step checkpoint just written
    in the run's folder; see [resumed TensorBoard run]. Runs after each step checkpoint."""
    writer = getattr(metric_logger, "_writer", None)  # torchtune's TensorBoardLogger's
    if writer is not None and hasattr(writer, "flush"):
        writer.flush()
    if isinstance(metric_logger, RunLogger):
        metric_logger.record_step_checkpoints()


def new_run_folder(log_dir: Path) -> Path:
    """A new ``<log_dir>/run_<date>_<time>`` folder; see [one TensorBoard run per launch]."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 1000):
        folder = log_dir / (f"run_{stamp}" if attempt == 1 else f"run_{stamp}_{attempt}")
        try:
            folder.mkdir()  # atomic: two launches in one second get two folders
        except FileExistsError:
            continue
        return folder
    raise RuntimeError(f"no free run folder name for {stamp} in {log_dir}")


def resumed_run_folder(log_dir: Path, output_dir: str | None) -> Path | None:
    """The run folder of ``log_dir`` that a launch resuming in ``output_dir`` goes on in, or
    ``None``: see [resumed TensorBoard run]."""
    if output_dir is None or not log_dir.is_dir():
        return None
    records = {}
    for record_file in log_dir.glob(f"*/{RUN_RECORD}"):
        try:
            records[record_file.parent] = json.loads(record_file.read_text())
        except (OSError, ValueError):
            continue  # a damaged record names no run
    for checkpoint_id in step_checkpoint_ids(output_dir):  # newest first
        recorded_it = [
            folder
            for folder, record in records.items()
            if checkpoint_id in record.get("step_checkpoints", [])
        ]
        if recorded_it:  # the launch that started last: the folder's line is its
            return max(recorded_it, key=lambda folder: _started(records[folder]))
    same_output = [
        folder
        for folder, record in records.items()
        if record.get("output_dir") == os.path.abspath(output_dir)
    ]
    return max(same_output, key=lambda folder: _started(records[folder]), default=None)


def _started(record: dict[str, Any]) -> float:
    started = record.get("started", 0.0)
    return float(started) if isinstance(started, (int, float)) else 0.0


def step_checkpoint_ids(output_dir: str) -> list[int]:
    """The identities (manifest CRC32s) of the step checkpoints in ``output_dir``, newest
    first; checkpoints whose manifest does not read are left out."""
    root = Path(output_dir) / STEP_CHECKPOINT_SUBDIR
    steps = [
        (int(match.group(1)), path)
        for path in (root.iterdir() if root.is_dir() else [])
        if (match := _STEP_FOLDER.match(path.name))
    ]
    ids = []
    for _, path in sorted(steps, reverse=True):
        try:
            ids.append(int(json.loads((path / MANIFEST_FILE).read_text())["manifest_crc32"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return ids


class RunLogger(TensorBoardLogger):
    """torchtune's ``TensorBoardLogger`` writing one launch's run (see [one TensorBoard run per
    launch]) with the Overview copies (see [dashboard order]); ``appending`` into a resumed
    run's folder, from its first scalar on without the killed launch's steps (see [resumed
    TensorBoard run])."""

    def __init__(
        self, run_folder: Path, output_dir: str | None, appending: bool, **kwargs: Any
    ) -> None:
        self._opened_at = time.time()  # files older than this are the killed launch's
        super().__init__(log_dir=str(run_folder), organize_logs=False, **kwargs)
        self._drop_pending = appending
        self._record_path = run_folder / RUN_RECORD
        self._record = self._read_record() if appending else {}
        self._record.setdefault("output_dir", output_dir and os.path.abspath(output_dir))
        self._record.setdefault("started", self._opened_at)
        self._record.setdefault("step_checkpoints", [])
        self._write_record()

    def log(self, name: str, data: Any, step: int) -> None:
        self._drop_killed_steps(step)
        super().log(name, data, step)

    def log_dict(self, payload: Any, step: int) -> None:
        self._drop_killed_steps(step)
        overview = {
            tag: factor * float(payload[name])
            for name, (tag, factor) in OVERVIEW_COPIES.items()
            if name in payload
        }
        super().log_dict({**payload, **overview}, step)

    def record_step_checkpoints(self) -> None:
        """Add the step checkpoints of the run's output folder (all of its line: see [one
        TensorBoard run per launch]) to its record."""
        output_dir = self._record["output_dir"]
        ids = step_checkpoint_ids(output_dir) if output_dir else []
        recorded = self._record["step_checkpoints"]
        new = [checkpoint_id for checkpoint_id in reversed(ids) if checkpoint_id not in recorded]
        if self._writer is None or not new:
            return
        recorded.extend(new)
        self._write_record()

    def _read_record(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self._record_path.read_text()))
        except (OSError, ValueError):
            return {}

    def _write_record(self) -> None:
        if self._writer is None:  # ranks other than 0 write nothing
            return
        partial = self._record_path.with_name(f".{RUN_RECORD}.partial")
        partial.write_text(json.dumps(self._record, indent=1))
        os.replace(partial, self._record_path)  # a kill leaves the old record or the new one

    def _drop_killed_steps(self, first_step: int) -> None:
        if not self._drop_pending:
            return
        self._drop_pending = False
        if self._writer is None:
            return
        # The logger's files (events.out.tfevents.*) and the report's (exactga_report.tfevents.*).
        for path in sorted(Path(self.log_dir).rglob("*.tfevents.*")):
            if not path.name.startswith(".") and path.stat().st_mtime < self._opened_at:
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
