"""The command line after the recipe (see [command line] in exactga.launch.cli): an argument
torchtune's parser would fail on with a traceback, or a config file that is not YAML, is one
message naming it; what it accepts passes. Through ``tune run`` (one device and torchrun):
tests/test_bad_input_launch.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_utils import REPO_ROOT

from exactga.launch import cli

RECIPE = "recipes/full_finetune.py"
CONFIG = str(REPO_ROOT / "configs/tiny/full_single_device.yaml")


def problem_of(*args: str, config: str = CONFIG) -> str | None:
    return cli._command_line_problem([RECIPE, "--config", config, *args])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["epochs", "3"],
            "command-line override 'epochs' is not key=value; write it as epochs=3 (no spaces "
            "around '=').",
        ),
        (["foo"], "command-line override 'foo' is not key=value; write it as foo=<value>"),
        (["=3"], "command-line override '=3' has no key before '='; write key=value"),
        (["epochs=3", "a=b=c"], "command-line override 'a=b=c' holds more than one '='"),
        (
            ["--epochs=3"],
            "command-line argument '--epochs=3': after the recipe, tune run takes only --config "
            "<file> and key=value overrides; write it as epochs=3.",
        ),
        (
            ["optimizer.lr=[1,"],
            "command-line override 'optimizer.lr=[1,': its value '[1,' does not parse (did not "
            "find expected node content); fix it (a list is [a,b]), or set it in the config file.",
        ),
        (["optimizer.lr=${oops"], "command-line override 'optimizer.lr=${oops': its value"),
        (["lr='abc"], "command-line override 'lr='abc': its value \"'abc\" does not parse"),
        (["~nokey"], "command-line override '~nokey': the config has no key 'nokey' to remove."),
        (["~profiler"], "command-line override '~profiler': torchtune cannot remove a component"),
    ],
    ids=[
        "split_by_the_shell",
        "bare_word",
        "no_key",
        "two_equals",
        "flag",
        "unclosed_list",
        "unclosed_interpolation",
        "unclosed_quote",
        "remove_missing_key",
        "remove_component",
    ],
)
def test_a_bad_override_is_named(args, message):
    problem = problem_of(*args)
    assert problem is not None and problem.startswith(message), problem
    assert "\n" not in problem


def test_what_torchtunes_parser_accepts_passes():
    accepted = [
        "epochs=3",
        "optimizer.lr=1e-4",
        "optimizer=torch.optim.SGD",  # a component by its section's name
        "lr_scheduler=null",
        "tokenizer.path=None",
        "checkpointer.checkpoint_files=[a.safetensors,b.safetensors]",
        "~profiler.enabled",  # a plain key may be removed
        "dataset.column_map.output=answer",
    ]
    assert problem_of(*accepted) is None
    assert cli._command_line_problem([RECIPE, f"--config={CONFIG}", "epochs=2"]) is None
    assert cli._command_line_problem([RECIPE]) is None  # argparse names the missing --config


def test_a_config_file_that_is_not_yaml_is_named(tmp_path: Path):
    config = tmp_path / "my.yaml"
    config.write_text("epochs: 1\n batch_size: 2\n")
    assert problem_of(config=str(config)) == (
        f"--config {config}: not valid YAML (line 2, column 12: mapping values are not allowed "
        "in this context); fix the file."
    )
    config.write_text("- epochs\n")
    assert problem_of(config=str(config)).startswith(f"--config {config}: holds a list")


def test_run_recipe_prints_the_message_and_never_calls_the_recipe(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", [RECIPE, "--config", CONFIG, "epochs", "3"])
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)

    def recipe_main() -> None:
        raise AssertionError("the recipe ran")

    assert cli.run_recipe(recipe_main) == 1
    err = capsys.readouterr().err
    assert "exactga: command-line override 'epochs' is not key=value" in err
    assert "Traceback" not in err
