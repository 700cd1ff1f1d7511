"""The gradient fingerprint's cost (Note [gradient fingerprint] in spillover/optim/fingerprint.py):
for --params parameters in --tensors gradients, one pass of the fingerprint over every gradient,

- the torch ops it dispatches, per gradient (its "bucket": what the hook stages at once);
- the host time of a pass on ``meta`` tensors: the dispatch alone, what a GPU's host pays while
  the kernels run on the device;
- the time of a pass on this CPU, arithmetic included.

Only ``spillover.optim.fingerprint._fingerprint_parts`` is used, so the same script measures an
older spillover: ``PYTHONPATH=/path/to/old/python python benches/python/fingerprint_cost.py``.

    python benches/python/fingerprint_cost.py [--params 1e8] [--tensors 64] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spillover.optim import fingerprint as fp

FREE = ("view", "_unsafe_view", "slice", "detach", "alias", "as_strided", "select", "unbind")


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        if not func.__name__.startswith(FREE):
            self.n += 1
        return func(*args, **(kwargs or {}))


def llama_1b_sizes() -> List[int]:
    """The parameters of a Llama-style 1B model (bench.py's: d 2048, 16 layers, ffn 5632,
    vocab 32000): embedding, per layer qkv / o / gate / up / down and two norms, norm, head."""
    d, ffn, vocab = 2048, 5632, 32000
    layer = [d * 3 * d, d * d, d * ffn, d * ffn, ffn * d, d, d]
    return [vocab * d] + layer * 16 + [d, vocab * d]


def measure(sizes: List[int], dtype: torch.dtype, rounds: int,
            devices: tuple = ("meta", "cpu")) -> Dict[str, Any]:
    out: Dict[str, Any] = {"params": sum(sizes), "tensors": len(sizes), "dtype": str(dtype)}
    for device in devices:
        grads = [torch.randn(n, device=device).to(dtype) for n in sizes]
        fp._fingerprint_parts(grads[0])  # the weights made once, as the optimizer does
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for g in grads:
                fp._fingerprint_parts(g)
            times.append(time.perf_counter() - t0)
        out[f"{device}_s"] = statistics.median(times)
        out[f"{device}_spread"] = (min(times), max(times))
        if device == "meta":
            c = _Count()
            with c:
                for g in grads:
                    fp._fingerprint_parts(g)
            out["ops"] = c.n
        del grads
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", default="even", choices=["even", "llama1b"],
                    help="even: --params in --tensors equal gradients; llama1b: a 1B model's")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.shape == "llama1b":
        sizes, devices = llama_1b_sizes(), ("meta",)  # 2 GiB of bf16: dispatch only
    else:
        sizes, devices = [int(args.params) // args.tensors] * args.tensors, ("meta", "cpu")
    r = measure(sizes, dtype, args.rounds, devices)
    line = (f"fingerprint of {r['params'] / 1e6:.0f}M {args.dtype} parameters in {r['tensors']} "
            f"gradients ({args.shape}): {r['ops']} torch ops per pass "
            f"({r['ops'] / r['tensors']:.1f} per gradient); host time per pass (dispatch on "
            f"meta tensors) {r['meta_s'] * 1e3:.1f} ms "
            f"[{r['meta_spread'][0] * 1e3:.1f}, {r['meta_spread'][1] * 1e3:.1f}]")
    if "cpu_s" in r:
        line += (f"; on this CPU with the arithmetic {r['cpu_s'] * 1e3:.1f} ms "
                 f"[{r['cpu_spread'][0] * 1e3:.1f}, {r['cpu_spread'][1] * 1e3:.1f}]")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
