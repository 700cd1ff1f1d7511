"""The low-bit parts of ``benches/python/optim_bench.py`` (issue 36): ``--parts lowbit`` and
``--parts lowbit-nvme``.

lowbit: host state per parameter and the step time of every ``state_bits`` against fp32
state, at ``--params`` (100M) parameters: fp32 parameters in place (state_bits 32 / 16 / 8),
and bf16 parameters (32 / 16 / 8 with an fp32 master, 8 without one). Every setting gets its
own parameters and state, the gradients are shared (the kernel only reads them); each round
runs every setting once, the rounds cycling through the orders of the settings; the table
gives medians, the spread (min-max over rounds) and the ratio to the fp32-state step of the
same parameter dtype, measured in the same run.

lowbit-nvme: the NVMe tier at ``--nvme-params`` parameters (bf16 with a master, state_bits 32
and 8): bytes read + written per step, their ratio, and the step time of each, interleaved.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import torch
from optim_common import race_spread, sizes, warm

import spillover
from spillover.optim import formats


def _setups(szs: List[int], dtype: torch.dtype, kinds: List[Tuple[str, int, bool]],
            pool_bytes: int) -> Tuple[Dict[str, Callable[[], None]], Dict[str, float], int]:
    """One optimizer per (name, state_bits, master_weights) over its own copy of the
    parameters, the gradients shared; their step functions and stored bytes per parameter."""
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(s, generator=g) * 1e-2).to(dtype) for s in szs]
    start = [torch.randn(s, generator=g).to(dtype) for s in szs]
    steps, per = {}, {}
    n = sum(szs)
    for name, bits, mw in kinds:
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        for p, gr in zip(ps, grads):
            p.grad = gr
        opt = spillover.OffloadAdamW(ps, lr=1e-3, tier="host", host_pool_bytes=pool_bytes,
                                     state_bits=bits, master_weights=mw)
        opt.step()  # the state is made here
        per[name] = opt.stats()["state_bytes"] / n
        steps[name] = opt.step
    return steps, per, n


def _table(times: Dict[str, List[float]], per: Dict[str, float], ref: str) -> List[str]:
    med = {k: statistics.median(v) for k, v in times.items()}
    out = ["| setting | state bytes/param | step ms (median) | spread (min-max) | vs fp32 state |",
           "| --- | --- | --- | --- | --- |"]
    for k, v in times.items():
        out.append(f"| {k} | {per[k]:.2f} | {med[k] * 1e3:.1f} | "
                   f"{min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} | {med[k] / med[ref]:.2f}x |")
    return out


def bench_lowbit(args, pool_bytes: int) -> List[str]:

    szs = sizes(int(args.params), args.tensors)
    # The largest state here: bf16 parameters, 12 + 8 + 6.03 + 2.03 bytes per parameter.
    pool = int(sum(szs) * 29 * 1.05) + (256 << 20)
    out = []
    for dtype, kinds in [
        (torch.float32, [("fp32 params, state_bits=32", 32, True),
                         ("fp32 params, state_bits=16", 16, True),
                         ("fp32 params, state_bits=8", 8, True)]),
        (torch.bfloat16, [("bf16 params + master, state_bits=32", 32, True),
                          ("bf16 params + master, state_bits=16", 16, True),
                          ("bf16 params + master, state_bits=8", 8, True),
                          ("bf16 params, no master, state_bits=8", 8, False)]),
    ]:
        steps, per, n = _setups(szs, dtype, kinds, pool)
        times = race_spread(steps, args.rounds)
        out.append(f"\n### low-bit state, {n / 1e6:.0f}M {str(dtype)[6:]} parameters in "
                   f"{len(szs)} tensors, host tier, {args.rounds} interleaved rounds\n")
        out += _table(times, per, kinds[0][0])
        med = {k: statistics.median(v) for k, v in times.items()}
        eight = kinds[2][0]
        ratio = med[eight] / med[kinds[0][0]]
        out.append(f"\ngoal: 8-bit step <= 1.0x the fp32-state step -> {ratio:.2f}x "
                   f"({'met' if ratio <= 1.0 else 'NOT met'})")
        if dtype == torch.bfloat16:
            out.append(f"goal: bytes/param <= 6.1 (8-bit, master) -> {per[eight]:.2f} "
                       f"({'met' if per[eight] <= 6.1 else 'NOT met'}); <= 2.1 (8-bit, no "
                       f"master) -> {per[kinds[3][0]]:.2f} "
                       f"({'met' if per[kinds[3][0]] <= 2.1 else 'NOT met'})")
        del steps
        gc.collect()
    out.append("\nformat figures (Note [state formats]): " + ", ".join(
        f"{b}/{'master' if m else 'none'} {formats.bytes_per_param(b, m):.2f}"
        for b in formats.STATE_BITS for m in (True, False)))
    return out


def bench_lowbit_nvme(args, pool_bytes: int) -> List[str]:

    szs = sizes(int(args.nvme_params), max(8, args.tensors // 4))
    n = sum(szs)
    d = args.nvme_path or tempfile.mkdtemp(prefix="spillover-lowbit-bench-")
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(s, generator=g) * 1e-2).to(torch.bfloat16) for s in szs]
    opts = {}
    for bits in (32, 8):
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in szs]
        for p, gr in zip(ps, grads):
            p.grad = gr
        opt = spillover.OffloadAdamW(ps, lr=1e-3, tier="nvme", nvme_path=d,
                                     host_pool_bytes=pool_bytes, state_bits=bits)
        opt.step()  # first step: nothing to read yet
        opts[bits] = opt
    before = {b: o.stats() for b, o in opts.items()}
    times: Dict[int, List[float]] = {32: [], 8: []}
    for r in range(args.rounds):
        for b in ((32, 8) if r % 2 == 0 else (8, 32)):
            warm()
            t0 = time.perf_counter()
            opts[b].step()
            times[b].append(time.perf_counter() - t0)
    out = [f"\n### NVMe tier, {n / 1e6:.0f}M bf16 parameters with an fp32 master, dir {d}, "
           f"{args.rounds} interleaved rounds\n",
           "| state_bits | state bytes/param | read + written per step | step s (median) | "
           "spread (min-max) | io wait s/step |",
           "| --- | --- | --- | --- | --- | --- |"]
    moved = {}
    for b, o in opts.items():
        s1, s0 = o.stats(), before[b]
        moved[b] = ((s1["bytes_read"] - s0["bytes_read"])
                    + (s1["bytes_written"] - s0["bytes_written"])) / args.rounds
        wait = (s1["io_wait_seconds"] - s0["io_wait_seconds"]) / args.rounds
        v = times[b]
        out.append(f"| {b} | {s1['state_bytes'] / n:.2f} | {moved[b] / 2**20:.0f} MiB | "
                   f"{statistics.median(v):.3f} | {min(v):.3f}-{max(v):.3f} | {wait:.3f} |")
    ratio = moved[8] / moved[32]
    want = formats.bytes_per_param(8, True) / formats.bytes_per_param(32, True)
    t = statistics.median(times[8]) / statistics.median(times[32])
    out.append(f"\nbytes moved per step, 8-bit / fp32: {ratio:.3f} (the state's own ratio: "
               f"{want:.3f}); step time 8-bit / fp32: {t:.2f}x")
    del opts
    gc.collect()
    return out
