"""Launch mix-ups (see [launch mix-ups] in exactga.launch.mixups): a command that would train
something other than asked is refused in one message naming the command that runs it, before
anything is written; a recipe given by a path that is no module name runs.

The refusals of ``tune run`` itself are checked in-process through torchtune's own parser (the
start-up hook patched it in this interpreter as in any other); what needs a launch (the
recipe's own refusal under torchrun, the hook in a fresh ``tune``, a run by absolute path) is
launched, each launch to its refusal or one tiny step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import re
from pathlib import Path

import pytest
import torchtune
import yaml
from recipe_utils import (
    INITIAL,
    RECIPE,
    REPO_ROOT,
    TINY_CONFIG,
    TRAINED,
    output_of,
    run_recipe,
    tiny_args,
)

from exactga.launch import mixups, registry, twins

TORCHTUNE_RECIPES = Path(torchtune.__file__).resolve().parents[1] / "recipes"
SCHEMA_MODULES = (
    "exactga.config.schemas",
    "exactga.kd.schema",
    "exactga.dpo.schema",
    "exactga.grpo.schema",
    "exactga.ppo.schema",
)
STOCK_RECIPES = [entry.name for entry in registry.RECIPES if entry.name != "ga_parity"]


def _tune_run(monkeypatch, *args: str) -> tuple[int, str]:
    """``tune run <args>`` in-process through torchtune's parser: its exit status and stderr.
    Only for commands refused before a recipe runs."""
    from torchtune._cli.tune import TuneCLIParser

    monkeypatch.setattr("sys.argv", ["tune", "run", *args])  # tune run reads it for torchrun
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # tune run appends the cwd
    parser = TuneCLIParser()
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), pytest.raises(SystemExit) as exit_info:
        parser.run(parser._parser.parse_args(["run", *args]))
    return exit_info.value.code, printed.getvalue()


def _schema_keys() -> set[str]:
    keys: set[str] = set()
    for name in SCHEMA_MODULES:
        module = importlib.import_module(name)
        for _, schema in inspect.getmembers(module, dataclasses.is_dataclass):
            if isinstance(schema, type) and schema.__module__ == name:
                keys |= {field.name for field in dataclasses.fields(schema)}
    return keys


@functools.cache
def _loaded(config_file: Path) -> object:
    """A YAML file as ``yaml.safe_load`` reads it, through libyaml's parser (several times
    faster on torchtune's hundreds of configs), read once for the module."""
    return yaml.load(config_file.read_text(), Loader=yaml.CSafeLoader)


def _stock_config_keys() -> set[str]:
    keys: set[str] = set()
    for path in (TORCHTUNE_RECIPES / "configs").rglob("*.yaml"):
        loaded = _loaded(path)
        keys |= set(loaded) if isinstance(loaded, dict) else set()
    return keys


def test_exactgas_own_keys_are_the_schemas_keys_no_torchtune_recipe_or_config_knows() -> None:
    stock_sources = " ".join(p.read_text() for p in TORCHTUNE_RECIPES.rglob("*.py"))
    derived = {
        key
        for key in _schema_keys() - _stock_config_keys()
        if not re.search(rf"\b{key}\b", stock_sources)  # read by a stock recipe: not ours
    }
    assert derived == registry.EXACTGA_ONLY_KEYS


@pytest.mark.parametrize("recipe", STOCK_RECIPES)
def test_every_shipped_config_of_a_recipe_torchtune_also_has_is_refused_under_the_stock_name(
    recipe: str,
) -> None:
    listed = {recipe: False}
    for config in registry.recipe_entry(recipe).configs:
        problem = mixups.tune_run_problem(recipe, str(registry.config_path(config)), False, listed)
        assert problem is not None and f"exactga/{recipe}" in problem, config


def test_no_stock_config_is_refused_under_its_stock_recipe() -> None:
    import torchtune._recipe_registry as torchtune_registry

    listed = {r.name: r.supports_distributed for r in torchtune_registry.get_all_recipes()}
    stock = [r for r in torchtune_registry.get_all_recipes() if not r.name.startswith("exactga/")]
    for recipe in stock:
        for config in recipe.configs:
            path = TORCHTUNE_RECIPES / "configs" / config.file_path
            assert mixups.tune_run_problem(recipe.name, str(path), False, listed) is None, path


