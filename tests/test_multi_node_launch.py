"""examples/slurm/train.sbatch run on this machine as a SLURM job of two nodes, one rank each.

SLURM is not here, so the test puts two stand-ins first on ``PATH``: ``scontrol`` answers the
host list with ``localhost``, and ``srun`` starts the command it is given twice, side by side,
as SLURM starts one task on each of two nodes (``SLURM_PROCID``/``SLURM_NODEID`` 0 and 1), each
task's output in a file of its own. Each task is then the script's ``tune run --nnodes 2
--nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint localhost:PORT`` (torchrun's agent of one
node), and the two agents meet through torchrun's c10d rendezvous on loopback, as the
multi-node trial of docs/reliability.md ("Dead and hung ranks") does. The job must train what a
plain ``tune run --nproc_per_node 2`` of the same config trains: one run of 2 ranks, not two
runs of one rank each (which is what a node that missed the rendezvous would train). The job is
the real launch; the plain run beside it is only its reference, so its two ranks are forked
(tests/launcher.py: the same recipe and numbers, without a torchrun agent and three fresh
interpreters). That a real ``tune run --nproc_per_node`` runs exactga's recipe is
tests/test_launching.py's. docs/meshes.md ("Several nodes") quotes the measured distance
(``-rP``).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launcher import start_recipe
from recipe_utils import (
    INITIAL,
    REPO_ROOT,
    SMALL_MODEL,
    TRAINED,
    load_weights,
    output_of,
    read_scalars,
    relative_l2,
    tune_env,
)

pytestmark = pytest.mark.slow

SCRIPT = REPO_ROOT / "examples/slurm/train.sbatch"
RECIPE = "recipes/full_finetune.py"
CONFIG = "configs/tiny/full_distributed.yaml"
# Two steps of 8 sequences (2 ranks x batch 2 x accumulation 2), no warm-up: both steps move the
# weights (the config's warm-up starts at lr 0).
RUN = {**SMALL_MODEL, "max_steps_per_epoch": 2, "lr_scheduler.num_warmup_steps": 0}
JOB_ID = "4242"

# SLURM's srun, for a job of two nodes: each task is the given command with the variables SLURM
# sets per task; the options (SLURM's, before the command) are written down for the test.
FAKE_SRUN = """#!/bin/bash
options=()
while [[ $1 == -* ]]; do options+=("$1"); shift; done
printf '%s\\n' "${options[@]}" > "$FAKE_SLURM_DIR/srun_options"
pids=()
for node in 0 1; do
    SLURM_PROCID=$node SLURM_NODEID=$node SLURM_LOCALID=0 \\
        "$@" > "$FAKE_SLURM_DIR/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
# SLURM's scontrol: the job's host list, both "nodes" being this machine.
FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames ]] || { echo "unexpected: scontrol $*" >&2; exit 1; }
echo localhost
"""


def _overrides(output_dir: Path) -> list[str]:
    return [f"output_dir={output_dir}", *(f"{key}={value}" for key, value in RUN.items())]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fake_slurm(folder: Path) -> Path:
    """A folder holding the ``srun`` and ``scontrol`` stand-ins."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _submit(folder: Path, output_dir: Path) -> subprocess.CompletedProcess:
    """The job script as sbatch would run it on the first node of a 2-node allocation, from a
    working directory that is not the submission folder (sbatch's spool copy)."""
    env = tune_env()
    env.pop("SLURM_CPUS_PER_TASK", None)
    # The stand-ins first, then the environment's `tune` (an activated environment's PATH).
    path = [str(_fake_slurm(folder)), str(Path(sys.executable).parent), env["PATH"]]
    env.update(
        PATH=os.pathsep.join(path),
        FAKE_SLURM_DIR=str(folder),
        SLURM_JOB_ID=JOB_ID,
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_SUBMIT_DIR=str(REPO_ROOT),
        GPUS_PER_NODE="1",
        RDZV_PORT=str(_free_port()),
    )
    command = ["bash", str(SCRIPT), CONFIG, *_overrides(output_dir)]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def test_slurm_script_trains_one_run_across_two_nodes(tmp_path):
    """The job exits 0, started one agent per node, and trained the weights and losses of a
    plain 2-rank run of the same config (its ranks forked: see the module's docstring)."""
    job_out, reference_out = tmp_path / "job_run", tmp_path / "reference_run"
    reference_args = ["--nproc_per_node", "2", RECIPE, "--config", CONFIG]
    # The reference's ranks train beside the job.
    reference = start_recipe(
        [*reference_args, *_overrides(reference_out)], REPO_ROOT, tune_env(), tmp_path / "ref"
    )
    try:
        job = _submit(tmp_path, job_out)
        reference_status = reference.wait(timeout=600)
    finally:
        reference.kill()
    reference_output = reference.stdout.read_text() + reference.stderr.read_text()

    nodes = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
    report = f"{output_of(job)}\n--- node 0 ---\n{nodes[0]}\n--- node 1 ---\n{nodes[1]}"
    assert job.returncode == 0, report[-6000:]
    assert reference_status == 0, reference_output[-4000:]
    print(f"job: {shlex.join(['bash', str(SCRIPT.relative_to(REPO_ROOT)), CONFIG])} ...")
    print(job.stdout.strip())
    assert "--ntasks-per-node=1" in (tmp_path / "srun_options").read_text().split()
    assert all("Running with torchrun" in node for node in nodes), report[-6000:]

    scalars, ref_scalars = read_scalars(job_out / "logs"), read_scalars(reference_out / "logs")
    assert len(scalars["loss"]) == RUN["max_steps_per_epoch"]
    assert scalars["loss_tokens"] == ref_scalars["loss_tokens"]  # the same 8 sequences a step
    assert scalars["loss"] == ref_scalars["loss"]
    weights, ref_weights = load_weights(job_out / TRAINED), load_weights(reference_out / TRAINED)
    assert weights.keys() == ref_weights.keys()
    rel = relative_l2(weights, ref_weights, load_weights(reference_out / INITIAL))
    identical = all(torch.equal(weights[name], ref_weights[name]) for name in ref_weights)
    print(
        f"2 nodes x 1 rank (SLURM script) vs 1 node x 2 ranks: relative L2 {rel:.3e}, "
        f"bit-identical: {identical}"
    )
    assert identical, f"relative L2 {rel:.3e}"
