"""The first hour's figure: how long ``make demo`` takes, on an idle machine and beside a busy one.

Launches the demo, ``tune run recipes/full_finetune.py --config
configs/tiny/full_single_device.yaml`` from the repository root, as a real subprocess in its own
output folder, under four conditions:

- load ``idle``: nothing else started; ``busy``: a neighbour that keeps one core fully busy
  (``python -c "while True: pass"``, started a second before the launch and killed after it);
- threads ``auto``: the recipe's own choice (``cpu_threads`` unset, ``OMP_NUM_THREADS``
  unset; see Note [cpu threads] in ``src/exactga/runtime/threads.py``); ``torch_default``:
  ``cpu_threads=<n>``, n being ``torch.get_num_threads()`` of a fresh interpreter without
  ``OMP_NUM_THREADS``, i.e. the count torch would have started with before the recipes chose.

Per load the two thread settings run as a pair, their order flipped every repeat (auto,
torch_default, then torch_default, auto, ...), so that a drift in the machine's speed hits both;
the ratio torch_default / auto is taken pair by pair. Every launch gets a new output folder, so
its initial checkpoint is written too, as on a user's first ``make demo``.

Per condition it prints one table row: the thread count the recipe logged (its ``CPU threads:``
line) and what it saw free, the median wall time of the whole ``tune run`` process, the median
training step (the run's ``time/step_ms`` TensorBoard scalar over the steps after the first two)
and the training time (the sum of ``time/step_ms`` over every step), and the neighbour's share of
a core over the launch (its own CPU time over its lifetime, from ``os.wait4``). Then the ratios.
The same, with every launch, goes to ``<out>/results.json``.

Run from the repository root (default: the whole demo, 40 steps, 1 repeat; about 7 minutes on 2
cores, most of it the busy torch_default launch)::

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/first_hour.py --repeats 2

``--steps N`` trains N steps (``max_steps_per_epoch``) instead of the demo's 40; ``--loads`` and
``--threads`` run a subset of the grid; ``--out DIR`` (default
``outputs/benchmarks/first_hour``) holds the run folders, their logs and the JSON. The launches
run without ``OMP_NUM_THREADS`` even when this script has it: that is what ``make demo`` sees on
a fresh shell. Keep the machine otherwise quiet while it runs: the idle rows assume it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/full_finetune.py"
CONFIG = "configs/tiny/full_single_device.yaml"
LOADS = ("idle", "busy")
THREADS = ("auto", "torch_default")
NEIGHBOUR = [sys.executable, "-c", "while True: pass"]
NEIGHBOUR_HEAD_START_S = 1.0  # so that the neighbour holds its core before the recipe samples
WARMUP_STEPS = 2  # left out of the median step; step 2 also times the gradient pass
# exactga.runtime.threads.ThreadChoice's line.
THREADS_LINE = re.compile(r"CPU threads: (\d+) \((.*?); config key cpu_threads\)")


@dataclass(frozen=True)
class Launch:
    """One finished ``tune run`` and what it measured."""

    load: str
    threads: str
    repeat: int
    wall_s: float  # the whole process: start-up, initial checkpoint, training, saving
    cpu_s: float  # user + system of the tune process, all its threads
    logged_threads: int
    logged_reason: str
    step_ms: list[float]  # time/step_ms of every step, step 1 first
    neighbour_core_share: float | None  # the busy neighbour's CPU time over its lifetime

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms[WARMUP_STEPS:] or self.step_ms)

    @property
    def train_s(self) -> float:
        return sum(self.step_ms) / 1e3


def torch_default_threads(env: dict[str, str]) -> int:
    """``torch.get_num_threads()`` in a fresh interpreter under ``env``: torch's own count."""
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[-1])


def launch_env() -> dict[str, str]:
    """This process's environment as a fresh shell's ``make demo`` sees it."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def tune_command(threads: str, num_default_threads: int, steps: int, output_dir: Path) -> list[str]:
    """The demo's command line, with the output folder and step count of this launch."""
    tune = Path(sys.executable).with_name("tune")
    overrides = [f"output_dir={output_dir}", f"max_steps_per_epoch={steps}"]
    if threads == "torch_default":
        overrides.append(f"cpu_threads={num_default_threads}")
    return [str(tune), "run", RECIPE, "--config", CONFIG, *overrides]