def test_a_stock_recipe_name_with_an_exactga_config_names_the_command_that_runs_it(
    monkeypatch,
) -> None:
    config = "configs/qwen3/0.6B_lora_single_device.yaml"
    monkeypatch.chdir(REPO_ROOT)
    status, printed = _tune_run(monkeypatch, "lora_finetune_single_device", "--config", config)
    assert status == 1
    assert printed.count("exactga: ") == 1 and "Traceback" not in printed
    assert f"tune run exactga/lora_finetune_single_device --config {config}" in printed
    assert "loss_normalization" in printed and "master_weights" in printed


@pytest.mark.parametrize(
    ("recipe", "suggested"),
    [
        ("exactga/full_finetune_single_devic", "'exactga/full_finetune_single_device'"),
        ("full_finetune_single_devic", "'full_finetune_single_device'"),
        # torchtune's file name, and the one file of both of its names
        ("recipes/lora_finetune_single_device.py", "'exactga/lora_finetune_single_device'"),
        (
            "recipes/lora_finetune.py",
            "'exactga/lora_finetune_single_device' or 'exactga/lora_finetune_distributed'",
        ),
    ],
)
def test_a_recipe_that_is_no_name_file_or_module_is_one_message_with_the_nearest_name(
    monkeypatch, tmp_path, recipe: str, suggested: str
) -> None:
    monkeypatch.chdir(tmp_path)  # no recipes/ folder here
    status, printed = _tune_run(monkeypatch, recipe, "--config", "exactga/tiny/full_single_device")
    assert status == 1 and "Traceback" not in printed
    assert f"Did you mean {suggested}?" in printed


def test_an_exactga_single_device_name_under_torchrun_names_its_distributed_twin(
    monkeypatch,
) -> None:
    args = ["--nproc_per_node", "2", "exactga/lora_dpo_single_device", "--config", "x.yaml"]
    status, printed = _tune_run(monkeypatch, *args)
    assert status == 1
    assert "tune run --nproc_per_node 2 exactga/lora_dpo_distributed --config x.yaml" in printed


@pytest.mark.parametrize(
    ("recipe", "by_path"),
    [
        ("recipes/full_finetune.py", False),  # imported as recipes.<name>
        (str(REPO_ROOT / RECIPE), True),
        ("./recipes/full_finetune.py", True),
        ("recipes/../recipes/full_finetune.py", True),
        ("recipes/no_such_recipe.py", False),
    ],
)
def test_a_recipe_path_that_is_no_module_name_runs_by_its_path(
    monkeypatch, recipe: str, by_path: bool
) -> None:
    monkeypatch.chdir(REPO_ROOT)
    found = mixups.path_only_recipe(recipe)
    assert (found == REPO_ROOT / RECIPE) if by_path else found is None


def _single_device_check(monkeypatch, world_size: str, recipe_file: Path, **globals_: str):
    monkeypatch.setenv("WORLD_SIZE", world_size)
    monkeypatch.delenv(mixups.LAUNCH_COMMAND_ENV, raising=False)
    return mixups.single_device_problem(recipe_file, globals_)


def test_a_single_device_only_recipe_or_its_copy_refuses_several_processes(monkeypatch, tmp_path):
    ppo = REPO_ROOT / "recipes/ppo_full_finetune_single_device.py"
    problem = _single_device_check(
        monkeypatch, "4", ppo, RECIPE_NAME="ppo_full_finetune_single_device"
    )
    assert problem is not None and "no distributed version" in problem
    copy = tmp_path / "my_recipe.py"  # a copy that renamed RECIPE_NAME: its source tells
    copy.write_text(ppo.read_text().replace('"ppo_full_finetune_single_device"', '"mine"'))
    problem = _single_device_check(monkeypatch, "2", copy, RECIPE_NAME="mine")
    assert problem is not None and "my_recipe.py trains on one device" in problem
    # one process: nothing to refuse
    assert (
        _single_device_check(monkeypatch, "1", ppo, RECIPE_NAME="ppo_full_finetune_single_device")
        is None
    )


