"""The NVMe tier: the host pool as a write-back cache over swap files, with look-ahead reads.

Per process and configuration there is one :class:`NvmeTier` (pool + swap engine + the access
order learned from the last step); each ``offload_context`` has a :class:`StepStore` over it.

Write-behind and eviction (Note [write early, drop late]): entries are written out
oldest-packed first -- backward runs in (roughly) reverse pack order, so the earliest packed
entry is the one whose next use is farthest away -- as soon as more than a quarter of the pool
holds bytes not yet on disk, and keep their blocks once written. A lease that finds the pool
full drops the earliest packed entry already on disk, at once; only when every block is unwritten
does it wait for the oldest write in flight (or start one).

Prefetch: on every unpack, reads are issued for the entries expected next (the unpack order
learned from the previous step, or reverse pack order on the first step), up to
``prefetch_bytes`` ahead. Unpack waits (GIL released) on a read already in flight instead of
issuing another.

Note [clean entries]
    An entry read back keeps its swap slot until it dies: its bytes on disk are still good, so
    when the pool needs its block again (a large tensor read back in pieces, or a long
    backward) it is dropped without being written a second time, and a second backward
    (``retain_graph=True``) reads it again from the same place.

Note [write early, drop late]
    Writing out only when the pool is nearly full made forward wait for the disk whenever a
    large tensor arrived (a 128 MiB softmax output through a 64 MiB pool: 0.18-0.20 s a step on
    the GPT benchmark), though the disk sat idle for most of forward. So the store writes behind
    as soon as unwritten bytes pass DIRTY_SHARE of the pool, and a written entry keeps its block
    (a clean entry, as after a read): dropping it later costs nothing, and if it is never
    dropped -- the last layers' tensors -- backward finds it in the pool. The price is disk
    bandwidth: up to a pool's worth of bytes a step is written that backward reads from the
    pool, and ``bytes_offloaded_nvme`` counts every byte written.

Note [chunked read-ahead]
    A chunked storage (Note [chunked storages] in context.py) on a CPU device is read back
    straight from its pieces' slots into one buffer of its own, which becomes the unpacked
    tensor: no pool block per piece and no copy to assemble them (pieces still in the pool are
    copied). The reads start when the storage is the next thing backward is expected to need
    (in the order learned from the last step; reverse pack order, the guess of a first step,
    is wrong in recomputation) -- in recomputation, when its region starts rerunning, so the
    ops before it overlap the reads -- and not earlier, which would hold its bytes through the
    backward of the region before. One storage is read ahead at a time.

Note [parked I/O]
    An entry freed while its write or read is in flight hands its ticket and slot to the tier,
    which keeps them until the request completes: the engine parks the block itself, and the
    slot must not be reallocated (and rewritten) while an older write to it may still land.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Deque, Dict, List, Optional, Tuple

from . import _native, _runtime
from .config import Config
from .errors import ConfigError, PoolExhaustedError

DIRTY_SHARE = 0.25  # write behind while more of the pool than this is not on disk yet
DEFAULT_PREFETCH_CAP = 256 << 20

_tiers: Dict[Tuple, NvmeTier] = {}
_tiers_lock = threading.Lock()
_tmpdirs: List[str] = []


def _default_dir() -> str:
    d = tempfile.mkdtemp(prefix="spillover-swap-")
    os.chmod(d, 0o700)
    _tmpdirs.append(d)
    return d


@atexit.register
def _cleanup() -> None:
    for d in _tmpdirs:
        shutil.rmtree(d, ignore_errors=True)


def check_dirs(dirs: Tuple[str, ...]) -> None:
    """Refuse, before any step runs, a swap directory that cannot work."""
    for d in dirs:
        if not os.path.exists(d):
            raise ConfigError(
                f"SPILLOVER_NVME_PATH: {d!r} does not exist; create it or point "
                "SPILLOVER_NVME_PATH at a directory on a local NVMe drive"
            )
        if not os.path.isdir(d):
            raise ConfigError(f"SPILLOVER_NVME_PATH: {d!r} is not a directory")
        real = os.path.realpath(d)
        if real.split(os.sep)[1:2] in (["proc"], ["sys"], ["dev"]) and not real.startswith(
            "/dev/shm"
        ):
            raise ConfigError(
                f"SPILLOVER_NVME_PATH: {d!r} is under /{real.split(os.sep)[1]}, a kernel "
                "file system: choose a directory on a local drive"
            )
        st = os.stat(real)
        if st.st_mode & 0o002 and not st.st_mode & 0o1000:
            raise ConfigError(
                f"SPILLOVER_NVME_PATH: {d!r} is world-writable without the sticky bit, so "
                "other users could replace what is in it; use a private directory (chmod 700) "
                "or one with the sticky bit (chmod +t)"
            )
        if not os.access(d, os.W_OK | os.X_OK):
            raise ConfigError(
                f"SPILLOVER_NVME_PATH: {d!r} is not writable by this user; fix its "
                "permissions or choose another directory"
            )


class NvmeTier:
    def __init__(self, cfg: Config, pool: Any):
        dirs = cfg.nvme_path or (_default_dir(),)
        check_dirs(dirs)
        self.pool = pool
        self.capacity = pool.capacity
        self.swap = _native.Swap(
            pool,
            list(dirs),
            engine=cfg.io_engine,
            queue_depth=cfg.io_queue_depth,
            block_bytes=cfg.io_block_bytes,
            allow_buffered=cfg.allow_buffered_io,
        )
        if self.swap.warning:
            _runtime.warn_once("swap:" + self.swap.warning, self.swap.warning)
        self.prefetch_bytes = cfg.prefetch_bytes or min(self.capacity // 4, DEFAULT_PREFETCH_CAP)
        self.dirty_max = int(self.capacity * DIRTY_SHARE)
        # Note [chunked storages] in context.py: larger storages go in pieces of chunk_bytes.
        self.chunk_above = self.capacity // 2
        self.chunk_bytes = max(4096, (self.capacity // 8) // 4096 * 4096)
        #: (unpack order, entry sizes in pack order) of the last step, and of the one before
        self.learned: Optional[Tuple[List[int], List[int]]] = None
        self.last_order: Optional[Tuple[List[int], List[int]]] = None
        self._parked: List[Tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def park(self, ticket: Any, slot: Any) -> None:
        """Note [parked I/O]."""
        with self._lock:
            self._parked.append((ticket, slot))

    def reap_parked(self) -> None:
        with self._lock:
            still = []
            for t, s in self._parked:
                if t.done():
                    # The entry is gone, so nobody needs these bytes or this request's error.
                    with contextlib.suppress(Exception):
                        t.wait()
                else:
                    still.append((t, s))
            self._parked = still


def _after_fork_in_child() -> None:
    global _tiers_lock
    _tiers_lock = threading.Lock()
    _tiers.clear()  # Note [fork]: the child opens its own swap files if it offloads


os.register_at_fork(after_in_child=_after_fork_in_child)


def tier_for(cfg: Config, pool: Any) -> NvmeTier:
    key = (
        pool.capacity,
        cfg.nvme_path,
        cfg.io_engine,
        cfg.io_queue_depth,
        cfg.io_block_bytes,
        cfg.allow_buffered_io,
        cfg.prefetch_bytes,
    )
    with _tiers_lock:
        t = _tiers.get(key)
        if t is None:
            _runtime.log.info("opening NVMe tier in %s", cfg.nvme_path or "a private temp dir")
            t = _tiers[key] = NvmeTier(cfg, pool)
        return t


class Spilled:
    """Where an entry's bytes are. ``state``: host, writing, disk or reading."""

    __slots__ = ("state", "ticket", "slot", "seq", "viewed", "went_to_disk")

    def __init__(self, seq: int):
        self.state = "host"
        self.ticket: Any = None
        self.slot: Any = None
        self.seq = seq
        self.viewed = False
        self.went_to_disk = False


