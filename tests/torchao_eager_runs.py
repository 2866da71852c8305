"""The torchao optimizer runs of two test modules, with torch.compile off (``FORCE_EAGER``).

tests/test_low_bit_optimizer.py (``AdamW8bit``) and tests/test_precision_recipes.py (pure bf16
with ``_AdamW``'s stochastic rounding) each train a short LoRA run, stop a copy of it after its
second-to-last step, resume that copy, and compare. torchao compiles its optimizer step on first
use (40 s on our 2 CPU cores, torchao's own business); tests/run_hooks.py's ``FORCE_EAGER`` runs
the same step eagerly (torch's ``set_stance("force_eager")``, what ``TORCHDYNAMO_DISABLE=1`` does
in a fresh process). The runs are made once per session (``run_once``), one after another
(tests/many_runs.py); the two modules are one xdist group, so one worker makes them. Nothing here
is a test.

Each module plans a case with :func:`stopped_and_resumed`: in ``<case>/``, ``uninterrupted``
trains every step; ``stopped`` is the same command into a folder of its own that stops itself with
SIGTERM after step ``stop_after`` (``STOP_AFTER_STEP``: the recipe's own stop at a step boundary,
with its step checkpoint, as a scheduler's preemption would stop it); ``resumed`` is that command
with ``resume_from_checkpoint=True``, logging into a folder of its own, so its logged steps show
that it trained only the steps after the checkpoint (a run retrained from step 0 would end on the
same weights: same seed, same data).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from many_runs import Run, launch_runs, run_of
from run_hooks import FORCE_EAGER, STOP_AFTER_STEP

GROUP = "torchao_eager_runs"  # the xdist group of both modules' tests that read these runs
EAGER = {FORCE_EAGER: "1"}
STOPPED_STATUS = 143  # 128 + SIGTERM: see docs/reliability.md


def eager_runs(run_once, case: str) -> Path:
    """The folder of ``case``'s runs (``"adamw8bit"`` or ``"bf16_stochastic_rounding"``)."""
    return run_once("torchao_eager_runs", _launch_all) / case


def stopped_and_resumed(
    root: Path, args_of: Callable[[Path], list[str]], stop_after: int
) -> list[Run]:
    """The runs of one case in ``root``: ``uninterrupted``, ``stopped`` after step
    ``stop_after``, and ``resumed`` from the stopped run's step checkpoint, each with the
    output directory ``<name>/out`` (the resumed run's is the stopped run's) and its output in
    ``<name>/output.txt``; ``args_of(output_dir)`` is the case's ``tune run`` arguments."""
    stopped = root / "stopped" / "out"
    resume = ["resume_from_checkpoint=True", f"metric_logger.log_dir={root / 'resumed' / 'logs'}"]
    runs = [
        run_of(args_of(root / "uninterrupted" / "out"), root / "uninterrupted"),
        run_of(args_of(stopped), root / "stopped"),
        run_of([*args_of(stopped), *resume], root / "resumed"),
    ]
    assert all(nproc == 0 for nproc, _ in runs)
    uninterrupted, stopped_run, resumed = (run for _, run in runs)
    return [uninterrupted, stopped_run._replace(env={STOP_AFTER_STEP: str(stop_after)}), resumed]


def _launch_all(root: Path) -> None:
    from test_low_bit_optimizer import planned_runs as adamw8bit_runs
    from test_precision_recipes import planned_runs as stochastic_rounding_runs

    runs = [
        *adamw8bit_runs(root / "adamw8bit"),
        *stochastic_rounding_runs(root / "bf16_stochastic_rounding"),
    ]
    launch_runs(runs, nproc=0, extra_env=EAGER)
