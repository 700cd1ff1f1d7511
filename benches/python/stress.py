"""Stress harness on real model code (issue 20): random cases until the time is up.

    python benches/python/stress.py --minutes 10 --seed 0 [--out stress.json]
    python benches/python/stress.py --case '<json printed for a failure>'     # rerun one case

Each case (``tests/python/_stress_models.py``) draws a family (transformers GPT-2, Llama,
Mistral, Qwen2, Gemma, BERT-MaskedLM, or a pure-torch RMSNorm chain), a realistic vocabulary
(32k-128k), a tiny config (hidden 64-128, 2-3 layers, dropout mostly on), sdpa or eager
attention, a sequence length per step, a tier (host or NVMe in a fresh temp dir), a pool
(16 MiB .. min(1 GiB, an eighth of the available memory)), a policy (no wrap, full, selective,
offload, auto), a min_offload_bytes (often 4096), and runs 3-4 steps with one context object,
comparing each step's loss and gradients bitwise with the plain model's (same parameters, same
seed before each forward). A failure is an exception (pyo3 panics included), a mismatch, bytes
left in the pool or swap after the case, a hang (--case-timeout) or a dead worker.

Cases run in a worker process (spawned; restarted after any failure, and when the pools it
mapped pass --worker-pool-cap, since a process keeps every pool it made), so one panic or crash
does not end the run or leak into the next case. Prints a line per case, then a summary and
every failure with the JSON and the command that reproduces it; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))

import _stress_models as sm  # noqa: E402


def _worker_main(conn, threads: int) -> None:
    sm.worker_loop(conn, threads)


class Worker:
    """One spawned worker process; ``run`` returns an Outcome dict, or a timeout/crash one."""

    def __init__(self, threads: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, threads), daemon=True)
        self.proc.start()
        child.close()
        self.pool_bytes: set = set()
        try:
            msg = self.conn.recv() if self.conn.poll(300) else "nothing within 300 s"
        except EOFError:
            msg = f"nothing: it died (exit status {self.proc.exitcode})"
        if msg != "ready":
            raise RuntimeError(f"the worker said {msg!r}")

    def run(self, case: sm.Case, timeout: float) -> dict:
        self.pool_bytes.add(case.pool_bytes)
        self.conn.send(case.to_json())
        try:
            ready = self.conn.poll(timeout)
        except (EOFError, OSError):
            ready = True
        if not ready:
            self.kill()
            return dict(kind="timeout", message=f"no result after {timeout:.0f} s (a hang?)")
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            code = self.proc.exitcode
            what = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            return dict(kind="crash", message=f"the worker process died ({what})")

    def alive(self) -> bool:
        return self.proc.is_alive()

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.proc.join(10)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def _mib(n: int) -> str:
    return sm._size(n)


def _repro(case: sm.Case) -> str:
    return f"python benches/python/stress.py --case '{case.to_json()}'"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="draw cases until this is up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write every case and its outcome here (JSON)")
    ap.add_argument("--case", help="run this one case (the JSON a failure printed) and stop")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the worker")
    ap.add_argument("--case-timeout", type=float, default=600.0,
                    help="seconds before a case counts as hung")
    ap.add_argument("--max-pool", type=int, default=None,
                    help="largest pool to draw, bytes (default min(1 GiB, available/8))")
    ap.add_argument("--calibrated", action="store_true",
                    help="price selective/auto with this machine's calibration (measured on "
                         "first use, cached) instead of drawn rates")
    ap.add_argument("--worker-pool-cap", type=int, default=3 << 30,
                    help="restart the worker once the pools it mapped pass this many bytes")
    args = ap.parse_args(argv)

    if args.case:
        case = sm.Case.from_json(args.case)
        print(case.short(), flush=True)
        out = sm.run_case(case, log=lambda s: print(s, flush=True))
        print(out.describe())
        print(json.dumps(out.stats))
        return 0 if out.ok else 1

    max_pool = args.max_pool or sm.max_pool_bytes()
    rng = random.Random(args.seed)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    print(f"stress: seed {args.seed}, {args.minutes:g} min, pools 16MiB..{_mib(max_pool)}, "
          f"{args.threads} torch thread(s), pid {os.getpid()}", flush=True)
    worker = Worker(args.threads)
    records = []
    i = 0
    while time.monotonic() < deadline:
        case = sm.draw_case(rng, max_pool, calibrated=args.calibrated)
        if (worker.pool_bytes and case.pool_bytes not in worker.pool_bytes
                and sum(worker.pool_bytes) + case.pool_bytes > args.worker_pool_cap):
            worker.close()
            worker = Worker(args.threads)
        res = worker.run(case, args.case_timeout)
        kind = res.get("kind")
        records.append({"case": json.loads(case.to_json()), "outcome": res})
        steps = res.get("steps_done", 0)
        st = res.get("stats") or {}
        moved = (f" host {_mib(st.get('bytes_offloaded_host', 0))}"
                 f" nvme {_mib(st.get('bytes_offloaded_nvme', 0))}"
                 f" chunked {st.get('tensors_chunked', 0)}") if st else ""
        print(f"[{i:3d} {(time.monotonic() - start) / 60:5.1f}m] {kind.upper():9s} "
              f"{case.short()} ({steps}/{case.steps} steps, {res.get('seconds', 0):.1f}s{moved})",
              flush=True)
        if kind != "ok":
            first = (res.get("message") or "").splitlines()[:1]
            print("    " + (first[0][:300] if first else "(no message)"), flush=True)
            if worker.alive():
                worker.close()
            worker = Worker(args.threads)
        i += 1
    worker.close()
    minutes = (time.monotonic() - start) / 60

    cases = [sm.Case(**r["case"]) for r in records]
    outs = [r["outcome"] for r in records]
    fails = [(c, o) for c, o in zip(cases, outs) if o.get("kind") != "ok"]

    def count(xs):
        return ", ".join(f"{k} {v}" for k, v in sorted(collections.Counter(xs).items(),
                                                       key=lambda kv: (-kv[1], str(kv[0]))))

    pools = sorted(c.pool_bytes for c in cases if c.pool_bytes) or [0]
    steps_run = sum(o.get("steps_done", 0) for o in outs)
    steps_drawn = sum(c.steps for c in cases)
    print("\n== summary ==")
    print(f"cases {len(cases)} ({len(cases) - len(fails)} ok, {len(fails)} failed) in "
          f"{minutes:.1f} min, seed {args.seed}")
    print(f"models: {count(c.family for c in cases)}")
    print(f"tiers: {count(c.tier for c in cases)}")
    print(f"policies: {count(c.policy for c in cases)}")
    print(f"attention: {count(c.attn for c in cases)}; dropout on: "
          f"{sum(c.dropout > 0 for c in cases)}; padded: {sum(c.pad for c in cases)}; "
          f"sliding window: {sum(c.window is not None for c in cases)}")
    if cases:
        print(f"pools: {len(set(pools))} sizes, {_mib(pools[0])} .. {_mib(pools[-1])}, median "
              f"{_mib(pools[len(pools) // 2])}; the default (growing) pool in "
              f"{sum(not c.pool_bytes for c in cases)} cases")
        vocabs = sorted(c.vocab for c in cases)
        print(f"vocabularies: {vocabs[0]} .. {vocabs[-1]}; min_offload_bytes: "
              f"{count(_mib(c.min_offload_bytes) for c in cases)}")
        print(f"sequence lengths: {min(min(c.seqs) for c in cases)} .. "
              f"{max(max(c.seqs) for c in cases)}; cases whose length changed between steps: "
              f"{sum(len(set(c.seqs)) > 1 for c in cases)}")
    priced = [c for c in cases if c.policy in ("selective", "auto")]
    print(f"steps: {steps_run} compared bitwise ({steps_drawn} drawn); of {len(priced)} "
          f"selective/auto cases {sum(c.rates is not None for c in priced)} priced with drawn "
          f"rates, the rest with {'the calibration' if args.calibrated else 'fixed rates'}")
    stats = [o.get("stats") or {} for o in outs]
    print(f"offload: {sum(s.get('bytes_offloaded_nvme', 0) > 0 for s in stats)} cases wrote to "
          f"NVMe, {sum(s.get('tensors_chunked', 0) > 0 for s in stats)} offloaded a storage in "
          f"pieces, {sum(s.get('bytes_kept_pool_full', 0) > 0 for s in stats)} kept bytes "
          f"because the pool was full; {_mib(sum(s.get('bytes_offloaded_host', 0) for s in stats))}"
          f" host + {_mib(sum(s.get('bytes_offloaded_nvme', 0) for s in stats))} NVMe offloaded")
    print(f"outcomes: {count(o.get('kind') for o in outs)}")
    if fails:
        print("\n== failures ==")
        for n, (c, o) in enumerate(fails):
            step = o.get("step")
            print(f"\n-- failure {n}: {o.get('kind')}"
                  f"{'' if step is None else f' at step {step}'}: {c.short()}")
            print(f"   {o.get('message')}")
            print(f"   reproduce: {_repro(c)}")
            tb = (o.get("traceback") or "").strip().splitlines()
            if tb:
                print("   " + "\n   ".join(tb[-6:]))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "seed": args.seed, "minutes": minutes, "max_pool": max_pool, "records": records,
        }, indent=1))
        print(f"\nwrote {args.out}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
