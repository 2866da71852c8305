"""exactga's recipes and configs in torchtune's command line (exactga.launch.registry): ``tune ls``
lists them under ``exactga/``, ``tune cp`` copies them, ``tune run exactga/<recipe> --config
exactga/<config>`` runs them, and a copied recipe, edited, runs with a copied tiny config from
any folder. Stock names keep meaning stock recipes."""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from recipe_utils import REPO_ROOT, logged_steps, output_of, run_recipe, tune_in_process

from exactga.launch import registry, twins

CONFIGS = sorted(
    p.relative_to(REPO_ROOT / "configs") for p in (REPO_ROOT / "configs").rglob("*.yaml")
)
RECIPE_FILES = sorted(p.stem for p in (REPO_ROOT / "recipes").glob("*.py") if p.stem != "__init__")


def test_every_recipe_and_config_file_is_registered_once() -> None:
    assert sorted({entry.recipe_file for entry in registry.RECIPES}) == RECIPE_FILES
    names = [entry.name for entry in registry.RECIPES]
    assert len(set(names)) == len(names)
    listed = [config for entry in registry.RECIPES for config in entry.configs]
    assert sorted(listed) == sorted(str(p.with_suffix("")) for p in CONFIGS)
    assert len(set(listed)) == len(listed)


@pytest.mark.parametrize(
    ("recipe", "config"),
    [(entry.name, config) for entry in registry.RECIPES for config in entry.configs],
    ids=lambda value: value,
)
def test_a_config_is_listed_under_the_recipe_its_header_launches(recipe: str, config: str):
    header = registry.config_path(config).read_text().split("\n\n")[0]
    launched = re.search(r"recipes/(\w+)\.py", header)
    entry = registry.recipe_entry(recipe)
    assert launched is not None and launched.group(1) == entry.recipe_file
    if entry.file:  # one file, two names: the header launches this one ([one recipe, two launches])
        assert ("--nproc_per_node" in header) == entry.supports_distributed


def test_torchtunes_twin_names_share_one_file_and_only_the_distributed_one_takes_torchrun() -> None:
    families = {entry.file for entry in registry.RECIPES if entry.file}
    assert families == {"full_finetune", "lora_finetune", "knowledge_distillation", "lora_dpo"}
    for family in families:
        single = registry.recipe_entry(family + "_single_device")
        distributed = registry.recipe_entry(family + "_distributed")
        assert single.recipe_file == distributed.recipe_file == family
        assert not single.supports_distributed and distributed.supports_distributed
        assert registry.distributed_twin(single.name) == distributed.name


def test_distributed_only_keys_are_what_the_distributed_twins_schemas_add() -> None:
    """[one recipe, two launches], rule 3: a config with one of these keys is a distributed
    twin's; no single-device schema reads one."""
    import dataclasses

    from exactga.config.schemas import FULL_FINETUNE, LORA_FINETUNE
    from exactga.dpo.schema import LORA_DPO
    from exactga.kd.schema import KNOWLEDGE_DISTILLATION

    def keys(schema: type) -> set[str]:
        return {f.name for f in dataclasses.fields(schema)}

    pairs = (FULL_FINETUNE, LORA_FINETUNE, KNOWLEDGE_DISTILLATION, LORA_DPO)
    added = set().union(*(keys(p.distributed) - keys(p.single_device) for p in pairs))
    assert added == twins.DISTRIBUTED_ONLY_KEYS
    assert all(keys(p.single_device) <= keys(p.distributed) for p in pairs)


def test_tune_ls_lists_exactgas_after_the_stock_ones_which_keep_their_names() -> None:
    rows = [line.split() for line in tune_in_process("ls").splitlines()[1:]]
    names = [name for row in rows for name in row]
    assert "exactga/full_finetune_single_device" in names
    assert "exactga/tiny/full_single_device" in names and "exactga/llama3_1/8B_lora" in names
    first_ours = names.index("exactga/full_finetune_single_device")
    assert "full_finetune_single_device" in names[:first_ours]  # stock, unprefixed
    assert all(name.startswith("exactga/") for name in names[first_ours:])
    import torchtune._recipe_registry as torchtune_registry

    (stock,) = [
        r for r in torchtune_registry.get_all_recipes() if r.name == "lora_finetune_distributed"
    ]
    assert "site-packages" in str(Path(torchtune_registry.__file__))
    assert all(not config.name.startswith("exactga/") for config in stock.configs)
    registry.add_to_torchtune_registry(torchtune_registry)  # a second time adds nothing
    assert len(
        [r for r in torchtune_registry.get_all_recipes() if r.name.startswith("exactga/")]
    ) == len(registry.RECIPES)


