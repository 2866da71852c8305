"""What share of a DPO step its reference forward takes: does precomputing it pay?

The tiny DPO configs' models (LoRA: the policy with its adapters off; full: a frozen copy) on the
shipped preference pairs, sorted longest first and cut into micro-batches of ``--batch-size``
pairs, each micro-batch's reference forward timed on its own, then the whole step (reference,
policy forward, loss, backward) through ``exactga.dpo.loss.dpo_micro_batch_loss``. The first pass
over the micro-batches warms up and is not counted. Prints the reference's share of the step,
which is what ``precompute_reference_logprobs`` saves from the second epoch on (see [precomputed
reference] in exactga.dpo.reference_logprobs).

    .venv/bin/python benchmarks/dpo_reference_share.py
    .venv/bin/python benchmarks/dpo_reference_share.py --pairs 128 --batch-size 4

Wall time on one intra-op thread unless ``--threads``; both timings come from the same steps,
so machine load weighs on both.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from omegaconf import OmegaConf
from torchtune import config
from torchtune.modules.peft import get_adapter_params, set_trainable_params
from torchtune.rlhf.loss import DPOLoss

from exactga.accumulation.loss_units import LOSS_POSITIONS, loss_positions, shift_labels
from exactga.data.micro_batching import sample_length
from exactga.dpo.log_probs import frozen_model_reference, lora_reference
from exactga.dpo.loss import dpo_micro_batch_loss
from exactga.dpo.preference import collate_pairs
from exactga.model_build.frozen import freeze_model

LORA_CONFIG = "configs/tiny/lora_dpo_single_device.yaml"
FULL_CONFIG = "configs/tiny/full_dpo_distributed.yaml"


def micro_batches(num_pairs: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    cfg = OmegaConf.load(LORA_CONFIG)
    dataset = config.instantiate(cfg.dataset, config.instantiate(cfg.tokenizer))
    pairs = sorted((dataset[i] for i in range(num_pairs)), key=sample_length, reverse=True)
    return [collate_pairs(pairs[i : i + batch_size]) for i in range(0, num_pairs, batch_size)]


def policy_and_reference(kind: str):
    if kind == "lora":
        model = config.instantiate(OmegaConf.load(LORA_CONFIG).model)
        set_trainable_params(model, get_adapter_params(model))
        for name, param in model.named_parameters():
            if "lora_b" in name:  # adapters that have trained: the policy is not the reference
                torch.nn.init.normal_(param, std=0.01)
        return model, lora_reference(model)
    model = config.instantiate(OmegaConf.load(FULL_CONFIG).model)
    return model, frozen_model_reference(freeze_model(copy.deepcopy(model)))


def measure(kind: str, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """Seconds of reference forwards and of whole steps over the counted pass."""
    model, reference = policy_and_reference(kind)
    loss_fn = DPOLoss(beta=0.1)
    reference_s = step_s = 0.0
    for counted in (False, True):
        for batch in batches:
            positions = loss_positions(batch["labels"])
            targets = shift_labels(batch["labels"]).reshape(-1).index_select(0, positions)
            start = time.perf_counter()
            reference({"tokens": batch["tokens"]}, positions, targets)
            after_reference = time.perf_counter()
            loss = dpo_micro_batch_loss(
                model, loss_fn, {**batch, LOSS_POSITIONS: positions}, reference
            )
            loss.backward()
            end = time.perf_counter()
            if counted:
                reference_s += after_reference - start
                step_s += end - after_reference
    return reference_s, step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches = micro_batches(args.pairs, args.batch_size)
    print(f"{args.pairs} shipped pairs, {args.batch_size} a micro-batch, {args.threads} thread(s)")
    print("recipe | reference forward s | whole step s | reference share")
    for kind in ("lora", "full"):
        reference_s, step_s = measure(kind, batches)
        print(f"{kind} DPO | {reference_s:.2f} | {step_s:.2f} | {reference_s / step_s:.0%}")


if __name__ == "__main__":
    main()
