"""What the optimizer benches share (optim_bench.py, optim_lowbit.py, optim_staged.py): the
parameter sizes, parameters with gradients, warm cores, and the interleaved race."""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from typing import Callable, Dict, List

import torch


def sizes(total: int, n: int) -> List[int]:
    """`n` sizes summing to about `total`, varied, none a multiple of 16."""
    base = total // n
    out = []
    for i in range(n):
        s = int(base * (0.5 + (i % 7) / 6.0))
        out.append(s - s % 16 + 3)
    scale = total / sum(out)
    return [max(19, int(s * scale) | 1) for s in out]


def params_like(szs: List[int], dtype: torch.dtype, seed: int) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = []
    for s in szs:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(dtype))
        p.grad = (torch.randn(s, generator=g) * 1e-2).to(dtype)
        ps.append(p)
    return ps


def warm(seconds: float = 0.2) -> None:
    """Keep every core busy for a moment. On this project's VM an idle vCPU comes back slow
    (the kernel that follows an I/O-bound phase ran ~1.5x slower), and in training the step
    follows backward, so both the optimizer and the engine are timed on warm cores."""
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def race_spread(methods: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, List[float]]:
    """Every method twice (warm-up: allocates state, faults pages in), then once per round,
    the rounds cycling through every order, so each method follows each other one equally
    often (what ran just before matters here: foreach leaves freed temporaries behind, and an
    idle core slows down); the times of every round."""
    for f in methods.values():
        f()
        f()
    times: Dict[str, List[float]] = {k: [] for k in methods}
    orders = list(itertools.permutations(methods))
    for r in range(rounds):
        for k in orders[r % len(orders)]:
            gc.collect()
            t0 = time.perf_counter()
            methods[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def race(methods: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, float]:
    """:func:`race_spread`'s medians."""
    return {k: statistics.median(v) for k, v in race_spread(methods, rounds).items()}
