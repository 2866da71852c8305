"""Does the suite still catch the bugs it exists for? Plant each one and run the tests that must
fail.

Each mutant is one textual change to a copy of ``src/exactga`` (the repository is not touched):
the copy goes first on ``PYTHONPATH``, so the tests and every ``tune run`` they launch import
it. A mutant is *caught* when its tests fail. Run from the repository root::

    .venv/bin/python tools/mutants.py            # every mutant
    .venv/bin/python tools/mutants.py packing    # the ones whose name contains "packing"

It prints one line per mutant and exits non-zero if any survives. The tests named for each are
the suite's own, unchanged; a survivor means the suite lost an assertion that catches a real
bug (docs/contributing.md, "Tests").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    """``old`` replaced by ``new`` (exactly once) in ``module``; ``tests`` must then fail."""

    name: str
    module: str  # relative to src/exactga
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "loss_step_1pct_off",  # every micro-batch's exact weight 1% too large
        "accumulation/normalization.py",
        "return self.dp_size * micro_batch.num_units / self.num_global_units",
        "return 1.01 * self.dp_size * micro_batch.num_units / self.num_global_units",
        ("tests/test_oracle.py",),
    ),
    Mutant(
        "token_count_before_shift",  # stock torchtune's count: each row's first label too
        "accumulation/loss_units.py",
        "return int((labels[..., 1:] != ignore_index).sum())",
        "return int((labels != ignore_index).sum())",
        ("tests/test_normalization.py", "tests/test_loss_positions.py"),
    ),
    Mutant(
        "restart_posing_as_resume",  # says it resumes, starts from step 0
        "run/resume.py",
        "resume = ResumePoint(ResumeFrom.STEP_CHECKPOINT, found, checkpointer.world_size)",
        "resume = ResumePoint(ResumeFrom.START)",
        ("tests/test_resume.py::test_killed_run_resumes_to_the_uninterrupted_weights",),
    ),
    Mutant(
        "packing_mask_crosses_documents",  # one causal mask over the whole packed row
        "data/packing.py",
        "return DocumentLengths.of(list(seq_lens), padding)",
        "return create_block_causal_mask([torch.tensor([sum(seq_lens) + padding])])",
        ("tests/test_packing.py",),
    ),
)


def planted_copy(mutant: Mutant, root: Path) -> Path:
    """A copy of ``src/exactga`` under ``root/src`` with ``mutant`` planted; the ``src`` folder."""
    src = root / "src"
    shutil.copytree(REPO / "src" / "exactga", src / "exactga")
    path = src / "exactga" / mutant.module
    text = path.read_text()
    if text.count(mutant.old) != 1:  # the code moved: the mutant must be rewritten, not skipped
        raise SystemExit(f"{mutant.name}: '{mutant.old}' is not once in {mutant.module}")
    path.write_text(text.replace(mutant.old, mutant.new))
    for shipped in ("recipes", "configs"):  # where a checkout's exactga finds its own files
        (root / shipped).symlink_to(REPO / shipped)
    return src


def run_tests(mutant: Mutant, src: Path) -> tuple[bool, float, str]:
    """Whether the tests failed, the seconds they took, and their summary line."""
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    proc = subprocess.run(
        [*command, *mutant.tests], cwd=REPO, env=env, capture_output=True, text=True
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode != 0, time.perf_counter() - start, lines[-1] if lines else ""


def main(selected: list[str]) -> int:
    mutants = [m for m in MUTANTS if not selected or any(s in m.name for s in selected)]
    survivors = []
    for mutant in mutants:
        with tempfile.TemporaryDirectory(prefix=f"mutant_{mutant.name}_") as tmp:
            caught, seconds, summary = run_tests(mutant, planted_copy(mutant, Path(tmp)))
        verdict = "caught" if caught else "SURVIVED"
        print(f"{mutant.name:32} {verdict:8} in {seconds:6.1f} s  ({summary})", flush=True)
        if not caught:
            survivors.append(mutant.name)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
