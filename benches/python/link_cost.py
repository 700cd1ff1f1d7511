"""Host time per saved tensor through ``offload_context``: what pack and unpack cost the host, on
each link, against the same step without the context, measured in the same run.

A chain of N ops, each saving one tensor of SIZE (``sin`` saves its input), runs forward and
backward; the cost per pack is (forward under the context - forward without) / N, per unpack
the same for backward. Links: ``host`` (plain CPU tensors: one Rust call per pack, nothing in
flight), ``sim`` (the simulated device of rust/link/sim/ with free transfers -- a link of
1e15 B/s -- and, by default, free device calls: what spillover's own code costs), and with
``--device cuda`` the CUDA link. Modes are interleaved round by round; medians and the spread
(min-max over rounds) are printed, with the device calls per pack and per unpack the link
counted (Note [device calls] in rust/link/mod.rs).

Medians of rounds leave out the pauses of Python's garbage collector, which the objects a pack
leaves alive until backward bring on (Note [survivors of a pack] in
spillover/activations/hooks.py): ``--gc-steps N`` (default 150) runs N more steps per link with
the collector on, then off, and prints the mean host time per tensor (pack + unpack, the op
taken out) each way, the collections of the oldest generation, and the collector-tracked
objects one pack leaves alive at the end of forward.

``--call-cost S`` also runs the CPU GPT of recompute_bench.py on the simulated device charging S
host seconds per device call, against free calls: the ratio of their step times says whether a
driver's host cost per call would make the step host-bound.

    python benches/python/link_cost.py                  # host and sim, 4 KiB and 1 MiB
    python benches/python/link_cost.py --call-cost 3e-6 --json out.json
    python benches/python/link_cost.py --device cuda    # on a GPU host
    python benches/python/link_cost.py --large-calls    # device calls at 16-64 MiB too
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

import spillover

try:  # the link's device-call counter (absent before the link moved to Rust)
    from spillover.activations.link import link_for
except ImportError:  # an older spillover: timings only, through the public API
    link_for = None

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20}
FREE = 1e15  # B/s: a simulated link whose copies take no time
CUDA_CAP = int(16e9 * 0.020)  # the CUDA link's default cap (Note [back-pressure] in rust/link)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def chain_step(x: torch.Tensor, n: int, ctx: Any = None) -> tuple:
    """Forward and backward of n ``sin`` ops; (forward seconds, backward seconds)."""
    device = x.device.type
    _sync(device)
    t0 = time.perf_counter()
    if ctx is None:
        h = x
        for _ in range(n):
            h = h.sin()
        loss = h.sum()
    else:
        with ctx:
            h = x
            for _ in range(n):
                h = h.sin()
            loss = h.sum()
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    x.grad = None
    return t1 - t0, t2 - t1


def context(link: str, device: str, call_cost: float) -> Any:
    kw: Dict[str, Any] = dict(min_offload_bytes=0, host_pool_bytes="512MiB")
    if link == "sim":
        kw.update(sim_link_bandwidth=FREE)
        if call_cost:
            kw.update(sim_call_cost=call_cost)
    return spillover.offload_context("host", **kw)


def measure_links(links: List[str], device: str, n: int, rounds: int,
                  call_cost: float) -> List[Dict[str, Any]]:
    rows = []
    for size_name, nbytes in SIZES.items():
        x = torch.randn(nbytes // 4, device=device, requires_grad=True)
        ctxs = {name: context(name, device, call_cost) for name in links}
        times: Dict[str, List[tuple]] = {name: [] for name in ["none", *links]}
        calls: Dict[str, List[int]] = {name: [] for name in links}
        for r in range(rounds + 1):  # round 0 warms every mode up
            for name in ["none", *links]:
                ctx = ctxs.get(name)
                tr = None
                if link_for is not None and name == "sim":
                    tr = link_for("cpu", sim_bandwidth=FREE, sim_call_cost=call_cost)
                elif link_for is not None and name == "cuda":
                    tr = link_for(device)
                c0 = tr.calls if tr is not None else 0
                f, b = chain_step(x, n, ctx)
                if r:
                    times[name].append((f, b))
                    if tr is not None:
                        calls[name].append(tr.calls - c0)
        base_f = [f for f, _ in times["none"]]
        base_b = [b for _, b in times["none"]]
        for name in links:
            fs = [(f - bf) / n * 1e6 for (f, _), bf in zip(times[name], base_f)]
            bs = [(b - bb) / n * 1e6 for (_, b), bb in zip(times[name], base_b)]
            s = ctxs[name].stats()
            per = calls[name][-1] / n if calls[name] else 0.0
            rows.append({
                "link": name, "size": size_name, "n": n,
                "pack_us": statistics.median(fs), "pack_spread": (min(fs), max(fs)),
                "unpack_us": statistics.median(bs), "unpack_spread": (min(bs), max(bs)),
                "offloaded": s.tensors_offloaded, "unpacked": s.tensors_unpacked,
                "device_calls_per_tensor_step": per,
            })
    return rows


def device_calls(n: int, nbytes: int, pool_bytes: Optional[int] = None,
                 cap_bytes: int = 1 << 40) -> Dict[str, float]:
    """Device calls per pack and per unpack on the simulated link: packs counted in forward
    (no cap: no victim waits), unpacks in backward, with every entry's copy landed and no
    source kept (so each unpack brings its bytes back over the link). The pool: 512 MiB, or
    what the step's saves need and a quarter more (the default pool grows to the step's
    size), the larger. ``cap_bytes``: the link's cap (none by default; CUDA's default is
    ``CUDA_CAP``)."""
    bw = FREE * 0.999  # a link of its own
    pool = pool_bytes if pool_bytes is not None else max(512 << 20, n * nbytes * 5 // 4)
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=pool,
                                    sim_link_bandwidth=bw, copy_inflight_bytes=cap_bytes)
    tr = link_for("cpu", sim_bandwidth=bw, cap_bytes=cap_bytes)
    x = torch.randn(nbytes // 4, requires_grad=True)
    chain_step(x, n, ctx)  # warm: the link's events are made and pooled
    c0, q0 = tr.calls, tr.counters()["queries"]
    with ctx:
        h = x
        for _ in range(n):
            h = h.sin()
        loss = h.sum()
    ctx.synchronize()
    tr.release_sources()
    c1, q1 = tr.calls, tr.counters()["queries"]
    loss.backward()
    c2, q2 = tr.calls, tr.counters()["queries"]
    return {"calls_per_pack": (c1 - c0) / n, "calls_per_unpack": (c2 - c1) / n,
            "queries_per_pack": (q1 - q0) / n, "queries_per_unpack": (q2 - q1) / n}


def tracked_per_pack(link: str, n: int) -> float:
    """Collector-tracked objects alive at the end of a forward under the context, per pack,
    beyond the same forward without it (after a youngest-generation pass, which untracks
    tuples of numbers)."""
    import gc

    x = torch.randn(1024, requires_grad=True)
    ctx = context(link, "cpu", 0.0)

    def alive(c: Any) -> int:
        with c if c is not None else torch.enable_grad():
            h = x
            for _ in range(n):
                h = h.sin()
            gc.collect(0)
            count = len(gc.get_objects())
        h.sum().backward()
        x.grad = None
        return count

    chain_step(x, n, ctx)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        return (alive(ctx) - alive(None)) / n
    finally:
        if was:
            gc.enable()


def gc_cost(links: List[str], n: int, steps: int) -> List[Dict[str, Any]]:
    """Per link: the mean host seconds per tensor over ``steps`` chain steps with the
    collector on and off (the same steps without the context taken out), with the
    oldest-generation collections and their seconds."""
    import gc

    x = torch.randn(1024, requires_grad=True)
    ctxs: Dict[str, Any] = {name: context(name, "cpu", 0.0) for name in links}
    ctxs["none"] = None
    seen = {"full": 0, "seconds": 0.0, "t0": 0.0}

    def watch(phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            seen["t0"] = time.perf_counter()
        else:
            seen["seconds"] += time.perf_counter() - seen["t0"]
            seen["full"] += info["generation"] == 2

    gc.callbacks.append(watch)
    rows: Dict[str, Dict[str, Any]] = {}
    try:
        for on in (True, False):
            (gc.enable if on else gc.disable)()
            for name, ctx in ctxs.items():
                chain_step(x, n, ctx)
                seen.update(full=0, seconds=0.0)
                t0 = time.perf_counter()
                for _ in range(steps):
                    chain_step(x, n, ctx)
                row = rows.setdefault(name, {"link": name})
                key = "on" if on else "off"
                row[f"us_gc_{key}"] = (time.perf_counter() - t0) / (steps * n) * 1e6
                if on:
                    row["full_collections"], row["gc_seconds"] = seen["full"], seen["seconds"]
    finally:
        gc.callbacks.remove(watch)
        gc.enable()
    base = rows.pop("none")
    for r in rows.values():
        for key in ("on", "off"):
            r[f"us_gc_{key}"] -= base[f"us_gc_{key}"]
        r["tracked_per_pack"] = tracked_per_pack(r["link"], n)
    return list(rows.values())


def gpt_with_call_cost(call_cost: float, rounds: int) -> Dict[str, Any]:
    """The CPU GPT of recompute_bench.py (SDPA) on the simulated device, free device calls
    against ``call_cost`` seconds each, interleaved: step seconds, medians."""
    from spillover.models import GPT, GPTConfig, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=8192, d_model=256, n_heads=8, n_layers=4, seq=512, attn="sdpa")
    model, (idx, tgt) = GPT(cfg), synthetic_batch(GPTConfig(vocab=8192, seq=512), batch=8)
    ctxs = {
        cost: spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes="1GiB",
                                        sim_link_bandwidth=FREE * (1 + i * 1e-9),
                                        sim_call_cost=cost)
        for i, cost in enumerate((0.0, call_cost))
    }
    times: Dict[float, List[float]] = {c: [] for c in ctxs}
    for r in range(rounds + 1):
        for cost, ctx in ctxs.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with ctx:
                loss = model(idx, tgt)
            loss.backward()
            if r:
                times[cost].append(time.perf_counter() - t0)
    free, charged = statistics.median(times[0.0]), statistics.median(times[call_cost])
    return {"call_cost_s": call_cost, "free_s": free, "charged_s": charged,
            "ratio": charged / free, "free_spread": (min(times[0.0]), max(times[0.0])),
            "charged_spread": (min(times[call_cost]), max(times[call_cost]))}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("-n", type=int, default=400, help="ops in the chain (one save each)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--call-cost", type=float, default=0.0,
                    help="host seconds per simulated device call (also runs the GPT check)")
    ap.add_argument("--gc-steps", type=int, default=150,
                    help="steps per link for the collector's cost (0: not measured)")
    ap.add_argument("--large-calls", action="store_true",
                    help="device calls at 16-64 MiB too (and 44 MiB at CUDA's default cap)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    links = ["cuda"] if args.device == "cuda" else ["host", "sim"]
    torch.manual_seed(0)
    rows = measure_links(links, args.device, args.n, args.rounds, 0.0)
    print(f"host time per saved tensor, {args.n} ops, {args.rounds} interleaved rounds "
          f"(medians, [min, max]); torch {torch.__version__}")
    print(f"{'link':<6}{'size':>6}{'pack us':>10}{'spread':>18}{'unpack us':>11}{'spread':>18}")
    for r in rows:
        ps, us = r["pack_spread"], r["unpack_spread"]
        print(f"{r['link']:<6}{r['size']:>6}{r['pack_us']:>10.1f}"
              f"{f'[{ps[0]:.1f}, {ps[1]:.1f}]':>18}{r['unpack_us']:>11.1f}"
              f"{f'[{us[0]:.1f}, {us[1]:.1f}]':>18}")
    out: Dict[str, Any] = {"rows": rows}
    if args.device == "cpu" and link_for is not None:
        out["device_calls"] = {}
        sizes = [("4KiB", 4 << 10, args.n), ("1MiB", 1 << 20, args.n),
                 ("8MiB", 8 << 20, min(args.n, 48))]
        if args.large_calls:
            # past 8 MiB the steps of the models that save such tensors hold dozens of them (the
            # probe's 1B Llama at seq 4096: 16-44 MiB a save, hundreds a step); ~30 s more here
            sizes += [("16MiB", 16 << 20, min(args.n, 48)), ("32MiB", 32 << 20, min(args.n, 48)),
                      ("64MiB", 64 << 20, min(args.n, 24)),
                      ("44MiB-cuda-cap", 44 << 20, min(args.n, 24))]
        for name, nbytes, n in sizes:
            cap = CUDA_CAP if name.endswith("cuda-cap") else 1 << 40
            calls = out["device_calls"][name] = device_calls(n, nbytes, cap_bytes=cap)
            print(f"device calls at {name}: {calls['calls_per_pack']:.2f} per pack, "
                  f"{calls['calls_per_unpack']:.2f} per unpack (goal <= 3 and <= 4); of them "
                  f"event queries {calls['queries_per_pack']:.2f} / "
                  f"{calls['queries_per_unpack']:.2f}")
    if args.device == "cpu" and args.gc_steps > 0:
        g_rows = gc_cost(links, args.n, args.gc_steps)
        out["gc"] = g_rows
        print(f"with the collector, 4 KiB, {args.gc_steps} steps each: mean us per tensor "
              "(pack + unpack), collector on / off; full collections; tracked objects a pack "
              "leaves alive")
        for r in g_rows:
            print(f"{r['link']:<6}{r['us_gc_on']:>8.1f} /{r['us_gc_off']:>6.1f} us   "
                  f"{r['full_collections']} full ({r['gc_seconds']:.3f} s)   "
                  f"{r['tracked_per_pack']:.2f} per pack")
    if args.call_cost > 0:
        g = gpt_with_call_cost(args.call_cost, max(3, args.rounds // 2))
        out["gpt_call_cost"] = g
        print(f"CPU GPT on the simulated device: {g['free_s']:.3f} s per step with free calls, "
              f"{g['charged_s']:.3f} s at {g['call_cost_s'] * 1e6:.1f} us per call: "
              f"{g['ratio']:.3f}x (goal <= 1.10x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
