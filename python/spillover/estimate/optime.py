"""Op times on this machine's CPU, measured per op signature (Note [op times on a CPU]).

Note [op times on a CPU]
    A roofline (FLOPs at the calibrated matmul rate, bytes at the elementwise rate) misses a CPU
    step by 3-9x: the calibration is cached and kept stable for the planner (Note [stable
    calibration] in calibrate.py) while the machine's load moves its real rates 4x (measured
    here, one hour apart: 177 vs 38 GFLOP/s), small matmuls run far below the large one's
    rate, and softmax, norms and GELU cost more per byte than a multiply. So for a CPU the
    estimate times each distinct op of the step once, for real: the op (an ATen overload),
    its arguments' shapes, strides and dtypes and its other arguments make a signature; the
    first time the trace meets one, the op runs on scratch tensors of those shapes, once to warm
    up and three times timed, and
    the faster time less the cost of calling an op at all is kept for the process. A repeated
    block costs one block's ops to time, not the step's. Scratch values matter: integers are
    zero (a valid index, class or mask) and floats uniform in [0.5, 1). Standard normal values
    made torch's chunked ``linear_cross_entropy`` take 17 s instead of 1 s (1,024 tokens,
    vocab 32,000, d 256): logits of N(0, 256) push ``exp`` into denormals, which a CPU computes
    ~100x slower; trained weights and these values keep logits moderate. An op that will not
    run on scratch
    tensors (one that reads values to size its output) falls back to the roofline. The host's
    dispatch cost per op (``Device.host_seconds_per_op``, autograd and Python included) is
    added by the time model as for any device.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["OpTimer"]

_SKIP = {"_local_scalar_dense", "empty", "empty_strided", "new_empty", "new_empty_strided",
         "_to_copy_", "lift_fresh", "detach"}


def _describe(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset())
    if isinstance(x, (list, tuple)):
        return tuple(_describe(y) for y in x)
    if isinstance(x, torch.device):
        return ("D",)
    return x


def _make(d: Any) -> Any:
    if isinstance(d, tuple) and d and d[0] == "T":
        _, shape, stride, dtype, offset = d
        n = 1 + offset + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
        if any(s == 0 for s in shape):
            n = offset + 1
        if dtype.is_floating_point:  # Note [op times on a CPU]: no denormals, no NaN
            base = torch.rand(n).add_(1.0).mul_(0.5).to(dtype)
        else:
            base = torch.zeros(n, dtype=dtype)
        return base.as_strided(shape, stride, offset)
    if isinstance(d, tuple) and d and d[0] == "D":
        return torch.device("cpu")
    if isinstance(d, tuple):
        return type(d)(_make(y) for y in d) if d else d
    return d


class OpTimer:
    """Note [op times on a CPU]: seconds of one op by signature, measured on first sight."""

    def __init__(self) -> None:
        self._times: Dict[Tuple[Any, ...], Optional[float]] = {}
        self._lock = threading.Lock()
        self._call: Optional[float] = None

    def call_seconds(self) -> float:
        """The cost of calling a trivial op (subtracted from every op's time)."""
        if self._call is None:
            a = torch.ones(1)
            op = torch.ops.aten.add.Tensor
            ts = []
            for _ in range(200):
                t0 = time.perf_counter()
                op(a, a)
                ts.append(time.perf_counter() - t0)
            ts.sort()
            self._call = ts[len(ts) // 2]
        return self._call

    def key(self, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
            ) -> Optional[Tuple[Any, ...]]:
        """The op's signature (None: not timed)."""
        name = getattr(func, "__name__", "")
        if name.split(".")[0] in _SKIP:
            return None
        try:
            key = (func, _describe(args), _describe(tuple(sorted(kwargs.items()))))
            hash(key)
        except TypeError:
            return None
        return key

    def seconds(self, key: Optional[Tuple[Any, ...]]) -> Optional[float]:
        """The measured seconds of the op ``key`` names (measured now if never seen; None: it
        could not be measured)."""
        if key is None:
            return None
        with self._lock:
            if key in self._times:
                return self._times[key]
        sec = self._measure(key[0], key[1], dict(_make(key[2])))
        with self._lock:
            self._times[key] = sec
        return sec

    def refresh(self) -> None:
        """Measure every signature seen again (the machine's load moves its rates: a bench
        interleaves this with the real steps it compares against)."""
        with self._lock:
            keys = list(self._times)
        for key in keys:
            sec = self._measure(key[0], key[1], dict(_make(key[2])))
            with self._lock:
                self._times[key] = sec

    def _measure(self, func: Any, args_d: Any, kwargs: Dict[str, Any]) -> Optional[float]:
        with _disable_current_modes(), torch.no_grad():
            try:
                base = self.call_seconds()
                args = _make(args_d)
                func(*args, **kwargs)
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    func(*args, **kwargs)
                    best = min(best, time.perf_counter() - t0)
                return max(0.0, best - base)
            except Exception:  # an op scratch tensors cannot run: the roofline decides
                return None
