"""The GPU probe: what the first lent device must answer, in under five minutes, before the full
run (benches/gpu/run.sh). One check after another, each in a process of its own (one sticky
CUDA error once failed 7 of 9 checks run in one process), each under a budget of its own and all
under one deadline; each answer a ✓/✗ line in ``summary.md`` the moment it is known; every
figure in ``probe.json``; at the end one archive, ``probe.tgz``, of everything written.

    python3 benches/gpu/probe.py --out DIR              # on the GPU host (about 4 minutes)
    python3 benches/gpu/probe.py --out DIR --dry-run    # every check on the CPU, tiny sizes

On the device machine (PyTorch, no Rust, no network; dist/gpu carried from a machine that ran
benches/gpu/prepare.sh):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site dist/gpu/spillover-*.whl \
      && PYTHONPATH=/tmp/site timeout 290 python3 benches/gpu/probe.py --out $OUT

Checks (the review of 2026-12-03 names what each confirms or refutes):
  env          torch / CUDA / driver, /proc/meminfo (MemTotal, MemAvailable: a microVM's grow),
               memlock, PCIe generation and width (max), the scratch directory's file system,
               O_DIRECT and io_uring, and its write / read speed through spillover's swap engine
  pool         mapping a pool and registering it with CUDA, timed apart; D2H / H2D GB/s from a
               pool block against torch's pinned memory
  link         host time per pack and per unpack on the device through the public API, and the
               device calls per tensor (benches/python/link_cost.py)
  optimizer    OffloadAdamW's gradient staging on a GPT: copies at step() (the default) against
               copies in backward's hooks, against torch's fused AdamW: step seconds
  step         a Llama-style 1B step (seq 4096, bf16) per tier: none, full checkpointing, host,
               nvme; max_memory_allocated and max_memory_reserved of forward and backward apart,
               step seconds, spillover's stalls and prefetch figures
  capture      a context under CUDA graph capture: a forward captured after an eager step; a
               first step under capture (raises, saying to enter once eagerly); a backward
               captured over an eager forward's offloaded tensors (raises)
  streams      half the blocks on a side stream: gradients bitwise equal to no offload
  verify       the verify mode on the device: no false positive, and its cost
  estimate     spillover.estimate's device peak against max_memory_allocated per mode (none,
               full, selective, host) on a 4-layer GPT (benches/gpu/estimate_check.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.join(ROOT, "benches", "python")]

from estimate_check import check_estimate  # noqa: E402

import spillover  # noqa: E402
from spillover import _pools  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


class Probe:
    """Where the answers go: summary.md line by line, probe.json at every check."""

    def __init__(self, out: str, dry: bool, deadline: float, append: bool = False):
        self.out, self.dry, self.deadline = out, dry, deadline
        self.t0 = time.monotonic()
        self.results: Dict[str, Any] = {"dry_run": dry}
        self.failed = 0
        self.summary = os.path.join(out, "summary.md")
        self.child = append  # a check's own process: its figures go to check-NAME.json
        if not append:  # a check's own process appends to its parent's
            open(self.summary, "w").close()

    def say(self, line: str) -> None:
        print(line, flush=True)
        with open(self.summary, "a") as f:  # the parent and each check's process take turns
            f.write(line + "\n")

    def mark(self, ok: bool, text: str) -> None:
        self.say(f"- {'✓' if ok else '✗'} {text}")
        if not ok:
            self.failed += 1

    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.t0)

    def save(self) -> None:
        if self.child:
            return
        with open(os.path.join(self.out, "probe.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)

    def run(self, name: str, budget: float, fn: Callable[[Probe], Dict[str, Any]]) -> None:
        if self.left() < budget:
            self.say(f"\n## {name}: not run (needs ~{budget:.0f} s, {self.left():.0f} s left)")
            self.failed += 1
            return
        self.say(f"\n## {name} (budget ~{budget:.0f} s, at {time.monotonic() - self.t0:.0f} s)")
        t0 = time.monotonic()
        try:
            self.results[name] = fn(self)
        except Exception as e:  # noqa: BLE001 -- one failed check must not stop the others
            self.mark(False, f"{name} raised {type(e).__name__}: {e}")
            self.results[name] = {"error": traceback.format_exc()}
        self.results.setdefault("seconds", {})[name] = time.monotonic() - t0
        self.save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def device(p: Probe) -> str:
    return "cpu" if p.dry else "cuda"


def sync(p: Probe) -> None:
    if not p.dry:
        torch.cuda.synchronize()


# ---- env -----------------------------------------------------------------------------------


def meminfo() -> Dict[str, int]:
    out = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable", "Cached", "Hugepagesize"):
                out[k] = int(v.split()[0]) * 1024
    return out


def check_env(p: Probe) -> Dict[str, Any]:
    r: Dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "spillover": spillover.__version__,
        "meminfo_start": meminfo(), "memlock": _native_memlock(), "cores": os.cpu_count(),
    }
    if not p.dry:
        r["gpu"] = torch.cuda.get_device_name()
        q = "name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max"
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            r["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
    m = r["meminfo_start"]
    p.mark(True, f"torch {r['torch']} (CUDA {r['cuda']}), Python {r['python']}, "
           f"{r.get('gpu', 'no GPU (dry run)')}; {r.get('nvidia_smi', '')}")
    p.mark(True, f"MemTotal {m.get('MemTotal', 0) / GiB:.1f} GiB, MemAvailable "
           f"{m.get('MemAvailable', 0) / GiB:.1f} GiB, memlock {r['memlock']}, "
           f"{r['cores']} cores")
    scratch = os.environ.get("SPILLOVER_NVME_PATH") or tempfile.mkdtemp(prefix="probe-swap-")
    r["scratch"] = scratch
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        r["scratch_fs"] = subprocess.run(["df", "-PT", scratch], capture_output=True,
                                         text=True, timeout=10).stdout.splitlines()[-1]
    r["disk"] = disk_speed(scratch, 4 if p.dry else 10)
    d = r["disk"]
    p.mark(d.get("ok", False), f"scratch {scratch} ({r.get('scratch_fs', '?')}): engine "
           f"{d.get('engine')}, write {d.get('write_gbps', 0):.2f} GB/s, read "
           f"{d.get('read_gbps', 0):.2f} GB/s ({d.get('warning') or 'O_DIRECT'})")
    return r


def _native_memlock() -> Optional[int]:
    return spillover._native.memlock_limit()


def disk_speed(scratch: str, seconds: float) -> Dict[str, Any]:
    """Write then read 64 MiB requests through spillover's swap engine for ``seconds``."""
    from spillover import _native

    pool = _native.Pool(256 * MiB)
    swap = _native.Swap(pool, [scratch], engine="auto")
    blocks = [pool.lease(64 * MiB) for _ in range(2)]
    slots, written, t0 = [], 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2 and written < 8 * GiB:
        slot = swap.alloc(64 * MiB)
        i = len(slots) % 2
        blocks[i] = swap.write(blocks[i], slot).wait()  # the block comes back with the ticket
        slots.append(slot)
        written += 64 * MiB
    tw = time.perf_counter() - t0
    t1 = time.perf_counter()
    read = 0
    for i, slot in enumerate(slots):
        blocks[i % 2] = swap.read(slot, blocks[i % 2]).wait()
        read += 64 * MiB
    tr = time.perf_counter() - t1
    return {"ok": True, "engine": swap.engine, "warning": swap.warning,
            "write_gbps": written / tw / 1e9, "read_gbps": read / tr / 1e9,
            "bytes": written}


