"""The layout of the library and the recipes, checked by reading the source.

Recipes are leaf scripts that call the library for everything that decides numbers, data order,
resume position or saved artefacts; the library never imports a recipe; each named note is
defined once and every citation finds it. A refactor that copies such logic back into a recipe
fails here, naming the recipe and what it wrote.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exactga.config.options import Option

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.py"))
LIBRARY = sorted((REPO / "src" / "exactga").rglob("*.py"))
TRAINING_RECIPES = [p for p in RECIPES if p.stem != "ga_parity"]

# Names whose use in a recipe means it decides, on its own, something the library decides:
# the data order and loader, loss weighting, counters, resume, saved adapters.
LIBRARY_ONLY_NAMES = {
    "StatefulDistributedSampler": "the sampler (exactga.data.loader.build_dataloader)",
    "StatefulDataLoader": "the data loader (exactga.data.loader.build_dataloader)",
    "ConcatDataset": "the dataset (exactga.data.loader.load_dataset)",
    "checked_dataset": "the dataset (exactga.data.loader.load_dataset)",
    "scale_grads": "gradient scaling (exactga.accumulation.normalization)",
    "get_merged_lora_ckpt": "the saved adapters (exactga.lora.adapters.epoch_checkpoint_weights)",
    "get_adapter_state_dict": "the saved adapters (exactga.lora.adapters.epoch_checkpoint_weights)",
    "restore_rng_state": "resume (exactga.run.resume.ResumePoint)",
    "capture_rng_state": "resume (exactga.run.resume.write_step_checkpoint)",
    "handle_nonfinite_loss": "the non-finite policy (exactga.run.steps.StepBook)",
    "close_epoch": "the save order at an epoch's end (exactga.run.steps.StepBook)",
    "step_metrics": "the logged metrics (exactga.run.steps.StepBook)",
    "log_dict": "what is logged (exactga.run.steps.StepBook)",
}
# Counters only TrainingProgress moves; see exactga.run.progress.
COUNTERS = ("global_step", "epochs_run", "num_skipped_steps", "num_nonfinite_steps")


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of ``path``'s syntax tree, parsed once for the module: the tests only read
    them, and most files are read by several tests."""
    return tuple(ast.walk(ast.parse(path.read_text())))


def _names_called(path: Path) -> set[str]:
    """The names a file calls (``f(...)``, ``obj.f(...)``, ``Class(...)``)."""
    called = set()
    for node in _nodes(path):
        if isinstance(node, ast.Call):
            func = node.func
            called.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return called


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_leave_numbers_data_order_and_resume_to_the_library(recipe: Path) -> None:
    called = _names_called(recipe)
    offending = {name: what for name, what in LIBRARY_ONLY_NAMES.items() if name in called}
    assert not offending, f"{recipe.name} decides {sorted(set(offending.values()))} itself"


# What a training recipe sets up only through its Runtime (exactga.runtime.runtime) and
# exactga.wiring.run_start, one call each: the setup that decides numbers and artefacts (see
# [setup order]). The parity report trains its splits its own way.
SETUP_ONLY_NAMES = {
    "set_seed": "the seed (exactga.runtime.runtime.Runtime)",
    "init_distributed": "the process group (exactga.runtime.runtime.Runtime)",
    "build_device_mesh": "the device mesh (exactga.runtime.runtime.Runtime)",
    "start_run": "the resume point (exactga.wiring.run_start.RunStart)",
    "build_frozen_model": "frozen models (exactga.wiring.run_start.RunStart.frozen_model)",
    "shard_model": "sharding (exactga.wiring.run_start.RunStart.build_model)",
    "restore_progress": "the counters of a resume (RunStart.build_optimizer)",
    "dataloader_from_settings": "the loader (exactga.wiring.run_start.RunStart.dataloader)",
    "RunCheckpoints": "the checkpoints (exactga.wiring.run_start.RunStart.training_run)",
    "StepBook": "the step bookkeeping (exactga.wiring.run_start.RunStart.training_run)",
    "restore_rng": "the RNG states of a resume (RunStart.training_run)",
    "LossNormalizer": "the normaliser's ranks (exactga.wiring.run_start.RunStart.normalizer)",
}


