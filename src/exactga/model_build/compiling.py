"""``compile: True``: each of a model's layers compiled by torchtune's ``compile_model``, with
the dynamo setting exactga's layers need to stay one graph each.

Note [host-read sizes under compile]
The MoE experts' loop (exactga.models.moe.experts, the path off Hopper's grouped GEMM) reads
each expert's number of tokens on the host to cut the rows. By default dynamo breaks the graph at
such a read ("Data dependent operator", ``aten._local_scalar_dense``): 4 breaks in a 2-layer MoE.
With ``capture_scalar_outputs`` it traces the values as size symbols instead (the loop checks
them as sizes that sum to the rows, and branches on none), and the layer is one graph, as it is
under ``fullgraph=True``. A read that a graph cannot carry (a branch on the value) still breaks
the graph where it is, as before; nothing else changes.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtune import training


def compile_layers(model: nn.Module, verbose: bool = True) -> None:
    """torchtune's ``compile_model`` on ``model`` (each transformer layer compiled in place),
    host reads of sizes traced into the graphs ([host-read sizes under compile]); the setting
    is dynamo's, so it holds for the rest of the process, as compiling does."""
    torch._dynamo.config.capture_scalar_outputs = True
    training.compile_model(model, verbose=verbose)
