"""Per-tensor cost of pack and unpack through offload_context, against memcpy of the same bytes
measured in the same run.

For each size and tier, N distinct tensors are packed one at a time inside one context:
``pack`` is the time pack() takes to return (the copy runs on), ``land`` the wait for that copy
(``ctx.synchronize()``), ``unpack`` the time unpack() takes to return the tensor (on a CPU host
a view of the block, no copy), ``memcpy`` a copy of the same bytes into a preallocated tensor.
Medians over N, in microseconds. Only public API, so the same script measures any version:

    python benches/python/pack_cost.py --json out.json
    PYTHONPATH=/path/to/other/install python benches/python/pack_cost.py --json old.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import spillover

SIZES = {"1MiB": 1 << 20, "64MiB": 64 << 20}


def measure(tier: str, nbytes: int, n: int, pool: int, swap_dir: str) -> dict:
    ts = [torch.full((nbytes // 4,), float(i)) for i in range(n)]
    kw = dict(host_pool_bytes=pool, min_offload_bytes=0)
    if tier == "nvme":
        kw["nvme_path"] = swap_dir
    pack, land, unpack = [], [], []
    ctx = spillover.offload_context(tier, **kw)
    handles = []
    with ctx:
        for t in ts:
            t0 = time.perf_counter()
            h = ctx.pack(t)
            t1 = time.perf_counter()
            ctx.synchronize()
            t2 = time.perf_counter()
            pack.append(t1 - t0)
            land.append(t2 - t1)
            handles.append(h)
    for h, t in zip(handles, ts):
        t0 = time.perf_counter()
        out = ctx.unpack(h)
        unpack.append(time.perf_counter() - t0)
        assert out.data_ptr() == t.data_ptr() or torch.equal(out, t)
        del out
    del handles
    dst = torch.empty(nbytes // 4)
    memcpy = []
    for t in ts:
        t0 = time.perf_counter()
        dst.copy_(t)
        memcpy.append(time.perf_counter() - t0)

    def us(xs):
        return round(statistics.median(xs) * 1e6, 1)

    return {"pack": us(pack), "land": us(land), "unpack": us(unpack), "memcpy": us(memcpy),
            "kept": ctx.stats().bytes_kept}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=0, help="tensors per size (default 200 / 12)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"version": getattr(spillover, "__file__", "?")}
    with tempfile.TemporaryDirectory() as d:
        for tier in ("host", "nvme"):
            for name, nbytes in SIZES.items():
                n = args.n or (200 if nbytes <= 1 << 20 else 12)
                r = measure(tier, nbytes, n, pool=max(1 << 30, 5 * n * nbytes), swap_dir=d)
                out[f"{tier} {name}"] = r
                print(f"{tier:5} {name:6} pack {r['pack']:9.1f} us  land {r['land']:9.1f} us  "
                      f"unpack {r['unpack']:8.1f} us  memcpy {r['memcpy']:9.1f} us  "
                      f"(kept {r['kept']} B)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
