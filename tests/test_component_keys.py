"""Start-up checks before anything is written (issue #62): a misspelt key inside a component
section, a component that does not import, a builder's missing argument and a broken data file
each fail as one message naming the key or the file, before the output folder gets its first
file (exactga.config.components, [data files at start-up] in exactga.data.files). In process,
through the recipes' own start-up call; the launch: tests/test_bad_input_launch.py."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pyarrow
import pyarrow.parquet
import pytest
from omegaconf import OmegaConf
from torchtune.config._utils import _merge_yaml_and_cli_args
from unit_utils import CONFIGS, tiny_config

from exactga.config.schemas import FullFinetuneSingleDeviceConfig
from exactga.config.validation import validate_config
from exactga.dpo.schema import LoraDpoSingleDeviceConfig
from exactga.grpo.schema import GrpoDistributedConfig
from exactga.wiring.run_start import validated_config

ALPACA_ROW = '{"instruction": "Say hi.", "input": "", "output": "Hi there."}'


def start(tmp_path: Path, overrides: list[str], name: str = "full_single_device") -> Path:
    """The recipes' start-up call on a tiny config with ``overrides`` (command-line style);
    returns the output folder."""
    output_dir = tmp_path / "out"
    cfg = OmegaConf.merge(
        tiny_config(name, output_dir=str(output_dir)), OmegaConf.from_dotlist(overrides)
    )
    schema = {
        "full_single_device": FullFinetuneSingleDeviceConfig,
        "lora_dpo_single_device": LoraDpoSingleDeviceConfig,
    }[name]
    validated_config(cfg, schema, name)
    return output_dir


def refused(tmp_path: Path, overrides: list[str], name: str = "full_single_device") -> str:
    """The one message a start-up with ``overrides`` fails with; nothing was written."""
    with pytest.raises(ValueError) as err:
        start(tmp_path, overrides, name)
    output_dir = tmp_path / "out"
    written = sorted(output_dir.rglob("*")) if output_dir.exists() else []
    assert not written, f"written before the check: {written}"
    message = str(err.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def test_a_good_config_starts_and_writes_its_resolved_config(tmp_path):
    """The reference for the tests below: a start-up that passes writes the output folder."""
    output_dir = start(tmp_path, [])
    assert (output_dir / "resolved_config.yaml").is_file()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "optimizer.lrr=0.001",
            "config key 'optimizer.lrr': not an argument of torch.optim.AdamW. "
            "Did you mean 'optimizer.lr'?",
        ),
        ("model.num_layer=2", "config key 'model.num_layer'.*Did you mean 'model.num_layers'"),
        (
            "dataset.data_file=data.json",
            "config key 'dataset.data_file'.*alpaca_dataset.*Did you mean 'dataset.data_files'",
        ),
        ("tokenizer.paht=tok.model", "config key 'tokenizer.paht'.*'tokenizer.path'"),
        (
            "loss.num_output_chunk=8",
            "config key 'loss.num_output_chunk'.*'loss.num_output_chunks'",
        ),
        (
            "lr_scheduler.num_warmup_step=3",
            "config key 'lr_scheduler.num_warmup_step'.*'lr_scheduler.num_warmup_steps'",
        ),
        # torchtune's loggers take **kwargs and drop them: a misspelt key would vanish.
        (
            "metric_logger.log_dirr=logs",
            "config key 'metric_logger.log_dirr'.*'metric_logger.log_dir'",
        ),
        # exactga's checkpointer passes its **kwargs on to FullModelHFCheckpointer's.
        ("checkpointer.model_typ=LLAMA3", "'checkpointer.model_typ'.*'checkpointer.model_type'"),
        # dataset keys that reach datasets.load_dataset: its own and the json builder's.
        ("dataset.fild=rows", "config key 'dataset.fild'.*Did you mean 'dataset.field'"),
        (
            "optimizer._component_=torch.optim.AdamWW",
            "config key 'optimizer._component_': torch.optim has no 'AdamWW'. "
            "Did you mean 'torch.optim.AdamW'",
        ),
        (
            "optimizer._component_=torch.optimm.AdamW",
            "torch has no 'optimm'. Did you mean 'torch.optim'",
        ),
    ],
)
def test_a_misspelt_component_key_is_named_before_anything_is_written(tmp_path, override, expected):
    assert_matches(refused(tmp_path, [override]), expected)


def test_a_component_of_a_package_not_installed_is_left_to_instantiation():
    """torchtune's QLoRA configs name bitsandbytes' optimizers, an optional package: whether
    it is installed is instantiation's to say, not a misspelt path."""
    cfg = tiny_config("full_single_device")
    cfg.optimizer = {"_component_": "not_installed_package.optim.PagedAdamW", "lr": 1e-3}
    validate_config(cfg, FullFinetuneSingleDeviceConfig, "full_single_device")