# ---- pool -----------------------------------------------------------------------------------


def check_pool(p: Probe) -> Dict[str, Any]:
    from spillover import _native

    size = 64 * MiB if p.dry else 4 * GiB
    t0 = time.perf_counter()
    pool = _native.Pool(size)
    t_map = time.perf_counter() - t0
    t1 = time.perf_counter()
    registered = _pools.register_with_cuda(pool) if not p.dry else False
    t_reg = time.perf_counter() - t1
    r: Dict[str, Any] = {"bytes": size, "map_s": t_map, "register_s": t_reg,
                         "registered": registered, "meminfo": meminfo()}
    p.mark(p.dry or registered, f"a {size / GiB:.2f} GiB pool: mapped and pre-faulted in "
           f"{t_map:.2f} s, registered with CUDA in {t_reg:.2f} s ({registered})")
    if not p.dry:
        n = 256 * MiB
        blk = pool.lease(n)
        host = torch.from_numpy(__import__("numpy").asarray(blk))
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        for name, h in (("pool", host), ("pin_memory", pinned)):
            for way in ("d2h", "h2d"):
                ts = []
                for _ in range(5):
                    sync(p)
                    t = time.perf_counter()
                    (h.copy_(dev, non_blocking=True) if way == "d2h"
                     else dev.copy_(h, non_blocking=True))
                    sync(p)
                    ts.append(time.perf_counter() - t)
                r[f"{name}_{way}_gbps"] = n / statistics.median(ts) / 1e9
        p.mark(r["pool_d2h_gbps"] > 0.7 * r["pin_memory_d2h_gbps"],
               f"D2H {r['pool_d2h_gbps']:.1f} GB/s from a pool block against "
               f"{r['pin_memory_d2h_gbps']:.1f} from pin_memory; H2D {r['pool_h2d_gbps']:.1f} "
               f"against {r['pin_memory_h2d_gbps']:.1f}")
        del blk, host
    return r


