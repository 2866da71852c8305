"""The output projection and the cross-entropy computed together, a chunk of rows at a time.

A micro-batch's logits are ``rows x vocab``: with Qwen3's 151,936 or Gemma 3's 262,144 entries
they are the largest tensor of a step, several times a layer's activations, and the present
paths keep them (or their log-softmax, or their chunks) alive from the forward to the backward.
Here the projection and the loss are one autograd function over chunks of rows, so no more than
one chunk's logits exist at any time, in the forward or the backward, and none is kept between.

Note [projection fused with the loss]
The loss of a micro-batch is ``(1/n) sum_i (logsumexp(W h_i) - (W h_i)[t_i])`` over its ``n``
scored rows (``t_i`` not the ignore index), ``h_i`` the final-normed hidden state and ``W`` the
output weight. Rows are independent, so the sum is taken a chunk of rows at a time: the forward
computes a chunk's logits in the compute dtype (bf16 under autocast, as ``nn.Linear`` would),
upcasts them to fp32 for the logsumexp (as the present losses upcast logits), adds the chunk's
summed loss and keeps only each row's logsumexp (fp32, one number a row). The backward recomputes
each chunk's logits (one more projection, the price of not keeping them), forms
``softmax - one_hot`` in fp32, zeroes the ignored rows, and accumulates ``dL/dh = G W`` and
``dL/dW = G^T h`` with ``G`` cast to the compute dtype, ``dL/dW`` summed over chunks in the
weight's dtype (fp32 master weights: fp32; a bf16 weight: bf16, as autograd would sum it).
The same per-token losses are summed over the same tokens and divided by the same count, so the
loss and every gradient equal those of materialised logits and ``F.cross_entropy`` up to float
rounding (tests/test_linear_cross_entropy.py measures it). ``LinearCrossEntropyLoss`` divides by
``max(n, 1)``: a micro-batch without a scored row has loss 0 and zero gradients, not 0/0.

It must run inside the model's forward: under FSDP2 the output weight (or the embedding it is
tied to) is gathered only while its module's forward runs, and the backward of what that forward
returned gathers it again. So ``exactga.accumulation.forward.projecting_into_loss`` shadows the
decoder's ``unembed`` and its projection's ``forward`` for one call: the decoder returns the loss
instead of logits, through the projection module's own hooks (FSDP's gather, activation
offloading's no-op). It fuses a torchtune ``TransformerDecoder`` whose output is a plain
``nn.Linear`` without bias or a ``TiedLinear``, unsharded or sharded by FSDP2 on one data-parallel
mesh dimension. Every other model takes the present path with materialised logits, with no error
and the same loss: a LoRA or DoRA output (``apply_lora_to_output``: the adapter's own matmuls),
an NF4-quantised or QAT-fake-quantised output (their weight is not a plain matrix), a
soft-capped one (a ``TiedLinear`` subclass: the cap acts on the logits), a tensor-parallel output
(its weight stays distributed in the forward), a decoder asked for ``output_hidden_states``, a
decoder class with an ``unembed`` of its own (it may do more than norm and project), and any
model that is not a torchtune decoder.

Why not ``torch.nn.functional.linear_cross_entropy``: torch 2.13 has one; with
``options=LinearCrossEntropyOptions(...)`` it chunks the rows and never makes the whole logits,
on CPU and CUDA. Measured in a decoder step (benchmarks/large_vocab_loss.py, CPU, 4 x 512 tokens,
embed 1,024; docs/large_vocab.md), with ``reduction="none"`` and 8 chunks set by hand it needs
what this function needs in fp32 (peak above the model 1,094 / 2,296 MiB against 1,046 / 2,288
MiB here, Qwen3 / Gemma 3 vocabularies; materialised logits 3,936 / 6,452). It is not the engine:
(1) it exists from torch 2.13 only, and exactga supports torch >= 2.6; (2) it ignores autocast,
so under bf16 autocast over fp32 weights the caller must cast both operands to bf16, and then on
CPU it copies the weight back to fp32 for its products: 3,260 / 5,572 MiB and 2.6-2.7x the
materialised step time, against 2,091 / 3,368 MiB and 1.4x here; (3) its ``mean`` and ``sum``
reductions compute the gradients inside the forward and consume them in the backward (one
backward only), only ``reduction="none"`` recomputes them; (4) its default chunking sizes a
chunk's logits like the input: 8 rows a chunk at 2,048 x 262,144 x 1,024, the whole weight read
256 times a pass (forward and backward of that projection alone, fp32: 462 s against 105 s for
materialised logits, back to back on the same CPU). The function here is plain tensor code
with the present path's dtypes, the same on every supported torch and device.

Not done: computing the gradients in the forward (as torch's ``sum`` and Liger do) would save the
recomputed projection (three products a step instead of four) for the same peak in a
forward-then-backward step, at the price of a one-shot backward; the recompute keeps autograd's
usual contract.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from exactga.accumulation.loss_units import IGNORE_INDEX


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    ignore_index: int = IGNORE_INDEX,
    compiled: bool = False,
) -> torch.Tensor:
    """``sum_i CE(hidden[i] @ weight.T, targets[i])`` over rows whose target is not
    ``ignore_index``, in fp32, computed ``chunk_size`` rows at a time; see [projection fused
    with the loss].

    Args:
        hidden: ``(rows, embed)`` final-normed hidden states.
        weight: ``(vocab, embed)`` output projection weight.
        targets: ``(rows,)`` class indices; ``ignore_index`` rows add nothing, not even a gradient.
        chunk_size: rows a chunk; at most ``chunk_size x vocab`` logits exist at once.
        ignore_index: the target value that is not scored.
        compiled: run each chunk's work through ``torch.compile`` (see [fused loss under
            compile]); the same sums, rounded as inductor's fused kernels round them.

    Returns:
        The summed loss, a 0-dim fp32 tensor (0 when no row is scored). The projection runs in
        the autocast dtype when autocast is on for ``hidden``'s device, else in ``weight``'s.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy takes (rows, embed) hidden states and (rows,) targets, got "
            f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    compute_dtype = _compute_dtype(hidden, weight)
    return _LinearCrossEntropySum.apply(
        hidden, weight, targets, chunk_size, ignore_index, compute_dtype, compiled
    )


