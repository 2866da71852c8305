"""Every bad input of a new user's first hour, through the real ``tune run`` (issue #14).

Each launch must exit non-zero with one short message naming the key, file or row, and no
traceback (see [user errors] in exactga.launch.cli). A configuration error (keys, values, flag
combinations, input files, checkpoints to read, something to resume) must also come before the
resolved config is printed and before any model is built: the tiny configs' checkpointer builds
the model to write ``base_model/`` on first use, so that folder must not appear. A bad dataset
row is found while the dataset is built or read, after the model; a damaged step checkpoint
when it is read (its check reads every byte), after the config is printed.

The unit tests of the same checks are in tests/test_bad_input.py (rows), tests/test_config.py
and tests/test_config_checks.py (keys, values, combinations, files) and
tests/test_checkpointing.py (checkpoints); the distributed recipe launched with torchrun on bad
input in tests/test_recipe_full_distributed_extra.py.

Most launches fail at start-up, so a fresh process would cost mostly the import of torch and
torchtune. The single-process cases therefore fork from the tests' launch server
(tests/launcher.py: each case still ``tune run`` on its command line, its status and its own
output kept), made by module fixtures: the config and row cases in one, the cases reading a copy
of the finished run in another (their setup needs it), the users' own dataset in a third (its
own ``PYTHONPATH``). Two cases are real ``tune run --nproc_per_node`` launches: what they test
is what exactga's wrap of torchrun prints. Another rank's error, printed once, takes 2 ranks (of
a recipe of a few lines); a config error without the launcher's traceback takes the agent alone,
so 1 rank (that 2 ranks failing on the same key print one message is tests/test_cli_torchrun.py's
test of the wrap). The other 2-rank cases fork their ranks too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
from recipe_utils import (
    INITIAL,
    LORA_RECIPE,
    LORA_TINY_CONFIG,
    REPO_ROOT,
    output_of,
    run_recipe,
    run_tune,
    tiny_args,
)

pytestmark = pytest.mark.slow

DATA = REPO_ROOT / "configs/tiny/data.json"
FULL_DISTRIBUTED = ("recipes/full_finetune.py", "configs/tiny/full_distributed.yaml")
LORA_DISTRIBUTED = ("recipes/lora_finetune.py", "configs/tiny/lora_distributed.yaml")
PARITY = ("recipes/ga_parity.py", "configs/tiny/ga_parity_full.yaml")
MAX_MESSAGE_LINES = 6
# What a launch prints once the config is validated and once a model is built.
# The config as printed: torchtune's dump (config.log_config), or exactga's summary
# (exactga.run.metric_logging.log_config_summary), whichever the recipe calls.
CONFIG_PRINTED = re.compile(r"with resolved config|\(the full resolved config: ")
MODEL_BUILT = "Model is initialized"


def with_recipe(recipe_and_config: tuple[str, str], args: list[str]) -> list[str]:
    """``tiny_args``'s overrides for another recipe and config."""
    recipe, config = recipe_and_config
    return [recipe, "--config", config, *args[3:]]


def message_of(output: str) -> str:
    """The user-error message: from its ``exactga:`` line to the line saying how to show the
    traceback; fails if there is none."""
    match = re.search(r"^exactga: .*?^\(the traceback is hidden[^\n]*$", output, re.M | re.S)
    assert match, f"no exactga message in:\n{output[-4000:]}"
    return match.group(0)


def assert_fails_naming(proc, out_dir: Path, names: list[str], before_config: bool = True) -> str:
    """Non-zero exit, no traceback, one message of at most a few lines naming every item of
    ``names`` (plain text); with ``before_config``, before the config is printed and before any
    model is built. Returns the message."""
    output = output_of(proc)
    assert proc.returncode != 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    message = message_of(output)
    assert len(message.splitlines()) <= MAX_MESSAGE_LINES, message
    assert output.count("exactga: ") == 1, output[-4000:]  # rank 0 alone, once
    for name in names:
        assert name in message, f"{name!r} not in:\n{message}"
    if before_config:
        assert not CONFIG_PRINTED.search(output), output[-4000:]
        assert MODEL_BUILT not in output, output[-4000:]
        assert not (out_dir / INITIAL).exists(), "the initial checkpoint was written"
    return message


