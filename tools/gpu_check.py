#!/usr/bin/env python3
"""The GPU check: exactga's GPU tests and GPU benchmarks in one command, and one report.

``make gpu-check`` runs this file with the system ``python3`` (standard library only):

1. **Environment.** A virtual environment (``--venv``, default ``.venv-gpu``). When this
   interpreter already has a CUDA build of torch, the environment reuses it instead of
   installing another: with ``--system-site-packages`` for a system interpreter, or, when this
   interpreter is itself a virtual environment (whose packages ``--system-site-packages`` would
   not reach), with a ``.pth`` file that adds its site-packages after the new environment's
   own. Otherwise the torch named by ``--torch`` is installed first. Then the project and its
   dependencies: from PyPI (``pip install -e ".[dev]"``), or with ``--wheels DIR`` offline from
   a folder of wheels (``pip --no-index --find-links DIR``, every wheel there with
   ``--no-deps``, then the project itself, editable). Where no virtual environment can be
   made, or with ``--no-venv``, the wheels go into a plain folder put on ``PYTHONPATH``
   instead (this needs ``--wheels``; see [PYTHONPATH install]). ``--python PATH`` skips all
   of this and uses an interpreter that is ready.
2. **Tests.** ``pytest -m gpu tests/gpu`` (tests/gpu/conftest.py skips them without CUDA), in
   ``--test-workers`` processes, with a JUnit XML file for the report.
3. **Benchmarks.** Those of ``BENCHMARKS`` (``--benchmarks`` picks some), each writing its
   figures as JSON.
4. **Report.** One markdown file (``--report``, default docs/gpu_report.md): the device, driver,
   torch, CUDA and package versions, each test's outcome and the values it recorded, every
   benchmark figure, the date and the command. Logs and raw files stay in ``--work-dir``.

The exit status is 0 when every selected test passed and every benchmark finished. Where
torch sees no CUDA device the check stops at once with status 2: it would otherwise skip every
test, measure nothing and still end green. ``--rehearse`` goes on without one on purpose, to
run each part's no-CUDA path before a GPU machine's minutes are spent; its report goes to
``--work-dir``, never over docs/gpu_report.md's figures.

# [PYTHONPATH install]
Packages installed with ``pip --target DIR`` are importable once DIR is on ``PYTHONPATH``, but
Python reads ``.pth`` files only in site directories, so exactga's recipe hook
(src/exactga_recipes_path.pth, docs/launching.md) would stay off and ``tune run
recipes/<name>.py`` would run torchtune's own recipes package. So DIR also gets a
``sitecustomize.py`` that makes DIR and the checkout's ``src/`` site directories: the wheels'
``.pth`` files and the hook then load in every interpreter started with that ``PYTHONPATH``,
the ``tune run`` workers included, and ``exactga`` is imported from the checkout, as an
editable install would. (It shadows another ``sitecustomize`` module, if the interpreter has
one.) ``tune`` and the other scripts land in ``DIR/bin``, which goes on ``PATH``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REPORT = Path("docs/gpu_report.md")
# name -> command after the interpreter; each writes its figures as JSON (``--json PATH``).
BENCHMARKS = {
    "gpu_scale_pass_8b": ["benchmarks/gpu_scale_pass_8b.py"],
    "gpu_tiny_throughput": ["benchmarks/gpu_tiny_throughput.py"],
    "precision_table": ["benchmarks/precision_table.py", "--device", "cuda", "--jobs", "8"],
    "gpu_1b_variable_length": ["benchmarks/gpu_1b_variable_length.py"],
    "large_vocab_loss": ["benchmarks/large_vocab_loss.py", "--device", "cuda"],
    "hf_trainer_peer": ["benchmarks/hf_trainer_peer.py", "--splits"],
    # The same benchmark again, so that a plan can put other work between its runs.
    "gpu_1b_packed_rows": ["benchmarks/gpu_1b_variable_length.py"],
    # Counted on meta and the CPU (no CUDA needed): the host's launches a micro-batch, eager and
    # compiled, to set beside a GPU profile's.
    "kernel_counts": ["benchmarks/kernel_counts.py"],
}
# [round three]
# Issue #46's measurements in the order they are worth device minutes, as one command
# (``--plan round_three``; docs/quickstart.md, "GPU check"). The tests come first (every GPU
# test green is the floor), then the memory at real vocabularies (a minute), then the 1B step
# pushed toward the hardware (the headline: stock and token_budget as shipped, then a window
# packed into one row, eager and compiled), then the Hugging Face Trainer on the same rows
# (the README's figure needs its row), then packed rows of 4,096, eager and compiled.
# GRPO's generation and training tokens/s come with the tests (test_gpu_preference_rl.py
# records the recipe's own throughput scalars). A session is lent a GPU for about 15 minutes, in
# calls of at most 10: ``--deadline`` skips what would not finish (the report says which), and
# a second call with ``--skip-tests --benchmarks ...`` measures the rest.
PLANS = {
    "round_three": {
        "benchmarks": [
            "large_vocab_loss",
            "gpu_1b_variable_length",
            "hf_trainer_peer",
            "gpu_1b_packed_rows",
        ],
        "benchmark_args": {
            # A Qwen3-8B- and a Gemma-3-4B-shaped micro-batch of 8 x 1,024 tokens, 2 layers deep
            "large_vocab_loss": "--architecture family --rows 8 --seq-len 1024 --num-layers 2",
            "hf_trainer_peer": "--steps 8 --warmup-steps 3",  # as the 1B runs
            "gpu_1b_variable_length": "--steps 8 --warmup-steps 3 --runs as_shipped/stock "
            "as_shipped/token_budget as_shipped/packed_window compile/packed_window",
            "gpu_1b_packed_rows": "--steps 8 --warmup-steps 3 --runs as_shipped/packed "
            "compile/packed",
        },
    },
}
DEFAULT_TORCH = "torch --index-url https://download.pytorch.org/whl/cu128"

PROBE = r"""
import importlib.metadata as md, json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
for name in ("torchtune", "torchao", "torchdata", "omegaconf", "datasets"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = None
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1),
                multiprocessors=props.multi_processor_count,
                device_count=torch.cuda.device_count(),
                cudnn=torch.backends.cudnn.version(),
                nccl=".".join(map(str, torch.cuda.nccl.version())))
