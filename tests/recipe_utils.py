"""Helpers for the recipe tests: run ``tune run`` and read what it wrote.

Tests run recipes only as ``tune run`` starts them (docs/contributing.md point 10): nothing here
imports a recipe. Every run is offline. ``run_recipe`` forks the run's ranks from a server that
made the imports once (tests/launcher.py), for the tests of a run; ``run_tune`` is a real
``tune`` process, for the tests of a launch (torchrun, signals, a fresh console).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import launcher
import torch
from tiny_runs import (  # noqa: F401 - re-exported for the tests
    SMALL_MODEL,
    TUNE,
    logged_steps,
    output_of,
    run_tune,
    tune_env,
)

# The one relative L2 of the project, as the docs define it: ||w - w_ref|| / ||w_ref - w_init||
# over every tensor, in float64 (see exactga.parity.scoring).
from exactga.parity.scoring import relative_l2  # noqa: F401 - re-exported for the tests

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/full_finetune.py"
TINY_CONFIG = "configs/tiny/full_single_device.yaml"

# What a full fine-tuning run writes: its initial checkpoint and the trained weights of epoch 0.
INITIAL = "base_model/model.safetensors"
TRAINED = "epoch_0/model-00001-of-00001.safetensors"


def run_recipe(
    args: list[str],
    cwd: Path | str = REPO_ROOT,
    extra_env: dict[str, str | None] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``tune run *args`` from ``cwd`` with its ranks forked (tests/launcher.py: what a run
    shows, not a launch), stdout and stderr captured as text."""
    return launcher.run_recipe(args, cwd, tune_env(extra_env), timeout=timeout)


def tune_in_process(*args: str) -> str:
    """What ``tune <args>`` prints (``ls``, ``cp``: no recipe runs), run in this interpreter by
    torchtune's own parser; the start-up hook has patched its registry here as in any other. A
    ``tune`` process of its own would spend about 7 s of CPU importing torchtune for a copy."""
    from torchtune._cli.tune import TuneCLIParser

    parser = TuneCLIParser()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        parser.run(parser._parser.parse_args(list(args)))
    return printed.getvalue()


def tiny_args(output_dir: Path | str, **overrides: object) -> list[str]:
    """Recipe, tiny config, small-model overrides and ``output_dir``, then ``overrides``.

    Keyword names are config keys with ``.`` written as ``__`` (``optimizer__lr=0.1``); a later
    key wins, so ``overrides`` may also replace a small-model size.
    """
    merged: dict[str, object] = dict(SMALL_MODEL)
    merged["output_dir"] = str(output_dir)
    merged.update({key.replace("__", "."): value for key, value in overrides.items()})
    return [RECIPE, "--config", TINY_CONFIG, *(f"{k}={v}" for k, v in merged.items())]


def load_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file."""
    from safetensors.torch import load_file

    return load_file(str(path))


def read_scalars(log_root: Path | str) -> dict[str, list[float]]:
    """Every scalar logged under ``log_root`` (TensorBoard events), by tag, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    event_files = sorted(Path(log_root).rglob("events.out.tfevents.*"))
    assert event_files, f"no TensorBoard events under {log_root}"
    scalars: dict[str, list[tuple[int, float]]] = {}
    for event_file in event_files:
        ea = EventAccumulator(str(event_file), size_guidance={"tensors": 0, "scalars": 0})
        ea.Reload()
        tags = ea.Tags()
        for tag in tags.get("tensors", []):
            for e in ea.Tensors(tag):
                if e.tensor_proto.string_val:  # text and layouts, not scalars
                    continue
                value = float(make_ndarray(e.tensor_proto).reshape(-1)[0])
                scalars.setdefault(tag, []).append((e.step, value))
        for tag in tags.get("scalars", []):
            for e in ea.Scalars(tag):
                scalars.setdefault(tag, []).append((e.step, float(e.value)))
    return {tag: [v for _, v in sorted(values)] for tag, values in scalars.items()}


LORA_RECIPE = "recipes/lora_finetune.py"
LORA_TINY_CONFIG = "configs/tiny/lora_single_device.yaml"
QLORA_TINY_CONFIG = "configs/tiny/qlora_single_device.yaml"


def lora_tiny_args(
    output_dir: Path | str, config: str = LORA_TINY_CONFIG, **overrides: object
) -> list[str]:
    """:func:`tiny_args` for the LoRA recipe: the tiny LoRA (or QLoRA) config, same overrides.

    The base model under ``checkpointer.model`` follows ``model.*`` by interpolation, so the
    small-model overrides shrink both.
    """
    return [LORA_RECIPE, "--config", config, *tiny_args(output_dir, **overrides)[3:]]


def load_adapters(path: Path | str) -> dict[str, torch.Tensor]:
    """The adapter weights of ``adapter_model.pt`` (torchtune's names and layout)."""
    return torch.load(str(path), map_location="cpu", weights_only=True)


def alpaca_row(instruction: str, output: str) -> dict[str, str]:
    """One row in the shipped data's format (``alpaca_dataset``), without an input."""
    return {"instruction": instruction, "input": "", "output": output}


