"""``python -m spillover demo``: train a small built-in GPT on synthetic data in several modes
and show, side by side, step time, activation memory, bytes moved and whether the gradients are
bitwise identical to training without spillover."""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import psutil
import torch

from .config import format_size
from .context import offload_context
from .models import GPT, GPTConfig, synthetic_batch

MODES = ("none", "host")

SIZES = {
    # name: (GPTConfig kwargs, batch)
    "tiny": (dict(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=128), 4),
    "small": (dict(vocab=1024, d_model=256, n_heads=8, n_layers=4, seq=512), 4),
    "medium": (dict(vocab=2048, d_model=512, n_heads=8, n_layers=6, seq=1024), 4),
}


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _device_mem(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _rss()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Mode:
    def __init__(self, name: str, enter: Callable[[], Any]):
        self.name = name
        self.enter = enter


def _modes(names: List[str], pool_bytes: int) -> List[_Mode]:
    out = []
    for n in names:
        if n == "none":
            out.append(_Mode(n, lambda: None))
        elif n == "host":
            out.append(
                _Mode(n, lambda: offload_context("host", host_pool_bytes=pool_bytes))
            )
        else:
            raise SystemExit(f"spillover demo: unknown mode {n!r}; choose from {', '.join(MODES)}")
    return out


def run_mode(
    mode: _Mode,
    base: GPT,
    batches: List[tuple],
    device: torch.device,
    progress: Callable[[str], None],
) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = copy.deepcopy(base).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, held, grads_per_step = [], [], []
    stats: Dict[str, Any] = {}
    timeline: List[tuple] = []
    t_start = time.perf_counter()
    for step, (idx, tgt) in enumerate(batches):
        gc.collect()
        _sync(device)
        before = _device_mem(device)
        t0 = time.perf_counter()
        ctx = mode.enter()
        if ctx is not None:
            with ctx:
                loss = model(idx, tgt)
        else:
            loss = model(idx, tgt)
        _sync(device)
        after_fwd = _device_mem(device)
        timeline.append((time.perf_counter() - t_start, after_fwd - before))
        loss.backward()
        _sync(device)
        dt = time.perf_counter() - t0
        timeline.append((time.perf_counter() - t_start, _device_mem(device) - before))
        grads_per_step.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > 0:  # step 0 is warm-up (pool mapping, allocator growth)
            times.append(dt)
            held.append(after_fwd - before)
        if ctx is not None:
            s = ctx.stats()
            stats = {
                "bytes_offloaded_host": s.bytes_offloaded_host,
                "bytes_offloaded_nvme": s.bytes_offloaded_nvme,
                "bytes_kept": s.bytes_kept,
                "pool_peak": s.pool_peak,
                "stall_seconds": stats.get("stall_seconds", 0.0) + s.stall_seconds,
            }
        progress(f"{mode.name}: step {step + 1}/{len(batches)}  {dt:.2f}s  loss {loss.item():.4f}")
        del loss
    return {
        "mode": mode.name,
        "step_seconds": statistics.median(times) if times else float("nan"),
        "activation_bytes": statistics.median(held) if held else 0,
        "grads": grads_per_step,
        "timeline": timeline,
        **stats,
    }


def _table(rows: List[Dict[str, Any]], device: torch.device) -> str:
    mem_label = "act. mem (device)" if device.type == "cuda" else "act. RSS after fwd"
    head = ["mode", "step s", "x none", mem_label, "to host", "pool peak", "stall s", "grads"]
    base_t = rows[0]["step_seconds"]
    lines = []
    for r in rows:
        lines.append([
            r["mode"],
            f"{r['step_seconds']:.3f}",
            f"{r['step_seconds'] / base_t:.2f}",
            format_size(max(0, r["activation_bytes"])),
            format_size(r.get("bytes_offloaded_host")) if "pool_peak" in r else "-",
            format_size(r.get("pool_peak")) if "pool_peak" in r else "-",
            f"{r['stall_seconds']:.3f}" if "stall_seconds" in r else "-",
            "✓ identical" if r["identical"] else "✗ DIFFER",
        ])
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in lines]
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spillover demo", description=__doc__)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument(
        "--steps", type=int, default=3, help="training steps per mode (the first is warm-up)"
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--out", default="spillover-demo", help="folder for results.json")
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "none" in names:
        names.remove("none")
    names.insert(0, "none")  # the reference every other mode is compared against
    cfg_kw, batch = SIZES[args.size]
    cfg = GPTConfig(**cfg_kw)
    torch.manual_seed(0)
    base = GPT(cfg)
    nparams = sum(p.numel() for p in base.parameters())
    steps = max(2, args.steps)
    batches = [
        tuple(t.to(device) for t in synthetic_batch(cfg, batch, seed=s)) for s in range(steps)
    ]
    # Room for every activation of a step, with margin (scores: 3 per head; the rest ~24 d).
    per_layer = batch * cfg.seq * (cfg.n_heads * cfg.seq * 3 + cfg.d_model * 24) * 4
    pool_bytes = 2 * cfg.n_layers * per_layer
    pool_bytes = max(pool_bytes, 64 << 20)
    print(
        f"spillover demo: GPT {cfg.n_layers} layers, d_model {cfg.d_model}, seq {cfg.seq}, "
        f"batch {batch}, {nparams / 1e6:.1f}M params, on {device}; {steps} steps per mode "
        f"(first is warm-up)",
        flush=True,
    )
    tty = sys.stdout.isatty()

    def progress(msg: str) -> None:
        if tty:
            print("\r\033[K  " + msg, end="", flush=True)
        else:
            print("  " + msg, flush=True)

    rows = []
    for mode in _modes(names, pool_bytes):
        r = run_mode(mode, base, batches, device, progress)
        if tty:
            print()
        rows.append(r)
    ref = rows[0]["grads"]
    for r in rows:
        r["identical"] = all(
            torch.equal(a, b) for ga, gb in zip(ref, r["grads"]) for a, b in zip(ga, gb)
        )
    print()
    print(_table(rows, device))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(
            {
                "device": str(device),
                "model": cfg_kw,
                "batch": batch,
                "steps": steps,
                "rows": [{k: v for k, v in r.items() if k != "grads"} for r in rows],
            },
            f,
            indent=2,
        )
    print(f"\nresults written to {path}")
    ok = all(r["identical"] for r in rows)
    if not ok:
        print("spillover demo: gradients differ from training without offload", file=sys.stderr)
    return 0 if ok else 1
