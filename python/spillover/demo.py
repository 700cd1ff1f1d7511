"""``python -m spillover demo``: train a small built-in GPT on synthetic data in every mode
spillover offers and show, side by side, step time, peak activation memory, bytes moved per
tier, prefetch hit rate, stall time and whether the gradients are bitwise identical to
training without spillover. A mode that another mode beat on both peak memory and step time in
the same run is marked "dominated by" that mode. Writes a PNG memory timeline and a JSON of the
results.

``--attn`` picks the model's attention: ``explicit`` (the default: softmax(q kᵀ/√d) v written
out, so the s×s scores are saved and there is much for spillover to cut) or ``sdpa``
(``F.scaled_dot_product_attention``, what Hugging Face models run by default: no saved scores,
so less activation memory and smaller savings)."""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import psutil
import torch

from .activations import offload_context
from .config import format_size
from .demo_plot import draw, predict
from .loss import limit_chunk
from .models import ATTENTION_KINDS, GPT, GPTConfig, synthetic_batch

MODES: Dict[str, str] = {
    "none": "no checkpointing, no offload (the reference)",
    "full": "spillover.wrap(policy='full'): recompute every block",
    "selective": "spillover.wrap(policy='selective'): recompute cheap ops, keep matmuls",
    "host": "offload_context('host'): saved activations to the pinned host pool",
    "nvme": "offload_context('nvme'): host pool 1/4 of the activations, the rest on disk",
    "auto": "wrap(policy='auto') + an offload context: the planner, budget = full's peak",
    "adamw": "offload_context('host') + spillover.OffloadAdamW(tier='host')",
}

SIZES = {
    # name: (GPTConfig kwargs, batch)
    "tiny": (dict(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=128), 4),
    "small": (dict(vocab=1024, d_model=256, n_heads=8, n_layers=4, seq=512), 4),
    "medium": (dict(vocab=2048, d_model=512, n_heads=8, n_layers=6, seq=1024), 4),
}


#: Modes left out of the default list on a CPU-only machine: there the host tier moves RAM to
#: RAM, so it can only cost memory and time (pass --modes to run them anyway).
GPU_ONLY_DEFAULTS = ("host", "adamw")


class Allocator:
    """glibc, switched per step (CPU). Memory steps pin the mmap threshold at 64 KiB, so that
    freed tensors leave RSS at once and RSS tracks live bytes; timed steps run with the
    threshold at glibc's own ceiling (32 MiB), as a warmed-up process has it — pinned, every
    large allocation would page-fault and the modes that allocate most (none) would look
    slowest. Both trim the heap before a step, so what an earlier mode freed is not counted
    as free room for a later one."""

    def __init__(self) -> None:
        try:
            self.libc: Any = ctypes.CDLL("libc.so.6")
            _ = self.libc.mallopt, self.libc.malloc_trim
        except (OSError, AttributeError):
            self.libc = None

    def for_memory(self, on: bool) -> None:
        if self.libc is not None:
            self.libc.mallopt(-3, (1 << 16) if on else (32 << 20))  # M_MMAP_THRESHOLD
            self.libc.malloc_trim(0)


