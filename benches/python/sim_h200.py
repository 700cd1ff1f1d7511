"""The modes on a simulated H200 (Note [the simulated H200] in spillover/simh200.py): the CPU GPT
on the simulated device with its link set so that forward makes saved bytes 4.9x faster than
the link moves them and the host's time per offload is 0.34 of the compute per offloaded tensor,
as on the H200. Prints the ratios it ran at, then per mode (interleaved rounds, medians and the
spread) the step's time against none's and its device peak (the live tensor storages of the
whole step, from the CPU allocator's events: the simulated device's memory) against none's.

    python benches/python/sim_h200.py                      # GPT 4x256, seq 512, batch 4
    python benches/python/sim_h200.py --attn sdpa --rounds 3 --layers 6

Modes: none; full (wrap's full recomputation); selective (wrap's); host (every saved tensor
through the simulated link, a new context each step, defaults: the Quick start); auto at full's
peak and at 0.7x none's (wrap(policy="auto", budget_bytes=...) under the same context).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch

import spillover
from spillover import simh200
from spillover.activations.link import link_for
from spillover.estimate.measured import allocator_events, peak_of
from spillover.models import GPT, GPTConfig, synthetic_batch

FREE = 1e15  # a simulated link whose copies take no time


def step(model: torch.nn.Module, batch: Tuple[Any, Any], ctx: Any = None) -> Tuple[float, float]:
    """One forward and backward: (forward seconds, step seconds)."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    if ctx is None:
        loss = model(*batch)
    else:
        with ctx:
            loss = model(*batch)
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t0


def measure(args: argparse.Namespace, model: torch.nn.Module,
            batch: Tuple[Any, Any]) -> simh200.SimH200:
    """Note [the simulated H200]: what the CPU step measures, and the settings from it."""
    fwd, st = [], []
    for _ in range(args.rounds):
        f, s = step(model, batch)
        fwd.append(f)
        st.append(s)
    bw = FREE + 1
    tr = link_for("cpu", sim_bandwidth=bw, sim_lag=0.0)
    free_steps, calls, offloads, saved = [], [], 0, 0
    for _ in range(args.rounds):
        ctx = spillover.offload_context("host", sim_link_bandwidth=bw, min_offload_bytes=0)
        c0 = tr.calls
        _, s = step(model, batch, ctx)
        free_steps.append(s)
        calls.append(tr.calls - c0)
        stats = ctx.stats()
        offloads, saved = stats.tensors_offloaded, stats.bytes_offloaded
    if not offloads:
        sys.exit("sim_h200: nothing was offloaded; use a larger model (--d-model, --seq)")
    host = (statistics.median(free_steps) - statistics.median(st)) / offloads
    return simh200.settings(statistics.median(fwd), statistics.median(st), saved, offloads,
                            host, statistics.median(calls) / offloads)


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--attn", default="explicit", choices=["explicit", "sdpa"])
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, d_model=args.d_model, n_heads=4, n_layers=args.layers,
                    seq=args.seq, attn=args.attn)
    base = GPT(cfg)
    batch = synthetic_batch(cfg, batch=args.batch)
    step(base, batch)  # warm-up
    sim = measure(args, base, batch)
    print(f"GPT {args.layers}x{args.d_model}, seq {args.seq}, batch {args.batch}, {args.attn}; "
          f"torch {torch.__version__}")
    print(sim.describe())
    mach = spillover.planner.machine_for("cpu")
    print(f"planner's calibration of this CPU: matmul {mach.flops_per_s('float32') / 1e9:.0f} "
          f"GFLOP/s, elementwise {mach.elementwise_bytes_per_s / 1e9:.1f} GB/s, "
          f"{mach.host_seconds_per_op * 1e6:.1f} us per region op (a stale one plans wrongly: "
          "`python -m spillover bench` measures again)")
    kw = dict(sim.context_kwargs(), min_offload_bytes=0)  # every saved tensor, as measured

    def peak(fn: Callable[[], Any]) -> int:
        return peak_of(allocator_events(fn))

    none_peak = peak(lambda: step(base, batch))
    models: Dict[str, Tuple[torch.nn.Module, bool]] = {"none": (base, False)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in ("full", "selective"):
            m = copy.deepcopy(base)
            spillover.wrap(m, policy=mode, chunked_loss=False)
            models[mode] = (m, False)
        models["host"] = (base, True)
        full_peak = peak(lambda: step(models["full"][0], batch))
        budgets = {"auto@full": full_peak, "auto@0.7none": int(0.7 * none_peak)}
        plans: Dict[str, str] = {}
        for name, budget in budgets.items():
            planner = spillover.Planner(budget_bytes=budget)
            m = copy.deepcopy(base)
            spillover.wrap(m, policy=planner, chunked_loss=False)
            models[name] = (m, True)
            for _ in range(6):  # auto's learning step and its tuning steps settle
                step(m, batch, spillover.offload_context("host", **kw))
            plans[name] = planner.plan.variant if planner.plan is not None else "-"
    times: Dict[str, List[float]] = {k: [] for k in models}
    peaks: Dict[str, int] = {}
    for r in range(args.rounds):  # interleaved: every mode once per round
        for name, (m, offload) in models.items():
            ctx = spillover.offload_context("host", **kw) if offload else None
            times[name].append(step(m, batch, ctx)[1])
            if r == 0:
                ctx = spillover.offload_context("host", **kw) if offload else None
                peaks[name] = peak(lambda m=m, ctx=ctx: step(m, batch, ctx))
    t_none = statistics.median(times["none"])
    print(f"{'mode':14} {'step s':>8} {'spread':>16} {'x none':>7} {'peak MiB':>9} "
          f"{'x none':>7}")
    for name in models:
        t = times[name]
        print(f"{name:14} {statistics.median(t):8.3f} [{min(t):6.3f}, {max(t):6.3f}] "
              f"{statistics.median(t) / t_none:7.2f} {peaks[name] / 2**20:9.1f} "
              f"{peaks[name] / none_peak:7.2f}")
    fixed = ("none", "full", "selective", "host")
    for name, budget in budgets.items():  # auto's Pareto points against the fixed modes
        fits = [f for f in fixed if peaks[f] <= budget]
        best = min(fits, key=lambda f: statistics.median(times[f]), default=None)
        vs = (f"{statistics.median(times[name]) / statistics.median(times[best]):.2f}x {best}"
              if best else "no fixed mode fits")
        print(f"{name}: budget {budget / 2**20:.1f} MiB, peak {peaks[name] / budget:.3f}x "
              f"of it; time {vs} (the fastest fixed mode within it); plan "
              f"{plans[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
