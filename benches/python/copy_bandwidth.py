"""Copy bandwidth into a leased pool block vs single-thread memcpy, measured in the same run.

    python benches/python/copy_bandwidth.py [--mib 256] [--rounds 7]

Prints GB/s (medians over interleaved rounds) for:
  memcpy       libc memmove between two pre-faulted buffers (the roofline for one thread)
  pool copy    Block.copy_from from a torch tensor into a leased block (what pack does on CPU)
  torch fresh  src.clone() into freshly allocated memory (what save_on_cpu-style copies pay)
and the ratio pool copy / memcpy (target >= 0.9).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from spillover import _native


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n = args.mib << 20
    torch.set_num_threads(1)
    pool = _native.Pool(n + (64 << 20), lock=False)
    block = pool.lease(n)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8)
    dst.fill_(1)  # pre-fault
    memmove = ctypes.memmove
    res = {"memcpy": [], "pool copy": [], "torch fresh": []}
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        memmove(dst.data_ptr(), src.data_ptr(), n)
        res["memcpy"].append(gbps(n, time.perf_counter() - t0))
        t0 = time.perf_counter()
        block.copy_from(src.data_ptr(), n)
        res["pool copy"].append(gbps(n, time.perf_counter() - t0))
        t0 = time.perf_counter()
        c = src.clone()
        res["torch fresh"].append(gbps(n, time.perf_counter() - t0))
        del c
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"copy of {args.mib} MiB, {args.rounds} interleaved rounds, medians:")
    for k, v in med.items():
        print(f"  {k:<12} {v:6.2f} GB/s   x memcpy {v / med['memcpy']:.2f}")
    print(f"pool copy / memcpy = {med['pool copy'] / med['memcpy']:.2f} (target >= 0.90)")


if __name__ == "__main__":
    main()
