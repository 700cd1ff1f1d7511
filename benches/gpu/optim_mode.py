"""The GPU bench's mode ``optim`` (bench.py's docstring): torch's fused AdamW against
OffloadAdamW on a GPT, per way the step's time, memory and what is not hidden."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import torch
from measure import GiB, Memory, write_json

import spillover


def run_optim(args: Any, res: Dict[str, Any], path: Optional[str]) -> List[str]:
    """Mode optim (the module docstring); returns its summary lines."""
    import gc

    from spillover import optim as so
    from spillover.models import GPT, GPTConfig

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if args.tiny:
        cfg, batch = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq=64), 2
    else:
        cfg, batch = GPTConfig(vocab=32000, d_model=768, n_heads=12, n_layers=12, seq=512), 8
    cfg.attn = "sdpa"
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g).to(dev)
            for _ in range(args.steps + 1)]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    mem = Memory(cuda)
    res["memory_counter"] = mem.kind
    finals: Dict[str, List[torch.Tensor]] = {}
    inbwd = "OffloadAdamW(host, update_in_backward)"
    # The default copies gradients at step(); the hooks' copies during backward are the other
    # way, timed so a GPU can confirm or overturn the default (Note [staged gradients])
    hooks = "OffloadAdamW(host, hook copies)"
    start = time.perf_counter()
    for way in ("fwd+bwd only", "torch AdamW(fused)", "OffloadAdamW(host)", hooks, inbwd):
        if way == inbwd:  # only if it fits the section's budget, so the table is never lost
            spent = time.perf_counter() - start
            need = spent / 3 * 1.5  # a way's share of the time so far, with margin
            if spent + need > 0.85 * args.optim_budget:
                res["skipped"] = (f"{inbwd}: {spent:.1f} s spent, about {need:.1f} s more "
                                  f"needed, budget {args.optim_budget:.0f} s")
                print(f"  skipped {res['skipped']}", flush=True)
                break
        torch.manual_seed(0)
        with dev:
            model = GPT(cfg)
        n = sum(p.numel() for p in model.parameters())
        res.update(params=n, seq=cfg.seq, batch=batch, layers=cfg.n_layers,
                   d_model=cfg.d_model, device=str(dev), torch=torch.__version__,
                   gpu=torch.cuda.get_device_name() if cuda else "cpu")
        opt: Any = None
        if way.startswith("torch"):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        elif way.startswith("Offload"):
            opt = spillover.OffloadAdamW(model.parameters(), lr=1e-4, tier="host",
                                         optim_pool_bytes=int(n * 22) + (256 << 20),
                                         _force_staging=not cuda,
                                         update_in_backward=way == inbwd,
                                         _hook_copies=way == hooks)
        rows = []
        for step, idx in enumerate(data):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            sync()
            mem.reset()
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(idx[:, :-1], idx[:, 1:])
            phases = [mem.peaks()]  # forward, backward, step(): counters reset between them
            mem.reset()
            loss.backward()
            t1 = time.perf_counter()  # backward returned (the device may still run it)
            phases.append(mem.peaks())
            mem.reset()
            if opt is not None:
                opt.step()
            t2 = time.perf_counter()
            sync()
            t3 = time.perf_counter()
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
        if path:
            write_json(path, res)
        if isinstance(opt, spillover.OffloadAdamW):
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
        del model, opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    def max_diff(way: str) -> float:
        ref = finals["torch AdamW(fused)"]
        return max(float((x - y).abs().max()) for x, y in zip(ref, finals[way]))

    res["max_param_diff"] = max_diff("OffloadAdamW(host)")
    if inbwd in finals:
        res["max_param_diff_inbwd"] = max_diff(inbwd)

    def med(way: str, key: str) -> float:
        vals = [r[key] for r in res["ways"][way][1:] if r[key] is not None]
        return sorted(vals)[len(vals) // 2] if vals else float("nan")

    base_t, base_m = med("fwd+bwd only", "seconds"), med("fwd+bwd only", "peak_bytes")
    amp = "bf16 autocast" if cuda else "fp32"
    counter = ("" if mem.kind == "cuda" else
               "; memory: the CPU's stand-in, the process's peak RSS" if mem.kind else
               "; memory: no counter")
    lines = ["", f"GPT {n / 1e6:.1f}M fp32 parameters ({amp}), batch {batch} x seq "
             f"{cfg.seq}, {args.steps} measured steps, {dev}{counter}", "",
             "| way | step s | optimizer s not hidden | step() s after backward | peak GiB "
             "| reserved GiB | fwd / bwd / step() peak GiB | optimizer GiB on device |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def gib(x: float) -> str:
        return "–" if x != x else f"{x / GiB:.2f}"  # NaN: no memory counter

    for way in res["ways"]:
        t, m = med(way, "seconds"), med(way, "peak_bytes")
        cells = (f"{gib(m)} | {gib(med(way, 'reserved_peak_bytes'))} | "
                 + " / ".join(gib(med(way, k)) for k in
                              ("fwd_peak_bytes", "bwd_peak_bytes", "step_peak_bytes")))
        if way.startswith("fwd"):
            lines.append(f"| {way} | {t:.3f} | | | {cells} | |")
            continue
        lines.append(f"| {way} | {t:.3f} | {t - base_t:.3f} | {med(way, 'step_call_s'):.3f} "
                     f"| {cells} | {gib(m - base_m)} |")
    st = [r["stats"] for r in res["ways"][hooks]]
    copies = [b["grad_copies"] - a["grad_copies"] for a, b in zip(st, st[1:])]
    lines += ["", f"{hooks}: gradient copies per measured step {copies} (units), stale "
              f"{st[-1]['grad_stale_copies']}; fingerprint {res['fingerprint_gib_s']:.2f} GiB/s "
              f"on {dev}; max |param - torch's| after {args.steps + 1} steps "
              f"{res['max_param_diff']:.2e}"]
    if inbwd in finals:
        lines.append(f"update_in_backward (CPU updates during backward, Note [update in "
                     f"backward]): max |param - torch's| {res['max_param_diff_inbwd']:.2e}")
    else:
        lines.append(f"update_in_backward row skipped: {res.get('skipped')}")
    return lines