# ---- link -----------------------------------------------------------------------------------


def check_link(p: Probe) -> Dict[str, Any]:
    import link_cost

    dev = device(p)
    links = ["host", "sim"] if p.dry else ["cuda"]
    rows = link_cost.measure_links(links, dev, 100 if p.dry else 400, 2 if p.dry else 5, 0.0)
    for row in rows:
        (a, b), (c, d) = row["pack_spread"], row["unpack_spread"]
        goal = row["pack_us"] <= 25 and row["unpack_us"] <= 25
        p.mark(goal or p.dry,  # a dry run checks the script, not the CPU's figures
               f"{row['link']} {row['size']}: {row['pack_us']:.1f} us per pack [{a:.1f}, "
               f"{b:.1f}], {row['unpack_us']:.1f} us per unpack [{c:.1f}, {d:.1f}] (goal <= 25 "
               f"us each{'; CPU figures, not judged' if p.dry else ''})")
    out: Dict[str, Any] = {"rows": rows}
    if not p.dry:
        from spillover.activations.link import link_for

        tr = link_for(torch.device("cuda"))
        out["counters"] = tr.counters()
    return out


# ---- optimizer -------------------------------------------------------------------------------


def check_optimizer(p: Probe) -> Dict[str, Any]:
    from spillover.models import GPT, GPTConfig, synthetic_batch

    dev = device(p)
    if p.dry:
        cfg = GPTConfig(vocab=512, d_model=64, n_heads=4, n_layers=2, seq=64)
        batch_size, steps = 2, 2
    else:
        cfg = GPTConfig(vocab=32000, d_model=1024, n_heads=16, n_layers=24, seq=1024)
        batch_size, steps = 8, 3
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    idx, tgt = (t.to(dev) for t in synthetic_batch(cfg, batch=batch_size))
    ways = {
        "torch AdamW(fused)": lambda: torch.optim.AdamW(model.parameters(), lr=1e-4,
                                                        fused=not p.dry),
        # the dry run takes the GPU path's staging on CPU tensors, so both ways run there too
        "OffloadAdamW copies at step() (default)": lambda: spillover.OffloadAdamW(
            model.parameters(), lr=1e-4, _force_staging=p.dry),
        "OffloadAdamW hook copies": lambda: spillover.OffloadAdamW(
            model.parameters(), lr=1e-4, _force_staging=p.dry, _hook_copies=True),
    }
    r: Dict[str, Any] = {"parameters": sum(x.numel() for x in model.parameters())}
    for name, make in ways.items():
        opt = make()
        ts = []
        for s in range(steps + 1):
            sync(p)
            t0 = time.perf_counter()
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=not p.dry):
                loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(p)
            if s:
                ts.append(time.perf_counter() - t0)
        r[name] = statistics.median(ts)
        del opt
    best = min(r[k] for k in ways)
    for k in ways:
        p.mark(True, f"{k}: {r[k]:.3f} s per step ({r[k] / best:.2f}x the fastest)")
    return r


