"""``python -m spillover doctor``: check this machine for spillover and say what to fix.

Each line is ✓ (fine), ! (works, degraded) or ✗ (broken), followed by what to do.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _native
from .config import Config, format_size
from .errors import ConfigError, SpilloverError

OK, WARN, BAD = "✓", "!", "✗"


def effective(cfg: Config) -> Dict[str, str]:
    """What each setting left unset resolves to on this machine, in words with the numbers."""
    from . import _runtime
    from .activations.link.common import default_cap_bytes
    from .planner.tuner import DEFAULT_BUDGET_SHARE

    act = _runtime.default_size("activations")
    start = min(act, _runtime.MIN_POOL)
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
        where = "of free device memory"
    else:
        import psutil

        free = psutil.virtual_memory().available
        where = "of available RAM (a CPU host)"
    pool = cfg.host_pool_bytes or start
    return {
        "SPILLOVER_NVME_PATH": f"a private directory under {tempfile.gettempdir()} (made at "
                               "first use, removed at exit)",
        "SPILLOVER_HOST_POOL_BYTES": f"{format_size(start)} at first, grown to what steps hold, "
                                     f"at most {format_size(act)}",
        "SPILLOVER_OPTIM_POOL_BYTES": "what the parameters' state needs, at most "
                                      f"{format_size(_runtime.default_size('optim'))}",
        "SPILLOVER_PREFETCH_BYTES": f"a quarter of the pool, at most 256 MiB ("
                                    f"{format_size(min(pool // 4, 256 << 20))} of a "
                                    f"{format_size(pool)} pool)",
        "SPILLOVER_DEVICE_BUDGET_BYTES": f"none; policy='auto' plans for "
                                         f"{DEFAULT_BUDGET_SHARE:.0%} {where} "
                                         f"({format_size(DEFAULT_BUDGET_SHARE * free)} now)",
        "SPILLOVER_COPY_INFLIGHT_BYTES": f"{format_size(default_cap_bytes())} (16 GB/s x 20 ms; "
                                         "device copies only)",
        "SPILLOVER_SIM_LINK_BANDWIDTH": "off (no simulated device)",
        "SPILLOVER_WRITE_HOLD_BYTES": "the pool's capacity plus the largest storage written "
                                      "from its tensor",
    }


class Report:
    def __init__(self) -> None:
        self.lines: List[Tuple[str, str]] = []

    def add(self, mark: str, text: str) -> None:
        self.lines.append((mark, text))
        print(f"{mark} {text}", flush=True)

    @property
    def failed(self) -> bool:
        return any(m == BAD for m, _ in self.lines)


def _cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << 14))
    except OSError:
        pass
    return False


def check_node_budget(r: Report, mem: Any, act: int, optim: int, act_grows: bool = False) -> None:
    """Note [node budget] in _runtime.py, as the pools would be made now. ``act_grows``: no
    activation pool size was given, so it starts small and grows up to ``act`` (Note [growing
    pool] in _growth.py)."""
    from ._growth import FIRST_POOL
    from ._runtime import check_pool_size

    try:
        check_pool_size(act, "activations", mem)
        check_pool_size(optim, "optim", dataclasses.replace(mem, in_pools=act))
    except ConfigError as e:
        r.add(BAD, str(e))
        return
    act_text = (f"{format_size(FIRST_POOL)} growing to what steps use, at most {format_size(act)}"
                if act_grows else format_size(act))
    r.add(OK, f"node budget: {mem.describe()}; activation pool {act_text}, optimizer "
              f"pool at most {format_size(optim)} (each made only when used; the optimizer's "
              "sized to its parameters' state)")


def check_memlock(r: Report, pool_bytes: int) -> None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else format_size(soft)
    if _cap_ipc_lock():
        r.add(OK, f"memlock: CAP_IPC_LOCK held, the {format_size(pool_bytes)} pool can be locked "
                  f"(RLIMIT_MEMLOCK {limit})")
    elif soft == resource.RLIM_INFINITY or soft >= pool_bytes:
        r.add(OK, f"memlock: RLIMIT_MEMLOCK {limit} covers the {format_size(pool_bytes)} pool")
    else:
        r.add(WARN, f"memlock: RLIMIT_MEMLOCK is {limit}, below the {format_size(pool_bytes)} "
                    "pool: it runs unlocked (swappable, slower CUDA copies). Raise it: "
                    "`ulimit -l unlimited`, LimitMEMLOCK=infinity (systemd), "
                    "--ulimit memlock=-1 (docker)")


def check_thp(r: Report) -> None:
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    try:
        with open(path) as f:
            mode = f.read().strip()
    except OSError:
        r.add(WARN, "transparent huge pages: not available on this kernel")
        return
    chosen = mode[mode.find("[") + 1 : mode.find("]")] if "[" in mode else mode
    if chosen in ("always", "madvise"):
        r.add(OK, f"transparent huge pages: {chosen} (the pool asks for them with madvise)")
    else:
        r.add(WARN, f"transparent huge pages: {chosen}; the pool uses 4 KiB pages (more TLB "
                    f"misses). Enable with `echo madvise > {path}`")


def check_dirs(r: Report, cfg: Config, pool: _native.Pool) -> List[str]:
    dirs = list(cfg.nvme_path or (tempfile.gettempdir(),))
    usable = []
    for d in dirs:
        if not os.path.isdir(d):
            r.add(BAD, f"swap dir {d}: does not exist or is not a directory; create it or fix "
                       "SPILLOVER_NVME_PATH")
            continue
        free = shutil.disk_usage(d).free
        try:
            s = _native.Swap(pool, [d], engine="threads", allow_buffered=False)
            direct = s.direct
            del s
        except (SpilloverError, OSError, ValueError) as e:
            r.add(BAD, f"swap dir {d}: {e}")
            continue
        mark = OK if direct else WARN
        r.add(mark, f"swap dir {d}: O_DIRECT {'works' if direct else 'refused'}, "
                    f"{format_size(free)} free")
        usable.append(d)
    return usable


def check_uring(r: Report, pool: _native.Pool, d: str) -> Optional[str]:
    try:
        s = _native.Swap(pool, [d], engine="io_uring")
        msg = s.warning
        del s
    except (SpilloverError, OSError, ValueError) as e:
        r.add(WARN, f"io_uring: refused ({e}); the pread/pwrite thread engine is used instead "
                    "(more CPU per byte). In containers, allow io_uring_setup in the seccomp "
                    "profile; check sysctl kernel.io_uring_disabled")
        return "threads"
    if msg:
        r.add(WARN, f"io_uring: usable, with a caveat: {msg}")
    else:
        r.add(OK, "io_uring: usable, pool arenas registered as fixed buffers")
    return "io_uring"


def check_cuda(r: Report) -> None:
    if not torch.cuda.is_available():
        r.add(OK, "CUDA: not present; spillover runs on the CPU (worker-thread copies)")
        return
    name = torch.cuda.get_device_name(0)
    p = _native.Pool(16 << 20, lock=False)
    addr, length = p.arenas()[0]
    err = torch.cuda.cudart().cudaHostRegister(addr, length, 0)
    code = int(getattr(err, "value", err))
    if code == 0:
        torch.cuda.cudart().cudaHostUnregister(addr)
        r.add(OK, f"CUDA: {name}; registering host memory (cudaHostRegister) works")
    else:
        r.add(BAD, f"CUDA: {name}; cudaHostRegister failed (cudaError {code}): copies from the "
                   "pool will not be asynchronous. Raise RLIMIT_MEMLOCK")


def probe_bandwidth(r: Report, pool: _native.Pool, d: Optional[str], engine: str,
                    seconds: float) -> None:
    n = 64 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    blk = pool.lease(n)
    t_end = time.perf_counter() + seconds / 3
    moved, t0 = 0, time.perf_counter()
    while time.perf_counter() < t_end:
        blk.copy_from(src.data_ptr(), n)
        moved += n
    r.add(OK, f"host tier: copy into the pool {moved / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
    if torch.cuda.is_available():
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        from .activations.link import block_tensor

        host = block_tensor(blk)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(8):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        r.add(OK, f"device link: host→device {8 * n / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
    if d is None:
        return
    swap = _native.Swap(pool, [d], engine=engine)
    slot = swap.alloc(n)
    for op in ("write", "read"):
        t_end = time.perf_counter() + seconds / 3
        moved, t0 = 0, time.perf_counter()
        while time.perf_counter() < t_end:
            blk = getattr(swap, op)(*((blk, slot) if op == "write" else (slot, blk))).wait()
            moved += n
        r.add(OK, f"NVMe tier ({d}, {engine}): {op} "
                  f"{moved / (time.perf_counter() - t0) / 1e9:.2f} GB/s")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spillover doctor", description=__doc__)
    ap.add_argument("--probe-seconds", type=float, default=5.0,
                    help="time for the bandwidth probes (0 skips them)")
    args = ap.parse_args(argv)
    r = Report()
    try:
        cfg = Config.load()
    except SpilloverError as e:
        r.add(BAD, f"configuration: {e}")
        return 1
    from ._runtime import default_pool_bytes, node_memory

    mem = node_memory()
    pool_bytes = cfg.host_pool_bytes or default_pool_bytes(mem)
    optim_bytes = cfg.optim_pool_bytes or default_pool_bytes(mem)
    print("spillover doctor\n")
    check_node_budget(r, mem, pool_bytes, optim_bytes, act_grows=cfg.host_pool_bytes is None)
    check_memlock(r, pool_bytes)
    check_thp(r)
    probe_pool = _native.Pool(256 << 20, lock=False)
    dirs = check_dirs(r, cfg, probe_pool)
    engine = check_uring(r, probe_pool, dirs[0]) if dirs else None
    check_cuda(r)
    print("\neffective configuration (the values a context and an optimizer will use):")
    used = effective(cfg)
    for env, (_f, value, source, _h) in cfg.describe().items():
        shown = format_size(value) if env.endswith("_BYTES") and isinstance(value, int) else value
        if value is None:
            shown = used.get(env, "none")
        print(f"  {env:<30} {shown}  ({source})")
    from .optim import formats

    print("\nOffloadAdamW state per parameter (state_bits=, master_weights=; Note [state formats] "
          "in spillover/optim/formats.py;\n  `print(spillover.explain(opt))` shows an "
          "optimizer's own):")
    for line in formats.explain_bytes().split("\n"):
        print(f"  {line}")
    if args.probe_seconds > 0:
        print(f"\nbandwidth probe (~{args.probe_seconds:.0f} s):")
        probe_bandwidth(r, probe_pool, dirs[0] if dirs else None, engine or "threads",
                        args.probe_seconds)
    print()
    print("problems found: see the ✗ lines" if r.failed else "no blocking problems found")
    return 1 if r.failed else 0
