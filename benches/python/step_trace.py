"""One process, one GPT step after another under the NVMe tier, with the context's counters per
step: where a step's time goes (forward, backward, waiting) and what went where. Public API
only, so it traces any version of spillover (PYTHONPATH=/other/install python ...).

    python benches/python/step_trace.py [--policy offload|auto] [--pool 64MiB] [--steps 4]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import spillover
from spillover.config import parse_size
from spillover.models import GPT, GPTConfig, synthetic_batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", choices=("offload", "auto"), default="offload")
    ap.add_argument("--pool", default="64MiB")
    ap.add_argument("--budget", default="96.3MiB", help="auto's device budget")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    cfg = GPTConfig(vocab=2048, d_model=512, n_heads=8, n_layers=6, seq=1024)
    torch.manual_seed(0)
    policy = ("offload" if args.policy == "offload"
              else spillover.Planner(budget_bytes=parse_size(args.budget)))
    model = spillover.wrap(GPT(cfg), policy=policy)
    idx, tgt = synthetic_batch(cfg, 4)
    swap_dir = tempfile.mkdtemp(prefix="spillover-trace-")
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        c = spillover.offload_context("nvme", host_pool_bytes=args.pool, nvme_path=swap_dir)
        t0 = time.perf_counter()
        with c:
            loss = model(idx, tgt)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        s = c.stats()
        print(f"fwd {t1 - t0:.2f} bwd {t2 - t1:.2f} stall {s.stall_seconds:.2f} offloaded "
              f"{s.tensors_offloaded} ({s.tensors_chunked} in pieces) nvme "
              f"{s.bytes_offloaded_nvme >> 20} MiB host {s.bytes_offloaded_host >> 20} MiB hits "
              f"{s.prefetch_hits} misses {s.prefetch_misses} overflow {s.overflow_reads}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
