"""The CPU thread count a recipe picks (see [cpu threads] in exactga.runtime.threads): the config's,
else OMP_NUM_THREADS's, else what the machine's load leaves free, shared among the node's
ranks. The machine is described to the chooser, never read, so no test depends on the load."""

from __future__ import annotations

from pathlib import Path

import pytest

from exactga.runtime.threads import (
    SAMPLE_SECONDS,
    _cgroup_cpu_quota,
    busy_cpus,
    choose_cpu_threads,
    read_cpu_times,
)


def _choose(cpu_threads=None, env=None, usable=2.0, machine=2, busy=0.0, default=2):
    return choose_cpu_threads(
        cpu_threads,
        env=env or {},
        default_threads=default,
        usable_cpus=usable,
        machine_cpus=machine,
        busy_cpus=lambda: busy,
    )


@pytest.mark.parametrize(
    ("busy", "expected"),
    [(0.05, 2), (0.25, 2), (0.3, 1), (1.0, 1), (2.0, 1)],  # 1.75 CPUs free still give 2
)
def test_the_threads_are_the_cpus_others_leave_free(busy: float, expected: int) -> None:
    choice = _choose(busy=busy)
    assert choice.num_threads == expected
    assert f"{2 - busy:.1f} of 2 usable CPUs free" in str(choice)


def test_never_more_than_torch_would_start_nor_than_this_process_may_use() -> None:
    assert _choose(usable=16.0, machine=16, default=8).num_threads == 8  # torch's: physical
    # A 2-CPU quota on a 64-CPU host whose other CPUs are busy with other containers' work.
    assert _choose(usable=2.0, machine=64, busy=30.0, default=32).num_threads == 2


def test_the_ranks_of_a_node_share_the_free_cpus() -> None:
    choice = _choose(env={"LOCAL_WORLD_SIZE": "4"}, usable=16.0, machine=16, busy=0.0, default=16)
    assert choice.num_threads == 4 and "shared by 4 ranks" in str(choice)
    crowded = _choose(env={"LOCAL_WORLD_SIZE": "8"}, usable=4.0, machine=4, default=4)
    assert crowded.num_threads == 1  # at least one


def test_the_config_and_omp_num_threads_come_first_and_the_load_is_not_read() -> None:
    def unread() -> float:
        raise AssertionError("the load was read")

    def choose(cpu_threads, env):
        return choose_cpu_threads(
            cpu_threads,
            env=env,
            default_threads=3,
            usable_cpus=2.0,
            machine_cpus=2,
            busy_cpus=unread,
        )

    assert choose(5, {"OMP_NUM_THREADS": "1"}).num_threads == 5  # the config wins
    from_env = choose(None, {"OMP_NUM_THREADS": "1"})
    assert from_env.num_threads == 3 and "OMP_NUM_THREADS=1" in str(from_env)  # torch's count
    with pytest.raises(ValueError, match="cpu_threads"):
        choose(0, {})


def test_an_unreadable_load_leaves_the_usable_cpus() -> None:
    choice = _choose(busy=None)
    assert choice.num_threads == 2 and "load unknown" in str(choice)


def test_busy_cpus_from_two_readings_of_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait ...: 300 busy of 1000 jiffies, then 600 more busy of 1000.
    readings = iter(["cpu 100 0 200 600 100 0 0 0", "cpu 500 0 400 900 200 0 0 0"])
    slept: list[float] = []

    def read():
        stat.write_text(next(readings) + "\ncpu0 1 2 3 4\n")
        return read_cpu_times(stat)

    assert busy_cpus(read, slept.append, machine_cpus=4) == pytest.approx(0.6 * 4)
    assert slept == [SAMPLE_SECONDS]
    assert read_cpu_times(tmp_path / "missing") is None
    assert busy_cpus(lambda: None, slept.append) is None


@pytest.mark.parametrize(("text", "quota"), [("200000 100000", 2.0), ("max 100000", None)])
def test_cgroup_quota(tmp_path: Path, text: str, quota: float | None) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text + "\n")
    assert _cgroup_cpu_quota(cpu_max) == quota
    assert _cgroup_cpu_quota(tmp_path / "absent") is None


def test_an_optimizer_on_cpu_takes_the_free_cores_over_torchruns_one() -> None:
    """fsdp_cpu_offload: torchtune sets cores / GPUs there; the load decides here."""
    choice = choose_cpu_threads(
        None,
        optimizer_on_cpu=True,
        env={"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"},
        default_threads=1,
        usable_cpus=16.0,
        machine_cpus=16,
        busy_cpus=lambda: 0.0,
    )
    assert choice.num_threads == 8 and "the optimizer steps on CPU" in str(choice)
