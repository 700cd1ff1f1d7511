"""``python -m spillover fit --hf-config PATH --seq N --batch N --device h200``: will a
transformers model's training step fit, in each mode, and what is the largest batch and
sequence that does, from its ``config.json`` alone (no weights, no download).

Note [layers extrapolated]
    Tracing an 80-layer model's step on fake tensors costs ~0.3 ms per op on this machine, ~20 s
    a step, and a mode's figures need one step (``auto`` a few). ``fit`` traces the model with
    3 and 4 layers instead and extends each figure linearly to the config's depth: with
    identical blocks every figure is an affine function of the depth (the peak is at the same
    place relative to the last block or the first; each extra block adds what one middle block
    adds). Measured on a 12-layer Llama (d 1024, seq 2048, batch 2, h200), 3-and-4-layer
    extrapolation against the 12-layer trace: 0.00 % on the peak and the time in none, full
    and selective (a 2-and-3-layer one was 4 % off on full: with 2 layers there is no middle
    block). Offload modes hold at most ``copy_inflight_bytes`` of sources on a GPU, which is
    not affine until one block saves more than that: below it (the 12-layer test: 56 % off),
    ``fit`` traces deep enough that it does, or the whole model. ``auto`` is planned by the
    planner on the deeper model's region records (the middle block's record repeated) with
    the offsets its fake tuning measured at 4 layers. ``--no-extrapolate`` traces the whole
    model.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config import format_size, parse_size
from .devices import device_spec
from .modes import MODES, OPTIMIZERS, SECONDS_PER_DAY, SHARDINGS, ModeEstimate, Runner

__all__ = ["main", "load_config", "build_model"]

A, B = 3, 4  # Note [layers extrapolated]


def load_config(path: str) -> Any:
    """A transformers config from a ``config.json`` (or a folder holding one); no download."""
    from transformers import AutoConfig

    if not os.path.exists(path):
        raise SystemExit(f"spillover fit: --hf-config {path!r}: no such file; pass a "
                         "config.json (or the folder of one), as saved by transformers")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def _layers_attr(cfg: Any) -> str:
    for k in ("num_hidden_layers", "num_layers", "n_layer"):
        if hasattr(cfg, k):
            return k
    raise SystemExit("spillover fit: the config names no layer count (num_hidden_layers)")


def build_model(cfg: Any, layers: Optional[int], dtype: torch.dtype) -> torch.nn.Module:
    """The config's model on the ``meta`` device (no memory), with ``layers`` layers."""
    import transformers as T

    cfg = copy.deepcopy(cfg)
    if layers is not None:
        setattr(cfg, _layers_attr(cfg), layers)
        if hasattr(cfg, "num_decoder_layers") and cfg.num_decoder_layers is not None:
            cfg.num_decoder_layers = layers
    cfg.use_cache = False
    errors = []
    for auto in (T.AutoModelForCausalLM, T.AutoModelForSeq2SeqLM, T.AutoModelForMaskedLM):
        try:
            with torch.device("meta"):
                return auto.from_config(cfg, torch_dtype=dtype)
        except ValueError as e:
            errors.append(str(e).split("\n")[0])
    raise SystemExit(f"spillover fit: no causal, seq2seq or masked LM for {type(cfg).__name__}: "
                     f"{errors[0]}")


def _inputs(seq: int, batch: int) -> Dict[str, torch.Tensor]:
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def _line(a: float, b: float, x: float) -> float:
    """The value at depth ``x`` of the line through (A, a) and (B, b)."""
    return b + (x - B) * (b - a)


