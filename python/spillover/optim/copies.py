"""The optimizer's device <-> host copies, on the activation link's CUDA primitives.

Note [optimizer copies]
    Streams, events, a copy on a stream and ``record_stream`` are those of
    ``activations/link/cuda.py`` (``CudaDevice``), the one place that drives ``torch.cuda`` for
    copies. What differs from the activation path is the rule for a copy's source. There
    (Note [sources held] in rust/link/mod.rs) a source is never passed to
    ``record_stream``: it is held until its copy lands or the compute stream waits on it,
    because forward's activations are many, are to be freed as early as possible, and bytes the
    allocator keeps back for another stream would be invisible to the link's cap. Here:

    - D2H (``to_host``, ``stage``: a gradient into a staging buffer, a parameter into an output
      buffer for its first master copy): the copy stream waits on an event of the compute
      stream (the source's producer), and the source is passed to ``record_stream``. The
      source is the user's gradient, which the optimizer does not own and cannot hold:
      ``zero_grad(set_to_none=True)``, a step GradScaler skips or an abandoned backward drops
      it while its copy may still be queued. What ``record_stream`` keeps back is bounded by
      one step's gradients, resident through backward anyway, and every copy is waited for
      (its event synchronized) before ``step()`` reads its buffer or ``close()`` frees it.
    - H2D (``to_device``: parameters back from an output buffer): the copy stream waits for
      the compute stream (kernels queued before may still read the parameter) and the compute
      stream for the copy, so the next forward sees the new values without a host wait (Note
      [staged gradients] in staged.py). The source is a pinned buffer the optimizer owns and
      does not overwrite before the copy's event has been synchronized (``_wait_h2d``):
      nothing is recorded.
    - The staged copy's fingerprint kernels run on the D2H stream too (Note [gradient
      fingerprint] in fingerprint.py).

    On CPU (parameters on the host with ``update_in_backward``, and the tests'
    ``_force_staging``) every copy is a synchronous ``copy_`` and every event None, unless a
    stand-in of ``CudaDevice`` is given (``OffloadAdamW(_link=...)``: the simulated device of
    ``activations/link/sim.py`` in the benchmark, a recording device in the tests); every copy
    then goes through it, the fingerprint's kernels run on the calling thread.

Note [parameter writes are ordered]
    Every write of a parameter the optimizer issues is an H2D copy from ``to_device``, and the
    compute stream current at that call waits on the copy's event right after it is queued
    (a ``wait_event``, not a host synchronize), or a kernel queued on that stream after such a
    wait (the delayed update's gradient term: Note [next-gradient prediction] in
    rust/optim/predict.rs). Those calls are made only by ``step()`` on the
    caller's thread: the update-in-backward worker and the hooks write state and staging
    buffers, never a parameter (Note [update in backward] in inbwd.py). So when backward
    returns nothing of the optimizer's writes a parameter, and when ``step()`` returns the
    compute stream is ordered after every write it queued: an EMA update or a parameter norm
    run between backward and ``step()`` reads the old values, one run after ``step()`` the new,
    with no host wait. The sharded step's parameter all-gather and copies into the model run on
    the compute stream after those waits. Guarded through a device that logs these calls
    (tests/python/_stream_log.py): test_optim_staged.py (staged, update in backward) and
    test_optim.py's two-rank test (sharded).
"""

from __future__ import annotations

import contextlib
from typing import Any, List, Tuple

import torch

from ..activations.link.cuda import CudaDevice
from . import fingerprint as _fp


