"""``spillover.estimate(device="h200")`` on the GPU probe's 1B Llama against what the H200
measured (issue 40, items 3): each mode's predicted step time and peak beside the probe's
``step`` table, and ``auto``'s plan without a budget, at full checkpointing's peak and at 0.7x
none's, against the fixed modes' predictions. No device needed: the model is built on ``meta``.

The measured table is ``probe-step.json`` of a GPU run (default: the 2026-12-04 H200 run in
``../shared/gpu-2026-12-04/``): per mode the median of forward + backward over its measured
steps, and the peak ``max_memory_allocated`` (weights included) of forward and backward.
The probe ran forward and backward only (``optimizer="none"``), the host mode through a 16 GiB
pool; its ``full`` is torch's checkpointing per layer, the estimate's ``spillover.wrap``'s. It
ran before Note [made again at unpack] (activations/rederive.py), so the accuracy table is
estimated with ``rederive=False``; a row below gives the host mode as this tree runs it.

    python benches/python/estimate_h200.py [--probe PATH] [--no-auto] [--host-us US]
                                           [--headroom]

``--headroom`` prints what bounds auto at full checkpointing's peak (issue 40's goal there:
<= 0.95x full's time): full's traced step at the end of forward, at the start of backward (the
model's tail and loss done, before the first region is rebuilt) and at its peak (the first
region rebuilt, beside every weight's gradient). Whatever a plan keeps beyond full's saves is
held at the start of backward, so the room there bounds it; and what keeping spares: a
region's replay by the planner's model against what running it plainly holds.

``--host-us`` plans auto's rows with another host time per offloaded tensor (pack + unpack)
than the H200's measured 107 us (the Python link of 88f5013): a what-if for a link whose host
time was measured on the simulated device only, printed as such. The accuracy table keeps the
measured figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "gpu"))

from llama import Llama  # noqa: E402

import spillover  # noqa: E402

GiB = 1 << 30
DEFAULT_PROBE = os.path.join(HERE, "..", "..", "..", "shared", "gpu-2026-12-04",
                             "probe-step.json")
DIMS = dict(vocab=32000, d=2048, layers=16, heads=16, ffn=5632, seq=4096)
POOL = "16GiB"  # the probe's host pool


def measured(path: str) -> Dict[str, Dict[str, float]]:
    """mode -> {"seconds", "peak"} of the probe's ``step`` check."""
    with open(path) as f:
        data = json.load(f)["step"]
    out = {}
    for mode, r in data.items():
        if not isinstance(r, dict) or "steps" not in r:
            continue
        steps = r["steps"]
        out[mode] = {
            "seconds": statistics.median(s["forward_s"] + s["backward_s"] for s in steps),
            "peak": max(max(s["forward_peak"][0], s["backward_peak"][0]) for s in steps),
        }
    return out


def model_and_batch(batch: int = 1, chunked_loss: bool = False) -> Any:
    with torch.device("meta"):
        model = Llama(**DIMS).to(torch.bfloat16)
    model.chunked_loss = chunked_loss
    idx = torch.zeros(batch, DIMS["seq"], dtype=torch.long, device="meta")
    return model, idx


def run(modes: Any, budget: Optional[int] = None, device: Any = "h200",
        rederive: Optional[bool] = None, chunked_loss: bool = False) -> Any:
    model, idx = model_and_batch(chunked_loss=chunked_loss)
    return spillover.estimate(model, idx, idx, device=device, optimizer="none", modes=modes,
                              host_pool_bytes=POOL, budget=budget, rederive=rederive)


def phases(none: Any, full: Any) -> Dict[str, int]:
    """Full checkpointing's traced step over the step's start, as ``max_memory_allocated``
    reads it (the estimate's workspace included): at the end of forward, at the start of
    backward (the tail and the loss done, before the first region is rebuilt), at its peak."""
    tr = full.trace
    extra = full.device_peak_bytes - tr.peak - none.trace.base  # workspace, less the start
    fwd_end = tr.marks["forward"]
    # (backward's seed, made with grad enabled, is traced as a recompute op)
    bwd = next(i for i in range(fwd_end, len(tr.ops)) if tr.ops[i].phase == "backward")
    first = next((i for i in range(bwd, len(tr.ops)) if tr.ops[i].phase == "recompute"),
                 len(tr.ops))
    return {"end of forward": tr.live[fwd_end - 1] + extra,
            "start of backward": max(tr.live[fwd_end:first]) + extra,
            "peak": tr.peak + extra}