class Launched(NamedTuple):
    """One case: its result as ``run_recipe`` gives it and its folder (a test's ``tmp_path``)."""

    proc: subprocess.CompletedProcess
    folder: Path


def launch_together(
    root: Path, args_of: dict[str, list[str]], extra_env: dict[str, str] | None = None
) -> dict[str, Launched]:
    """``tune run *args`` of every case, single-process, one after another (tests/launcher.py);
    case ``name``'s folder is ``root / name``."""
    launched = {}
    for name, args in args_of.items():
        assert args[0] != "--nproc_per_node", args
        (root / name).mkdir(parents=True, exist_ok=True)
        launched[name] = Launched(run_recipe(args, extra_env=extra_env), root / name)
    return launched


# --- configuration: keys, values, combinations, files -----------------------------------------

# (id, recipe and config or None for the full single-device one, overrides, names)
CONFIG_CASES = [
    (
        "unknown_key_lora",
        (LORA_RECIPE, LORA_TINY_CONFIG),
        {"epoch": 2},
        ["unknown config key 'epoch'", "Did you mean 'epochs'?"],
    ),
    (
        "unknown_key_in_section",
        None,
        {"profiler__wait_stepz": 1},
        ["unknown config key 'profiler.wait_stepz'", "Did you mean 'wait_steps'?"],
    ),
    (
        "bad_choice_distributed_without_torchrun",
        FULL_DISTRIBUTED,
        {"loss_normalization": "bogus"},
        ["config key 'loss_normalization'='bogus'", "exact, post_scale, naive"],
    ),
    ("count_below_one", None, {"batch_size": 0}, ["config key 'batch_size'", "at least 1"]),
    ("wrong_type", None, {"epochs": "many"}, ["config key 'epochs'", "'many'"]),
    (
        "keep_last_n_checkpoints",
        None,
        {"keep_last_n_checkpoints": 1},
        ["config key 'keep_last_n_checkpoints'", "at least 2"],
    ),
    (
        "optimizer_in_bwd_with_accumulation",
        None,
        {"optimizer_in_bwd": True, "clip_grad_norm": "null", "gradient_accumulation_steps": 2},
        ["config keys 'optimizer_in_bwd' and 'gradient_accumulation_steps'"],
    ),
    (
        "token_budget_without_micro_batch_tokens",
        LORA_DISTRIBUTED,
        {"micro_batching": "token_budget"},
        ["config key 'micro_batch_tokens' is needed", "token_budget"],
    ),
    (
        "by_length_with_post_scale",
        None,
        {"micro_batching": "by_length", "loss_normalization": "post_scale"},
        ["config keys 'micro_batching' and 'loss_normalization'", "micro_batching=fixed"],
    ),
    (
        "missing_data_file",
        None,
        {"dataset__data_files": "nope/data.json"},
        [
            "config key 'dataset.data_files': no file at 'nope/data.json'",
            f"relative to the working directory {REPO_ROOT}",
        ],
    ),
    (
        "missing_tokenizer",
        None,
        {"tokenizer__path": "nope/tokenizer.model"},
        [
            "config key 'tokenizer.path': no file at 'nope/tokenizer.model'",
            f"relative to the working directory {REPO_ROOT}",
        ],
    ),
    (
        "parity_split_of_another_global_batch",
        PARITY,
        {"parity__splits": "[1x8,2x3]"},
        ["config key 'parity.splits'"],
    ),
    # A misspelt key inside a component section (issue #62: exactga.config.components).
    (
        "component_key_misspelt",
        None,
        {"optimizer__lrr": 0.001},
        ["config key 'optimizer.lrr': not an argument of", "Did you mean 'optimizer.lr'?"],
    ),
    (
        "dataset_key_misspelt",
        None,
        {"dataset__data_file": "data.json"},
        ["config key 'dataset.data_file'", "Did you mean 'dataset.data_files'?"],
    ),
    (
        "required_section_nulled_on_the_command_line",
        None,
        {"optimizer": "null"},
        ["config key 'optimizer._component_' is null", "optimizer._component_=<path>"],
    ),
    (
        "resume_with_an_empty_output_folder",
        None,
        {"resume_from_checkpoint": True},
        ["resume_from_checkpoint=True", "nothing to resume", "step_checkpoints"],
    ),
]


