"""Config values and flag combinations fail at start-up, in validate_config, naming the keys.

Each check lives next to its default in exactga.config.schemas (``choices``, ``check_flags``), so
every recipe that uses the schema gets it, before the config is printed or a model is built.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from exactga.config.options import (
    GradientSync,
    MasterWeights,
    MicroBatching,
    NonFinitePolicy,
    NormMode,
    Option,
)
from exactga.config.schemas import (
    FullFinetuneDistributedConfig,
    FullFinetuneSingleDeviceConfig,
    LoraFinetuneDistributedConfig,
    LoraFinetuneSingleDeviceConfig,
)
from exactga.config.validation import check_input_files, validate_config
from exactga.parity.schema import GaParityConfig

FULL = "configs/tiny/full_single_device.yaml"
LORA = "configs/tiny/lora_single_device.yaml"
FULL_DISTRIBUTED = "configs/tiny/full_distributed.yaml"
LORA_DISTRIBUTED = "configs/tiny/lora_distributed.yaml"
PARITY = "configs/tiny/ga_parity_full.yaml"


def _validate(schema: type, path: str, **overrides: object):
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.create(overrides))
    return validate_config(cfg, schema, "recipe")


@pytest.mark.parametrize(
    ("schema", "path", "key", "value", "choices"),
    [
        (FullFinetuneSingleDeviceConfig, FULL, "loss_normalization", "mean", "exact, post_scale"),
        (FullFinetuneSingleDeviceConfig, FULL, "dtype", "fp16", "bf16, fp32, fp64"),
        (LoraFinetuneSingleDeviceConfig, LORA, "nonfinite_loss", "halt", "skip, stop"),
        (
            FullFinetuneSingleDeviceConfig,
            FULL,
            "micro_batching",
            "sorted",
            "fixed, by_length, token_budget",
        ),
        (
            LoraFinetuneDistributedConfig,
            LORA_DISTRIBUTED,
            "gradient_sync",
            "often",
            "every_micro_batch, once",
        ),
    ],
)
def test_a_value_outside_its_choices_names_the_key_and_the_choices(
    schema, path, key, value, choices
) -> None:
    with pytest.raises(ValueError, match=f"config key '{key}'='{value}': choose one of {choices}"):
        _validate(schema, path, **{key: value})


def test_enum_knobs_come_back_as_members_and_the_printed_config_reads_back() -> None:
    """Recipes hand ``cfg.loss_normalization`` and the rest to the library as they are; the
    config a run prints and saves (OmegaConf writes a member by its name) validates again to
    the same members. See exactga.config.options."""
    cfg = _validate(LoraFinetuneDistributedConfig, LORA_DISTRIBUTED, nonfinite_loss="stop")
    knobs = {
        "loss_normalization": NormMode.EXACT,
        "micro_batching": MicroBatching.BY_LENGTH,
        "master_weights": MasterWeights.FP32,
        "nonfinite_loss": NonFinitePolicy.STOP,
        "gradient_sync": GradientSync.EVERY_MICRO_BATCH,
    }
    for key, member in knobs.items():
        assert cfg[key] is member, key
    printed = OmegaConf.to_yaml(cfg, resolve=True)
    assert "nonfinite_loss: stop\n" in printed
    again = validate_config(OmegaConf.create(printed), LoraFinetuneDistributedConfig, "recipe")
    assert all(again[key] is member for key, member in knobs.items())
    parity = _validate(GaParityConfig, PARITY, parity={"modes": ["exact"]})
    assert list(parity.parity.modes) == [NormMode.EXACT]
    assert all(isinstance(m, MicroBatching) for m in parity.parity.micro_batching)


def test_every_option_is_named_as_the_config_spells_it() -> None:
    for option in Option.__subclasses__():
        for member in option:
            assert member.name == member.value == str(member) == f"{member}", member


@pytest.mark.parametrize("tokens", [0, -8])
def test_a_token_budget_below_one_names_the_key(tokens: int) -> None:
    with pytest.raises(ValueError, match="'micro_batch_tokens' must be null or at least 1"):
        _validate(
            FullFinetuneSingleDeviceConfig,
            FULL,
            micro_batching="token_budget",
            micro_batch_tokens=tokens,
        )


def test_a_list_of_choices_names_the_bad_item() -> None:
    with pytest.raises(ValueError, match="'parity.modes'='mean': choose one of"):
        _validate(GaParityConfig, PARITY, parity={"modes": ["exact", "mean"]})


def test_the_profiler_section_is_checked_against_its_schema() -> None:
    with pytest.raises(ValueError, match="unknown config key 'profiler.wait_stepz'.*'wait_steps'"):
        _validate(FullFinetuneSingleDeviceConfig, FULL, profiler={"wait_stepz": 1})
    with pytest.raises(ValueError, match="config key 'profiler.enabled'"):
        _validate(FullFinetuneSingleDeviceConfig, FULL, profiler={"enabled": "sometimes"})


@pytest.mark.parametrize(
    ("schema", "path", "overrides", "message"),
    [
        (
            FullFinetuneSingleDeviceConfig,
            FULL,
            {"optimizer_in_bwd": True, "gradient_accumulation_steps": 2},
            "'optimizer_in_bwd' and 'gradient_accumulation_steps'",
        ),
        (
            FullFinetuneDistributedConfig,
            FULL_DISTRIBUTED,
            {"optimizer_in_bwd": True, "clip_grad_norm": 1.0, "gradient_accumulation_steps": 1},
            "'optimizer_in_bwd' and 'clip_grad_norm'",
        ),
        (
            FullFinetuneDistributedConfig,
            FULL_DISTRIBUTED,
            {"optimizer_in_bwd": True, "clip_grad_norm": None, "gradient_accumulation_steps": 2},
            "'optimizer_in_bwd' and 'gradient_accumulation_steps'",
        ),
        (
            FullFinetuneSingleDeviceConfig,
            FULL,
            {
                "optimizer_in_bwd": True,
                "loss_normalization": "naive",
                "micro_batching": "fixed",
                "clip_grad_norm": None,
                "gradient_accumulation_steps": 1,
            },
            "'optimizer_in_bwd' and 'loss_normalization'",
        ),
        (
            FullFinetuneSingleDeviceConfig,
            FULL,
            {"loss_normalization": "post_scale", "micro_batching": "by_length"},
            "'micro_batching' and 'loss_normalization'",
        ),
        (
            LoraFinetuneDistributedConfig,
            LORA_DISTRIBUTED,
            {"micro_batching": "fixed", "micro_batch_tokens": 1024},
            "'micro_batch_tokens' and 'micro_batching'",
        ),
        (
            FullFinetuneDistributedConfig,
            FULL_DISTRIBUTED,
            {"micro_batching": "token_budget"},
            "'micro_batch_tokens' is needed",
        ),
        (
            LoraFinetuneSingleDeviceConfig,
            LORA,
            {"enable_activation_offloading": True},
            "'enable_activation_offloading' needs device: cuda",
        ),
        (
            FullFinetuneDistributedConfig,
            FULL_DISTRIBUTED,
            {"tensor_parallel_dim": 2},
            "'tensor_parallel_plan' is needed",
        ),
        (GaParityConfig, PARITY, {"optimizer_in_bwd": True}, "'optimizer_in_bwd' must be False"),
        (GaParityConfig, PARITY, {"dataset": {"packed": True}}, "'dataset.packed' is not"),
    ],
)
def test_impossible_combinations_fail_naming_the_keys(schema, path, overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        _validate(schema, path, **overrides)


def test_a_full_model_section_in_a_lora_config_names_the_missing_lora_keys() -> None:
    cfg = OmegaConf.load(LORA)
    cfg.model = OmegaConf.load(FULL).model
    with pytest.raises(ValueError, match="has no model.lora_rank, model.lora_alpha"):
        validate_config(cfg, LoraFinetuneSingleDeviceConfig, "recipe")


@pytest.mark.parametrize(
    ("schema", "path", "overrides", "message"),
    [
        (FullFinetuneSingleDeviceConfig, FULL, {"log_peak_memory_stats": True}, "ignored on CPU"),
        (
            FullFinetuneDistributedConfig,
            FULL_DISTRIBUTED,
            {"fsdp_cpu_offload": True},
            "'fsdp_cpu_offload' is ignored on CPU",
        ),
        (
            LoraFinetuneDistributedConfig,
            LORA_DISTRIBUTED,
            {"fsdp": {"cpu_offload": False}},
            "'fsdp' is ignored",
        ),
    ],
)
def test_an_ignored_setting_warns(schema, path, overrides, message) -> None:
    with pytest.warns(UserWarning, match=message):
        _validate(schema, path, **overrides)


def test_the_parity_report_runs_a_training_config_and_names_the_keys_it_ignores() -> None:
    training_config = OmegaConf.load(FULL)
    training_config.parity = {"splits": ["1x8", "2x4"]}
    with pytest.warns(UserWarning, match="ignored by recipe: .*batch_size.*metric_logger"):
        cfg = validate_config(training_config, GaParityConfig, "recipe")
    assert "batch_size" not in cfg and cfg.parity.splits == ["1x8", "2x4"]
    with pytest.raises(ValueError, match="unknown config key 'warp_drive'"):
        _validate(GaParityConfig, PARITY, warp_drive=9)


def test_the_shipped_parity_configs_hold_only_keys_the_report_reads() -> None:
    for path in (
        PARITY,
        "configs/tiny/ga_parity_lora.yaml",
        "configs/tiny/ga_parity_kd.yaml",
        "configs/tiny/ga_parity_qat.yaml",
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _validate(GaParityConfig, path)


def test_missing_input_files_name_the_key_and_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok.model").write_bytes(b"x")
    (tmp_path / "a.json").write_text("[]")
    cfg = OmegaConf.create(
        {
            "tokenizer": {"path": "tok.model"},
            "dataset": [
                {"source": "json", "data_files": "a.json"},
                {"source": "json", "data_files": {"train": ["a.json", "shards/*.json"]}},
                {"source": "tatsu-lab/alpaca"},  # a hub dataset: nothing local to check
            ],
        }
    )
    check_input_files(cfg)  # every local file is there; a glob is left to datasets

    cfg.dataset[1].data_files.train.append("b.json")
    with pytest.raises(ValueError) as err:
        check_input_files(cfg)
    message = str(err.value)
    assert "config key 'dataset[1].data_files': no file at 'b.json'" in message
    assert f"relative to the working directory {tmp_path}" in message

    cfg.tokenizer.path = str(tmp_path / "missing.model")
    with pytest.raises(ValueError, match="'tokenizer.path': no file at '/.*missing.model'\\. Fix"):
        check_input_files(cfg)


def test_the_shipped_tiny_configs_pass_the_file_check_from_the_repository_root(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    for path in (FULL, LORA, FULL_DISTRIBUTED, LORA_DISTRIBUTED, PARITY):
        schema = {
            FULL: FullFinetuneSingleDeviceConfig,
            LORA: LoraFinetuneSingleDeviceConfig,
            FULL_DISTRIBUTED: FullFinetuneDistributedConfig,
            LORA_DISTRIBUTED: LoraFinetuneDistributedConfig,
            PARITY: GaParityConfig,
        }[path]
        validate_config(OmegaConf.load(path), schema, "recipe", check_files=True)
