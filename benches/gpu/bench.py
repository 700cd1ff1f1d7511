"""GPU benchmark: a Llama-style ~1B model in bf16 at long sequence, peak memory and tokens/s
per mode, all in one run (ratios against `none` from the same run).

    python benches/gpu/bench.py --out DIR [--seq 4096] [--layers 16] [--steps 4]
    python benches/gpu/bench.py --tiny --device cpu     # smoke test of the script itself

Modes: none; full (torch.utils.checkpoint per layer); save_on_cpu
(torch.autograd.graph.save_on_cpu(pin_memory=True)); spillover host / nvme / auto
(offload_context with that tier). Peak memory is torch.cuda.max_memory_allocated over a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import spillover


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q1, q2 = q.chunk(2, dim=-1)
    return torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=-1)


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, ffn, bias=False)
        self.up = nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k = rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin)
        a = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        self.ckpt = False

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        dt = self.embed.weight.dtype
        cos, sin = self.cos[:s].to(dt), self.sin[:s].to(dt)
        x = self.embed(idx)
        for layer in self.layers:
            if self.ckpt:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())


def mode_context(mode: str, args: Any):
    if mode == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if mode in ("host", "nvme", "auto"):
        kw: Dict[str, Any] = {"host_pool_bytes": args.pool}
        if args.nvme_path:
            kw["nvme_path"] = args.nvme_path
        return spillover.offload_context(mode, **kw)
    return None


def run(args: Any) -> Dict[str, Any]:
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Llama(args.vocab, args.d_model, args.layers, args.heads, args.ffn, args.seq)
    model = model.to(dev, dtype)
    nparams = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(dev)
    inp, tgt = idx[:, :-1], idx[:, 1:]
    print(f"Llama-style {nparams / 1e9:.2f}B params, {args.layers} layers, d {args.d_model}, "
          f"seq {args.seq}, batch {args.batch}, {dtype}, {dev}", flush=True)
    rows: Dict[str, Dict[str, List[float]]] = {m: {"t": [], "peak": []} for m in args.modes}
    grads: Dict[str, List[torch.Tensor]] = {}
    for step in range(args.steps + 1):
        for mode in args.modes:  # interleaved, so drift hits every mode alike
            model.ckpt = mode == "full"
            model.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
            t0 = time.perf_counter()
            ctx = mode_context(mode, args)
            if ctx is None:
                loss = model(inp, tgt)
            else:
                with ctx:
                    loss = model(inp, tgt)
            loss.backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else 0
            if step == 1:
                grads[mode] = [p.grad.detach().clone() for p in model.parameters()]
            if step > 0:
                rows[mode]["t"].append(dt)
                rows[mode]["peak"].append(peak)
            print(f"  step {step} {mode:<12} {dt:7.3f} s  peak {peak / 2**30:6.2f} GiB", flush=True)
            del loss, ctx
    ref = grads.get("none")
    tokens = args.batch * args.seq
    out = {"params": nparams, "seq": args.seq, "batch": args.batch, "device": str(dev),
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "modes": {}}
    base_t = statistics.median(rows["none"]["t"]) if "none" in rows else float("nan")
    base_p = statistics.median(rows["none"]["peak"]) if "none" in rows else float("nan")
    print(f"\n{'mode':<12} {'tok/s':>9} {'x none':>7} {'peak GiB':>9} {'x none':>7} {'grads':>6}")
    for m in args.modes:
        t = statistics.median(rows[m]["t"])
        p = statistics.median(rows[m]["peak"])
        same = ref is not None and all(torch.equal(a, b) for a, b in zip(ref, grads[m]))
        out["modes"][m] = {"step_s": t, "tokens_per_s": tokens / t, "peak_bytes": p,
                           "grads_identical": same}
        print(f"{m:<12} {tokens / t:9.0f} {base_t / t:7.2f} {p / 2**30:9.2f} "
              f"{(p / base_p) if base_p else float('nan'):7.2f} {'✓' if same else '✗':>6}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (+1 warm-up)")
    ap.add_argument("--pool", default="8GiB")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--modes", default="none,full,save_on_cpu,host,nvme,auto")
    ap.add_argument("--tiny", action="store_true", help="a small model, to test the script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.seq, args.layers, args.d_model, args.heads = 128, 2, 64, 4
        args.ffn, args.vocab = 128, 256
        args.pool, args.steps = "64MiB", 1
    args.modes = args.modes.split(",")
    if "none" in args.modes:
        args.modes.remove("none")
    args.modes.insert(0, "none")
    res = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
