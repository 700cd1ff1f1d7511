"""The optimizer's device <-> host copies (Note [optimizer copies])."""

from __future__ import annotations

import contextlib
from typing import Any, List, Tuple

import torch

from . import fingerprint as _fp


class _Copies:
    """Device <-> pinned host copies for the staged path; synchronous on CPU (tests)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            _fp._fp_weights(device)  # made here, on the compute stream, before any use

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        if not self.cuda:
            dst.copy_(src)
            return None
        # The producer of `src` is the compute stream; the caching allocator must not reuse
        # `src` (zero_grad may free it) before this stream has read it.
        self.d2h.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        src.record_stream(self.d2h)
        return ev

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy `src` (host) into `dst` (device): the copy waits for the compute stream and the
        compute stream for the copy (on the main thread, at ``step()``)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        compute = torch.cuda.current_stream(dst.device)
        self.h2d.wait_stream(compute)  # kernels queued before may still read the parameter
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        compute.wait_event(ev)  # Note [staged gradients]: the next forward sees new values
        return ev

    def stage(
        self, src: torch.Tensor, units: List[Tuple[torch.Tensor, int, int]], fp_dst: torch.Tensor
    ) -> Tuple[List[Any], Any]:
        """Note [gradient fingerprint]: copy the flat gradient `src` into the host views of its
        units (``(dst, start, n)``, in order, covering it) through device snapshots of one
        fingerprint chunk each, and each snapshot's sums into the host tensor `fp_dst`, so the
        staged bytes and the fingerprint are of the same bytes even if `src` is written while
        the copy runs. Returns one event per unit and one after the fingerprint."""
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream(src.device))
            ctx: Any = torch.cuda.stream(self.d2h)
        else:
            ctx = contextlib.nullcontext()
        esize = src.element_size()
        chunk = _fp._FP_WORDS * 2 // esize
        events: List[Any] = []
        with ctx:
            r = _fp._fp_weights(src.device)
            parts = []
            u = 0
            for lo in range(0, src.numel(), chunk):
                hi = min(lo + chunk, src.numel())
                snap = src[lo:hi].clone()
                words = snap.view(torch.int16)
                parts.append((words * r[:, : words.numel()]).sum(dim=1))
                while u < len(units):
                    dst, start, n = units[u]
                    a, b = max(lo, start), min(hi, start + n)
                    if a < b:
                        dst[a - start : b - start].copy_(snap[a - lo : b - lo], non_blocking=True)
                    if start + n > hi:
                        break  # the unit goes on in the next chunk
                    events.append(self._record())
                    u += 1
            while u < len(units):  # empty units at the end
                events.append(self._record())
                u += 1
            if not parts:
                parts.append(torch.zeros(2, dtype=torch.int64, device=src.device))
            fp_dst.copy_(torch.stack(parts), non_blocking=True)
            fp_event = self._record()
        if self.cuda:
            src.record_stream(self.d2h)
        return events, fp_event

    def _record(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def wait(ev: Any) -> None:
        if ev is not None:
            ev.synchronize()