# The command line itself (see [command line] in exactga.launch.cli): (id, arguments after the
# tiny args, names); torchtune's parser would fail on each with a traceback.
COMMAND_LINE_CASES = [
    (
        "override_split_by_the_shell",
        ["epochs", "3"],
        ["command-line override 'epochs' is not key=value; write it as epochs=3"],
    ),
    (
        "override_value_does_not_parse",
        ["optimizer.lr=[1,"],
        ["command-line override 'optimizer.lr=[1,': its value '[1,' does not parse"],
    ),
]


def config_case_args(tmp_path: Path, recipe: tuple[str, str] | None, overrides: dict) -> list[str]:
    out = tmp_path / "out"
    args = tiny_args(out, **overrides)
    if recipe is not None:
        args = with_recipe(recipe, args)
    return args


@pytest.mark.xdist_group("bad_input_shared")
@pytest.mark.parametrize(
    ("case", "names"),
    [(case[0], case[2]) for case in COMMAND_LINE_CASES],
    ids=[case[0] for case in COMMAND_LINE_CASES],
)
def test_a_bad_command_line_is_one_message_before_the_config_is_printed(shared_launch, case, names):
    proc, tmp_path = shared_launch[case]
    assert_fails_naming(proc, tmp_path / "out", names)


@pytest.mark.xdist_group("bad_input_shared")
@pytest.mark.parametrize(
    ("case", "names"),
    [(case[0], case[3]) for case in CONFIG_CASES],
    ids=[case[0] for case in CONFIG_CASES],
)
def test_config_error_is_one_message_before_the_config_is_printed(shared_launch, case, names):
    proc, tmp_path = shared_launch[case]
    assert_fails_naming(proc, tmp_path / "out", names)
    if "key_misspelt" in case:  # issue #62: nothing written, not even the resolved config
        assert_nothing_written(tmp_path / "out")


# A recipe whose rank 1 fails at once on its own input while rank 0 is still starting: the
# launcher then stops rank 0 before rank 0 could print anything (a race that once lost the
# message behind rank 0's "stopped at once" line).
RANK_1_FAILS_FIRST = """
import os, sys, time
from exactga.launch.cli import run_recipe

def recipe_main():
    if os.environ["RANK"] == "1":
        raise ValueError("data file 'shard_1.json', row 7: no 'output' field; add one.")
    time.sleep(120)

sys.exit(run_recipe(recipe_main))
"""


def test_under_torchrun_another_ranks_error_is_printed_once_by_the_launcher(tmp_path):
    recipe, config = tmp_path / "my_recipe.py", tmp_path / "my_config.yaml"
    recipe.write_text(RANK_1_FAILS_FIRST)
    config.write_text("{}\n")  # tune run asks for one; this recipe reads none
    proc = run_tune(["--nproc_per_node", "2", recipe.name, "--config", config.name], cwd=tmp_path)
    output = output_of(proc)
    assert proc.returncode == 1, output[-4000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]
    assert output.count("exactga: ") == 1, output[-4000:]  # no stop line from rank 0
    assert "row 7: no 'output' field" in message_of(output)