def read_step_ms(log_dir: Path) -> list[float]:
    """The ``time/step_ms`` scalar of the run under ``log_dir``, in step order."""
    steps: dict[int, float] = {}
    for event_file in sorted(log_dir.rglob("events.out.tfevents.*")):
        if "profiling_report" in event_file.parts:
            continue
        ea = EventAccumulator(str(event_file), size_guidance={"tensors": 0, "scalars": 0})
        ea.Reload()
        # torchtune's TensorBoardLogger writes scalars as tensor summaries.
        if "time/step_ms" in ea.Tags().get("tensors", []):
            for e in ea.Tensors("time/step_ms"):
                steps[e.step] = float(tensor_util.make_ndarray(e.tensor_proto))
        if "time/step_ms" in ea.Tags().get("scalars", []):
            for e in ea.Scalars("time/step_ms"):
                steps[e.step] = e.value
    if not steps:
        raise FileNotFoundError(f"no time/step_ms scalar under {log_dir}")
    return [steps[s] for s in sorted(steps)]


def start_neighbour() -> subprocess.Popen:
    neighbour = subprocess.Popen(NEIGHBOUR, stdin=subprocess.DEVNULL)
    time.sleep(NEIGHBOUR_HEAD_START_S)
    return neighbour


def stop_neighbour(neighbour: subprocess.Popen, started: float) -> float:
    """Kill the neighbour and return its CPU time over its lifetime, as a share of one core."""
    neighbour.send_signal(signal.SIGKILL)
    _, _, usage = os.wait4(neighbour.pid, 0)
    neighbour.returncode = -signal.SIGKILL  # reaped here, not by Popen
    return (usage.ru_utime + usage.ru_stime) / (time.perf_counter() - started)


def measure(
    load: str, threads: str, repeat: int, args: argparse.Namespace, num_default_threads: int
) -> Launch:
    """One launch of the demo under one condition."""
    name = f"{load}-{threads}-{repeat}"
    output_dir = args.out / name
    log_path = args.out / f"{name}.log"
    command = tune_command(threads, num_default_threads, args.steps, output_dir)
    neighbour_started = time.perf_counter()
    neighbour = start_neighbour() if load == "busy" else None
    try:
        with open(log_path, "w") as log:
            start = time.perf_counter()
            proc = subprocess.Popen(
                command, cwd=REPO_ROOT, env=launch_env(), stdout=log, stderr=log
            )
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            except BaseException:  # Ctrl-C: do not leave the run training alone
                proc.kill()
                proc.wait()
                raise
            wall_s = time.perf_counter() - start
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    finally:
        share = stop_neighbour(neighbour, neighbour_started) if neighbour else None
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        failed = f"failed (exit {proc.returncode})"
        raise RuntimeError(f"{shlex.join(command)}\n{failed}:\n{text[-3000:]}")
    match = THREADS_LINE.search(text)
    if match is None:
        raise RuntimeError(f"no 'CPU threads:' line in {log_path}")
    return Launch(
        load=load,
        threads=threads,
        repeat=repeat,
        wall_s=wall_s,
        cpu_s=usage.ru_utime + usage.ru_stime,
        logged_threads=int(match[1]),
        logged_reason=match[2],
        step_ms=read_step_ms(output_dir / "logs"),
        neighbour_core_share=share,
    )