class Sampler:
    """Samples memory every ``interval`` seconds on a thread: device memory on CUDA; on CPU
    the process RSS (a context's pool, faulted in before the step, is added in full by
    :func:`run_mode`)."""

    def __init__(self, device: torch.device, interval: float = 0.005):
        self.device = device
        self.interval = interval
        self.samples: List[Tuple[float, int]] = []
        self.marks: Dict[str, float] = {}  # seconds at which forward and backward end
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._t0 = 0.0
        self._thread: Optional[threading.Thread] = None

    def now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._proc.memory_info().rss  # a context's pool is added in full by run_mode

    def __enter__(self) -> Sampler:
        self.base = self.now()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._t0, self.now() - self.base))
            time.sleep(self.interval)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append((time.perf_counter() - self._t0, self.now() - self.base))

    @property
    def peak(self) -> int:
        return max((m for _, m in self.samples), default=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Mode:
    def __init__(self, name: str, base: GPT, device: torch.device, act_bytes: int,
                 swapdir: str, full_peak: int = 0):
        import spillover

        self.name = name
        self.planner: Any = None
        self.model = copy.deepcopy(base).to(device)
        self.ctx_kw: Optional[Dict[str, Any]] = None
        pool = max(64 << 20, 2 * act_bytes)
        if name in ("full", "selective"):
            spillover.wrap(self.model, policy=name)
        elif name == "host" or name == "adamw":
            self.ctx_kw = dict(tier="host", host_pool_bytes=pool)
        elif name == "nvme":
            # A quarter of the activations: most go to disk, yet the largest saved tensor
            # (the attention scores) still fits a few times over for prefetch.
            self.ctx_kw = dict(tier="nvme", host_pool_bytes=max(64 << 20, act_bytes // 4),
                               nvme_path=swapdir)
        elif name == "auto":
            # full checkpointing's peak as the budget (a third of none's without it)
            budget = max(1 << 20, full_peak or act_bytes // 3)
            self.planner = spillover.Planner(budget_bytes=budget)
            spillover.wrap(self.model, policy=self.planner)
            if device.type == "cpu":
                # the pool is this same RAM: a sixteenth of the budget, the rest to disk
                self.ctx_kw = dict(tier="nvme", host_pool_bytes=max(8 << 20, budget // 16),
                                   nvme_path=swapdir)
            else:
                self.ctx_kw = dict(tier="auto", host_pool_bytes=pool, nvme_path=swapdir)
        params = self.model.parameters()
        if name == "adamw":
            self.opt: Any = spillover.OffloadAdamW(params, lr=1e-3, tier="host")
        else:
            self.opt = torch.optim.AdamW(params, lr=1e-3)

    def context(self) -> Any:
        return offload_context(**self.ctx_kw) if self.ctx_kw is not None else None


def _step(mode: Mode, idx: torch.Tensor, tgt: torch.Tensor, device: torch.device,
          sampler: Optional[Sampler]) -> Tuple[Any, float, Any]:
    ctx = mode.context()
    _sync(device)
    if sampler is not None:
        sampler.__enter__()
    t0 = time.perf_counter()
    try:
        if ctx is not None:
            with ctx:
                loss = mode.model(idx, tgt)
        else:
            loss = mode.model(idx, tgt)
        if sampler is not None:
            _sync(device)
            sampler.marks["forward"] = time.perf_counter() - sampler._t0
        loss.backward()
        _sync(device)
    finally:
        if sampler is not None:
            sampler.marks["backward"] = time.perf_counter() - sampler._t0
            sampler.__exit__(None, None, None)
    return loss, time.perf_counter() - t0, ctx


def run_mode(mode: Mode, batches: List[tuple], device: torch.device, alloc: Allocator,
             progress: Callable[[str], None]) -> Dict[str, Any]:
    """Step 0 warms up; then steps alternate: memory (peak sampled, allocator pinned) and time.
    ``auto`` first runs its learning and tuning steps (Note [peak feedback] in planner/tuner.py) on
    the first batch, without an optimizer step, so its steps see the parameters none's did."""
    times, peaks, grads = [], [], []
    stats: Dict[str, float] = {"bytes_offloaded_host": 0, "bytes_offloaded_nvme": 0,
                               "prefetch_hits": 0, "prefetch_misses": 0, "stall_seconds": 0.0}
    timeline: List[Tuple[float, int]] = []
    marks: Dict[str, float] = {}
    planner = mode.planner
    if planner is not None:
        for i in range(planner.TUNING_STEPS + 2):
            if planner.tuned:
                break
            gc.collect()
            alloc.for_memory(True)
            loss, dt, ctx = _step(mode, *batches[0], device, None)
            mode.model.zero_grad(set_to_none=True)
            seeded = " (planned from a trace of the step on fake tensors)" if (
                i == 0 and planner.seeded is not None) else ""
            progress(f"{mode.name:<9} planning {i + 1}  {dt:6.2f} s  "
                     f"{planner.plan.variant if planner.plan else 'learning'}{seeded}")
            del loss, ctx
    for step, (idx, tgt) in enumerate(batches):
        gc.collect()
        memory_step = step % 2 == 1 or len(batches) == 2
        alloc.for_memory(memory_step)
        sampler = Sampler(device) if memory_step else None
        loss, dt, ctx = _step(mode, idx, tgt, device, sampler)
        grads.append([p.grad.detach().clone() for p in mode.model.parameters()])
        mode.opt.step()
        mode.opt.zero_grad(set_to_none=True)
        if step == 0:
            first_params = [p.detach().clone() for p in mode.model.parameters()]
        if step > 0:  # step 0 is warm-up (pool mapping, swap files, allocator growth)
            if sampler is not None:
                # On a CPU host the context's pool is RAM faulted in before the step: counted
                # in full (as the planner and the benchmarks count it).
                pool = ctx.stats().pool_capacity if ctx is not None and device.type == "cpu" \
                    else 0
                peaks.append(sampler.peak + pool)
                timeline = [(t, m + pool) for t, m in sampler.samples]
                marks = dict(sampler.marks)
            if not memory_step or len(batches) == 2:
                times.append(dt)
            if ctx is not None:
                s = ctx.stats()
                for k in stats:
                    stats[k] += getattr(s, k)
        progress(f"{mode.name:<9} step {step + 1}/{len(batches)}  {dt:6.2f} s  "
                 f"{'(memory) ' if memory_step else ''}loss {loss.item():.4f}")
        del loss, ctx
    n = max(1, len(times))
    return {
        "mode": mode.name,
        "step_seconds": statistics.median(times),
        "peak_bytes": statistics.median(peaks),
        "grads": grads,
        "params": first_params,
        "timeline": timeline,
        "marks": marks,
        "bytes_offloaded_host": stats["bytes_offloaded_host"] / n,
        "bytes_offloaded_nvme": stats["bytes_offloaded_nvme"] / n,
        "prefetch_hits": stats["prefetch_hits"],
        "prefetch_misses": stats["prefetch_misses"],
        "stall_seconds": stats["stall_seconds"] / n,
        "uses_context": mode.ctx_kw is not None,
        # Note [loss chunk under a budget] (loss/chunked.py): the cap the plan put on the chunk
        "loss_cap": planner.plan.loss_cap if planner is not None and planner.plan else None,
        "plan_line": _plan_line(planner),
    }


def _plan_line(planner: Any) -> str:
    """One line: which plan ``auto`` follows and why (its variant, the modeled peak against
    the budget, what it recomputes and moves)."""
    plan = planner.plan if planner is not None else None
    if plan is None:
        return ""
    from .config import format_size

    regions = len(plan.regions)
    modes: Dict[str, int] = {}
    for r in plan.regions:
        modes[r.mode] = modes.get(r.mode, 0) + 1
    how = ", ".join(f"{n} region{'s' if n > 1 else ''} {m}" for m, n in modes.items())
    peak = plan.model_peak + (plan.peak_offset or 0)
    why = ("the fastest modeled plan whose peak fits the budget" if plan.fits
           else "no plan fits the budget: the lowest peak")
    return (f"auto chose {plan.variant or 'its plan'} ({how}; {regions} regions): {why} -- "
            f"peak {format_size(peak)} of {format_size(plan.budget or 0)}, recompute "
            f"{plan.recompute_seconds * 1e3:.0f} ms, exposed transfers "
            f"{plan.transfer_seconds * 1e3:.0f} ms modeled per step")


def _check(ref: Dict[str, Any], r: Dict[str, Any]) -> str:
    if r["mode"] == "adamw":
        # Another optimizer: gradients can match only while the parameters do (step 1); its
        # update is checked by the parameters after that step against torch.optim.AdamW's
        # (later steps drift apart through the model, not through the optimizer).
        first = all(torch.equal(a, b) for a, b in zip(ref["grads"][0], r["grads"][0]))
        close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                    for a, b in zip(ref["params"], r["params"]))
        return "✓ step 1 (+AdamW ≈ torch)" if first and close else "✗ DIFFER"
    same = all(torch.equal(a, b) for ga, gb in zip(ref["grads"], r["grads"])
               for a, b in zip(ga, gb))
    return "✓ identical" if same else "✗ DIFFER"


#: How much more a mode must use to count as "more" in :func:`dominated`: peaks repeat to a
#: fraction of a percent; step times move 20-40 % between runs on a shared machine, and a
#: difference inside this margin says nothing about which mode is faster.
PEAK_MARGIN = 0.01
TIME_MARGIN = 0.05


def dominated(rows: List[Dict[str, Any]], peak_margin: float = PEAK_MARGIN,
              time_margin: float = TIME_MARGIN) -> Dict[str, str]:
    """``{mode: other}`` for each mode that ``other`` beat on both counts in the same run: the
    mode's peak memory is more than ``1 + peak_margin`` times the other's and its step time
    more than ``1 + time_margin`` times (``peak_bytes``, ``step_seconds``); a peak below zero
    counts as zero, as the table shows it. Of several such modes, the first in ``rows`` order
    is named. A mode no other beats on both is absent."""
    out: Dict[str, str] = {}
    for r in rows:
        for o in rows:
            if (r["step_seconds"] > o["step_seconds"] * (1 + time_margin)
                    and max(0, r["peak_bytes"]) > max(0, o["peak_bytes"]) * (1 + peak_margin)):
                out[r["mode"]] = o["mode"]
                break
    return out


def _table(rows: List[Dict[str, Any]], device: torch.device) -> str:
    mem_label = "peak act. (device)" if device.type == "cuda" else "peak act. (RSS+pool)"
    head = ["mode", "step s", "x none", mem_label, "x none", "to host", "to NVMe",
            "prefetch hit", "stall s", "gradients", "dominated by"]
    base_t, base_m = rows[0]["step_seconds"], max(1, rows[0]["peak_bytes"])
    beaten = dominated(rows)
    lines = []
    for r in rows:
        hits, misses = r["prefetch_hits"], r["prefetch_misses"]
        ctx = r["uses_context"]
        lines.append([
            r["mode"],
            f"{r['step_seconds']:.3f}",
            f"{r['step_seconds'] / base_t:.2f}",
            format_size(max(0, r["peak_bytes"])),
            f"{max(0, r['peak_bytes']) / base_m:.2f}",
            format_size(r["bytes_offloaded_host"]) if ctx else "-",
            format_size(r["bytes_offloaded_nvme"]) if ctx else "-",
            f"{hits / (hits + misses):.0%}" if hits + misses else "-",
            f"{r['stall_seconds']:.3f}" if ctx else "-",
            r["check"],
            beaten.get(r["mode"], "-"),
        ])
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in lines]
    if beaten:
        out += ["", "dominated by X: X took both less peak memory and less step time in this "
                "run (" + ", ".join(f"{m}: {o}" for m, o in beaten.items()) + ")."]
    return "\n".join(line.rstrip() for line in out)


def _estimate_mode(name: str, act_bytes: int, full_peak: int, device: torch.device
                   ) -> Optional[Dict[str, Any]]:
    """What ``spillover.estimate`` runs for the demo's mode ``name`` (its pool and budget as
    :class:`Mode` sets them); None for a mode it has no counterpart of."""
    if name in ("none", "full", "selective"):
        return {"mode": name}
    if name == "host":
        return {"mode": "host", "pool": max(64 << 20, 2 * act_bytes)}
    if name == "nvme":
        return {"mode": "nvme", "pool": max(64 << 20, act_bytes // 4)}
    if name == "auto":
        budget = max(1 << 20, full_peak or act_bytes // 3)
        pool = max(8 << 20, budget // 16) if device.type == "cpu" else max(64 << 20,
                                                                            2 * act_bytes)
        return {"mode": "auto", "budget": budget, "pool": pool}
    return None


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spillover demo", description=__doc__)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=3,
                   help="training steps per mode (the first is warm-up)")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, from: {', '.join(MODES)} (default: all; on a "
                        f"CPU-only machine all but {', '.join(GPU_ONLY_DEFAULTS)}, whose host "
                        "tier there moves RAM to RAM)")
    p.add_argument("--attn", choices=ATTENTION_KINDS, default="explicit",
                   help="the model's attention: explicit softmax (saves the s×s scores; "
                        "default) or sdpa (F.scaled_dot_product_attention, as Hugging Face "
                        "models run it)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--out", default="spillover-demo", help="folder for the PNG and the JSON")
    p.add_argument("--no-predict", action="store_true",
                   help="leave spillover.estimate's predicted curves out of the PNG")
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.modes is None:
        names = [m for m in MODES if device.type == "cuda" or m not in GPU_ONLY_DEFAULTS]
    else:
        names = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad:
        p.error(f"unknown mode {', '.join(bad)}; choose from {', '.join(MODES)}")
    names = ["none"] + [m for m in names if m != "none"]  # the reference comes first
    cfg_kw, batch = SIZES[args.size]
    # The head and loss through torch's chunked linear_cross_entropy in every mode, "none"
    # included: the loss spillover.wrap gives the model (spillover.loss), so that each mode's
    # gradients can be bitwise those of the same math without spillover.
    cfg = GPTConfig(**cfg_kw, attn=args.attn, chunked_loss=True)
    torch.manual_seed(0)
    base = GPT(cfg)
    nparams = sum(p.numel() for p in base.parameters())
    steps = max(2, args.steps)
    batches = [
        tuple(t.to(device) for t in synthetic_batch(cfg, batch, seed=s)) for s in range(steps)
    ]
    alloc = Allocator()
    swapdir = tempfile.mkdtemp(prefix="spillover-demo-swap-")
    print(f"spillover demo: GPT {cfg.n_layers} layers, d_model {cfg.d_model}, seq {cfg.seq}, "
          f"{cfg.attn} attention, batch {batch}, {nparams / 1e6:.1f}M params, on {device}; "
          f"{steps} steps per mode (the first is warm-up); head + loss by torch's chunked "
          "linear_cross_entropy in every mode (no logits)", flush=True)
    for n in names:
        print(f"  {n:<9} {MODES[n]}")
    if args.modes is None and device.type != "cuda":
        print(f"  ({', '.join(GPU_ONLY_DEFAULTS)} left out: on a CPU-only machine the host tier "
              "moves RAM to RAM; --modes runs them)")
    print(flush=True)
    tty = sys.stdout.isatty()

    def progress(msg: str) -> None:
        if tty:
            print("\r\033[K  " + msg, end="", flush=True)
        else:
            print("  " + msg, flush=True)

    rows: List[Dict[str, Any]] = []
    act_bytes = full_peak = 0
    for name in names:
        mode = Mode(name, base, device, act_bytes, swapdir, full_peak)
        r = run_mode(mode, batches, device, alloc, progress)
        if tty:
            print()
        if name == "none":
            act_bytes = int(r["peak_bytes"])
        if name == "full":
            full_peak = int(r["peak_bytes"])
        cap = r["loss_cap"]
        if cap is not None:
            # The plan shrank the loss chunk to fit its budget (Note [loss chunk under a
            # budget] in loss/chunked.py): another summation order for the head's gradient,
            # so the reference is none run with the same chunk.
            with limit_chunk(cap):
                r["reference"] = run_mode(Mode("none", base, device, 0, swapdir, 0), batches,
                                          device, alloc, lambda _msg: None)
        rows.append(r)
        del mode
    for r in rows:
        r["check"] = _check(r.pop("reference", rows[0]), r)
        if r["check"].startswith("✓") and r["loss_cap"] is not None:
            r["check"] += " (to none with its loss chunk)"
    print()
    print(_table(rows, device))
    for r in rows:
        if r.get("plan_line"):
            print(r["plan_line"])
    os.makedirs(args.out, exist_ok=True)
    wanted = {r["mode"]: _estimate_mode(r["mode"], act_bytes, full_peak, device) for r in rows}
    predicted = {} if args.no_predict else predict(
        base, *batches[0], device, {m: how for m, how in wanted.items() if how is not None},
        lambda msg: print("  " + msg, flush=True))
    png = draw(rows, predicted, os.path.join(args.out, "timeline.png"),
               f"spillover demo: GPT {cfg.n_layers}x{cfg.d_model}, seq {cfg.seq}, {cfg.attn} "
               f"attention, batch {batch}, {device}: memory over each step's start, measured "
               "and predicted", device)
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump({
            "device": str(device), "model": dict(cfg_kw, attn=cfg.attn), "batch": batch,
            "steps": steps, "dominated_by": dominated(rows),
            "modes": {n: MODES[n] for n in names},
            "rows": [{k: v for k, v in r.items() if k not in ("grads", "params")}
                     for r in rows],
        }, f, indent=1)
    print(f"\nwrote {path}" + (f" and {png}" if png else " (matplotlib missing: no PNG)"))
    ok = all(r["check"].startswith("✓") for r in rows)
    if not ok:
        print("spillover demo: gradients differ from training without offload", file=sys.stderr)
    return 0 if ok else 1
