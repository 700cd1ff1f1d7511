"""Per-tensor cost of pack and unpack through offload_context, against memcpy of the same bytes
measured in the same run.

For each size and tier, N distinct tensors are packed one at a time inside one context:
``pack`` is the time pack() takes to return (the copy runs on), ``land`` the wait for that copy
(``ctx.synchronize()``), ``unpack`` the time unpack() takes to return the tensor (on a CPU host
a view of the block, no copy), ``memcpy`` a copy of the same bytes into a preallocated tensor,
``memcpy_cold`` into one of N distinct preallocated tensors (as the tier copies into a
different block each time: the fair baseline of a pack that copies). Medians over N, in
microseconds. ``--burst`` packs all N with no synchronisation between packs (as a forward does)
and reports the median per pack; ``--device cuda`` measures CUDA tensors (the GPU run). Only
public API, so the same script measures any version:

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

#: 4 KiB: the copy is negligible, so pack and unpack are the per-tensor overhead itself.
SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(tier: str, nbytes: int, n: int, pool: int, swap_dir: str, burst: bool = False,
            device: str = "cpu") -> dict:
    ts = [torch.full((nbytes // 4,), float(i), device=device) for i in range(n)]
    kw = dict(host_pool_bytes=pool, min_offload_bytes=0)
    if tier == "nvme":
        kw["nvme_path"] = swap_dir
    pack, land, unpack = [], [], []
    ctx = spillover.offload_context(tier, **kw)
    handles = []
    _sync(device)
    with ctx:
        if burst:
            t0 = time.perf_counter()
            for t in ts:
                handles.append(ctx.pack(t))
            t1 = time.perf_counter()
            ctx.synchronize()
            t2 = time.perf_counter()
            pack, land = [(t1 - t0) / n], [(t2 - t1) / n]
        else:
            for t in ts:
                t0 = time.perf_counter()
                h = ctx.pack(t)
                t1 = time.perf_counter()
                ctx.synchronize()
                t2 = time.perf_counter()
                pack.append(t1 - t0)
                land.append(t2 - t1)
                handles.append(h)
    outs = []
    for h in handles:
        t0 = time.perf_counter()
        outs.append(ctx.unpack(h))
        _sync(device)
        unpack.append(time.perf_counter() - t0)
    # checked after the timing: a 1 MiB comparison between two unpacks evicts the caches the
    # next one runs in (measured: host 1 MiB unpack ~50 us with it, ~13 us without)
    for out, t in zip(outs, ts):
        assert out.data_ptr() == t.data_ptr() or torch.equal(out, t)
    del handles, outs
    host = "cpu"
    dst = torch.empty(nbytes // 4, device=host, pin_memory=device == "cuda")
    memcpy, cold = [], []
    for t in ts:
        t0 = time.perf_counter()
        dst.copy_(t)
        _sync(device)
        memcpy.append(time.perf_counter() - t0)
    dsts = [torch.empty(nbytes // 4, device=host, pin_memory=device == "cuda")
            for _ in range(min(n, 64))]
    for d in dsts:
        d.zero_()  # touched once, as the tier's pool is (no first-touch page faults timed)
    for i, t in enumerate(ts):
        d = dsts[i % len(dsts)]
        t0 = time.perf_counter()
        d.copy_(t)
        _sync(device)
        cold.append(time.perf_counter() - t0)

    def us(xs):
        return round(statistics.median(xs) * 1e6, 1)

    return {"pack": us(pack), "land": us(land), "unpack": us(unpack), "memcpy": us(memcpy),
            "memcpy_cold": us(cold), "kept": ctx.stats().bytes_kept}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=0, help="tensors per size (default 200 / 12)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--burst", action="store_true",
                    help="no synchronisation between packs (median per pack of the burst)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the packed tensors live (cuda: the GPU run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    out = {"version": getattr(spillover, "__file__", "?"), "burst": args.burst,
           "device": args.device}
    with tempfile.TemporaryDirectory() as d:
        for tier in ("host", "nvme"):
            for name, nbytes in SIZES.items():
                n = args.n or (200 if nbytes <= 1 << 20 else 12)
                if nbytes > 1 << 20:
                    n = min(n, 12)
                r = measure(tier, nbytes, n, pool=max(1 << 30, 5 * n * nbytes), swap_dir=d,
                            burst=args.burst, device=args.device)
                out[f"{tier} {name}"] = r
                print(f"{tier:5} {name:6} pack {r['pack']:9.1f} us  land {r['land']:9.1f} us  "
                      f"unpack {r['unpack']:8.1f} us  memcpy {r['memcpy']:9.1f} us  "
                      f"memcpy_cold {r['memcpy_cold']:9.1f} us  "
                      f"(kept {r['kept']} B)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