def headroom(none: Any, full: Any) -> None:
    """``--headroom``: full's step by phase, and what a plan can spare within its peak."""
    at = phases(none, full)
    print("\nfull checkpointing's traced step, over the step's start:")
    for k, v in at.items():
        print(f"  {k}: {v / GiB:.2f} GiB")
    room = at["peak"] - at["start of backward"]
    print(f"  room at the start of backward under full's peak: {room / 2**20:.0f} MiB")
    # the planner's figures, on auto's records at full's budget
    au = run(["none", "auto"], budget=at["peak"])["auto"]
    pl = au.planner
    recs = pl.planned_records
    m = pl.machine_of(recs)
    r = recs[len(recs) // 2]
    ops = [o for o in r.ops if not o.after_stop]
    kernels = sum(m.op_seconds(o) for o in ops)
    replay = m.replay_seconds(r.ops, ops)
    plain = r.input_bytes + r.needed_bytes - r.rederived_bytes
    print(f"  a middle region's replay (the planner's model, Note [a replay's host time is the "
          f"region's]): {replay * 1e3:.2f} ms, its dispatch of {len(ops)} ops, against "
          f"{kernels * 1e3:.2f} ms of kernels; so keeping op outputs in a checkpointed region "
          f"spares nothing here, running it plainly spares its replay and its hooks' "
          f"dispatch ({(replay + m.wrapped_seconds(r.ops)) * 1e3:.2f} ms) for "
          f"{plain / 2**20:.0f} MiB held to backward (its cheap saves made again)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", default=DEFAULT_PROBE)
    ap.add_argument("--no-auto", action="store_true", help="only the accuracy table")
    ap.add_argument("--headroom", action="store_true",
                    help="what bounds auto at full's peak (see the docstring)")
    ap.add_argument("--host-us", type=float, default=None,
                    help="auto's rows: host microseconds per offloaded tensor (what-if)")
    a = ap.parse_args()
    meas = measured(a.probe)
    modes = [m for m in ("none", "full", "host") if m in meas]
    t0 = time.perf_counter()
    # the probe ran before Note [made again at unpack] (activations/rederive.py): its offload
    # context shipped every saved tensor
    est = run(modes + ["selective"], rederive=False)
    print(f"spillover.estimate(device='h200') of the probe's 1B Llama "
          f"({', '.join(f'{k} {v}' for k, v in DIMS.items())}, bf16, batch 1), "
          f"against {os.path.relpath(a.probe)}")
    print("| mode | predicted s | measured s | error | predicted GiB | measured GiB | error |")
    print("|---|---|---|---|---|---|---|")
    worst_t = worst_p = 0.0
    for m in modes:
        e, r = est[m], meas[m]
        et = (e.step_seconds - r["seconds"]) / r["seconds"]
        ep = (e.device_peak_bytes - r["peak"]) / r["peak"]
        worst_t, worst_p = max(worst_t, abs(et)), max(worst_p, abs(ep))
        print(f"| {m} | {e.step_seconds:.3f} | {r['seconds']:.3f} | {100 * et:+.1f} % | "
              f"{e.device_peak_bytes / GiB:.2f} | {r['peak'] / GiB:.2f} | {100 * ep:+.1f} % |")
    s = est["selective"]
    print(f"| selective | {s.step_seconds:.3f} | - | - | {s.device_peak_bytes / GiB:.2f} | - | - |")
    if "host" in meas:  # this tree's default: cheap saved tensors made again at unpack
        h = run(["host"])["host"]
        print(f"| host, made again at unpack (default since) | {h.step_seconds:.3f} | - | - | "
              f"{h.device_peak_bytes / GiB:.2f} | - | - |")
    print(f"worst: time {100 * worst_t:.1f} % (goal 10), peak {100 * worst_p:.1f} % (goal 5) "
          f"[{time.perf_counter() - t0:.0f} s]")
    if a.headroom:
        headroom(est["none"], est["full"])
    if a.no_auto:
        return
    none, full = est["none"], est["full"]
    start = none.trace.base
    if a.host_us is not None:
        from spillover.estimate.devices import DEVICES

        measured_us = DEVICES["h200"].host_seconds_per_offload * 1e6
        DEVICES["h200"] = DEVICES["h200"].replace(host_seconds_per_offload=a.host_us * 1e-6)
        none = run(["none"])["none"]
        print(f"\nWHAT-IF: auto's rows below plan with {a.host_us:g} us of host time per "
              f"offloaded tensor, not the {measured_us:g} us the H200 measured")
    print()
    print("auto's plan without a budget and at two budgets (over the step's start, as "
          "SPILLOVER_DEVICE_BUDGET_BYTES means), against the fixed modes' predictions")
    print("| budget | auto s | auto GiB | vs none s | vs full s | NVMe GB/step | drive writes/day "
          "| within budget | plan |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, peak in (("none (everything fits)", none.device_peak_bytes),
                       ("full's peak", full.device_peak_bytes),
                       ("0.7x none's peak", int(0.7 * none.device_peak_bytes))):
        budget = None if name.startswith("none") else peak - start
        au = run(["none", "auto"], budget=budget)["auto"]
        fits = au.device_peak_bytes <= peak
        dwpd = au.drive_writes_per_day
        print(f"| {name} ({peak / GiB:.2f} GiB) | {au.step_seconds:.3f} | "
              f"{au.device_peak_bytes / GiB:.2f} | {au.step_seconds / none.step_seconds:.2f}x | "
              f"{au.step_seconds / full.step_seconds:.2f}x | "
              f"{au.nvme_write_bytes_per_step / 1e9:.2f} | "
              f"{'-' if dwpd is None else f'{dwpd:.1f}'} | {'yes' if fits else 'NO'} | "
              f"{au.note} |")
    # the same model with spillover's chunked loss (no fp32 logits, nor their backward at the
    # start of backward), against the plain loss's modes: what the user's own loss costs
    peak = full.device_peak_bytes
    au = run(["none", "auto"], budget=peak - start, chunked_loss=True)["auto"]
    print(f"| full's peak, the model's loss by spillover.loss.chunked_cross_entropy "
          f"({peak / GiB:.2f} GiB) | {au.step_seconds:.3f} | {au.device_peak_bytes / GiB:.2f} | "
          f"{au.step_seconds / none.step_seconds:.2f}x | "
          f"{au.step_seconds / full.step_seconds:.2f}x | "
          f"{au.nvme_write_bytes_per_step / 1e9:.2f} | - | "
          f"{'yes' if au.device_peak_bytes <= peak else 'NO'} | {au.note} |")


if __name__ == "__main__":
    main()