def test_a_file_of_two_names_or_its_copy_takes_several_processes(monkeypatch, tmp_path):
    """Under torchrun the one file of torchtune's twins trains on every rank, whatever its
    config ([one recipe, two launches]): nothing to refuse, for it or a renamed copy."""
    shipped = REPO_ROOT / RECIPE
    assert _single_device_check(monkeypatch, "2", shipped, RECIPE_NAME="full_finetune") is None
    copy = tmp_path / "my_recipe.py"
    copy.write_text(shipped.read_text().replace('"full_finetune"', '"mine"'))
    assert _single_device_check(monkeypatch, "2", copy, RECIPE_NAME="mine") is None


@pytest.mark.parametrize(
    ("environment", "keys", "launched"),
    [
        ({}, {"model", "batch_size"}, "full_finetune_single_device"),
        ({}, {"model", "fsdp_cpu_offload"}, "full_finetune_distributed"),  # a distributed config
        ({"RANK": "0"}, {"model"}, "full_finetune_distributed"),  # torchrun, any config
        (
            {twins.LAUNCHED_AS_ENV: "full_finetune_distributed"},
            {"model"},
            "full_finetune_distributed",
        ),
        (
            {twins.LAUNCHED_AS_ENV: "full_finetune_single_device"},
            {"gradient_sync"},  # the single-device schema then names the key
            "full_finetune_single_device",
        ),
        ({twins.LAUNCHED_AS_ENV: "lora_dpo_distributed"}, {"model"}, "full_finetune_single_device"),
    ],
)
def test_a_launch_of_a_file_of_two_names_runs_as_one_of_them(
    monkeypatch, environment: dict[str, str], keys: set[str], launched: str
) -> None:
    """[one recipe, two launches]: torchrun, else the exactga name launched (another family's
    is no answer), else the config."""
    for variable in ("RANK", twins.LAUNCHED_AS_ENV):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    assert twins.launched_as("full_finetune", keys) == launched


def test_the_recipes_check_of_a_mixed_up_config_takes_the_name_the_launch_runs_as(
    monkeypatch,
) -> None:
    """run_recipe asks the family checks with the name validated_config will pick."""
    from exactga.launch import cli

    for variable in ("RANK", twins.LAUNCHED_AS_ENV):
        monkeypatch.delenv(variable, raising=False)
    one_file = {"RECIPE_NAME": "lora_finetune"}
    single = ["x.py", "--config", str(registry.config_path("tiny/lora_single_device"))]
    distributed = ["x.py", "--config", str(registry.config_path("tiny/lora_distributed"))]
    assert cli._launched_name(one_file, single) == "lora_finetune_single_device"
    assert cli._launched_name(one_file, distributed) == "lora_finetune_distributed"
    assert cli._launched_name(one_file, [*single, "gradient_sync=once_per_window"]) == (
        "lora_finetune_distributed"
    )
    assert (
        cli._launched_name(
            one_file,
            [
                *distributed,
                "~gradient_sync",
                "~rank_balancing",
                "~fsdp_cpu_offload",
                "~fsdp_reshard_after_forward",
            ],
        )
        == "lora_finetune_single_device"
    )
    monkeypatch.setenv("RANK", "1")
    assert cli._launched_name(one_file, single) == "lora_finetune_distributed"
    assert cli._launched_name({"RECIPE_NAME": "qat_distributed"}, single) == "qat_distributed"


def test_the_single_device_runtime_refuses_several_processes(monkeypatch) -> None:
    """For a copy that calls its recipe_main without run_recipe."""
    from exactga.runtime.runtime import Runtime

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="launched as one of 2 processes"):
        Runtime.single_device(None)


# --- launches -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("copy", [False, True], ids=["shipped", "tune_cp_copy"])
def test_a_file_of_two_names_by_path_under_torchrun_trains_a_one_device_config_on_every_rank(
    tmp_path: Path, copy: bool
) -> None:
    """Where torchtune's single-device file under torchrun trained the whole run once per
    process into one folder, the one file runs its distributed schema: each rank its share."""
    out = tmp_path / "out"
    args = tiny_args(out, max_steps_per_epoch=1)
    cwd = REPO_ROOT
    if copy:  # the user's copy, as docs/launching.md makes it
        cwd = tmp_path / "project"
        cwd.mkdir()
        (cwd / "my_recipe.py").write_text((REPO_ROOT / RECIPE).read_text())
        args[:3] = ["my_recipe.py", "--config", str(REPO_ROOT / TINY_CONFIG)]
    proc = run_recipe(["--nproc_per_node", "2", *args], cwd=cwd)
    output = output_of(proc)
    assert proc.returncode == 0, output[-4000:]
    assert "full_finetune_distributed: model" in output, output[-4000:]  # the config summary
    assert (out / INITIAL).is_file() and (out / TRAINED).is_file()


