"""Counts torch.distributed collectives per optimizer step in a recipe launched by a test.

Put this folder on ``PYTHONPATH`` and set ``EXACTGA_COUNT_COLLECTIVES_DIR``: every interpreter
started under it (the ``tune run`` workers) wraps ``dist.all_reduce`` and FSDP2's reduce-scatter
entry points, closes an interval at each optimizer step (a global step post-hook) and writes
``rank<RANK>.json`` when the run ends its default process group (or at exit): one dict of
counts per optimizer step. A run forked by tests/launcher.py imports this module afresh with
its own variable (the launcher runs a ``sitecustomize`` found on the run's ``PYTHONPATH``), so
each run writes its counts to its own folder. Without the variable at start this module does
nothing and imports nothing. Tests only; recipes never see it.
"""

import os

_OUT = os.environ.get("EXACTGA_COUNT_COLLECTIVES_DIR")

if _OUT:
    import atexit
    import collections
    import json

    import torch
    import torch.distributed as dist

    _current = collections.Counter()
    _steps = []

    def _wrap(name, classify):
        original = getattr(dist, name, None)
        if original is None:
            return

        def counting(*args, **kwargs):
            _current[classify(*args, **kwargs)] += 1
            return original(*args, **kwargs)

        setattr(dist, name, counting)

    def _all_reduce_kind(tensor, *args, **kwargs):
        # The window token count is the only int64 all-reduce of a step, the non-finite-loss
        # flag the only uint8 one.
        if tensor.dtype == torch.int64:
            return "token_count"
        return "finite_flag" if tensor.dtype == torch.uint8 else "all_reduce_other"

    _wrap("all_reduce", _all_reduce_kind)
    _wrap("reduce_scatter_single", lambda *a, **k: "reduce_scatter")
    _wrap("reduce_scatter_tensor", lambda *a, **k: "reduce_scatter")

    def _close_step(optimizer, args, kwargs):
        _steps.append(dict(_current))
        _current.clear()

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_close_step)

    def _write():
        rank = os.environ.get("RANK")
        out = os.environ.get("EXACTGA_COUNT_COLLECTIVES_DIR", _OUT)
        if rank is not None and _steps:
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                json.dump(_steps, f)
        _steps.clear()
        _current.clear()

    _destroy = dist.destroy_process_group

    def _destroy_and_write(group=None):
        if group is None:  # the run's default group: the run is over
            _write()
        return _destroy(group)

    dist.destroy_process_group = _destroy_and_write
    atexit.register(_write)
