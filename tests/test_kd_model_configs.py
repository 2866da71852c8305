"""Checks on the shipped knowledge-distillation configs, fast and offline.

Student and teacher are built on the meta device (nothing is allocated or downloaded), every
config validates against its recipe's schema, and the losses and vocabularies fit together as
the recipes check them at start-up. No recipe is run.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from tiny_runs import recipe_script
from torchtune import config
from torchtune.config._utils import _get_component_from_path
from torchtune.modules.peft import get_adapter_params
from unit_utils import config_header, load_config

from exactga.config.validation import validate_config
from exactga.data.loader import model_vocab_size
from exactga.kd.distillation import check_kd_losses, check_vocabularies
from exactga.kd.schema import (
    KnowledgeDistillationDistributedConfig,
    KnowledgeDistillationSingleDeviceConfig,
)

# config -> (student params range, teacher params range)
MODEL_CONFIGS = {
    "llama3_2/8B_to_1B_KD_lora_single_device": ((1.0e9, 1.6e9), (7.5e9, 8.5e9)),
    "llama3_2/8B_to_1B_KD_lora_distributed": ((1.0e9, 1.6e9), (7.5e9, 8.5e9)),
    "qwen2_5/7B_to_0.5B_KD_lora_single_device": ((0.4e9, 0.65e9), (7.0e9, 8.0e9)),
    "qwen2_5/7B_to_0.5B_KD_lora_distributed": ((0.4e9, 0.65e9), (7.0e9, 8.0e9)),
}
TINY = ["tiny/kd_single_device", "tiny/kd_distributed"]
NAMES = list(MODEL_CONFIGS)


def _schema(name: str) -> type:
    if name.endswith("distributed"):
        return KnowledgeDistillationDistributedConfig
    return KnowledgeDistillationSingleDeviceConfig


@pytest.mark.parametrize("name", NAMES)
def test_student_and_teacher_build_on_meta(name: str) -> None:
    (s_lo, s_hi), (t_lo, t_hi) = MODEL_CONFIGS[name]
    cfg = load_config(name)
    with torch.device("meta"):
        student = config.instantiate(cfg.model)
        teacher = config.instantiate(cfg.teacher_model)
    adapters = get_adapter_params(student)
    n_adapter = sum(p.numel() for p in adapters.values())
    n_student = sum(p.numel() for p in student.parameters()) - n_adapter
    n_teacher = sum(p.numel() for p in teacher.parameters())
    assert s_lo <= n_student <= s_hi, f"student {n_student:,}"
    assert t_lo <= n_teacher <= t_hi, f"teacher {n_teacher:,}"
    assert 0 < n_adapter < 0.1 * n_student
    assert not get_adapter_params(teacher)  # a plain teacher: nothing of it trains
    check_vocabularies(model_vocab_size(student), model_vocab_size(teacher))


@pytest.mark.parametrize("name", NAMES + TINY)
def test_validates_and_losses_fit(name: str) -> None:
    cfg = validate_config(load_config(name), _schema(name), name)
    check_kd_losses(config.instantiate(cfg.loss), config.instantiate(cfg.kd_loss))
    assert cfg.loss_normalization == "exact" and 0.0 <= cfg.kd_ratio <= 1.0
    for key in ("tokenizer", "checkpointer", "teacher_checkpointer", "metric_logger"):
        assert callable(_get_component_from_path(cfg[key]._component_)), key


@pytest.mark.parametrize("name", NAMES + TINY)
def test_header_has_launch_command(name: str) -> None:
    recipe = "knowledge_distillation_" + (
        "distributed" if "distributed" in name else "single_device"
    )
    assert recipe_script(recipe) in config_header(name)
    assert f"configs/{name}.yaml" in config_header(name)


@pytest.mark.parametrize("name", TINY)
def test_tiny_teacher_is_wider_than_the_student(name: str) -> None:
    cfg = load_config(name)
    assert cfg.teacher_model.embed_dim > cfg.model.embed_dim
    assert cfg.teacher_model.vocab_size == cfg.model.vocab_size
    assert "random_init_checkpointer" in cfg.teacher_checkpointer._component_
    teacher_dir = OmegaConf.to_container(cfg.teacher_checkpointer)["checkpoint_dir"]
    assert teacher_dir == "${output_dir}/teacher_model"
