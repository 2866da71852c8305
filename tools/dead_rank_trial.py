"""Two nodes on loopback, one rank killed (or stopped): what the other node's agent does, and when.

docs/reliability.md ("Dead and hung ranks") describes this trial; tests/test_dead_rank.py covers
the one-node case. Here two ``tune run --nnodes 2 --nproc_per_node 1`` agents run on this
machine, each as a node of its own, and meet through torchrun's c10d rendezvous on
``127.0.0.1`` (the multi-node launch of docs/launching.md; c10d assigns the global ranks, so no
``--node_rank`` is needed: torchrun reads it only for the static backend). They train
recipes/full_finetune.py on the tiny config shrunk as in the tests (2 layers x 64),
gloo on CPU. Once a training step has finished, the worker of the *second* agent is sent
``--signal``:

- ``KILL`` (default): the process dies at once, its sockets close. The second agent sees its
  worker exit; the first agent's worker should fail in its next collective ("Connection reset by
  peer") and its agent exit too. The script reports when each agent exited and its status.
- ``STOP``: the process hangs, its sockets stay open. Neither agent sees a failure; the first
  node's rank waits in its collective until the process group's timeout (torch's default, 30
  min for gloo, 10 min for NCCL). The script watches for ``--wait`` seconds, reports that both
  agents still run, then ends them (SIGKILL of each process it started, by pid).

Every process it signals carries a marker in its environment, so a recycled pid is never
another's process. Run from the repository root (about 1 minute on 2 shared cores)::

    .venv/bin/python tools/dead_rank_trial.py                  # SIGKILL, two nodes
    .venv/bin/python tools/dead_rank_trial.py --signal STOP --wait 120
    .venv/bin/python tools/dead_rank_trial.py --print-commands # the two agents' commands only
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TUNE = Path(sys.executable).parent / "tune"
MARKER = "EXACTGA_DEAD_RANK_TRIAL"
# tqdm's bar on global rank 0 after a finished step: "epoch 1:   1%|          | 3/258 [...]".
STEP_DONE = re.compile(r"epoch \d+:.*\|\s*[1-9]\d*/\d+")
# Lines worth showing from each agent's log after the signal.
TELLING = re.compile(
    r"Connection reset|Connection closed|Signal \d+|SIGKILL|SIGTERM|ChildFailedError|"
    r"rank\s*:\s*\d|exitcode|timed out|Timeout|RendezvousClosedError|error",
    re.IGNORECASE,
)
OVERRIDES = [
    "model.num_layers=2",
    "model.embed_dim=64",
    "model.intermediate_dim=128",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "epochs=50",  # far more steps than the trial lasts
    "max_steps_per_epoch=null",
    "batch_size=1",
    "gradient_accumulation_steps=1",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    parser.add_argument("--wait", type=float, default=60, help="seconds to watch after it")
    parser.add_argument("--start-timeout", type=float, default=180)
    parser.add_argument("--out", type=Path, default=Path("/tmp/dead_rank_trial"))
    parser.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")
    parser.add_argument("--print-commands", action="store_true")
    return parser.parse_args()


def agent_command(port: int, out: Path) -> list[str]:
    """One node's launch; both nodes run the same command."""
    return [
        str(TUNE),
        "run",
        "--nnodes", "2", "--nproc_per_node", "1",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
        "--rdzv_id", "dead_rank_trial",
        "recipes/full_finetune.py",
        "--config", "configs/tiny/full_distributed.yaml",
        f"output_dir={out / 'run'}",
        *OVERRIDES,
    ]  # fmt: skip


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _descendants(pid: int) -> list[int]:
    children = _children(pid)
    return children + [g for child in children for g in _descendants(child)]


def _environ(pid: int) -> dict[str, str]:
    try:
        entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return {}
    pairs = (e.decode(errors="replace").partition("=") for e in entries if e)
    return {key: value for key, _, value in pairs}


def _signal_ours(pid: int, sig: signal.Signals, tag: str) -> None:
    if _environ(pid).get(MARKER) == tag:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def main() -> None:
    args = parse_args()
    if args.port == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    command = agent_command(args.port, args.out)
    env_prefix = "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1"
    print(f"each node (twice, as two agents): {env_prefix} {shlex.join(command)}", flush=True)
    if args.print_commands:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}:{args.out}"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(OMP_NUM_THREADS="1", **{MARKER: tag})
    print(f"load average at start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")

    logs = [args.out / f"node{i}.log" for i in range(2)]
    agents: list[subprocess.Popen] = []
    try:
        for log in logs:
            with open(log, "w") as f:
                agents.append(
                    subprocess.Popen(
                        command,
                        cwd=REPO_ROOT,
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        started = time.monotonic()
        while not any(STEP_DONE.search(log.read_text()) for log in logs):
            if any(a.poll() is not None for a in agents):
                sys.exit(f"an agent ended before a step finished; see {logs}")
            if time.monotonic() - started > args.start_timeout:
                sys.exit(f"no finished step within {args.start_timeout} s; see {logs}")
            time.sleep(0.2)
        workers = _children(agents[1].pid)
        assert len(workers) == 1, f"workers of the second agent: {workers}"
        victim = workers[0]
        victim_rank = _environ(victim).get("RANK")
        sig = signal.Signals[f"SIG{args.signal}"]
        print(
            f"a step finished {time.monotonic() - started:.1f} s after launch; sending {sig.name} "
            f"to the second agent's worker (pid {victim}, global rank {victim_rank})",
            flush=True,
        )
        os.kill(victim, sig)
        signalled = time.monotonic()
        exits: dict[int, tuple[float, int]] = {}
        while len(exits) < 2 and time.monotonic() - signalled < args.wait:
            for i, agent in enumerate(agents):
                if i not in exits and agent.poll() is not None:
                    exits[i] = (time.monotonic() - signalled, agent.returncode)
            time.sleep(0.05)
        for i in range(2):
            if i in exits:
                took, code = exits[i]
                print(f"agent {i}: exited with status {code}, {took:.1f} s after the signal")
            else:
                print(f"agent {i}: still running {args.wait:.0f} s after the signal")
        for i, log in enumerate(logs):
            text = log.read_text()
            lines = [line.strip() for line in text.splitlines() if TELLING.search(line)]
            print(f"\nagent {i} log ({log}), telling lines:")
            seen = set()
            for line in lines:
                if line not in seen and "Warning" not in line:
                    seen.add(line)
                    print(f"  {line[:200]}")
        print(f"\nload average at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for agent in agents:
            if agent.poll() is None:
                for pid in [*_descendants(agent.pid), agent.pid]:
                    _signal_ours(pid, signal.SIGKILL, tag)
            agent.wait()


if __name__ == "__main__":
    main()
