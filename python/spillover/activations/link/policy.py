"""Device <-> host copies: one policy, :class:`Transfers`, over a small primitive interface
(streams; ``copy`` on a stream; ``record`` / ``query`` / ``synchronize`` / ``wait`` an event;
``empty`` on a stream; timed waits) with three implementations: :class:`CudaDevice`;
:class:`SimDevice`, a simulated device for CPU tests whose copies finish only after
bytes / bandwidth; and :class:`CpuDevice`, plain CPU tensors (the "device" is the host).

Note [stream ordering]
    A D2H copy runs on the copy stream after the compute stream's current point (an event
    recorded on compute and waited for by the copy stream, never a host sync). An H2D copy
    allocates its output on the H2D stream, which first waits for the D2H event that filled the
    block (``after``); the compute stream waits for the H2D event before using the tensor (at
    once, or at ``use()`` for a tensor staged ahead). On the simulated device the compute stream
    is the calling thread and every other stream a worker thread: a wait on the compute stream
    blocks the caller. Nothing here calls torch.cuda.synchronize().

Note [source lifetime]
    A copy reads its source after ``to_host`` has returned, so the policy holds the source until
    either the copy is observed complete, or the compute stream the source was produced on (the
    one current at ``to_host``) has been made to wait on the copy's event (Note [back-pressure]).
    The second is safe without a host wait: the source was allocated on that stream, and the
    caching allocator hands a freed block only to later work of the same stream, which is now
    ordered after the copy. Never ``record_stream`` on the source: the allocator would then keep
    the bytes until it notices the copy stream passed, invisible to any cap. (A tensor produced
    on another stream breaks this, as it breaks the copy's own ordering.) The destination is
    held until the copy is observed complete.

Note [back-pressure]
    Forward produces activations faster than the link drains them. Unbounded, every source
    would stay alive until backward and offloading would save nothing. So the bytes of copies
    whose source the policy still holds are capped (``cap_bytes``; the newest copy may pass it
    alone): past the cap the compute stream waits on the oldest copies' events (one wait, on the
    newest of them, as a copy stream runs in order) and their sources are dropped. The ledger
    in the tier picks them (Note [the ledger lives in the tier]). Sources are
    also all released at every unpack and at the end of backward (``release_sources``), so
    nothing offloaded stays on the device after backward. The default cap is 20 ms of link
    bandwidth, clamped to [64 MiB, 2 GiB]: enough to keep the link busy, small beside device
    memory. What the cap costs shows as ``stall_seconds`` and ``forced_waits``.

Note [in-place after pack]
    Under saved_tensors_hooks autograd no longer checks that a saved tensor was not modified in
    place before backward, and an asynchronous copy could read a half-modified tensor. So the
    saved tensor is watched: its version counter is compared when the copy is observed complete
    (``Copy.modified``), and again at unpack while it is alive; either mismatch raises the error
    autograd itself would raise. The watch is a weak reference: a strong one would close a cycle
    through the autograd graph (tensor -> grad_fn -> saved handle -> copy -> tensor) that gc
    cannot see. Guarded by test_context.py::test_inplace_after_save_is_an_error.

Note [the ledger lives in the tier]
    The accounting of device->host copies and the choice of victims are the Rust tier's
    (``spillover._native.Inflight``, rust/tier/inflight.rs, Note [the ledger of copies in
    flight] there, property-tested in tests/inflight.rs): which copies are in flight (issue
    order; polled from the oldest), whose sources are held, the bytes of each, their peaks, the
    oldest held sources to drop past the cap (never the newest copy), each copy landing once,
    and the counters (``copies``, ``forced_waits``, ``sources_released``). This class keeps
    only the torch objects -- events, streams, source and destination tensors -- in a table
    keyed by the ledger's ids, and does what the ledger decided: the waits and the drops. Every
    ledger call is made under ``_lock``, so a copy's ``_src`` is set exactly while the ledger
    holds its source. A copy leaves the table once its ``on_landed`` has returned (not when the
    ledger saw it land), so ``synchronize()`` also waits for callbacks still running on another
    thread.

The host -> device side (``to_device``, ``use``) is :class:`~.h2d.ToDevice`, a base of
:class:`Transfers`; what it hands out is made in the pool of the stream that uses it, and goes
back to it in stream order (Note [backward's tensors in the compute pool] in frees.py).

"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from ..._native import Inflight
from .frees import StagedAhead
from .h2d import ToDevice

__all__ = ["Copy", "Transfers"]


class Copy:
    """A device->host copy. ``done()`` never blocks; ``wait()`` returns the seconds it blocked
    and re-raises what the copy or its ``on_landed`` raised. Both see ``on_landed`` finished."""

    __slots__ = ("nbytes", "modified", "_tr", "_id", "_event", "_stream", "_src", "_dst",
                 "_watch", "_version", "_on_landed", "_finished", "_landed", "_error", "_sink",
                 "__weakref__")

    def __init__(self, tr: Transfers, event: Any, stream: Any, src: torch.Tensor,
                 dst: torch.Tensor, watch: Optional[torch.Tensor],
                 on_landed: Optional[Callable[[], Any]]):
        self.nbytes = src.numel()
        #: True when the watched tensor was modified in place before the copy was observed
        #: complete (Note [in-place after pack]).
        self.modified = False
        self._tr, self._event, self._stream = tr, event, stream
        self._id = -1  # its id in the policy's ledger (Note [the ledger lives in the tier])
        # Note [source lifetime]; not None exactly while the ledger holds the source
        self._src: Optional[torch.Tensor] = src
        self._dst: Optional[torch.Tensor] = dst
        self._watch = weakref.ref(watch) if watch is not None else None
        self._version = watch._version if watch is not None else 0
        self._on_landed = on_landed
        self._finished = False  # observed complete: the ledger said it landed (policy's lock)
        self._landed = threading.Event()  # ... and on_landed has returned
        self._error: Optional[BaseException] = None
        # where an error nobody waited for goes (Note [errors go to their owner])
        self._sink: Optional[List[BaseException]] = None

    @property
    def event(self) -> Any:
        """The copy stream's event recorded after this copy."""
        return self._event

    def source(self) -> Optional[torch.Tensor]:
        """The device source while the policy still holds it, else None."""
        return self._src

    def done(self) -> bool:
        if not self._finished:
            self._tr._try_observe(self)
        return self._landed.is_set()

    def wait(self) -> float:
        """Block until complete; the seconds spent waiting (0 when already done)."""
        dt = 0.0
        if not self._landed.is_set():
            t0 = time.perf_counter()
            self._sync()
            dt = time.perf_counter() - t0
        if self._error is not None:
            self._tr._forget(self._error, self._sink)
            raise self._error
        return dt

    def _sync(self) -> None:
        if not self._finished:
            try:
                self._tr.dev.synchronize(self._event)
                self._tr._observe(self)
            except Exception as e:
                self._tr._observe(self, e)
        self._landed.wait()


