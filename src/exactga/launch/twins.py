"""One recipe file under torchtune's two names: whether a launch trains on one device or on
every rank of a process group.

Note [one recipe, two launches]
torchtune 0.6.1 ships each of its fine-tuning recipes twice, ``<family>_single_device`` and
``<family>_distributed``, two files that differ in how they start. exactga keeps one file per
family (``recipes/full_finetune.py``, ``lora_finetune.py``, ``knowledge_distillation.py``,
``lora_dpo.py``), listed under both names (exactga.launch.registry), so a copy of either name
holds the one step to edit. The file hands its two schemas to ``validated_config`` and builds
``Runtime.for_settings``; which of the two a launch runs is decided here, by
:func:`launched_as`, and nowhere else, in this order:

1. a process started by torchrun (``RANK`` set: ``tune run --nproc_per_node N``, any N, or
   ``--nnodes``): distributed, every rank. A config written for one device runs too (the
   distributed schema takes every key of the single-device one), sharded over the ranks: no
   rank trains the whole run on its own. torchtune itself refuses the single-device *name*
   under torchrun, with the distributed twin named (exactga.launch.mixups);
2. a launch by an exactga name (``tune run exactga/full_finetune_distributed``, which the
   launcher's wrap records in :data:`LAUNCHED_AS_ENV`): that name's. The distributed name
   without torchrun trains as one rank of a process group of one, as it always has;
3. anything else (the file by its path, a user's copy, ``python recipes/full_finetune.py``):
   the config. Distributed, as one rank, where it sets a key that only the distributed schema
   reads (:data:`DISTRIBUTED_ONLY_KEYS`: ``fsdp_cpu_offload``, ``gradient_sync``, ...; every
   distributed tiny config sets some), else one device (no single-device config sets one).

Imports nothing: the launcher (every ``tune`` command) and the recipe's process both read it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

# The exactga recipe name a ``tune run`` launched (without the prefix), for the recipe's
# process (rule 2 of [one recipe, two launches]); set by exactga.launch.cli's wrap of tune run.
LAUNCHED_AS_ENV = "EXACTGA_LAUNCHED_AS"
SINGLE_DEVICE, DISTRIBUTED = "_single_device", "_distributed"
# The top-level keys a distributed twin's schema reads and its single-device twin's does not
# (tests/test_registry.py derives them from the schemas and checks they are these).
DISTRIBUTED_ONLY_KEYS = frozenset(
    {
        "ac_mode",
        "ac_option",
        "context_parallel_dim",
        "custom_sharded_layers",
        "data_parallel_replicate_dim",
        "data_parallel_shard_dim",
        "enable_async_checkpointing",
        "fsdp",
        "fsdp_cpu_offload",
        "fsdp_reshard_after_forward",
        "gradient_sync",
        "rank_balancing",
        "tensor_parallel_dim",
        "tensor_parallel_plan",
    }
)


def launched_as(family: str, config_keys: Iterable[str]) -> str:
    """The name a launch of ``family``'s file runs as, ``<family>_single_device`` or
    ``<family>_distributed``, from the process's environment and its config's top-level
    ``config_keys``; see [one recipe, two launches]."""
    if "RANK" in os.environ:  # started by torchrun
        return family + DISTRIBUTED
    named = os.environ.get(LAUNCHED_AS_ENV)
    if named in (family + SINGLE_DEVICE, family + DISTRIBUTED):
        return named
    distributed = not DISTRIBUTED_ONLY_KEYS.isdisjoint(config_keys)
    return family + (DISTRIBUTED if distributed else SINGLE_DEVICE)