# What a recipe reaches only through exactga.wiring.run_start's one call each (their names are
# also RunStart's methods, so the test looks at imports rather than calls).
SETUP_INTERNALS = {
    "exactga.model_build.trained": {"build_model"},
    "exactga.accumulation.optimizers": {"build_optimizer"},
}


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.stem)
def test_training_recipes_leave_the_setup_to_the_run_start(recipe: Path) -> None:
    called = _names_called(recipe)
    offending = {name: what for name, what in SETUP_ONLY_NAMES.items() if name in called}
    assert not offending, f"{recipe.name} decides {sorted(set(offending.values()))} itself"


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.stem)
def test_recipes_build_model_and_optimizer_through_the_run_start(recipe: Path) -> None:
    for node in _nodes(recipe):
        if isinstance(node, ast.ImportFrom) and node.module in SETUP_INTERNALS:
            imported = {alias.name for alias in node.names} & SETUP_INTERNALS[node.module]
            assert not imported, f"{recipe.name} imports {imported}: use RunStart's methods"


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.stem)
def test_only_training_progress_moves_the_counters(recipe: Path) -> None:
    for node in _nodes(recipe):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in COUNTERS:
                pytest.fail(f"{recipe.name}:{node.lineno} sets {target.attr} itself")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_import_no_other_recipe(recipe: Path) -> None:
    others = {p.stem for p in RECIPES}
    for node in _nodes(recipe):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.module.split(".")[-1] not in others, f"{recipe.name} imports a recipe"
            assert not node.module.startswith("recipes"), f"{recipe.name} imports a recipe"


def test_the_library_imports_no_recipe() -> None:
    for path in LIBRARY:
        for node in _nodes(path):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                assert not module.startswith("recipes"), f"{path.name} imports {module}"


def _joined(path: Path) -> str:
    """The file's text with wrapped comment and docstring lines joined, so a note's name
    broken over two lines still reads as one."""
    return re.sub(r"\s*\n\s*#?\s*", " ", path.read_text())


def test_every_named_note_is_defined_once_and_every_citation_finds_it() -> None:
    defined: dict[str, list[str]] = {}
    cited: dict[str, list[str]] = {}
    for path in [*LIBRARY, *RECIPES]:
        text = _joined(path)
        for name in re.findall(r"Note \[([^\]]+)\]", text):
            defined.setdefault(name, []).append(path.name)
        for name in re.findall(r"[Ss]ee \[([^\]]+)\]", text):
            cited.setdefault(name, []).append(path.name)
    assert defined, "no named note found: has the form changed?"
    twice = {name: files for name, files in defined.items() if len(files) > 1}
    assert not twice, f"notes defined more than once: {twice}"
    dangling = {name: files for name, files in cited.items() if name not in defined}
    assert not dangling, f"cited notes that are not defined: {dangling}"


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.stem)
def test_recipes_leave_the_step_bookkeeping_to_the_library(recipe: Path) -> None:
    """The throughput figure and the epoch's data order are decided in exactga.run.steps; see
    [step bookkeeping]. The calls that decide the rest are in LIBRARY_ONLY_NAMES."""
    identifiers = set()
    for node in _nodes(recipe):
        if isinstance(node, ast.Name):
            identifiers.add(node.id)
        elif isinstance(node, ast.Attribute):
            identifiers.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            identifiers.add(node.arg)
    for name in ("tokens_per_second_per_gpu", "set_epoch"):
        assert name not in identifiers, f"{recipe.name} uses {name} (exactga.run.steps.StepBook)"


def _exactga_imports(path: Path) -> set[str]:
    """The exactga modules a file imports (``from exactga.x import y`` names ``exactga.x``)."""
    modules = set()
    for node in _nodes(path):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return {module for module in modules if module.split(".")[0] == "exactga"}