class DirectRead:
    """Note [chunked read-ahead]: the buffer a chunked storage is read into, piece by piece.
    ``blocks[i]`` is piece i's part of the buffer (None while its read holds it), ``reads[i]``
    its read in flight (ticket, slot) or None."""

    __slots__ = ("tier", "pool", "blocks", "reads", "base", "nbytes", "__weakref__")

    def __init__(self, tier: NvmeTier, sizes: List[int]):
        self.tier = tier
        cap = sum(-(-n // 4096) * 4096 for n in sizes)
        # Faulted in by the reads themselves, as a fresh tensor would be by its first write.
        self.pool = _native.Pool(cap, arena_bytes=cap, prefault=False, lock=False,
                                 huge_pages=False)
        self.blocks: List[Any] = [self.pool.lease(n) for n in sizes]
        self.reads: List[Optional[Tuple[Any, Any]]] = [None] * len(sizes)
        self.base = self.blocks[0].address
        self.nbytes = sum(sizes)

    def contiguous(self) -> bool:
        off = 0
        for b in self.blocks:
            if b.address != self.base + off:
                return False
            off += b.capacity
        return True

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        # The whole buffer as one array; numpy keeps this object (and so the blocks) alive.
        return {"data": (self.base, False), "shape": (self.nbytes,), "typestr": "|u1",
                "version": 3}

    def __del__(self) -> None:
        for r in self.reads:  # Note [parked I/O]: a read may still land in these bytes
            if r is not None and not r[0].done():
                self.tier.park(*r)


class StepStore:
    """The NVMe side of one context: which entries are resident, written, being read."""

    def __init__(self, tier: NvmeTier, stats: Any):
        self.tier = tier
        self.stats = stats
        self.lock = threading.RLock()
        # Resident entries are held weakly: an entry lives exactly as long as autograd's
        # handles to it (and a write or read in flight), never because the store knows it.
        self.resident: Dict[int, Any] = {}
        # Entries with a write or read in flight, held weakly too: an entry whose handles are
        # all gone dies at once and parks its request with the tier (Note [parked I/O]).
        self.writing: Deque[Any] = collections.deque()  # weakrefs, oldest first
        self.reading: Dict[int, Any] = {}  # seq -> weakref
        self.by_seq: Dict[int, Any] = {}  # seq -> weakref of entry
        self._ahead: Any = None  # weakref of the DirectRead started ahead of its use
        # Entries not yet written, in pack order, with their bytes (some may have died or been
        # written by a lease since: skipped when reached).
        self.dirty: Deque[Tuple[Any, int]] = collections.deque()
        self.dirty_bytes = 0
        self.next_seq = 0
        self.order: List[int] = []  # this step's unpack order (taught to the next step)
        self.sizes: List[int] = []  # bytes of each entry, in pack order
        if tier.last_order and tier.last_order[0]:
            tier.learned = (list(tier.last_order[0]), tier.last_order[1])
        tier.last_order = (self.order, self.sizes)
        self.learned: Optional[List[int]] = tier.learned[0] if tier.learned else None
        self._learned_sizes = tier.learned[1] if tier.learned else None
        self._learned_pos: Dict[int, int] = (
            {s: i for i, s in enumerate(self.learned)} if self.learned else {}
        )

    # -- forward --

    def lease(self, nbytes: int) -> Any:
        """A block, writing out older entries when the pool is full. Raises
        PoolExhaustedError when nothing can be evicted (the caller keeps the tensor)."""
        pool = self.tier.pool
        while True:
            try:
                return pool.lease(nbytes)
            except PoolExhaustedError:
                with self.lock:
                    if self._drop_clean():  # Note [write early, drop late]: no waiting
                        continue
                    writing = self._oldest_writing()
                    evicted = writing is None and self._start_oldest_write()
                    reading = next((e for e in self._live(self.reading.values())), None)
                    copying = next((e for e in self._resident() if not e.copy.done()), None)
                if writing is not None:
                    self._finish_write(writing, wait=True)
                elif evicted:
                    continue
                elif reading is not None:  # a prefetched entry becomes resident (evictable)
                    self._finish_read(reading)
                elif copying is not None:  # its pack copy is still running: then evictable
                    t0 = time.perf_counter()
                    copying.copy.wait()
                    self.stats.add(stall_seconds=time.perf_counter() - t0)
                else:
                    raise

    def add(self, entry: Any) -> None:
        with self.lock:
            entry.spill = Spilled(self.next_seq)
            self.next_seq += 1
            self.sizes.append(entry.nbytes)
            self.resident[entry.spill.seq] = self.by_seq[entry.spill.seq] = weakref.ref(entry)
            self.dirty.append((self.by_seq[entry.spill.seq], entry.nbytes))
            self.dirty_bytes += entry.nbytes
        self.tier.reap_parked()
        self._reap_writes()
        self._reap_reads()
        self._write_behind()

    def _write_behind(self) -> None:
        """Note [write early, drop late]: start writes, earliest packed first, until no more
        than DIRTY_SHARE of the pool holds bytes that are not on disk. O(1) per pack but for
        the writes it starts: the unwritten entries wait in pack order."""
        with self.lock:
            while self.dirty_bytes > self.tier.dirty_max and self.dirty:
                ref, nbytes = self.dirty[0]
                e = ref()
                if e is not None and e.spill.slot is None:  # not dead, not written by a lease
                    if not self._movable(e):
                        break  # its pack copy is still running: the next pack looks again
                    self._start_write(e.spill.seq, e)
                self.dirty.popleft()
                self.dirty_bytes -= nbytes

    @staticmethod
    def _movable(e: Any) -> bool:
        """Its pack copy is done and nothing but the entry refers to the block (an unpacked
        tensor viewing it holds a reference through numpy's array base)."""
        return e.copy.done() and sys.getrefcount(e.block) <= 2

    def _drop_clean(self) -> bool:
        """Give back the block of the earliest packed resident entry whose bytes are on disk
        (Note [clean entries]). Caller holds the lock."""
        for seq in sorted(self.resident):
            e = self.resident[seq]()
            if e is None:
                del self.resident[seq]
            elif e.spill.slot is not None and self._movable(e):
                e.block = None
                e.spill.state = "disk"
                del self.resident[seq]
                return True
        return False

    def _evict_one(self) -> bool:
        """Free a block: drop a clean entry, else start writing the movable resident entry
        packed earliest. Caller holds the lock."""
        return self._drop_clean() or self._start_oldest_write()

    def _start_oldest_write(self) -> bool:
        """Start writing the movable resident entry packed earliest. Caller holds the lock."""
        for seq in sorted(self.resident):  # earliest packed = next use farthest away
            e = self.resident[seq]()
            if e is None:
                del self.resident[seq]
            elif self._movable(e):
                self._start_write(seq, e)
                return True
        return False

    def _start_write(self, seq: int, e: Any) -> None:
        """Write ``e`` out; its block is the request's until the write is done. Caller holds
        the lock."""
        if e.checksum is None and e.verify:
            e.checksum = e.block.checksum()
        slot = self.tier.swap.alloc(e.nbytes)  # OutOfSpaceError: this step fails here
        e.spill.ticket = self.tier.swap.write(e.block, slot)
        e.spill.slot = slot
        e.spill.state = "writing"
        if not e.spill.went_to_disk:
            self.stats.add(bytes_offloaded_nvme=e.nbytes, bytes_offloaded_host=-e.nbytes)
        e.spill.went_to_disk = True
        e.block = None
        del self.resident[seq]
        self.writing.append(weakref.ref(e))

    @staticmethod
    def _live(refs: Any) -> List[Any]:
        return [e for e in (r() for r in list(refs)) if e is not None]

    def _oldest_writing(self) -> Any:
        """The oldest entry still being written (dropping references to dead ones)."""
        while self.writing:
            e = self.writing[0]()
            if e is not None and e.spill.state == "writing":
                return e
            self.writing.popleft()
        return None

    def _resident(self) -> List[Any]:
        return [e for e in (r() for r in list(self.resident.values())) if e is not None]

    def _reap_reads(self) -> None:
        with self.lock:
            done = [e for e in self._live(self.reading.values())
                    if e.spill.ticket is not None and e.spill.ticket.done()]
        for e in done:
            self._finish_read(e)

    def _reap_writes(self) -> None:
        while True:
            with self.lock:
                e = self._oldest_writing()
                if e is None or not e.spill.ticket.done():
                    return
            self._finish_write(e, wait=False)

    def _finish_write(self, e: Any, wait: bool) -> None:
        t0 = time.perf_counter()
        with self.lock:
            if e.spill.state != "writing":
                return
            ticket = e.spill.ticket
            e.spill.ticket = None
            self.writing = collections.deque(r for r in self.writing if r() not in (e, None))
        blk = ticket.wait()  # raises SwapIOError / OutOfSpaceError
        with self.lock:  # on disk, and still in the pool: Note [write early, drop late]
            e.block = blk
            e.spill.state = "host"
            self.resident[e.spill.seq] = weakref.ref(e)
        if wait:
            self.stats.add(stall_seconds=time.perf_counter() - t0)

    # -- backward --

    def fetch(self, e: Any) -> Any:
        """The entry's host block, read back if needed; then prefetch what comes next."""
        sp = e.spill
        with self.lock:
            self.order.append(sp.seq)
            state = sp.state
        hit = True
        if state == "writing":
            self._finish_write(e, wait=True)
            state = sp.state
        if state == "disk":
            hit = False
            self._start_read(e)
            state = "reading"
        if state == "reading":
            t0 = time.perf_counter()
            if hit and not sp.ticket.done():
                hit = False
            self._finish_read(e)
            self.stats.add(stall_seconds=time.perf_counter() - t0)
        self._used(e, hit)
        return e.block

    def _used(self, e: Any, hit: bool) -> None:
        """``e`` was unpacked (``hit``: its bytes were back in time): count it, read ahead."""
        sp = e.spill
        if sp.went_to_disk:
            self.stats.add(prefetch_hits=int(hit), prefetch_misses=int(not hit))
        else:
            self.stats.add(host_cache_hits=1)
        with self.lock:
            sp.viewed = True
        self._reap_reads()
        self.tier.reap_parked()
        self._prefetch_after(sp.seq)

    def read_direct(self, c: Any) -> Optional[DirectRead]:
        """Note [chunked read-ahead]: start reading the pieces of chunked storage ``c`` that
        are on disk into a buffer of its own (once; None if the buffer cannot be one piece)."""
        if c.ahead is not None:
            return c.ahead or None
        d = DirectRead(self.tier, [p.nbytes for p in c.parts])
        if not d.contiguous():
            c.ahead = False
            return None
        with self.lock:
            for i, p in enumerate(c.parts):
                sp = p.spill
                if sp is not None and sp.state == "disk":
                    d.reads[i] = (self.tier.swap.read(sp.slot, d.blocks[i]), sp.slot)
                    d.blocks[i] = None
        c.ahead = d
        self._ahead = weakref.ref(d)
        return d

    def direct_done(self, c: Any) -> None:
        """``c``'s buffer was handed to its unpack: another storage may be read ahead."""
        if self._ahead is not None and self._ahead() is c.ahead:
            self._ahead = None
        c.ahead = None  # a second unpack (retain_graph) reads again

    def finish_direct(self, d: DirectRead, i: int, e: Any) -> None:
        """Wait for piece ``i`` (entry ``e``) of ``d`` to land, counting it as used."""
        with self.lock:
            self.order.append(e.spill.seq)
        ticket, _slot = d.reads[i]
        hit = ticket.done()
        t0 = time.perf_counter()
        d.blocks[i] = ticket.wait()  # raises SwapIOError
        d.reads[i] = None
        self.stats.add(stall_seconds=time.perf_counter() - t0)
        self._used(e, hit)

    def _start_read(self, e: Any) -> None:
        try:
            blk = self.lease(e.nbytes)
        except PoolExhaustedError:
            blk = self._overflow_block(e.nbytes)
        with self.lock:
            if e.spill.state != "disk":  # someone else started it
                return
            e.spill.ticket = self.tier.swap.read(e.spill.slot, blk)
            e.spill.state = "reading"
            self.reading[e.spill.seq] = weakref.ref(e)

    def _overflow_block(self, nbytes: int) -> Any:
        """Backward must not fail because the pool is full or fragmented: read into a block
        of a one-off mapping instead (unregistered, so the engine uses plain reads), which goes
        away with the tensor that views it."""
        _runtime.warn_once(
            "pool-overflow",
            f"spillover: the {self.tier.capacity >> 20} MiB host pool had no room to read back "
            f"a {nbytes >> 20} MiB tensor; used a temporary buffer (slower). Raise "
            "SPILLOVER_HOST_POOL_BYTES to a few times the largest saved tensor.",
        )
        self.stats.add(overflow_reads=1)
        return _native.Pool(nbytes, lock=False, huge_pages=False).lease(nbytes)

    def _finish_read(self, e: Any) -> None:
        with self.lock:
            if e.spill.state != "reading":
                return
            ticket = e.spill.ticket
        blk = ticket.wait()
        with self.lock:
            if e.spill.state == "reading":
                e.block = blk
                e.spill.state = "host"
                e.spill.ticket = None  # the slot stays: Note [clean entries]
                self.reading.pop(e.spill.seq, None)
                self.resident[e.spill.seq] = weakref.ref(e)

    def _expected_after(self, seq: int) -> List[int]:
        if self._learned_sizes is not None and self._learned_sizes != self.sizes:
            # The step that taught the order packed other tensors (the model or its plan
            # changed, e.g. auto after its learning step): its order would read the wrong
            # entries ahead.
            self.learned, self._learned_pos = None, {}
        self._learned_sizes = None  # compared once, when backward starts
        pos = self._learned_pos.get(seq)
        if self.learned is not None and pos is not None:
            return self.learned[pos + 1 :]
        return list(range(seq - 1, -1, -1))

    def _prefetch_after(self, seq: int) -> None:
        window = self.tier.prefetch_bytes
        ahead = 0
        expected = self._expected_after(seq)
        learned = seq in self._learned_pos  # not a guess: read chunked storages ahead
        for s in expected:
            if ahead >= window:
                break
            ref = self.by_seq.get(s)
            e = ref() if ref is not None else None
            if e is None:
                continue
            c = e.chunk() if e.chunk is not None else None
            if c is not None and c.device.type == "cpu":
                # Note [chunked read-ahead]: never through the pool; started when it is next.
                busy = self._ahead() if self._ahead is not None else None
                if c.ahead is None and learned and ahead == 0 and busy is None:
                    self.read_direct(c)
                if c.ahead is not False:
                    continue
            st = e.spill.state
            if st in ("reading", "writing"):
                ahead += e.nbytes
            elif st == "disk":
                try:
                    blk = self.tier.pool.lease(e.nbytes)  # prefetch never evicts
                except PoolExhaustedError:
                    break
                with self.lock:
                    if e.spill.state == "disk":
                        e.spill.ticket = self.tier.swap.read(e.spill.slot, blk)
                        e.spill.state = "reading"
                        self.reading[s] = weakref.ref(e)
                ahead += e.nbytes
            elif st == "host" and not e.spill.viewed:
                ahead += e.nbytes

    def release(self, e: Any) -> None:
        """Called when an entry dies: Note [parked I/O]."""
        sp = getattr(e, "spill", None)
        if sp is None:
            return
        if sp.ticket is not None and not sp.ticket.done():
            self.tier.park(sp.ticket, sp.slot)

