"""``tune run`` finds *our* recipe files, however they are launched.

torchtune 0.6.1 installs a top-level ``recipes`` package that would shadow ./recipes; the start-up
hook (src/_exactga_recipes_hook.py) makes the working directory's folder win. These tests launch
the way a user does and prove which file ran: stock torchtune has no "unknown config key" error
and no ``loss_tokens`` metric, and an edited copy prints its own marker. Each is a real launch (not
forked by tests/launcher.py): the start-up hook runs as a fresh interpreter starts. Two launches:
one on one device from the repository root, and the edited copy from its own folder under
torchrun (``--nproc_per_node 1``: ``python -m recipes.<name>``, where the installed package
shadows most). Under torchrun from the repository root, tests/test_stop_on_signal.py,
tests/test_dead_rank.py and tests/test_bad_input_launch.py launch recipes/full_finetune.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_utils import (
    RECIPE,
    REPO_ROOT,
    TINY_CONFIG,
    TRAINED,
    output_of,
    read_scalars,
    run_tune,
    tiny_args,
)

pytestmark = pytest.mark.slow

MARKER = "EDITED COPY RAN"


def _assert_trained_by_us(proc, output_dir: Path) -> None:
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert (output_dir / TRAINED).is_file()
    # Metrics only exactga's recipe logs.
    scalars = read_scalars(output_dir / "logs")
    assert scalars["loss_tokens"] and scalars["skipped_steps"] == [0.0]


def test_tune_run_from_repo_root_runs_our_recipe(tmp_path):
    """Our metrics show our recipe ran. (That it refuses a misspelt key, which stock torchtune
    would not, is tests/test_recipe_full_single_device.py's test_bad_config_fails_naming_the_key
    and tests/test_bad_input_launch.py's.)"""
    proc = run_tune(tiny_args(tmp_path / "out", max_steps_per_epoch=1))
    _assert_trained_by_us(proc, tmp_path / "out")


def _edited_copy(destination: Path) -> None:
    """The recipe with a print inserted after its imports, as a user's edit would be."""
    lines = (REPO_ROOT / RECIPE).read_text().splitlines(keepends=True)
    first_statement = next(i for i, line in enumerate(lines) if line.startswith("log = "))
    lines.insert(first_statement, f'print("{MARKER}")\n\n')
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_text("".join(lines))


# A copy at the top of its folder (my_recipe.py) runs in tests/test_registry.py, made with
# `tune cp`; the config's files are found from any folder (${exactga_file:...}).
@pytest.mark.parametrize("recipe", ["recipes/edited.py"])
def test_edited_copy_runs_from_its_own_folder_under_torchrun(tmp_path, recipe):
    """``--nproc_per_node`` goes through torchrun, which runs the recipe with ``python -m``."""
    project = tmp_path / "myproj"
    _edited_copy(project / "my_recipe.py")
    _edited_copy(project / "recipes" / "edited.py")
    out_dir = tmp_path / "out"
    args = tiny_args(out_dir, max_steps_per_epoch=1)
    assert args[:3] == [RECIPE, "--config", TINY_CONFIG]
    args[:3] = [recipe, "--config", str(REPO_ROOT / TINY_CONFIG)]
    proc = run_tune(["--nproc_per_node", "1", *args], cwd=project)
    assert "Running with torchrun" in proc.stdout, output_of(proc)[-4000:]
    assert MARKER in proc.stdout, output_of(proc)[-4000:]
    _assert_trained_by_us(proc, out_dir)
