"""tools/gpu_check.py's plan and deadline, on the CPU: what a lent GPU machine's few minutes
depend on being right before they start (issue #46, see [round three] there)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "tools/gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up while defining
_spec.loader.exec_module(gpu_check)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_round_three_plan_names_benchmarks_that_exist_with_their_arguments() -> None:
    args = gpu_check.parse_args(["--plan", "round_three"])
    assert args.benchmarks == gpu_check.PLANS["round_three"]["benchmarks"]
    for name in args.benchmarks:
        assert (REPO_ROOT / gpu_check.BENCHMARKS[name][0]).is_file(), name
    assert "--runs" in args.benchmark_args["gpu_1b_variable_length"]


def test_explicit_benchmarks_and_arguments_win_over_the_plan() -> None:
    args = gpu_check.parse_args(
        [
            "--plan",
            "round_three",
            "--benchmarks",
            "hf_trainer_peer",
            "--benchmark-args",
            "gpu_1b_variable_length=--groups compile",
        ]
    )
    assert args.benchmarks == ["hf_trainer_peer"]
    assert args.benchmark_args["gpu_1b_variable_length"] == "--groups compile"
    assert gpu_check.parse_args([]).benchmarks == list(gpu_check.BENCHMARKS)


def test_the_1b_runs_of_the_plan_parse_as_the_benchmark_reads_them() -> None:
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import gpu_1b_variable_length as bench
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    plan = gpu_check.PLANS["round_three"]["benchmark_args"]
    runs = bench.selected_runs(bench.parse_args(plan["gpu_1b_variable_length"].split()))
    assert runs == {
        "as_shipped": ["stock", "token_budget", "packed_window"],
        "compile": ["packed_window"],
    }
    later = bench.selected_runs(bench.parse_args(plan["gpu_1b_packed_rows"].split()))
    assert later == {"as_shipped": ["packed"], "compile": ["packed"]}
    with pytest.raises(SystemExit):
        bench.parse_args(["--runs", "as_shipped/packd"])


def test_a_deadline_cuts_timeouts_to_what_is_left() -> None:
    clock = FakeClock()
    deadline = gpu_check.Deadline(300, clock=clock)
    assert deadline.timeout(900) == 300
    clock.now += 250
    assert deadline.timeout(900) == 50 and deadline.timeout(20) == 20
    assert deadline.allows(50) and not deadline.allows(51)
    clock.now += 100
    assert deadline.timeout(900) == 0
    unlimited = gpu_check.Deadline(None, clock=clock)
    assert unlimited.timeout(900) == 900 and unlimited.allows(1e9)


def test_a_benchmark_the_deadline_cannot_fit_is_reported_not_run(tmp_path: Path) -> None:
    clock = FakeClock()
    args = gpu_check.parse_args(["--plan", "round_three", "--min-part-s", "60"])
    environment = gpu_check.Environment(sys.executable, {}, "this interpreter")
    result = gpu_check.run_benchmark(
        "hf_trainer_peer", args, environment, tmp_path, gpu_check.Deadline(59, clock=clock)
    )
    assert result["status"] is None and "59 s of --deadline" in result["skipped"]
    assert not list(tmp_path.iterdir())  # nothing started
    assert not gpu_check.passed(None, [result])  # a check that left parts out is not green
    report = gpu_check.render_report(args, environment, None, None, [result], 1.0)
    assert f"### `{result['script']}`\n\nNot run: 59 s of --deadline were left." in report


def test_a_finished_benchmarks_figures_reach_the_report(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "fake_benchmark.py"
    script.write_text(
        "import json, sys\n"
        "path = sys.argv[sys.argv.index('--json') + 1]\n"
        "json.dump({'markdown': '| a | b |\\n|---|---|\\n| 1 | 2 |'}, open(path, 'w'))\n"
    )
    monkeypatch.setitem(gpu_check.BENCHMARKS, "fake", [str(script)])
    args = gpu_check.parse_args(["--benchmarks", "fake"])
    environment = gpu_check.Environment(sys.executable, None, "this interpreter")
    result = gpu_check.run_benchmark("fake", args, environment, tmp_path, gpu_check.Deadline(None))
    assert result["status"] == 0 and gpu_check.passed(None, [result])
    assert json.loads((tmp_path / "fake.json").read_text())["markdown"].startswith("| a | b |")
    report = gpu_check.render_report(args, environment, None, None, [result], 1.0)
    assert "| 1 | 2 |" in report


def _no_cuda(monkeypatch) -> None:
    # What the probe of a CPU-only torch reports, without starting an interpreter for it.
    cpu_torch = {"torch": "2.13.0+cpu", "cuda_available": False}
    monkeypatch.setattr(gpu_check, "probe", lambda python, env=None: cpu_torch)


def test_without_cuda_the_check_stops_with_one_message_and_writes_no_report(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    _no_cuda(monkeypatch)
    report = tmp_path / "report.md"
    status = gpu_check.main(
        ["--python", sys.executable, "--work-dir", str(tmp_path / "work"), "--report", str(report)]
    )
    assert status == 2  # not green: it would have skipped every test and measured nothing
    assert not report.exists()
    message = capsys.readouterr().out.strip().splitlines()[-1]
    assert "sees no CUDA device (torch 2.13.0+cpu)" in message and "--rehearse" in message


def test_a_rehearsal_runs_without_cuda_and_never_writes_over_the_gpu_report(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    _no_cuda(monkeypatch)
    work = tmp_path / "work"
    args = ["--python", sys.executable, "--work-dir", str(work), "--rehearse"]
    assert gpu_check.parse_args(args).report == work / "gpu_report.md"
    assert gpu_check.parse_args([]).report == Path("docs/gpu_report.md")
    assert gpu_check.main([*args, "--skip-tests", "--skip-benchmarks"]) == 0
    report = (work / "gpu_report.md").read_text()
    assert report.startswith("# GPU check report (a rehearsal: nothing measured)")
    assert "rehearsal all green: nothing was measured on a GPU" in capsys.readouterr().out


def test_a_rehearsal_that_finds_cuda_is_not_labelled_as_measuring_nothing() -> None:
    args = gpu_check.parse_args(["--rehearse"])
    environment = gpu_check.Environment(sys.executable, None, "this interpreter")
    on_gpu = {"cuda_available": True, "device": "NVIDIA H200"}
    report = gpu_check.render_report(args, environment, on_gpu, None, None, 1.0)
    assert report.startswith("# GPU check report\n")
    without = gpu_check.render_report(args, environment, {"cuda_available": False}, None, None, 1.0)
    assert without.startswith("# GPU check report (a rehearsal: nothing measured)\n")
