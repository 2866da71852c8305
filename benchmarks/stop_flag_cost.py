"""What agreeing on a stop costs each step: one all-reduce (MAX) of one int32 on 2 gloo ranks.

The step bookkeeping runs it at every step boundary under data parallelism (see [every rank
stops at one step] in exactga.run.steps), through ``exactga.runtime.distributed.host_group``'s
group, and reads it on the host. This times the same call, ``--steps`` of them per repeat, on two
local processes, one thread each, and prints microseconds per call for each of ``--repeats``.

    .venv/bin/python benchmarks/stop_flag_cost.py
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from exactga.runtime.distributed import host_group


def _agree_once(group: dist.ProcessGroup) -> int:
    flag = torch.tensor([0], dtype=torch.int32)  # as StepBook._agreed_stop_signal makes it
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())


def _rank(rank: int, port: int, steps: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    group = host_group()
    for _ in range(50):  # warm-up: connections made
        _agree_once(group)
    per_call = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            _agree_once(group)
        per_call.append((time.perf_counter() - start) / steps * 1e6)
    if rank == 0:
        print(f"µs per stop-flag all-reduce, {repeats} repeats of {steps}:")
        print(", ".join(f"{value:.0f}" for value in per_call))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(port, args.steps, args.repeats), nprocs=2)


if __name__ == "__main__":
    main()