# The packages of src/exactga and what each may import besides itself: layers at the bottom,
# one package per loss family above them (a family never imports another), then the parity
# report, which trains every family. The profiler is the recipes' (and the report's): the step
# takes it as an argument and never imports it. docs/architecture.md draws the same table.
LAYERS = (
    "config",
    "launch",
    "runtime",
    "data",
    "accumulation",
    "run",
    "models",
    "qat",
    "lora",
    "model_build",
    "checkpoints",
    "wiring",
    "validation",
)
FAMILIES = ("sft", "kd", "dpo", "grpo", "ppo")
ALLOWED_IMPORTS = {
    "config": set(),
    "launch": set(),
    "runtime": {"config"},
    "data": {"config", "runtime"},
    "accumulation": {"config", "runtime", "data"},
    # launch sits at the bottom beside config: run reads the stop request it records.
    "run": {"config", "launch", "runtime", "data", "accumulation"},
    # Model families, their formats and checkpointers, loading a state dict: below the build.
    "models": {"config", "runtime"},
    # QAT's fake quantisation and LoRA's adapters: what the model build puts into a model.
    "qat": {"runtime"},
    "lora": {"config", "models", "run"},
    # The trained model built in one order, and frozen models.
    "model_build": {"config", "runtime", "run", "models", "qat", "lora"},
    # What epoch and step checkpoints hold of the model and optimizer.
    "checkpoints": {"runtime", "accumulation", "run", "lora"},
    # A recipe's run wired in the order that decides its numbers (exactga.wiring.run_start):
    # the loader and the profiler too.
    "wiring": {
        "config",
        "launch",  # which of a recipe file's two schemas a launch runs (exactga.launch.twins)
        "runtime",
        "data",
        "accumulation",
        "run",
        "qat",
        "lora",
        "model_build",
        "checkpoints",
        "profiling",
    },
    # Validation during training: the held-out set and the exact sums of its losses, below the
    # families whose figures they make.
    "validation": {"config", "runtime", "data", "accumulation"},
    # Sampling what the policy generates, below the families that train on it (GRPO, PPO).
    "generation": {"accumulation", "model_build"},
    **{
        family: {"config", "runtime", "data", "accumulation", "model_build", "models", "validation"}
        for family in FAMILIES
    },
    "profiling": {"config", "runtime", "data", "accumulation"},
    "parity": {*LAYERS, *FAMILIES, "generation", "models", "profiling"} - {"launch"},
}
ALLOWED_IMPORTS["grpo"].add("generation")
ALLOWED_IMPORTS["ppo"].add("generation")


def _package_of(path: Path) -> str:
    """The package of src/exactga a module belongs to (``exactga`` for the top ``__init__``)."""
    parts = path.relative_to(REPO / "src" / "exactga").parts
    return parts[0] if len(parts) > 1 else "exactga"