def test_tune_cp_copies_exactgas_files(tmp_path: Path) -> None:
    tune_in_process("cp", "exactga/lora_finetune_distributed", str(tmp_path / "mine"))
    tune_in_process("cp", "exactga/lora_finetune_single_device", str(tmp_path / "mine_too"))
    tune_in_process("cp", "exactga/tiny/lora_distributed", str(tmp_path / "mine_config"))
    shipped = (REPO_ROOT / "recipes/lora_finetune.py").read_text()
    # Either name: the one file, whose one step a copy edits.
    assert (tmp_path / "mine.py").read_text() == shipped == (tmp_path / "mine_too.py").read_text()
    assert (tmp_path / "mine_config.yaml").read_bytes() == (
        REPO_ROOT / "configs/tiny/lora_distributed.yaml"
    ).read_bytes()


def test_bundled_files_resolve_from_any_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.load(registry.config_path("tiny/kd_single_device"))
    assert Path(cfg.tokenizer.path) == REPO_ROOT / "configs/tiny/tokenizer.model"
    assert Path(cfg.dataset.data_files).is_file()
    assert registry.files_root() == REPO_ROOT  # an editable install serves its checkout


def test_the_hook_module_is_the_installed_copy_of_the_source() -> None:
    """CI installs it; a local environment keeps a copy made at install time."""
    installed = importlib.import_module("_exactga_recipes_hook")
    source = REPO_ROOT / "src/_exactga_recipes_hook.py"
    assert Path(installed.__file__).read_text() == source.read_text()


# --- through tune run ---------------------------------------------------------------------

PRINTED = 'print(f"my step {report.step}: loss {report.loss:.6f}")'


@pytest.fixture(scope="module")
def copied_and_edited(tmp_path_factory) -> tuple[Path, str]:
    """A folder outside the repository holding ``tune cp``'s copies, the recipe edited to print
    each step's loss, run there with no path override and the machine's own thread choice."""
    folder = tmp_path_factory.mktemp("my_project")
    tune_in_process("cp", "exactga/full_finetune_single_device", str(folder / "my_recipe.py"))
    tune_in_process("cp", "exactga/tiny/full_single_device", str(folder / "my_config.yaml"))
    recipe = (folder / "my_recipe.py").read_text()
    line = re.search(r"\n( +)steps\.end_step\(window, outcome\)[^\n]*", recipe)
    assert line is not None, "the loop's end_step line moved: update this test and the docs"
    indent = line.group(1)
    edited = f"\n{indent}report = steps.end_step(window, outcome)\n{indent}{PRINTED}"
    (folder / "my_recipe.py").write_text(recipe.replace(line.group(0), edited))
    proc = run_recipe(
        [
            "my_recipe.py",
            "--config",
            "my_config.yaml",
            "max_steps_per_epoch=3",
            "log_every_n_steps=1",
        ],
        cwd=folder,
        extra_env={"OMP_NUM_THREADS": None},  # unset: the recipe picks from the load
    )
    assert proc.returncode == 0, output_of(proc)[-4000:]
    return folder, output_of(proc)


@pytest.mark.slow
def test_a_copied_edited_recipe_runs_from_any_folder_and_its_prints_keep_the_bar_whole(
    copied_and_edited,
):
    folder, output = copied_and_edited
    pieces = re.split(r"[\r\n]", output)
    printed = {
        int(m.group(1)): float(m.group(2))
        for p in pieces
        if (m := re.fullmatch(r"my step (\d+): loss ([\d.]+)", p))
    }
    assert sorted(printed) == [1, 2, 3], [p for p in pieces if "my step" in p]
    logged = logged_steps(folder / "outputs/tiny/full_single_device/logs")
    assert printed == pytest.approx(logged, abs=1e-6)  # the loop's loss is the logged one


@pytest.mark.slow
def test_the_recipe_logs_the_cpu_threads_it_chose(copied_and_edited):
    _, output = copied_and_edited
    chosen = re.search(r"CPU threads: (\d+) \(([\d.]+) of ([\d.]+) usable CPUs free", output)
    assert chosen is not None, output[-3000:]
    assert 1 <= int(chosen.group(1)) <= max(1, os.cpu_count() or 1)


@pytest.mark.slow
def test_tune_run_takes_exactga_names_from_any_folder(tmp_path: Path) -> None:
    proc = run_recipe(
        [
            "exactga/lora_finetune_single_device",
            "--config",
            "exactga/tiny/lora_single_device",
            "max_steps_per_epoch=2",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert "CPU threads: 1 (OMP_NUM_THREADS=1" in output_of(proc)
    assert (tmp_path / "outputs/tiny/lora_single_device/epoch_0").is_dir()
