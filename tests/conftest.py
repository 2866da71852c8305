"""Fixtures shared by the test modules, one rule about the ``slow`` marker, and the hooks that
keep an ``xdist_group`` on one worker under ``--dist loadgroup``.

A test that reads a module fixture which launches ``tune run`` (a ``run_once`` one, or one of
``tmp_path_factory``) carries ``pytest.mark.xdist_group``: ``make test`` (``--dist loadgroup``)
then runs all of them on one worker, which makes the fixture once while the other worker runs
other tests, instead of waiting on the fixture's lock or making it a second time.

The plain helpers are modules of their own, imported by name: tests/recipe_utils.py (launch
``tune run`` and read what it wrote) and tests/unit_utils.py (a tiny model, hand-made rows, the
2-rank harness, config files). Nothing here is imported by a test: pytest hands these fixtures
to the tests that name them.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n N``, each worker computes with its share of the CPUs: torch would start
    one thread per core in every worker, and its threads spin at each op waiting for a core the
    other workers hold (see [cpu threads] in exactga.runtime.threads: the same pathology, 4x slower
    on 2 cores). The launched recipes get ``OMP_NUM_THREADS=1`` (tests/recipe_utils.py)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def two_ranks(tmp_path: Path) -> Callable[..., list[Any]]:
    """The 2-rank gloo harness: ``two_ranks(worker, *args)`` runs ``worker(rank, *args)`` on
    ranks 0 and 1 of one process group (CPU, gloo) and returns the two results, in rank order.
    ``start_method`` (default ``"forkserver"``) is ``unit_utils.run_on_ranks``'s."""

    from unit_utils import run_on_ranks  # here: a session that uses no harness never imports it

    def run(worker: Callable[..., Any], *args: Any, start_method: str = "forkserver") -> list[Any]:
        return run_on_ranks(worker, args, tmp_path, world_size=2, start_method=start_method)

    return run


@pytest.fixture(scope="session")
def run_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable], Path]:
    """``run_once(name, make)``: the folder ``name``, filled by ``make(folder)`` once per test
    session, whichever ``pytest -n`` worker asks first; the others wait for it (a file lock)
    and reuse it. For the recipe launches of a module fixture: ``pytest -n`` spreads the
    module's tests over its workers, and each worker sets up module fixtures of its own.

    The folder is the session's own (under this session's base temporary directory), so a
    later session never reuses a stale one. If ``make`` fails, the folder is marked failed and
    every worker's fixture fails with the first error instead of launching again.
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' base folders are siblings in the session's folder

    def get(name: str, make: Callable[[Path], None]) -> Path:
        folder = base / name
        with FileLock(f"{folder}.lock"):
            failed = folder.with_name(f"{name}.failed")
            if failed.exists():
                pytest.fail(f"{name} failed in another test worker:\n{failed.read_text()}")
            if not (folder / ".done").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                try:
                    make(folder)
                except BaseException:
                    failed.write_text(traceback.format_exc()[-8000:])
                    raise
                (folder / ".done").touch()
        return folder

    return get


@pytest.fixture(autouse=True)
def _tune_run_needs_the_slow_marker(request: pytest.FixtureRequest, monkeypatch) -> None:
    """A test that runs a recipe carries ``pytest.mark.slow``: ``make test-fast``
    (``-m "not slow"``) must never run one. Any test without the marker that starts a process
    named ``tune``, or a recipe run of tests/launcher.py, fails here, naming itself."""
    if request.node.get_closest_marker("slow") is not None:
        return
    import launcher

    refusal = f"{request.node.nodeid} runs a recipe: mark it pytest.mark.slow"
    popen_init = subprocess.Popen.__init__

    def refuse_tune(self, args, *rest, **kwargs):
        first = args if isinstance(args, str | bytes | os.PathLike) else args[0]
        if Path(os.fsdecode(first).split()[0]).name == "tune":
            raise AssertionError(refusal)
        popen_init(self, args, *rest, **kwargs)

    def refuse_run(self, *args, **kwargs):
        raise AssertionError(refusal)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_tune)
    monkeypatch.setattr(launcher.RecipeRun, "__init__", refuse_run)


# ``make test`` (``--dist loadgroup``) keeps each ``xdist_group`` on one worker. pytest-xdist 3.8
# says a test's group by appending ``@<group>`` to a private attribute that pytest 9.2 no longer
# reads (pytest-dev/pytest-xdist#1386), so its own grouping spreads a group over both workers:
# a ``run_once`` fixture then leaves the second worker waiting on its lock, and a plain module
# fixture (``tmp_path_factory``) is made twice. Instead, through xdist's public hooks, each
# worker writes its tests' groups to a file, and the controller's scheduler reads them.


def _group_of(item: pytest.Item) -> str | None:
    names = {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names)) or None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """The controller: tell each worker where to write its tests' groups."""
    if node.config.getoption("dist") == "loadgroup":
        node.workerinput["exactga_groups"] = str(_groups_folder(node.config))


def _groups_folder(config: pytest.Config) -> Path:
    if not hasattr(config, "exactga_groups"):
        config.exactga_groups = Path(tempfile.mkdtemp(prefix="exactga_xdist_groups_"))
    return config.exactga_groups


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "exactga_groups"):
        shutil.rmtree(config.exactga_groups, ignore_errors=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (torch, torchtune, the tests' modules: about 400,000
    objects the collector tracks, never garbage), so the tests' garbage collections skip it:
    in-process tests spent 5.7 of 73 s collecting, 1.8 s frozen."""
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A worker under ``--dist loadgroup``: write ``{nodeid: group}`` for its grouped tests
    (before it reports its collection, so the controller finds the file when it schedules)."""
    folder = getattr(config, "workerinput", {}).get("exactga_groups")
    if folder is None:  # not a worker under ``--dist loadgroup``
        return
    groups = {item.nodeid: group for item in items if (group := _group_of(item))}
    file = Path(folder) / f"{config.workerinput['workerid']}.json"
    file.with_suffix(".tmp").write_text(json.dumps(groups))
    file.with_suffix(".tmp").replace(file)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """The controller under ``--dist loadgroup``: xdist's scope scheduling, a scope being a
    test's group (the workers' files) or, for a test in none, the test itself."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    folder = _groups_folder(config)

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:  # xdist's documented extension point
            if self.groups is None:
                self.groups = {}
                for file in folder.glob("*.json"):
                    self.groups.update(json.loads(file.read_text()))
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def bundled_dataset():
    """The bundled data, tokenized as the tiny configs do (at the benchmark's 512 tokens), and
    its tokenizer: ``(dataset, tokenizer)``."""
    from omegaconf import OmegaConf
    from torchtune import config

    from exactga.data.loader import load_dataset

    configs = Path(__file__).resolve().parents[1] / "configs" / "tiny"
    cfg = OmegaConf.load(configs / "full_single_device.yaml")
    cfg.tokenizer.path = str(configs / "tokenizer.model")
    cfg.tokenizer.max_seq_len = 512
    cfg.dataset.data_files = str(configs / "data.json")
    tokenizer = config.instantiate(cfg.tokenizer)
    return load_dataset(cfg.dataset, tokenizer, vocab_size=2048), tokenizer