@pytest.mark.slow
def test_the_distributed_name_without_torchrun_trains_a_one_device_config_as_one_rank(
    tmp_path: Path,
) -> None:
    """[one recipe, two launches], rule 2: the name typed decides where torchrun does not."""
    out = tmp_path / "out"
    overrides = tiny_args(out, max_steps_per_epoch=1)[3:]
    args = ["exactga/full_finetune_distributed", "--config", "exactga/tiny/full_single_device"]
    proc = run_recipe([*args, *overrides])
    output = output_of(proc)
    assert proc.returncode == 0, output[-4000:]
    assert "full_finetune_distributed: model" in output, output[-4000:]
    assert "No torchrun environment (RANK is not set): training as one rank" in output
    assert (out / TRAINED).is_file()


@pytest.mark.slow
def test_a_single_device_only_recipe_by_path_under_torchrun_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    args = [
        "--nproc_per_node",
        "2",
        "recipes/ppo_full_finetune_single_device.py",
        "--config",
        "configs/tiny/ppo_single_device.yaml",
        f"output_dir={out}",
    ]
    proc = run_recipe(args)
    output = output_of(proc)
    assert proc.returncode == 1, output[-4000:]
    assert output.count("exactga: ") == 1 and "Traceback" not in output, output[-4000:]
    assert "trains on one device, but this launch starts 2 processes" in output
    assert "no distributed version" in output
    assert not out.exists(), sorted(p.name for p in out.iterdir())


@pytest.mark.slow
def test_the_stock_name_refusal_through_tune(tmp_path: Path) -> None:
    """Through tune run: the start-up hook installs the check in a process of its own (the
    in-process tests above run through it)."""
    config = "configs/qwen3/0.6B_lora_single_device.yaml"
    proc = run_recipe(["lora_finetune_single_device", "--config", config])
    output = output_of(proc)
    assert proc.returncode == 1, output[-4000:]
    assert output.count("exactga: ") == 1 and "Traceback" not in output, output[-4000:]
    assert f"tune run exactga/lora_finetune_single_device --config {config}" in output


@pytest.mark.slow
def test_a_recipe_by_absolute_path_runs_from_another_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = tiny_args(out, max_steps_per_epoch=1)
    args[:3] = [str(REPO_ROOT / RECIPE), "--config", str(REPO_ROOT / TINY_CONFIG)]
    proc = run_recipe(args, cwd=tmp_path)
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert (out / INITIAL).is_file() and (out / TRAINED).is_file()


def test_a_torchrun_option_after_the_recipe_is_refused_with_it_moved_before(monkeypatch) -> None:
    args = ["exactga/full_finetune_distributed", "--config", "x.yaml", "--nproc_per_node", "2"]
    status, printed = _tune_run(monkeypatch, *args)
    assert status == 1
    moved = "tune run --nproc_per_node 2 exactga/full_finetune_distributed --config x.yaml"
    assert moved in printed
    standalone = ["r.py", "--standalone", "--config", "x.yaml", "epochs=1"]
    status, printed = _tune_run(monkeypatch, *standalone)
    assert status == 1 and "tune run --standalone r.py --config x.yaml epochs=1" in printed


def test_several_nodes_without_a_rendezvous_endpoint_are_refused_before_any_rank_starts(
    monkeypatch,
) -> None:
    """tune run would start each node standalone, waiting for the others until its timeout."""
    static = ["--nnodes", "2", "--nproc_per_node", "1", "--node_rank", "0"]
    static += ["--master_addr", "127.0.0.1", "exactga/full_finetune_distributed"]
    status, printed = _tune_run(monkeypatch, *static, "--config", "x.yaml")
    assert status == 1 and printed.count("exactga: ") == 1
    assert "--nnodes 2 without --rdzv_endpoint" in printed and "Traceback" not in printed
    status, printed = _tune_run(monkeypatch, "--nnodes", "1:4", "r.py", "--config", "x.yaml")
    assert status == 1 and "--nnodes 1:4 without --rdzv_endpoint" in printed