def test_under_torchrun_a_config_error_is_one_message_without_the_launchers_traceback(tmp_path):
    """The rank fails on the key; the launcher prints its message, rank 0 does not print it
    too, and the launcher's ChildFailedError is not printed. One rank: what is tested is
    torchrun's agent and exactga's wrap of it (every rank of two failing on the key: one
    message, in tests/test_cli_torchrun.py)."""
    out = tmp_path / "out"
    args = ["--nproc_per_node", "1", *with_recipe(FULL_DISTRIBUTED, tiny_args(out, epoch=2))]
    proc = run_tune(args)
    assert_fails_naming(proc, out, ["unknown config key 'epoch'", "Did you mean 'epochs'?"])
    assert proc.returncode == 1
    assert "ChildFailedError" not in output_of(proc)


def test_on_two_ranks_a_bad_override_is_one_message(tmp_path):
    """Every rank refuses the override before torchtune's parser sees it; rank 0 says so.
    (What exactga's wrap of torchrun prints for a rank's error is the two tests above.)"""
    out = tmp_path / "out"
    args = [*with_recipe(FULL_DISTRIBUTED, tiny_args(out)), "optimizer.lr=[1,"]
    proc = run_recipe(["--nproc_per_node", "2", *args])
    assert_fails_naming(proc, out, ["command-line override 'optimizer.lr=[1,'"])
    assert proc.returncode == 1


def test_on_two_ranks_a_bad_data_file_is_one_message(tmp_path):
    """Every rank fails on the file as it builds its dataset, after the model: one message."""
    (_, text, names), *_ = DATA_FILE_CASES  # not valid JSON: datasets' traceback before #43
    data = tmp_path / "train.json"
    data.write_text(text)
    out = tmp_path / "out"
    args = tiny_args(out, dataset__data_files=data, max_steps_per_epoch=2)
    proc = run_recipe(["--nproc_per_node", "2", *with_recipe(FULL_DISTRIBUTED, args)])
    message = assert_fails_naming(proc, out, names, before_config=False)
    assert str(data) in message
    assert proc.returncode == 1


def test_a_config_file_that_does_not_exist_is_one_message(tmp_path):
    out = tmp_path / "out"
    args = ["recipes/full_finetune.py", "--config", "configs/tiny/nope.yaml"]
    names = ["--config configs/tiny/nope.yaml: no such file", str(REPO_ROOT), "'tune ls'"]
    assert_fails_naming(run_recipe([*args, f"output_dir={out}"]), out, names)


# --- checkpoints: a finished run, damaged step checkpoints, missing weights --------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """One step of the tiny run, with its step checkpoint (the one successful launch here)."""
    out = tmp_path_factory.mktemp("finished") / "out"
    proc = run_recipe(tiny_args(out, max_steps_per_epoch=1, save_every_n_steps=1))
    assert proc.returncode == 0, output_of(proc)[-4000:]
    assert (out / "step_checkpoints" / "step_000001").is_dir()
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(run, out)
    return out


# The setup of each case on the finished run (in its ``tmp_path``): its ``tune run`` args, the
# folder that must not get an initial checkpoint, and the names its message must hold. The
# cases then share one launch (``finished_run_cases``).


def resume_after_a_run_finished(finished_run: Path, tmp_path: Path):
    out = copy_of(finished_run, tmp_path)
    shutil.rmtree(out / "step_checkpoints")
    args = tiny_args(out, max_steps_per_epoch=1, resume_from_checkpoint=True)
    names = [
        f"resume_from_checkpoint=True, but the run in {out} has finished",
        f"checkpointer.checkpoint_dir={out / 'epoch_0'}",
    ]
    # No model built: the copy's base_model/ is the finished run's, so no folder to watch.
    return args, tmp_path / "no_new_output", names


@pytest.mark.xdist_group("bad_input_finished_run")
def test_resume_after_a_run_finished_without_step_checkpoints(finished_run_cases):
    proc, out, names = finished_run_cases["resume_after_finish"]
    assert_fails_naming(proc, out, names)


