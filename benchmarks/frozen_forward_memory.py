"""Peak host memory of one teacher forward of the tiny KD config, per grad mode (issue #22).

Each case runs in a fresh process: build the teacher of configs/tiny/kd_single_device.yaml
(frozen, fp32), read the resident set size, run one forward on a batch of ``--batch-size`` x
``--seq-len`` tokens, and report how far the peak resident set size (``ru_maxrss``) rose above
it, and how much stayed resident once the logits were the only output kept. Cases:

- ``grad``: as a trained model runs (autograd records the graph and keeps activations);
- ``inference_mode``: what the KD recipes used before issue #22;
- ``no_grad``: ``exactga.model_build.frozen.frozen_forward``, what they use now;
- ``no_grad_fsdp_1_rank``: the same, the teacher sharded with FSDP2 on one gloo rank (the case
  that crashed under inference mode).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/frozen_forward_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("grad", "inference_mode", "no_grad", "no_grad_fsdp_1_rank")


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _measure(case: str, batch_size: int, seq_len: int) -> dict[str, float]:
    import torch
    from omegaconf import OmegaConf
    from torchtune import config

    from exactga.model_build.frozen import freeze_model, frozen_forward

    cfg = OmegaConf.load(REPO / "configs/tiny/kd_single_device.yaml")
    torch.manual_seed(0)
    teacher = config.instantiate(cfg.teacher_model)
    if case == "grad":
        teacher.eval()  # weights frozen as a LoRA base is, but the input asks for a graph
    else:
        freeze_model(teacher)
    if case.endswith("fsdp_1_rank"):
        import torch.distributed as dist
        from torchtune.training import shard_model

        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        layer_type = type(teacher.layers[0])
        shard_model(
            teacher,
            [lambda name, module: isinstance(module, layer_type)],
            cpu_offload=False,
            reshard_after_forward=True,
        )
    tokens = torch.randint(0, 2000, (batch_size, seq_len))
    contexts = {
        "grad": torch.enable_grad,
        "inference_mode": torch.inference_mode,
    }
    context = contexts.get(case, frozen_forward)
    if case == "grad":
        for param in teacher.parameters():
            param.requires_grad_(True)
    before = _rss_mib()
    with context():
        logits = teacher(tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kept = _rss_mib()
    return {
        "peak_rise_mib": peak - before,
        "kept_mib": kept - before,
        "logits_mib": logits.numel() * logits.element_size() / 2**20,
        "has_graph": logits.grad_fn is not None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(_measure(args.case, args.batch_size, args.seq_len)))
        return
    print(
        f"teacher of configs/tiny/kd_single_device.yaml, batch {args.batch_size} x "
        f"{args.seq_len} tokens, fp32, threads {os.environ.get('OMP_NUM_THREADS', 'default')}"
    )
    print(f"{'case':<22}{'peak rise MiB':>15}{'kept MiB':>10}{'logits MiB':>12}  graph")
    for case in CASES:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--case",
                case,
                "--batch-size",
                str(args.batch_size),
                "--seq-len",
                str(args.seq_len),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"{case:<22}{row['peak_rise_mib']:>15.1f}{row['kept_mib']:>10.1f}"
            f"{row['logits_mib']:>12.1f}  {row['has_graph']}"
        )


if __name__ == "__main__":
    main()