@pytest.mark.parametrize(
    ("nnodes", "endpoint"), [("1", ""), ("1:1", ""), ("2", "node0:29500"), ("1:4", "n:1")]
)
def test_one_node_or_a_rendezvous_endpoint_is_not_refused(nnodes: str, endpoint: str) -> None:
    assert mixups.several_nodes_without_rendezvous(nnodes, endpoint) is None


def test_a_stock_name_with_another_recipes_exactga_config_says_whose_config_it_is() -> None:
    config = str(registry.config_path("tiny/lora_single_device"))
    listed = {"full_finetune_single_device": False}
    problem = mixups.tune_run_problem("full_finetune_single_device", config, False, listed)
    assert problem is not None
    assert "this config is written for exactga/lora_finetune_single_device" in problem


def _component_of(config_file: Path, section: str) -> object:
    """``<section>._component_`` of a config file (each file read once for the module)."""
    value = _loaded(config_file).get(section)
    return value.get("_component_") if isinstance(value, dict) else None


def _loss_of(config_file: Path) -> object:
    return _component_of(config_file, "loss")


def test_no_recipe_refuses_the_loss_of_its_own_or_its_stock_namesakes_configs() -> None:
    import torchtune._recipe_registry as torchtune_registry

    stock = {r.name: r for r in torchtune_registry.get_all_recipes()}
    for entry in registry.RECIPES:
        files = [registry.config_path(config) for config in entry.configs]
        if entry.name in stock:  # exactga's recipes run torchtune's configs unchanged
            files += [
                TORCHTUNE_RECIPES / "configs" / c.file_path for c in stock[entry.name].configs
            ]
        for path in files:
            assert mixups.recipe_family_problem(entry.name, _loss_of(path), []) is None, path


FINE_TUNING = ("full_finetune_distributed", "lora_finetune_single_device", "qat_distributed")
PREFERENCE = ("lora_dpo_single_device", "lora_dpo_distributed", "full_dpo_distributed")


@pytest.mark.parametrize(
    ("recipe", "configs_of"), [(r, p) for r in FINE_TUNING for p in PREFERENCE]
)
def test_a_fine_tuning_recipe_refuses_a_dpo_config_and_back(recipe: str, configs_of: str) -> None:
    for given, configs in [(recipe, configs_of), (configs_of, recipe)]:
        for config in registry.recipe_entry(configs).configs:
            loss = _loss_of(registry.config_path(config))
            problem = mixups.recipe_family_problem(given, loss, ["--config", "c.yaml"])
            assert problem is not None and "tune run exactga/" in problem, (given, config)


def _model_of(config_file: Path) -> object:
    return _component_of(config_file, "model")


def test_a_recipe_that_trains_every_weight_refuses_a_lora_model_and_only_that() -> None:
    import torchtune._recipe_registry as torchtune_registry

    stock = {r.name: r for r in torchtune_registry.get_all_recipes()}
    every_config = [registry.config_path(c) for e in registry.RECIPES for c in e.configs]
    lora = [p for p in every_config if "lora_" in str(_model_of(p)).rsplit(".", 1)[-1]]
    assert len(lora) > 20
    for recipe in ("full_finetune_single_device", "full_finetune_distributed", "qat_distributed"):
        own = [registry.config_path(c) for c in registry.recipe_entry(recipe).configs]
        own += [TORCHTUNE_RECIPES / "configs" / c.file_path for c in stock[recipe].configs]
        for path in own:
            assert mixups.lora_model_problem(recipe, _model_of(path), []) is None, path
        for path in lora:
            problem = mixups.lora_model_problem(recipe, _model_of(path), ["--config", "c.yaml"])
            assert problem is not None and "tune run exactga/" in problem, path


def test_the_launcher_tells_the_recipe_the_exactga_name_it_was_given(monkeypatch) -> None:
    """[one recipe, two launches], rule 2: tune run's wrap records an exactga name, and clears
    what an outer launch recorded when given a path."""
    import os

    from exactga.launch import cli

    monkeypatch.setenv(twins.LAUNCHED_AS_ENV, "an outer launch's")
    cli.record_launched_name("exactga/full_finetune_distributed")
    assert os.environ[twins.LAUNCHED_AS_ENV] == "full_finetune_distributed"
    cli.record_launched_name("recipes/full_finetune.py")
    assert twins.LAUNCHED_AS_ENV not in os.environ