@functools.cache
def _package_imports() -> dict[str, dict[str, set[str]]]:
    """package -> {imported package -> the modules of package that import it}, built once for
    the module's tests (which only read it)."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in LIBRARY:
        package = _package_of(path)
        for module in _exactga_imports(path):
            target = module.split(".")[1] if "." in module else "exactga"
            if target != package:
                graph.setdefault(package, {}).setdefault(target, set()).add(path.name)
    return graph


def test_every_library_module_lives_in_a_package_of_the_table() -> None:
    packages = {_package_of(path) for path in LIBRARY} - {"exactga"}
    assert packages == set(ALLOWED_IMPORTS), (
        f"packages not in ALLOWED_IMPORTS: {sorted(packages - set(ALLOWED_IMPORTS))}; "
        f"in it but gone: {sorted(set(ALLOWED_IMPORTS) - packages)}"
    )
    top = [path.name for path in LIBRARY if _package_of(path) == "exactga"]
    assert top == ["__init__.py"], f"modules outside a package: {top}"


@pytest.mark.parametrize("package", sorted(ALLOWED_IMPORTS))
def test_a_package_imports_only_what_the_table_allows(package: str) -> None:
    """See ALLOWED_IMPORTS: no layer imports one above it, no family another family."""
    imported = _package_imports().get(package, {})
    forbidden = {
        target: sorted(modules)
        for target, modules in imported.items()
        if target not in ALLOWED_IMPORTS[package]
    }
    assert not forbidden, f"exactga.{package} imports what it may not: {forbidden}"


def test_the_package_graph_has_no_cycle() -> None:
    graph = {package: set(targets) for package, targets in _package_imports().items()}
    visiting: list[str] = []
    done: set[str] = set()

    def visit(package: str) -> None:
        if package in visiting:
            cycle = visiting[visiting.index(package) :] + [package]
            pytest.fail(f"import cycle between packages: {' -> '.join(cycle)}")
        if package in done:
            return
        visiting.append(package)
        for target in sorted(graph.get(package, ())):
            visit(target)
        visiting.pop()
        done.add(package)

    for package in sorted(graph):
        visit(package)


def _module_name(path: Path) -> str:
    """``src/exactga/dpo/loss.py`` -> ``exactga.dpo.loss`` (a package's ``__init__``: its name)."""
    parts = path.relative_to(REPO / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _module_imports() -> dict[str, set[str]]:
    """module -> the exactga modules it imports anywhere in its file: at the top, inside a
    function, or under ``TYPE_CHECKING`` (``from exactga.x import y`` names ``exactga.x.y``
    where ``y`` is a module, else ``exactga.x``). Built once for the module."""
    modules = {_module_name(path): path for path in LIBRARY}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in _nodes(path):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {target for target in targets if target in modules} - {name}
    return graph


def test_the_module_graph_has_no_cycle() -> None:
    """No two modules import each other, even through others, and even where an import is
    local to a function or under ``TYPE_CHECKING``: hiding a circle is still a circle."""
    graph = _module_imports()
    assert "exactga.dpo.loss" in graph and graph["exactga.dpo.loss"], "has the layout changed?"
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in visiting:
            cycle = visiting[visiting.index(module) :] + [module]
            pytest.fail(f"import cycle between modules: {' -> '.join(cycle)}")
        if module in done:
            return
        visiting.append(module)
        for target in sorted(graph[module]):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


@pytest.mark.parametrize("family", ["kd", "dpo", "grpo"])
def test_a_family_schema_imports_only_the_config_package(family: str) -> None:
    """Settings flow down: a family's keys extend exactga.config's schemas and import nothing
    that runs, so validating a config loads no model, loader or step."""
    imported = _exactga_imports(REPO / "src" / "exactga" / family / "schema.py")
    assert imported and all(module.startswith("exactga.config.") for module in imported), imported


def test_importing_the_schemas_loads_no_runtime_module() -> None:
    """The same at run time: validating any recipe's config imports only exactga.config, the
    families' schema modules and the config resolver (exactga.launch.registry, which the
    package's ``__init__`` registers; it imports nothing of exactga's, nor torch)."""
    code = (
        "import sys, exactga.config.schemas, exactga.kd.schema, exactga.dpo.schema, "
        "exactga.grpo.schema; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'exactga'))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    allowed_packages = {
        "exactga",
        "exactga.config",
        "exactga.launch",
        *(f"exactga.{f}" for f in FAMILIES),
    }
    unexpected = [
        module
        for module in ast.literal_eval(loaded)
        if module not in allowed_packages
        and not module.startswith("exactga.config.")
        and module != "exactga.launch.registry"
        and not module.endswith(".schema")
    ]
    assert not unexpected, f"validating a config loads {unexpected}"


# Config values validate_config has checked and handed over as enum members: a recipe reads
# them as they are, so no recipe converts or re-checks one (see exactga.config.options).
CONVERTERS = {"as_option", *(option.__name__ for option in Option.__subclasses__())}
# parity.splits ("BxG" or "BxGxN") is a list of strings in the config; what N may be depends on
# the launch's process count, which the recipe reads, so ga_parity parses it.
ALLOWED_PARSERS = {"parse_splits"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_take_config_values_as_validate_config_typed_them(recipe: Path) -> None:
    called = _names_called(recipe)
    parsers = {name for name in called if name.startswith("parse_")} - ALLOWED_PARSERS
    assert not parsers, f"{recipe.name} parses config values validate_config checked: {parsers}"
    converted = called & CONVERTERS
    assert not converted, f"{recipe.name} converts config values itself: {sorted(converted)}"


# Names of optimizer_in_bwd's plumbing, which lives in
# exactga.accumulation.optimizers.OptimizerInBackward.
IN_BACKWARD_PLUMBING = (
    "_optim_ckpt_wrapper",
    "optim_map",
    "register_optim_in_bwd_hooks",
    "create_optim_in_bwd_wrapper",
    "OptimizerInBackwardWrapper",
    "steps_in_backward",
)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_do_not_branch_on_optimizer_in_backward(recipe: Path) -> None:
    """``optimizer_in_bwd`` is one object with the optimizer's interface (see [optimizer in
    backward] in exactga.accumulation.optimizers): a recipe copies the flag and hands it to
    ``build_optimizer``, and its loop, checkpoints and scheduler are those of any optimizer."""
    source = recipe.read_text()
    for name in IN_BACKWARD_PLUMBING:
        assert name not in source, (
            f"{recipe.name} mentions {name} (exactga.accumulation.optimizers)"
        )
    allowed: set[int] = set()  # the flag's copy in __init__ and build_optimizer's argument
    for node in _nodes(recipe):
        if isinstance(node, ast.Call) and _callee(node) == "build_optimizer":
            allowed |= {id(n) for kw in node.keywords for n in ast.walk(kw.value)}
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "optimizer_in_bwd"
        ):
            allowed |= {id(n) for part in (node.value, *node.targets) for n in ast.walk(part)}
    uses = sorted(
        (node.lineno, ast.unparse(node))
        for node in _nodes(recipe)
        if isinstance(node, ast.Attribute)
        and "optimizer_in_bwd" in node.attr
        and id(node) not in allowed
    )
    assert not uses, f"{recipe.name} reads optimizer_in_bwd beyond build_optimizer: {uses}"


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.stem)
def test_recipes_let_the_library_choose_the_attention_kernels(recipe: Path) -> None:
    """Every training recipe applies ``cudnn_attention`` through ``exactga.runtime.kernels`` (see
    [cuDNN attention and variable shapes]) and none sets torch's backend flags itself."""
    source = recipe.read_text()
    runtimes = ("Runtime.for_settings(cfg", "Runtime.single_device(cfg)", "Runtime.distributed(cfg")
    assert any(runtime in source for runtime in runtimes)
    assert "enable_cudnn_sdp" not in source and "sdpa_kernel" not in source
    from exactga.runtime.runtime import Runtime

    runtime_source = inspect.getsource(Runtime)
    assert runtime_source.count("choose_attention_kernels(cfg.cudnn_attention") == 2


def test_the_normaliser_has_no_say_in_a_windows_size() -> None:
    """``gradient_accumulation_steps`` and ``drop_partial_window`` are read by
    ``exactga.data.loader`` only: the normaliser counts the windows it is given and has no say in
    their size."""
    from exactga.accumulation.normalization import LossNormalizer

    params = set(inspect.signature(LossNormalizer).parameters)
    assert not params & {"gradient_accumulation_steps", "drop_partial_window"}


@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda p: p.stem)
def test_the_training_loop_stays_readable(recipe: Path) -> None:
    """Each training recipe's ``train()`` fits on a screen (at most 60 lines): the loop a user
    edits, with the step's decisions in the library."""
    functions = [node for node in _nodes(recipe) if isinstance(node, ast.FunctionDef)]
    (train,) = [node for node in functions if node.name == "train"]
    assert train.end_lineno - train.lineno + 1 <= 60


