"""Measured compute throughput and transfer bandwidths of this machine, cached on disk.

The planner (:mod:`spillover.planner`) turns per-tensor bytes and FLOPs into seconds with these
numbers. They are measured once per machine — by ``python -m spillover bench`` or on the
planner's first use — and reused from a JSON file::

    $XDG_CACHE_HOME/spillover/calibration-<fingerprint>.json   (default ~/.cache/spillover/)

The fingerprint covers what changes the numbers (host name, CPU model and count, torch version
and thread count, GPU names, swap directories), so a home directory shared between machines
keeps one file per machine. ``calibrate(force=True)`` measures again.

Note [stable calibration]
    The planner's plan is a function of these numbers, and a machine's load moves them by
    20-40 % from one measurement to the next. Each number is the median of repeats (5; 3 when
    quick; the NVMe pass: the median of 3 passes), and measuring again keeps a cached number
    when the new one is within ``KEEP_WITHIN`` (40 %) of it: two calibrations back to back
    give the same numbers, hence the same plan, unless the machine really changed.

What is measured (all seconds are medians of a few repeats, after one warm-up):

``matmul_flops``
    FLOP/s of a large matmul on the device, per dtype (fp32; bf16 and fp16 on CUDA). The output
    is freshly allocated each time, as in training, so on CPU first-touch page faults count.
``elementwise_bytes_per_s``
    Bytes read plus written per second by an out-of-place elementwise op with a fresh output.
``d2h_bytes_per_s`` / ``h2d_bytes_per_s``
    Device to pinned host memory and back. On a CPU-only machine: a copy into a host-pool block
    (what ``offload_context`` does there) — the "link" is memcpy.
``nvme_write_bytes_per_s`` / ``nvme_read_bytes_per_s``
    The swap engine (``O_DIRECT``, the configured io engine and queue depth) over every
    SPILLOVER_NVME_PATH directory at once (the engine stripes across them: the sum of the
    drives), or a private temp dir. ``None`` with ``nvme_error`` when no swap file can be opened.
``host_seconds_per_offload``
    Note [host cost in the plan]: the host time one offloaded tensor costs, pack and unpack
    together, through this device's link (a 4 KiB tensor: its copy is nothing), against the same
    ops without the context.
``host_seconds_per_op``
    The host time one aten op costs inside a ``spillover.wrap`` region, in forward (the save
    mode's dispatch) and again when the region is recomputed (the replay's), against plain.
``host_seconds_per_forward_op`` (CUDA only)
    Note [two clocks in the plan] in planner/machine.py: the host's time per op of an eager
    forward through module code, where the device runs apart from the host: the built-in GPT
    (2 layers, d 64, seq 32), forward with grad, its host time over the aten ops it dispatches
    (counted once). Its kernels are tiny, so the forward is host-bound and the figure is the
    dispatch. The planner then costs a CUDA step on two clocks, as ``spillover.estimate``
    costs its GPU devices. Not measured on a CPU (one clock: host and device are the same
    cores).

Note [a calibration made under load]
    A calibration is cached for good, and the one this machine's planner used on 2026-12-05 had
    been measured while CI ran on both cores: elementwise 1.5 GB/s, matmul 38 GFLOP/s, 109 us
    per region op, against 8.0 GB/s, 282 GFLOP/s and 4.8 us quiet. Planned with it, auto on
    the simulated H200 chose plain offload at 1.46 s a step where full recomputation took 0.43
    s: every recomputation looked 5-20x dearer than it was. So each measurement records the
    load it ran under (the 1-minute load average per core, ``load``), and a cached calibration
    measured under ``LOADED`` is measured again the first time the machine is found under
    ``QUIET`` (Note [stable calibration] then keeps what did not move). One made on a busy
    machine stands until then, and ``python -m spillover bench`` measures again at any time.

Note [calibration outside the step]
    The first calibration often runs inside the user's forward (a selective region's first
    call), with autocast on: its "float32" matmul then ran in bf16 and a rate ~10x too high was
    cached. Every measurement runs on a thread of its own, which starts with none of the
    caller's thread-local state: no autocast, no saved-tensor hooks (an offload context's, a
    checkpoint region's: ``no_offload()`` cannot take those out from under a region, and the
    first calibration often runs inside one), no dispatch modes, grad mode on; with torch's
    RNG forked by the planner.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, TypeVar

import torch

# the host's costs (re-exported: callers and tests use calibrate.host_cost_times and
# calibrate.forward_dispatch_seconds)
from .calibrate_host import (  # noqa: F401
    _host_costs,
    _sync_for,
    forward_dispatch_seconds,
    host_cost_times,
)
from .config import Config, format_size

__all__ = ["calibrate", "load", "cache_path", "main", "FORMAT_VERSION"]

FORMAT_VERSION = 1


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "spillover")


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def fingerprint(cfg: Optional[Config] = None) -> Dict[str, Any]:
    """What the measured numbers depend on."""
    cfg = cfg or Config.load()
    gpus: List[str] = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__.split("+")[0],
        "threads": torch.get_num_threads(),
        "gpus": gpus,
        "nvme_path": list(cfg.nvme_path) if cfg.nvme_path else None,
        "io_engine": cfg.io_engine,
    }


def cache_path(cfg: Optional[Config] = None) -> str:
    """The JSON file this machine's calibration is kept in."""
    key = json.dumps(fingerprint(cfg), sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(_cache_dir(), f"calibration-{digest}.json")


def load(cfg: Optional[Config] = None) -> Optional[Dict[str, Any]]:
    """The cached calibration of this machine, or None (missing, unreadable or outdated)."""
    path = cache_path(cfg)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        return None
    return data


def _save(data: Dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


# ---- measurements ---------------------------------------------------------------------------


def _median_seconds(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def _matmul_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(2 * n, n, device=device).to(dtype)
    b = torch.randn(n, 2 * n, device=device).to(dtype)
    sec = _median_seconds(lambda: a @ b, repeats, _sync_for(device))
    return 2.0 * (2 * n) * n * (2 * n) / sec


def _elementwise(device: torch.device, nbytes: int, repeats: int) -> float:
    x = torch.randn(nbytes // 4, device=device)
    sec = _median_seconds(lambda: x * 1.5, repeats, _sync_for(device))
    return 2.0 * nbytes / sec


def _link(device: torch.device, nbytes: int, repeats: int) -> Dict[str, float]:
    """Device <-> pinned host memory, or (CPU) memcpy into a host-pool-like block."""
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        sync = _sync_for(device)
        d2h = _median_seconds(lambda: host.copy_(src, non_blocking=True), repeats, sync)
        h2d = _median_seconds(lambda: src.copy_(host, non_blocking=True), repeats, sync)
        return {"d2h_bytes_per_s": nbytes / d2h, "h2d_bytes_per_s": nbytes / h2d}
    from . import _native

    pool = _native.Pool(max(nbytes, 64 << 20), lock=False)
    block = pool.lease(nbytes)
    src = torch.randn(nbytes // 4)
    sec = _median_seconds(
        functools.partial(block.copy_from, src.data_ptr(), nbytes, 0), repeats, lambda: None
    )
    return {"d2h_bytes_per_s": nbytes / sec, "h2d_bytes_per_s": nbytes / sec}


def _nvme(cfg: Config, total: int, chunk: int) -> Dict[str, Any]:
    """Write then read ``total`` bytes in ``chunk``-sized requests, all in flight at once,
    through one engine over every swap directory (striped: the drives' sum)."""
    from . import _native

    own_dir = None
    if cfg.nvme_path:
        dirs = list(cfg.nvme_path)
        total *= len(dirs)  # as much per drive as one drive gets
    else:
        own_dir = tempfile.mkdtemp(prefix="spillover-calibrate-")
        dirs = [own_dir]
    try:
        n = max(1, total // chunk)
        pool = _native.Pool(n * chunk + (4 << 20), lock=False)
        swap = _native.Swap(
            pool,
            dirs,
            engine=cfg.io_engine,
            queue_depth=cfg.io_queue_depth,
            block_bytes=cfg.io_block_bytes,
            allow_buffered=cfg.allow_buffered_io,
        )
        blocks = [pool.lease(chunk) for _ in range(n)]
        fill = torch.randn(chunk // 4)
        for b in blocks:
            b.copy_from(fill.data_ptr(), chunk, 0)
        slots = [swap.alloc(chunk) for _ in range(n)]
        ws, rs = [], []
        for _ in range(4):  # the first pass warms the file's extents: not counted
            t0 = time.perf_counter()
            tickets = [swap.write(b, s) for b, s in zip(blocks, slots)]
            blocks = [t.wait() for t in tickets]
            ws.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tickets = [swap.read(s, b) for b, s in zip(blocks, slots)]
            blocks = [t.wait() for t in tickets]
            rs.append(time.perf_counter() - t0)
        best_w, best_r = statistics.median(ws[1:]), statistics.median(rs[1:])
        out = {
            "nvme_write_bytes_per_s": n * chunk / best_w,
            "nvme_read_bytes_per_s": n * chunk / best_r,
            "nvme_engine": swap.engine,
            "nvme_direct": bool(swap.direct),
            "nvme_dir": ",".join(dirs),
            "nvme_error": None,
        }
        del tickets, blocks, slots, swap, pool
        return out
    except Exception as e:  # no usable swap directory: the planner then never picks NVMe
        return {
            "nvme_write_bytes_per_s": None,
            "nvme_read_bytes_per_s": None,
            "nvme_dir": ",".join(dirs),
            "nvme_error": f"{type(e).__name__}: {e}",
        }
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def measure_device(device: torch.device, quick: bool = False) -> Dict[str, Any]:
    """Throughput and link bandwidth of one device (not cached; see :func:`calibrate`), outside
    any step the caller is in (Note [calibration outside the step])."""
    def work() -> Dict[str, Any]:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            out = _measure_device(device, quick)
        out.update(_host_costs(device, quick))
        return out

    return on_own_thread(work)


T = TypeVar("T")


def on_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own, which starts with none of the caller's thread-local
    state (Note [calibration outside the step]); what it raises is raised here."""
    box: Dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # raised again on the caller's thread
            box["error"] = e

    worker = threading.Thread(target=work, name="spillover-calibrate", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["out"]


def _measure_device(device: torch.device, quick: bool) -> Dict[str, Any]:
    n = 512 if quick else 1024
    repeats = 3 if quick else 5
    flops = {"float32": _matmul_flops(device, torch.float32, n, repeats)}
    if device.type == "cuda":
        n_half = 2048 if quick else 4096
        for dt in (torch.bfloat16, torch.float16):
            flops[str(dt).replace("torch.", "")] = _matmul_flops(device, dt, n_half, repeats)
    ew_bytes = (16 << 20) if quick else (64 << 20)
    out: Dict[str, Any] = {
        "matmul_flops": flops,
        "elementwise_bytes_per_s": _elementwise(device, ew_bytes, repeats),
    }
    out.update(_link(device, (16 << 20) if quick else (64 << 20), repeats))
    if device.type == "cuda":
        out["name"] = torch.cuda.get_device_name(device)
    return out


#: Note [a calibration made under load]: load per core (the 1-minute load average) above which
#: a measurement is not trusted for good, and below which it is measured again
LOADED = 1.5
QUIET = 0.75


def _load_per_core() -> Optional[float]:
    """The 1-minute load average per core, or None where the OS has none."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def _measured_under_load(data: Dict[str, Any], key: str) -> bool:
    """Note [a calibration made under load]: ``key``'s numbers were measured on a busy machine
    that is quiet now."""
    loads = data.get("load") or {}
    then = loads.get(key) if isinstance(loads, dict) else None
    if not isinstance(then, (int, float)) or then <= LOADED:
        return False
    now = _load_per_core()
    return now is not None and now < QUIET


#: Note [stable calibration]: a new measurement within this share of the cached one keeps it
#: (a loaded machine moved them by 31 % (matmul) and 27 % (NVMe read) between two runs).
KEEP_WITHIN = 0.4


def _keep_close(old: Optional[Dict[str, Any]], new: Dict[str, Any]) -> Dict[str, Any]:
    """``new``, where each rate (a positive number, also inside dicts such as matmul_flops)
    within KEEP_WITHIN of ``old``'s is replaced by the old one."""
    if not old:
        return new
    out = dict(new)
    for k, v in new.items():
        o = old.get(k)
        if isinstance(v, dict) and isinstance(o, dict):
            out[k] = _keep_close(o, v)
        elif (isinstance(v, (int, float)) and not isinstance(v, bool)
              and isinstance(o, (int, float)) and not isinstance(o, bool) and o > 0 and v > 0
              and abs(v / o - 1) <= KEEP_WITHIN):
            out[k] = o
    return out


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


def calibrate(
    force: bool = False,
    device: Optional[torch.device | str] = None,
    quick: bool = False,
    cfg: Optional[Config] = None,
) -> Dict[str, Any]:
    """This machine's calibration: from the cache, or measured now (and cached).

    Args:
        force: measure again even when a cached result exists.
        device: the compute device to measure (default: CUDA when available, else CPU). Each
            device measured is added to the same file.
        quick: smaller, faster measurements (about a second on a CPU; for tests).
        cfg: the configuration whose swap directory and io engine are measured (default:
            ``Config.load()``, i.e. the SPILLOVER_* environment).

    Returns:
        ``{"version", "fingerprint", "devices": {"cpu": {...}, "cuda:0": {...}},
        "nvme_write_bytes_per_s", "nvme_read_bytes_per_s", "nvme_error", ...}``.
    """
    cfg = cfg or Config.load()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    key = _device_key(dev)
    path = cache_path(cfg)
    cached = load(cfg)
    data = None if force else cached
    if data is not None and key in data.get("devices", {}) and "nvme_error" in data \
            and not _measured_under_load(data, key) and not _missing(data, key):
        return data
    data = data or {"version": FORMAT_VERSION, "fingerprint": fingerprint(cfg), "devices": {}}
    t0 = time.perf_counter()
    old_dev = (cached or {}).get("devices", {}).get(key)
    busy = _load_per_core()
    data["devices"][key] = _keep_close(old_dev, measure_device(dev, quick=quick))
    if busy is not None:  # Note [a calibration made under load]
        loads = data.get("load") if isinstance(data.get("load"), dict) else {}
        data["load"] = dict(loads, **{key: round(busy, 2)})
    if force or "nvme_error" not in data:
        total, chunk = ((32 << 20), (4 << 20)) if quick else ((256 << 20), (8 << 20))
        old_nvme = {k: (cached or {}).get(k)
                    for k in ("nvme_write_bytes_per_s", "nvme_read_bytes_per_s")}
        data.update(_keep_close(old_nvme, _nvme(cfg, total, chunk)))
    data["quick"] = bool(quick)
    data["measured_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"
    )
    data["seconds"] = round(time.perf_counter() - t0, 2)
    try:
        _save(data, path)
    except OSError as e:  # a read-only home still gets numbers, just not cached
        data["cache_error"] = str(e)
    return data


def _missing(data: Dict[str, Any], key: str) -> bool:
    """A cached device made before a figure it should have was measured (a CUDA device's
    ``host_seconds_per_forward_op``): measured again."""
    return key.startswith("cuda") and "host_seconds_per_forward_op" not in data["devices"][key]


def _rate(v: Optional[float], unit: str) -> str:
    if v is None:
        return "-"
    if unit == "B":
        return f"{format_size(v)}/s"
    return f"{v / 1e9:.1f} G{unit}/s"


def describe(data: Dict[str, Any]) -> str:
    """A short human-readable table of a calibration."""
    lines = []
    for key, d in data.get("devices", {}).items():
        name = f"{key} ({d['name']})" if d.get("name") else key
        lines.append(f"{name}:")
        for dt, f in d["matmul_flops"].items():
            lines.append(f"  matmul {dt:<9}        {_rate(f, 'FLOP')}")
        lines.append(f"  elementwise (read+write) {_rate(d['elementwise_bytes_per_s'], 'B')}")
        lines.append(f"  device -> host           {_rate(d['d2h_bytes_per_s'], 'B')}")
        lines.append(f"  host -> device           {_rate(d['h2d_bytes_per_s'], 'B')}")
        for k, what in (("host_seconds_per_offload", "host per offloaded tensor"),
                        ("host_seconds_per_op", "host per region op"),
                        ("host_seconds_per_forward_op", "host per forward op")):
            if d.get(k) is not None:
                lines.append(f"  {what:<24} {d[k] * 1e6:.1f} us")
    if data.get("nvme_error"):
        lines.append(f"nvme ({data.get('nvme_dir')}): unavailable: {data['nvme_error']}")
    else:
        lines.append(
            f"nvme ({data.get('nvme_dir')}, {data.get('nvme_engine')}"
            f"{'' if data.get('nvme_direct') else ', buffered'}): write "
            f"{_rate(data.get('nvme_write_bytes_per_s'), 'B')}, read "
            f"{_rate(data.get('nvme_read_bytes_per_s'), 'B')}"
        )
    lines.append(f"measured {data.get('measured_at')} in {data.get('seconds')} s")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m spillover bench``: calibrate this machine (or show the cached result)."""
    ap = argparse.ArgumentParser(
        prog="python -m spillover bench",
        description="Measure compute throughput and transfer bandwidths for the planner.",
    )
    ap.add_argument("--force", action="store_true", help="measure again, ignoring the cache")
    ap.add_argument("--quick", action="store_true", help="smaller, faster measurements")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    data = calibrate(force=args.force, device=args.device, quick=args.quick)
    if args.json:
        json.dump(data, sys.stdout, indent=1, sort_keys=True)
        print()
    else:
        print(describe(data))
        print(f"cached in {cache_path()}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
