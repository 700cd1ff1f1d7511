"""The probe's ``estimate`` check (issue 35): ``spillover.estimate``'s predicted device peak
against the measured one, per mode, on the device the probe runs on.

On a GPU the measured peak is ``torch.cuda.max_memory_allocated()`` over the step (forward,
loss, backward, ``optimizer.step()``), reset just before it, after a warm-up step that made
AdamW's state (what the estimate counts: Note [step time] and its device peak "as
``max_memory_allocated`` counts it"); the estimate gets this GPU's figures (``h100``/``h200``
when the name says so, else an H100's rates with this device's memory). In a dry run on the CPU
the measured peak is the CPU allocator's events over the step's start plus what the step
starts with (``spillover.estimate.measured.step_peak``, as tests/python/test_estimate.py
measures it). Goal: within 5 % in every mode.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

import spillover
from spillover.estimate.devices import known_gpu
from spillover.estimate.measured import step_peak

POOL = 64 << 20
MODES = ("none", "full", "selective", "host")


def _spec(dev: str) -> Any:
    if dev == "cpu":
        return "cpu"
    return known_gpu(torch.cuda.get_device_name()) or {
        "base": "h100", "memory_bytes": torch.cuda.get_device_properties(0).total_memory}


def check_estimate(p: Any) -> Dict[str, Any]:
    import tempfile

    from spillover.models import GPT, GPTConfig, synthetic_batch

    dev = "cpu" if p.dry else "cuda"
    if p.dry:
        cfg = GPTConfig(vocab=512, d_model=64, n_heads=4, n_layers=2, seq=64)
    else:
        cfg = GPTConfig(vocab=8192, d_model=1024, n_heads=16, n_layers=4, seq=1024, attn="sdpa")
    batch = tuple(t.to(dev) for t in synthetic_batch(cfg, batch=4))
    with torch.device("meta"):
        meta = GPT(cfg)
    est = spillover.estimate(meta, *(t.to("meta") for t in batch), device=_spec(dev),
                             modes=list(MODES), host_pool_bytes=POOL)
    swapdir = tempfile.mkdtemp(prefix="probe-estimate-")
    rows: Dict[str, Any] = {}
    ok = True
    for mode in MODES:
        pred = est[mode].device_peak_bytes
        torch.manual_seed(0)
        meas = step_peak(mode, GPT(cfg).to(dev), batch, {}, swapdir, POOL)
        err = (pred - meas) / meas
        ok &= abs(err) <= 0.05
        rows[mode] = {"predicted": pred, "measured": meas, "error": err}
        p.say(f"  {mode:<9} predicted {pred / 2**20:9.1f} MiB, measured {meas / 2**20:9.1f} MiB "
              f"({100 * err:+.1f} %)")
    what = "max_memory_allocated" if dev != "cpu" else "live storages (CPU allocator events)"
    p.mark(ok, f"spillover.estimate's device peak within 5 % of {what} in "
           f"{sum(abs(r['error']) <= 0.05 for r in rows.values())}/{len(rows)} modes "
           f"(GPT {cfg.n_layers}x{cfg.d_model}, seq {cfg.seq}, batch 4, {cfg.attn})")
    return rows
