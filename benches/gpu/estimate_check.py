"""The probe's ``estimate`` check (issue 35): ``spillover.estimate``'s predicted device peak
against the measured one, per mode, on the device the probe runs on.

On a GPU the measured peak is ``torch.cuda.max_memory_allocated()`` over the step (forward,
loss, backward, ``optimizer.step()``), reset just before it, after a warm-up step that made
AdamW's state (what the estimate counts: Note [step time] and its device peak "as
``max_memory_allocated`` counts it"); the estimate gets this GPU's figures (``h100``/``h200``
when the name says so, else an H100's rates with this device's memory). In a dry run on the CPU
the measured peak is the CPU allocator's events over the step's start plus what the step
starts with (tests/python/test_estimate.py's way). Goal: within 5 % in every mode.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Any, Dict, Tuple

import torch

import spillover

POOL = 64 << 20
MODES = ("none", "full", "selective", "host")


def _spec(dev: str) -> Any:
    if dev == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for known in ("h200", "h100"):
        if known in name:
            return known
    return {"base": "h100", "memory_bytes": torch.cuda.get_device_properties(0).total_memory}


def _storages(ts: Any) -> int:
    seen, total = set(), 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def measure(mode: str, cfg: Any, batch: Tuple[torch.Tensor, torch.Tensor], dev: str,
            swapdir: str) -> int:
    """The measured device peak of one step of ``mode`` (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    from spillover.models import GPT

    torch.manual_seed(0)
    model = GPT(cfg).to(dev)
    ctx = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode in ("full", "selective"):
            spillover.wrap(model, policy=mode)
        elif mode == "host":
            spillover.wrap(model, policy="offload")
            ctx = spillover.offload_context("host", host_pool_bytes=POOL, nvme_path=swapdir)
    opt = torch.optim.AdamW(model.parameters())
    idx, tgt = batch

    def step() -> None:
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = model(idx, tgt)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's state; selective's regions learn
    gc.collect()
    if dev != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    start = _storages(list(model.parameters()) + list(model.buffers()) + [idx, tgt]
                      + [v for s in opt.state.values() for v in s.values()])
    if ctx is not None:
        start += ctx.stats().pool_capacity
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    cur = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                       if e.name() == "[memory]"):
        cur += n
        peak = max(peak, cur)
    return start + peak


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
        meas = measure(mode, cfg, batch, dev, swapdir)  # type: ignore[arg-type]
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