# --- the tests' own house -----------------------------------------------------------------------

TESTS = REPO / "tests"


def _imported_top_names(path: Path) -> set[str]:
    """The top-level module names ``path`` imports (``import a.b``, ``from a.b import c``)."""
    names = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("folder", ["benchmarks", "tools"])
def test_benchmarks_and_tools_import_no_test_module(folder: str) -> None:
    """What they share with the tests lies in tools/ (docs/contributing.md, point 9)."""
    test_modules = {path.stem for path in TESTS.rglob("*.py")}
    for path in sorted((REPO / folder).rglob("*.py")):
        wrong = _imported_top_names(path) & test_modules
        assert not wrong, f"{path.relative_to(REPO)} imports test modules {sorted(wrong)}"


def test_the_tests_patch_no_pytest_internals() -> None:
    """Fixtures and hooks go through pytest's and xdist's public interfaces only."""
    for path in sorted(TESTS.rglob("*.py")):
        if "_pytest" in path.read_text():  # a file cannot import it without naming it: parse
            assert "_pytest" not in _imported_top_names(path), path.relative_to(REPO)


# The test modules that start a real ``tune`` process (``recipe_utils.run_tune``, ``TUNE``
# itself, or a SLURM job script, which runs ``tune``): what only a launch shows, as
# docs/contributing.md (point 9) lists them. Every other recipe run forks its ranks
# (tests/launcher.py). tests/gpu/ launches on CUDA, each a fresh process that initialises CUDA
# itself.
REAL_LAUNCHES = {
    "test_bad_input_launch.py",
    "test_dead_rank.py",
    "test_launching.py",
    "test_multi_node_launch.py",
    "test_stop_on_signal.py",
}


def test_real_tune_launches_stay_in_the_modules_the_contributing_guide_lists() -> None:
    launching = {
        path.name
        for path in TESTS.glob("test_*.py")
        if path.name != Path(__file__).name
        and re.search(r"\brun_tune\b|\bTUNE\b|\.sbatch\b", path.read_text())
    }
    assert launching == REAL_LAUNCHES
    guide = (REPO / "docs" / "contributing.md").read_text()
    assert all(name.removesuffix(".py") in guide for name in REAL_LAUNCHES)