print(json.dumps(info))
"""


@dataclass
class Environment:
    """The interpreter the checks run in, its environment variables, and how it was made."""

    python: str
    env: dict[str, str]
    how: str
    notes: list[str] = field(default_factory=list)


class SetupError(RuntimeError):
    """An environment could not be made this way."""


def log(message: str) -> None:
    print(f"[gpu-check] {message}", flush=True)


def run(cmd: list[str], log_path: Path, env: dict[str, str] | None = None, timeout=None) -> int:
    """Run ``cmd`` from the repository root, echoing its output and appending it to
    ``log_path``; returns the exit status, 124 when it was killed after ``timeout`` seconds."""
    log("$ " + shlex.join(cmd))
    with open(log_path, "a") as log_file:
        log_file.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: a timeout kills the whole tree
        )
        timer = None
        if timeout is not None:
            timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
            timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log_file.write(line)
        status = proc.wait()
        if timer is not None:
            timer.cancel()
            if not timer.is_alive() and status == -signal.SIGKILL:
                log_file.write(f"[gpu-check] killed after {timeout} s\n")
                return 124
        return status


def probe(python: str, env: dict[str, str] | None = None) -> dict | None:
    """Versions and the device, as ``python`` sees them; None if it cannot import torch."""
    proc = subprocess.run(
        [python, "-c", PROBE], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


# -- environments -----------------------------------------------------------------------------


def wheel_files(wheels: Path, keep_torch: bool) -> list[str]:
    """The wheels to install from ``wheels``; a torch wheel only when no CUDA torch is there."""
    files = sorted(str(w) for w in wheels.glob("*.whl"))
    if not keep_torch:
        files = [f for f in files if not Path(f).name.startswith("torch-")]
    if not files:
        raise SetupError(f"no wheels in {wheels}")
    return files


def make_venv(args: argparse.Namespace, cuda_torch: bool, work: Path) -> Environment:
    venv = (REPO_ROOT / args.venv).resolve()
    python = venv / "bin" / "python"
    in_venv = sys.prefix != sys.base_prefix
    notes = []
    if not python.exists():
        # Reuse this interpreter's CUDA torch: a system interpreter's packages through
        # --system-site-packages, a virtual environment's through a .pth file (below).
        cmd = [sys.executable, "-m", "venv", str(venv)]
        if cuda_torch and not in_venv:
            cmd.insert(3, "--system-site-packages")
        if run(cmd, work / "setup.log") != 0:
            shutil.rmtree(venv, ignore_errors=True)  # ensurepip may be missing: pip comes later
            if run([*cmd, "--without-pip"], work / "setup.log") != 0:
                raise SetupError(f"'{shlex.join(cmd)}' failed")
            notes.append("the virtual environment was created --without-pip")
    if cuda_torch and in_venv:
        link_parent_site_packages(python)
        notes.append(
            f"this interpreter ({sys.executable}) is itself a virtual environment, so its "
            "site-packages (with its CUDA torch) are added to the new environment by a .pth "
            "file, after the environment's own"
        )
    if run([str(python), "-m", "pip", "--version"], work / "setup.log") != 0:
        raise SetupError(f"no pip in {venv}")
    env = base_env()
    env.pop("PYTHONPATH", None)
    install = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    index = ["--no-index", "--find-links", str(args.wheels)] if args.wheels else []
    steps = []
    if not cuda_torch:
        steps.append([*install, *index, *(["torch"] if args.wheels else shlex.split(args.torch))])
    if args.wheels:
        # --ignore-installed: into this environment even where a linked parent has a version
        wheels = wheel_files(args.wheels, not cuda_torch)
        steps.append([*install, *index, "--no-deps", "--ignore-installed", *wheels])
        steps.append([*install, *index, "--no-deps", "-e", "."])
    else:
        steps.append([*install, "-e", ".[dev]"])
    for cmd in steps:
        if run(cmd, work / "setup.log", env=env) == 0:
            continue
        # Offline, the isolated build of the project needs hatchling's own dependencies in
        # the wheel folder; without them, build with what the environment already holds.
        if not (args.wheels and cmd[-2:] == ["-e", "."]):
            raise SetupError(f"'{shlex.join(cmd)}' failed")
        retry = [*cmd[:-2], "--no-build-isolation", "-e", "."]
        if run(retry, work / "setup.log", env=env) != 0:
            raise SetupError(f"'{shlex.join(retry)}' failed")
        notes.append("the project was built without build isolation")
    how = f"virtual environment {args.venv}" + (
        " (offline, wheels from " + str(args.wheels) + ")" if args.wheels else " (from PyPI)"
    )
    return Environment(str(python), env, how, notes)


def link_parent_site_packages(python: Path) -> None:
    """Add this interpreter's site-packages to the environment of ``python``, after its own."""
    import site

    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    parents = [p for p in site.getsitepackages() if p.startswith(sys.prefix)]
    lines = [f"import site; site.addsitedir({p!r})" for p in parents]
    Path(purelib, "_gpu_check_parent_site.pth").write_text("\n".join(lines) + "\n")