def resume_from_a_truncated_step_checkpoint(finished_run: Path, tmp_path: Path):
    out = copy_of(finished_run, tmp_path)
    weights = out / "step_checkpoints" / "step_000001" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    args = tiny_args(out, max_steps_per_epoch=1, resume_from_checkpoint=True)
    names = [f"no usable step checkpoint in {out / 'step_checkpoints'}", str(weights), "truncated"]
    return args, out, names


@pytest.mark.xdist_group("bad_input_finished_run")
def test_resume_from_a_truncated_step_checkpoint_names_the_file(finished_run_cases):
    proc, out, names = finished_run_cases["truncated_step_checkpoint"]
    # The check reads every byte of the checkpoint, so it runs once, where the run reads it.
    assert_fails_naming(proc, out, names, before_config=False)


STOCK_CHECKPOINTER = {
    "checkpointer___component_": "torchtune.training.FullModelHFCheckpointer",
}
WITHOUT_INITIALIZER = ["~checkpointer.model", "~checkpointer.init_seed"]


CHECKPOINT_DIR_PROBLEMS = [
    "missing_files",
    "missing_folder",
    "no_config_json",
    "output_inside",
    "truncated",
    "cut_bin",
]


def checkpoint_dir_without_the_named_files(finished_run: Path, tmp_path: Path, problem: str):
    """torchtune's own checkpointer, pointed at a folder that lacks what it names."""
    checkpoint_dir = finished_run / "base_model"  # holds config.json and model.safetensors
    files = "[model-00001-of-00002.safetensors,model-00002-of-00002.safetensors]"
    out = tmp_path / "out"
    names = [
        "config key 'checkpointer.checkpoint_files': no file "
        f"'model-00001-of-00002.safetensors' (nor 1 more) in checkpointer.checkpoint_dir "
        f"'{checkpoint_dir}'",
        "it holds config.json, model.safetensors",
    ]
    if problem == "missing_folder":
        checkpoint_dir, files = tmp_path / "nowhere", "[model.safetensors]"
        names = [f"config key 'checkpointer.checkpoint_dir': no folder at '{checkpoint_dir}'"]
    elif problem == "no_config_json":
        checkpoint_dir, files = tmp_path / "weights_only", "[model.safetensors]"
        checkpoint_dir.mkdir()
        shutil.copy(finished_run / INITIAL, checkpoint_dir)
        names = [f"config key 'checkpointer.checkpoint_dir': no config.json in '{checkpoint_dir}'"]
    elif problem == "truncated":
        checkpoint_dir, files = (
            shutil.copytree(checkpoint_dir, tmp_path / "model"),
            "[model.safetensors]",
        )
        weights = checkpoint_dir / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        names = [f"config key 'checkpointer.checkpoint_files': {weights} has", "(truncated?)"]
    elif problem == "cut_bin":  # torch.save's zip format, as pytorch_model.bin files are
        import torch
        from safetensors.torch import load_file

        checkpoint_dir = shutil.copytree(checkpoint_dir, tmp_path / "model")
        weights, files = checkpoint_dir / "pytorch_model.bin", "[pytorch_model.bin]"
        torch.save(load_file(checkpoint_dir / "model.safetensors"), weights)
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        names = [f"config key 'checkpointer.checkpoint_files': {weights} (", "(truncated?)"]
    elif problem == "output_inside":
        checkpoint_dir, files = shutil.copytree(checkpoint_dir, tmp_path / "model"), "[x]"
        out = checkpoint_dir / "out"
        names = ["config keys 'checkpointer.output_dir'", "'checkpointer.checkpoint_dir'"]
    overrides = {
        **STOCK_CHECKPOINTER,
        "checkpointer__checkpoint_dir": checkpoint_dir,
        "checkpointer__checkpoint_files": files,
    }
    return [*tiny_args(out, **overrides), *WITHOUT_INITIALIZER], out, names


