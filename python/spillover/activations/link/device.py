"""The link of a device with one (CUDA, or the simulated device for CPU tensors): the Python side
of ``spillover._native.Link`` (rust/link). The Rust link issues every copy, owns the events and
keeps the ledger of copies in flight; this side holds what only Python can -- the device
sources the ledger says to keep (Note [sources held] in rust/link), the tensors handed to
backward, and the errors each step owns -- and makes one call into Rust per pack and per unpack.

Note [backward's tensors in the compute pool]
    A tensor brought back for backward is made on the stream that uses it (the current stream:
    the one autograd runs the node on), from that stream's allocator pool, so that when autograd
    lets go of it the allocator gives its block back to that stream's later work only: freed in
    stream order by the allocator's own rule, however far the host runs ahead, and backward
    shares the pool forward's activations left. A copy into it that the stream needs now runs on
    that stream (Note [stream ordering] in rust/link: urgent); one staged ahead runs on the H2D
    stream after the stream's queued work (the block may be one queued work still uses), and the
    stream waits for it at the unpack. Two cases need us:
    - a tensor staged ahead and let go unused: the stream that made it waits for its copy before
      we drop it (``_collect``, at each staging; ``end_of_backward`` for the rest);
    - a tensor used on another stream than it was made on: ``record_stream`` of that stream.

Note [the newest sources stay]
    Backward unpacks first what forward saved last, and those are the copies most likely still
    holding their source (Note [source returned]). A copy that lands keeps its source while the
    sources kept this way and those the ledger holds fit the cap together, newest first; the
    oldest go as new copies come, every one at the end of backward. So the last cap bytes of
    a forward come back to backward without crossing the link twice, where dropping each
    source as its copy landed sent it over and back (the review's G6). A returned source used
    on another stream than the one it was made on is ``record_stream``-ed there.

Note [returned sources go with their use]
    A source handed to backward (Note [source returned]) stays for the other views of its
    storage, which its stored entry holds as long as autograd holds one of them; at the end of
    backward every one still held goes. The link once held each returned copy strongly until
    then, and with it the source: under full recomputation every region's input and the
    model's tail, unpacked early in backward, were still there at its end -- on the simulated
    H200 (GPT 4x256, seq 512, a 25 MiB cap) the step peaked at 72.6 MiB against torch's full
    checkpointing's 58.5 (Note [the simulated device is a device] in planner/records.py). The
    link now holds them weakly.

Note [polls]
    Each poll asks the device which copies landed (2 + log2(k) queries at most for k events:
    Note [polls in order] in rust/link). Pack and unpack poll at most every 1 ms, and only
    once ``POLL_BYTES`` (64 MiB, at most a quarter of the cap of Note [back-pressure]) were
    packed or unpacked since the last poll, or the pack would pass the cap (its victims, which
    the compute stream is made to wait for, may have landed unseen): what lands between two
    polls waits for the next
    one -- its source kept a little longer (at most the cap: past it the ledger's victims go
    without a poll), its entry sealed a little later (an unpack before the seal orders its copy
    back after the event instead), its error raised a few packs later -- which costs nothing a
    step can see, where a poll per pack doubled the device calls of a pack of small tensors.
    At 100 us a pack of 1 MiB still polled at each pack on the simulated device (3.07 calls a
    pack; 1.88 at 1 ms), and one of 4 KiB made 1.60 calls (1.44). The bytes count because the
    CPU's ops are slow: a pack of 8 MiB takes milliseconds here (tens of microseconds on the
    H200), so 1 ms alone let each pack poll, 3.5-4.2 calls a pack from one run to the next;
    issue 40, item 5. At 32 MiB every pack and unpack of 32 MiB or more polled; at 64 MiB
    every other one does (a pack of 32 MiB still takes 3.02-3.08 calls: two copies a group,
    2.5, and half a query; on the H200, where such a pack comes every ~100 us, the 1 ms gate
    binds). An unpack's poll also tells which staged copies ran (Note [staged copies seen
    landed] in rust/link): an unpack of 16 MiB takes 3.38 calls at 64 MiB, 3.71 at 32.
    ``synchronize``, ``wait``, ``done()`` and the end of forward poll at
    the time gate alone, or at once.

Note [errors go to their owner]
    One link serves every context of the process. An error of a copy whose step was abandoned
    (its forward raised: a full disk, a failed write) must not come out of another context's
    next pack: each step hands its own list to ``pack`` and reaps only that one; an abandoned
    step's list goes with it. Errors of copies started without a list go to whoever reaps next.

Note [in-place after pack]
    Under saved_tensors_hooks autograd no longer checks that a saved tensor was not modified in
    place before backward, and an asynchronous copy could read a half-modified tensor. So the
    saved tensor is watched: its version counter is compared when the copy is seen complete
    (``LinkCopy.modified``), and again at unpack while it is alive; either mismatch raises the
    error autograd itself would raise. A region that writes a storage it saved marks the copies
    modified itself (``_written_after_pack`` in recompute/modes.py: the tensor it watched may be
    gone by then). A modified copy's verify mismatch is that write, not a fault of the link, and
    is not raised: nothing reads those bytes without raising the in-place error first. The
    watch is a weak reference: a strong one would close a cycle through the autograd graph
    (tensor -> grad_fn -> saved handle -> copy -> tensor) that gc cannot see.

Note [pieces come back piece by piece]
    A storage offloaded in pieces (larger than half an NVMe pool, or than one host arena) comes
    back as one device tensor whose slices are filled from each piece's pool block, staged like a
    whole entry: no gather on the host, no page-locked buffer outside the pool.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ... import _native
from ...errors import IntegrityError
from ..verify import device_checksum
from .common import default_cap_bytes, use_count

__all__ = ["DeviceLink", "LinkCopy"]

#: Note [polls]: the least time between two polls of the copies in flight from pack and unpack
#: ...
POLL_SECONDS = 1e-3
#: ... and, between two polls from packs and unpacks, the bytes they moved (at most a quarter
#: of the cap).
POLL_BYTES = 64 << 20


class LinkCopy:
    """A device->host copy of the link: its source while the ledger holds it, whether it was
    seen complete, what it raised. ``done()`` never blocks; ``wait()`` returns the seconds it
    blocked and raises what the copy or its seal raised."""

    __slots__ = ("id", "nbytes", "modified", "stream", "packed_sum", "what", "_link", "_src",
                 "_watch", "_version", "_sink", "_landed", "_error", "_given", "__weakref__")

    def __init__(self, link: DeviceLink, cid: int, nbytes: int, src: Any, stream: int,
                 watch: Optional[torch.Tensor], sink: Optional[List[BaseException]]):
        self.id = cid
        self.stream = stream  # the stream current at pack: the source's
        self.nbytes = nbytes
        #: the watched tensor was modified in place before the copy was seen complete
        #: (Note [in-place after pack])
        self.modified = False
        self._link = link
        self._src = src  # the source storage, while the ledger holds it (Note [sources held])
        self._watch = weakref.ref(watch) if watch is not None else None
        self._version = watch._version if watch is not None else 0
        self._sink = sink
        self._landed = False
        self._error: Optional[BaseException] = None
        self._given = False  # its source was handed to backward (Note [source returned])
        #: verify mode: the source's checksum on the device, and what the copy is, for errors
        self.packed_sum: Optional[torch.Tensor] = None
        self.what = ""

    def source(self) -> Optional[torch.Tensor]:
        """The whole source storage, as a uint8 tensor, while it is held; else None."""
        src = self._src
        if src is None:
            return None
        return torch.empty(0, dtype=torch.uint8, device=src.device).set_(src)

    def done(self) -> bool:
        if not self._landed:
            self._link.poll()
        return self._landed

    def wait(self) -> float:
        dt = 0.0 if self._landed else self._link._wait(self)
        if self._error is not None:
            self._link._forget(self._error, self._sink)
            raise self._error
        return dt


class DeviceLink:
    """The activation link of one device (CUDA, or the simulated device): one call into Rust
    per pack and per unpack. Thread-safe. Made by :func:`~spillover.activations.link.link_for`.
    """

    host_is_device = False

    def __init__(self, device: torch.device, *, cap_bytes: Optional[int] = None,
                 sim_bandwidth: Optional[float] = None, sim_lag: float = 0.0,
                 sim_call_cost: float = 0.0, link_bandwidth: Optional[float] = None):
        self.device = device
        self.sim = device.type != "cuda"
        #: the simulated link's bandwidth (its calibration: guardrails read it); None on CUDA
        self.sim_bandwidth = float(sim_bandwidth) if self.sim and sim_bandwidth else None
        bw = self.sim_bandwidth or link_bandwidth
        cap = int(cap_bytes) if cap_bytes is not None else default_cap_bytes(bw)
        if self.sim:
            self.native = _native.Link("sim", cap_bytes=cap, bandwidth=self.sim_bandwidth,
                                       compute_lag=float(sim_lag), call_cost=float(sim_call_cost))
            self._index = 0
        else:
            self._index = device.index if device.index is not None else 0
            self.native = _native.Link("cuda", cap_bytes=cap, index=self._index)
        self._cap = cap
        self._lock = threading.Lock()
        self._copies: Dict[int, LinkCopy] = {}  # in flight, by the ledger's id
        #: landed copies that keep their source (Note [the newest sources stay]), oldest first
        self._retained: collections.OrderedDict = collections.OrderedDict()
        self._retained_bytes = 0
        #: sources handed to backward, weakly: each stays while its stored entry (the saved
        #: tensor autograd holds) does, and no longer (Note [returned sources go with their use])
        self._returned: List[weakref.ref] = []
        self._errors: List[BaseException] = []  # errors of copies no step owns
        self._staged: List[list] = []  # [storage, stream made on, event]: not used yet
        self._stall = 0.0
        self._last_poll = 0.0
        self._since_poll = 0  # bytes packed and unpacked since the last poll (Note [polls])
        self._poll_bytes = min(POLL_BYTES, cap // 4)
        self._cap = cap
        #: urgent copies back of bytes whose D2H copy was not seen landing (ordered after it
        #: on the device: Note [unpack before the seal] in rust/tier)
        self.urgent_before_landing = 0
        #: device memory on the simulated device, for tests (``probe_memory``); None: off
        self.memory: Optional[SimMemory] = None

    # -- the counters ---------------------------------------------------------------------

    @property
    def cap_bytes(self) -> int:
        return int(self.native.cap_bytes)

    @property
    def bytes_in_flight(self) -> int:
        return int(self.native.bytes_in_flight)

    @property
    def bytes_held(self) -> int:
        """Device bytes of sources kept: those the ledger holds and the newest kept after their
        copy landed (Note [the newest sources stay])."""
        return int(self.native.bytes_held) + self._retained_bytes

    @property
    def forced_waits(self) -> int:
        return int(self.native.forced_waits)

    @property
    def stall_seconds(self) -> float:
        """Host seconds spent waiting for the device (simulated: its compute stream is the host;
        CUDA: host waits only -- a wait queued on a stream costs the host nothing)."""
        return self._stall + float(self.native.host_wait_seconds)

    @property
    def calls(self) -> int:
        """Calls made to the device so far (Note [device calls] in rust/link)."""
        return int(self.native.calls)

    def counters(self) -> Dict[str, Any]:
        return dict(self.native.counters())

    # -- streams --------------------------------------------------------------------------

    def stream(self) -> int:
        """The current stream's handle (the simulated device's compute stream is 0)."""
        if self.sim:
            return 0
        return int(torch._C._cuda_getCurrentRawStream(self._index))

    # -- device -> host -------------------------------------------------------------------

    def pack(self, step: Any, storage: Any, nbytes: int, *, offset: int = 0,
             watch: Optional[torch.Tensor] = None,
             errors: Optional[List[BaseException]] = None,
             verify: str = "") -> Tuple[Any, LinkCopy]:
        """Lease ``nbytes`` from ``step`` and copy them from ``storage`` (a device storage)
        at ``offset``: one call into Rust. Returns (tier handle, copy). Raises
        PoolExhaustedError when the tier has no room now. ``verify``: what the copy is (its
        tensor's shape, dtype, step, tier), to check it (Note [verify on the device])."""
        stream = self.stream()
        checksum = None
        if verify:
            src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(
                storage, offset, (nbytes,))
            cs = device_checksum(src)
            checksum = (cs.data_ptr(), cs)
        with self._lock:  # a poll on another thread must find the copy once it can land
            handle, cid, victims = self.native.pack(step, storage.data_ptr() + offset, nbytes,
                                                    stream, storage if self.sim else None,
                                                    checksum)
            c = LinkCopy(self, cid, nbytes, storage, stream, watch, errors)
            if checksum is not None:
                c.packed_sum, c.what = checksum[1], verify
            self._copies[cid] = c
            for v in victims:  # the compute stream waits for them already
                d = self._copies.get(v)
                if d is not None:
                    d._src = None
            if self._retained:
                self._trim()
        if self.memory is not None:
            self.memory.track(storage, "compute")
        return handle, c

    def flush(self) -> None:
        """Issue the copies held back for their group (Note [grouped copies] in rust/link): at
        the end of forward, so that they drain while the host goes on."""
        self.native.flush()

    def poll(self) -> None:
        """Take in the copies seen complete: their sources go, their errors to their owners."""
        self._landed(self.native.poll())

    def _landed(self, landed: List[Tuple[int, Any]]) -> None:
        with self._lock:
            for cid, error in landed:
                c = self._copies.pop(cid, None)
                if c is None:
                    continue
                if c._given:  # backward holds it; other views of it may still come
                    pass
                elif error is None and c._src is not None:  # Note [the newest sources stay]
                    self._retained[cid] = c
                    self._retained_bytes += c.nbytes
                else:
                    c._src = None
                w = c._watch() if c._watch is not None else None
                if w is not None and w._version != c._version:  # Note [in-place after pack]
                    c.modified = True
                c._watch = None
                if c.modified and isinstance(error, IntegrityError):
                    # the source was written in place after its pack: not a fault of the link;
                    # an unpack of these bytes raises the in-place error instead
                    error = None
                if error is not None:
                    if c.what and isinstance(error, IntegrityError):
                        error = IntegrityError(f"{c.what}: {error} (check 1 of Note [verify on "
                                               "the device])")
                    c._error = error
                    (c._sink if c._sink is not None else self._errors).append(error)
                c._landed = True
            if self._retained:
                self._trim()

    def _trim(self) -> None:
        """Under the lock: the oldest kept sources go until they and the held ones fit the cap
        (Note [the newest sources stay])."""
        room = self._cap - int(self.native.bytes_held)
        while self._retained and self._retained_bytes > room:
            _, c = self._retained.popitem(last=False)
            self._retained_bytes -= c.nbytes
            c._src = None

    def returned(self, c: LinkCopy, src: torch.Tensor) -> torch.Tensor:
        """``src``, the source of ``c`` handed to backward (Note [source returned]): no longer
        ours to keep, and recorded on the using stream when it is not the source's."""
        with self._lock:
            if not c._given:
                c._given = True
                self._returned.append(weakref.ref(c))
            if self._retained.pop(c.id, None) is not None:
                self._retained_bytes -= c.nbytes
        if not self.sim and self.stream() != c.stream:
            src.record_stream(torch.cuda.current_stream(self.device))
        return src

    def _wait(self, c: LinkCopy) -> float:
        dt, landed = self.native.wait(c.id)
        self._landed(landed)
        with self._lock:
            self._stall += dt
        return dt

    def _forget(self, error: BaseException, sink: Optional[List[BaseException]]) -> None:
        with self._lock:
            for errs in (self._errors, sink) if sink is not None else (self._errors,):
                errs[:] = [e for e in errs if e is not error]

    def reap(self, errors: Optional[List[BaseException]] = None,
             nbytes: Optional[int] = None) -> None:
        """Poll (Note [polls]: at most every ``POLL_SECONDS``; from a pack or an unpack of
        ``nbytes``, once ``POLL_BYTES`` went by too, or the cap would be passed); raise the first
        error nobody has seen yet of a copy started with this ``errors`` list, or of one
        without a list (Note [errors go to their owner])."""
        if nbytes is not None:
            self._since_poll += nbytes
            # a pack past the cap makes victims of copies perhaps landed unseen: poll first
            if (self._since_poll < self._poll_bytes
                    and self.native.bytes_in_flight + nbytes <= self._cap):
                self._raise(errors)
                return
        now = time.perf_counter()
        if now - self._last_poll >= POLL_SECONDS:
            self._last_poll = now
            self._since_poll = 0
            self.poll()
        self._raise(errors)

    def _raise(self, errors: Optional[List[BaseException]]) -> None:
        if not self._errors and not errors:  # the common case, without the lock: an error
            return  # appended meanwhile is raised at the next reap
        with self._lock:
            error = self._errors.pop(0) if self._errors else None
            if error is None and errors:
                error = errors.pop(0)
        if error is not None:
            raise error

    def synchronize(self, errors: Optional[List[BaseException]] = None) -> None:
        """Wait for every copy in flight either way; raise as :meth:`reap`."""
        t0 = time.perf_counter()
        self._landed(self.native.synchronize())
        with self._lock:
            self._stall += time.perf_counter() - t0
        self._raise(errors)

    def release_sources(self) -> None:
        """Every held source goes (the compute streams wait for their copies)."""
        ids = self.native.release_all()
        with self._lock:
            for cid in ids:
                c = self._copies.get(cid)
                if c is not None:
                    c._src = None
            alive = [r() for r in self._returned]
            for c in [*self._retained.values(), *(c for c in alive if c is not None)]:
                c._src = None
            self._retained.clear()
            self._retained_bytes = 0
            self._returned.clear()

    # -- host -> device -------------------------------------------------------------------

    def share(self, t: torch.Tensor, made_on: Optional[int]) -> None:
        """``t``, brought back on stream ``made_on``, is handed out again (another view of its
        storage): used on another stream, that stream waits for ``made_on``'s work so far and
        the allocator keeps the block for it (``record_stream``)."""
        if self.sim or made_on is None:
            return
        stream = self.stream()
        if stream != made_on:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(torch.cuda.ExternalStream(made_on, device=self.device))
            t.record_stream(current)

    def _empty(self, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.memory is not None:
            self.memory.track(out.untyped_storage(), "compute")
        return out

    def bring_back(self, parts: List[Tuple[Any, Optional[LinkCopy]]]) -> torch.Tensor:
        """The bytes of ``parts`` (``(pool view, the copy that filled it)`` each, in order:
        one part, or the pieces of a storage: Note [pieces come back piece by piece]) in one
        new tensor of the current stream, copied on it now (urgent)."""
        total = sum(v.nbytes for v, _ in parts)
        out = self._empty(total)
        stream, base, off = self.stream(), out.data_ptr(), 0
        owner = out if self.sim else None
        for view, after in parts:
            aid = after.id if after is not None and not after._landed else None
            if aid is not None:  # Note [unpack before the seal] in rust/tier
                self.urgent_before_landing += 1
            self.native.to_device(base + off, view, stream, aid, owner)
            off += view.nbytes
        return out

    def stage(self, entries: List[List[Tuple[Any, Optional[LinkCopy]]]]) -> List[Any]:
        """Stage the entries ahead (each as :meth:`bring_back`'s ``parts``) on the H2D stream:
        for each, ``(tensor, events, stream)`` to pass to :meth:`use` at its unpack."""
        self._collect()
        stream = self.stream()
        items, outs = [], []
        for parts in entries:
            out = self._empty(sum(v.nbytes for v, _ in parts))
            base, off = out.data_ptr(), 0
            for view, after in parts:
                aid = after.id if after is not None and not after._landed else None
                items.append((base + off, view, aid, out if self.sim else None))
                off += view.nbytes
            outs.append((out, len(parts)))
        events = self.native.stage(stream, items)
        staged, i = [], 0
        with self._lock:
            for out, n in outs:
                evs = events[i:i + n]
                i += n
                self._staged.append([out.untyped_storage(), stream, evs])
                staged.append((out, evs, stream))
        return staged

    def use(self, staged: Any) -> torch.Tensor:
        """The tensor of a staged entry, the current stream ordered after its copies."""
        out, evs, made_on = staged
        storage = out.untyped_storage()
        with self._lock:
            for i, s in enumerate(self._staged):
                if s[0]._cdata == storage._cdata:
                    del self._staged[i]
                    break
        stream = self.stream()
        for ev in evs:
            self.native.use_staged(ev, stream)
        if stream != made_on and not self.sim:  # Note [backward's tensors in the compute pool]
            out.record_stream(torch.cuda.current_stream(self.device))
        return out

    def _collect(self) -> None:
        """Staged tensors nobody else references go, after the stream that made them waits for
        their copies (Note [backward's tensors in the compute pool])."""
        with self._lock:
            if not self._staged:
                return
            free, kept = [], []
            for s in self._staged:
                (free if use_count(s[0]) <= 1 else kept).append(s)
            self._staged = kept
        for _, stream, evs in free:
            for ev in evs:
                self.native.drop_staged(ev, stream)

    def end_of_backward(self) -> None:
        """Every source goes; every staged tensor's stream waits for its copies, so the ones
        still referenced elsewhere may go whenever they are dropped; then poll."""
        self.release_sources()
        with self._lock:
            staged, self._staged = self._staged, []
        for _, stream, evs in staged:
            for ev in evs:
                self.native.drop_staged(ev, stream)
        self.reap()

    # -- the simulated device's memory (tests) ----------------------------------------------

    def probe_memory(self) -> SimMemory:
        """Count device memory on the simulated device from now (tests)."""
        if not self.sim:
            raise ValueError("probe_memory: the simulated device only (torch.cuda counts CUDA's)")
        if self.memory is None:
            self.memory = SimMemory()
        return self.memory


class SimMemory:
    """Device memory of the simulated device as a caching allocator sees it: the bytes of the
    device storages the link touched (sources, tensors brought back) still alive, per stream
    pool; peaks taken at each new storage (the only moments live bytes grow)."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._lock = threading.Lock()
        self._live: Dict[int, Tuple[Any, int, str]] = {}
        self.peak = 0
        self.pool_peaks: Dict[str, int] = {}

    def _by_pool(self) -> Dict[str, int]:
        for k in [k for k, (w, _, _) in self._live.items() if w.expired()]:
            del self._live[k]
        out: Dict[str, int] = {}
        for _, n, pool in self._live.values():
            out[pool] = out.get(pool, 0) + n
        return out

    def track(self, storage: Any, pool: str) -> None:
        with self._lock:
            old = self._live.get(storage._cdata)
            if old is not None and not old[0].expired():
                return
            self._live[storage._cdata] = (self._ref(storage), storage.nbytes(), pool)
            by_pool = self._by_pool()
            self.peak = max(self.peak, sum(by_pool.values()))
            for p, n in by_pool.items():
                self.pool_peaks[p] = max(self.pool_peaks.get(p, 0), n)

    def live_bytes(self) -> int:
        with self._lock:
            return sum(self._by_pool().values())

    def reset_peaks(self) -> None:
        with self._lock:
            by_pool = self._by_pool()
            self.peak = sum(by_pool.values())
            self.pool_peaks = dict(by_pool)