def _extend(ea: ModeEstimate, eb: ModeEstimate, layers: int, memory: int, host: int
            ) -> ModeEstimate:
    e = copy.copy(eb)
    for f in ("device_peak_bytes", "host_bytes", "nvme_bytes_per_step",
              "nvme_write_bytes_per_step", "nvme_read_bytes_per_step"):
        setattr(e, f, int(max(0, _line(getattr(ea, f), getattr(eb, f), layers))))
    for f in ("step_seconds", "flops", "recompute_flops", "compute_seconds", "stall_seconds"):
        setattr(e, f, max(0.0, _line(getattr(ea, f), getattr(eb, f), layers)))
    if eb.drive_writes_per_day is not None and e.step_seconds > 0:
        e.drive_writes_per_day = eb.drive_writes_per_day * (
            e.nvme_write_bytes_per_step / max(1, eb.nvme_write_bytes_per_step)) * (
            eb.step_seconds / e.step_seconds)
    e.fits = e.device_peak_bytes <= memory and e.host_bytes <= host
    e.timeline, e.trace, e.planner = [], None, None
    return e


class Fit:
    """The modes of one config at one (seq, batch), layers extrapolated (Note [layers
    extrapolated]) or traced whole."""

    def __init__(self, cfg: Any, args: argparse.Namespace, dtype: torch.dtype):
        self.cfg, self.args, self.dtype = cfg, args, dtype
        self.layers = int(getattr(cfg, _layers_attr(cfg)))
        self.device = device_spec(args.device)
        self.extrapolate = not args.no_extrapolate and self.layers > B
        self.traces = 0
        self._done: Dict[Tuple[str, int, int], ModeEstimate] = {}

    def runner(self, layers: Optional[int], seq: int, batch: int) -> Runner:
        a = self.args
        return Runner(build_model(self.cfg, layers, self.dtype), (), _inputs(seq, batch),
                      self.device, optimizer=a.optimizer, world_size=a.world,
                      sharding=a.sharding, budget=a.budget, dtype=self.dtype)

    def mode(self, mode: str, seq: int, batch: int) -> ModeEstimate:
        """One mode's figures at the config's depth (each (mode, seq, batch) traced once)."""
        key = (mode, seq, batch)
        if key not in self._done:
            self._done[key] = self._mode(mode, seq, batch)
        return self._done[key]

    def _mode(self, mode: str, seq: int, batch: int) -> ModeEstimate:
        if mode == "auto":
            return self._auto(seq, batch)
        if not self.extrapolate:
            self.traces += 1
            return self.runner(None, seq, batch).run(mode)
        ea = self.runner(A, seq, batch).run(mode)
        eb = self.runner(B, seq, batch).run(mode)
        self.traces += 2
        if mode in ("host", "nvme") and self.device.kind == "cuda":
            per = (eb.trace.extra.get("offloaded", 0) - ea.trace.extra.get("offloaded", 0))
            if per < self.device.copy_inflight_bytes:  # not affine yet: trace it all
                self.traces += 1
                return self.runner(None, seq, batch).run(mode)
        return _extend(ea, eb, self.layers, self.device.memory_bytes,
                       self.device.host_memory_bytes)

    def _auto(self, seq: int, batch: int) -> ModeEstimate:
        """Note [layers extrapolated]: the planner, on the deeper model's region records."""
        from ..planner import make_plan

        if not self.extrapolate:
            self.traces += 1
            return self.runner(None, seq, batch).run("auto")
        ra, rb = self.runner(A, seq, batch), self.runner(B, seq, batch)
        na, nb = ra.run("none"), rb.run("none")
        eb = rb.run("auto")
        self.traces += 3
        tmp = eb.planner
        start = int(_line(na.trace.base, nb.trace.base, self.layers))
        budget = self.args.budget if self.args.budget is not None else int(
            self.device.memory_bytes - start - self.device.workspace_bytes)
        recs = tmp.planned_records
        middle = recs[1]
        deep = [recs[0]]
        for i in range(1, self.layers - 1):
            r = copy.deepcopy(middle)
            r.key = r.name = f"{middle.name}#{i}"
            deep.append(r)
        deep.append(recs[-1])
        plan = make_plan(deep, rb.device.machine(), budget, tmp.outside_bytes,
                         peak_offset=tmp.peak_offsets or {"learning": 0},
                         loss_bytes=tmp.loss_bytes, loss_min_bytes=tmp.loss_min_bytes)
        e = copy.copy(eb)
        none_l = _extend(na, nb, self.layers, self.device.memory_bytes,
                         self.device.host_memory_bytes)
        pool = eb.pool_bytes if self.device.kind == "cpu" else 0
        e.device_peak_bytes = int(start + plan.model_peak + (plan.peak_offset or 0)
                                  + self.device.workspace_bytes + 0 * pool)
        e.step_seconds = none_l.step_seconds + plan.recompute_seconds + plan.transfer_seconds
        nv = sum(o.bytes for r in deep for o in r.ops if o.action == "offload"
                 and o.tier == "nvme")
        if any(r.mode == "plain-offload" for r in deep) and self.device.nvme_write_bytes_per_s:
            nv = max(nv, sum(o.bytes for r in deep if r.mode == "plain-offload"
                             for o in r.ops if o.needed) - int(eb.pool_bytes * 0.75))
        e.nvme_write_bytes_per_step = e.nvme_read_bytes_per_step = int(max(0, nv))
        e.nvme_bytes_per_step = 2 * e.nvme_write_bytes_per_step
        drive = self.device.nvme_drive_bytes
        e.drive_writes_per_day = (e.nvme_write_bytes_per_step * SECONDS_PER_DAY
                                  / e.step_seconds / drive
                                  if drive and e.nvme_write_bytes_per_step and e.step_seconds > 0
                                  else None)  # this plan's writes, not the 4-layer trace's
        # the plan models forward and backward; the optimizer step's peak (parameters,
        # gradients, state and the optimizer's temporaries) is every mode's, as full's trace
        # found it
        full = self.mode("full", seq, batch)
        if full.peak_phase.startswith("optimizer") and \
                full.device_peak_bytes > e.device_peak_bytes:
            e.device_peak_bytes = full.device_peak_bytes
            e.peak_phase = full.peak_phase
        e.fits = e.device_peak_bytes <= self.device.memory_bytes and plan.fits
        e.note = f"plan {plan.variant}" + ("" if plan.fits else ", over its budget")
        e.timeline, e.trace, e.planner, e.plan = [], None, None, plan
        self.auto_budget = budget
        return e


