"""Which attention kernels a run may use: cuDNN's fused attention is off unless asked for.

Note [cuDNN attention and variable shapes]
``F.scaled_dot_product_attention`` picks a backend per call among cuDNN's fused attention,
flash attention, memory-efficient attention and the math fallback; on an H100 with torch 2.11
cuDNN's is chosen first. cuDNN builds an execution plan for each new input shape, and that
costs about 100 ms (tiny-model probe: 117.8 ms a call at a new length, 0.38 ms without cuDNN's
kernel; docs/gpu_report.md). Fine-tuning data of variable length changes shape at almost every
micro-batch: padded batches take their longest sample's length, ``by_length`` and
``token_budget`` cut windows by length. Measured on a Llama-3.2-1B-shaped model over the bundled
data (benchmarks/gpu_1b_variable_length.py, docs/gpu_report_round_two.md): 1,743 ms per step for
stock torchtune with cuDNN's attention, 781 ms without; the same 2.2-2.4x for every
micro-batching mode. So exactga's recipes switch it off by default (``cudnn_attention: False``)
and flash attention runs instead, bit for bit as it would without cuDNN installed. Data of one
fixed shape (packed, ``dataset.packed: True``) pays the plan once; there cuDNN's kernel may be
the faster one, and ``cudnn_attention: True`` gives it back.
"""

from __future__ import annotations

import torch


def choose_attention_kernels(cudnn_attention: bool, device: torch.device) -> str:
    """Allow or forbid cuDNN's fused attention for this process (the config's
    ``cudnn_attention``; see [cuDNN attention and variable shapes]) and say so, for the
    recipe's start-up log. A no-op in effect on CPU, where only the other kernels exist."""
    torch.backends.cuda.enable_cudnn_sdp(bool(cudnn_attention))
    if device.type != "cuda":
        return "attention: torch's CPU kernels"
    if cudnn_attention:
        return "attention: cuDNN's fused kernel allowed (cudnn_attention: True)"
    return (
        "attention: cuDNN's fused kernel off (cudnn_attention: False; it re-plans for every new "
        "sequence length), flash or memory-efficient kernels instead"
    )
