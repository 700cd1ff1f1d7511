"""What recomputing one layer's attention-score chain costs on this CPU, against the layer's
share of a plain step: the four ops selective recompute reruns for each layer of the
recompute_bench GPT (scores = q @ k^T, / sqrt(d), masked_fill, softmax; 128 MiB each in fp32
at batch 4, 8 heads, seq 1024), with fresh outputs (page-faulted, as glibc hands out tensors
above 32 MiB) and with outputs written into memory already faulted in (as a caching allocator
would give).

    python benches/python/score_chain.py [--batch 4 --heads 8 --seq 1024 --head-dim 64]
        [--rounds 10]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    b, h, s, d = args.batch, args.heads, args.seq, args.head_dim
    q = torch.randn(b * h, s, d)
    kt = torch.randn(b * h, d, s)
    mask = torch.ones(s, s, dtype=torch.bool).tril().logical_not()
    scale = math.sqrt(d)
    outs = [torch.empty(b, h, s, s).fill_(0) for _ in range(4)]  # faulted in once

    def fresh() -> None:
        x = torch.bmm(q, kt).view(b, h, s, s)
        x = x / scale
        x = x.masked_fill(mask, float("-inf"))
        torch.softmax(x, dim=-1)

    def faulted() -> None:
        x = torch.bmm(q, kt, out=outs[0].view(b * h, s, s)).view(b, h, s, s)
        x = torch.div(x, scale, out=outs[1])
        outs[2].copy_(x).masked_fill_(mask, float("-inf"))
        torch.ops.aten._softmax.out(outs[2], -1, False, out=outs[3])

    # Bitwise the same chain either way.
    x = torch.softmax((torch.bmm(q, kt).view(b, h, s, s) / scale).masked_fill(
        mask, float("-inf")), dim=-1)
    faulted()
    assert torch.equal(x, outs[3])
    del x

    times = {"fresh outputs": [], "pre-faulted outputs": []}
    for _ in range(args.rounds):  # interleaved
        for name, fn in (("fresh outputs", fresh), ("pre-faulted outputs", faulted)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    mib = b * h * s * s * 4 / 2**20
    print(f"score chain of one layer: 4 ops over {mib:.0f} MiB tensors, {torch.get_num_threads()} "
          f"threads, medians of {args.rounds}")
    for name, ts in times.items():
        print(f"  {name:<20} {statistics.median(ts) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
