"""What the verify mode costs (Note [verify on the device] in spillover/activations/verify.py):
the CPU GPT of recompute_bench.py (its default shape, both attention kinds optional) under
``offload_context`` on the host and NVMe tiers, on plain CPU tensors (the tier's crc32c of the
host bytes) and on the simulated device (the device checksums too), verify off against on,
interleaved round by round in one process; step seconds, medians with the spread.

    python benches/python/verify_cost.py [--attn sdpa] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

import spillover
from spillover.models import GPT, GPTConfig, synthetic_batch


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "explicit"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sim-bandwidth", type=float, default=8e9)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cfg = GPTConfig(vocab=8192, d_model=args.d_model, n_heads=8, n_layers=args.layers,
                    seq=args.seq, attn=args.attn)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = synthetic_batch(cfg, batch=args.batch)
    swap = tempfile.mkdtemp(prefix="verify-cost-")
    ctxs: Dict[str, Any] = {}
    for tier in ("host", "nvme"):
        for link in ("cpu", "sim"):
            for verify in (False, True):
                kw: Dict[str, Any] = dict(min_offload_bytes=1 << 20, verify=verify)
                kw["host_pool_bytes"] = "1GiB" if tier == "host" else "64MiB"
                if tier == "nvme":
                    kw["nvme_path"] = swap
                if link == "sim":
                    kw["sim_link_bandwidth"] = args.sim_bandwidth
                ctxs[f"{tier}/{link}/{'on' if verify else 'off'}"] = spillover.offload_context(
                    tier, **kw)
    times: Dict[str, List[float]] = {k: [] for k in ctxs}
    for r in range(args.rounds + 1):
        for k, ctx in ctxs.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with ctx:
                loss = model(idx, tgt)
            loss.backward()
            if r:
                times[k].append(time.perf_counter() - t0)
        print(f"round {r} done", file=sys.stderr, flush=True)
    print(f"verify mode's cost: GPT {cfg.n_layers}x{cfg.d_model}, seq {cfg.seq}, batch "
          f"{args.batch}, {args.attn}; {args.rounds} interleaved rounds, medians [min, max]")
    rows = []
    for tier in ("host", "nvme"):
        for link in ("cpu", "sim"):
            off, on = times[f"{tier}/{link}/off"], times[f"{tier}/{link}/on"]
            mo, mn = statistics.median(off), statistics.median(on)
            rows.append({"tier": tier, "link": link, "off_s": mo, "on_s": mn, "ratio": mn / mo,
                         "off_spread": (min(off), max(off)), "on_spread": (min(on), max(on))})
            print(f"  {tier:<5} {link:<4} off {mo:.3f} s [{min(off):.3f}, {max(off):.3f}]  "
                  f"on {mn:.3f} s [{min(on):.3f}, {max(on):.3f}]  {mn / mo:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
