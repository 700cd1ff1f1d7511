"""The saved-tensor hooks of ``offload_context``: the torch semantics between autograd and the
tier -- which saved tensors are offloaded, one storage however many views of it are saved,
version checks, and rebuilding the exact view on unpack. The bytes go through the link of the
tensor's device (activations/link) into the Rust tier; unpack is in unpack.py, what pack
returns in stored.py.

What pack and unpack promise
    pack(t) returns either ``t`` itself (kept: small, a parameter or buffer, marked with
    :func:`keep`, an unsupported layout, or the pool is full) or a handle to the bytes of
    ``t``'s *storage*, copied once into a host block however many views of it are saved.
    unpack(handle) returns a tensor with the exact dtype, size, stride and storage offset that
    was saved, on the original device, bitwise equal to it. Unpack may run any number of
    times (``retain_graph=True``), on any thread, after the ``with`` block has ended.

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

Note [the smallest offload on a device]
    A saved tensor costs the host the same time to offload whatever its size (Note [host cost in
    the plan] in planner/cost.py); below the bytes the link moves in that time, offloading it
    costs more than it frees room for. On CUDA, unless ``min_offload_bytes`` was set, tensors
    smaller than max(1 MiB, link rate x host seconds per offload) -- both from the cached
    calibration -- stay on the device (about 1.5 MB at 50 GB/s and 30 us).

Note [kept by a policy]
    ``spillover.wrap``/``checkpoint`` regions hold some saved tensors themselves, out of
    autograd's hooks: op outputs their policy keeps (policy="auto"'s plan, a callable's "keep",
    ops with side effects), and everything a "plain-keep" region saves. That is device memory
    the step holds all the same, so the regions hand each to :meth:`OffloadContext.kept`
    (recompute/modes.py, recompute/policies.py): counted as saved and kept, "policy" in
    ``report()`` (parameters, buffers and small tensors under their own reasons). A storage a
    policy holds is not offloaded when autograd saves it again in the same forward (the copy
    would free nothing on the device): that counts as a deduplicated view.

Note [survivors of a pack]
    What a pack leaves alive until backward are objects Python's collector tracks, and every
    one alive at a collection of the middle generation is promoted to the oldest, whose
    collection scans every tracked object of the process (torch alone makes ~330,000 of them:
    0.13 s a collection on this 2-core machine). CPython collects the oldest generation once
    the promoted objects pass a quarter of those already there, so its pauses come at a rate
    proportional to the objects each pack leaves. Medians of rounds hide them
    (``benches/python/link_cost.py --gc-steps``). A pack left 10.3 on the host link (the
    node's Python object, made by reading ``grad_fn`` for the autocast-cast check; a lock
    per stored storage; the saved size as a ``torch.Size``, which the collector never untracks;
    the dedup table's tuple, its ``StorageWeakRef`` and that one's bound method) and 12.0 on
    the simulated device's: over 300 steps of 400 packs, 3 and 6 full collections, 4.4 and 7.3
    us of each tensor's host time. Now ``grad_fn`` is read only for tensors of a parameter's
    size, the lock is the step's, the size a tuple of ints, and the stored storage keeps
    torch's own weak reference (an int) itself: 3.1 and 6.0 left, 0 and 2 full collections, 0.1
    and 2.3 us. torch's ``save_on_cpu`` leaves 2.2 (its tuple and the host tensor).
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import PoolExhaustedError
from .link import link_for
from .rederive import REDERIVE_MIN_BYTES, Remade, remade
from .registry import StepRecord, StorageWeakRef, capturing, is_param
from .stored import Packed, Stored
from .unpack import Unpack

__all__ = ["Hooks", "Packed", "Stored"]


class Hooks(Unpack):
    """pack and unpack, a mixin of :class:`~.context.OffloadContext`, which owns the steps and
    the pools they use."""

    if TYPE_CHECKING:  # what pack reads of the context, beyond what Unpack declares
        _transfer_base: Dict[Any, Tuple[float, int]]
        _pool_starts: List[int]
        _pool_ranges: List[Tuple[int, int]]
        _chunk_above: int
        _chunk_bytes: int
        _grow_lock: threading.Lock
        _pools: Any

        @property
        def _tier(self) -> Any: ...

        def _current(self) -> StepRecord: ...

        def _grown(self) -> None: ...

    _min_cuda: Optional[int] = None  # Note [the smallest offload on a device], once computed

    def _in_pool(self, addr: int) -> bool:
        i = bisect.bisect_right(self._pool_starts, addr) - 1
        return i >= 0 and addr < self._pool_ranges[i][1]

    def _transfer(self, device: torch.device) -> Any:
        """The link of ``device`` (activations/link): the host link, or a device link."""
        tr = self._transfers.get(device)
        if tr is None:
            cfg = self.config
            tr = link_for(device, sim_bandwidth=cfg.sim_link_bandwidth,
                          cap_bytes=cfg.copy_inflight_bytes, sim_lag=cfg.sim_compute_lag,
                          sim_call_cost=cfg.sim_call_cost)
            with self._lock:
                self._transfer_base[device] = (tr.stall_seconds, tr.forced_waits)
                self._transfers[device] = tr
        return tr

    def _min_bytes(self, kind: str) -> int:
        """Note [the smallest offload on a device]: ``min_offload_bytes``, or on CUDA when it
        was not set, at least the bytes the link moves in the host time one offload costs."""
        cfg = self.config
        if kind != "cuda" or cfg.sources.get("min_offload_bytes", "default") != "default":
            return cfg.min_offload_bytes
        cached = self._min_cuda
        if cached is None:
            cached = cfg.min_offload_bytes
            try:
                from .. import calibrate

                cal = calibrate.load(cfg) or {}
                dev = cal.get("devices", {}).get(f"cuda:{torch.cuda.current_device()}") or {}
                rate = min(dev.get("d2h_bytes_per_s") or 0, dev.get("h2d_bytes_per_s") or 0)
                cached = max(cached, int(rate * float(dev.get("host_seconds_per_offload") or 0)))
            except Exception:  # noqa: BLE001 -- no calibration: the configured default
                pass
            self._min_cuda = cached
        return cached

    @torch._dynamo.disable  # type: ignore[misc]
    def _pack(self, t: torch.Tensor, offload: bool = True, remake: bool = False) -> Any:
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
        key = (kind, device.index or 0, storage.data_ptr())
        why = self._kept_why(rec, t, storage, nbytes, key, offload)
        if (remake and why == "bytes_kept_policy" and nbytes >= REDERIVE_MIN_BYTES
                and self.config.rederive):
            made = self._rederive(rec, t, key, nbytes)  # Note [made again at unpack]
            if made is not None:
                rec.kept.pop(key, None)  # not held after all
                return made
        if why is not None:
            if type(why) is Packed:  # a view of a storage this step offloaded already
                stats.add(tensors_packed=1, bytes_packed=nbytes, storages_deduplicated=1,
                          bytes_deduplicated=nbytes)
                return why
            counts = {why: nbytes}
            if why == "bytes_deduplicated":  # a storage a policy holds (Note [kept by a policy])
                counts["storages_deduplicated"] = 1
            stats.add(tensors_packed=1, bytes_packed=nbytes, **counts)
            return t
        if nbytes >= REDERIVE_MIN_BYTES and self.config.rederive:
            made = self._rederive(rec, t, key, nbytes)  # Note [made again at unpack]
            if made is not None:
                return made
        pieces = bool(self._chunk_above) and nbytes > self._chunk_above
        if pieces and rec.tier.defers_writes:
            # Note [writes wait for growth] (rust/tier/room.rs): pieces are one tier step's,
            # so a pool that may grow grows before them, not between them
            self._grow(rec, nbytes)
        tr = self._transfer(device)
        on_host = tr.host_is_device
        if on_host:  # Note [host link]: one call into the tier, no copy in flight
            stored = self._pack_host(rec, storage, t, nbytes)
        else:
            tr.reap(rec.errors, nbytes)
            if pieces:
                stored = self._pack_pieces(rec, tr, storage, t, nbytes)
            else:
                stored = self._pack_whole(rec, tr, storage, t, nbytes)
        if stored is None:
            stats.add(tensors_packed=1, bytes_packed=nbytes, bytes_kept_pool_full=nbytes)
            return t
        # a weak reference to the source storage (Note [storage identity] in stored.py)
        stored.src_weak, stored.src_version = storage._weak_ref(), t._version
        ref = weakref.ref(stored)
        rec.dedup[key] = ref
        rec.stored.add(ref)
        rec.packs += nbytes
        if rec.packs * 8 >= rec.stats.pool_capacity:  # Note [growth off the critical path]
            rec.packs = 0
            self._pools.maybe_prepare()
        rec.devices.add(device)
        if on_host:
            stats.count_offload(nbytes)
        else:  # only a device's H2D copies are staged ahead
            stats.count_offload(nbytes, tr.bytes_in_flight)
            rec.by_seq[stored.seq] = ref
        return Packed(stored, t)

    def _rederive(self, rec: StepRecord, t: torch.Tensor, key: Tuple[str, int, int],
                  nbytes: int) -> Optional[Remade]:
        """Note [made again at unpack] in rederive.py: the handle that makes ``t`` again at
        unpack, or None where it is to be shipped."""
        made, first = remade(rec.rederived, key, t, rec, nbytes)
        if made is not None:
            if first:
                rec.stats.add(tensors_packed=1, bytes_packed=nbytes, tensors_rederived=1,
                              bytes_rederived=nbytes)
            else:  # another save of the same storage
                rec.stats.add(tensors_packed=1, bytes_packed=nbytes, storages_deduplicated=1,
                              bytes_deduplicated=nbytes)
        return made

    def _kept_why(self, rec: StepRecord, t: torch.Tensor, storage: Any, nbytes: int,
                  key: Tuple[str, int, int], offload: bool) -> Any:
        """Why ``t`` is not offloaded: the stats field its bytes count in, or the handle of the
        storage this step already offloaded that it views; None when it is to be offloaded."""
        kind = key[0]
        if nbytes < self._min_bytes(kind) or nbytes == 0:
            return "bytes_kept_small"
        if kind == "cuda" and capturing(t.device):
            return "bytes_kept_unsupported"
        if is_param(rec, t, storage):
            return "bytes_kept_parameter"
        if key in rec.marked:
            return "bytes_kept_marked"
        held = rec.kept.get(key)  # Note [kept by a policy]
        if held is not None and held.cdata == storage._cdata and not held.expired():
            return "bytes_deduplicated"
        if not offload:
            rec.kept[key] = StorageWeakRef(storage)
            return "bytes_kept_policy"
        if kind == "cpu" and not self.config.sim_link_bandwidth and self._in_pool(key[2]):
            # Already a view of a pool block (e.g. an unpacked tensor saved again); not on the
            # simulated device, whose unpacks are new tensors, as a GPU's are
            return "bytes_kept_unsupported"
        hit = rec.dedup.get(key)
        if hit is not None:
            stored = hit()
            # the same live storage, not written since (a view shares its base's version
            # counter): a storage written in place after its pack is packed again
            if (stored is not None and stored.source_alive()
                    and t._version == stored.src_version):
                return Packed(stored, t)
        if rec.keep_rest:  # Note [the tail stays] in planner/search.py
            rec.kept[key] = StorageWeakRef(storage)
            return "bytes_kept_policy"
        return None

    def _put(self, rec: StepRecord, tr: Any, storage: Any, t: torch.Tensor, nbytes: int,
             offset: int = 0, grow: bool = True) -> Tuple[Any, Any]:
        """A tier entry of ``nbytes`` from ``storage`` at ``offset``, its copy started: one
        call into the device link. When every block is staged or viewed, the copies in
        flight are waited for (their entries become evictable) and the lease tried again;
        then (``grow``) a default pool grows (Note [growing pool] in _growth.py);
        PoolExhaustedError when none of that makes room."""
        what = ""
        if self.config.verify:  # Note [verify on the device]
            what = (f"a saved tensor of shape {list(t.shape)} and dtype {t.dtype} in step "
                    f"{rec.index} on the {self.tier} tier")
        try:  # the common case: no closure, no second frame
            return tr.pack(rec.step, storage, nbytes, offset=offset, watch=t, errors=rec.errors,
                           verify=what)
        except PoolExhaustedError as e:
            full = e

        def put() -> Tuple[Any, Any]:
            return tr.pack(rec.step, storage, nbytes, offset=offset, watch=t, errors=rec.errors,
                           verify=what)

        return self._put_again(rec, tr, nbytes, grow, put, full)

    def _put_again(self, rec: StepRecord, tr: Any, nbytes: int, grow: bool,
                   put: Callable[[], Tuple[Any, Any]],
                   full: PoolExhaustedError) -> Tuple[Any, Any]:
        """:meth:`_put` after ``put`` found the pool full (``full``): wait for the copies in
        flight, grow, or raise ``full``."""
        if rec.pool_full:  # found full after waiting: waiting again frees nothing
            raise full
        if not tr.bytes_in_flight and not self._room_for(rec, nbytes, grow):
            self._full(rec)
            raise full
        if tr.bytes_in_flight:
            t0 = time.perf_counter()
            tr.synchronize(rec.errors)
            rec.stats.add(stall_seconds=time.perf_counter() - t0)
            try:
                return put()
            except PoolExhaustedError:
                if not self._room_for(rec, nbytes, grow):
                    self._full(rec)
                    raise
        return put()

    @staticmethod
    def _full(rec: StepRecord) -> None:
        """A pool without swap that is full once its copies landed stays full for the step (its
        entries are freed only by a backward): later packs keep their tensors without waiting
        for the device again. With swap, write-behind makes room: those packs still wait."""
        if not rec.tier.has_swap:
            rec.pool_full = True

    def _room_for(self, rec: StepRecord, nbytes: int, grow: bool = True) -> bool:
        """A put of ``nbytes`` found the pool full: grow it (``grow``); else, where its tier
        deferred writes for a growth (Note [writes wait for growth] in rust/tier/room.rs), let
        it write from now on. False: no room can be made."""
        if grow and self._grow(rec, nbytes):
            return True
        tier = rec.tier
        if tier.has_swap and tier.defers_writes:
            tier.defer_writes(False)
            return True
        return False

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
            if not self._room_for(rec, nbytes, grow):
                raise
        return rec.step.put_from(src, src.data_ptr() + offset, nbytes)

    def _put_direct(self, rec: StepRecord, storage: Any, addr: int, nbytes: int,
                    first: bool = True, grow: bool = True) -> Any:
        """Note [written from the tensor] (rust/tier/direct.rs): ``nbytes`` at ``addr`` of
        ``storage`` into the tier; a pool whose writes wait for its growth grows first."""
        try:
            return rec.step.put_direct(storage, addr, nbytes, first)
        except PoolExhaustedError:
            if not self._room_for(rec, nbytes, grow):
                raise
        return rec.step.put_direct(storage, addr, nbytes, first)

    def _pack_host(self, rec: StepRecord, storage: Any, t: torch.Tensor, nbytes: int
                   ) -> Optional[Stored]:
        """Note [host link]: the storage's bytes into the tier in one call per entry (pieces
        above the chunk size, Note [gathered storages] in rust/tier/gather.rs). On the NVMe
        tier a whole storage is written out from its own memory (Note [written from the
        tensor] in rust/tier/direct.rs)."""
        direct = rec.tier.has_swap and self.config.write_from_tensor
        if not (self._chunk_above and nbytes > self._chunk_above):
            try:
                if direct:
                    handle = self._put_direct(rec, storage, storage.data_ptr(), nbytes)
                else:
                    handle = self._put_from(rec, storage, 0, nbytes)
            except PoolExhaustedError:
                return None
            return Stored(rec, handle, nbytes, t.device, (), handle.seq)
        handles = []
        addr = storage.data_ptr()
        # written from the tensor, every piece after the first starts on a page
        off, n = 0, self._chunk_bytes - (addr % 4096 if direct else 0)
        try:
            while off < nbytes:
                n = min(n, nbytes - off)
                if direct:
                    handles.append(self._put_direct(rec, storage, addr + off, n, off == 0,
                                                    grow=False))
                else:
                    handles.append(self._put_from(rec, storage, off, n, grow=False))
                off, n = off + n, self._chunk_bytes
        except PoolExhaustedError:
            return None
        rec.stats.add(tensors_chunked=1)
        return Stored(rec, rec.step.gather(handles), nbytes, t.device, (), handles[-1].seq)

    def _pack_whole(self, rec: StepRecord, tr: Any, storage: Any, t: torch.Tensor,
                    nbytes: int) -> Optional[Stored]:
        try:
            handle, copy = self._put(rec, tr, storage, t, nbytes)
        except PoolExhaustedError:
            return None
        return Stored(rec, handle, nbytes, t.device, [copy], handle.seq)

    def _pack_pieces(self, rec: StepRecord, tr: Any, storage: Any, t: torch.Tensor,
                     nbytes: int) -> Optional[Stored]:
        """Note [gathered storages] (rust/tier/gather.rs): a storage larger than half the pool
        goes in pieces, each an entry of its own, written out as the pool fills."""
        handles, copies = [], []
        try:
            for off in range(0, nbytes, self._chunk_bytes):
                n = min(self._chunk_bytes, nbytes - off)
                handle, copy = self._put(rec, tr, storage, t, n, offset=off, grow=False)
                copies.append(copy)
                handles.append(handle)
        except PoolExhaustedError:
            # The pieces go as their copies land (the link holds their staging views).
            return None
        rec.stats.add(tensors_chunked=1)
        return Stored(rec, rec.step.gather(handles), nbytes, t.device, copies, handles[-1].seq)