# ---- step -----------------------------------------------------------------------------------


def check_steps(p: Probe) -> Dict[str, Any]:
    from llama import Llama
    from measure import Memory

    dev = device(p)
    if p.dry:
        dims = dict(vocab=512, d=64, layers=2, heads=4, ffn=128, seq=128)
        batch, dtype = 2, torch.float32
    else:
        dims = dict(vocab=32000, d=2048, layers=16, heads=16, ffn=5632, seq=4096)
        batch, dtype = 1, torch.bfloat16
    torch.manual_seed(0)
    model = Llama(**dims).to(dev, dtype)
    idx = torch.randint(0, dims["vocab"], (batch, dims["seq"]), device=dev)
    tgt = torch.randint(0, dims["vocab"], (batch, dims["seq"]), device=dev)
    mem = Memory(not p.dry)
    nvme = tempfile.mkdtemp(prefix="probe-nvme-")
    pool = "64MiB" if p.dry else "16GiB"
    modes: Dict[str, Any] = {
        "none": None, "full": None,
        "host": lambda: spillover.offload_context("host", host_pool_bytes=pool),
        # the README's Quick start: a new context every step, the default pool (Note [the pool
        # lives for the process]: from the third step on, nothing mapped or registered)
        "quickstart": lambda: spillover.offload_context("auto"),
        "nvme": lambda: spillover.offload_context(
            "nvme", host_pool_bytes="16MiB" if p.dry else "4GiB", nvme_path=nvme),
    }
    r: Dict[str, Any] = {"dims": dims}
    def link_calls(ctx: Any) -> int:
        return sum(int(getattr(tr, "calls", 0)) for tr in list(ctx._transfers.values()))

    def link_queries(ctx: Any) -> int:  # of the calls, event queries (Note [polls in order])
        return sum(int(tr.counters().get("queries", 0)) for tr in list(ctx._transfers.values())
                   if hasattr(tr, "counters"))

    for mode, make in modes.items():
        model.ckpt = mode == "full"
        ctx = make() if make else None
        rows, per_step = [], []
        for s in range(4 if mode == "quickstart" else 3):  # warm-up, then measured
            if mode == "quickstart":
                ctx = make()
            calls0 = link_calls(ctx) if ctx is not None else 0
            queries0 = link_queries(ctx) if ctx is not None else 0
            model.zero_grad(set_to_none=True)
            sync(p)
            base = mem.now()
            mem.reset()
            t0 = time.perf_counter()
            with ctx if ctx is not None else contextlib.nullcontext():
                loss = model(idx, tgt)
            sync(p)
            t1 = time.perf_counter()
            fwd = mem.peaks()
            mem.reset()
            loss.backward()
            sync(p)
            t2 = time.perf_counter()
            bwd = mem.peaks()
            if ctx is not None:
                st = ctx.stats()
                per_step.append({"seconds": t2 - t0, "pool_maps": st.pool_maps,
                                 "pool_registrations": st.pool_registrations,
                                 "link_calls": link_calls(ctx) - calls0,
                                 "link_queries": link_queries(ctx) - queries0,
                                 "stall_seconds": st.stall_seconds,
                                 "pool_capacity": st.pool_capacity})
            if s >= (2 if mode == "quickstart" else 1):
                rows.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "base": base,
                             "forward_peak": fwd, "backward_peak": bwd})
        res = {"steps": rows, "per_step": per_step}
        if ctx is not None:
            res["stats"] = ctx.stats().as_dict()
        r[mode] = res
        step = statistics.median(x["forward_s"] + x["backward_s"] for x in rows)
        peak = max(max(x["forward_peak"][0] or 0, x["backward_peak"][0] or 0) for x in rows)
        extra = ""
        if ctx is not None:
            st = res["stats"]
            extra = (f"; stalls {st['stall_seconds']:.3f} s, prefetch "
                     f"{st['prefetch_hits']}/{st['prefetch_misses']}, from source "
                     f"{st['unpacks_from_source']}")
        p.mark(True, f"{mode}: {step:.3f} s per step, peak allocated {peak / GiB:.2f} GiB "
               f"(forward / backward apart in probe.json){extra}")
        if per_step:
            p.say("  per step: " + "; ".join(
                f"{x['seconds']:.3f} s, {x['pool_maps']} maps, {x['pool_registrations']} "
                f"registrations, {x['link_calls']} link calls ({x['link_queries']} queries), "
                f"stalls {x['stall_seconds']:.3f} s,"
                f" pool {x['pool_capacity'] / GiB:.2f} GiB" for x in per_step))
        if mode == "quickstart":
            late = per_step[2:]
            p.mark(all(x["pool_maps"] == 0 and x["pool_registrations"] == 0 for x in late),
                   "quickstart: no pool mapped or registered from the third step on")
        del ctx
    return r


