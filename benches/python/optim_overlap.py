"""Where OffloadAdamW's step goes on the simulated device, per bucket, and each mode against
torch's fused AdamW (issue 41).

    python benches/python/optim_overlap.py [--params 48e6] [--layers 12] [--link-gbs 54]
                                           [--paces h200,0.6] [--steps 8]
                                           [--modes torch,exact,inbwd,delayed]
                                           [--per-bucket] [--json FILE]

The device is ``spillover/activations/link/sim.py``'s ``SimDevice`` behind a link of
``--link-gbs`` GB/s each way (the H200's, measured: 54), one stream per direction; its compute
is the host's calling thread sleeping (the CPU is free meanwhile, as it is while a GPU
computes), a forward and a backward of ``--layers`` layers whose parameters are shaped like a
GPT's (per layer 3:1:4:4 for qkv, proj, fc1, fc2, and an embedding of a tenth of the
parameters). Each layer's backward sleeps its share, then its gradients arrive (tensors made
once and handed back every step, so making them costs the host nothing, as on a GPU). The
compute stream's waits for copies are taken when the next forward starts (a GPU's host queues
on and its compute stream waits there). The CPU update is the real Rust kernel on this
machine's cores, the copies really move their bytes (on the sim's stream threads).

Paces (``--paces``), the device's forward + backward per step:

- ``h200``: an H200's pace for this model: the probe's GPT (369M parameters, batch 8 x 1024,
  bf16 autocast) took 0.148 s per step with torch's fused AdamW, of which ~0.004 s is the
  fused update: 0.144 s x params / 369M (forward a third, backward two thirds). On a machine
  with few cores the host update is then several times the device's work: nothing can hide it
  all, and the table shows how much each mode hides;
- a number x: forward + backward = x times this machine's host update of the model (measured
  first, in the same run, as the exact mode's kernel time), so the host-to-device ratio of a
  larger machine can be replayed here: on the H200 host (16 cores) OffloadAdamW's default
  added ~0.24 s to a 0.144 s forward + backward, so x = 0.6 is about that machine.

Modes (``--modes``): ``torch`` (torch's fused AdamW with its state on the device: forward +
backward + the fused update's device time, 28 bytes per parameter at 2.9 TB/s, 60 % of the
H200's HBM, no copies, no host work); ``exact`` (OffloadAdamW's default: at ``step()`` the
bucket pipeline, bucket k's gradients crossing while bucket k-1 updates and bucket k-2's
parameters return); ``inbwd`` (``update_in_backward=True``: each bucket's update on the worker
thread during backward, kept at ``step()``); ``delayed`` (``overlap="delayed"``: the update
of step t on the worker during step t+1's forward and backward; its math differs, Note
[delayed update] in spillover/optim/delayed.py; with its default prediction, Note
[next-gradient prediction] in rust/optim/predict.rs, whose coefficients cross with the
parameters and whose gradient term runs at ``step()`` on the compute stream: on the simulated
device, the host's cores); ``delayed-momentum`` (``predict_weights="momentum"``: no
coefficients, no gradient term).

Per mode, summed over the buckets and averaged over ``--steps`` measured steps (after two
warm-up steps): the step (forward start to the next forward start, the copies' waits
included) and its ratio to ``torch``'s; what is not hidden (step - forward - backward); and
for each part of the optimizer's work — gradient D2H, host update (the kernel's passes), and
parameter H2D — its time and the share of it that ran while the device computed (forward or
backward). ``--per-bucket`` adds one table per mode: each bucket's parts and their overlap.

``--update-threads N`` gives every OffloadAdamW mode ``update_threads=N`` (default: the
library's, Note [update threads] in spillover/optim/adamw.py: all cores for ``exact``, one
fewer for ``inbwd`` and ``delayed``). ``--copies model`` and ``--fingerprints host``: see
``Link.copy`` and ``device_fingerprints``. The parameter H2D column counts the next-gradient
prediction's coefficients (bf16) with the parameters; its term on the device has a column of
its own (``--term``: slept at HBM speed, the default, or run on this host).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

import spillover
from spillover.activations.link import sim
from spillover.optim import delayed as _delayed

H200_STEP_S = 0.144  # forward + backward of the probe's GPT on the H200 (see the docstring)
H200_PARAMS = 369e6
FUSED_BYTES_PER_S = 2.9e12  # torch's fused AdamW on the device: 28 B/param at 60 % of HBM
# The next-gradient prediction's term (Note [next-gradient prediction]) runs at step() on the
# compute stream. A GPU runs its 4 elementwise passes, ~46 bytes per fp32 parameter, at HBM
# speed; the simulated device's compute stream is the calling thread, so with ``--term model``
# (the default) the term is that thread sleeping ``TERM_BYTES`` per element over
# ``FUSED_BYTES_PER_S``, as forward and backward sleep theirs (the values it would compute are
# not needed here); ``--term run`` computes it on this host's cores instead.
TERM_BYTES = 46
TERM = {"run": False}
_TERM: List[Tuple[float, float]] = []
_run_term = _delayed._gradient_term


def _timed_term(dst: List[torch.Tensor], *a: Any) -> None:
    t0 = time.perf_counter()
    if TERM["run"]:
        _run_term(dst, *a)
    else:
        time.sleep(sum(d.numel() for d in dst) * TERM_BYTES / FUSED_BYTES_PER_S)
    _TERM.append((t0, time.perf_counter()))


_delayed._gradient_term = _timed_term


class Link(sim.SimDevice):
    """The simulated device, logging each copy's direction, host address, bytes and when it
    ran; the compute stream's waits are kept for the next forward."""

    def __init__(self, bandwidth: float, move: bool = True):
        super().__init__(bandwidth)
        self.move = move
        self.pending: List[Any] = []
        self.copies: List[List[Any]] = []  # [kind, host address, bytes, start, end]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """The bytes move first (on the stream's thread: this host's memcpy), then the copy
        lasts until ``bytes / bandwidth`` has passed since it started (``--copies move``), or
        they do not move at all (``model``: a DMA engine's copy costs the host no CPU time; the
        bench's values are then meaningless, its times are what it measures)."""
        up = self.is_pinned(src)
        host = src if up else dst
        n = src.numel() * src.element_size()
        rec = ["h2d" if up else "d2h", host.data_ptr(), n, None, None]
        seconds = n / self.bandwidth
        move = self.move

        def op() -> None:
            t0 = time.perf_counter()
            rec[3] = t0
            if move:
                dst.copy_(src)
            rest = seconds - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
            rec[4] = time.perf_counter()

        stream.put(op)
        self.copies.append(rec)

    def wait(self, stream: Any, ev: Any) -> None:
        if stream is sim._HOST:
            self.pending.append(ev)
        else:
            super().wait(stream, ev)

    def forward_starts(self) -> None:
        for ev in self.pending:
            self.synchronize(ev)
        self.pending = []


class _Layer(torch.autograd.Function):
    """One layer of the simulated device: forward sleeps its share; backward sleeps its share
    and hands back its gradients (popped from `pool`, so autograd takes them as they are)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float, pool: List[Any],
                *params: torch.Tensor) -> torch.Tensor:
        time.sleep(fwd_s)
        ctx.bwd_s, ctx.pool, ctx.n = bwd_s, pool, len(params)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Any, ...]:
        time.sleep(ctx.bwd_s)
        grads = [ctx.pool.pop(0) for _ in range(ctx.n)]
        return (g, None, None, None, *grads)


def gpt_like(total: int, layers: int) -> List[List[int]]:
    """Per layer, parameter sizes in the proportions of a GPT block (qkv, proj, fc1, fc2) plus
    an embedding of a tenth of `total` in the first layer; none a multiple of 16."""
    emb = total // 10
    per = (total - emb) // layers
    shapes = []
    for i in range(layers):
        sizes = [per * w // 12 for w in (3, 1, 4, 4)]
        if i == 0:
            sizes = [emb] + sizes
        shapes.append([s - s % 16 + 5 for s in sizes])
    return shapes


class Model:
    """Parameters shaped by :func:`gpt_like`, gradients made once (constant, small values)."""

    def __init__(self, shapes: List[List[int]], seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.layers = [[torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in ls]
                       for ls in shapes]
        self.pools = [[torch.randn(n, generator=g) * 1e-3 for n in ls] for ls in shapes]

    def parameters(self) -> List[torch.nn.Parameter]:
        return [p for ls in self.layers for p in ls]

    def step(self, fwd_s: float, bwd_s: float, times: Dict[str, float]) -> None:
        """Forward then backward; `times` gets their start and end."""
        n = len(self.layers)
        times["fwd0"] = time.perf_counter()
        x = torch.zeros((), requires_grad=True)
        for ps, pool in zip(self.layers, self.pools):
            x = _Layer.apply(x, fwd_s / n, bwd_s / n, pool, *ps)
        times["fwd1"] = times["bwd0"] = time.perf_counter()
        x.backward()
        times["bwd1"] = time.perf_counter()

    def take_back_grads(self) -> None:
        """The gradients go back to the pools for the next backward (set to None here)."""
        for ps, pool in zip(self.layers, self.pools):
            for p in ps:
                pool.append(p.grad)
                p.grad = None


def device_fingerprints() -> None:
    """The gradient fingerprints (Note [gradient fingerprint]) are device kernels on a GPU,
    on the copy stream; on the simulated device they would run on the host's CPU (the int64
    passes and the snapshot copies: ~2 s per step here for the update-in-backward mode's two
    passes over 96 MB of gradients). ``--fingerprints device`` (the default) replaces them by
    a stand-in that costs nothing and always matches: in this bench no gradient changes after
    backward, so every check they would make passes anyway."""
    from spillover.optim import fingerprint as fp

    def chunk(b: torch.Tensor, padded: bool = False) -> torch.Tensor:
        return torch.zeros(fp._FP_LANES, dtype=torch.int64)

    fp._fp_chunk = chunk
    fp._fp_pad = lambda b: b.view(-1)  # not `b` itself: no snapshot copy (copies.stage)


def overlap(iv: Tuple[float, float], busy: List[Tuple[float, float]]) -> float:
    """Seconds of interval `iv` inside the union of the (disjoint) intervals `busy`."""
    a, b = iv
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def run_mode(mode: str, shapes: List[List[int]], fwd_s: float, bwd_s: float, args: Any
             ) -> Dict[str, Any]:
    model = Model(shapes)
    n = sum(p.numel() for p in model.parameters())
    link: Optional[Link] = None
    opt: Any = None
    fused_s = n * 28 / FUSED_BYTES_PER_S
    if mode != "torch":
        link = Link(args.link_gbs * 1e9, move=args.copies == "move")
        opt = spillover.OffloadAdamW(
            model.parameters(), lr=1e-4, optim_pool_bytes=int(n * 22) + (256 << 20),
            _force_staging=True, _link=link, update_in_backward=mode == "inbwd",
            overlap="delayed" if mode.startswith("delayed") else None,
            predict_weights="momentum" if mode == "delayed-momentum" else None,
            update_threads=args.update_threads)
    steps: List[Dict[str, float]] = []
    for _ in range(args.steps + 3):  # two warm-up steps, and one to end the last measured
        t: Dict[str, float] = {"start": time.perf_counter()}
        if link is not None:
            link.forward_starts()
        model.step(fwd_s, bwd_s, t)
        if opt is not None:
            opt.step()
        else:
            time.sleep(fused_s)
        t["step_end"] = time.perf_counter()
        model.take_back_grads()
        steps.append(t)
    measured = steps[2:-1]
    t0, t1 = measured[0]["start"], steps[-1]["start"]
    busy = [(t["fwd0"], t["fwd1"]) for t in steps] + [(t["bwd0"], t["bwd1"]) for t in steps]
    compute = sum((t["fwd1"] - t["fwd0"]) + (t["bwd1"] - t["bwd0"]) for t in measured)
    k = len(measured)
    out: Dict[str, Any] = {
        "mode": mode, "params": n,
        "step_s": statistics.median(b["start"] - a["start"] for a, b in zip(steps[2:], steps[3:])),
        "compute_s": compute / k,
    }
    parts: Dict[str, List[Tuple[int, float, float]]] = {"d2h": [], "update": [], "h2d": []}
    if opt is not None and link is not None:
        spaces = list(opt._spaces)
        blocks = []  # (lo, hi, bucket) of every staging block
        for sp in spaces:
            for b, (_, _, _, g, o) in enumerate(sp.buckets):
                for blk in (g, o):
                    lo = blk.data_ptr()
                    blocks.append((lo, lo + blk.numel() * blk.element_size(), b))

        def bucket_of(addr: int) -> int:
            for lo, hi, b in blocks:
                if lo <= addr < hi:
                    return b
            return -1

        for kind, addr, _, a, b in link.copies:
            if a is not None and b is not None and t0 <= a < t1:
                parts[kind].append((bucket_of(addr), a, b))
        for sp in spaces:
            for b, a, e in sp.update_log:
                if t0 <= a < t1:
                    parts["update"].append((b, a, e))
        out["buckets"] = len(spaces[0].buckets) if spaces else 0
        term = [(a, b) for a, b in _TERM if t0 <= a < t1]
        out["term_s"] = sum(b - a for a, b in term) / k
        out["term_device_s"] = n * TERM_BYTES / FUSED_BYTES_PER_S if term else 0.0
        _TERM.clear()
    for kind, ivs in parts.items():
        total = sum(e - a for _, a, e in ivs)
        hidden = sum(overlap((a, e), busy) for _, a, e in ivs)
        out[kind] = {"s": total / k, "hidden_s": hidden / k}
        per: Dict[int, List[float]] = {}
        for b, a, e in ivs:
            x = per.setdefault(b, [0.0, 0.0])
            x[0] += (e - a) / k
            x[1] += overlap((a, e), busy) / k
        out[kind]["per_bucket"] = {b: v for b, v in sorted(per.items())}
    del opt, model
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=48e6)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--link-gbs", type=float, default=54.0)
    ap.add_argument("--paces", default="h200,0.6")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", default="torch,exact,inbwd,delayed")
    ap.add_argument("--per-bucket", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--copies", choices=("move", "model"), default="move")
    ap.add_argument("--update-threads", type=int, default=None,
                    help="OffloadAdamW(update_threads=): default, the library's (Note [update "
                         "threads] in spillover/optim/adamw.py)")
    ap.add_argument("--fingerprints", choices=("device", "host"), default="device")
    ap.add_argument("--term", choices=("model", "run"), default="model",
                    help="the next-gradient prediction's device term: slept at HBM speed, or "
                         "computed on this host (see TERM_BYTES)")
    args = ap.parse_args()
    TERM["run"] = args.term == "run"
    if args.fingerprints == "device":
        device_fingerprints()
    torch.set_num_threads(1)  # the sim's copies: optim_threads.py's docstring says why
    shapes = gpt_like(int(args.params), args.layers)
    n = sum(map(sum, shapes))
    cores = len(os.sched_getaffinity(0))
    print(f"simulated device: {n / 1e6:.1f}M fp32 parameters in {sum(map(len, shapes))} "
          f"tensors, {args.layers} layers, link {args.link_gbs:g} GB/s each way; "
          f"{cores} host cores; torch {torch.__version__}", flush=True)
    host_update = None
    results = []
    for pace in args.paces.split(","):
        if pace == "h200":
            device_s = H200_STEP_S * n / H200_PARAMS
        else:
            if host_update is None:  # this machine's update of the model, exact mode's kernel
                cal = run_mode("exact", shapes, 0.0, 0.0, args)
                host_update = cal["update"]["s"]
                print(f"host update of the model here: {host_update * 1e3:.1f} ms "
                      f"(the exact mode's kernel passes, no device work)", flush=True)
            device_s = float(pace) * host_update
        fwd_s, bwd_s = device_s / 3, device_s * 2 / 3
        rows = {}
        for mode in args.modes.split(","):
            rows[mode] = run_mode(mode, shapes, fwd_s, bwd_s, args)
            print(f"  pace {pace}: {mode} {rows[mode]['step_s'] * 1e3:.1f} ms", flush=True)
        results.append({"pace": pace, "device_s": device_s, "rows": rows})
        base = rows["torch"]["step_s"] if "torch" in rows else None
        print(f"\n### pace {pace}: forward + backward {device_s * 1e3:.1f} ms per step "
              f"({n / 1e6:.1f}M parameters, link {args.link_gbs:g} GB/s, {cores} cores)\n")
        print("| mode | step ms | vs torch fused | not hidden ms | gradient D2H ms (hidden) "
              "| host update ms (hidden) | parameter H2D ms (hidden) | gradient term ms "
              "(at HBM speed) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for mode, r in rows.items():
            ratio = f"{r['step_s'] / base:.2f}x" if base else ""

            def term(r: Dict[str, Any]) -> str:
                if not r.get("term_s"):
                    return "–"
                return f"{r['term_s'] * 1e3:.1f} ({r['term_device_s'] * 1e3:.1f})"

            def cell(kind: str, r: Dict[str, Any] = r) -> str:
                x = r[kind]
                if not x["s"]:
                    return "–"
                return f"{x['s'] * 1e3:.1f} ({x['hidden_s'] / x['s'] * 100:.0f} %)"

            print(f"| {mode} | {r['step_s'] * 1e3:.1f} | {ratio} | "
                  f"{(r['step_s'] - r['compute_s']) * 1e3:.1f} | {cell('d2h')} | "
                  f"{cell('update')} | {cell('h2d')} | {term(r)} |")
        if args.per_bucket:
            for mode, r in rows.items():
                if mode == "torch":
                    continue
                print(f"\n{mode}, per bucket: ms per step (hidden ms)\n")
                print("| bucket | gradient D2H | host update | parameter H2D |")
                print("| ---: | ---: | ---: | ---: |")
                buckets = sorted({b for kind in ("d2h", "update", "h2d")
                                  for b in r[kind]["per_bucket"]})
                for b in buckets:
                    cells = []
                    for kind in ("d2h", "update", "h2d"):
                        s, h = r[kind]["per_bucket"].get(b, (0.0, 0.0))
                        cells.append(f"{s * 1e3:.1f} ({h * 1e3:.1f})")
                    print(f"| {b} | " + " | ".join(cells) + " |")
        print(flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "link_gbs": args.link_gbs, "cores": cores,
                       "argv": sys.argv[1:], "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