def _largest(fit: Fit, mode: str, dim: str, x0: int, e0: ModeEstimate, deadline: float
             ) -> Tuple[int, str]:
    """The largest batch (affine in it) or sequence (quadratic: attention's s² where scores
    are materialised, linear otherwise) whose peak fits the device, from the figures at ``x0``
    and more sizes; sequences in multiples of 128. Note [largest past the optimizer]: where
    the peak is the optimizer step's (parameters, gradients, state: no activations), it does
    not grow with the size, and a line through such points says nothing of where the
    activations' peak crosses the memory; the sizes double until the last points' peaks are
    the forward's or backward's (or one is over the memory), at most 5 more traces; if none
    get there in time, the answer is a lower bound."""
    mem = fit.device.memory_bytes
    if time.perf_counter() > deadline:
        return -1, "skipped (time)"
    need = 2 if dim == "batch" else 3
    pts: List[Tuple[int, ModeEstimate]] = [(x0, e0)]
    if dim == "seq":
        x = max(128, x0 // 2)
        pts.insert(0, (x, _at(fit, mode, dim, x)))
    x = x0
    for _ in range(5):
        tail = pts[-need:]
        if len(tail) == need and all(e.peak_phase != "optimizer" for _, e in tail):
            break
        if pts[-1][1].device_peak_bytes > mem or time.perf_counter() > deadline:
            break
        x *= 2
        pts.append((x, _at(fit, mode, dim, x)))
    quantum = 1 if dim == "batch" else 128
    while len(pts) < need or pts[0][1].device_peak_bytes > mem:
        # over the memory from the start: smaller sizes, down to the smallest
        x = pts[0][0] // 2 // quantum * quantum
        if x < quantum or time.perf_counter() > deadline:
            break
        pts.insert(0, (x, _at(fit, mode, dim, x)))
    if pts[0][1].device_peak_bytes > mem:
        return 0, f"not even {pts[0][0]} fits"
    if len(pts) < need:
        return -1, "skipped (time)"
    xl, el = pts[-1]
    if el.peak_phase == "optimizer" and el.device_peak_bytes <= mem:
        return -1, f">= {xl} (the optimizer step's peak up to there)"
    xs = [p[0] for p in pts[-need:]]
    ys = [p[1].device_peak_bytes for p in pts[-need:]]
    if dim == "batch":
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
        base = ys[0] - slope * xs[0]
        if slope <= 0:
            return -1, "does not grow with it"
        best = int((mem - base) // slope)
        return max(0, best), "affine in the batch"
    # quadratic through three points
    (x1, x2, x3), (y1, y2, y3) = xs, ys
    d = (x1 - x2) * (x1 - x3) * (x2 - x3)
    qa = (x3 * (y2 - y1) + x2 * (y1 - y3) + x1 * (y3 - y2)) / d
    qb = (x3 * x3 * (y1 - y2) + x2 * x2 * (y3 - y1) + x1 * x1 * (y2 - y3)) / d
    qc = y1 - qa * x1 * x1 - qb * x1
    if abs(qa) < 1e-12:
        best = (mem - qc) / qb if qb > 0 else -1
    else:
        disc = qb * qb - 4 * qa * (qc - mem)
        best = (-qb + math.sqrt(disc)) / (2 * qa) if disc >= 0 else -1
    return max(0, int(best) // 128 * 128), "quadratic in the sequence"


def _at(fit: Fit, mode: str, dim: str, x: int) -> ModeEstimate:
    seq, batch = (fit.args.seq, x) if dim == "batch" else (x, fit.args.batch)
    return fit.mode(mode, seq, batch)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m spillover fit",
        description="Predict a transformers model's training step in every spillover mode from "
                    "its config.json: device peak, host RAM, NVMe traffic, step time, and the "
                    "largest batch and sequence that fit. No weights are loaded or downloaded.")
    ap.add_argument("--hf-config", required=True, help="a config.json, or the folder of one")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", default="h200", help="cpu, h100, h200 (Note [device figures])")
    ap.add_argument("--world", type=int, default=1, help="ranks (data parallel)")
    ap.add_argument("--sharding", choices=SHARDINGS, default="none",
                    help="what the ranks shard: none (DDP), zero (optimizer state), fsdp")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    ap.add_argument("--dtype", default=None,
                    help="parameters' dtype (default: the config's torch_dtype, else bfloat16)")
    ap.add_argument("--budget", default=None, help="auto's peak budget over the step's start")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--largest", choices=("both", "batch", "seq", "none"), default="both")
    ap.add_argument("--no-extrapolate", action="store_true",
                    help="trace every layer (Note [layers extrapolated]: slower)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.budget is not None:
        args.budget = parse_size(args.budget)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode {', '.join(bad)}; choose from {', '.join(MODES)}")
    cfg = load_config(args.hf_config)
    name = args.dtype or str(getattr(cfg, "torch_dtype", None) or "bfloat16")
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        ap.error(f"--dtype {name!r}: not a torch dtype (bfloat16, float16, float32)")
    fit = Fit(cfg, args, dtype)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = {m: fit.mode(m, args.seq, args.batch) for m in modes}
        from .result import Estimate

        est = Estimate(fit.runner(B if fit.extrapolate else None, args.seq, args.batch), results,
                       f"{type(cfg).__name__} ({fit.layers} layers"
                       + (f", extrapolated from {A} and {B}" if fit.extrapolate else "")
                       + f"), batch {args.batch} x seq {args.seq}, {name}"
                       + (f", {args.world} ranks, sharding {args.sharding}"
                          if args.world > 1 else ""), None)
        if "auto" in results and hasattr(fit, "auto_budget"):
            est.budget = fit.auto_budget
        print(est.table())
        t_table = time.perf_counter() - t_start
        largest: Dict[str, Dict[str, Any]] = {}
        deadline = t_start + 40.0
        dims = ["batch", "seq"] if args.largest == "both" else (
            [] if args.largest == "none" else [args.largest])
        for dim in dims:
            x0 = args.batch if dim == "batch" else args.seq
            for m in modes:
                if m == "auto":
                    continue
                largest.setdefault(m, {})[dim] = _largest(fit, m, dim, x0, results[m], deadline)
        if largest:
            print(f"\nlargest that fits the {format_size(fit.device.memory_bytes)} device "
                  "(the other held):")
            for m, d in largest.items():
                parts = [f"{dim} {v[0]}" if v[0] >= 0 else f"{dim} {v[1]}"
                         for dim, v in d.items()]
                print(f"  {m:<10} " + ", ".join(parts))
            if "auto" in modes:
                best = {dim: max((d[dim][0] for d in largest.values() if dim in d),
                                 default=-1) for dim in dims}
                print("  auto       " + ", ".join(f"{k} {v if v >= 0 else '-'}"
                                                  for k, v in best.items())
                      + " (its most frugal plans: the largest number above)")
            kinds = {v[1] for d in largest.values() for v in d.values() if v[0] >= 0}
            print("  (" + "; ".join(sorted(kinds)) + ", fitted on traces at other sizes)")
        if fit.device.kind == "cuda" and hasattr(cfg, "intermediate_size"):
            _closed(cfg, args, results, fit)
    total = time.perf_counter() - t_start
    print(f"\n{fit.traces} fake steps traced; table in {t_table:.1f} s, all in {total:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"modes": {m: {k: getattr(e, k) for k in (
                "device_peak_bytes", "host_bytes", "nvme_bytes_per_step", "step_seconds",
                "fits", "note")} for m, e in results.items()},
                "largest": {m: {k: v[0] for k, v in d.items()} for m, d in largest.items()},
                "seconds": total}, f, indent=1)
    return 0


