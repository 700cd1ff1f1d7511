"""The simulated device: the CPU pretending to be a GPU behind a link, for tests and
benchmarks on machines without one (Note [stream ordering] in policy.py)."""

from __future__ import annotations

import atexit
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
            del op  # Note [source lifetime]: an op's tensors go when it ends


_workers: Any = weakref.WeakSet()


def _stop_workers() -> None:
    for w in list(_workers):
        w.stop()


# Before threading joins its threads (as concurrent.futures does); atexit where that is absent.
getattr(threading, "_register_atexit", atexit.register)(_stop_workers)

_HOST = "host"  # the simulated compute stream: the calling thread


class SimDevice:
    """The CPU pretending to be a device behind a link of ``bandwidth_bytes_per_s``: device
    tensors are CPU tensors, a copy's bytes really move but it completes (and its event fires)
    only ``latency_s + nbytes / bandwidth`` after its stream started it. ``live_bytes()`` is a
    device-memory probe: the bytes of D2H sources and ``empty`` tensors still alive."""

    host_is_device = False
    has_callbacks = True

    def __init__(self, bandwidth_bytes_per_s: Optional[float], latency_s: float = 0.0):
        self.bandwidth = float(bandwidth_bytes_per_s) if bandwidth_bytes_per_s else None
        self.latency = float(latency_s)
        self.default_cap = default_cap_bytes(self.bandwidth)
        self._live: Dict[int, Tuple[Any, int]] = {}
        self._peak = 0
        self._probe, self._probe_lock = True, threading.Lock()

    def current_stream(self) -> Any:
        return _HOST

    def new_stream(self) -> Any:
        return _Worker()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
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
                                       "reading it ran (Note [source lifetime])")
                if d is not None:  # a device output freed meanwhile: as on CUDA, bytes go nowhere
                    d.copy_(s)
            except Exception as e:
                errors.append(e)

        stream.put(op)

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
            return _SimEvent(fired=True)
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
        self.track(t)
        return t

    def record_stream(self, storage: Any, stream: Any) -> None:
        pass  # the simulated compute stream never runs behind the host

    def track(self, t: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        if not self._probe:
            return
        st = t.untyped_storage()
        with self._probe_lock:
            old = self._live.get(st.data_ptr())
            if st.nbytes() and (old is None or old[0].expired()):
                self._live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())

    def live_bytes(self) -> int:
        with self._probe_lock:
            for k in [k for k, (w, _) in self._live.items() if w.expired()]:
                del self._live[k]
            return sum(n for _, n in self._live.values())

    def peak_live_bytes(self) -> int:
        return self._peak

    def poll(self) -> None:
        if self._probe:
            n = self.live_bytes()
            with self._probe_lock:
                self._peak = max(self._peak, n)

