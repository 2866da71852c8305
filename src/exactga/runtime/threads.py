"""How many CPU threads torch computes with: a count that holds on a shared machine, logged.

Note [cpu threads]
torch starts one compute thread per physical core, and its OpenMP threads wait for each other
at every parallel region by spinning. On a machine where another job holds a core, one thread
then waits for a core it cannot get, at every op: the tiny demo on 2 cores with one CPU-heavy
neighbour took 135 s at torch's 2 threads and 34 s at 1 (docs/quickstart.md, "First hour"). So
a recipe picks its count once, at start-up, from what is free then:

- ``cpu_threads: <n>`` in the config: n, as asked;
- else ``OMP_NUM_THREADS`` set (torchrun sets it to 1 for each of several ranks): torch's
  count from it, untouched; except under ``fsdp_cpu_offload``, where the optimizer steps on
  the CPU and is about twice as fast with every free core (torchtune sets its count to the
  cores over the GPUs there): the rule below;
- else the CPUs this process may use (affinity, and a cgroup quota), less the CPUs other
  processes kept busy over a short sample of ``/proc/stat``, shared among the node's ranks,
  at least 1 and at most torch's own default.

The count is logged. It does not change what is computed, but can change the last bits of a
CPU run (a reduction split over other threads adds in another order): a run that must resume
bit for bit on CPU sets ``cpu_threads`` (or ``OMP_NUM_THREADS``), so both halves use one count.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# How long the start-up sample of the machine's load lasts.
SAMPLE_SECONDS = 0.25
# A CPU counts as free when at least this share of it was idle (so 1.75 free CPUs give 2
# threads, 1.7 give 1): one thread too many costs far more than one too few.
_FREE_SHARE_FOR_A_THREAD = 0.75


@dataclass(frozen=True)
class ThreadChoice:
    """The count and why; ``str()`` is the line the recipes log."""

    num_threads: int
    reason: str

    def __str__(self) -> str:
        return f"CPU threads: {self.num_threads} ({self.reason}; config key cpu_threads)"


def use_cpu_threads(cpu_threads: int | None, optimizer_on_cpu: bool = False) -> ThreadChoice:
    """Choose the count (see [cpu threads]), set it in torch and return it for the log;
    ``optimizer_on_cpu``: ``fsdp_cpu_offload`` on an accelerator.

    Raises:
        ValueError: ``cpu_threads`` below 1.
    """
    choice = choose_cpu_threads(
        cpu_threads,
        optimizer_on_cpu=optimizer_on_cpu,
        env=dict(os.environ),
        default_threads=torch.get_num_threads(),
        usable_cpus=usable_cpus(),
        machine_cpus=os.cpu_count() or 1,
        busy_cpus=lambda: busy_cpus(read_cpu_times, time.sleep),
    )
    torch.set_num_threads(choice.num_threads)
    return choice


def choose_cpu_threads(
    cpu_threads: int | None,
    *,
    optimizer_on_cpu: bool = False,
    env: dict[str, str],
    default_threads: int,
    usable_cpus: float,
    machine_cpus: int,
    busy_cpus: Callable[[], float | None],
) -> ThreadChoice:
    """The count for ``cpu_threads`` (the config's) on a machine described by the rest; see
    [cpu threads]. ``busy_cpus`` is only called when the load decides."""
    if cpu_threads is not None:
        if cpu_threads < 1:
            raise ValueError(
                f"config key 'cpu_threads': {cpu_threads} is below 1; give a count, or null "
                "to choose one from the machine's load."
            )
        return ThreadChoice(cpu_threads, "set in the config")
    if env.get("OMP_NUM_THREADS") and not optimizer_on_cpu:
        return ThreadChoice(default_threads, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    ranks = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    busy = busy_cpus()
    if busy is None:
        free, measured = usable_cpus, "load unknown"
    else:  # of all the machine's CPUs, what others leave, at most the ones we may use
        free = min(usable_cpus, max(0.0, machine_cpus - busy))
        measured = f"{free:.1f} of {usable_cpus:g} usable CPUs free"
    per_rank = math.floor(free / ranks + 1 - _FREE_SHARE_FOR_A_THREAD)
    shared = f", shared by {ranks} ranks" if ranks > 1 else ""
    if optimizer_on_cpu:  # torch's default may be torchrun's 1
        return ThreadChoice(max(1, per_rank), f"{measured}{shared}; the optimizer steps on CPU")
    return ThreadChoice(min(max(1, per_rank), default_threads), f"{measured}{shared}")


def usable_cpus() -> float:
    """The CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota."""
    if hasattr(os, "sched_getaffinity"):
        cpus = float(len(os.sched_getaffinity(0)))
    else:  # macOS, Windows
        cpus = float(os.cpu_count() or 1)
    quota = _cgroup_cpu_quota(Path("/sys/fs/cgroup/cpu.max"))
    return min(cpus, quota) if quota is not None else cpus


def _cgroup_cpu_quota(cpu_max: Path) -> float | None:
    """``cpu.max``'s quota in CPUs ("200000 100000" is 2), or None without one."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def read_cpu_times(stat: Path = Path("/proc/stat")) -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``'s first line; None off Linux."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    times = [float(value) for value in fields[1:]]
    idle = times[3] + (times[4] if len(times) > 4 else 0.0)  # idle and iowait
    return sum(times) - idle, sum(times)


def busy_cpus(
    read_times: Callable[[], tuple[float, float] | None],
    sleep: Callable[[float], None],
    machine_cpus: int | None = None,
) -> float | None:
    """How many CPUs other processes kept busy over a :data:`SAMPLE_SECONDS` sample (this
    one sleeps through it), or None where the load cannot be read."""
    before = read_times()
    sleep(SAMPLE_SECONDS)
    after = read_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    share = (after[0] - before[0]) / (after[1] - before[1])
    return share * (machine_cpus or os.cpu_count() or 1)
