"""Run every stock torchtune 0.6.1 config of our two distributed recipes on CPU, tiny assets.

Each of the 57 non-vision configs of ``full_finetune_distributed`` (25) and
``lora_finetune_distributed`` (32) is adapted by tools/stock_configs.py (tiny model of the same
family, tiny tokenizer, data and initial checkpoint, ``device: cpu``, 2 steps; every other key
as shipped) and launched through the real ``tune run --nproc_per_node 2`` on gloo ranks, two
launches at a time. A launch passes when it exits 0, every logged loss is finite and the
epoch's artefacts exist. One line per config as it finishes, then the count. ``--ours`` runs
exactga's own distributed configs (``configs/llama3_1/8B_full.yaml``, ...: 10) the same way
instead. The QAT recipes' stock configs and PPO's one (``mistral/7B_full_ppo_low_memory``, on
one process: ``--recipe ppo_full_finetune_single_device``, 2 to 5 minutes on 2 shared cores,
mostly ``compile``) are swept too.

Run from the repository root::

    python tools/stock_config_sweep.py                  # all 57, about 7 minutes on 2 cores
    python tools/stock_config_sweep.py --only gemma2    # configs whose name contains "gemma2"
    python tools/stock_config_sweep.py --recipe lora_finetune_distributed   # its 32
    python tools/stock_config_sweep.py --ours           # our 10 in configs/

Each run's config, logs, checkpoints and console output stay under ``--out``
(outputs/stock_config_sweep by default). Exit status 1 if any config failed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import stock_configs  # tools/, next to this script
from omegaconf import OmegaConf
from tiny_runs import output_of, run_tune

REPO_ROOT = Path(__file__).resolve().parents[1]

TIMEOUT_S = 600


def run_one(recipe: str, name: str, out_root: Path) -> tuple[bool, float, str]:
    """Launch one adapted config; ``(passed, seconds, first error line or '')``."""
    out = out_root / recipe / name
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        args = stock_configs.launch_args(name, recipe, out)
        proc = run_tune(args, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - t0, f"timed out after {TIMEOUT_S} s"
    except Exception as err:  # a config the helper cannot adapt is a failure, not a crash
        return False, time.perf_counter() - t0, f"adapting the config: {err!r}"[:200]
    seconds = time.perf_counter() - t0
    (out / "output.txt").write_text(output_of(proc))
    if proc.returncode != 0:
        return False, seconds, stock_configs.first_error_line(output_of(proc))
    losses = stock_configs.logged_losses(out)
    if not stock_configs.all_finite(losses):
        return False, seconds, f"logged losses not finite (or none): {losses}"
    cfg = OmegaConf.load(out / "config.yaml")
    missing = [f for f in stock_configs.expected_artefacts(cfg) if not (out / f).is_file()]
    if missing:
        return False, seconds, f"missing artefacts: {', '.join(missing)}"
    return True, seconds, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "stock_config_sweep")
    parser.add_argument("--jobs", type=int, default=2, help="launches at a time (2 ranks each)")
    parser.add_argument("--only", default="", help="run configs whose name contains this")
    parser.add_argument(
        "--recipe",
        choices=stock_configs.RECIPES + stock_configs.QAT_RECIPES + (stock_configs.PPO,),
        help="one recipe's configs",
    )
    parser.add_argument(
        "--ours", action="store_true", help="exactga's own configs in configs/, not the stock ones"
    )
    args = parser.parse_args(argv)

    recipes = stock_configs.RECIPES + stock_configs.QAT_RECIPES + (stock_configs.PPO,)
    configs = stock_configs.OUR_CONFIGS if args.ours else stock_configs.all_stock_configs(recipes)
    todo = [(r, n) for r, n in configs if args.only in n and args.recipe in (None, r)]
    print(f"{len(todo)} configs, {args.jobs} launches at a time, outputs in {args.out}")
    t0 = time.perf_counter()
    failed: list[str] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_one, r, n, args.out): (r, n) for r, n in todo}
        for future in as_completed(futures):
            recipe, name = futures[future]
            passed, seconds, error = future.result()
            if not passed:
                failed.append(f"{recipe} {name}")
            status = "pass" if passed else "FAIL"
            print(f"{name:28} {recipe:26} {status} {seconds:6.1f} s  {error}", flush=True)
    wall = time.perf_counter() - t0
    print(f"{len(todo) - len(failed)} passed, {len(failed)} failed in {wall:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
