"""tests/launcher.py: a run's ranks forked from the tests' server behave as torchrun's ranks do
where a run can tell (its environment, its exit, a failing peer), and the server preloads only
what it can import."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import launcher
import pytest
import run_costs
import run_hooks
from recipe_utils import output_of, run_recipe

TESTS = Path(__file__).resolve().parent

# A "recipe" that reports what torchrun would have set, then exits as the test asks: rank 1 with
# status 3 after rank 0 has started to wait, so a launch that left rank 0 running would time out.
PROBE = """
import json, os, sys, time
rank = int(os.environ.get("RANK", "0"))
seen = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
        "EXACTGA_TESTS_PROBE")}
seen["argv"] = sys.argv[1:]
seen["path_first"] = sys.path[1]
print(json.dumps(seen), flush=True)
if os.environ.get("EXACTGA_TESTS_PROBE") == "fail" and rank == 1:
    sys.exit(3)
if os.environ.get("EXACTGA_TESTS_PROBE") == "fail":
    time.sleep(600)
"""
PROBE_ARGS = ["probe.py", "--config", "probe.yaml"]


def _write_probe(folder: Path) -> None:
    (folder / "probe.py").write_text(PROBE)
    (folder / "probe.yaml").write_text("{}\n")


def test_the_server_preloads_installed_modules_only() -> None:
    """CPython's forkserver does not get the tests' sys.path, so a module of tests/ in the list
    would fail to import there, silently, and every run would import it afresh."""
    for name in launcher.PRELOAD:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        assert TESTS not in Path(spec.origin).resolve().parents, name


@pytest.mark.slow
def test_each_rank_gets_torchruns_variables_and_the_runs_environment(tmp_path: Path) -> None:
    _write_probe(tmp_path)
    extra = tmp_path / "extra"
    extra.mkdir()
    env = {"EXACTGA_TESTS_PROBE": "ok", "PYTHONPATH": str(extra)}
    proc = run_recipe(["--nproc_per_node", "2", *PROBE_ARGS], cwd=tmp_path, extra_env=env)
    assert proc.returncode == 0, output_of(proc)
    seen = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda s: s["RANK"])
    assert [s["RANK"] for s in seen] == ["0", "1"] and [s["LOCAL_RANK"] for s in seen] == ["0", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {"2"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1  # one rendezvous
    assert all(s["EXACTGA_TESTS_PROBE"] == "ok" and s["argv"] == PROBE_ARGS[1:] for s in seen)
    assert all(s["path_first"] == str(extra) for s in seen)  # PYTHONPATH first, as at start


@pytest.mark.slow
def test_a_failing_rank_ends_its_peer_and_gives_its_status(tmp_path: Path) -> None:
    _write_probe(tmp_path)
    env = {"EXACTGA_TESTS_PROBE": "fail"}
    proc = run_recipe(["--nproc_per_node", "2", *PROBE_ARGS], cwd=tmp_path, extra_env=env)
    assert proc.returncode == 3, output_of(proc)


@pytest.mark.slow
def test_one_process_without_nproc_has_no_torchrun_variables(tmp_path: Path) -> None:
    _write_probe(tmp_path)
    proc = run_recipe([*PROBE_ARGS, "a=1"], cwd=tmp_path)
    assert proc.returncode == 0, output_of(proc)
    (seen,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert (
        seen["RANK"] is None
        and seen["WORLD_SIZE"] is None
        and seen["argv"] == [*PROBE_ARGS[1:], "a=1"]
    )


# Compiled where torch.compile runs (dynamo's capture, no code generation), eager under the hook.
COMPILING_PROBE = """
import torch
@torch.compile(fullgraph=True, backend="eager")
def compiling(x):
    return x + float(torch.compiler.is_compiling())
print("compiled" if compiling(torch.zeros(1)).item() == 1.0 else "eager", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("force_eager", [False, True])
def test_the_force_eager_hook_runs_a_compiled_function_eagerly(tmp_path: Path, force_eager) -> None:
    """tests/run_hooks.py's ``FORCE_EAGER``: torch.compile off in the run, as
    ``TORCHDYNAMO_DISABLE=1`` would turn it off in a fresh process (tests/torchao_eager_runs.py)."""
    (tmp_path / "probe.py").write_text(COMPILING_PROBE)
    (tmp_path / "probe.yaml").write_text("{}\n")
    env = {run_hooks.FORCE_EAGER: "1"} if force_eager else {}
    proc = run_recipe(PROBE_ARGS, cwd=tmp_path, extra_env=env)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.split() == ["eager" if force_eager else "compiled"], output_of(proc)


@pytest.mark.slow
def test_each_rank_logs_its_cost_where_asked_and_the_summary_adds_them(tmp_path: Path) -> None:
    _write_probe(tmp_path)
    log = tmp_path / "costs.jsonl"
    env = {"EXACTGA_TESTS_PROBE": "ok", launcher.RUN_COST_LOG: str(log)}
    proc = run_recipe(["--nproc_per_node", "2", *PROBE_ARGS], cwd=tmp_path, extra_env=env)
    assert proc.returncode == 0, output_of(proc)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(line["rank"] for line in lines) == ["0", "1"]
    assert all(line["argv"] == PROBE_ARGS and line["cpu_s"] >= 0 for line in lines)
    assert all(line["test"].startswith("tests/test_launcher.py::") for line in lines)
    totals = run_costs.costs_by_module(log.read_text().splitlines())
    ranks, cpu, _ = totals["tests/test_launcher.py"]
    assert ranks == 2 and cpu == pytest.approx(sum(line["cpu_s"] for line in lines))


@pytest.mark.slow
def test_a_rank_that_crashes_in_c_prints_its_python_stack(tmp_path: Path) -> None:
    """A segfault (in gloo, say) kills a rank with no traceback; faulthandler names the frame."""
    (tmp_path / "crash.py").write_text(
        "import ctypes\n\ndef crash():\n    ctypes.string_at(0)\n\ncrash()\n"
    )
    (tmp_path / "crash.yaml").write_text("{}\n")
    proc = run_recipe(["crash.py", "--config", "crash.yaml"], cwd=tmp_path)
    assert proc.returncode == -11, output_of(proc)
    assert "Fatal Python error: Segmentation fault" in proc.stderr, output_of(proc)
    assert 'crash.py", line 4 in crash' in proc.stderr, output_of(proc)