def make_pythonpath_env(args: argparse.Namespace, cuda_torch: bool, work: Path) -> Environment:
    """Wheels into a plain folder on PYTHONPATH; see [PYTHONPATH install]."""
    if not args.wheels:
        raise SetupError("an install without a virtual environment needs --wheels DIR")
    site_dir = (work / "site").resolve()
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-index"]
    cmd += ["--find-links", str(args.wheels), "--no-deps", "--upgrade", "--target", str(site_dir)]
    if run([*cmd, *wheel_files(args.wheels, not cuda_torch)], work / "setup.log") != 0:
        raise SetupError("pip install --target failed")
    (site_dir / "sitecustomize.py").write_text(
        "# Written by tools/gpu_check.py; see [PYTHONPATH install] there.\n"
        "import site\n\n"
        f"site.addsitedir({str(site_dir)!r})\n"
        f"site.addsitedir({str(REPO_ROOT / 'src')!r})\n"
    )
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site_dir), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(site_dir / "bin"), env.get("PATH", "")])
    how = f"no virtual environment: wheels from {args.wheels} in {site_dir} on PYTHONPATH"
    return Environment(sys.executable, env, how)


def prepare_environment(args: argparse.Namespace, work: Path) -> Environment:
    if args.python:
        return Environment(args.python, base_env(), f"the interpreter {args.python}, as it is")
    this = probe(sys.executable)
    cuda_torch = bool(this and this["torch_cuda"])
    log(f"this interpreter: {sys.executable}; torch: {this and this['torch']}")
    notes = []
    if not args.no_venv:
        try:
            return make_venv(args, cuda_torch, work)
        except SetupError as err:
            notes.append(f"no virtual environment could be made ({err}); used PYTHONPATH")
            log(notes[-1])
    environment = make_pythonpath_env(args, cuda_torch, work)
    environment.notes[:0] = notes
    return environment


