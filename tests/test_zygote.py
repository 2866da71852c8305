"""tests/zygote.py forks a launch whose ``PYTHONPATH`` adds entries before the server's only where
a fresh interpreter would import the same modules: the decision, in-process (no launch). And the
2-rank harness's forkserver preloads only what it can import."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import zygote
from unit_utils import RANK_PRELOAD
from zygote import extra_path, path_is_safe

TESTS = Path(__file__).resolve().parent


def test_extra_path_is_what_goes_before_the_servers_entries() -> None:
    sep = os.pathsep
    assert extra_path(None, None) == []
    assert extra_path("/a", None) == ["/a"]
    assert extra_path(f"/a{sep}/b{sep}src", "src") == ["/a", "/b"]
    assert extra_path("src", "src") == []
    assert extra_path(None, "src") is None  # the server's entries dropped
    assert extra_path(f"src{sep}/a", "src") is None  # after the server's: not a prefix
    assert extra_path("/a", "src") is None


def test_a_folder_of_new_modules_is_safe(tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text("")
    (tmp_path / "my_package").mkdir()
    (tmp_path / "my_package" / "__init__.py").write_text("")
    (tmp_path / "run_folder").mkdir()
    assert path_is_safe([str(tmp_path)], {"torch": ["/site/torch/__init__.py"]})


def test_the_tests_folder_is_safe_for_the_real_server() -> None:
    # What the GRPO tests add (tests/grpo_rewards.py): zygote itself is the server's own file.
    modules = {"zygote": [str(Path(zygote.__file__).resolve())], "torch": ["/x/torch.py"]}
    assert path_is_safe([str(TESTS)], modules)


def test_shadowing_an_imported_module_is_not_safe(tmp_path: Path) -> None:
    (tmp_path / "torch.py").write_text("")
    assert not path_is_safe([str(tmp_path)], {"torch": ["/site/torch/__init__.py"]})
    # The same file the server imported is no shadow.
    assert path_is_safe([str(tmp_path)], {"torch": [str((tmp_path / "torch.py").resolve())]})


def test_a_package_or_namespace_folder_of_an_imported_name_is_not_safe(tmp_path: Path) -> None:
    (tmp_path / "datasets").mkdir()  # no __init__.py: a namespace folder, kept real
    assert not path_is_safe([str(tmp_path)], {"datasets": ["/site/datasets/__init__.py"]})
    (tmp_path / "datasets" / "__init__.py").write_text("")
    assert not path_is_safe([str(tmp_path)], {"datasets": ["/site/datasets/__init__.py"]})


def test_an_extension_module_of_an_imported_name_is_not_safe(tmp_path: Path) -> None:
    (tmp_path / "numpy.cpython-311-x86_64-linux-gnu.so").write_text("")
    assert not path_is_safe([str(tmp_path)], {"numpy": ["/site/numpy/__init__.py"]})


def test_a_start_up_hook_is_not_safe(tmp_path: Path) -> None:
    for hook in ("sitecustomize.py", "usercustomize.py"):
        folder = tmp_path / hook.split(".")[0]
        folder.mkdir()
        (folder / hook).write_text("")
        assert not path_is_safe([str(folder)], {})
    # The collective counter's folder (tests/collective_counter) stays a real launch.
    assert not path_is_safe([str(TESTS / "collective_counter")], {})


def test_relative_missing_or_empty_entries_are_not_safe(tmp_path: Path) -> None:
    assert not path_is_safe(["tests"], {})
    assert not path_is_safe([""], {})
    assert not path_is_safe([str(tmp_path / "missing")], {})
    assert path_is_safe([], {})


def test_the_rank_forkserver_preloads_installed_modules_only() -> None:
    """The forkserver does not get the tests' sys.path (CPython drops it) and skips a module
    it cannot import without a word: each preloaded module must come from outside tests/."""
    for name in RANK_PRELOAD:
        origin = Path(importlib.import_module(name).__file__).resolve()
        assert TESTS not in origin.parents, name
