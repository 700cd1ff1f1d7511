"""What an estimate is checked against on a CPU: the peak of a step's live tensor storages,
from the CPU allocator's own events (``torch.profiler`` with ``profile_memory=True``: every
allocation and free, kernels' scratch included), over what the step started with.

Shared by tests/python/test_estimate.py and test_estimate_seed.py,
benches/python/estimate_accuracy.py and the GPU probe's dry run (benches/gpu/estimate_check.py).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, List, Tuple

import torch

from .._peak import memory_events, peak_of

__all__ = ["storages_bytes", "allocator_events", "peak_of"]


def storages_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages of ``tensors`` (views of one storage counted once;
    anything not a tensor skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def allocator_events(fn: Callable[[], Any]) -> List[Tuple[int, int]]:
    """Run ``fn`` under the profiler; the CPU allocator's events, (wall-clock ns, bytes: + for
    an allocation, - for a free), in time order. The profiler's own warnings are silenced; a
    planner's profiler left running is stopped first (Note [a stale profiler] in _peak.py)."""
    from torch.profiler import ProfilerActivity, profile

    from .._peak import stop_stale

    stop_stale()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    return memory_events(prof)


def step_peak(mode: str, model: torch.nn.Module, args: Tuple[Any, ...], kwargs: dict,
              swapdir: str, pool_bytes: int) -> int:
    """The device peak of one real training step of ``model(*args, **kwargs)`` in ``mode``
    (``none``, ``full``, ``selective``, ``host``: wrap's policy, and for ``host`` an offload
    context of ``pool_bytes`` with its swap files in ``swapdir``), AdamW's state made by a
    warm-up step first, as the estimate counts it: on a GPU ``max_memory_allocated`` over the
    step; on a CPU what the step starts with (parameters, buffers, inputs, AdamW's state, the
    pool) plus the most the allocator's events add over that."""
    import contextlib
    import gc

    import spillover

    from .fakes import pick_loss

    model.train()
    ctx = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode in ("full", "selective"):
            spillover.wrap(model, policy=mode)
        elif mode == "host":
            spillover.wrap(model, policy="offload")
            ctx = spillover.offload_context("host", host_pool_bytes=pool_bytes,
                                            nvme_path=swapdir)
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = pick_loss(model(*args, **kwargs))
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state, the pool; selective's regions learn
    gc.collect()
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    start = storages_bytes(list(model.parameters()) + list(model.buffers()) + list(args)
                           + list(kwargs.values())
                           + [v for s in opt.state.values() for v in s.values()])
    if ctx is not None:
        start += ctx.stats().pool_capacity
    return start + peak_of(allocator_events(step))
