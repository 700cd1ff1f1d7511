"""Device tensors the link handed out for backward, given back to the allocator in stream order.

Note [frees in stream order]
    A tensor ``to_device`` hands out is allocated on the H2D stream (its pool) and used by the
    compute stream; freed as soon as its last reference goes, the allocator could give its
    bytes to the next H2D copy while compute still reads them. Nor may the host wait to *see*
    that compute passed its last use: on a GPU the host runs ahead, and whatever it keeps until
    then piles up (a link-bound backward would keep nearly everything it brought back). So a
    handed-out storage is released in stream order. Each remembers the stream that used it (the
    current stream at ``to_device(wait=True)`` or ``use``); once nobody else references it
    (autograd let go after its node), an event is recorded on that stream -- every use was
    enqueued before -- and the storage joins the *released* list. A released storage goes:
    at once when its event has fired; or, when the released bytes pass the cap, after the H2D
    stream was made to wait on the newest event among the oldest ones (the pool's next H2D
    copies are then ordered after compute's uses), never by a host wait; or at
    ``end_of_backward``, the same way. A storage never used by compute (staged, then dropped)
    goes at once: only later work of the H2D stream can reuse it. One still referenced at
    ``end_of_backward`` (kept by autograd or the caller) goes to ``record_stream`` of its using
    stream. Where the allocation lives (the H2D stream's pool, apart from forward's) is what
    ``max_memory_reserved`` shows; the simulated device counts reserved bytes per stream pool.
    Guarded by test_link_sim.py, whose simulated compute stream lags the host.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Deque, Dict, List, Tuple

from .common import use_count

__all__ = ["NOT_USED", "StreamOrderFrees"]

#: The using stream of a handed-out storage no compute stream has used yet (staged ahead).
NOT_USED = None


class StreamOrderFrees:
    """Note [frees in stream order] for one device: storages handed out on ``copy_stream``,
    released on the streams that used them, behind ``cap_bytes`` of released bytes."""

    def __init__(self, dev: Any, copy_stream: Any, cap_bytes: int):
        self.dev, self.copy_stream, self.cap_bytes = dev, copy_stream, cap_bytes
        self._lock = threading.Lock()
        self._handed: List[list] = []  # [storage, using stream or NOT_USED], still referenced
        self._released: Deque[Tuple[Any, Any, int, int]] = collections.deque()  # +event, bytes
        self._released_bytes = 0
        #: storages that went after the copy stream was made to wait (the cap was passed)
        self.released_by_wait = 0

    @property
    def held(self) -> int:
        """Handed-out storages still kept (referenced elsewhere, or released and waiting)."""
        with self._lock:
            return len(self._handed) + len(self._released)

    def hand_out(self, storage: Any, stream: Any) -> None:
        """``storage`` was made on the copy stream for ``stream`` (NOT_USED: staged ahead)."""
        with self._lock:
            self._handed.append([storage, stream])

    def used_on(self, storage: Any, stream: Any) -> None:
        """A staged storage's user is ``stream`` from now on."""
        with self._lock:
            for h in self._handed:
                if h[0]._cdata == storage._cdata:
                    h[1] = stream
                    return

    def collect(self) -> None:
        """Storages nobody else references are released on the stream that used them; those
        compute has passed go, and past the cap the copy stream waits for the oldest before
        they go. Never a host wait."""
        dev = self.dev
        with self._lock:
            if not self._handed and not self._released:
                return
            free, kept = [], []
            for h in self._handed:  # one use count each: the scan is per H2D copy
                (free if use_count(h[0]) <= 1 else kept).append(h)
            if free:
                self._handed = kept
        events: Dict[int, Any] = {}
        for storage, stream in free:
            if stream is NOT_USED:
                continue  # only the copy stream ever used it: its own later work comes after
            ev = events.get(id(stream))
            if ev is None:
                ev = events[id(stream)] = dev.record(stream)
            n = storage.nbytes()
            with self._lock:
                self._released.append((storage, ev, n, id(stream)))
                self._released_bytes += n
        free.clear()
        victims: List[Any] = []
        wait_on: Dict[int, Any] = {}  # per using stream, the newest event to wait for
        with self._lock:
            while self._released and dev.query(self._released[0][1]):
                victims.append(self._released.popleft())
                self._released_bytes -= victims[-1][2]
            while self._released and self._released_bytes > self.cap_bytes:
                v = self._released.popleft()
                self._released_bytes -= v[2]
                victims.append(v)
                wait_on[v[3]] = v[1]  # a stream's events fire in order: the newest covers all
                self.released_by_wait += 1
        for ev in wait_on.values():
            dev.wait(self.copy_stream, ev)
        victims.clear()  # the storages go now

    def release_all(self) -> None:
        """End of backward: every released storage goes after the copy stream waits for its
        event; one still referenced goes to ``record_stream`` of its using stream."""
        with self._lock:
            released, self._released = list(self._released), collections.deque()
            self._released_bytes = 0
            rest, self._handed = self._handed, []
        newest = {skey: ev for _, ev, _, skey in released}
        for ev in newest.values():
            self.dev.wait(self.copy_stream, ev)
        for storage, stream in rest:
            if stream is not NOT_USED:
                self.dev.record_stream(storage, stream)
        del rest, released, newest
