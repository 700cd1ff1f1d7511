"""Per-op overhead of ``spillover.wrap(model, policy="selective")`` against torch's own
selective checkpointing with the same decisions, on a model small enough that Python, not
arithmetic, sets the step time.

Both sides checkpoint each block of the same GPT (non-reentrant). torch's side is
``checkpoint(block, x, use_reentrant=False, context_fn=partial(
create_selective_checkpoint_contexts, policy_fn))`` where ``policy_fn`` applies the same rule
as spillover's policy (``SelectivePolicy.torch_policy``), so both run the same rule on the
same ops; a check step asserts that both saved the same ops and computed the same loss.
The modes run interleaved, round by round (order alternating), so a shared, noisy machine
slows both alike; the table gives the median step time of each, the spread of its per-round
medians, the ratio to torch, and the cost above a plain (no checkpoint) step per region op.

    python benches/python/wrap_overhead.py [--rounds 30 --steps 4 --batch 2 --threads 1]
    python benches/python/wrap_overhead.py --min-flops-per-byte 32   # the linears are saved
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import json
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
import torch.utils.checkpoint as tc
from torch import nn

import spillover
from spillover.models import GPT, GPTConfig, synthetic_batch


class TorchSAC(nn.Module):
    """One block under torch's selective checkpointing."""

    def __init__(self, block: nn.Module, policy_fn: Callable[..., Any]):
        super().__init__()
        self.block = block
        self.context_fn = functools.partial(tc.create_selective_checkpoint_contexts, policy_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tc.checkpoint(self.block, x, use_reentrant=False, context_fn=self.context_fn)


def torch_sac(model: GPT, policy_fn: Callable[..., Any]) -> GPT:
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = TorchSAC(blk, policy_fn)
    return model


class Recording(spillover.SelectivePolicy):
    """The same rule, noting the ops it saves (check step only)."""

    def __init__(self, min_flops_per_byte: float, saved: collections.Counter):
        super().__init__(min_flops_per_byte)
        self.saved = saved

    def decide(self, op: Any, args: Any, kwargs: Dict[str, Any], out: Any) -> str:
        d = super().decide(op, args, kwargs, out)
        if d == "save":
            self.saved[str(op)] += 1
        return d


def step(model: nn.Module, batch: tuple) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    return loss.detach()


def check(base: GPT, batch: tuple, mfpb: float) -> int:
    """Both sides save the same ops and compute the same loss; returns the ops per region."""
    ours: collections.Counter = collections.Counter()
    theirs: collections.Counter = collections.Counter()
    a = spillover.wrap(copy.deepcopy(base), policy=Recording(mfpb, ours))
    rule = Recording(mfpb, theirs)

    def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        return rule.torch_policy(ctx, func, *args, **kwargs)

    b = torch_sac(copy.deepcopy(base), policy_fn)
    la, lb = step(a, batch), step(b, batch)
    assert torch.equal(la, lb), (la, lb)
    theirs.clear()  # torch's policy_fn is called in forward only; count one step
    ours.clear()
    step(a, batch)
    step(b, batch)
    assert ours == theirs, f"saved ops differ: spillover {dict(ours)}, torch {dict(theirs)}"
    recs = a._spillover_state.last_records()
    print(f"decisions match: {sum(ours.values())} op outputs saved per step "
          f"({', '.join(f'{k} x{v}' for k, v in sorted(ours.items())) or 'none'})")
    return len(recs[0].ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=4, help="steps per mode per round")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--min-flops-per-byte", type=float, default=256.0,
                    help="SelectivePolicy's threshold (256: policy='selective')")
    ap.add_argument("--no-plain", action="store_true", help="leave out the plain baseline")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=args.d_model, n_heads=4, n_layers=args.layers,
                    seq=args.seq)
    base = GPT(cfg)
    batch = synthetic_batch(cfg, args.batch)
    ops_per_region = check(base, batch, args.min_flops_per_byte)

    mfpb = args.min_flops_per_byte
    pol: Any = "selective" if mfpb == 256.0 else spillover.SelectivePolicy(mfpb)
    rule = spillover.SelectivePolicy(mfpb)
    models: Dict[str, nn.Module] = {
        "torch-sac": torch_sac(copy.deepcopy(base), rule.torch_policy),
        "spillover": spillover.wrap(copy.deepcopy(base), policy=pol),
    }
    if not args.no_plain:
        models["plain"] = copy.deepcopy(base)
    for m in models.values():  # warm up
        for _ in range(3):
            step(m, batch)
    per_round: Dict[str, List[float]] = {k: [] for k in models}
    names = list(models)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for k in order:
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(models[k], batch)
                ts.append(time.perf_counter() - t0)
            per_round[k].append(statistics.median(ts))

    med = {k: statistics.median(v) for k, v in per_round.items()}
    n_ops = ops_per_region * cfg.n_layers
    print(f"GPT d_model={cfg.d_model} layers={cfg.n_layers} seq={cfg.seq} batch={args.batch}, "
          f"{ops_per_region} ops per region, {args.rounds} rounds x {args.steps} steps, "
          f"threads={args.threads}, min_flops_per_byte={mfpb:g}")
    print(f"{'mode':<10} {'median ms':>10} {'p10-p90 of rounds':>20} {'vs torch':>9} "
          f"{'us/op above plain':>18}")
    out: Dict[str, Any] = {}
    for k in names:
        v = sorted(per_round[k])
        p10, p90 = v[len(v) // 10], v[(len(v) * 9) // 10]
        above = (med[k] - med["plain"]) / n_ops * 1e6 if "plain" in med else float("nan")
        print(f"{k:<10} {med[k] * 1e3:>10.2f} {f'{p10 * 1e3:.2f}-{p90 * 1e3:.2f}':>20} "
              f"{med[k] / med['torch-sac']:>8.3f}x {above:>18.2f}")
        out[k] = {"median_s": med[k], "p10_s": p10, "p90_s": p90,
                  "ratio_vs_torch": med[k] / med["torch-sac"], "us_per_op_above_plain": above}
    # The ratio per round (same round, adjacent in time) is steadier than the ratio of medians.
    pr = [s / t for s, t in zip(per_round["spillover"], per_round["torch-sac"])]
    print(f"spillover / torch-sac per round: median {statistics.median(pr):.3f}x, "
          f"p10-p90 {sorted(pr)[len(pr) // 10]:.3f}-{sorted(pr)[(len(pr) * 9) // 10]:.3f}")
    out["ratio_per_round_median"] = statistics.median(pr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
