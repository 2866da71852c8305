"""One optimizer step over an accumulation window: the micro-batches' forward, loss, exact scale and
backward, then the gradients finished, clipped and stepped.

What happens inside a step, where a silent divergence would change the numbers, lives here once:
the skipped-window rule, scaling before backward, the step's one finiteness read, and the
optimizer step. The recipes show the loop around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torchtune import utils

from exactga.accumulation.micro_batch_loss import MicroBatchLoss
from exactga.accumulation.normalization import MicroBatch, Window, warn_skipped_step
from exactga.accumulation.optimizers import steps_in_backward
from exactga.accumulation.window_statistics import compute_window_statistics
from exactga.runtime.context_parallel import sharded_micro_batch

T = TypeVar("T")
LossStep = Callable[[dict[str, torch.Tensor]], "MicroBatchLoss | torch.Tensor"]
MicroBatchContext = Callable[[bool], contextlib.AbstractContextManager[Any]]


class StepProfiler(Protocol):
    """What a step asks of the recipe's profiler (``exactga.profiling.TrainingProfiler``)."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]: ...

    def sample_gradient_pass(self, model: nn.Module) -> None: ...


@dataclass(frozen=True)
class StepOutcome:
    """What one window did: skipped (no loss token anywhere, or a non-finite loss), and the
    grad norm if clipped. ``nonfinite`` says a micro-batch loss on some rank was NaN or inf."""

    skipped: bool
    grad_norm: torch.Tensor | None = None
    nonfinite: bool = False


# Note [non-finite loss]
# Each micro-batch's loss is tested with ``isfinite`` on the device and the flags are and-ed
# there, so no micro-batch waits for the host. Once per step, before the optimizer runs, the flag
# is reduced over the data-parallel group (one 1-byte all-reduce; every rank must take the same
# decision or their weights would part) and read on the host: one sync per step, where the
# optimizer step would have to wait for backward anyway. A non-finite step never reaches the
# optimizer: its gradients are dropped, so the weights stay finite. With ``clip_grad_norm``
# set, a non-finite gradient norm (a finite loss whose backward overflowed) counts as well; it
# is read in the same host read (without clipping there is no norm to test short of a pass over
# the gradients, which is what we avoid). ``skip`` warns, counts it in ``nonfinite_steps`` and
# goes on with the next window; ``stop`` saves a step checkpoint of the
# weights before that step (its data-loader position is after the bad window, so resuming goes
# on with the next one) and raises. With ``optimizer_in_bwd`` the optimizer has already stepped
# inside backward, so the run always stops, pointing to the last step checkpoint (see
# [optimizer in backward] in exactga.accumulation.optimizers).


@dataclass(frozen=True)
class StepContext:
    """How this rank runs a window's micro-batches; set once by a recipe, the same every step.

    Args:
        model: the model whose gradients accumulate.
        device: where micro-batches go.
        profiler: the recipe's profiler hook (phases, the saved-latency sample).
        micro_batch_context: called with "is this the window's last micro-batch" around each
            micro-batch's forward and backward (the distributed recipes' gradient-sync policy,
            ``exactga.runtime.distributed.gradient_sync``), or ``None``.
        announce_skip: warn about a skipped window here (rank 0 only, under data parallelism).
        cp_mesh: the context-parallel mesh each micro-batch's sequences are sharded over
            around its forward and backward (``exactga.runtime.context_parallel``), or ``None``.
    """

    model: nn.Module
    device: torch.device
    profiler: StepProfiler
    micro_batch_context: MicroBatchContext | None = None
    announce_skip: bool = True
    cp_mesh: DeviceMesh | None = None


Clip = Callable[[Iterator[nn.Parameter]], "torch.Tensor | None"]


