"""The host's time per op of a wrapped block, against torch's own checkpointing, on a host-bound
model: an HF Llama with tiny layers (hidden 64, seq 16), whose step is its Python dispatch, as a
GPU's forward is when its kernels are short. Interleaved rounds, medians and spread; per mode the
forward and backward over none's, per op of the wrapped blocks.

    python benches/python/region_dispatch.py                 # SDPA, 4 layers, 40 rounds
    python benches/python/region_dispatch.py --attn eager --rounds 60

Modes: none; torch's full checkpointing and its selective checkpointing saving the matmuls
(HF's gradient checkpointing with a ``context_fn``); spillover's full, selective (following its
record, and recording every run as before Note [a forward that follows its record]), and auto at
a budget where every block saves some ops (following and recording).
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.utils.checkpoint as tc

import spillover
from spillover.planner import Machine, Planner
from spillover.recompute import follow

#: fixed rates, so that auto's plan does not depend on this host's calibration
MACHINE = Machine(matmul_flops={"float32": 1e11}, elementwise_bytes_per_s=1e10,
                  d2h_bytes_per_s=5e9, h2d_bytes_per_s=5e9)


def _recording(run: Any, *_: Any) -> Any:
    return run.contexts


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)
    try:
        import transformers
    except ImportError:
        sys.exit("region_dispatch: needs transformers (pip install -e '.[test]')")
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=args.attn)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))

    def wrapped(policy: Any) -> torch.nn.Module:
        m = copy.deepcopy(base)
        spillover.wrap(m, policy=policy, chunked_loss=False)
        return m

    def torch_ckpt(context_fn: Any = None) -> torch.nn.Module:
        m = copy.deepcopy(base)
        kw: Dict[str, Any] = {"use_reentrant": False}
        if context_fn is not None:
            kw["context_fn"] = context_fn
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        m.train()
        return m

    def save_mm(ctx: Any, op: Any, *a: Any, **k: Any) -> Any:
        return (tc.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default
                else tc.CheckpointPolicy.PREFER_RECOMPUTE)

    def step(m: torch.nn.Module) -> Tuple[float, float]:
        m.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        t1 = time.perf_counter()
        loss.backward()
        return t1 - t0, time.perf_counter() - t1

    # auto at the budget where the most blocks save some ops and recompute the rest
    best: Tuple[int, Any] = (-1, None)
    for budget in range(2_000_000, 12_000_001, 250_000):
        planner = Planner(budget_bytes=budget, machine=MACHINE, measure_peak=False,
                          seed_from_trace=False)
        m = wrapped(planner)
        step(m)
        step(m)
        k = sum(r.mode == "checkpoint" and not r.recomputes_all for r in planner.plan.regions)
        if k > best[0]:
            best = (k, m)
    print(f"HF Llama {args.layers} x hidden 64, seq 16, {args.attn}; torch {torch.__version__}; "
          f"auto: {best[0]} of {args.layers} blocks save some ops")
    sel = wrapped(spillover.SelectivePolicy(machine=MACHINE))
    following = follow.following_contexts
    modes: Dict[str, Tuple[torch.nn.Module, Callable[..., Any]]] = {
        "none": (base, following),
        "torch full": (torch_ckpt(), following),
        "torch selective": (torch_ckpt(functools.partial(tc.create_selective_checkpoint_contexts,
                                                         save_mm)),
                            following),
        "full": (wrapped("full"), following),
        "selective": (sel, following),
        "selective, recording": (sel, _recording),
        "auto": (best[1], following),
        "auto, recording": (best[1], _recording),
    }
    count = _ops_per_block(base, ids)
    times: Dict[str, Tuple[List[float], List[float]]] = {k: ([], []) for k in modes}
    try:
        for r in range(args.rounds + 2):
            for name, (m, contexts) in modes.items():
                follow.following_contexts = contexts
                f, b = step(m)
                if r >= 2:  # two warm-up rounds: selective learns, then records
                    times[name][0].append(f)
                    times[name][1].append(b)
    finally:
        follow.following_contexts = following
    f0 = statistics.median(times["none"][0])
    b0 = statistics.median(times["none"][1])
    ops = count * args.layers
    print(f"{ops} ops in the wrapped blocks; medians of {args.rounds} interleaved rounds")
    print(f"{'mode':22} {'forward ms':>11} {'spread':>15} {'us/op over none':>16} "
          f"{'backward ms':>12} {'us/op over none':>16}")
    for name, (f, b) in times.items():
        fm, bm = statistics.median(f), statistics.median(b)
        print(f"{name:22} {fm * 1e3:11.2f} [{min(f) * 1e3:5.2f}, {max(f) * 1e3:5.2f}] "
              f"{(fm - f0) / ops * 1e6:16.1f} {bm * 1e3:12.2f} {(bm - b0) / ops * 1e6:16.1f}")
    return 0


def _ops_per_block(base: torch.nn.Module, ids: torch.Tensor) -> int:
    """Aten ops one decoder layer dispatches in its forward (with grad)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            Count.n += 1
            return func(*args, **(kwargs or {}))

    layer = base.model.layers[0]
    seen: List[int] = []

    def pre(mod: Any, a: Any, k: Any) -> None:
        seen.append(Count.n)

    def post(mod: Any, a: Any, k: Any, out: Any) -> None:
        seen.append(Count.n)

    h1 = layer.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = layer.register_forward_hook(post, with_kwargs=True)
    try:
        with Count():
            base(input_ids=ids, use_cache=False)
    finally:
        h1.remove()
        h2.remove()
    return seen[1] - seen[0]


if __name__ == "__main__":
    sys.exit(main())
