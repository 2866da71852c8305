"""Rollouts: one prompt's group of sampled completions, the same on any rank layout.

GRPO samples a group of completions per prompt, PPO one; both generate here, so both families
share the one generation path (a family never imports another, so it sits in a package below
them).

:func:`generate_group` samples ``num_samples`` completions of one prompt with torchtune's
``generate`` and a KV cache, and returns them as rollouts for
:func:`exactga.grpo.policy.collate_rollouts`: ``tokens`` (prompt then completion), ``labels``
(ignored at the prompt, so after the shift exactly the completion tokens are scored), the
``completion`` itself, ``prompt_index``, ``sample_index`` and ``stopped``. The settings are
one :class:`SamplingSettings`. See [rollouts independent of the rank layout].

Note [rollouts independent of the rank layout]
A completion is a function of the weights and of (seed, step, prompt index, sample index) only,
so 1 rank and N ranks generate the same completions for the same global batch (which is also
what lets a split comparison be exact). Three things could make it depend on the layout:

- Which prompts share a forward. Batched with other prompts, a prompt is left-padded to the
  longest, which moves its masks and the kernels' shapes (and so the low bits of its logits).
  Here one ``generate`` call holds one prompt's group: ``num_samples`` identical rows, no
  padding, a KV cache of ``len(prompt) + max_generated_tokens`` positions. Every shape is the
  prompt's own, whatever else the rank generates.
- Where the randomness comes from. torchtune's ``generate`` samples by ``argmax(p / q)`` with
  ``q`` one exponential draw per row and vocabulary entry at every step, from the generator it
  is handed. That generator is a fresh one per group, seeded from a stable hash of (seed, step,
  prompt index) (:func:`rollout_seed`), so row ``i`` of the draws, sample ``i``, is the same
  whichever rank draws it and whatever was generated before.
- When generation stops. Under FSDP2 every forward all-gathers parameters, so every rank must
  run the same number of forwards: a rank whose completions had all stopped would leave the
  others waiting in an all-gather. With ``run_full_length`` each group runs exactly
  ``max_generated_tokens`` forwards and each completion is cut on the host after its first
  stop token. Every row draws at every step, stopped or not, so the tokens up to the cut are
  those an early-stopping run produces: one rank may stop early and gets the same completions.

It does not make a CUDA run equal a CPU run (different generators and kernels), and every rank
must generate as many groups per step (the same ``batch_size``), or the forward counts differ.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchtune.generation import generate
from torchtune.modules.common_utils import local_kv_cache

from exactga.accumulation.loss_units import IGNORE_INDEX
from exactga.model_build.frozen import frozen_forward

Rollout = dict[str, Any]

# Handed to torchtune's generate as its pad_id. generate treats every prompt token equal to
# pad_id as left padding (masked out, positions shifted); a group's rows are never padded, so
# no real token may be taken for padding, and no token id is negative.
_NO_PAD_ID = -1


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled; the arguments of torchtune's ``generate``.

    Attributes:
        max_generated_tokens: the most tokens a completion has (its stop token included).
        temperature: the logits are divided by it (torchtune floors it at 1e-5: 0 is greedy).
        top_k: sample among the ``top_k`` likeliest tokens only; ``None`` for all.
        stop_tokens: a completion ends after the first of these (kept as its last token).
    """

    max_generated_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if int(self.max_generated_tokens) != self.max_generated_tokens or (
            self.max_generated_tokens < 1
        ):
            raise ValueError(
                f"max_generated_tokens={self.max_generated_tokens}: must be a whole number of "
                "at least 1."
            )
        if not self.temperature >= 0.0 or self.temperature == float("inf"):  # NaN fails too
            raise ValueError(f"temperature={self.temperature}: must be finite and at least 0.")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k}: must be at least 1, or None for no cut.")
        # A list from a config is fine; kept as a tuple so the settings stay hashable.
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        if any(t < 0 for t in self.stop_tokens):
            raise ValueError(f"stop_tokens={list(self.stop_tokens)}: token ids are at least 0.")


@dataclass(frozen=True)
class RolloutGroup:
    """One prompt's group: ``rollouts`` in sample order, and ``num_generated_tokens``, the
    tokens the generator produced for it (rows times forwards run, past stop tokens included:
    the work done, not the completions' lengths)."""

    rollouts: list[Rollout]
    num_generated_tokens: int


# The ``step`` of validation's seeds (GRPO's and PPO's held-out prompts, by their rows):
# training's steps count from 0, so no validation draw is a training draw, and every validation
# of a run draws the same numbers.
VALIDATION_STEP = -1