def table(launches: list[Launch], args: argparse.Namespace) -> list[str]:
    """One row per condition (medians over repeats), then the ratios taken pair by pair."""
    header = [
        "load",
        "threads",
        "logged",
        "wall s",
        "train ms/step",
        "train s",
        "CPU s",
        "neighbour core share",
        "launches",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for load in args.loads:
        for threads in args.threads:
            runs = [r for r in launches if r.load == load and r.threads == threads]
            if not runs:
                continue
            logged = sorted({f"{r.logged_threads} ({r.logged_reason})" for r in runs})
            shares = [r.neighbour_core_share for r in runs if r.neighbour_core_share is not None]
            cells = [
                load,
                threads,
                "; ".join(logged),
                f"{statistics.median(r.wall_s for r in runs):.1f}",
                f"{statistics.median(r.median_step_ms for r in runs):.0f}",
                f"{statistics.median(r.train_s for r in runs):.1f}",
                f"{statistics.median(r.cpu_s for r in runs):.0f}",
                f"{statistics.median(shares):.2f}" if shares else "-",
                ", ".join(f"{r.wall_s:.0f} s" for r in runs),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for line in ratios(launches, args):
        lines.append(f"- {line}")
    return lines


def paired_ratio(launches: list[Launch], a: dict[str, str], b: dict[str, str], value) -> str:
    """The median over repeats of value(a) / value(b), each repeat's a against its own b."""
    by_key = {(r.load, r.threads, r.repeat): r for r in launches}
    pairs = []
    for r in launches:
        if r.load == a["load"] and r.threads == a["threads"]:
            other = by_key.get((b["load"], b["threads"], r.repeat))
            if other is not None:
                pairs.append(value(r) / value(other))
    if not pairs:
        return "n/a"
    return f"{statistics.median(pairs):.2f}x (" + ", ".join(f"{p:.2f}" for p in pairs) + ")"


def ratios(launches: list[Launch], args: argparse.Namespace) -> list[str]:
    lines = []
    for load in args.loads:
        a, b = {"load": load, "threads": "torch_default"}, {"load": load, "threads": "auto"}
        wall = paired_ratio(launches, a, b, lambda r: r.wall_s)
        step = paired_ratio(launches, a, b, lambda r: r.median_step_ms)
        lines.append(f"{load}: torch_default / auto, wall {wall}; train ms/step {step}")
    for threads in args.threads:
        a, b = {"load": "busy", "threads": threads}, {"load": "idle", "threads": threads}
        wall = paired_ratio(launches, a, b, lambda r: r.wall_s)
        lines.append(f"{threads}: busy / idle, wall {wall}")
    return lines


def conditions(num_default_threads: int) -> dict[str, str]:
    """The machine and software the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), flags=re.M)
        cpu = names[0] if names else cpu
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
        "cpus": f"{cores} usable of {os.cpu_count()} ({cpu})",
        "torch_default_threads": str(num_default_threads),
        "software": f"torch {metadata.version('torch')}, torchtune "
        f"{metadata.version('torchtune')}, Python {platform.python_version()}",
        "busy_neighbour": shlex.join(NEIGHBOUR),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="max_steps_per_epoch (demo: 40)")
    parser.add_argument("--repeats", type=int, default=1, help="launches per condition")
    parser.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS))
    parser.add_argument("--threads", nargs="+", choices=THREADS, default=list(THREADS))
    parser.add_argument(
        "--out", type=Path, default=Path("outputs/benchmarks/first_hour"), help="results here"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    num_default_threads = torch_default_threads(launch_env())
    load_before = os.getloadavg()
    start = time.perf_counter()
    launches: list[Launch] = []
    for repeat in range(args.repeats):
        for load in args.loads:
            pair = args.threads if repeat % 2 == 0 else args.threads[::-1]
            for threads in pair:
                result = measure(load, threads, repeat, args, num_default_threads)
                launches.append(result)
                print(
                    f"{load} {threads} #{repeat}: {result.wall_s:.1f} s, "
                    f"{result.median_step_ms:.0f} ms/step, {result.logged_threads} threads",
                    file=sys.stderr,
                )
    load_after = os.getloadavg()
    argv_text = shlex.join(argv if argv is not None else sys.argv[1:])
    machine = conditions(num_default_threads)
    print(f"# benchmarks/first_hour.py {argv_text}".rstrip())
    print(f"# {RECIPE} --config {CONFIG}, {args.steps} steps, {args.repeats} repeat(s)")
    print("# " + "; ".join(f"{k} {v}" for k, v in machine.items()))
    print(
        "# load average (1, 5, 15 min): before "
        + ", ".join(f"{x:.2f}" for x in load_before)
        + "; after "
        + ", ".join(f"{x:.2f}" for x in load_after)
        + f"; total wall time {time.perf_counter() - start:.0f} s"
    )
    print("\n".join(table(launches, args)))
    results = {
        "command": f"benchmarks/first_hour.py {argv_text}".rstrip(),
        "steps": args.steps,
        "repeats": args.repeats,
        "conditions": machine,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "launches": [
            {**asdict(r), "median_step_ms": r.median_step_ms, "train_s": r.train_s}
            for r in launches
        ],
        "ratios": ratios(launches, args),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n(written to {args.out / 'results.json'})")


if __name__ == "__main__":
    main()
