"""The saved-tensor hooks of ``offload_context``: the torch semantics between autograd and the
tier -- which saved tensors are offloaded, one storage however many views of it are saved,
version checks, and rebuilding the exact view on unpack. The bytes go through the link of the
tensor's device (activations/link) into the Rust tier.

What pack and unpack promise
    pack(t) returns either ``t`` itself (kept: small, a parameter or buffer, marked with
    :func:`keep`, an unsupported layout, or the pool is full) or a handle to the bytes of
    ``t``'s *storage*, copied once into a host block however many views of it are saved.
    unpack(handle) returns a tensor with the exact dtype, size, stride and storage offset that
    was saved, on the original device, bitwise equal to it. Unpack may run any number of
    times (``retain_graph=True``), on any thread, after the ``with`` block has ended.

Note [source returned]
    An unpack whose entry's device→host copy still holds its source (the last tensors of a
    forward, unpacked first by backward) returns that source: the bytes are on the device
    already, and copying them back would spend the link on bytes that never left.

Note [views share one return]
    When several views of one storage were saved, the first unpack's bytes serve the others
    until each has had them: on a device, so the bytes cross the link once; on a CPU host for a
    storage in pieces, so its pieces are read and gathered once (an unpack of a whole entry
    there is a view of its block, free to repeat). Measured on the GPT benchmark's 128 MiB
    attention probabilities, each saved through two views: 1.3 s of backward's 1.45 s of
    waiting was the second gathering of each.

Note [storage identity]
    Views are deduplicated by (device, storage address), but an address can be reused once the
    storage is freed. A dedup entry therefore also holds a *weak* reference to the storage and
    matches only while that storage is alive (a freed storage cannot have more views saved).

Note [host link]
    On a CPU host (plain CPU tensors, no simulated link) the "device" is the host: pack copies
    the storage into the tier in one call (``Step.put_from``: lease, memcpy with the GIL
    released, seal), and unpack views the block. No worker thread, no events, no copy in
    flight: a copy on the same two cores is compute, not a link to overlap, and the worker
    thread's hand-offs cost more than the copy of a 1 MiB tensor (pack_cost.py: pack + land
    225 + 355 us before; pack 189 us, copy included, after, on a loaded machine). A stored
    storage then has no ``copies``: nothing to wait for, no source held (the version check at
    unpack still raises autograd's in-place error). CUDA and the simulated device keep their
    asynchronous copies (activations/link).

Note [kept by a policy]
    ``spillover.wrap``/``checkpoint`` regions hold some saved tensors themselves, out of
    autograd's hooks: op outputs their policy keeps (policy="auto"'s plan, a callable's "keep",
    ops with side effects), and everything a "plain-keep" region saves. That is device memory
    the step holds all the same, so the regions hand each to :meth:`OffloadContext.kept`
    (recompute/modes.py, recompute/policies.py): counted as saved and kept, "policy" in
    ``report()`` (parameters, buffers and small tensors under their own reasons). A storage a
    policy holds is not offloaded when autograd saves it again in the same forward (the copy
    would free nothing on the device): that counts as a deduplicated view.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from .. import _native, _runtime
from ..config import Config
from ..errors import IntegrityError, PoolExhaustedError
from .link import block_tensor, transfers_for
from .registry import StepRecord, StorageWeakRef, capturing, is_param

__all__ = ["Hooks", "Packed", "Stored"]

#: H2D staging distance (CUDA and the simulated device): entries and bytes ahead of unpack.
STAGE_AHEAD_ENTRIES = 4
STAGE_AHEAD_BYTES = 512 << 20




class Stored:
    """One offloaded storage: its tier entry (a ``Handle``, or a ``Gathered`` of pieces) and the
    device->host copies that fill it."""

    __slots__ = ("record", "entry", "nbytes", "device", "copies", "seq", "views", "staged",
                 "chunked", "_lock", "_cached", "_cached_uses", "__weakref__")

    def __init__(self, record: Any, entry: Any, nbytes: int, device: torch.device,
                 copies: List[Any], seq: int):
        self.record = record  # its step (Note [one context, many steps]): lives as long as it
        self.entry = entry
        self.nbytes = nbytes
        self.device = device
        self.copies = copies  # none on a CPU host (Note [host link])
        self.seq = seq  # the tier's pack order (the last piece's, for a gathered storage)
        self.chunked = isinstance(entry, _native.Gathered)
        self.views = 0
        self.staged: Any = None  # (device tensor, event) staged ahead of its unpack
        self._lock = threading.Lock()
        self._cached: Optional[torch.Tensor] = None  # device bytes shared by several views
        self._cached_uses = 0

    @property
    def modified(self) -> bool:
        return any(c.modified for c in self.copies)

    def source(self) -> Optional[torch.Tensor]:
        """The whole storage still on the device (Note [source returned]), or None."""
        if not self.copies:  # copied when packed (Note [host link])
            return None
        if len(self.copies) != 1:
            srcs = [c.source() for c in self.copies]
            if any(s is None for s in srcs):
                return None
            base = srcs[0]
            if base is None or base.untyped_storage().nbytes() != self.nbytes:
                return None
            return torch.empty(0, dtype=torch.uint8, device=base.device).set_(
                base.untyped_storage())
        return self.copies[0].source()


class Packed:
    __slots__ = ("stored", "dtype", "size", "stride", "offset", "version", "tref", "__weakref__")

    def __init__(self, stored: Stored, t: torch.Tensor):
        self.stored = stored
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = t._version
        self.tref = weakref.ref(t)  # Note [in-place after pack] in link/policy.py
        stored.views += 1

    def check_version(self) -> None:
        t = self.tref()
        if self.stored.modified or (t is not None and t._version != self.version):
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a saved tensor of shape {list(self.size)} and dtype "
                f"{self.dtype} was changed after autograd saved it (spillover offloaded it; "
                "without spillover autograd raises the same error). Use an out-of-place op, or "
                "clone the tensor before modifying it."
            )



class Hooks:
    """pack and unpack, a mixin of :class:`~.context.OffloadContext`, which owns the steps and
    the pools they use."""

    if TYPE_CHECKING:  # what they read of the context
        config: Config
        _lock: threading.Lock
        _transfers: Dict[Any, Any]
        _transfer_base: Dict[Any, Tuple[float, int]]
        _pool_starts: List[int]
        _pool_ranges: List[Tuple[int, int]]
        _chunk_above: int
        _chunk_bytes: int
        _in_backward: bool
        _bwd_records: Dict[int, StepRecord]
        _grow_lock: threading.Lock
        _pools: Any

        @property
        def _pool(self) -> Any: ...

        @property
        def _tier(self) -> Any: ...

        @property
        def nvme(self) -> bool: ...

        def _current(self) -> StepRecord: ...

        def _grown(self) -> None: ...

        def _check_pool(self, rec: StepRecord) -> None: ...

        def _check_compiled(self, rec: StepRecord) -> None: ...

        def _check_speed(self, rec: StepRecord) -> None: ...

        def _note_node(self, rec: StepRecord, node: Any, s: Stored) -> None: ...

    def _in_pool(self, addr: int) -> bool:
        i = bisect.bisect_right(self._pool_starts, addr) - 1
        return i >= 0 and addr < self._pool_ranges[i][1]

    def _transfer(self, device: torch.device) -> Any:
        tr = self._transfers.get(device)
        if tr is None:
            tr = transfers_for(device, sim_bandwidth=self.config.sim_link_bandwidth,
                               cap_bytes=self.config.copy_inflight_bytes,
                               sim_lag=self.config.sim_compute_lag)
            with self._lock:
                self._transfer_base[device] = (tr.stall_seconds, tr.forced_waits)
                self._transfers[device] = tr
        return tr

    @torch._dynamo.disable  # type: ignore[misc]
    def _pack(self, t: torch.Tensor, offload: bool = True) -> Any:
        rec = self._current()
        stats = rec.stats
        device = t.device
        kind = device.type
        if (
            t.layout != torch.strided
            or kind not in ("cpu", "cuda")
            or (type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter))
            or t.is_quantized
        ):
            stats.add(tensors_packed=1, bytes_kept_unsupported=t.numel() * t.element_size())
            return t
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        why = self._kept_why(rec, t, storage, nbytes, kind, offload)
        if why is not None:
            if type(why) is Packed:  # a view of a storage this step offloaded already
                stats.add(tensors_packed=1, bytes_packed=nbytes, storages_deduplicated=1,
                          bytes_deduplicated=nbytes)
                return why
            stats.add(tensors_packed=1, bytes_packed=nbytes, **{why: nbytes})
            if why == "bytes_deduplicated":
                stats.add(storages_deduplicated=1)
            return t
        key = (kind, device.index or 0, storage.data_ptr())
        tr = self._transfer(device)
        if tr.host_is_device:  # Note [host link]: one call into the tier, no copy in flight
            stored = self._pack_host(rec, storage, t, nbytes)
        else:
            tr.reap(rec.errors)
            src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            if self._chunk_above and nbytes > self._chunk_above:
                stored = self._pack_pieces(rec, tr, src, t, nbytes)
            else:
                stored = self._pack_whole(rec, tr, src, t, nbytes)
        if stored is None:
            stats.add(tensors_packed=1, bytes_packed=nbytes, bytes_kept_pool_full=nbytes)
            return t
        rec.dedup[key] = (weakref.ref(stored), StorageWeakRef(storage))
        rec.stored.add(stored)
        rec.devices.add(device)
        stats.add(tensors_packed=1, bytes_packed=nbytes, tensors_offloaded=1)
        if not tr.host_is_device:  # only a device's H2D copies are staged ahead
            stats.raise_to(bytes_in_flight_peak=tr.bytes_in_flight)
            rec.by_seq[stored.seq] = weakref.ref(stored)
        return Packed(stored, t)

    def _kept_why(self, rec: StepRecord, t: torch.Tensor, storage: Any, nbytes: int, kind: str,
                  offload: bool) -> Any:
        """Why ``t`` is not offloaded: the stats field its bytes count in, or the handle of the
        storage this step already offloaded that it views; None when it is to be offloaded."""
        if nbytes < self.config.min_offload_bytes or nbytes == 0:
            return "bytes_kept_small"
        if kind == "cuda" and capturing():
            return "bytes_kept_unsupported"
        if is_param(rec, t, storage):
            return "bytes_kept_parameter"
        key = (kind, t.device.index or 0, storage.data_ptr())
        if key in rec.marked:
            return "bytes_kept_marked"
        held = rec.kept.get(key)  # Note [kept by a policy]
        if held is not None and held.cdata == storage._cdata and not held.expired():
            return "bytes_deduplicated"
        if not offload:
            rec.kept[key] = StorageWeakRef(storage)
            return "bytes_kept_policy"
        if kind == "cpu" and self._in_pool(key[2]):
            # Already a view of a pool block (e.g. an unpacked tensor saved again).
            return "bytes_kept_unsupported"
        hit = rec.dedup.get(key)
        if hit is not None:
            stored = hit[0]()
            if stored is not None and not hit[1].expired():
                return Packed(stored, t)
        return None

    def _put(self, rec: StepRecord, tr: Any, nbytes: int, grow: bool = True
             ) -> Tuple[Any, Any]:
        """A staged tier entry of ``nbytes``. When every block is staged or viewed, the copies
        in flight are waited for (their entries become evictable) and the lease tried again;
        then (``grow``) a default pool grows (Note [growing pool] in _growth.py);
        PoolExhaustedError when none of that makes room."""
        try:
            return rec.step.put(nbytes)
        except PoolExhaustedError:
            if rec.pool_full:  # found full after waiting: waiting again frees nothing
                raise
            if not tr.bytes_in_flight and not (grow and self._grow(rec, nbytes)):
                self._full(rec)
                raise
        if tr.bytes_in_flight:
            t0 = time.perf_counter()
            tr.synchronize(rec.errors)
            rec.stats.add(stall_seconds=time.perf_counter() - t0)
            try:
                return rec.step.put(nbytes)
            except PoolExhaustedError:
                if not (grow and self._grow(rec, nbytes)):
                    self._full(rec)
                    raise
        return rec.step.put(nbytes)

    @staticmethod
    def _full(rec: StepRecord) -> None:
        """A pool without swap that is full once its copies landed stays full for the step (its
        entries are freed only by a backward): later packs keep their tensors without waiting
        for the device again. With swap, write-behind makes room: those packs still wait."""
        if not rec.tier.has_swap:
            rec.pool_full = True

    def _grow(self, rec: StepRecord, nbytes: int) -> bool:
        """Mid-step growth: ``rec`` goes on over a larger pool (another thread's step may have
        grown it already). False when the pool cannot grow."""
        with self._grow_lock:
            if rec.tier is self._tier and not self._pools.grow_mid_step(nbytes):
                return False
            self._grown()
        rec.begin(self._tier)
        rec.stats.pool_capacity = self._pool.capacity
        return True

    def _put_from(self, rec: StepRecord, src: Any, offset: int, nbytes: int,
                  grow: bool = True) -> Any:
        """Note [host link]: a sealed tier entry holding ``nbytes`` of ``src`` (a CPU storage or
        tensor) from ``offset``,
        in one call into the tier. A full pool grows (``grow``, Note [growing pool]) or raises
        PoolExhaustedError."""
        try:
            return rec.step.put_from(src, src.data_ptr() + offset, nbytes)
        except PoolExhaustedError:
            if not (grow and self._grow(rec, nbytes)):
                raise
        return rec.step.put_from(src, src.data_ptr() + offset, nbytes)

    def _pack_host(self, rec: StepRecord, storage: Any, t: torch.Tensor, nbytes: int
                   ) -> Optional[Stored]:
        """Note [host link]: the storage's bytes into the tier in one call per entry (pieces
        above the chunk size, Note [gathered storages] in rust/tier/gather.rs)."""
        if not (self._chunk_above and nbytes > self._chunk_above):
            try:
                handle = self._put_from(rec, storage, 0, nbytes)
            except PoolExhaustedError:
                return None
            return Stored(rec, handle, nbytes, t.device, [], handle.seq)
        handles = []
        try:
            for off in range(0, nbytes, self._chunk_bytes):
                n = min(self._chunk_bytes, nbytes - off)
                handles.append(self._put_from(rec, storage, off, n, grow=False))
        except PoolExhaustedError:
            return None
        rec.stats.add(tensors_chunked=1)
        return Stored(rec, rec.step.gather(handles), nbytes, t.device, [], handles[-1].seq)

    def _pack_whole(self, rec: StepRecord, tr: Any, src: torch.Tensor, t: torch.Tensor,
                    nbytes: int) -> Optional[Stored]:
        try:
            handle, view = self._put(rec, tr, nbytes)
        except PoolExhaustedError:
            return None
        copy = tr.to_host(src, block_tensor(view), watch=t, on_landed=handle.seal,
                          errors=rec.errors)
        return Stored(rec, handle, nbytes, t.device, [copy], handle.seq)

    def _pack_pieces(self, rec: StepRecord, tr: Any, src: torch.Tensor, t: torch.Tensor,
                     nbytes: int) -> Optional[Stored]:
        """Note [gathered storages] (rust/tier/gather.rs): a storage larger than half the pool
        goes in pieces, each an entry of its own, written out as the pool fills."""
        handles, copies = [], []
        try:
            for off in range(0, nbytes, self._chunk_bytes):
                n = min(self._chunk_bytes, nbytes - off)
                handle, view = self._put(rec, tr, n, grow=False)  # one tier step for all
                copies.append(tr.to_host(src[off : off + n], block_tensor(view), watch=t,
                                         on_landed=handle.seal, errors=rec.errors))
                handles.append(handle)
        except PoolExhaustedError:
            # The pieces go as their copies land (a staging view keeps its block until then).
            return None
        rec.stats.add(tensors_chunked=1)
        return Stored(rec, rec.step.gather(handles), nbytes, t.device, copies, handles[-1].seq)

    @torch._dynamo.disable  # type: ignore[misc]
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        s = packed.stored
        rec = s.record
        node = self._note_backward(rec)
        if node is not None:
            self._note_node(rec, node, s)
        raw = self._materialize(s, packed)
        packed.check_version()
        out = torch.empty(0, dtype=packed.dtype, device=s.device)
        out.set_(raw.untyped_storage(), packed.offset, packed.size, packed.stride)
        rec.stats.add(tensors_unpacked=1, bytes_unpacked=s.nbytes)
        return out

    def _note_backward(self, rec: StepRecord) -> Any:
        """At the first unpack of a backward: run :meth:`_end_of_backward` when it ends.
        Returns the autograd node unpacking (None outside a backward)."""
        get_node = getattr(torch._C, "_current_autograd_node", None)
        node = get_node() if get_node is not None else None
        if get_node is not None and node is None:
            return None  # unpacked outside a backward (e.g. a saved tensor read directly)
        with self._lock:
            self._bwd_records[id(rec)] = rec
            if self._in_backward:
                return node
            self._in_backward = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        except RuntimeError:  # unpacked outside a backward (e.g. a saved tensor read directly)
            with self._lock:
                self._in_backward = False
        return node

    def _end_of_backward(self) -> None:
        with self._lock:
            self._in_backward = False
            recs, self._bwd_records = list(self._bwd_records.values()), {}
        for tr in list(self._transfers.values()):
            tr.end_of_backward()
        for rec in recs:
            self._check_pool(rec)  # packs of regions recomputed in backward count too
            self._check_compiled(rec)
            self._check_speed(rec)

    def _materialize(self, s: Stored, packed: Packed) -> torch.Tensor:
        """The storage's bytes as a uint8 tensor on its device."""
        tr = self._transfer(s.device)
        stats = s.record.stats
        src = s.source()
        if not tr.host_is_device:  # the host link holds no sources (Note [host link])
            # Copies seen complete drop their sources; the rest keep theirs (the next unpacks
            # may return them: Note [source returned]) -- no wait on a copy still in flight.
            tr.reap(s.record.errors)
        if src is not None:  # Note [source returned]
            stats.add(unpacks_from_source=1)
            s.entry.note_used()
            return src
        with s._lock:
            if s._cached is not None:  # another view of this storage already brought it back
                raw = s._cached
                s._cached_uses += 1
                if s._cached_uses >= s.views:
                    s._cached, s._cached_uses = None, 0
                return raw
            staged, s.staged = s.staged, None
            if staged is not None:
                s.entry.note_used()
                raw = tr.use(staged)
            else:
                raw = self._bring_back(tr, s, packed)
            if s.views > 1 and (not tr.host_is_device or s.chunked):
                # Note [views share one return]
                s._cached, s._cached_uses = raw, 1
        self._stage_ahead(tr, s)
        return raw

    def _bring_back(self, tr: Any, s: Stored, packed: Packed) -> torch.Tensor:
        t0 = time.perf_counter()
        for c in s.copies:  # the tier can give the bytes back only once they have landed
            c.wait()
        s.record.stats.add(stall_seconds=time.perf_counter() - t0)
        try:
            view = s.entry.get()
        except IntegrityError as e:
            where = "nvme" if self.nvme else "host"
            raise IntegrityError(
                f"a saved tensor of shape {list(packed.size)} and dtype {packed.dtype} read "
                f"back from the {where} tier does not match its checksum ({e})"
            ) from None
        if not s.chunked and not self._in_pool(view.address):
            _runtime.warn_once(
                "pool-overflow",
                f"spillover: the {self._pool.capacity >> 20} MiB host pool had no room to read "
                f"back a {s.nbytes >> 20} MiB tensor; used a temporary buffer (slower). Raise "
                "SPILLOVER_HOST_POOL_BYTES to a few times the largest saved tensor.",
            )
        raw, _ = tr.to_device(block_tensor(view))
        return raw

    def _stage_ahead(self, tr: Any, s: Stored) -> None:
        """Start the H2D copies of the next entries backward is expected to unpack, a bounded
        distance ahead, from blocks already in the pool (the tier reads the rest ahead)."""
        rec = s.record
        ref = rec.by_seq.get(s.seq)
        if tr.host_is_device or ref is None or ref() is not s:
            return  # nothing staged on a CPU host; an entry of a pool grown past: not ahead
        staged, nbytes = 0, 0
        for seq in rec.step.expected_after(s.seq, 4 * STAGE_AHEAD_ENTRIES):
            if staged >= STAGE_AHEAD_ENTRIES or nbytes >= STAGE_AHEAD_BYTES:
                break
            ref = rec.by_seq.get(seq)
            c = ref() if ref is not None else None
            if c is None or c.device != s.device or len(c.copies) != 1:
                continue
            with c._lock:
                if c.staged is not None:  # staged at an earlier unpack: within the distance
                    staged += 1
                    nbytes += c.nbytes
                    continue
                if c._cached is not None:
                    continue
                if c.copies[0].source() is not None or not c.copies[0].done():
                    continue
                view = c.entry.try_get()
                if view is None:
                    break  # still on disk or in flight: the tier's read-ahead owns it
                c.staged = tr.to_device(block_tensor(view), wait=False)
            staged += 1
            nbytes += c.nbytes

