"""Device <-> host copies behind one small interface, with a CUDA and a CPU backend.

``to_host(src, block)`` starts copying the bytes of ``src`` (a 1-D uint8 tensor over a whole
storage) into a pool block and returns a :class:`Copy`; ``to_device(block, device, after)``
brings a block back. Both return at once; ``Copy.wait()`` blocks (GIL released) until done.

Note [source lifetime]
    A copy reads its source after ``to_host`` has returned. The source tensor is therefore
    referenced by the Copy until the copy is known complete — on CPU until the worker finishes
    (a callback of the worker drops it), on CUDA until the event has fired (polled by
    ``reap()`` at each pack and when the context exits), never by ``record_stream`` on the
    source, which would let the caching allocator hand the bytes out again only once the side
    stream reaches that point and so keep them longer than needed. The destination block is
    kept by the same Copy. Guarded by tests/python/test_context.py::test_abandoned_steps_free.

Note [in-place after pack]
    Under saved_tensors_hooks autograd no longer checks that a saved tensor was not modified in
    place before backward, and an asynchronous copy could read a half-modified tensor. So the
    saved tensor is watched: its version counter is compared when the copy completes (Copy
    .modified) and again at unpack while it is alive; either mismatch raises the error autograd
    itself would raise. Guarded by test_context.py::test_inplace_after_save_is_an_error.

Note [stream ordering]
    CUDA: the D2H copy runs on a side stream that first waits for the compute stream (the
    producer of the tensor). The H2D copy runs on a second side stream that waits for the D2H
    event of the same block, and the compute stream waits for the H2D event before using the
    tensor. Nothing calls torch.cuda.synchronize() on this path.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
import weakref
from typing import Any, Deque, Dict, Optional

import numpy as np
import torch

__all__ = ["Copy", "CpuBackend", "CudaBackend", "backend_for", "block_tensor"]


def block_tensor(block: Any) -> torch.Tensor:
    """A 1-D uint8 CPU tensor viewing the block's bytes (no copy; keeps the block alive)."""
    return torch.from_numpy(np.asarray(block))


class Copy:
    """A copy in flight. ``wait()`` returns when the destination holds the bytes; it re-raises
    whatever the copy raised. ``done()`` never blocks."""

    __slots__ = ("_future", "_event", "_keep", "_done", "_lock", "_watch", "_version", "modified",
                 "__weakref__")

    def __init__(
        self,
        future: Optional[concurrent.futures.Future] = None,
        event: Optional[Any] = None,
        keep: Any = None,
        watch: Optional[torch.Tensor] = None,
    ):
        self._future = future
        self._event = event
        self._keep = keep
        self._done = future is None and event is None
        self._lock = threading.Lock()
        # Note [in-place after pack]: the saved tensor is watched until the copy completes.
        # Weakly: a strong reference would close a cycle through the autograd graph
        # (tensor -> grad_fn -> saved handle -> this copy -> tensor) that gc cannot see.
        self._watch = weakref.ref(watch) if watch is not None else None
        self._version = watch._version if watch is not None else 0
        #: True when the saved tensor was modified in place before its copy completed.
        self.modified = False

    def done(self) -> bool:
        if self._done:
            return True
        # A future (CPU worker) or a CUDA event: both are polled without blocking.
        finished = self._future.done() if self._future is not None else self._event.query()
        if finished:
            self._finish()
        return self._done

    def wait(self) -> float:
        """Block until complete; returns the seconds spent waiting (0 when already done)."""
        if self._done:
            return 0.0
        t0 = time.perf_counter()
        if self._future is not None:
            self._future.result()
        else:
            self._event.synchronize()
        self._finish()
        return time.perf_counter() - t0

    def _finish(self) -> None:
        with self._lock:
            if self._done:
                return
            fut = self._future
            self._done = True
            watched = self._watch() if self._watch is not None else None
            if watched is not None:
                self.modified = watched._version != self._version
            self._keep = self._watch = None  # Note [source lifetime]
        if fut is not None:
            fut.result()  # re-raise a failed copy


class CpuBackend:
    """Copies on a worker thread, so pack returns before the bytes have moved, exactly as on a
    GPU; the Rust copy releases the GIL, so forward runs on while it copies."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="spillover-copy"
        )

    def to_host(self, src: torch.Tensor, block: Any, watch: Optional[torch.Tensor] = None) -> Copy:
        fut = self._pool.submit(block.copy_from, src.data_ptr(), src.numel(), 0)
        c = Copy(future=fut, keep=(src, block), watch=watch)
        # Note [source lifetime]: the source goes as soon as the worker is done with it, not
        # when someone next polls the copy (the last tensors of a forward would otherwise stay
        # alive beside their copies until backward unpacks them). Weakly: a strong reference
        # would close a cycle future -> callback -> copy -> future.
        ref = weakref.ref(c)

        def finished(f: concurrent.futures.Future) -> None:
            copy = ref()
            if copy is not None and not f.cancelled() and f.exception() is None:
                copy._finish()  # a failure is raised by wait()

        fut.add_done_callback(finished)
        return c

    def to_device(
        self, block: Any, device: torch.device, after: Optional[Copy], wait: bool = True
    ) -> tuple:
        # CPU "device": the block itself is the storage (no copy), once the pack copy is done.
        if after is not None:
            after.wait()
        return block_tensor(block), None

    def reap(self) -> None:
        pass

    def synchronize(self) -> None:
        self._pool.submit(lambda: None).result()


class CudaBackend:
    """Side-stream copies ordered by events (Note [stream ordering])."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._pending: Deque[Copy] = collections.deque()
        self._lock = threading.Lock()

    def to_host(self, src: torch.Tensor, block: Any, watch: Optional[torch.Tensor] = None) -> Copy:
        dst = block_tensor(block)
        compute = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        c = Copy(event=event, keep=(src, dst, block), watch=watch)
        with self._lock:
            self._pending.append(c)
        return c

    def to_device(
        self, block: Any, device: torch.device, after: Optional[Copy], wait: bool = True
    ) -> tuple:
        """Start the H2D copy; returns (device uint8 tensor, event). With ``wait``, the current
        stream waits for it now; a prefetch (``wait=False``) makes the consumer wait on the
        event when it uses the tensor (Note [stream ordering])."""
        host = block_tensor(block)
        compute = torch.cuda.current_stream(self.device)
        out = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        self.h2d.wait_stream(compute)  # `out` was allocated on the compute stream
        if after is not None and after._event is not None and not after._done:
            self.h2d.wait_event(after._event)
        with torch.cuda.stream(self.h2d):
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        if wait:
            compute.wait_event(event)
        out.record_stream(self.h2d)
        c = Copy(event=event, keep=(host, block))
        with self._lock:
            self._pending.append(c)
        return out, event

    def reap(self) -> None:
        """Drop the references of copies that have finished (Note [source lifetime])."""
        with self._lock:
            while self._pending and self._pending[0].done():
                self._pending.popleft()

    def synchronize(self) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        for c in pending:
            c.wait()


_backends: Dict[Any, Any] = {}
_backends_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _backends_lock
    _backends_lock = threading.Lock()  # copy threads do not survive fork; keys carry the pid


os.register_at_fork(after_in_child=_after_fork_in_child)


def backend_for(device: torch.device) -> Any:
    """The process's backend for ``device`` (one CPU backend, one CUDA backend per device)."""
    key = (device.type, device.index if device.type == "cuda" else None, os.getpid())
    with _backends_lock:
        b = _backends.get(key)
        if b is None:
            b = CudaBackend(device) if device.type == "cuda" else CpuBackend()
            _backends[key] = b
        return b
