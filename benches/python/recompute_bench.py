"""Recompute and offload end to end on CPU: the peak memory of the whole step and step time,
per mode, same run, in two phases:

- memory: a child process with glibc's mmap threshold pinned at 64 KiB, so that freed tensors
  leave RSS at once (the method of e2e_cpu.py). peak = the kernel's RSS high-water mark over
  forward *and* backward (VmHWM, reset through /proc/self/clear_refs before the step) - RSS
  before the step + the whole spillover pool under a context (pre-faulted RAM on a CPU host,
  used or not: the planner charges it so too). Beside it, "held" = RSS after forward - RSS
  before (+ the pool), copies still in flight included. Two rounds: every mode once (the
  auto modes learn, and their budgets are set), then every mode again (auto planned); the
  second round is reported.
- time: this process, glibc's allocator as users have it (the pinned threshold would make
  every large allocation page-fault and slow the modes that allocate most: with it, `none`
  ran slower than `full`). One warm-up round, then --steps rounds; medians. Under glibc's
  default, tensors above 32 MiB (the attention scores here) are fresh page-faulted mappings
  every time in every mode, and step times swing with what the previous mode left in the heap;
  `--allocator cached` takes the page faults out, as a GPU's caching allocator does.

    python benches/python/recompute_bench.py [--layers 6 --d-model 512 --heads 8 --seq 1024
        --batch 4] [--steps 2] [--modes none,full,sac-mm,selective,offload-nvme,auto]
        [--pool 64MiB] [--auto-pool 64MiB] [--explain]

Modes:
  none          the plain model
  full          spillover.wrap(policy="full"): each block saves only its input
  sac-mm        torch's own selective checkpointing saving every matmul output (reference)
  selective     spillover.wrap(policy="selective")
  offload-nvme  spillover.wrap(policy="offload") under offload_context("nvme", pool --pool)
  auto          spillover.wrap(policy="auto") under offload_context("nvme", pool --auto-pool),
                budget = what `full` held after forward in this run (the planner budgets
                that, not the step's peak; the least of rounds 0 and 1: auto learns in round
                0 and plans at the start of round 1)
  auto-sel      the same with budget = what `selective` held (is auto faster at equal memory?)

Modes are interleaved round by round in both phases.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import spillover
from spillover import calibrate
from spillover.config import format_size
from spillover.models import GPT, GPTConfig, synthetic_batch

_libc = ctypes.CDLL("libc.so.6")

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def rss() -> int:
    return psutil.Process().memory_info().rss


def reset_peak_rss() -> None:
    """Start a new RSS high-water mark (Linux >= 4.0: "5" to clear_refs resets VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM in /proc/self/status")


def _sac_mm_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def sac_forward(model: GPT, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    x = model.tok(idx) + model.pos(torch.arange(idx.shape[1]))
    ctx_fn = functools.partial(create_selective_checkpoint_contexts, _sac_mm_policy)
    for blk in model.blocks:
        x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False, context_fn=ctx_fn)
    logits = model.head(model.ln_f(x))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3,
                    help="rounds; each times one step per mode, in a fresh process after its "
                         "warm-up step (two for auto: it learns, then plans)")
    ap.add_argument("--modes",
                    default="none,full,sac-mm,selective,offload-nvme,auto,auto-sel")
    ap.add_argument("--pool", default="64MiB", help="host pool of offload-nvme")
    ap.add_argument("--auto-pool", default="64MiB", help="host pool of auto's NVMe context")
    ap.add_argument("--explain", action="store_true", help="print explain() for each wrap mode")
    ap.add_argument("--phase", choices=("all", "memory", "time"), default="all",
                    help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--allocator", choices=("default", "cached"), default="default",
                    help="time phase: glibc as configured (default), or 'cached': no mmap and "
                         "no trimming, so freed memory is reused without page faults, as a "
                         "GPU's caching allocator does")
    return ap