# ---- capture, streams, verify -------------------------------------------------------------------


def check_capture(p: Probe) -> Dict[str, Any]:
    if p.dry:
        p.mark(True, "graph capture needs CUDA: covered on the CPU by test_device_link.py")
        return {"skipped": "dry run"}
    r: Dict[str, Any] = {}
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes="1GiB")
    with ctx:  # eager step first
        (x @ w).relu().sum().backward()
    g = torch.cuda.CUDAGraph()
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            (x @ w).relu()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g), ctx:
            y = (x @ w).relu()
        g.replay()
        torch.cuda.synchronize()
        r["forward_after_eager"] = "ok"
    except Exception as e:  # noqa: BLE001
        r["forward_after_eager"] = f"{type(e).__name__}: {e}"
    p.mark(r["forward_after_eager"] == "ok",
           f"forward captured after an eager step: {r['forward_after_eager']}")
    fresh = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes="64MiB")
    g2 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g2), fresh:
            (x @ w).relu()
        r["first_step_captured"] = "no error"
    except RuntimeError as e:
        r["first_step_captured"] = str(e)
    p.mark("once eagerly" in r["first_step_captured"],
           f"a first step under capture: {r['first_step_captured'][:120]}")
    del y
    return r


def check_streams(p: Probe) -> Dict[str, Any]:
    from llama import Llama

    dev = device(p)
    torch.manual_seed(0)
    dims = dict(vocab=512, d=256, layers=4, heads=4, ffn=512, seq=256)
    model = Llama(**dims).to(dev)
    idx = torch.randint(0, 512, (2, 256), device=dev)
    model(idx, idx).backward()
    ref = [q.grad.clone() for q in model.parameters()]
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes="256MiB")
    side = torch.cuda.Stream() if not p.dry else None
    ok = True
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with ctx:
            if side is not None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    loss = model(idx, idx)
                torch.cuda.current_stream().wait_stream(side)
            else:
                loss = model(idx, idx)
        loss.backward()
        ok &= all(torch.equal(q.grad, g) for q, g in zip(model.parameters(), ref))
    p.mark(ok, "forward on a side stream, backward on the default: gradients bitwise "
           f"{'equal' if ok else 'DIFFERENT'} over 3 steps")
    return {"bitwise": ok}


def check_verify(p: Probe) -> Dict[str, Any]:
    from spillover.models import GPT, GPTConfig, synthetic_batch

    dev = device(p)
    cfg = GPTConfig(vocab=512, d_model=256, n_heads=4, n_layers=4, seq=256)
    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    idx, tgt = (t.to(dev) for t in synthetic_batch(cfg, batch=4))
    kw: Dict[str, Any] = dict(min_offload_bytes=0, host_pool_bytes="256MiB")
    if p.dry:
        kw["sim_link_bandwidth"] = 8e9
    times: Dict[bool, List[float]] = {False: [], True: []}
    ctxs = {v: spillover.offload_context("host", verify=v, **kw) for v in (False, True)}
    for s in range(4):
        for v, ctx in ctxs.items():
            model.zero_grad(set_to_none=True)
            sync(p)
            t0 = time.perf_counter()
            with ctx:
                loss = model(idx, tgt)
            loss.backward()
            sync(p)
            if s:
                times[v].append(time.perf_counter() - t0)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    p.mark(True, f"verify on: {on:.3f} s per step against {off:.3f} s off ({on / off:.2f}x), "
           "no mismatch")
    return {"off_s": off, "on_s": on}


