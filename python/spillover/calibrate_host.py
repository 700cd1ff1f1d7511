"""The host's costs a calibration measures (:mod:`spillover.calibrate` calls these): the host
time one offloaded tensor costs, one op of a ``spillover.wrap`` region, and on CUDA one op of an
eager forward (Note [host cost in the plan] in planner/cost.py; Note [two clocks in the plan] in
planner/machine.py)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def host_cost_times(device: torch.device, n: int, rounds: int) -> Dict[str, float]:
    """Medians of ``rounds`` interleaved rounds (after one warm-up) of a chain of ``n`` ops on a
    4 KiB tensor, forward + backward: run plainly ("plain"), under a host offload context saving
    every tensor ("offloaded"), and as a full checkpoint region ("wrapped"), in seconds. Run it
    on a thread of its own (:func:`on_own_thread`) to keep the caller's step out of it."""
    from .activations import offload_context
    from .recompute.region import checkpoint

    x = torch.randn(1024, device=device, requires_grad=True)  # 4 KiB: its copy is nothing
    ctx = offload_context("host", min_offload_bytes=0, host_pool_bytes=64 << 20)
    sync = _sync_for(device)

    def chain(h: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            h = h.sin()
        return h

    def plain() -> None:
        chain(x).sum().backward()

    def offloaded() -> None:
        with ctx:
            y = chain(x).sum()
        y.backward()

    def wrapped() -> None:
        checkpoint(chain, x, policy="full").sum().backward()

    fns = {"plain": plain, "offloaded": offloaded, "wrapped": wrapped}
    times: Dict[str, List[float]] = {k: [] for k in fns}
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for r in range(rounds + 1):
            for k, fn in fns.items():
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                if r:
                    times[k].append(time.perf_counter() - t0)
                x.grad = None
    return {k: statistics.median(v) for k, v in times.items()}


def _host_costs(device: torch.device, quick: bool) -> Dict[str, float]:
    """Note [host cost in the plan]: host seconds per offloaded tensor and per op in a wrapped
    region, medians of interleaved rounds against the same work without spillover; on CUDA
    also the forward's dispatch per op (``host_seconds_per_forward_op``)."""
    n = 50 if quick else 200
    t = host_cost_times(device, n, 3 if quick else 5)
    per_offload = max(0.0, (t["offloaded"] - t["plain"]) / n)
    # a full region runs each op twice under its dispatch modes (forward, recompute)
    per_op = max(0.0, (t["wrapped"] - 2 * t["plain"]) / (2 * n))
    out = {"host_seconds_per_offload": per_offload, "host_seconds_per_op": per_op}
    if device.type == "cuda":
        out["host_seconds_per_forward_op"] = forward_dispatch_seconds(device, 3 if quick else 7)
    return out


def forward_dispatch_seconds(device: torch.device, rounds: int) -> float:
    """``host_seconds_per_forward_op``: the host seconds per aten op of a small model's eager
    forward with grad (the built-in GPT, 2 layers, d 64, seq 32: module code and tiny kernels,
    so the host is the bottleneck), the median of ``rounds`` timed forwards after one warm-up,
    over the ops one forward dispatches. The host's clock only: nothing waits for the device
    inside the timed forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from .models import GPT, GPTConfig

    cfg = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq=32)
    model = GPT(cfg).to(device)
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq), device=device)

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            Count.n += 1
            return func(*args, **(kwargs or {}))

    sync = _sync_for(device)
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        with Count():
            model(idx)
        ops = max(1, Count.n)
        times = []
        for r in range(rounds + 1):
            sync()
            t0 = time.perf_counter()
            out = model(idx)
            dt = time.perf_counter() - t0
            del out
            if r:
                times.append(dt)
    sync()
    return statistics.median(times) / ops
