"""The simulated device: the CPU pretending to be a GPU behind a link, for tests and
benchmarks on machines without one (the optimizer's staged copies: its streams and events from
Python; the activation link's simulator is rust/link/sim/)."""

from __future__ import annotations

import atexit
import heapq
import queue
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .common import default_cap_bytes

__all__ = ["SimDevice"]


class _SimEvent:
    __slots__ = ("fired", "error", "_lock", "_callbacks")

    def __init__(self, fired: bool = False):
        self.fired = threading.Event()
        self.error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._callbacks: List[Callable[[], None]] = []
        if fired:
            self.fired.set()

    def fire(self, error: Optional[BaseException]) -> None:
        with self._lock:
            self.error = error
            self.fired.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def then(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self.fired.is_set():
                self._callbacks.append(fn)
                return
        fn()


class _Worker:
    """A simulated stream: a thread running its queue in order (started on first use, ended
    when the stream is collected, joined at exit: a daemon thread stopped inside ``copy_`` at
    interpreter shutdown aborts the process). A failed op's error goes to the next event."""

    def __init__(self) -> None:
        self.queue: Any = queue.SimpleQueue()
        self.errors: List[BaseException] = []
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def put(self, op: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=_Worker._run, args=(self.queue,),
                                                name="spillover-copy", daemon=True)
                self._thread.start()
                _workers.add(self)
        self.queue.put(op)

    def stop(self) -> None:
        self.queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __del__(self) -> None:
        self.queue.put(None)

    @staticmethod
    def _run(q: Any) -> None:
        while True:
            op = q.get()
            if op is None:
                return
            op()
            del op  # an op's tensors go when it ends


_workers: Any = weakref.WeakSet()


def _stop_workers() -> None:
    for w in list(_workers):
        w.stop()


# Before threading joins its threads (as concurrent.futures does); atexit where that is absent.
getattr(threading, "_register_atexit", atexit.register)(_stop_workers)

_HOST = "host"  # the simulated compute stream: the calling thread, ``compute_lag_s`` behind


class _Clock:
    """Fires events at given times, on one thread per simulated device (started on first use):
    the compute stream's events of a device whose compute runs behind the host."""

    def __init__(self) -> None:
        self._heap: List[Tuple[float, int, Callable[[], None]]] = []
        self._cv = threading.Condition()
        self._n = 0
        self._thread: Optional[threading.Thread] = None

    def at(self, due: float, fn: Callable[[], None]) -> None:
        with self._cv:
            self._n += 1
            heapq.heappush(self._heap, (due, self._n, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="spillover-sim-clock",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(None if not self._heap
                                  else max(0.0, self._heap[0][0] - time.monotonic()))
                _, _, fn = heapq.heappop(self._heap)
            fn()


class SimDevice:
    """The CPU pretending to be a device behind a link of ``bandwidth_bytes_per_s``: device
    tensors are CPU tensors, a copy's bytes really move but it completes (and its event fires)
    only ``latency_s + nbytes / bandwidth`` after its stream started it; one to the device from
    pageable host memory (not a spillover pool, not :meth:`pinned_empty`) holds the host until
    it ran, as CUDA's driver may.

    The compute stream (the calling thread) runs ``compute_lag_s`` behind the host, as a GPU's
    does when the host enqueues work faster than it runs: an event recorded on it fires that
    long after it was recorded, and a storage given to ``record_stream`` is kept that long. A
    host that waits to *see* a compute event therefore waits the lag, and what it keeps until
    then piles up, as it would on a GPU.

    Device memory is probed as a caching allocator keeps it: ``live_bytes()`` are the bytes of
    D2H sources and ``empty`` tensors still alive (``max_memory_allocated``'s view), and each
    allocation belongs to the pool of the stream it was made on; a stream's freed bytes serve
    only that stream, so ``peak_reserved_bytes()`` is the sum over streams of each pool's peak
    (``max_memory_reserved``'s view, the memory a process really takes)."""

    host_is_device = False
    has_callbacks = True

    def __init__(self, bandwidth_bytes_per_s: Optional[float], latency_s: float = 0.0,
                 compute_lag_s: float = 0.0):
        self.bandwidth = float(bandwidth_bytes_per_s) if bandwidth_bytes_per_s else None
        self.latency = float(latency_s)
        self.compute_lag = float(compute_lag_s)
        self.default_cap = default_cap_bytes(self.bandwidth)
        self._live: Dict[int, Tuple[Any, int, Any]] = {}  # address -> (weak ref, bytes, pool)
        self._peak = 0
        self._pool_peaks: Dict[Any, int] = {}
        self._deferred: Dict[int, Any] = {}  # record_stream: storages kept for the lag
        self._pinned: Dict[int, Any] = {}  # address -> weak ref: pinned_empty's tensors
        self._clock = _Clock()
        self._probe, self._probe_lock = True, threading.Lock()

    def current_stream(self) -> Any:
        return _HOST

    def new_stream(self) -> Any:
        return _Worker()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        """``dst.copy_(src)`` on ``stream``: done ``latency + bytes / bandwidth`` after the
        stream starts it. From pageable host memory to the device, the host waits for it, as
        CUDA's driver, staging pageable bytes, may."""
        n = src.numel() * src.element_size()
        seconds = self.latency + (n / self.bandwidth if self.bandwidth else 0.0)
        errors, get_dst, get_src = stream.errors, self._hold(dst), self._hold(src)

        def op() -> None:
            try:
                if seconds > 0:  # the source is read at the end: the late reader a GPU may be
                    time.sleep(seconds)
                d, s = get_dst(), get_src()
                if s is None:
                    raise RuntimeError("spillover: a device tensor was freed before the copy "
                                       "reading it ran")
                if d is not None:  # a device output freed meanwhile: as on CUDA, bytes go nowhere
                    d.copy_(s)
            except Exception as e:
                errors.append(e)

        stream.put(op)
        if not self.host_is_device and self._tracked(dst) and not self.is_pinned(src):
            landed = threading.Event()
            stream.put(landed.set)
            landed.wait()

    def _tracked(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is device memory (tracked by the probe)."""
        with self._probe_lock:
            entry = self._live.get(t.untyped_storage().data_ptr()) if self._probe else None
        return entry is not None and not entry[0].expired()

    def is_pinned(self, host: torch.Tensor) -> bool:
        """Whether ``host`` lies in page-locked memory: a spillover pool (registered on CUDA)
        or a tensor of :meth:`pinned_empty`."""
        from ... import _pools

        addr = host.untyped_storage().data_ptr()
        with self._probe_lock:
            ref = self._pinned.get(addr)
            if ref is not None and not ref.expired():
                return True
        return any(a <= addr < e for a, e in _pools.pool_ranges())

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A host tensor in page-locked memory (CUDA: torch's pinned caching allocator)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        t = torch.empty(nbytes, dtype=torch.uint8)
        st = t.untyped_storage()
        with self._probe_lock:
            for k in [k for k, r in self._pinned.items() if r.expired()]:
                del self._pinned[k]
            self._pinned[st.data_ptr()] = StorageWeakRef(st)
        return t

    def _hold(self, t: torch.Tensor) -> Callable[[], Optional[torch.Tensor]]:
        """How an op reaches a tensor: a device tensor weakly, as a device's queue does (its
        memory may be freed under it: a stream-ordered allocator reuses it only for later work
        of that stream), so the probe sees frees as CUDA would and a source freed too early is
        an error, not a hidden one; a host tensor strongly."""
        from torch.multiprocessing.reductions import StorageWeakRef

        st = t.untyped_storage()
        with self._probe_lock:
            entry = self._live.get(st.data_ptr()) if self._probe else None
        if entry is None or entry[0].expired():
            return lambda: t
        ref, offset, numel = StorageWeakRef(st), t.storage_offset(), t.numel()

        def get() -> Optional[torch.Tensor]:
            alive = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            return None if alive is None else torch.empty(0, dtype=torch.uint8).set_(
                alive, offset, (numel,))

        return get

    def record(self, stream: Any) -> Any:
        if stream is _HOST:
            if self.compute_lag <= 0:
                return _SimEvent(fired=True)
            ev = _SimEvent()
            self._clock.at(time.monotonic() + self.compute_lag, lambda: ev.fire(None))
            return ev
        ev, errors = _SimEvent(), stream.errors
        stream.put(lambda: ev.fire(errors.pop(0) if errors else None))
        return ev

    def query(self, ev: Any) -> bool:
        if not ev.fired.is_set():
            return False
        if ev.error is not None:
            raise ev.error
        return True

    def synchronize(self, ev: Any) -> None:
        ev.fired.wait()
        self.query(ev)

    def wait(self, stream: Any, ev: Any) -> None:
        if ev.fired.is_set():
            return
        if stream is _HOST:
            ev.fired.wait()
        else:
            stream.put(ev.fired.wait)

    def order_after(self, stream: Any, other: Any) -> None:
        """After the compute stream, nothing to wait for: it runs what the host enqueues as it
        is enqueued (its lag is when the host *sees* its events), so what it queued has run
        (Note [backward's tensors in the compute pool] in device.py). After a side stream: its
        work queued so far."""
        if other is not _HOST:
            self.wait(stream, self.record(other))

    def timed_wait(self, stream: Any, ev: Any) -> Any:
        t0 = time.perf_counter()
        self.wait(stream, ev)
        return time.perf_counter() - t0 if stream is _HOST else 0.0

    def elapsed(self, token: Any) -> Optional[float]:
        return token

    def then(self, ev: Any, fn: Callable[[], None]) -> None:
        ev.then(fn)

    def empty(self, nbytes: int, stream: Any) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.track(t, stream)
        return t

    def record_stream(self, storage: Any, stream: Any) -> None:
        """As CUDA's allocator: the storage is not reused until ``stream`` passes this point,
        which for the lagging compute stream is ``compute_lag_s`` from now."""
        if stream is not _HOST or self.compute_lag <= 0:
            return
        key = id(storage)
        with self._probe_lock:
            self._deferred[key] = storage

        def free() -> None:
            with self._probe_lock:
                self._deferred.pop(key, None)

        self._clock.at(time.monotonic() + self.compute_lag, free)

    def track(self, t: torch.Tensor, stream: Any = _HOST) -> None:
        """Count ``t``'s storage as device memory of ``stream``'s pool while it lives."""
        if not self._probe:
            return
        from torch.multiprocessing.reductions import StorageWeakRef

        st = t.untyped_storage()
        with self._probe_lock:
            old = self._live.get(st.data_ptr())
            if st.nbytes() and (old is None or old[0].expired()):
                pool = "compute" if stream is _HOST else id(stream)
                self._live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes(), pool)

    def _live_by_pool(self) -> Dict[Any, int]:
        """Under the probe lock: live bytes per pool (dead entries dropped)."""
        for k in [k for k, (w, _, _) in self._live.items() if w.expired()]:
            del self._live[k]
        out: Dict[Any, int] = {}
        for _, n, pool in self._live.values():
            out[pool] = out.get(pool, 0) + n
        return out

    def live_bytes(self) -> int:
        with self._probe_lock:
            return sum(self._live_by_pool().values())

    def peak_live_bytes(self) -> int:
        return self._peak

    def reset_peaks(self) -> None:
        """Peaks from now on (``torch.cuda.reset_peak_memory_stats``)."""
        with self._probe_lock:
            by_pool = self._live_by_pool()
            self._peak = sum(by_pool.values())
            self._pool_peaks = dict(by_pool)

    def peak_reserved_bytes(self) -> int:
        """The sum over streams of each pool's peak (what a caching allocator reserves)."""
        return sum(self._pool_peaks.values())

    def poll(self) -> None:
        if self._probe:
            with self._probe_lock:
                by_pool = self._live_by_pool()
                self._peak = max(self._peak, sum(by_pool.values()))
                for pool, n in by_pool.items():
                    self._pool_peaks[pool] = max(self._pool_peaks.get(pool, 0), n)