CHECKS = [("env", 20, check_env), ("pool", 25, check_pool), ("link", 40, check_link),
          ("optimizer", 50, check_optimizer), ("step", 90, check_steps),
          ("capture", 15, check_capture), ("streams", 15, check_streams),
          ("verify", 20, check_verify), ("estimate", 30, check_estimate)]


def run_apart(p: Probe, name: str, budget: float, args: argparse.Namespace) -> None:
    """Check ``name`` in a process of its own (``--one``): a CUDA error it leaves sticky, or a
    crash, ends that process only. Its figures come back in ``check-NAME.json``."""
    if p.left() < budget:
        p.say(f"\n## {name}: not run (needs ~{budget:.0f} s, {p.left():.0f} s left)")
        p.failed += 1
        return
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--out", p.out,
           "--deadline", f"{p.left():.0f}"] + (["--dry-run"] if p.dry else [])
    t0 = time.monotonic()
    try:
        rc = subprocess.run(cmd, timeout=max(1.0, p.left())).returncode
    except subprocess.TimeoutExpired:
        rc = None
    path = os.path.join(p.out, f"check-{name}.json")
    got: Dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        got = json.load(f)
    with contextlib.suppress(OSError):
        os.remove(path)
    p.results[name] = got.get(name, {"error": f"its process ended with {rc} and no figures"})
    p.results.setdefault("seconds", {})[name] = time.monotonic() - t0
    if rc != 0:
        p.failed += 1
        if not got:
            p.mark(False, f"{name}: its process {'timed out' if rc is None else f'exited {rc}'}"
                   " before writing its figures")
            p.failed -= 1  # counted once
    p.save()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "probe-out"))
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes")
    ap.add_argument("--deadline", type=float, default=270.0, help="seconds for every check")
    ap.add_argument("--only", help="comma-separated checks to run (default all)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # one check, in this process (run_apart)
    args = ap.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        p = Probe(args.out, dry, args.deadline, append=True)
        name, budget, fn = next(c for c in CHECKS if c[0] == args.one)
        p.run(name, 0.0, fn)
        with open(os.path.join(args.out, f"check-{name}.json"), "w") as f:
            json.dump({name: p.results.get(name)}, f, indent=1, default=str)
        return 1 if p.failed else 0
    p = Probe(args.out, dry, args.deadline)
    p.say(f"# spillover GPU probe{' (DRY RUN on the CPU: not GPU figures)' if dry else ''}")
    p.say(f"- started {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, deadline "
          f"{args.deadline:.0f} s")
    only = set(args.only.split(",")) if args.only else None
    for name, budget, _ in CHECKS:
        if only is None or name in only:
            run_apart(p, name, budget, args)
    p.results["meminfo_end"] = meminfo()
    p.results["loss_path"] = spillover.loss.path_line()  # which loss ran; torch, transformers
    p.say(f"- {p.results['loss_path']}")
    p.save()
    p.say(f"\n## total: {'✓ every check passed' if not p.failed else f'✗ {p.failed} failed'} "
          f"in {time.monotonic() - p.t0:.0f} s")
    with tarfile.open(os.path.join(args.out, "probe.tgz"), "w:gz") as tar:
        for f in sorted(os.listdir(args.out)):
            if f not in ("probe.tgz",):
                tar.add(os.path.join(args.out, f), arcname=f)
    for f in os.listdir(args.out):  # one archive and summary.md come back
        if f not in ("probe.tgz", "summary.md", "probe.log"):
            os.remove(os.path.join(args.out, f))
    return 0 if not p.failed else 1


if __name__ == "__main__":
    sys.exit(main())