def rollout_seed(seed: int, step: int, prompt_index: int) -> int:
    """The seed of one group's generator: a hash of (seed, step, prompt index) that is the
    same in every process and Python version (``hash`` of a tuple is not promised to be).
    See [rollouts independent of the rank layout]."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)  # manual_seed takes a signed 64 bits


def check_prompt(
    model: nn.Module, prompt_tokens: Sequence[int], *, prompt_index: int, max_generated_tokens: int
) -> None:
    """Fail naming the prompt if ``model`` cannot generate ``max_generated_tokens`` after it.

    :func:`generate_group` calls it; a caller may also call it for every prompt of a step
    before generating any, so that a bad prompt fails before a first forward.

    Raises:
        ValueError: an empty prompt, one too long for the model's ``max_seq_len`` with the
            completion, or a token id outside the vocabulary.
    """
    if len(prompt_tokens) == 0:
        raise ValueError(
            f"prompt {prompt_index} is empty: generation needs at least one prompt token. "
            "Drop the example or give it a prompt."
        )
    max_seq_len = model.max_seq_len
    if len(prompt_tokens) + max_generated_tokens > max_seq_len:
        raise ValueError(
            f"prompt {prompt_index} has {len(prompt_tokens)} tokens, and with "
            f"max_generated_tokens={max_generated_tokens} its rollout would exceed the "
            f"model's max_seq_len={max_seq_len}. Shorten the prompt (or filter long ones), "
            "lower max_generated_tokens, or build the model with a larger max_seq_len."
        )
    vocab_size = model.tok_embeddings.num_embeddings
    low, high = min(prompt_tokens), max(prompt_tokens)
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"prompt {prompt_index} holds token id {low if low < 0 else high}, outside the "
            f"model's vocabulary of {vocab_size}: is the tokenizer the model's?"
        )


def generate_group(
    model: nn.Module,
    prompt_tokens: Sequence[int],
    *,
    num_samples: int,
    sampling: SamplingSettings,
    seed: int,
    step: int,
    prompt_index: int,
    run_full_length: bool,
    device: torch.device,
) -> RolloutGroup:
    """``num_samples`` completions of one prompt, as rollouts for ``collate_rollouts``; see
    [rollouts independent of the rank layout].

    ``prompt_index`` names the prompt the same way on every layout (its place in the step's
    global batch, or its dataset index). Set ``run_full_length`` whenever the model is sharded
    over more than one rank: every rank must then call this as many times per step. Under
    autocast (``Precision.autocast``) the KV cache takes the autocast dtype, otherwise the
    embedding weights'. The model's training flags are restored afterwards and an FSDP2 model
    is left resharded.

    Returns:
        The group; each rollout has ``tokens``, ``labels`` and ``completion`` (lists of ids;
        the labels are ``IGNORE_INDEX`` at the prompt and the completion's ids after it), and
        ``prompt_index``, ``sample_index``, ``stopped`` (the completion ends with a stop token).

    Raises:
        ValueError: a bad prompt (:func:`check_prompt`) or ``num_samples`` below 1.
    """
    if num_samples < 1:
        raise ValueError(f"grpo_samples={num_samples}: a group needs at least one completion.")
    max_generated = sampling.max_generated_tokens
    check_prompt(
        model, prompt_tokens, prompt_index=prompt_index, max_generated_tokens=max_generated
    )
    prompt = torch.tensor([list(prompt_tokens)], dtype=torch.long, device=device)
    rows = prompt.repeat(num_samples, 1)
    generator = torch.Generator(device=device)
    generator.manual_seed(rollout_seed(seed, step, prompt_index))
    if torch.is_autocast_enabled(device.type):
        cache_dtype = torch.get_autocast_dtype(device.type)
    else:
        cache_dtype = model.tok_embeddings.weight.dtype
    with (
        _generating(model),
        local_kv_cache(
            model,
            batch_size=num_samples,
            device=device,
            dtype=cache_dtype,
            # The group's own length, never a rank-wide maximum: see [rollouts independent
            # of the rank layout].
            decoder_max_seq_len=prompt.size(1) + max_generated,
        ),
    ):
        generated, _ = generate(
            model,
            rows,
            max_generated_tokens=max_generated,
            pad_id=_NO_PAD_ID,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            # Without stop tokens generate never stops early; the cut below finds them.
            stop_tokens=None if run_full_length else list(sampling.stop_tokens) or None,
            rng=generator,
        )
    completions = generated[:, prompt.size(1) :].cpu()
    lengths, stopped = _cut_at_stop(completions, sampling.stop_tokens)
    prompt_list = list(prompt_tokens)
    rollouts = []
    for sample_index in range(num_samples):
        completion = completions[sample_index, : lengths[sample_index]].tolist()
        rollouts.append(
            {
                "tokens": prompt_list + completion,
                "labels": [IGNORE_INDEX] * len(prompt_list) + completion,
                "completion": completion,
                "prompt_index": prompt_index,
                "sample_index": sample_index,
                "stopped": stopped[sample_index],
            }
        )
    return RolloutGroup(rollouts, num_generated_tokens=completions.numel())


def _cut_at_stop(
    completions: torch.Tensor, stop_tokens: Sequence[int]
) -> tuple[list[int], list[bool]]:
    """Each row's length up to and including its first stop token (all of it without one),
    and whether it has one. After a row's stop, early-stopping generate writes zeros, and a
    full-length one keeps sampling: neither is part of the completion."""
    num_rows, width = completions.shape
    if not stop_tokens:
        return [width] * num_rows, [False] * num_rows
    is_stop = torch.isin(completions, torch.tensor(stop_tokens, dtype=completions.dtype))
    stopped = is_stop.any(dim=1)
    first_stop = is_stop.int().argmax(dim=1)  # the first maximum: the first stop token
    lengths = torch.where(stopped, first_stop + 1, torch.full_like(first_stop, width))
    return lengths.tolist(), stopped.tolist()


@contextlib.contextmanager
def _generating(model: nn.Module) -> Iterator[None]:
    """No gradients, eval mode, and afterwards each module's training flag as it was and an
    FSDP2 model resharded.

    Gradients off through ``exactga.model_build.frozen.frozen_forward`` (see [frozen forwards
    run under no_grad] there): FSDP2 reuses its unsharded parameter storage in the training forward,
    which an inference tensor could not join. The reshard matters for
    units that keep their parameters unsharded after a forward, expecting a backward
    (``reshard_after_forward=False``, or ``None`` on the root): it frees those copies and puts
    the sharded parameters back, which the optimizer step needs.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with frozen_forward():
            yield
    finally:
        for module, training in modes:
            module.training = training
        if isinstance(model, FSDPModule):
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
