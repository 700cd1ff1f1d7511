"""The demo's picture (``timeline.png``): one panel per mode, the memory measured over its
memory step beside what ``spillover.estimate`` predicted for the same mode, model, batch and
pool, the end of forward marked and each curve's peak annotated.

The two curves run on different clocks (the measured step's seconds; the estimate's predicted
ones): the predicted curve is drawn with its forward stretched onto the measured forward and
its backward onto the measured backward, so that the shapes line up; its own step time is in
the legend. Both count what the step adds over its start (activations, gradients, transients),
with a context's pool in full on a CPU host, as the table's peak column does.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .estimate.devices import known_gpu
from .estimate.plot import timeline_panels

__all__ = ["predict", "draw"]

Curve = List[Tuple[float, int]]


def _device_name(device: torch.device) -> Optional[str]:
    """The estimate's device for ``device``: this CPU (measured), or a GPU it has figures for."""
    if device.type == "cpu":
        return "cpu"
    return known_gpu(torch.cuda.get_device_name(device))


def predict(base: Any, idx: torch.Tensor, tgt: torch.Tensor, device: torch.device,
            modes: Dict[str, Dict[str, Any]], progress: Callable[[str], None]
            ) -> Dict[str, Dict[str, Any]]:
    """Per demo mode (``{name: {"mode": estimate mode, "pool": bytes or None, "budget":
    bytes or None}}``), the estimate's curve over the step's start up to the end of backward
    (``"curve"``), its marks and its step time. A mode the estimate fails on is left out,
    with a line saying why."""
    import spillover

    dev = _device_name(device)
    if dev is None:
        progress("predicted curves left out: spillover.estimate has no figures for "
                 f"{torch.cuda.get_device_name(device)} (pass its figures to estimate)")
        return {}
    out: Dict[str, Dict[str, Any]] = {}
    t0 = time.perf_counter()
    for name, how in modes.items():
        try:
            est = spillover.estimate(base, idx.to("meta"), tgt.to("meta"), device=dev,
                                     modes=[how["mode"]], budget=how.get("budget"),
                                     host_pool_bytes=how.get("pool"))
        except Exception as e:  # the picture only: the run's measurements stand without it
            progress(f"{name:<9} no predicted curve: spillover.estimate failed "
                     f"({type(e).__name__}: {e})")
            continue
        m = est[how["mode"]]
        start = m.trace.base if m.trace is not None else 0
        end = m.marks.get("backward", float("inf"))
        out[name] = {"curve": [(t, v - start) for t, v in m.timeline if t <= end],
                     "marks": dict(m.marks), "step_seconds": m.step_seconds,
                     "peak": m.device_peak_bytes - start}
    progress(f"predicted each mode's memory (spillover.estimate) in "
             f"{time.perf_counter() - t0:.1f} s")
    return out


def _stretch(curve: Curve, pred: Dict[str, float], meas: Dict[str, float]) -> Curve:
    """``curve`` on the predicted clock mapped onto the measured one: forward onto forward,
    backward onto backward (piecewise linear)."""
    pf, pb = pred.get("forward", 0.0), pred.get("backward", 0.0)
    mf, mb = meas.get("forward", 0.0), meas.get("backward", 0.0)
    if pf <= 0 or pb <= pf or mf <= 0 or mb <= mf:
        return curve
    out = []
    for t, v in curve:
        s = t * mf / pf if t <= pf else mf + (t - pf) * (mb - mf) / (pb - pf)
        out.append((s, v))
    return out


def draw(rows: List[Dict[str, Any]], predicted: Dict[str, Dict[str, Any]], path: str,
         title: str, device: torch.device) -> Optional[str]:
    """The picture; None when matplotlib is missing. On a CPU host the measured curve is the
    process's RSS (with the mmap threshold pinned, so freed tensors leave it; small blocks and
    the allocator's arenas stay) and the predicted one live tensor storages: the gap between
    them is the allocator's slack, which the estimate does not model (its accuracy is checked
    against the allocator's own events: tests/python/test_estimate.py)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    panels = []
    for r in rows:
        if not r["timeline"]:
            continue
        marks = dict(r.get("marks") or {})
        what = "RSS + pool" if device.type == "cpu" else "memory_allocated"
        curves: Dict[str, Curve] = {f"measured ({what})": r["timeline"]}
        p = predicted.get(r["mode"])
        if p is not None and p["curve"]:
            label = (f"predicted live tensors ({p['step_seconds']:.2f} s step, drawn on the "
                     "measured clock)")
            curves[label] = _stretch(p["curve"], p["marks"], marks)
        panels.append((r["mode"], curves, marks))
    if not panels:
        return None
    return timeline_panels(path, title, panels, ylabel="memory over the step's start (MiB)")