# -- checks -----------------------------------------------------------------------------------


def has_cuda(info: dict | None) -> bool:
    """Whether the probe of the check's interpreter saw a CUDA device."""
    return bool(info and info.get("cuda_available"))


def driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout else None


def has_xdist(environment: Environment) -> bool:
    cmd = [environment.python, "-c", "import xdist"]
    return subprocess.run(cmd, env=environment.env, capture_output=True).returncode == 0


class Deadline:
    """The seconds left of ``--deadline`` (None: no deadline), for the parts still to run."""

    def __init__(self, seconds: float | None, clock=time.monotonic) -> None:
        self.clock = clock
        self.end = None if seconds is None else clock() + seconds

    def left(self) -> float | None:
        return None if self.end is None else self.end - self.clock()

    def timeout(self, limit: float) -> float:
        """A part's timeout: its own limit, cut to what is left."""
        left = self.left()
        return limit if left is None else max(0.0, min(limit, left))

    def allows(self, minimum: float) -> bool:
        left = self.left()
        return left is None or left >= minimum


def run_tests(
    args: argparse.Namespace, environment: Environment, work: Path, deadline: Deadline
) -> dict:
    junit = work / "gpu_tests.xml"
    junit.unlink(missing_ok=True)
    cmd = [environment.python, "-m", "pytest", "-m", "gpu", "tests/gpu", "-v", "-rA"]
    cmd += ["-p", "no:cacheprovider", f"--junitxml={junit}", *shlex.split(args.pytest_args)]
    if args.test_workers > 1 and has_xdist(environment):
        cmd += ["-n", str(args.test_workers), "--dist", "loadgroup"]
    start = time.perf_counter()
    timeout = deadline.timeout(args.test_timeout)
    status = run(cmd, work / "tests.log", env=environment.env, timeout=timeout)
    wall_s = time.perf_counter() - start
    cases = parse_junit(junit) if junit.exists() else []
    command = "python -m pytest " + shlex.join(cmd[3:])
    return {"status": status, "wall_s": wall_s, "cases": cases, "command": command}


def parse_junit(path: Path) -> list[dict]:
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome = name
                message = (node.get("message") or "").strip().split("\n")[0][:300]
                break
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        module = case.get("classname", "").rsplit(".", 1)[-1]
        cases.append(
            {
                "test": f"{module}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
                "properties": properties,
            }
        )
    return cases


def run_benchmark(
    name: str, args: argparse.Namespace, environment: Environment, work: Path, deadline: Deadline
) -> dict:
    """One benchmark, cut at the deadline; not started when less than ``--min-part-s`` is
    left (a run killed at once measures nothing and its log says less than the report)."""
    command = [*BENCHMARKS[name], *shlex.split(args.benchmark_args.get(name, ""))]
    result = {"script": shlex.join(command), "status": None, "wall_s": 0.0}
    if not deadline.allows(args.min_part_s):
        result["skipped"] = f"not run: {deadline.left():.0f} s of --deadline were left"
        log(f"{name}: {result['skipped']}")
        return result
    out = work / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [environment.python, *command, "--json", str(out)]
    start = time.perf_counter()
    timeout = deadline.timeout(args.bench_timeout)
    result["status"] = run(cmd, work / f"{name}.log", env=environment.env, timeout=timeout)
    result["wall_s"] = time.perf_counter() - start
    if out.exists():
        result.update(json.loads(out.read_text()))
    return result