class _Copies:
    """Device <-> pinned host copies for the staged path (Note [optimizer copies])."""

    def __init__(self, device: torch.device, link: Any = None):
        """`link`: a stand-in of ``CudaDevice`` for CPU tensors (Note [optimizer copies])."""
        self.dev: Any = link
        if link is None and device.type == "cuda":
            self.dev = CudaDevice(device)
        if self.dev is not None:
            self.d2h = self.dev.new_stream()
            self.h2d = self.dev.new_stream()
        if device.type == "cuda":
            _fp._fp_weights(device)  # made here, on the compute stream, before any use

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying `src` (device) into `dst` (pinned host); its event."""
        dev = self.dev
        if dev is None:
            dst.copy_(src)
            return None
        dev.wait(self.d2h, dev.record(dev.current_stream()))  # after src's producer
        dev.copy(dst, src, self.d2h)
        ev = dev.record(self.d2h)
        dev.record_stream(src.untyped_storage(), self.d2h)  # Note [optimizer copies]
        return ev

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy `src` (host) into `dst` (device): the copy waits for the compute stream and the
        compute stream for the copy (on the main thread, at ``step()``)."""
        dev = self.dev
        if dev is None:
            dst.copy_(src)
            return None
        compute = dev.current_stream()
        dev.wait(self.h2d, dev.record(compute))  # kernels queued before may read the parameter
        dev.copy(dst, src, self.h2d)
        ev = dev.record(self.h2d)
        dev.wait(compute, ev)  # Note [parameter writes are ordered]
        return ev

    def stage(
        self, src: torch.Tensor, units: List[Tuple[torch.Tensor, int, int]], fp_dst: torch.Tensor
    ) -> Tuple[List[Any], Any]:
        """Note [gradient fingerprint]: copy the flat gradient `src` into the host views of its
        units (``(dst, start, n)``, in order, covering it) through device snapshots of one
        fingerprint chunk each, and each snapshot's sums into the host tensor `fp_dst`, so the
        staged bytes and the fingerprint are of the same bytes even if `src` is written while
        the copy runs. Returns one event per unit and one after the fingerprint."""
        dev = self.dev
        ctx: Any = contextlib.nullcontext()
        if dev is not None:
            dev.wait(self.d2h, dev.record(dev.current_stream()))
            if src.is_cuda:
                ctx = torch.cuda.stream(self.d2h)  # the fingerprint's kernels run there too
        esize = src.element_size()
        chunk = _fp._FP_CHUNK // esize
        events: List[Any] = []
        with ctx:
            parts = []
            u = 0
            for lo in range(0, src.numel(), chunk):
                hi = min(lo + chunk, src.numel())
                # the snapshot: whole rows for the fingerprint, one copy (Note [gradient
                # fingerprint]); its first hi - lo elements are the chunk's bytes
                raw = src[lo:hi].view(torch.int8)
                padded = _fp._fp_pad(raw)
                if padded is raw:
                    padded = raw.clone()
                parts.append(_fp._fp_chunk(padded, padded=True))
                snap = padded[: raw.numel()].view(src.dtype)
                while u < len(units):
                    dst, start, n = units[u]
                    a, b = max(lo, start), min(hi, start + n)
                    if a < b:
                        self._copy_d2h(dst[a - start : b - start], snap[a - lo : b - lo])
                    if start + n > hi:
                        break  # the unit goes on in the next chunk
                    events.append(self._record())
                    u += 1
            while u < len(units):  # empty units at the end
                events.append(self._record())
                u += 1
            if not parts:
                parts.append(torch.zeros(_fp._FP_LANES, dtype=torch.int64, device=src.device))
            self._copy_d2h(fp_dst, torch.stack(parts))
            fp_event = self._record()
        if dev is not None:
            dev.record_stream(src.untyped_storage(), self.d2h)  # Note [optimizer copies]
        return events, fp_event

    def _copy_d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A copy on the D2H stream (inside ``stage``'s stream context on CUDA)."""
        if self.dev is None:
            dst.copy_(src)
        else:
            self.dev.copy(dst, src, self.d2h)

    def _record(self) -> Any:
        return None if self.dev is None else self.dev.record(self.d2h)

    def hold_compute(self, ev: Any) -> None:
        """The compute stream waits for the copy of event `ev` (no host wait): what is queued
        on it after this call runs after the copy (Note [delayed update] in delayed.py)."""
        if ev is not None and self.dev is not None:
            self.dev.wait(self.dev.current_stream(), ev)

    def wait(self, ev: Any) -> None:
        """Block the host until the copy of event `ev` has landed (None: it has)."""
        if ev is not None and self.dev is not None:
            self.dev.synchronize(ev)
