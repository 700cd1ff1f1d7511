"""OffloadAdamW(update_in_backward=True) on CPU parameters against the default mode, same run,
interleaved: backward, then clip_grad_norm_, then step(), timed per part (medians over rounds,
the first round dropped).

    python benches/python/inbwd_bench.py [--params 8e6] [--tensors 16] [--rounds 10]

Rows: the default mode (the kernel updates each parameter in place at step()); update in
backward with a clip limit that never applies (every update made during backward is kept); and
one that always applies (every update is undone and redone at step(): Note [speculative update]
in spillover/optim/inbwd.py). On a GPU host the mode overlaps the CPU update with the device's
backward; here backward and the update share the same cores, so this measures what the mode
costs, not what it saves."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import spillover


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=8e6)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    n, t = int(args.params), args.tensors
    torch.manual_seed(0)

    def setup(inbwd: bool):
        ps = [torch.nn.Parameter(torch.randn(n // t)) for _ in range(t)]
        coef = [torch.randn(n // t) * 1e-2 for _ in range(t)]
        opt = spillover.OffloadAdamW(
            ps, lr=1e-3, update_in_backward=inbwd, host_pool_bytes=max(1 << 30, 40 * n)
        )
        return ps, coef, opt

    def step(ps, coef, opt, clip):
        for p in ps:
            p.grad = None
        t0 = time.perf_counter()
        sum((p * c).sum() for p, c in zip(ps, coef)).backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(ps, clip)
        opt.step()
        return t1 - t0, time.perf_counter() - t1

    runs = {
        "default mode": (setup(False), 1e9),
        "in backward, clip never applies": (setup(True), 1e9),
        "in backward, clip always applies": (setup(True), 1e-6),
    }
    times = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, (s, clip) in runs.items():
            times[k].append(step(*s, clip))
    print(f"{n / 1e6:.0f}M fp32 parameters in {t} tensors, {torch.get_num_threads()} threads")
    print("| mode | backward ms | clip + step() ms | total ms | steps kept / redone |")
    print("| --- | --- | --- | --- | --- |")
    for k, v in times.items():
        b = statistics.median(x[0] for x in v[1:])
        s = statistics.median(x[1] for x in v[1:])
        st = runs[k][0][2].stats()
        kept = f"{st['steps_in_backward']} / {st['steps_redone']}"
        print(f"| {k} | {b * 1e3:.1f} | {s * 1e3:.1f} | {(b + s) * 1e3:.1f} | {kept} |")


if __name__ == "__main__":
    main()
