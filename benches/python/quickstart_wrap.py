"""The README's Quick start as users write it -- ``spillover.wrap(model)`` (policy "selective")
and a new ``offload_context()`` around every step, defaults -- beside a tuned setup (one host
context kept for the run), auto without a budget under the same new context per step, and the
baselines of the same run: no checkpointing and full recomputation without a context (torch's
checkpoint on every block, through ``wrap(policy="full")``). Modes are interleaved round by
round; each prints its median step time with the spread, its ratio to none's, and the peak of
one whole step (forward and backward: the live tensor storages from the CPU allocator's
events, plus the context's pool, which is this host's memory, counted in full). The process
keeps one pool across contexts, so each mode's peak is measured in a process of its own, after
the same warm-up steps.

    python benches/python/quickstart_wrap.py [--attn explicit|sdpa] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

import spillover
from spillover.estimate.measured import allocator_events, peak_of
from spillover.models import GPT, GPTConfig, synthetic_batch


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attn", default="explicit", choices=["explicit", "sdpa"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--peak-of", default=None, help=argparse.SUPPRESS)  # one mode's process
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, d_model=args.d, n_heads=4, n_layers=args.layers,
                    seq=args.seq, attn=args.attn)
    base = GPT(cfg)
    batch = synthetic_batch(cfg, batch=args.batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {
            "none": base,
            "full, no context": spillover.wrap(copy.deepcopy(base), policy="full"),
            "quick start": spillover.wrap(copy.deepcopy(base)),
            "tuned": spillover.wrap(copy.deepcopy(base)),
            "auto, no budget": spillover.wrap(copy.deepcopy(base), policy="auto"),
        }
    kept = spillover.offload_context("host")  # the tuned setup's one context for the run
    contexts: Dict[str, Callable[[], Any]] = {
        "quick start": spillover.offload_context,
        "tuned": lambda: kept,
        "auto, no budget": spillover.offload_context,
    }
    pools: Dict[str, int] = {}

    def step(name: str) -> float:
        model = models[name]
        model.zero_grad(set_to_none=True)
        make = contexts.get(name)
        t0 = time.perf_counter()
        if make is None:
            model(*batch).backward()
        else:
            ctx = make()
            with ctx:
                loss = model(*batch)
            loss.backward()
            pools[name] = ctx.stats().pool_capacity
        return time.perf_counter() - t0

    if args.peak_of is not None:
        for _ in range(6):  # the timed run's warm-up and rounds
            step(args.peak_of)
        gc.collect()
        peak = peak_of(allocator_events(lambda: step(args.peak_of)))
        print(peak + pools.get(args.peak_of, 0), pools.get(args.peak_of, 0))
        return 0
    for _ in range(3):  # warm-up: selective's refinement, auto's learning and tuning
        for name in models:
            step(name)
    times: Dict[str, List[float]] = {k: [] for k in models}
    for _ in range(args.rounds):
        for name in models:
            times[name].append(step(name))
    peaks = {}
    for name in models:  # Note in the docstring: a process of its own per mode
        out = subprocess.run([sys.executable, __file__, "--peak-of", name, *(argv or sys.argv[1:])],
                             capture_output=True, text=True, check=True).stdout.split()
        peaks[name], pools[name] = int(out[-2]), int(out[-1])
    t_none, p_none = statistics.median(times["none"]), peaks["none"]
    print(f"GPT {args.layers}x{args.d}, seq {args.seq}, batch {args.batch}, vocab {args.vocab}, "
          f"{args.attn}; torch {torch.__version__}; medians of {args.rounds} interleaved rounds")
    print(f"{'mode':18} {'step s':>7} {'spread':>16} {'x none':>7} {'peak MiB':>9} "
          f"{'x none':>7} {'pool MiB':>9}")
    for name in models:
        t = times[name]
        print(f"{name:18} {statistics.median(t):7.3f} [{min(t):6.3f}, {max(t):6.3f}] "
              f"{statistics.median(t) / t_none:7.2f} {peaks[name] / 2**20:9.1f} "
              f"{peaks[name] / p_none:7.2f} {pools.get(name, 0) / 2**20:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
