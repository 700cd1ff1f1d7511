"""End-to-end on CPU: activation memory held after forward and step time, per mode, same run.

    python benches/python/e2e_cpu.py [--layers 6 --d-model 512 --heads 8 --seq 1024 --batch 4]
                                     [--steps 3] [--pool 256MiB] [--modes none,full,torchsave,nvme]

Modes: none (plain), full (torch.utils.checkpoint per block), torchsave (a naive hook that
torch.save()s every saved tensor to a file and loads it back), nvme (spillover tier nvme with a
host pool far smaller than the activations), host (spillover host tier). Memory is RSS after
forward minus RSS before it, plus, for spillover, the pool bytes in use after forward (the pool
is pre-faulted, so RSS alone would hide it). Ratios are against `none` from the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import io
import os
import statistics
import tempfile
import time

import psutil
import torch
from torch.utils.checkpoint import checkpoint

import spillover
from spillover.models import GPT, GPTConfig, synthetic_batch

_libc = ctypes.CDLL("libc.so.6")
# Large blocks from mmap, returned to the OS on free: RSS then tracks live tensors instead of
# what glibc keeps cached from an earlier step (which made deltas read 0 for later modes).
_libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB (also disables its dynamic growth)


def rss() -> int:
    return psutil.Process().memory_info().rss


class TorchSaveHooks:
    def __init__(self, folder: str):
        self.folder = folder
        self.n = 0

    def pack(self, t):
        if t.numel() * t.element_size() < (1 << 20):
            return t
        path = os.path.join(self.folder, f"{self.n}.pt")
        self.n += 1
        torch.save(t, path)
        return path

    def unpack(self, p):
        if isinstance(p, torch.Tensor):
            return p
        with open(p, "rb") as f:
            t = torch.load(io.BytesIO(f.read()))
        os.unlink(p)
        return t


def forward(model, idx, tgt, mode, args, tmp):
    if mode == "full":
        s = idx.shape[1]
        x = model.tok(idx) + model.pos(torch.arange(s))
        for blk in model.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        logits = model.head(model.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten()), None
    if mode == "torchsave":
        h = TorchSaveHooks(tmp)
        with torch.autograd.graph.saved_tensors_hooks(h.pack, h.unpack):
            return model(idx, tgt), None
    if mode in ("nvme", "host"):
        ctx = spillover.offload_context(mode, host_pool_bytes=args.pool, nvme_path=tmp)
        with ctx:
            loss = model(idx, tgt)
        return loss, ctx
    return model(idx, tgt), None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per mode (+1 warm-up)")
    ap.add_argument("--pool", default="256MiB")
    ap.add_argument("--modes", default="none,full,torchsave,nvme")
    args = ap.parse_args()
    cfg = GPTConfig(vocab=2048, d_model=args.d_model, n_heads=args.heads,
                    n_layers=args.layers, seq=args.seq)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = synthetic_batch(cfg, args.batch)
    modes = args.modes.split(",")
    results = {m: {"t": [], "mem": [], "hit": []} for m in modes}
    tmp = tempfile.mkdtemp(prefix="spillover-e2e-")
    # Interleave modes round by round so drift (disk, thermal) hits all of them alike.
    for step in range(args.steps + 1):
        for mode in modes:
            model.zero_grad(set_to_none=True)
            gc.collect()
            _libc.malloc_trim(0)
            before = rss()
            t0 = time.perf_counter()
            loss, ctx = forward(model, idx, tgt, mode, args, tmp)
            held = rss() - before
            if ctx is not None:
                held += ctx._pool.stats()["in_use"]
            loss.backward()
            dt = time.perf_counter() - t0
            if step > 0:
                results[mode]["t"].append(dt)
                results[mode]["mem"].append(held)
                if ctx is not None:
                    results[mode]["hit"].append(ctx.stats().prefetch_hit_rate)
            print(f"  step {step} {mode:<10} {dt:6.2f} s  {held / 2**20:8.0f} MiB", flush=True)
            del loss, ctx
    base_t = statistics.median(results["none"]["t"]) if "none" in results else None
    base_m = statistics.median(results["none"]["mem"]) if "none" in results else None
    print(f"\nGPT {args.layers}x{args.d_model}, {args.heads} heads, seq {args.seq}, batch "
          f"{args.batch}, fp32, CPU ({torch.get_num_threads()} threads); pool {args.pool}; "
          f"medians of {args.steps} steps")
    head = ("mode", "step s", "x none", "act MiB", "x none", "prefetch hit")
    print(f"{head[0]:<10} {head[1]:>8} {head[2]:>7} {head[3]:>9} {head[4]:>7} {head[5]:>13}")
    for m in modes:
        t = statistics.median(results[m]["t"])
        mem = statistics.median(results[m]["mem"])
        hit = results[m]["hit"]
        print(f"{m:<10} {t:8.2f} {t / base_t if base_t else float('nan'):7.2f} "
              f"{mem / 2**20:9.0f} {mem / base_m if base_m else float('nan'):7.2f} "
              f"{(f'{statistics.median(hit):.0%}' if hit else '-'):>13}")


if __name__ == "__main__":
    main()