def _closed(cfg: Any, args: argparse.Namespace, results: Dict[str, ModeEstimate],
            fit: Fit) -> None:
    """Note [closed form]: none's and full's peaks against Korthikanti et al.'s counting."""
    from .closed_form import closed_form

    if args.world > 1 or args.optimizer != "adamw":
        return
    cf = closed_form(cfg, args.seq, args.batch, itemsize=torch.finfo(fit.dtype).bits // 8,
                     state_bytes_per_param=2 * torch.finfo(fit.dtype).bits // 8)
    ws = fit.device.workspace_bytes
    print(f"\nclosed form (Korthikanti et al. 2022; Note [closed form] in "
          f"spillover/estimate/closed_form.py), per layer: {format_size(cf.korthikanti_layer)} "
          f"as published (sbh(34 + 5as/h)), {format_size(cf.korthikanti_layer_flash)} without "
          f"materialised attention, {format_size(cf.llama_layer)} counted for this block")
    for m, closed in (("none", cf.none_peak), ("full", cf.full_peak)):
        if m in results:
            pred = results[m].device_peak_bytes - ws
            why = ""
            if results[m].peak_phase.startswith("optimizer"):
                # Note [closed form]: the formula's peak is backward's; the trace's is the
                # optimizer step's when foreach AdamW's parameter-sized temporary (its
                # denominator) beside parameters, gradients and state outweighs activations
                why = (f"; the traced peak is the optimizer step's ({format_size(cf.params)} "
                       "of parameters, gradients, two states and foreach AdamW's temporary "
                       "each), which the formula does not count")
            print(f"  {m:<5} peak: traced {format_size(pred)}, closed form {format_size(closed)}"
                  f" ({100 * (pred - closed) / closed:+.1f} %{why})")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