# -- report -----------------------------------------------------------------------------------


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_report(
    args: argparse.Namespace,
    environment: Environment,
    info: dict | None,
    tests: dict | None,
    benchmarks: list[dict] | None,
    wall_s: float,
) -> str:
    info = info or {}
    device = info.get("device", "no CUDA device")
    lines = [
        "# GPU check report" + ("" if has_cuda(info) else " (a rehearsal: nothing measured)"),
        "",
        "Generated by `make gpu-check` (tools/gpu_check.py); every figure below was measured on "
        f"**{device}** on {args.date}. Re-run the command to regenerate this file; see "
        'docs/quickstart.md, "GPU check".',
        "",
        "```bash",
        args.invoked_as or shlex.join(["python3", "tools/gpu_check.py", *sys.argv[1:]]),
        "```",
        "",
        "## Device and software",
        "",
        "| | |",
        "|---|---|",
        f"| GPU | {cell(device)} (compute capability {info.get('capability', '?')}, "
        f"{info.get('memory_gib', '?')} GiB, {info.get('multiprocessors', '?')} SMs; "
        f"{info.get('device_count', 0)} visible) |",
        f"| driver | {cell(driver_version() or 'unknown')} |",
        f"| torch | {info.get('torch', '?')} (CUDA {info.get('torch_cuda')}, cuDNN "
        f"{info.get('cudnn')}, NCCL {info.get('nccl')}) |",
        f"| torchtune, torchao, torchdata | {info.get('torchtune')}, {info.get('torchao')}, "
        f"{info.get('torchdata')} |",
        f"| Python | {info.get('python', '?')} on {cell(platform.platform())} |",
        f"| environment | {cell(environment.how)} |",
    ]
    for note in [*environment.notes, *args.note]:
        lines.append(f"| note | {cell(note)} |")
    lines.append(f"| wall time of the check | {wall_s / 60:.1f} min |")
    lines += ["", "## Tests (`pytest -m gpu tests/gpu`)", ""]
    if tests is None:
        lines.append("Not run (--skip-tests).")
    else:
        counts: dict[str, int] = {}
        for case in tests["cases"]:
            counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
        summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
        lines += [
            f"`{tests['command']}`: {summary or 'no test ran'}, exit status "
            f"{tests['status']}, {tests['wall_s']:.0f} s.",
            "",
            "| test | outcome | s | recorded values |",
            "|---|---|---|---|",
        ]
        for case in sorted(tests["cases"], key=lambda case: case["test"]):
            values = "; ".join(f"{k} = {v}" for k, v in case["properties"].items())
            if case["message"]:
                values = f"{values}; {case['message']}" if values else case["message"]
            lines.append(
                f"| `{cell(case['test'])}` | {case['outcome']} | {case['seconds']:.0f} | "
                f"{cell(values)} |"
            )
    lines += ["", "## Benchmarks", ""]
    if benchmarks is None:
        lines.append("Not run (--skip-benchmarks).")
    for result in benchmarks or []:
        lines += [f"### `{result['script']}`", ""]
        if "skipped" in result:
            lines += [result["skipped"].capitalize() + ".", ""]
            continue
        lines += [f"Exit status {result['status']}, {result['wall_s']:.0f} s of wall time.", ""]
        if "markdown" in result:
            lines += [result["markdown"].rstrip(), ""]
        else:
            lines += ["No figures: the benchmark did not finish (see its log).", ""]
    return "\n".join(lines).rstrip() + "\n"


def passed(tests: dict | None, benchmarks: list[dict] | None) -> bool:
    ok = True
    if tests is not None:
        outcomes = [case["outcome"] for case in tests["cases"]]
        ok = tests["status"] == 0 and "passed" in outcomes
    if benchmarks is not None:
        ok = ok and all(b["status"] == 0 and "markdown" in b for b in benchmarks)
    return ok