def measure(args: argparse.Namespace) -> None:
    if args.phase == "memory":
        _libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB: RSS tracks live tensors
    elif args.allocator == "cached":
        _libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: every allocation from the heap
        _libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never give freed memory back
    cfg = GPTConfig(vocab=2048, d_model=args.d_model, n_heads=args.heads,
                    n_layers=args.layers, seq=args.seq)
    torch.manual_seed(0)
    base = GPT(cfg)
    idx, tgt = synthetic_batch(cfg, args.batch)
    modes = args.modes.split(",")
    tmp = tempfile.mkdtemp(prefix="spillover-recompute-bench-")
    machine = calibrate.calibrate(device="cpu")  # before timing: the planner reads it
    if args.phase == "memory":
        print(calibrate.describe(machine), flush=True)

    models = {}
    planners = {}  # auto mode -> (planner, the mode whose memory is its budget)
    for mode in modes:
        if mode in ("none", "sac-mm"):
            models[mode] = base
            continue
        m = GPT(cfg)
        m.load_state_dict(base.state_dict())
        policy = {"full": "full", "selective": "selective", "offload-nvme": "offload"}.get(mode)
        if mode in ("auto", "auto-sel"):
            planner = spillover.Planner(budget_bytes=1)  # set from this run's measurements
            planners[mode] = (planner, "full" if mode == "auto" else "selective")
            policy = planner
        models[mode] = spillover.wrap(m, policy=policy)

    def context(mode):
        if mode == "offload-nvme":
            return spillover.offload_context("nvme", host_pool_bytes=args.pool, nvme_path=tmp)
        if mode in ("auto", "auto-sel"):
            return spillover.offload_context("nvme", host_pool_bytes=args.auto_pool,
                                             nvme_path=tmp)
        return None

    def step_once(mode, measure_memory):
        model = models[mode]
        model.zero_grad(set_to_none=True)
        gc.collect()
        if measure_memory:
            _libc.malloc_trim(0)
        ctx = context(mode)
        before = rss()
        if measure_memory:
            reset_peak_rss()
        t0 = time.perf_counter()
        if ctx is not None:
            with ctx:
                loss = model(idx, tgt)
        elif mode == "sac-mm":
            loss = sac_forward(model, idx, tgt)
        else:
            loss = model(idx, tgt)
        held = rss() - before  # copies still in flight hold their sources: counted
        loss.backward()
        dt = time.perf_counter() - t0
        peak = peak_rss() - before if measure_memory else 0
        if ctx is not None:
            pool = ctx.stats().pool_capacity  # pre-faulted RAM whether in use or not
            held += pool
            peak += pool
        return dt, peak, held

    if args.phase == "memory":
        # Round 0: every mode once (auto learns; the budgets come from it); round 1: what each
        # holds, auto now planned.
        least_held: dict = {}
        peak_by, held_by = {}, {}
        for step in range(2):
            for mode in modes:
                dt, peak, held = step_once(mode, True)
                least_held[mode] = min(least_held.get(mode, held), held)
                for planner, ref in planners.values():
                    if ref == mode:  # the planner budgets what forward leaves held (issue 15)
                        planner.budget_bytes = least_held[mode]
                peak_by[mode], held_by[mode] = peak, held
                print(f"  memory round {step} {mode:<13} peak {peak / 2**20:8.0f} MiB, held "
                      f"after forward {held / 2**20:8.0f} MiB", flush=True)
        budgets = {m: planners[m][0].budget_bytes for m in planners}
        with open(args.json, "w") as f:
            json.dump({"peak": peak_by, "held": held_by, "budgets": budgets}, f)
        if args.explain:
            for m in modes:
                if m in ("selective", "auto", "auto-sel"):
                    print(f"\n== explain: {m}")
                    print(spillover.explain(models[m]))
        return

    # phase "time": one mode, in steady state (as a training loop runs it).
    (mode,) = modes
    if mode in planners:
        planners[mode][0].budget_bytes = args.budget
    for _ in range(2 if mode in planners else 1):  # auto: learn, then planned
        step_once(mode, False)
    dt, _, _ = step_once(mode, False)
    with open(args.json, "w") as f:
        json.dump({"t": dt}, f)