class Transfers(ToDevice):
    """The copy policy of one device (Notes [back-pressure], [source lifetime], [the ledger
    lives in the tier], [backward's tensors in the compute pool]). Thread-safe; made by
    :func:`transfers_for`."""

    def __init__(self, dev: Any, cap_bytes: Optional[int] = None):
        self.dev = dev
        self.host_is_device: bool = dev.host_is_device
        cap = int(cap_bytes) if cap_bytes is not None else dev.default_cap
        self._d2h = dev.new_stream()
        self._h2d = None if dev.host_is_device else dev.new_stream()
        self._lock = threading.Lock()
        #: Note [the ledger lives in the tier]: what is in flight and held, and the victims
        self._ledger = Inflight(cap)
        #: the ledger's ids -> their copies, issue order, until on_landed has returned
        self._copies: Dict[int, Copy] = {}
        self._h2d_fifo: Deque[Tuple[Any, torch.Tensor]] = collections.deque()
        #: Note [backward's tensors in the compute pool] in frees.py (None on a plain CPU host)
        self.staged = None if self._h2d is None else StagedAhead(dev)
        self._timings: Deque[Any] = collections.deque()
        self._errors: List[BaseException] = []
        self._stall = 0.0
        self._pageable = 0  # Note [pageable sources] in h2d.py

    # The counters are the ledger's (Note [the ledger lives in the tier]).

    @property
    def cap_bytes(self) -> int:
        """The cap on the bytes of sources held (Note [back-pressure])."""
        return self._ledger.cap_bytes

    @property
    def bytes_in_flight(self) -> int:
        """Bytes of copies not yet observed complete."""
        return self._ledger.bytes_in_flight

    @property
    def peak_bytes_in_flight(self) -> int:
        return self._ledger.peak_bytes_in_flight

    @property
    def bytes_held(self) -> int:
        """Bytes of the sources the policy holds."""
        return self._ledger.bytes_held

    @property
    def peak_bytes_held(self) -> int:
        return self._ledger.peak_bytes_held

    @property
    def copies(self) -> int:
        """Device->host copies started."""
        return self._ledger.copies

    @property
    def forced_waits(self) -> int:
        """Copies that passed the cap and made the compute stream wait."""
        return self._ledger.forced_waits

    @property
    def sources_released(self) -> int:
        """Sources dropped before their copy was seen complete (past the cap, at unpack)."""
        return self._ledger.sources_released

    @property
    def stall_seconds(self) -> float:
        """Time the compute stream waited on copies (CUDA: timed by events, counted once they
        have fired). Copy.wait() and synchronize() are host waits the caller accounts for."""
        with self._lock:
            while self._timings:
                s = self.dev.elapsed(self._timings[0])
                if s is None:
                    break
                self._timings.popleft()
                self._stall += s
            return self._stall

    # -- device -> host --

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, *, watch: Optional[torch.Tensor] = None,
                on_landed: Optional[Callable[[], Any]] = None,
                errors: Optional[List[BaseException]] = None) -> Copy:
        """Start copying ``src`` (1-D uint8 on the device) into ``dst`` (1-D uint8 on the CPU,
        same length). ``on_landed`` runs once when the copy is observed complete (on any
        thread); what it raises comes out of ``wait()``, else out of the next ``reap(errors)``
        given the same ``errors`` list (Note [errors go to their owner]), or of any ``reap()``
        when ``errors`` is None."""
        if (src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.dim() != 1
                or dst.dim() != 1 or dst.numel() != src.numel() or dst.device.type != "cpu"):
            raise ValueError("to_host: src and dst must be 1-D uint8 of one length, dst on cpu")
        dev = self.dev
        compute = dev.current_stream()
        dev.wait(self._d2h, dev.record(compute))  # Note [stream ordering]
        dev.track(src)
        dev.copy(dst, src, self._d2h)
        c = Copy(self, dev.record(self._d2h), compute, src, dst, watch, on_landed)
        c._sink = errors
        with self._lock:
            # Note [back-pressure]: the ledger picks the oldest held sources, the newest spared
            c._id, ids = self._ledger.issue(c.nbytes)
            self._copies[c._id] = c
            victims = self._take_sources(ids)
        if dev.has_callbacks:
            dev.then(c._event, lambda: self._try_observe(c))
        self._release(victims)
        dev.poll()
        return c

    def release_sources(self) -> None:
        """Make the compute stream wait on every copy whose source is held; drop the sources."""
        with self._lock:
            victims = self._take_sources(self._ledger.release_all())
        self._release(victims)

    def _take_sources(self, ids: List[int]) -> List[Tuple[Copy, torch.Tensor]]:
        """The copies (and their sources) the ledger has just released; under the lock."""
        victims = []
        for i in ids:
            v = self._copies[i]  # held, so not landed, so still here
            src, v._src = v._src, None
            if src is not None:  # always: set exactly while the ledger holds it
                victims.append((v, src))
        return victims

    def _release(self, victims: List[Tuple[Copy, torch.Tensor]]) -> None:
        if not victims:
            return
        newest: Dict[Any, Copy] = {}  # per compute stream: its copies finish in issue order
        for v, _ in victims:
            newest[v._stream] = v
        for v in newest.values():
            self._wait_compute(v._stream, v._event)
        victims.clear()  # the sources go now (Note [source lifetime])

    def _wait_compute(self, stream: Any, ev: Any) -> None:
        try:
            if self.dev.query(ev):
                return
        except Exception:
            return  # a failed copy is raised where it is observed
        token = self.dev.timed_wait(stream, ev)
        with self._lock:
            if isinstance(token, float):
                self._stall += token
            else:
                self._timings.append(token)

    def _try_observe(self, c: Copy) -> None:
        try:
            if self.dev.query(c._event):
                self._observe(c)
        except Exception as e:
            self._observe(c, e)

    def _observe(self, c: Copy, error: Optional[BaseException] = None) -> None:
        """The copy is complete: drop what it held and run on_landed, exactly once."""
        with self._lock:
            if c._finished or not self._ledger.landed(c._id):
                return
            c._finished = True
            c._src = None  # the ledger released it with the landing
            c._dst = None
            watched = c._watch() if c._watch is not None else None
            if watched is not None:  # Note [in-place after pack]
                c.modified = watched._version != c._version
            c._watch = None
            landed, c._on_landed = c._on_landed, None
            sink = c._sink if c._sink is not None else self._errors
            if error is not None:
                c._error, landed = error, None
                sink.append(error)
        try:
            if landed is not None:
                landed()
        except Exception as e:
            with self._lock:
                c._error = e
                sink.append(e)
        finally:
            with self._lock:  # out of synchronize()'s sight only once on_landed has returned
                del self._copies[c._id]
            c._landed.set()

    def _forget(self, error: BaseException,
                sink: Optional[List[BaseException]] = None) -> None:
        with self._lock:
            for errs in (self._errors, sink) if sink is not None else (self._errors,):
                errs[:] = [e for e in errs if e is not error]

    def _poll(self) -> None:
        while True:  # the oldest copy not landed: a copy stream finishes in issue order
            with self._lock:
                i = self._ledger.front()
                c = self._copies[i] if i is not None else None
            if c is None:
                break
            self._try_observe(c)
            if not c._finished:
                break
        query = self.dev.query
        with self._lock:
            while self._h2d_fifo and query(self._h2d_fifo[0][0]):
                self._h2d_fifo.popleft()
        if self.staged is not None:
            self.staged.collect()
        self.dev.poll()

    def reap(self, errors: Optional[List[BaseException]] = None) -> None:
        """Drop what copies seen complete held; cheap when none is. Raises the first error,
        nobody has seen yet, of a copy (or its on_landed) started without an ``errors`` list or
        with this one.

        Note [errors go to their owner]
            One Transfers serves every context of the process. An error of a copy whose step
            was abandoned (its forward raised: a full disk, a failed write) must not come out
            of another context's next pack: each step hands its own list to ``to_host`` and
            reaps only that one; an abandoned step's list goes with it."""
        self._poll()
        with self._lock:
            error = self._errors.pop(0) if self._errors else None
            if error is None and errors:
                error = errors.pop(0)
        if error is not None:
            raise error

    def synchronize(self, errors: Optional[List[BaseException]] = None) -> None:
        """Wait for every copy in flight (tests, measurements, a full pool); raises as reap()."""
        with self._lock:  # issue order, with those whose on_landed is still running
            pending, h2d = list(self._copies.values()), [ev for ev, _ in self._h2d_fifo]
        for c in pending:
            c._sync()
        for ev in h2d:
            self.dev.synchronize(ev)
        self.reap(errors)

    def end_of_backward(self) -> None:
        """Release every source, let go of the tensors staged ahead and never used, after their
        streams wait for their copies (Note [backward's tensors in the compute pool]), reap."""
        self.release_sources()
        self._poll()
        if self.staged is not None:
            self.staged.release_all()
        self.reap()
