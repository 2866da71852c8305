"""tools/mutants.py stays plantable: each mutant's line is in its module, once, so a refactor
that moves the line cannot make the tool silently test nothing (it refuses a missing line, but
only when someone runs it)."""

from __future__ import annotations

import mutants
import pytest
from tiny_runs import REPO_ROOT


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda mutant: mutant.name)
def test_each_mutants_line_is_in_its_module_once(mutant: mutants.Mutant) -> None:
    text = (REPO_ROOT / "src" / "exactga" / mutant.module).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.name}: update its line in tools/mutants.py"
    assert all((REPO_ROOT / test.split("::")[0]).is_file() for test in mutant.tests)
