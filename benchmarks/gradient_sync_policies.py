"""Step time and gradient memory of the two ``gradient_sync`` policies, side by side in one run.

Two data-parallel ranks (gloo on CPU; NCCL when each rank has a GPU) build the tiny model of
``configs/tiny/full_distributed.yaml`` (torchtune's ``llama3_2`` builder, the config's sizes,
fp32) and shard it with torchtune's ``training.shard_model`` (FSDP2) over the ``("dp", "tp")``
mesh, as recipes/full_finetune.py does. For each ga in ``--ga`` the ranks then run
rounds of two optimizer steps, one per policy, on the *same* synthetic window (the order flips
every round), through the recipe's own pieces: ``LossNormalizer`` windows (token count reduced
over the dp group, loss scaled before backward), ``exactga.sft.loss.causal_lm_loss`` and
``exactga.runtime.distributed.gradient_sync`` around each micro-batch, then the config's AdamW. Both
policies therefore share the weights, the data, the process and whatever else the machine is
doing at that moment; only the policy differs. At ga = 1 the two policies are the same code
path, so their difference there is the benchmark's noise floor.

The "reduce-scatters per step" column is computed (FSDP units x ga, or x 1), not counted;
tests/test_recipe_full_distributed.py counts them through the recipe.

What is measured, per optimizer step (the slowest rank's value, over the measured rounds):

- **step time**: wall time of forward + backward of every micro-batch and the optimizer step,
  between two barriers; median and interquartile range.
- **gradient bytes held between micro-batches**, per rank: after each micro-batch's backward,
  the bytes of every gradient buffer FSDP2 holds (the sharded ``.grad`` of each parameter plus
  any unsharded gradient it keeps for a later reduce-scatter), maximum over the window. Exact
  and deterministic, on CPU and GPU alike; this is the memory the policy changes. (The transient
  unsharded gradient of the one FSDP unit being reduced inside backward is the same under both
  policies and not counted.)
- **peak memory**: on CUDA, ``torch.cuda.max_memory_allocated`` during the step minus the
  allocation at its start. On CPU there is no allocator statistic, so the process's resident
  set (RSS) is sampled after every micro-batch and after the optimizer step and the largest
  growth over the RSS at the step's start is reported; the C allocator keeps freed memory
  mapped and reuses it, so this resolves little at this model size (see the gradient bytes).

Run from the repository root (1.5-2 minutes on 2 CPU cores shared with other jobs at a load
average of 3-8; the defaults are small so that the run stays short there)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gradient_sync_policies.py

or under torchrun, which the script detects (same options)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 benchmarks/gradient_sync_policies.py

Options: ``--ga 1 4 8``, ``--steps`` (measured rounds per ga, default 6), ``--warmup`` (default
1), ``--batch-size`` (default 1), ``--seq-len`` (default 128; the tiny tokenizer allows 256),
``--nproc`` (default 2, when not under torchrun), ``--device auto|cpu|cuda`` and
``--set KEY=VALUE`` for model sizes (``--set num_layers=8``). Results are in
docs/full_finetune_distributed.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from torch.distributed.fsdp import FSDPModule
from torchtune import config, training, utils

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.runtime import distributed
from exactga.runtime.distributed import GradientSync
from exactga.sft.loss import causal_lm_loss

# tools/grouping.py: windows of hand-collated micro-batches, as the tests make them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from grouping import GroupingNormalizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "configs/tiny/full_distributed.yaml"
POLICIES = (GradientSync.EVERY_MICRO_BATCH, GradientSync.ONCE_PER_WINDOW)
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ga", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=6, help="measured rounds per ga")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds per ga")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (not under torchrun)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the config's model section",
    )
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Model, data and measurements.


def build_model(model_cfg, mesh, device: torch.device, reshard_after_forward: bool):
    """The recipe's ``_setup_model`` for this case: meta build, FSDP2 over dp, full state load."""
    torch.manual_seed(0)  # the same initial weights on every rank, as from one checkpoint
    with training.set_default_dtype(torch.float32):
        full_state_dict = config.instantiate(model_cfg).state_dict()
    with training.set_default_dtype(torch.float32), torch.device("meta"):
        model = config.instantiate(model_cfg)
    training.shard_model(
        model=model,
        shard_conditions=[partial(training.get_shard_conditions, names_to_match=None)],
        cpu_offload=False,
        reshard_after_forward=reshard_after_forward,
        dp_mesh=mesh.fsdp,
    )
    with training.set_default_dtype(torch.float32), device:
        for module in model.modules():
            if hasattr(module, "rope_init"):
                module.rope_init()
    training.load_from_full_model_state_dict(model, full_state_dict, device, strict=True)
    return model