class LinearCrossEntropyLoss(nn.Module):
    """Mean token cross-entropy whose projection is fused with the loss; a config's ``loss``.

    ``loss: {_component_: exactga.accumulation.linear_cross_entropy.LinearCrossEntropyLoss}``
    takes the place of torchtune's ``CEWithChunkedOutputLoss`` with the same knob. On a decoder
    it can fuse (see [projection fused with the loss]) the recipe's loss step never makes the
    logits: the decoder returns this loss, computed from its final-normed hidden states and its
    output weight. Elsewhere it is called, like ``CEWithChunkedOutputLoss``, on the logits the
    model returns in ``num_output_chunks`` chunks (``exactga.model_build.trained.build_loss``
    sets the model to chunk them), or on one logits tensor.

    Args:
        num_output_chunks: the fused loss splits a micro-batch's rows into this many chunks;
            the fallback's model splits its logits into as many (torchtune's knob, default 8).
        chunk_size: rows a fused chunk instead, whatever the micro-batch's size: at most
            ``chunk_size x vocab`` fp32 logits exist at once. Default ``None``: by chunks.
        ignore_index: the label value the loss does not score (torchtune's and torch's -100).
    """

    def __init__(
        self,
        num_output_chunks: int = 8,
        chunk_size: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__()
        if num_output_chunks < 1:
            raise ValueError(f"num_output_chunks must be at least 1, got {num_output_chunks}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1 or None, got {chunk_size}")
        self.num_output_chunks = num_output_chunks
        self.chunk_size = chunk_size
        self.ignore_index = ignore_index
        self.compiled = False  # see compile_chunks

    def compile_chunks(self) -> None:
        """Compile the fused path's work on each chunk (``compile: True``; see [fused loss under
        compile]): it runs inside the decoder's forward, which no compiled layer covers."""
        self.compiled = True

    def rows_per_chunk(self, num_rows: int) -> int:
        """The fused loss's chunk for a micro-batch of ``num_rows`` rows."""
        if self.chunk_size is not None:
            return self.chunk_size
        return max(1, math.ceil(num_rows / self.num_output_chunks))

    def from_hidden(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The mean loss of ``(rows, embed)`` final-normed hidden states against ``(rows,)``
        shifted labels, projected by the ``(vocab, embed)`` ``weight`` a chunk at a time."""
        total = linear_cross_entropy(
            hidden,
            weight,
            labels,
            chunk_size=self.rows_per_chunk(hidden.size(0)),
            ignore_index=self.ignore_index,
            compiled=self.compiled,
        )
        return total / self._num_scored(labels)

    def forward(
        self, logits: torch.Tensor | Sequence[torch.Tensor], labels: torch.Tensor
    ) -> torch.Tensor:
        """The mean loss of materialised logits: ``(rows, vocab)`` against ``(rows,)`` labels,
        or chunks of ``(batch, tokens, vocab)`` logits (split along the tokens, as a torchtune
        decoder chunks them) against ``(batch, tokens)`` labels. Each chunk is upcast to fp32 on
        its own, as ``CEWithChunkedOutputLoss`` does."""
        if isinstance(logits, torch.Tensor):
            total = self._summed_ce(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        else:  # chunks of (batch, tokens, vocab): the labels are split as the tokens were
            label_chunks = labels.split([chunk.size(1) for chunk in logits], dim=1)
            total = sum(
                self._summed_ce(chunk.reshape(-1, chunk.size(-1)), chunk_labels.reshape(-1))
                for chunk, chunk_labels in zip(logits, label_chunks, strict=True)
            )
        return total / self._num_scored(labels)

    def extra_repr(self) -> str:
        return (
            f"num_output_chunks={self.num_output_chunks}, chunk_size={self.chunk_size}, "
            f"ignore_index={self.ignore_index}, compiled={self.compiled}"
        )

    def _summed_ce(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.float(), labels, ignore_index=self.ignore_index, reduction="sum"
        )

    def _num_scored(self, labels: torch.Tensor) -> torch.Tensor:
        # At least 1: a micro-batch without a scored token has loss 0, not 0/0 = NaN.
        return (labels != self.ignore_index).sum().clamp(min=1)


def fusable_loss(loss_fn: nn.Module) -> LinearCrossEntropyLoss | None:
    """``loss_fn`` as a :class:`LinearCrossEntropyLoss` if it is one (also when
    ``torch.compile`` wrapped it, as torchtune's ``compile_loss`` does), else ``None``."""
    loss_fn = getattr(loss_fn, "_orig_mod", loss_fn)  # a compiled module's original
    return loss_fn if isinstance(loss_fn, LinearCrossEntropyLoss) else None


# ---------------------------------------------------------------------------------------------
# The autograd function.


class _LinearCrossEntropySum(torch.autograd.Function):
    """The summed loss of [projection fused with the loss]; chunked forward and backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        compute_dtype: torch.dtype,
        compiled: bool,
    ) -> torch.Tensor:
        scored = targets != ignore_index
        safe_targets = targets.masked_fill(~scored, 0)  # any valid index: the row weighs 0
        logsumexp = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        chunk_loss = _compiled(_chunk_loss) if compiled else _chunk_loss
        with _autocast_off(hidden):
            projection = weight.to(compute_dtype)  # one cast a pass, as autocast's F.linear
            for rows in _row_chunks(hidden.size(0), chunk_size):
                logsumexp[rows], loss = chunk_loss(
                    hidden[rows], projection, safe_targets[rows], scored[rows]
                )
                total += loss
        # The weight itself, not its cast: the cast is redone in the backward rather than kept.
        ctx.save_for_backward(hidden, weight, safe_targets, scored, logsumexp)
        ctx.chunk_size = chunk_size
        ctx.compute_dtype = compute_dtype
        ctx.compiled = compiled
        return total

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, safe_targets, scored, logsumexp = ctx.saved_tensors
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        # Summed over chunks in the weight's dtype, as autograd sums a reused weight's gradients:
        # fp32 master weights sum each chunk's bf16 product in fp32; a bf16 weight sums in bf16,
        # in place, as its chunked-logits gradient would (no vocab x embed fp32 buffer).
        grad_weight = torch.zeros_like(weight) if wants_weight else None
        row_weights = scored.to(torch.float32) * grad_total  # ignored rows: exactly 0
        chunk_grad_logits = _compiled(_chunk_grad_logits) if ctx.compiled else _chunk_grad_logits
        with _autocast_off(hidden):
            projection = weight.to(ctx.compute_dtype)
            for rows in _row_chunks(hidden.size(0), ctx.chunk_size):
                inputs = hidden[rows].to(ctx.compute_dtype)
                grad_logits = chunk_grad_logits(
                    inputs, projection, logsumexp[rows], safe_targets[rows], row_weights[rows]
                )
                if grad_hidden is not None:
                    grad_hidden[rows] = grad_logits @ projection
                if grad_weight is not None:
                    _accumulate_product_(grad_weight, grad_logits.T, inputs)
                del grad_logits  # before the next chunk's: one chunk's logits at a time
        return grad_hidden, grad_weight, None, None, None, None, None


# Note [fused loss under compile]
# The fused loss runs inside the decoder's forward (exactga.accumulation.forward), which
# ``compile: True`` does not compile: torchtune compiles each layer, and ``compile_loss`` the
# loss module's ``forward``, which the fused path never calls. So a compiled run would leave
# each chunk's dozen eager kernels as they are (logits' cast, maximum, exp, sum, log, gather,
# the masked sum; in the backward the softmax, the one-hot, the row weights, the cast). With
# ``compile_chunks`` each chunk's work, the products aside, is a compiled function of its own
# (``dynamic=True``: a micro-batch's scored rows, and so its chunks, change in size from one
# micro-batch to the next, which would otherwise recompile). The chunk loop and what is kept
# for the backward stay as they are, so no more than a chunk's logits (in inductor's buffers
# now) exist at once; the sums are the same sums, rounded as inductor's fused reductions round
# them (tests/test_linear_cross_entropy.py).


def _compiled(chunk_function: Callable) -> Callable:
    # The backend as torchtune's compile_model and compile_loss choose it.
    return _compiled_with(chunk_function, os.environ.get("TORCH_COMPILE_BACKEND", "inductor"))


@functools.cache
def _compiled_with(chunk_function: Callable, backend: str) -> Callable:
    return torch.compile(chunk_function, dynamic=True, backend=backend)


def _chunk_loss(
    hidden: torch.Tensor, projection: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's rows' logsumexp (fp32) and its scored rows' summed loss."""
    logits = _chunk_logits(hidden, projection)
    target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    logsumexp = _logsumexp_(logits)  # overwrites logits, no copy of them
    return logsumexp, torch.where(scored, logsumexp - target_logits, 0.0).sum()


def _chunk_grad_logits(
    inputs: torch.Tensor,
    projection: torch.Tensor,
    logsumexp: torch.Tensor,
    targets: torch.Tensor,
    row_weights: torch.Tensor,
) -> torch.Tensor:
    """A chunk's gradient with respect to its logits, in the projection's dtype: the logits
    recomputed (kept nowhere), ``softmax - one_hot`` in fp32, times each row's weight."""
    grad_logits = _chunk_logits(inputs, projection)
    _softmax_minus_one_hot_(grad_logits, logsumexp, targets)
    return grad_logits.mul_(row_weights.unsqueeze(1)).to(projection.dtype)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """What ``F.linear(hidden, weight)`` would multiply in: autocast's dtype where it is on."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _autocast_off(tensor: torch.Tensor) -> torch.autocast:
    # The function casts explicitly; autocast would recast the fp32 softmax's matmul operands.
    return torch.autocast(device_type=tensor.device.type, enabled=False)


def _row_chunks(num_rows: int, chunk_size: int) -> Iterator[slice]:
    for start in range(0, num_rows, chunk_size):
        yield slice(start, min(start + chunk_size, num_rows))


def _chunk_logits(hidden: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """A chunk's logits: the product in ``projection``'s dtype, then fp32 (a new tensor the
    caller may overwrite: the product is fresh, and ``float()`` of fp32 returns it as is)."""
    return (hidden.to(projection.dtype) @ projection.T).float()


def _accumulate_product_(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``total += left @ right``: in place when the dtypes agree, so no ``vocab x embed``
    product is made; otherwise through one product in the operands' (lower) dtype."""
    if left.dtype == total.dtype:
        total.addmm_(left, right)
    else:
        total.add_(left @ right)


def _logsumexp_(logits: torch.Tensor) -> torch.Tensor:
    """Each row's logsumexp; ``logits`` is left holding ``exp(logits - max)``."""
    row_max = logits.amax(dim=1, keepdim=True)
    # A row of -inf (impossible from a finite matmul) would give NaN here, as in F.cross_entropy.
    sum_exp = logits.sub_(row_max).exp_().sum(dim=1)
    return sum_exp.log_().add_(row_max.squeeze(1))


def _softmax_minus_one_hot_(
    logits: torch.Tensor, logsumexp: torch.Tensor, targets: torch.Tensor
) -> None:
    """``logits`` becomes ``softmax(logits) - one_hot(targets)``, in place: the gradient of
    each row's cross-entropy with respect to its logits."""
    logits.sub_(logsumexp.unsqueeze(1)).exp_()
    minus_one = torch.full((targets.numel(), 1), -1.0, dtype=logits.dtype, device=logits.device)
    logits.scatter_add_(1, targets.unsqueeze(1), minus_one)
