"""Where backward waits for the tier: per saved storage size, how many storages were brought
back, the seconds unpack spent bringing them (reads not yet landed, gathering pieces), and how
many took over 5 ms. The built-in GPT under ``wrap(policy="offload")`` and an NVMe context, a few
steps in one process (the first one teaches the tier the unpack order, Note [expected order]).

    python benches/python/backward_waits.py --attn explicit --pool 64MiB --steps 3

A diagnostic, not a ratio: recompute_bench.py measures the step against its baselines.
"""

from __future__ import annotations

import argparse
import collections
import gc
import tempfile
import time

import torch

import spillover
from spillover.activations import unpack as _unpack
from spillover.models import ATTENTION_KINDS, GPT, GPTConfig, synthetic_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attn", choices=ATTENTION_KINDS, default="explicit")
    ap.add_argument("--pool", default="64MiB", help="host pool of the NVMe context")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    cfg = GPTConfig(vocab=args.vocab, d_model=args.d_model, n_heads=8, n_layers=args.layers,
                    seq=args.seq, attn=args.attn)
    torch.manual_seed(0)
    model = spillover.wrap(GPT(cfg), policy="offload")
    idx, tgt = synthetic_batch(cfg, args.batch)
    swap = tempfile.mkdtemp(prefix="spillover-backward-waits-")

    waits = []
    bring_back = _unpack.Unpack._bring_back

    def timed(self, tr, s, packed):
        t0 = time.perf_counter()
        out = bring_back(self, tr, s, packed)
        waits.append((s.nbytes, s.chunked, time.perf_counter() - t0))
        return out

    _unpack.Unpack._bring_back = timed  # type: ignore[method-assign]
    print(f"GPT {args.layers}x{args.d_model}, seq {args.seq}, batch {args.batch}, attention "
          f"{args.attn}, NVMe tier, {args.pool} pool")
    for step in range(args.steps):
        waits.clear()
        model.zero_grad(set_to_none=True)
        gc.collect()
        ctx = spillover.offload_context("nvme", host_pool_bytes=args.pool, nvme_path=swap)
        with ctx:
            loss = model(idx, tgt)
        t0 = time.perf_counter()
        loss.backward()
        bwd = time.perf_counter() - t0
        by_size: dict = collections.defaultdict(lambda: [0, 0.0, 0])
        for nbytes, chunked, dt in waits:
            row = by_size[(nbytes, chunked)]
            row[0] += 1
            row[1] += dt
            row[2] += dt > 0.005
        print(f"step {step}: backward {bwd:.2f} s")
        for (nbytes, chunked), (n, secs, slow) in sorted(by_size.items()):
            what = "in pieces" if chunked else "whole"
            print(f"  {nbytes / 2**20:8.1f} MiB {what:9s} x{n:<4d} {secs:6.3f} s, "
                  f"{slow} over 5 ms")


if __name__ == "__main__":
    main()