def synthetic_window(ga: int, args, vocab_size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``ga`` micro-batches of random tokens whose labels mask a random-length prompt, as an
    instruction dataset does; seeded by round and rank so both policies see the same window."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(ga):
        tokens = torch.randint(0, vocab_size, (args.batch_size, args.seq_len), generator=generator)
        labels = tokens.clone()
        prompt_lens = torch.randint(1, args.seq_len // 2, (args.batch_size,), generator=generator)
        for row, prompt_len in enumerate(prompt_lens.tolist()):
            labels[row, :prompt_len] = IGNORE_INDEX
        batches.append({"tokens": tokens, "labels": labels})
    return batches


def _fsdp_params(model: torch.nn.Module):
    """FSDP2's per-parameter records (private API: ``_fsdp_param_groups`` in torch >= 2.9,
    ``_fsdp_param_group`` before)."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            yield from group.fsdp_params


def _nbytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients this rank holds now: sharded ``.grad`` plus unsharded ones that
    FSDP2 keeps while gradient sync is off."""
    held = sum(_nbytes(param.grad) for param in model.parameters())
    for fsdp_param in _fsdp_params(model):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        held += _nbytes(unsharded.grad if unsharded is not None else None)
        held += _nbytes(getattr(fsdp_param, "unsharded_accumulated_grad", None))
    return held


def rss_bytes() -> int:
    """This process's resident set size now (psutil if installed, else /proc)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def train_step(window, *, model, loss_fn, optimizer, policy, device) -> tuple[int, int]:
    """The recipe's ``_train_step`` without profiler and clipping; returns (max gradient bytes
    after a micro-batch, peak RSS growth) of this rank."""
    rss_start = rss_bytes()
    rss_peak, grad_peak = rss_start, 0
    micro_batches = list(window.micro_batches_to_run())
    for i, micro_batch in enumerate(micro_batches):
        with distributed.gradient_sync(model, policy, i == len(micro_batches) - 1):
            utils.batch_to_device(micro_batch.batch, device)
            loss = causal_lm_loss(model, loss_fn, micro_batch.batch)
            window.scale(loss, micro_batch).backward()
        grad_peak = max(grad_peak, gradient_bytes(model))
        rss_peak = max(rss_peak, rss_bytes())
    window.finish_gradients(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rss_peak = max(rss_peak, rss_bytes())
    return grad_peak, rss_peak - rss_start


# ---------------------------------------------------------------------------------------------
# The run.


def worker(args: argparse.Namespace) -> None:
    use_cuda = args.device == "cuda" or (
        args.device == "auto"
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    )
    device = torch.device("cuda" if use_cuda else "cpu")
    backend = distributed.init_distributed(device)
    if use_cuda:
        device = torch.device("cuda", torch.cuda.current_device())
    mesh = distributed.build_device_mesh(device)
    rank = dist.get_rank()

    cfg = OmegaConf.load(CONFIG)
    for item in args.set:
        key, value = item.split("=", 1)
        cfg.model[key] = OmegaConf.create({"v": value}).v if value else value
    model = build_model(cfg.model, mesh, device, cfg.fsdp_reshard_after_forward)
    loss_fn = config.instantiate(cfg.loss)
    if hasattr(loss_fn, "num_output_chunks"):
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    optimizer = config.instantiate(cfg.optimizer, model.parameters())
    num_params = sum(p.numel() for p in model.parameters())
    num_units = sum(1 for m in model.modules() if isinstance(m, FSDPModule))
    sharded_grad_bytes = sum(_nbytes(p) for p in model.parameters())

    results: dict[tuple[int, GradientSync], dict[str, list[float]]] = {}
    for ga in args.ga:
        normalizer = GroupingNormalizer(loss_fn, ga, dp_group=mesh.count_group())
        for round_index in range(args.warmup + args.steps):
            seed = 1000 * round_index + rank
            batches = synthetic_window(ga, args, cfg.model.vocab_size, seed=seed)
            order = POLICIES if round_index % 2 == 0 else POLICIES[::-1]
            for policy in order:
                # causal_lm_loss pops the labels from the dict: each policy gets its own dicts.
                window = next(normalizer.windows([dict(b) for b in batches]))
                distributed.barrier()
                if use_cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    allocated_start = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                grad_peak, rss_growth = train_step(
                    window,
                    model=model,
                    loss_fn=loss_fn,
                    optimizer=optimizer,
                    policy=policy,
                    device=device,
                )
                if use_cuda:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                peak = (
                    torch.cuda.max_memory_allocated() - allocated_start if use_cuda else rss_growth
                )
                # The slowest rank sets the step time; memory is per rank, its maximum.
                measured = torch.tensor([elapsed, grad_peak, peak], dtype=torch.float64)
                measured = measured.to(device if backend == "nccl" else "cpu")
                dist.all_reduce(measured, op=dist.ReduceOp.MAX)
                if round_index >= args.warmup:
                    record = results.setdefault((ga, policy), {"ms": [], "grad": [], "peak": []})
                    record["ms"].append(1e3 * float(measured[0]))
                    record["grad"].append(float(measured[1]))
                    record["peak"].append(float(measured[2]))
    if rank == 0:
        setting = (
            f"{dist.get_world_size()} ranks ({backend}, {device.type}), tiny llama3_2 "
            f"({num_params / 1e6:.2f}M parameters, {cfg.model.num_layers} layers, "
            f"{num_units} FSDP units), fp32, batch {args.batch_size} x {args.seq_len} tokens per "
            f"micro-batch, {args.steps} measured rounds (+{args.warmup} warm-up) per ga, "
            f"torch {torch.__version__}"
        )
        print(report(results, args, setting, num_units, sharded_grad_bytes, use_cuda), flush=True)
    distributed.destroy()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def report(results, args, setting, num_units, sharded_grad_bytes, use_cuda) -> str:
    peak_name = "peak allocated in step" if use_cuda else "peak RSS growth in step"
    lines = [
        f"Setting: {setting}.",
        "",
        f"| ga | policy | reduce-scatters per step | step time, median [IQR] (ms) | "
        f"gradient bytes held between micro-batches, per rank (MiB) | {peak_name}, max (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    readings = []
    for ga in args.ga:
        medians = {}
        grads = {}
        for policy in POLICIES:
            record = results[(ga, policy)]
            q1, median, q3 = _quartiles(record["ms"])
            medians[policy], grads[policy] = median, max(record["grad"])
            reduce_scatters = num_units * (ga if policy is GradientSync.EVERY_MICRO_BATCH else 1)
            lines.append(
                f"| {ga} | `{policy.value}` | {reduce_scatters} | {median:.1f} [{q1:.1f}-{q3:.1f}] "
                f"| {grads[policy] / MIB:.2f} | {max(record['peak']) / MIB:.1f} |"
            )
        every, once = (medians[p] for p in POLICIES)
        change = 100 * (once - every) / every
        extra = grads[GradientSync.ONCE_PER_WINDOW] - grads[GradientSync.EVERY_MICRO_BATCH]
        if ga == 1:
            readings.append(
                f"ga=1: the two policies run the same code (one micro-batch, always synced); "
                f"their median step times differ by {change:+.1f} %, which is the noise floor "
                f"of this run, and both hold {grads[POLICIES[0]] / MIB:.2f} MiB of sharded "
                "gradients."
            )
        else:
            readings.append(
                f"ga={ga}: once_per_window's median step is {change:+.1f} % "
                f"({once:.1f} vs {every:.1f} ms) with {num_units} instead of {ga * num_units} "
                f"reduce-scatters, and holds {extra / MIB:+.2f} MiB of gradients per rank "
                f"between micro-batches ({extra / sharded_grad_bytes:+.1f}x the sharded gradient)."
            )
    return "\n".join(lines + [""] + readings)


def _spawned(local_rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    worker(args)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "RANK" in os.environ:  # under torchrun
        worker(args)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_spawned, args=(args.nproc, port, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