@pytest.mark.xdist_group("bad_input_finished_run")
@pytest.mark.parametrize("problem", CHECKPOINT_DIR_PROBLEMS)
def test_checkpoint_dir_without_the_named_files(finished_run_cases, problem):
    """torchtune's own checkpointer, pointed at a folder that lacks what it names."""
    proc, out, names = finished_run_cases[f"checkpoint_dir_{problem}"]
    assert_fails_naming(proc, out, names)


def truncated_initial_weights(finished_run: Path, tmp_path: Path):
    out = copy_of(finished_run, tmp_path)
    weights = out / INITIAL
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    names = [
        f"config key 'checkpointer.checkpoint_files': {weights} has",
        "(truncated?)",
        f"Delete '{weights.parent}' to have the initial weights written again",
    ]
    return tiny_args(out, max_steps_per_epoch=1), out, names


@pytest.mark.xdist_group("bad_input_finished_run")
def test_truncated_initial_weights_of_the_tiny_configs_checkpointer(finished_run_cases):
    """exactga's initialized_hf_checkpointer reads back the weights it wrote on first use."""
    proc, _, names = finished_run_cases["truncated_initial"]
    output = output_of(proc)
    assert proc.returncode != 0 and "Traceback" not in output, output[-4000:]
    message = message_of(output)
    for name in names:
        assert name in message, message
    assert not CONFIG_PRINTED.search(output)


class FinishedRunCase(NamedTuple):
    proc: subprocess.CompletedProcess
    out: Path  # the folder that must not get an initial checkpoint
    names: list[str]


@pytest.fixture(scope="module")
def finished_run_cases(finished_run, tmp_path_factory) -> dict[str, FinishedRunCase]:
    """Every case set up on a copy of ``finished_run``, then launched together."""
    root = tmp_path_factory.mktemp("finished_run_cases")
    setups = {
        "resume_after_finish": resume_after_a_run_finished,
        "truncated_step_checkpoint": resume_from_a_truncated_step_checkpoint,
        "truncated_initial": truncated_initial_weights,
    }
    prepared = {}
    for name, setup in setups.items():
        (root / name).mkdir()
        prepared[name] = setup(finished_run, root / name)
    for problem in CHECKPOINT_DIR_PROBLEMS:
        name = f"checkpoint_dir_{problem}"
        (root / name).mkdir()
        prepared[name] = checkpoint_dir_without_the_named_files(finished_run, root / name, problem)
    launched = launch_together(root, {name: args for name, (args, _, _) in prepared.items()})
    return {
        name: FinishedRunCase(launched[name].proc, out, names)
        for name, (_, out, names) in prepared.items()
    }


# --- dataset rows ----------------------------------------------------------------------------

GOOD = {"instruction": "Say hi.", "input": "", "output": "Hi there."}


def alpaca_rows(bad_row: dict, index: int = 5) -> list[dict]:
    rows = json.loads(DATA.read_text())[:16]
    rows[index] = bad_row
    return rows


def chat_rows(last: dict) -> list[dict]:
    human = {"from": "human", "value": "Say hi."}
    good = {"conversations": [human, {"from": "gpt", "value": "Hi there."}]}
    return [good] * 6 + [last] + [good] * 9


CHAT = {
    "dataset___component_": "torchtune.datasets.chat_dataset",
    "dataset.conversation_column": "conversations",
    "dataset.conversation_style": "sharegpt",
}