def test_a_dpo_loss_typo_is_named(tmp_path):
    message = refused(tmp_path, ["loss.betaa=0.1"], name="lora_dpo_single_device")
    assert_matches(message, "config key 'loss.betaa'.*DPOLoss.*Did you mean 'loss.beta'")


def test_keys_that_reach_load_dataset_are_accepted(tmp_path):
    start(tmp_path, ["dataset.name=null", "dataset.keep_in_memory=true"])


def test_a_missing_argument_of_a_builder_is_named(tmp_path):
    cfg = tiny_config("full_single_device", output_dir=str(tmp_path / "out"))
    del cfg.tokenizer["path"]
    with pytest.raises(ValueError, match="config key 'tokenizer.path' is missing: .*needs it"):
        validated_config(cfg, FullFinetuneSingleDeviceConfig, "full_single_device")
    assert not (tmp_path / "out").exists()


def test_a_model_section_is_checked_for_names_only(tmp_path):
    """A builder's shape arguments may come from the checkpoint's folder: a model section
    without them is not refused here (only a misspelt name is)."""
    cfg = tiny_config("full_single_device")
    del cfg.model["num_layers"]
    validate_config(cfg, FullFinetuneSingleDeviceConfig, "full_single_device")


# -- data files -------------------------------------------------------------------------------


def _parquet_with_a_damaged_page(path: Path) -> None:
    rows = 2000
    table = pyarrow.table(
        {"instruction": [f"q{i}" for i in range(rows)], "input": [""] * rows},
    ).append_column("output", pyarrow.array([f"a{i}" * 20 for i in range(rows)]))
    pyarrow.parquet.write_table(table, path, row_group_size=500, compression="NONE")
    data = bytearray(path.read_bytes())
    data[1000:3000] = bytes(b ^ 0x5A for b in data[1000:3000])  # the footer stays readable
    path.write_bytes(bytes(data))


DATA_FAULTS = {
    "truncated_json": (
        "json",
        "rows.json",
        f"[{ALPACA_ROW},\n" + ALPACA_ROW[:30],
        r"is not valid JSON \(line 2, column",
    ),
    "jsonl_broken_line": (
        "json",
        "rows.jsonl",
        f"{ALPACA_ROW}\n{ALPACA_ROW[:25]}\n{ALPACA_ROW}\n",
        r"is not valid JSON Lines \(line 2, column",
    ),
    "csv_extra_field": (
        "csv",
        "rows.csv",
        "instruction,input,output\nSay hi.,,Hi.\nSay,no,,more\n",
        r"is not valid CSV \(the row on line 3: 4 fields, the header has 3\)",
    ),
    "csv_open_quote": (
        "csv",
        "rows.csv",
        'instruction,input,output\nSay hi.,,Hi.\n"Say,,bye.\nSay hi.,,Hi.\n',
        r"is not valid CSV \(the row on line 3: .*a quote left open",
    ),
    "csv_cut_off": (
        "csv",
        "rows.csv",
        "instruction,input,output\nSay hi.,,Hi.\nSay hi.,",
        r"ends in the middle of a row \(its last line has 2 fields, the header 3; cut off\?\)",
    ),
    "corrupt_parquet": ("parquet", "rows.parquet", None, "is a damaged Parquet file"),
    "not_parquet": ("parquet", "rows.parquet", "PAR1 not really", "is not a Parquet file"),
}


