"""What each tensor of a run is kept in: ``dtype`` and ``master_weights``, for every recipe.

``dtype`` (torchtune's key) is the precision the model computes in, and the one frozen weights
(a LoRA base) and buffers are stored in. ``master_weights: fp32`` keeps the *trainable*
parameters, their gradients and the optimizer state in fp32 under ``dtype: bf16``; ``none``
keeps them in ``dtype`` too, torchtune 0.6.1's behaviour, bit for bit. Every recipe makes the
same few calls (:class:`Precision`): cast the trainable parameters after the model is built,
run the forward under :meth:`Precision.autocast`, shard with :meth:`Precision.mp_policy`, and
write weights for users in ``dtype`` (:meth:`Precision.saving_in_dtype`). Measurements and the
memory each choice costs: docs/precision.md.

Note [fp32 master weights]
Under pure bf16 an update smaller than half a unit in the last place of a weight (2^-9 of it)
is rounded away, and gradients accumulated over micro-batches in bf16 lose low bits at every
add; after 12 steps on the tiny model the weights are 5 % of the update away from the fp32
run's, and the splits 8x1 and 1x8 1 % from each other (docs/precision.md). Keeping the
trainable weights, their gradients and the optimizer state in fp32 while the matrix products
run in bf16 removes both: the
gradient of each micro-batch is computed in bf16, then added to an fp32 ``.grad``, and the
optimizer steps fp32 weights. How the bf16 compute is obtained differs by where the weights
live, not in what it means:

- one device: ``torch.autocast(dtype=bf16)`` around the forward. Autocast casts each fp32
  weight to bf16 where a matrix product reads it (the copy is saved for backward) and the
  gradient flows back through that cast into the fp32 ``.grad``. Norms, RoPE and the residual
  stream, which autocast leaves alone, run in fp32, a little more precise than pure bf16. The
  loss runs outside autocast on the bf16 logits, as under pure bf16 (torchtune's losses upcast).
  Autocast's cast cache is off: with it, a weight read by several products in one forward
  (the output projection once per chunk of ``CEWithChunkedOutputLoss``, a tied embedding
  twice) is cast once and the gradients of all its uses meet on that one bf16 copy, so they
  are summed in bf16 before reaching the fp32 ``.grad``. Without the cache each use casts its
  own copy and the sum happens in fp32: on the tiny model that took the bf16 gradient of one
  micro-batch from 3.4e-3 to 2.8e-3 of the fp64 gradient (relative L2, mean of 8 batches).
  The price is one more cast of such a weight per use, a read and a write of it in bf16.
- FSDP2: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` over fp32 shards of
  the decoder layers. FSDP all-gathers bf16 copies (half the traffic of fp32), and
  reduce-scatters the bf16 gradients in fp32 into fp32 sharded gradients, where accumulation
  over micro-batches happens. The units around the layers (the root with the embeddings,
  final norm and output, or those sharded on their own with ``custom_sharded_layers``) gather
  their fp32 weights and layers take their inputs uncast (``cast_forward_inputs=False``), so
  the residual stream is fp32 as under autocast on one device: with a bf16 embedding the
  residual stream was bf16 and 2 ranks landed 1.3x further from fp32 than one device (3.6e-3
  against 2.8e-3, SGD). That costs one fp32 instead of bf16 unsharded copy of those weights
  while they are in use (2 GB more for Llama 3.1 8B's embedding and output). The forward also
  runs under autocast, so the compute is bf16 on one rank or without FSDP too.
- LoRA: only the adapters (and DoRA magnitudes) are trainable, so only they become fp32; the
  frozen base stays bf16, and its gradient-free matrix products are the same as under pure bf16.

Weights written for users (torchtune's epoch checkpoints: full weights, adapters, merged
weights) are cast back to ``dtype``, the files stock writes; ``adapter_config.json`` does not
change. Step checkpoints keep the fp32 trainable weights, so a resume goes on bit for bit; a
resume from an *epoch* checkpoint starts from its bf16-rounded weights (and the fp32 optimizer
state), which is close but not the uninterrupted run.

With ``dtype: fp32`` or ``fp64`` the weights are at least fp32 already and ``master_weights``
changes nothing (it asks for "at least fp32"; the LoRA recipes default to it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from exactga.config.options import MasterWeights, as_option

# The keys of torchtune's checkpoint dictionaries whose tensors are weights users load
# (torchtune.training.MODEL_KEY and ADAPTER_KEY); optimizer and recipe state are left as they are.
_WEIGHT_KEYS = ("model", "adapter")


@dataclass(frozen=True)
class Precision:
    """The dtypes of a run, from ``dtype`` and ``master_weights``. See [fp32 master weights].

    Attributes:
        compute_dtype: ``dtype``: what the forward computes in, and what frozen weights,
            buffers and the weights written for users are stored in.
        param_dtype: what the trainable parameters, their gradients and the optimizer state
            are stored in: fp32 with ``master_weights: fp32`` under bf16, else ``dtype``.
        device_type: for autocast ("cpu", "cuda", ...).
    """

    compute_dtype: torch.dtype
    param_dtype: torch.dtype
    device_type: str

    @classmethod
    def from_config(
        cls, dtype: torch.dtype, master_weights: MasterWeights | str, device: torch.device
    ) -> Precision:
        """From the recipe's ``dtype`` (torchtune's ``training.get_dtype``) and config key
        ``master_weights`` (a member, or its config spelling).

        Raises:
            ValueError: ``master_weights`` is not one of fp32, none.
        """
        master = as_option(MasterWeights, master_weights, "master_weights")
        lower_than_fp32 = dtype.is_floating_point and torch.finfo(dtype).bits < 32
        param_dtype = torch.float32 if master is MasterWeights.FP32 and lower_than_fp32 else dtype
        return cls(compute_dtype=dtype, param_dtype=param_dtype, device_type=device.type)

    @property
    def mixed(self) -> bool:
        """Whether trainable weights are kept in a higher precision than the compute."""
        return self.param_dtype != self.compute_dtype

    def describe(self) -> str:
        """For the recipes' start-up log line."""
        if not self.mixed:
            return f"precision {self.compute_dtype}"
        return (
            f"precision {self.compute_dtype} compute over {self.param_dtype} master weights "
            "(master_weights: fp32)"
        )

    def cast_trainable(self, model: nn.Module) -> None:
        """Store every parameter that requires grad in ``param_dtype``, in place (the
        ``Parameter`` objects stay, so references to them stay valid). Call after freezing
        the base (LoRA) and before loading weights and building the optimizer; works on the
        meta device, before sharding. A no-op unless ``mixed``."""
        if not self.mixed:
            return
        for param in model.parameters():
            if param.requires_grad and param.dtype != self.param_dtype:
                param.data = param.data.to(self.param_dtype)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context of a forward pass: bf16 autocast when ``mixed``, else nothing (so
        ``none`` runs exactly stock's ops). See [fp32 master weights]."""
        if not self.mixed:
            return contextlib.nullcontext()
        # No cast cache, so reused weights sum their gradients in fp32: see [fp32 master weights].
        return torch.autocast(
            device_type=self.device_type, dtype=self.compute_dtype, cache_enabled=False
        )

    def mp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's policy: gather parameters in ``dtype``, reduce gradients in fp32 into fp32
        shards when ``mixed``; ``None`` (FSDP's default, stock) otherwise."""
        if not self.mixed:
            return None
        return MixedPrecisionPolicy(
            param_dtype=self.compute_dtype,
            reduce_dtype=self.param_dtype,
            cast_forward_inputs=False,  # the residual stream stays fp32 between layers
        )

    def shard_model(
        self,
        model: nn.Module,
        shard_conditions: list[Callable[[str, nn.Module], bool]],
        *,
        cpu_offload: bool,
        reshard_after_forward: bool = True,
        dp_mesh: Any = None,
    ) -> None:
        """torchtune 0.6.1's ``training.shard_model``, with :meth:`mp_policy` when ``mixed``.

        torchtune's takes no mixed-precision policy, so under ``mixed`` its loop is repeated
        here with one (the same modules, bottom-up, then the root); otherwise torchtune's own
        function runs, so ``master_weights: none`` shards exactly as stock.
        """
        from torchtune import training

        policy = self.mp_policy()
        if policy is None:
            training.shard_model(
                model=model,
                shard_conditions=shard_conditions,
                cpu_offload=cpu_offload,
                reshard_after_forward=reshard_after_forward,
                dp_mesh=dp_mesh,
            )
            return
        # See [fp32 master weights]: the decoder layers gather bf16, the units around them
        # (embeddings, final norm, output; the root) their own dtype, so the residual stream
        # starts and stays fp32 as under autocast on one device.
        edge_policy = MixedPrecisionPolicy(reduce_dtype=self.param_dtype, cast_forward_inputs=False)
        fsdp_kwargs: dict[str, Any] = {
            "reshard_after_forward": reshard_after_forward,
            "mesh": dp_mesh,
        }
        if cpu_offload:
            fsdp_kwargs["offload_policy"] = CPUOffloadPolicy()
        num_sharded = 0
        for name, module in reversed(list(model.named_modules())):
            if any(condition(name, module) for condition in shard_conditions):
                unit_policy = policy if _is_decoder_layer(name) else edge_policy
                fully_shard(module, mp_policy=unit_policy, **fsdp_kwargs)
                num_sharded += 1
        if num_sharded == 0:
            raise ValueError(
                "No layer modules were sharded. Please check if shard conditions are working as "
                "expected."
            )
        fully_shard(model, mp_policy=edge_policy, **fsdp_kwargs)

    def weights_for_saving(self, ckpt_dict: Mapping[str, Any]) -> dict[str, Any]:
        """``ckpt_dict`` (a torchtune checkpoint dictionary) with the floating-point tensors
        of its model and adapter weights in ``dtype``; the rest (optimizer and recipe state,
        adapter config) as it is. A shallow copy; ``ckpt_dict`` itself is not changed."""
        saved = dict(ckpt_dict)
        if not self.mixed:
            return saved
        for key in _WEIGHT_KEYS:
            if isinstance(saved.get(key), Mapping):
                saved[key] = {name: self._saved(value) for name, value in saved[key].items()}
        return saved

    def _saved(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype == self.param_dtype:
            return value.to(self.compute_dtype)
        return value

    def saving_in_dtype(self, checkpointer: Any) -> Any:
        """``checkpointer`` (a torchtune checkpointer, or the ``CheckpointClient`` of the
        distributed full recipe) whose ``save_checkpoint`` writes weights in ``dtype``
        (:meth:`weights_for_saving`); everything else is the checkpointer's own. The
        checkpointer itself unless ``mixed``."""
        if not self.mixed:
            return checkpointer
        from torchtune.training.checkpointing import DistributedCheckpointer
        from torchtune.training.checkpointing._checkpoint_client import CheckpointClient

        if isinstance(checkpointer, CheckpointClient):
            # The client builds the user's checkpointer on first use and keeps it there.
            inner = checkpointer._get_checkpointer()
            if not isinstance(inner, DistributedCheckpointer):
                checkpointer._checkpointer = _SavesInDtype(inner, self)
            return checkpointer
        if isinstance(checkpointer, DistributedCheckpointer):
            return checkpointer  # sharded resume state, not files for users: kept in fp32
        return _SavesInDtype(checkpointer, self)


def _is_decoder_layer(module_name: str) -> bool:
    """``layers.N``: a decoder layer as torchtune's ``get_shard_conditions`` names it."""
    parts = module_name.split(".")
    return len(parts) == 2 and parts[0] == "layers" and parts[1].isdigit()


class _SavesInDtype:
    """A torchtune checkpointer that writes the weights it is handed in ``Precision``'s
    ``dtype``; every other attribute is the wrapped checkpointer's."""

    def __init__(self, checkpointer: Any, precision: Precision) -> None:
        self._wrapped = checkpointer
        self._precision = precision

    def save_checkpoint(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        saved = self._precision.weights_for_saving(state_dict)
        return self._wrapped.save_checkpoint(saved, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)
