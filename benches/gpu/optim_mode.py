"""The GPU bench's mode ``optim`` (bench.py's docstring): torch's fused AdamW against
OffloadAdamW on a GPT, per way the step's time, memory and what is not hidden (issue 41).

Ways, one after the other in one process: forward + backward alone; torch's fused AdamW (state
on the device); OffloadAdamW's exact default (copies at ``step()``, the bucket pipeline);
``overlap="delayed"`` (the one-step delayed update, Note [delayed update] in
spillover/optim/delayed.py: not the exact update, so its parameter difference from torch's is
expected to be large); and, when it fits the budget, ``update_in_backward=True`` (exact). The
hook-copies way of the first H200 run (4.37x torch's step, against 2.62x for the default) is no
longer timed.

The breakdown, per OffloadAdamW way, summed over the buckets and averaged over the measured
steps: gradient D2H, host update (the kernel's passes: the spaces' ``update_log``) and
parameter H2D, each with the share of it that ran while the device computed the forward or
backward. On CUDA the copies are timed with events on their streams (:class:`Traced`, around
the optimizer's CudaDevice) and the forward and backward with events on the compute stream,
placed on the host's clock by the step's start (each step starts after a synchronize, so the
device is idle there and every copy a step issues has run before the next one starts); on the
CPU (the dry run) the copies are synchronous and untimed: only the update has a figure."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from measure import GiB, Memory, write_json

import spillover

PARTS = ("d2h", "update", "h2d")


class Traced:
    """The optimizer's CudaDevice, each copy between two timing events on its stream:
    ``copies`` holds (``"d2h"`` or ``"h2d"``, host time it was issued, start event, end
    event)."""

    def __init__(self, dev: Any):
        self.dev = dev
        self.copies: List[Tuple[str, float, Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dev, name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        self.dev.copy(dst, src, stream)
        b.record(stream)
        self.copies.append(("d2h" if src.is_cuda else "h2d", time.perf_counter(), a, b))


def _overlap(a: float, b: float, busy: List[Tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def breakdown(opt: Any, trace: Optional[Traced], steps: List[Dict[str, Any]]
              ) -> Dict[str, Dict[str, float]]:
    """Per part: seconds per measured step, and the seconds of it that ran during a forward
    or backward (the module docstring). `steps`, per step: ``host0`` (the host's clock at its
    start), ``ev0`` (an event recorded there, CUDA), ``fwd`` and ``bwd`` (the ends of forward
    and backward: host times, or events). The first step (warm-up) is left out."""
    def at(st: Dict[str, Any], ev: Any) -> float:
        return ev if isinstance(ev, float) else st["host0"] + st["ev0"].elapsed_time(ev) / 1e3

    busy: List[Tuple[float, float]] = []
    for st in steps:
        busy += [(st["host0"], at(st, st["fwd"])), (at(st, st["fwd"]), at(st, st["bwd"]))]
    lo = steps[1]["host0"] if len(steps) > 1 else steps[0]["host0"]
    k = max(1, len(steps) - 1)
    ivs: Dict[str, List[Tuple[float, float]]] = {p: [] for p in PARTS}
    starts = [st["host0"] for st in steps]
    for kind, issued, a, b in trace.copies if trace is not None else []:
        i = max(0, sum(1 for s0 in starts if s0 <= issued) - 1)  # the step that issued it
        ivs[kind].append((at(steps[i], a), at(steps[i], b)))
    for sp in opt._spaces:
        ivs["update"] += [(a, b) for _, a, b in getattr(sp, "update_log", [])]
    out = {}
    for kind, xs in ivs.items():
        xs = [(a, b) for a, b in xs if a >= lo]
        out[kind] = {"s": sum(b - a for a, b in xs) / k,
                     "hidden_s": sum(_overlap(a, b, busy) for a, b in xs) / k}
    return out


def run_optim(args: Any, res: Dict[str, Any], path: Optional[str]) -> List[str]:
    """Mode optim (the module docstring); returns its summary lines."""
    import gc

    from spillover import optim as so
    from spillover.activations.link.cuda import CudaDevice
    from spillover.models import GPT, GPTConfig

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    llama = args.optim_model == "llama"
    if args.tiny:
        cfg, batch = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq=64), 2
    else:
        cfg, batch = GPTConfig(vocab=32000, d_model=768, n_heads=12, n_layers=12, seq=512), 8
    cfg.attn = "sdpa"
    # --optim-model llama: the probe's 1B Llama (llama.py) with bf16 parameters and no
    # autocast; OffloadAdamW keeps their fp32 masters on the host, torch's fused AdamW its
    # state in bf16 on the device (its own way with bf16 parameters)
    dims = (dict(vocab=256, d=64, layers=2, heads=4, ffn=128, seq=64) if args.tiny else
            dict(vocab=32000, d=2048, layers=16, heads=16, ffn=5632, seq=1024))
    if llama:
        batch = 2 if args.tiny else 4
        cfg.vocab, cfg.seq, cfg.n_layers, cfg.d_model = (dims["vocab"], dims["seq"],
                                                         dims["layers"], dims["d"])
    pdtype = torch.bfloat16 if llama else torch.float32

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        if llama:
            from llama import Llama

            with dev:
                return Llama(**dims).to(pdtype)
        with dev:
            return GPT(cfg)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g).to(dev)
            for _ in range(args.steps + 1)]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def mark() -> Any:
        if not cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    mem = Memory(cuda)
    res["memory_counter"] = mem.kind
    finals: Dict[str, List[torch.Tensor]] = {}
    exact = "OffloadAdamW(host)"
    delayed = "OffloadAdamW(host, overlap=delayed)"
    inbwd = "OffloadAdamW(host, update_in_backward)"
    # Note [next-gradient prediction]'s cost: the delayed update with the momentum's prediction
    momentum = "OffloadAdamW(host, overlap=delayed, predict_weights=momentum)"
    start = time.perf_counter()
    ways = ("fwd+bwd only", "torch AdamW(fused)", exact, delayed, inbwd, momentum)
    for done, way in enumerate(ways):
        if way in (inbwd, momentum):  # only if it fits the budget, so the table is never lost
            spent = time.perf_counter() - start
            need = spent / done * 1.5  # a way's share of the time so far, with margin
            if spent + need > 0.85 * args.optim_budget:
                res["skipped"] = (f"{way}: {spent:.1f} s spent, about {need:.1f} s more "
                                  f"needed, budget {args.optim_budget:.0f} s")
                print(f"  skipped {res['skipped']}", flush=True)
                break
        model = build()
        n = sum(p.numel() for p in model.parameters())
        res.update(model="llama" if llama else "gpt", param_dtype=str(pdtype), params=n,
                   seq=cfg.seq, batch=batch, layers=cfg.n_layers,
                   d_model=cfg.d_model, device=str(dev), torch=torch.__version__,
                   gpu=torch.cuda.get_device_name() if cuda else "cpu")
        opt: Any = None
        trace: Optional[Traced] = None
        if way.startswith("torch"):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        elif way.startswith("Offload"):
            trace = Traced(CudaDevice(dev)) if cuda else None
            opt = spillover.OffloadAdamW(model.parameters(), lr=1e-4, tier="host",
                                         optim_pool_bytes=int(n * 22) + (256 << 20),
                                         _force_staging=not cuda, _link=trace,
                                         update_in_backward=way == inbwd,
                                         overlap="delayed" if way in (delayed, momentum)
                                         else None,
                                         predict_weights="momentum" if way == momentum
                                         else None)
        rows = []
        marks: List[Dict[str, Any]] = []
        for step, idx in enumerate(data):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            sync()
            mem.reset()
            t0 = time.perf_counter()
            st: Dict[str, Any] = {"host0": t0, "ev0": mark()}
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda and not llama):
                loss = model(idx[:, :-1], idx[:, 1:])
            st["fwd"] = mark()
            phases = [mem.peaks()]  # forward, backward, step(): counters reset between them
            mem.reset()
            loss.backward()
            st["bwd"] = mark()
            t1 = time.perf_counter()  # backward returned (the device may still run it)
            phases.append(mem.peaks())
            mem.reset()
            if opt is not None:
                opt.step()
            t2 = time.perf_counter()
            sync()
            t3 = time.perf_counter()
            marks.append(st)
            phases.append(mem.peaks())
            alloc = [a for a, _ in phases]
            reserved = [r for _, r in phases]
            row = {"step": step, "seconds": t3 - t0, "step_call_s": t2 - t1,
                   "peak_bytes": max(alloc) if None not in alloc else None,
                   "reserved_peak_bytes": max(reserved) if None not in reserved else None,
                   "fwd_peak_bytes": alloc[0], "bwd_peak_bytes": alloc[1],
                   "step_peak_bytes": alloc[2], "fwd_reserved_bytes": reserved[0],
                   "bwd_reserved_bytes": reserved[1], "step_reserved_bytes": reserved[2]}
            if isinstance(opt, spillover.OffloadAdamW):
                row["stats"] = opt.stats()
            rows.append(row)
            print(f"  {way} step {step}{' (warm-up)' if step == 0 else ''}: {t3 - t0:.3f} s, "
                  f"step() {t2 - t1:.3f} s after backward returned", flush=True)
        res.setdefault("ways", {})[way] = rows
        if isinstance(opt, spillover.OffloadAdamW):
            for sp in opt._spaces:  # the delayed update's last passes: logged, then counted
                sp.join()
            sync()
            res.setdefault("breakdown", {})[way] = breakdown(opt, trace, marks)
        # Back to back, no synchronize or counter between steps (the steps above leave the
        # host idle between them, which would give the delayed update's worker free time):
        # the step time the ratios use; the delayed update's last update and copies back
        # are included (flush).
        sync()
        t0 = time.perf_counter()
        for idx in data[1:]:
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda and not llama):
                loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            if opt is not None:
                opt.step()
        if isinstance(opt, spillover.OffloadAdamW):
            opt.flush()  # the parameters compared below hold every update (delayed)
        sync()
        res.setdefault("steady_s", {})[way] = (time.perf_counter() - t0) / len(data[1:])
        print(f"  {way}: {res['steady_s'][way]:.3f} s per step back to back", flush=True)
        if path:
            write_json(path, res)
        if way == exact:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            nbytes = sum(gr.numel() * gr.element_size() for gr in grads)
            sync()
            t0 = time.perf_counter()
            for gr in grads:
                so._fingerprint_parts(gr)
            sync()
            res["fingerprint_gib_s"] = nbytes / (1 << 30) / (time.perf_counter() - t0)
        if opt is not None:
            finals[way] = [p.detach().float().cpu() for p in model.parameters()]
        del model, opt, trace
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def max_diff(way: str) -> float:
        ref = finals["torch AdamW(fused)"]
        return max(float((x - y).abs().max()) for x, y in zip(ref, finals[way]))

    for way in (exact, delayed, inbwd, momentum):
        if way in finals:
            res.setdefault("max_param_diff", {})[way] = max_diff(way)

    def med(way: str, key: str) -> float:
        vals = [r[key] for r in res["ways"][way][1:] if r[key] is not None]
        return sorted(vals)[len(vals) // 2] if vals else float("nan")

    steady = res["steady_s"]
    base_t, base_m = steady["fwd+bwd only"], med("fwd+bwd only", "peak_bytes")
    torch_t = steady["torch AdamW(fused)"]
    amp = ("bf16 parameters, fp32 masters on the host" if llama else
           "bf16 autocast" if cuda else "fp32")
    counter = ("" if mem.kind == "cuda" else
               "; memory: the CPU's stand-in, the process's peak RSS" if mem.kind else
               "; memory: no counter")
    lines = ["", f"{'Llama' if llama else 'GPT'} {n / 1e6:.1f}M parameters ({amp}), batch "
             f"{batch} x seq "
             f"{cfg.seq}, {args.steps} measured steps, {dev}{counter}", "",
             "| way | step s | vs torch fused | optimizer s not hidden | synced step s "
             "| step() s after backward | peak GiB | reserved GiB | fwd / bwd / step() peak GiB "
             "| optimizer GiB on device |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def gib(x: float) -> str:
        return "–" if x != x else f"{x / GiB:.2f}"  # NaN: no memory counter

    for way in res["ways"]:
        t, m = steady[way], med(way, "peak_bytes")
        synced = med(way, "seconds")
        cells = (f"{gib(m)} | {gib(med(way, 'reserved_peak_bytes'))} | "
                 + " / ".join(gib(med(way, k)) for k in
                              ("fwd_peak_bytes", "bwd_peak_bytes", "step_peak_bytes")))
        if way.startswith("fwd"):
            lines.append(f"| {way} | {t:.3f} | | | {synced:.3f} | | {cells} | |")
            continue
        lines.append(f"| {way} | {t:.3f} | {t / torch_t:.2f}x | {t - base_t:.3f} | "
                     f"{synced:.3f} | {med(way, 'step_call_s'):.3f} | {cells} | "
                     f"{gib(m - base_m)} |")
    lines += ["", "Where OffloadAdamW's step goes, ms per step (the share that ran during the "
              "device's forward or backward)" + ("" if cuda else "; on the CPU the copies "
                                                 "are synchronous and untimed") + ":", "",
              "| way | gradient D2H | host update | parameter H2D |",
              "| --- | ---: | ---: | ---: |"]
    for way, b in res.get("breakdown", {}).items():
        cells = []
        for part in PARTS:
            x = b[part]
            cells.append("–" if not x["s"] else
                         f"{x['s'] * 1e3:.1f} ({x['hidden_s'] / x['s'] * 100:.0f} %)")
        lines.append(f"| {way} | " + " | ".join(cells) + " |")
    diffs = ", ".join(f"{w} {d:.2e}" for w, d in res.get("max_param_diff", {}).items())
    lines += ["", f"max |param - torch's| after {2 * args.steps + 1} steps: {diffs} (delayed: "
              "another update, Note [delayed update]"
              + ("; bf16 parameters: torch's AdamW has no fp32 master, so every way differs"
                 if llama else "") + "); fingerprint "
              f"{res.get('fingerprint_gib_s', float('nan')):.2f} GiB/s on {dev}"]
    if momentum not in finals:
        lines.append(f"rows skipped: {res.get('skipped')}")
    return lines
