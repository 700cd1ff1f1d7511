"""Long run: many CPU training steps with tier nvme (and OffloadAdamW on NVMe when available);
RSS, open file descriptors, threads, swap bytes and pool use must stay flat.

    python benches/python/long_run.py [--steps 1000] [--every 50]

Tolerances (checked at the end, exit 1 if broken): after a warm-up of `--every` steps, RSS
grows by less than 5% (and less than 64 MiB); fds and threads do not change; pool bytes in use
between steps are 0, and so are swap bytes beyond OffloadAdamW's state (which lives in the same
swap: one engine and one set of files per process).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
import time

import psutil
import torch

import spillover
from spillover.models import GPT, GPTConfig, synthetic_batch


def sample(ctx) -> dict:
    gc.collect()
    ctx.synchronize()
    st = ctx.stats()
    p = psutil.Process()
    return {
        "rss": p.memory_info().rss,
        "fds": len(os.listdir(f"/proc/{os.getpid()}/fd")),
        "threads": threading.active_count(),
        "os_threads": p.num_threads(),
        "swap": st.swap_in_use,
        "pool": st.pool_in_use,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--optimizer", choices=["offload", "torch"], default="offload")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq=64)
    model = GPT(cfg)
    batch = synthetic_batch(cfg, 4)
    swapdir = tempfile.mkdtemp(prefix="spillover-long-")
    kw = dict(nvme_path=swapdir, host_pool_bytes=(1 << 20) + 65536, min_offload_bytes=0)
    opt_name = "torch.optim.AdamW"
    held = 0  # swap bytes the optimizer's state holds for good
    if args.optimizer == "offload" and hasattr(spillover, "OffloadAdamW"):
        opt = spillover.OffloadAdamW(model.parameters(), lr=1e-3, tier="nvme", nvme_path=swapdir)
        opt_name = "OffloadAdamW(tier='nvme')"
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print(f"{args.steps} steps, tier nvme, {opt_name}, swap dir {swapdir}", flush=True)
    samples = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        ctx = spillover.offload_context("nvme", **kw)
        with ctx:
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        if step == 1 and opt_name != "torch.optim.AdamW":
            held = opt._swap.stats()["swap_in_use"]  # its state is made at the first step
        if step % args.every == 0 or step == 1:
            s = sample(ctx)
            samples.append((step, s))
            print(f"  step {step:5d}  {ctx.stats().bytes_offloaded_nvme >> 10:6d} KiB to "
                  f"NVMe  rss {s['rss'] >> 20} MiB  fds {s['fds']}  threads {s['os_threads']}  "
                  f"swap {s['swap']}  pool {s['pool']}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    warm = [s for st, s in samples if st >= args.every]
    first, last = warm[0], warm[-1]
    growth = last["rss"] - first["rss"]
    checks = {
        "rss growth < 5% and < 64 MiB": growth < 0.05 * first["rss"] and growth < 64 << 20,
        "fds flat": all(s["fds"] == first["fds"] for s in warm),
        "threads flat": all(s["os_threads"] == first["os_threads"] for s in warm),
        "swap in use 0 (beyond the optimizer's state)": all(
            s["swap"] == held for _, s in samples
        ),
        "pool in use 0": all(s["pool"] == 0 for _, s in samples),
    }
    print(f"\nstart (step {args.every}): rss {first['rss'] >> 20} MiB, fds {first['fds']}, "
          f"threads {first['os_threads']}; end (step {samples[-1][0]}): rss {last['rss'] >> 20} "
          f"MiB, fds {last['fds']}, threads {last['os_threads']}; swap peak "
          f"{spillover._tiers.opened_swap(ctx.config).stats()['swap_peak'] >> 10} KiB")
    for name, ok in checks.items():
        print(f"  {'✓' if ok else '✗'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
