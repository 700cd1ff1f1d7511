"""``python -m spillover bench``: calibrate the planner's cost model (host copy, device link,
NVMe bandwidth, compute throughput; cached on disk), and with ``--compare`` measure the swap
engine against fio on the same file system, interleaved, and print the ratios."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

from . import _native
from .config import Config


def engine_pass(swap: _native.Swap, pool: _native.Pool, total: int, chunk: int,
                op: str, slots: List) -> float:
    """Seconds to move `total` bytes with `op` ("write"/"read"), `chunk` bytes per request,
    keeping 4 requests in flight."""
    blocks = [pool.lease(chunk) for _ in range(4)]
    n = total // chunk
    t0 = time.perf_counter()
    inflight: List = []
    for i in range(n):
        if len(inflight) == 4:
            blocks.append(inflight.pop(0).wait())
        b = blocks.pop()
        inflight.append(swap.write(b, slots[i]) if op == "write" else swap.read(slots[i], b))
    for t in inflight:
        t.wait()
    return time.perf_counter() - t0


def fio_pass(directory: str, total: int, op: str) -> Optional[float]:
    exe = shutil.which("fio")
    if exe is None:
        return None
    path = os.path.join(directory, "spillover-fio.tmp")
    cmd = [exe, "--name=spillover", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
           "--bs=1M", "--iodepth=32", f"--size={total}", f"--rw={op}", "--output-format=json",
           "--fixedbufs", "--registerfiles", "--sqthread_poll=0"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        job = json.loads(out.stdout)["jobs"][0][op]
        return job["io_bytes"] / (job["runtime"] / 1000) / 1e9 if job["runtime"] else None
    except (subprocess.CalledProcessError, KeyError, ValueError):
        return None
    finally:
        if op == "read" and os.path.exists(path):
            os.unlink(path)


def compare(directory: str, total: int, rounds: int) -> Dict[str, float]:
    pool = _native.Pool(64 << 20, lock=False)
    swap = _native.Swap(pool, [directory])
    chunk = 16 << 20
    slots = [swap.alloc(chunk) for _ in range(total // chunk)]
    res: Dict[str, List[float]] = {"engine write": [], "engine read": [], "fio write": [],
                                   "fio read": []}
    for r in range(rounds):
        for op in ("write", "read"):
            secs = engine_pass(swap, pool, total, chunk, op, slots)
            res[f"engine {op}"].append(total / secs / 1e9)
            f = fio_pass(directory, total, op)
            if f is not None:
                res[f"fio {op}"].append(f)
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{k} {v[-1]:.2f}" for k, v in res.items() if v), flush=True)
    med = {k: statistics.median(v) for k, v in res.items() if v}
    print(f"\nswap engine ({swap.engine}) vs fio (io_uring, O_DIRECT, 1 MiB, qd 32, fixed "
          f"buffers), {total >> 20} MiB sequential in {directory}, medians of {rounds}:")
    for op in ("write", "read"):
        e = med.get(f"engine {op}")
        f = med.get(f"fio {op}")
        ratio = f"{e / f:.2f}x fio" if e and f else "fio not installed (apt-get install fio)"
        print(f"  {op:<5} engine {e:.2f} GB/s   fio {f if f else float('nan'):.2f} GB/s   {ratio}")
    return med


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spillover bench", description=__doc__)
    ap.add_argument("--compare", action="store_true", help="engine vs fio on the swap dir")
    ap.add_argument("--bytes", default="1GiB", help="bytes per pass for --compare")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--force", action="store_true", help="recalibrate even if cached")
    args = ap.parse_args(argv)
    cfg = Config.load()
    from .config import parse_size

    try:
        from . import calibrate
    except ImportError:  # pragma: no cover - until the planner's calibration lands
        calibrate = None  # type: ignore[assignment]
    if calibrate is not None:
        print("calibrating (cached for the planner) ...", flush=True)
        res = calibrate.calibrate(force=args.force)
        for k, v in res.items():
            print(f"  {k:<28} {v}")
    if args.compare:
        d = (cfg.nvme_path or (tempfile.gettempdir(),))[0]
        compare(d, parse_size(args.bytes, "--bytes"), args.rounds)
    return 0