def rows_with_an_empty_window() -> list[dict[str, str]]:
    """Twelve rows that, unshuffled, with ``batch_size=2``, ``gradient_accumulation_steps=2`` and
    ``tokenizer.max_seq_len=64``, give three windows: [long long | long long] has no loss token
    (prompts longer than max_seq_len leave every label masked), [short short | long long] has
    one empty micro-batch, and [short short | short short] is plain."""
    long_prompt = " ".join(["describe the weather in a very long sentence"] * 30)  # 270 words
    long_rows = [alpaca_row(long_prompt, "It is sunny.") for _ in range(2)]
    short_rows = [alpaca_row("Say hello.", "Hello there, friend.") for _ in range(2)]
    return long_rows * 2 + short_rows + long_rows + short_rows * 2


# The overrides (for tiny_args) under which rows_with_an_empty_window() gives its three windows.
EMPTY_WINDOW_RUN = {
    "tokenizer__max_seq_len": 64,
    "shuffle": False,
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_steps_per_epoch": 3,
}


# --- killing a launch ------------------------------------------------------------------------


def launch_and_kill(
    args: list[str],
    log_path: Path,
    ready: Callable[[], bool],
    timeout_s: float = 300.0,
    delay_s: float = 0.0,
    extra_env: dict[str, str | None] | None = None,
) -> None:
    """Start ``tune run args`` (``run_recipe``'s forked ranks, ``extra_env`` as its), and SIGKILL
    every rank ``delay_s`` after ``ready()`` first holds; fail if it ends by itself before. The
    ranks' output goes to ``log_path``."""
    folder = log_path.with_name(f"{log_path.name}.ranks")
    run = launcher.start_recipe(args, REPO_ROOT, tune_env(extra_env), folder)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready() and run.poll() is None:
            assert time.monotonic() < deadline, "the run did not reach its kill point"
            time.sleep(0.02)
        time.sleep(delay_s)
        ended = run.poll() is not None
    finally:
        run.kill()  # returns once every rank is gone: nothing writes into the folder after
        log_path.write_text(run.stdout.read_text() + run.stderr.read_text())
    assert not ended, f"the run ended before its kill:\n{log_path.read_text()[-3000:]}"


def kill_launch(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGKILL a real ``tune run`` launch (``subprocess.Popen``) and every process it started,
    and wait until all are gone. torchrun starts each rank in a session of its own, so killing
    the launcher's process group would leave the ranks training on: they are found under the
    launcher in /proc and killed by their ids."""
    descendants = _descendants(proc.pid)
    for pid in [proc.pid, *descendants]:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + timeout_s
    while any(_is_running(pid) for pid in descendants):
        assert time.monotonic() < deadline, f"processes {descendants} outlived SIGKILL"
        time.sleep(0.02)


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (read from Linux's /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):  # a process that ended meanwhile
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        started = children.get(todo.pop(), [])
        found += started
        todo += started
    return found


def _is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- what a resumed run trained --------------------------------------------------------------


def latest_step_checkpoint(output_dir: Path | str) -> int:
    """The newest complete step checkpoint under ``output_dir/step_checkpoints`` (0 if none): a
    checkpoint is renamed into place whole, so a killed save leaves only a hidden staging
    folder, which this does not count."""
    root = Path(output_dir) / "step_checkpoints"
    steps = [int(p.name.split("_")[1]) for p in root.glob("step_*")] if root.is_dir() else []
    return max(steps, default=0)


# A tiny Qwen3 MoE (the router-term tests: test_ga_parity_router, test_editing_recipes).
TINY_QWEN3_MOE = {
    "_component_": "exactga.models.qwen3_moe.qwen3_moe",
    "vocab_size": 2048,  # the tiny tokenizer's 2000 pieces, rounded up
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "head_dim": 16,
    "moe_intermediate_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_seq_len": 512,
}


# torch.compile without inductor's code generation, for a run's ``env`` (tests/many_runs.py's
# ``Run``; torchtune's compile_model and compile_loss read the variable at each call): dynamo's
# capture and AOT autograd's forward and backward graphs, the graphs a compiled step runs, each
# run by aten's eager kernels. A tiny run compiles in about 5 s of CPU instead of inductor's 40;
# inductor's own kernels are tests/test_compile_launch.py's.
COMPILE_WITHOUT_INDUCTOR = {"TORCH_COMPILE_BACKEND": "aot_eager"}
_COMPILE_LINE = re.compile(
    r"exactga: torch\.compile: (\d+) graphs? .*?, (?:at least )?\d+ recompilations? .*?, "
    r"(\d+) graph breaks?"
)


class CompileLine(NamedTuple):
    """What a run's end-of-run ``torch.compile`` line reports (exactga.profiling.compilations):
    its graphs and graph breaks, and the line itself (the breaks' reasons follow the counts)."""

    graphs: int
    graph_breaks: int
    text: str


def compile_line(output: str) -> CompileLine:
    """The end-of-run ``torch.compile`` line of a run's output; rank 0 prints it."""
    found = list(_COMPILE_LINE.finditer(output))
    assert len(found) == 1, f"expected one end-of-run compile line, found {len(found)}"
    graphs, breaks = (int(group) for group in found[0].groups())
    text = output[found[0].start() :].split("\n")[0]
    return CompileLine(graphs, breaks, text)


def assert_compiled(output: str) -> CompileLine:
    """The run's compile line, after checking that it compiled graphs and broke none."""
    line = compile_line(output)
    assert line.graphs > 0, "compile: True compiled nothing"
    assert line.graph_breaks == 0, line.text
    return line