def write_report(
    args: argparse.Namespace,
    environment: Environment,
    info: dict | None,
    tests: dict | None,
    benchmarks: list[dict] | None,
    start: float,
) -> Path:
    """Write the report as it stands; called after every part, so that a check stopped from
    outside (a lease's end) still leaves what it measured."""
    report = render_report(args, environment, info, tests, benchmarks, time.perf_counter() - start)
    report_path = REPO_ROOT / args.report
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(report)
    return report_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv-gpu", help="virtual environment to (re)use")
    parser.add_argument("--no-venv", action="store_true", help="install onto PYTHONPATH")
    parser.add_argument("--python", help="use this interpreter as it is; install nothing")
    parser.add_argument(
        "--torch", default=DEFAULT_TORCH, help="pip arguments for a CUDA torch, if none is there"
    )
    parser.add_argument("--wheels", type=Path, help="install offline from this wheel folder")
    parser.add_argument(
        "--report",
        type=Path,
        help=f"the report's path (default: {DEFAULT_REPORT}; with --rehearse, gpu_report.md "
        "in --work-dir, so that a rehearsal never writes over a GPU's figures)",
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="go on without a CUDA device: each part runs its no-CUDA path, which catches a "
        "wrong option before a GPU machine's minutes are spent; nothing is measured",
    )
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/gpu_check"))
    parser.add_argument("--test-workers", type=int, default=4, help="pytest-xdist processes")
    parser.add_argument("--test-timeout", type=float, default=1500, help="seconds")
    parser.add_argument("--bench-timeout", type=float, default=900, help="seconds per script")
    parser.add_argument(
        "--deadline",
        type=float,
        help="seconds for the whole check, setup included: each part's timeout is cut to what "
        "is left, and a benchmark is not started with less than --min-part-s left",
    )
    parser.add_argument("--min-part-s", type=float, default=60, help="see --deadline")
    parser.add_argument(
        "--plan",
        choices=list(PLANS),
        help="a preset order of benchmarks and their arguments (see [round three]); "
        "--benchmarks and --benchmark-args given too take precedence",
    )
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-benchmarks", action="store_true")
    parser.add_argument(
        "--benchmarks",
        nargs="+",
        choices=list(BENCHMARKS),
        help="which benchmarks to run, in this order (default: --plan's, else all)",
    )
    parser.add_argument(
        "--benchmark-args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help='more arguments for one benchmark: "gpu_1b_variable_length=--groups default"',
    )
    parser.add_argument(
        "--pytest-args", default="", help='more pytest arguments, one string: "-k numerics"'
    )
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--invoked-as", help="the command to print in the report")
    parser.add_argument(
        "--note", action="append", default=[], help="a line for the report (repeatable)"
    )
    args = parser.parse_args(argv)
    if args.wheels is not None:
        args.wheels = args.wheels.resolve()
    extra = dict(item.split("=", 1) for item in args.benchmark_args if "=" in item)
    unknown = sorted(set(extra) - set(BENCHMARKS))
    if unknown or len(extra) != len(args.benchmark_args):
        parser.error(f"--benchmark-args takes NAME=ARGS with NAME one of {list(BENCHMARKS)}")
    plan = PLANS.get(args.plan, {})
    args.benchmark_args = {**plan.get("benchmark_args", {}), **extra}
    if args.benchmarks is None:
        args.benchmarks = list(plan.get("benchmarks", BENCHMARKS))
    if args.report is None:
        args.report = args.work_dir / "gpu_report.md" if args.rehearse else DEFAULT_REPORT
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    work = (REPO_ROOT / args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    environment = prepare_environment(args, work)
    info = probe(environment.python, environment.env)
    log(f"environment: {environment.how}; {json.dumps(info)}")
    if not has_cuda(info):
        if not args.rehearse:
            # Going on would skip every test, measure nothing and still end green.
            log(
                f"stopped: torch in {environment.python} sees no CUDA device "
                f"({'torch does not import' if info is None else 'torch ' + info['torch']}), so "
                "there is nothing to measure; check the driver and that torch is a CUDA build, "
                "or add --rehearse to run each part's no-CUDA path on purpose"
            )
            return 2
        log("rehearsal: torch sees no CUDA device; the GPU tests skip themselves")
    deadline = Deadline(
        None if args.deadline is None else args.deadline - (time.perf_counter() - start)
    )
    tests = None if args.skip_tests else run_tests(args, environment, work, deadline)
    benchmarks = None if args.skip_benchmarks else []
    report_path = write_report(args, environment, info, tests, benchmarks, start)
    for name in [] if args.skip_benchmarks else args.benchmarks:
        benchmarks.append(run_benchmark(name, args, environment, work, deadline))
        report_path = write_report(args, environment, info, tests, benchmarks, start)
    ok = passed(tests, benchmarks)
    verdict = "all green" if ok else "NOT all green"
    if not has_cuda(info):
        verdict = f"rehearsal {verdict}: nothing was measured on a GPU"
    log(f"report written to {report_path}; {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