def child(args: list) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as jf:
        subprocess.run([sys.executable, __file__, "--json", jf.name, *args], check=True)
        with open(jf.name) as f:
            return json.load(f)


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.phase != "all":
        measure(args)
        return
    modes = args.modes.split(",")
    shape = ["--layers", str(args.layers), "--d-model", str(args.d_model), "--heads",
             str(args.heads), "--seq", str(args.seq), "--batch", str(args.batch), "--pool",
             args.pool, "--auto-pool", args.auto_pool, "--allocator", args.allocator]
    # Memory first, in a child whose allocator is pinned (see the module docstring); then each
    # timed step in a child of its own that runs one mode only, round by round.
    mem_run = child(["--phase", "memory", "--modes", args.modes, *shape]
                    + (["--explain"] if args.explain else []))
    results = {m: {"t": [], "mem": [mem_run["peak"][m]]} for m in modes}
    for step in range(args.steps):
        for mode in modes:
            budget = (["--budget", str(mem_run["budgets"][mode])]
                      if mode in mem_run["budgets"] else [])
            dt = child(["--phase", "time", "--modes", mode, *shape, *budget])["t"]
            results[mode]["t"].append(dt)
            print(f"  time round {step} {mode:<13} {dt:6.2f} s", flush=True)
    budgets = mem_run["budgets"]

    med = {m: (statistics.median(r["t"]), statistics.median(r["mem"]))
           for m, r in results.items()}
    base_t, base_m = med.get("none", (float("nan"), float("nan")))
    full_t, full_m = med.get("full", (float("nan"), float("nan")))
    print(f"\nGPT {args.layers}x{args.d_model}, {args.heads} heads, seq {args.seq}, batch "
          f"{args.batch}, fp32, CPU ({torch.get_num_threads()} threads); medians of "
          f"{args.steps} rounds, allocator {args.allocator}")
    head = ("mode", "step s", "spread", "x none", "x full", "peak MiB", "x none", "x full",
            "held MiB")
    print(f"{head[0]:<13} {head[1]:>7} {head[2]:>11} {head[3]:>7} {head[4]:>7} {head[5]:>9} "
          f"{head[6]:>7} {head[7]:>7} {head[8]:>9}")
    for m in modes:
        t, mem = med[m]
        lo, hi = min(results[m]["t"]), max(results[m]["t"])
        print(f"{m:<13} {t:7.2f} {lo:5.2f}-{hi:<5.2f} {t / base_t:7.2f} {t / full_t:7.2f} "
              f"{mem / 2**20:9.0f} {mem / base_m:7.2f} {mem / full_m:7.2f} "
              f"{mem_run['held'][m] / 2**20:9.0f}")
    print("peak MiB: the RSS high-water mark of the whole step (forward and backward) over RSS "
          "before it, + the whole pool of a context; held MiB: RSS after forward (+ the pool), "
          "copies in flight included. spread: fastest-slowest round.")
    if "offload-nvme" in med and "full" in med and "none" in med:
        t, mem = med["offload-nvme"]
        print(f"goal offload-nvme ({args.pool} pool): peak {mem / full_m:.2f}x full's (<= 1.0x), "
              f"time {t / base_t:.2f}x none (<= 1.0x)")
    if "selective" in med and "none" in med:
        t, mem = med["selective"]
        print(f"selective: peak {mem / base_m:.0%} of none, time {t / base_t:.2f}x none")
    if "auto" in med and "full" in med:
        t, mem = med["auto"]
        print(f"auto: peak {mem / full_m:.2f}x full's (budget "
              f"{format_size(budgets['auto'])}), time {t / full_t:.2f}x full")
    if "auto-sel" in med and "selective" in med:
        t, mem = med["auto-sel"]
        sel_t, sel_m = med["selective"]
        print(f"auto-sel: memory {mem / sel_m:.2f}x selective's (budget "
              f"{format_size(budgets['auto-sel'])}), time "
              f"{t / sel_t:.2f}x selective")


if __name__ == "__main__":
    main()
