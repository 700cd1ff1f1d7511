"""The Quick start's loop timed beside a tuned setup and torch's own offload, on this host:
what users write -- a new ``offload_context()`` around every step, the defaults (tier auto,
the default pool) -- against one context kept for the run over a pool preset to the step's
size (tier host), torch's ``save_on_cpu`` and no offload at all. Modes are interleaved round
by round; each prints its median step time with the spread (min-max) over the rounds, its
ratio to none's median, and per step the bytes the context wrote to the drive and the pool
maps (from the third step on the Quick start's loop must map nothing and, with RAM to spare,
write nothing: Note [RAM before the drive] in spillover/_growth.py).

    python benches/python/quickstart_time.py [--rounds 5] [--layers 4] [--d 256] [--seq 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch

import spillover
from spillover.models import GPT, GPTConfig, synthetic_batch

MODES = ("none", "torch save_on_cpu", "quick start", "tuned")


def step(model: torch.nn.Module, batch: Any, wrap: Callable[[], Any]) -> None:
    model.zero_grad(set_to_none=True)
    idx, tgt = batch
    with wrap():
        loss = model(idx, tgt)
    loss.backward()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=a.vocab, d_model=a.d, n_heads=max(1, a.d // 64), n_layers=a.layers,
                    seq=a.seq)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=a.batch)
    swap = tempfile.TemporaryDirectory(prefix="spillover-qs-")
    spillover.empty_cache()

    # the tuned setup's pool: what one step offloads, measured once
    probe = spillover.offload_context("host")
    step(model, batch, lambda p=probe: p)
    need = probe.stats().bytes_offloaded
    probe = None
    spillover.empty_cache()
    tuned = spillover.offload_context("host", host_pool_bytes=max(need * 5 // 4, 64 << 20))
    contexts: List[Any] = []

    def quick_start() -> Any:
        ctx = spillover.offload_context(nvme_path=swap.name)  # tier auto, default pool
        contexts.append(ctx)
        return ctx

    wraps: Dict[str, Callable[[], Any]] = {
        "none": lambda: torch.enable_grad(),
        "torch save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=False),
        "quick start": quick_start,
        "tuned": lambda: tuned,
    }
    times: Dict[str, List[float]] = {m: [] for m in MODES}
    for m in MODES:  # one step each before timing (the first pools, the first allocations)
        step(model, batch, wraps[m])
    qs_rows = []
    for r in range(a.rounds):
        for m in MODES:
            t0 = time.perf_counter()
            step(model, batch, wraps[m])
            times[m].append(time.perf_counter() - t0)
            if m == "quick start":
                s = contexts[-1].stats()
                qs_rows.append((s.bytes_offloaded_nvme, s.pool_maps, s.pool_capacity))
                contexts.clear()
        print(f"round {r + 1}: " + ", ".join(f"{m} {times[m][-1]:.3f} s" for m in MODES),
              flush=True)
    none = statistics.median(times["none"])
    print()
    print(f"GPT {a.layers}x{a.d}, seq {a.seq}, batch {a.batch}, vocab {a.vocab}, fp32, "
          f"{torch.get_num_threads()} threads; the tuned pool {need * 5 // 4 >> 20} MiB "
          f"(one step offloads {need >> 20} MiB); {a.rounds} interleaved rounds")
    print("| mode | median s | spread s | x none |")
    print("|---|---|---|---|")
    for m in MODES:
        med = statistics.median(times[m])
        print(f"| {m} | {med:.3f} | {min(times[m]):.3f}-{max(times[m]):.3f} | "
              f"{med / none:.2f}x |")
    print()
    print("quick start, per timed step: drive bytes written, pool maps, pool MiB: "
          + "; ".join(f"{w} {mp} {c >> 20}" for w, mp, c in qs_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