class TrainingWindow:
    """One optimizer step as a recipe's loop runs it::

        for batch in window:          # this rank's micro-batches, on the device
            loss = loss_step(batch)   # a MicroBatchLoss: the mean over the micro-batch's units
            window.backward(loss)     # scaled by its exact share of the window, then backward
        outcome = window.step(optimizer, clip_grad_norm=max_norm)

    Iterating yields each micro-batch's batch dict, moved to the device, in the forward phase
    and inside the gradient-sync context; under data parallelism that includes the empty
    micro-batches every rank must run (see [empty micro-batches under FSDP]) and yields nothing
    when no rank has a loss unit (see [empty windows]). :meth:`backward` must follow each
    forward, and :meth:`step` the last micro-batch. What the window counted (units, loss,
    work) is read through to the ``Window`` it runs, so a ``TrainingWindow`` goes wherever a
    ``Window`` does (``StepBook.end_step``, a recipe's own metrics).
    """

    def __init__(self, window: Window, context: StepContext, step: int) -> None:
        self.window = window
        self.context = context
        self.step_number = step  # the optimizer step this window makes, for the skip warning
        self._current: MicroBatch | None = None  # yielded, waiting for its backward
        self._forward_phase = contextlib.ExitStack()
        self._finite: torch.Tensor | None = None
        self._ran_all = False

    def __getattr__(self, name: str) -> Any:  # what the window counted: see the docstring
        if name == "window":  # not set yet (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.window, name)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        context = self.context
        if self.window.should_skip_step():  # the same answer on every rank; see [empty windows]
            self._ran_all = True
            return
        if self.window.statistics:  # before the first backward: see [window statistics]
            with context.profiler.phase("forward"):
                compute_window_statistics(self.window, self.window.statistics, context.device)
        micro_batches = _with_last_flag(self.window.micro_batches_to_run())
        for micro_batch, is_last in micro_batches:
            sync = context.micro_batch_context
            with sync(is_last) if sync else contextlib.nullcontext():
                try:
                    self._forward_phase.enter_context(context.profiler.phase("forward"))
                    utils.batch_to_device(micro_batch.batch, context.device)
                    with sharded_micro_batch(context.cp_mesh, micro_batch.batch):
                        self._current = micro_batch
                        yield micro_batch.batch
                finally:
                    self._forward_phase.close()  # a no-op once backward closed it
                if self._current is not None:
                    raise RuntimeError(_ONE_BACKWARD_EACH)
        self._ran_all = True

    def backward(self, loss: MicroBatchLoss | torch.Tensor) -> None:
        """Weigh the current micro-batch's loss by its share of the window over every rank and
        backpropagate it: see [loss scaled before backward], no gradient pass follows.
        ``loss`` is what the loss step returned, a :class:`MicroBatchLoss` (its main term a mean
        over the micro-batch's units, each further term weighed by its own units; see [one
        return type for every loss step]), or a 0-d mean tensor."""
        micro_batch = self._current
        if micro_batch is None:
            raise RuntimeError(_ONE_BACKWARD_EACH)
        if isinstance(loss, MicroBatchLoss):  # the term means in the normaliser's order
            loss = loss.term_means(self.window.term_names)
        self._finite = _and_finite(self._finite, loss)  # on the device; see [non-finite loss]
        self._forward_phase.close()
        with self.context.profiler.phase("backward"):
            self.window.scale(loss, micro_batch).backward()
        self._current = None

    def step(
        self,
        optimizer: Optimizer | None,
        *,
        clip_grad_norm: float | None = None,
        clip: Clip | None = None,
    ) -> StepOutcome:
        """Finish the gradients, clip them, step ``optimizer`` and zero the gradients; the
        step's one host read decides whether every loss was finite (see [non-finite loss]).

        Args:
            optimizer: the recipe's optimizer. An ``OptimizerInBackward`` (``optimizer_in_bwd``)
                has stepped inside backward, so nothing touches the gradients after it;
                ``None`` leaves them to the caller. See [optimizer in backward] in
                ``exactga.accumulation.optimizers``.
            clip_grad_norm: max gradient norm (torch's ``clip_grad_norm_``), or ``None``.
            clip: a clipping of one's own instead, called with the model's parameters once
                their gradients are final; a tensor it returns is checked for finiteness and
                logged as ``grad_norm``.
        """
        if clip_grad_norm is not None and clip is not None:
            raise ValueError("window.step takes clip_grad_norm or clip, not both.")
        if not self._ran_all:
            raise RuntimeError(
                "window.step() before every micro-batch of the window ran: iterate the window "
                "to its end (under data parallelism every rank must run the same micro-batches)."
            )
        if self.window.should_skip_step():
            if self.context.announce_skip:
                warn_skipped_step(self.step_number)
            return StepOutcome(skipped=True)
        window, model, profiler = self.window, self.context.model, self.context.profiler
        if optimizer is None or steps_in_backward(optimizer):  # see [non-finite loss]
            if optimizer is not None:
                optimizer.step()  # a no-op that tells a learning-rate scheduler the step happened
            return StepOutcome(skipped=False, nonfinite=not _all_finite(self._finite, None, window))
        profiler.sample_gradient_pass(model)  # measures only; see [saved latency]
        with profiler.phase("optimizer"):
            window.finish_gradients(model)
            grad_norm = None
            if clip_grad_norm is not None:
                grad_norm = clip_grad_norm_over_meshes(model.parameters(), float(clip_grad_norm))
            elif clip is not None:
                grad_norm = clip(model.parameters())
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
                grad_norm = grad_norm.full_tensor()
            if not _all_finite(self._finite, grad_norm, window):  # see [non-finite loss]
                optimizer.zero_grad(set_to_none=True)
                return StepOutcome(skipped=True, nonfinite=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return StepOutcome(skipped=False, grad_norm=grad_norm)


def clip_grad_norm_over_meshes(parameters: Iterator[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_``, also where the gradients are DTensors of several meshes.

    Under tensor parallelism over data-parallel ranks, the layers the plan shards live on the
    2-D (dp, tp) mesh and the rest (torchtune's Llama plan leaves the norms out) on the dp mesh
    alone; torch's function stacks their norms and refuses ("All operands in aten.stack.default
    must have the same mesh"). Here each mesh's gradients give their full norm, and the total is
    the norm of those, as one norm over every gradient is. One mesh (or none): torch's own.
    """
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    if len(by_mesh) <= 1:
        params = next(iter(by_mesh.values()), [])
        return torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([param.grad for param in params])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in by_mesh.values():  # each mesh's gradients scaled apart: one op per mesh
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


_ONE_BACKWARD_EACH = (
    "window.backward(loss) must follow each micro-batch's forward, once: iterate the window "
    "with `for batch in window: window.backward(loss_step(batch))`."
)


def train_window(
    window: Window,
    *,
    model: nn.Module,
    loss_step: LossStep,
    optimizer: Optimizer | None,
    profiler: StepProfiler,
    device: torch.device,
    step: int,
    clip_grad_norm: float | None = None,
    micro_batch_context: MicroBatchContext | None = None,
    announce_skip: bool = True,
) -> StepOutcome:
    """The recipes' loop in one call, for code that trains windows without showing the step
    (the parity report, tests): every micro-batch through ``loss_step``, then the optimizer
    step. See :class:`TrainingWindow` and :class:`StepContext` for the arguments."""
    context = StepContext(model, device, profiler, micro_batch_context, announce_skip)
    running = TrainingWindow(window, context, step)
    for batch in running:
        running.backward(loss_step(batch))
    return running.step(optimizer, clip_grad_norm=clip_grad_norm)


def _with_last_flag(items: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """Each item with "is it the last one", looking one item ahead (so a lazy iterator is read
    no earlier than needed)."""
    current = next(items, _NONE)
    while current is not _NONE:
        following = next(items, _NONE)
        yield current, following is _NONE  # type: ignore[misc]
        current = following


_NONE: Any = object()


def _and_finite(finite: torch.Tensor | None, loss: torch.Tensor) -> torch.Tensor:
    """``finite and isfinite(loss)``, on the device: no host sync per micro-batch."""
    loss_finite = torch.isfinite(loss.detach()).all()
    return loss_finite if finite is None else finite & loss_finite


def _all_finite(
    finite: torch.Tensor | None, grad_norm: torch.Tensor | None, window: Window
) -> bool:
    """Whether every rank's losses, and the gradient norm if clipping computed one, were
    finite: the step's one flag reduction and one host read."""
    if finite is None:
        return True
    if grad_norm is not None:  # already global under FSDP, so and-ing it in is enough
        finite = finite & torch.isfinite(grad_norm).to(finite.device)
    if window.dp_size > 1:
        flag = finite.to(torch.uint8)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=window.dp_group)
        return bool(flag.item())
    return bool(finite.item())
