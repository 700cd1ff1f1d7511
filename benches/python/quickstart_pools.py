"""The Quick start's loop -- a new ``offload_context`` every step, the defaults -- and what each
step maps and registers (Note [the pool lives for the process] in spillover/_pools.py): pool
maps, registrations (CUDA's, or the simulated device's), the pool's size and the step's time,
for 10 steps, on the host tier and on the simulated device. From the third step on both counts
must be 0.

    python benches/python/quickstart_pools.py [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import spillover
from spillover import _growth
from spillover.models import GPT, GPTConfig, synthetic_batch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "python"))
from conftest import gpt_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    _growth.FIRST_POOL = 16 << 20  # a first pool the first step must grow past
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=128)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=8)
    for label, kw in [("host tier", {}),
                      ("host tier, simulated device", {"sim_link_bandwidth": 20e9 + 17})]:
        spillover.empty_cache()
        print(f"{label}: step, pool maps, registrations, pool MiB, seconds")
        for i in range(args.steps):
            ctx = spillover.offload_context("host", min_offload_bytes=0, **kw)
            t0 = time.perf_counter()
            gpt_step(model, batch, ctx)
            s = ctx.stats()
            print(f"  {i + 1:2d} {s.pool_maps:2d} {s.pool_registrations:2d} "
                  f"{s.pool_capacity >> 20:6d} {time.perf_counter() - t0:7.3f}")
            del ctx
    return 0


if __name__ == "__main__":
    sys.exit(main())