# (id, rows, overrides, names): each file has 16 rows; the bad one is row 5 or 6 (0-based).
ROW_CASES = [
    (
        "row_missing_a_column",
        alpaca_rows({"instruction": "Say hi.", "input": ""}),
        {},
        ["dataset row 5 (0-based) of dataset (json: ", "missing column 'output' (absent or null)"],
    ),
    (
        "column_missing_from_every_row",
        [{"instruction": "Say hi.", "answer": "Hi."}] * 16,
        {},
        ["missing column 'output' in every row; its columns are instruction, answer"],
    ),
    (
        "renamed_column",
        [GOOD] * 16,
        {"dataset.column_map.output": "answer"},
        ["missing column 'answer' (column_map 'output')"],
    ),
    (
        "column_of_the_wrong_type",
        alpaca_rows({**GOOD, "instruction": 7}),
        {},
        ["dataset row 5 (0-based) of dataset", "column 'instruction' must be a string, got int 7"],
    ),
    (
        "chat_turn_without_a_role",
        chat_rows({"conversations": [{"from": "human", "value": "Hi"}, {"value": "Hi."}]}),
        {**CHAT, "shuffle": False},
        ["dataset row 6 (0-based) of dataset (json: ", "missing column or key 'from' (KeyError)"],
    ),
    (
        "chat_row_without_its_conversation",
        chat_rows({"dialog": "Hi."}),
        CHAT,
        ["dataset row 6 (0-based) of dataset", "missing column 'conversations'"],
    ),
    (
        "token_ids_beyond_the_vocabulary",
        json.loads(DATA.read_text())[:16],
        {"model__vocab_size": 1000},
        ["(its largest) is beyond the model's vocabulary (vocab_size 1000)", "'model.vocab_size'"],
    ),
]


def row_case_args(tmp_path: Path, rows: list[dict], overrides: dict) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(rows))
    out = tmp_path / "out"
    plain = {k: v for k, v in overrides.items() if "." not in k}
    added = [f"{k}={v}" for k, v in overrides.items() if "." in k]
    return tiny_args(out, dataset__data_files=data, max_steps_per_epoch=2, **plain) + added


# A data file datasets cannot read or that holds no rows (see [data file faults] in
# exactga.data.files): (id, the file's text, names). Found at start-up, before anything is
# written ([data files at start-up]); a ``csv`` id is a CSV file.
DATA_FILE_CASES = [
    (
        "data_file_not_valid_json",
        '[{"instruction": "Say hi.", "input": "", "output": "Hi."}\n {"instruction": "Hi."}]\n',
        ["config key 'dataset.data_files': ", "is not valid JSON (line 2, column 2: Expecting"],
    ),
    ("data_file_empty", "", ["config key 'dataset.data_files': ", "is empty (0 bytes)"]),
    (
        "data_file_csv_with_a_broken_row",
        'instruction,input,output\nSay hi.,,Hi.\n"Say hi.,,Hi.\nSay hi.,,Hi.\n',
        ["config key 'dataset.data_files': ", "is not valid CSV (the row on line 3: "],
    ),
]


def data_file_name(case: str) -> str:
    return "train.csv" if "csv" in case else "train.json"


def data_file_case_args(tmp_path: Path, case: str, text: str) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / data_file_name(case)
    data.write_text(text)
    return tiny_args(
        tmp_path / "out",
        dataset__data_files=data,
        dataset__source="csv" if "csv" in case else "json",
        max_steps_per_epoch=2,
    )


@pytest.mark.xdist_group("bad_input_shared")
@pytest.mark.parametrize(
    ("case", "names"),
    [(case[0], case[2]) for case in DATA_FILE_CASES],
    ids=[case[0] for case in DATA_FILE_CASES],
)
def test_a_bad_data_file_is_one_message_naming_it(shared_launch, case, names):
    proc, tmp_path = shared_launch[case]
    message = assert_fails_naming(proc, tmp_path / "out", names)
    assert str(tmp_path / data_file_name(case)) in message
    assert_nothing_written(tmp_path / "out")


def assert_nothing_written(out_dir: Path) -> None:
    """Issue #62: a start-up check fails before the output folder gets its first file."""
    written = sorted(out_dir.rglob("*")) if out_dir.exists() else []
    assert not written, f"written before the check failed: {written}"