@pytest.mark.parametrize("fault", sorted(DATA_FAULTS))
def test_a_broken_data_file_is_named_before_anything_is_written(tmp_path, fault):
    source, name, content, expected = DATA_FAULTS[fault]
    path = tmp_path / name
    if content is None:
        _parquet_with_a_damaged_page(path)
    else:
        path.write_text(content)
    message = refused(tmp_path, [f"dataset.source={source}", f"dataset.data_files={path}"])
    assert_matches(message, f"config key 'dataset.data_files': {path} {expected}")


def test_a_good_data_file_read_at_start_up_is_not_parsed_again(tmp_path):
    """The start-up read fills datasets' cache, which the builder's own call then reads."""
    import datasets

    path = tmp_path / "rows.jsonl"
    path.write_text(f"{ALPACA_ROW}\n" * 50)
    cache = tmp_path / "hf_cache"
    start(
        tmp_path,
        ["dataset.source=json", f"dataset.data_files={path}", f"dataset.cache_dir={cache}"],
    )
    built = list(cache.rglob("*.arrow"))
    assert built
    mtimes = {p: p.stat().st_mtime_ns for p in built}
    datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(cache))
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.arrow")} == mtimes


# -- GRPO: a policy loss per command (docs/grpo.md) -------------------------------------------

GRPO_CONFIG = CONFIGS / "qwen3" / "0.6B_grpo.yaml"
# docs/grpo.md's overrides, one command per policy loss; tests below keep them equal.
POLICY_LOSS_OVERRIDES = {
    "ppo-clip": [],
    "clip-higher": ["loss.epsilon_high=0.28"],
    "gspo": [
        "loss._component_=exactga.grpo.losses.GSPOLoss",
        "~loss.epsilon",
        "loss_aggregation=seq-mean-token-mean",
    ],
    "cispo": ["loss._component_=exactga.grpo.losses.CISPOLoss", "~loss.epsilon"],
}


def _grpo_config(overrides: list[str]):
    """The shipped GRPO config with command-line ``overrides``, merged as ``tune run`` does."""
    yaml = OmegaConf.to_container(OmegaConf.load(GRPO_CONFIG), resolve=False)
    return _merge_yaml_and_cli_args(argparse.Namespace(**yaml), overrides)


@pytest.mark.parametrize("loss", sorted(POLICY_LOSS_OVERRIDES))
def test_each_policy_loss_command_of_the_docs_validates(loss):
    cfg = _grpo_config(POLICY_LOSS_OVERRIDES[loss])
    validate_config(cfg, GrpoDistributedConfig, "grpo_full_finetune_distributed")
    docs = (Path(__file__).resolve().parents[1] / "docs" / "grpo.md").read_text()
    for override in POLICY_LOSS_OVERRIDES[loss]:
        assert override in docs, f"docs/grpo.md lacks {override}"


def test_a_loss_swap_that_keeps_ppo_clips_epsilon_names_the_removal():
    cfg = _grpo_config(["loss._component_=exactga.grpo.losses.GSPOLoss"])
    with pytest.raises(ValueError) as err:
        validate_config(cfg, GrpoDistributedConfig, "grpo_full_finetune_distributed")
    message = str(err.value)
    assert "config key 'loss.epsilon': exactga.grpo.losses.GSPOLoss takes epsilon_low" in message
    assert "~loss.epsilon" in message


def assert_matches(message: str, expected: str) -> None:
    assert re.search(expected, message), message
