"""What the docs name exists: every repository path, every ``exactga.`` module or attribute, every
``tune run`` command's recipe and config, every ``make`` target (issue #63: "the claims a test
can check, checked").

A page that shows a name which does not exist on purpose (a user's own file in an example, a
path in an error message, torchtune's own recipe folder) lists it in ``NOT_OURS`` with why, so a
rename that leaves a page behind fails here instead of sending a reader to nothing.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from torchtune._recipe_registry import get_all_recipes

from exactga.launch import registry

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]

# Names a page shows that are not ours to have, each with why.
NOT_OURS = {
    "recipes/dev/grpo_full_finetune_distributed.py": "torchtune's own GRPO recipe (grpo.md)",
    "recipes/my_recipe.py": "a user's copy in launching.md's examples",
    "recipes/x.py": "a user's copy in launching.md's examples",
    "$EXACTGA/recipes/full_finetune.py": "the clone's recipe by absolute path (launching.md)",
    "$EXACTGA/configs/tiny/full_single_device.yaml": "its config, likewise (launching.md)",
    "configs/tiny/nope.yaml": "the missing config of reliability.md's message example",
    "docs/gpu_report_tests.md": "a report round two's command writes (gpu_report_round_two.md)",
    "tests/test_models_": "the prefix of tests/test_models_<family>.py (models.md)",
    "exactga.x.y": "the shape of a module path (contributing.md)",
    "exactga.yaml": "a file name, DIR/exactga.yaml (dpo.md)",
}
# A repository path: one of the top folders, then a name; not part of a longer path or URL.
PATH = re.compile(
    r"(?<![\w/.-])((?:src|recipes|configs|tests|tools|benchmarks|docs|\.ci)/[\w./-]*\w)"
)
DOTTED = re.compile(r"(?<![\w.])(exactga(?:\.\w+)+)")
TUNE_RUN = re.compile(r"tune run (?:--\w+ \S+ )*(\S+)\s+(?:\\\s+)?--config (\S+)")
MAKE = re.compile(r"`make ([a-z][\w-]*)")
PLACEHOLDER = re.compile(r"[<>*{}]|\.\.\.|DIR/|^my[_.-]|/my[_.-]")


def _names(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """(page, name) for every match of ``pattern``'s first group on every page."""
    return sorted(
        {
            (page.name, match.group(1).rstrip("."))
            for page in PAGES
            for match in pattern.finditer(page.read_text())
        }
    )


def _resolves(dotted: str) -> bool:
    """``dotted`` is an importable module, or an attribute path under the longest one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


def _ours(name: str) -> bool:
    return name not in NOT_OURS and not PLACEHOLDER.search(name)


def test_every_repository_path_a_page_names_exists() -> None:
    missing = [f"{page}: {path}" for page, path in _names(PATH) if _ours(path)]
    missing = [entry for entry in missing if not (REPO / entry.split(": ")[1]).exists()]
    assert not missing, "pages name paths that do not exist:\n" + "\n".join(missing)


def test_every_exactga_name_a_page_gives_resolves() -> None:
    wrong = [f"{page}: {name}" for page, name in _names(DOTTED) if _ours(name)]
    wrong = [entry for entry in wrong if not _resolves(entry.split(": ")[1])]
    assert not wrong, "pages name exactga modules or attributes that do not exist:\n" + "\n".join(
        wrong
    )


def _recipe_exists(recipe: str) -> bool:
    if recipe.endswith(".py"):
        return (REPO / recipe).exists()
    ours = {entry.name for entry in registry.RECIPES}
    return recipe.removeprefix("exactga/") in ours or any(
        r.name == recipe for r in get_all_recipes()
    )


def _config_exists(config: str) -> bool:
    if config.endswith((".yaml", ".yml")):
        return (REPO / config).exists()
    if config.startswith("exactga/"):
        return (REPO / "configs" / f"{config.removeprefix('exactga/')}.yaml").exists()
    return any(c.name == config for r in get_all_recipes() for c in r.configs)


def _trimmed(word: str) -> str:
    """A command's last word without the sentence's punctuation around it (``...`` kept)."""
    word = word.rstrip("`),;")
    return word if word.endswith("...") else word.rstrip(".")


def test_every_tune_run_command_names_a_recipe_and_config_that_exist() -> None:
    commands = {
        (page.name, match.group(1), _trimmed(match.group(2)))
        for page in PAGES
        for match in TUNE_RUN.finditer(page.read_text())
    }
    wrong = [
        f"{page}: tune run {recipe} --config {config}"
        for page, recipe, config in sorted(commands)
        if _ours(recipe)
        and _ours(config)
        and not (_recipe_exists(recipe) and _config_exists(config))
    ]
    assert len(commands) > 50, "the pattern no longer finds the pages' commands"
    assert not wrong, "commands whose recipe or config does not exist:\n" + "\n".join(wrong)


def test_every_make_target_a_page_names_exists() -> None:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
    wrong = [f"{page}: make {target}" for page, target in _names(MAKE) if target not in targets]
    assert not wrong, "pages name make targets the Makefile lacks:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("src/exactga/no_such_module.py", PATH),
        ("exactga.launch.no_such_function", DOTTED),
    ],
)
def test_a_name_that_does_not_exist_is_found(name: str, kind: re.Pattern[str]) -> None:
    found = [match.group(1) for match in kind.finditer(f"see `{name}` there")]
    assert found == [name]
    if kind is PATH:
        assert not (REPO / name).exists()
    else:
        assert not _resolves(name)