@pytest.mark.xdist_group("bad_input_shared")
@pytest.mark.parametrize(
    ("case", "names"),
    [(case[0], case[3]) for case in ROW_CASES],
    ids=[case[0] for case in ROW_CASES],
)
def test_bad_row_is_one_message_naming_row_and_file(shared_launch, case, names):
    proc, tmp_path = shared_launch[case]
    data, out = tmp_path / "rows.json", tmp_path / "out"
    message = assert_fails_naming(proc, out, names, before_config=False)
    if "row" in names[0]:
        assert str(data) in message


@pytest.fixture(scope="module")
def shared_launch(tmp_path_factory) -> dict[str, Launched]:
    """Every configuration, command-line, row and data-file case, by its id, launched
    together."""
    root = tmp_path_factory.mktemp("bad_input_shared")
    args_of = {name: config_case_args(root / name, *case) for name, *case, _ in CONFIG_CASES}
    args_of |= {name: row_case_args(root / name, *case) for name, *case, _ in ROW_CASES}
    args_of |= {
        name: [*config_case_args(root / name, None, {}), *extra]
        for name, extra, _ in COMMAND_LINE_CASES
    }
    args_of |= {
        name: data_file_case_args(root / name, name, text) for name, text, _ in DATA_FILE_CASES
    }
    launched = launch_together(root, args_of)
    # The row cases fail after the config is printed and the model built, so a run in a shared
    # launch prints both as one of its own would: the config cases' checks that neither is in
    # their output are not empty.
    for name, *_ in ROW_CASES:
        output = output_of(launched[name].proc)
        assert CONFIG_PRINTED.search(output) and MODEL_BUILT in output, output[-4000:]
    return launched


# A dataset of the user's own that gives bad samples: only the sample checks apply.
OWN_DATASET = """
from torch.utils.data import Dataset

SAMPLES = {
    "no_labels": {"tokens": [1, 2]},
    "length_mismatch": {"tokens": [1, 2, 3], "labels": [2, 3]},
    "negative_id": {"tokens": [1, -1], "labels": [1, -100]},
}


class Samples(Dataset):
    def __init__(self, problem):
        self.problem = problem

    def __len__(self):
        return 16

    def __getitem__(self, index):
        good = {"tokens": [1, 5, 6, 2], "labels": [-100, 5, 6, 2]}
        return SAMPLES[self.problem] if index == 3 else good


def samples(tokenizer, problem, **kwargs):
    return Samples(problem)
"""


OWN_SAMPLE_PROBLEMS = [
    ("no_labels", "a sample must hold 'tokens' and 'labels', got tokens."),
    ("length_mismatch", "3 tokens but 2 labels"),
    ("negative_id", "token id -1 is negative"),
]


@pytest.fixture(scope="module")
def own_dataset_launch(tmp_path_factory) -> dict[str, Launched]:
    """Each problem's run, launched together with ``own_dataset.py`` on ``PYTHONPATH`` (the
    same module for all three; the other cases' launch keeps the plain path)."""
    root = tmp_path_factory.mktemp("own_dataset")
    (root / "own_dataset.py").write_text(OWN_DATASET)
    args_of = {}
    for problem, _ in OWN_SAMPLE_PROBLEMS:
        out = root / problem / "out"
        args = tiny_args(
            out,
            dataset___component_="own_dataset.samples",
            shuffle=False,
            batch_size=4,
            max_steps_per_epoch=2,
        )
        args_of[problem] = [*args, f"dataset.problem={problem}"]
    # Before the launching environment's own entries, as a user's PYTHONPATH would put it.
    python_path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return launch_together(root, args_of, extra_env={"PYTHONPATH": python_path})


@pytest.mark.xdist_group("bad_input_own_dataset")
@pytest.mark.parametrize(("problem", "expected"), OWN_SAMPLE_PROBLEMS)
def test_bad_sample_of_a_users_own_dataset(own_dataset_launch, problem, expected):
    proc, tmp_path = own_dataset_launch[problem]
    out = tmp_path / "out"
    assert_fails_naming(
        proc, out, ["dataset row 3 (0-based) of dataset", expected], before_config=False
    )
