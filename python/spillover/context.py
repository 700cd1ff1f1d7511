"""``offload_context``: saved activations leave device memory during forward and come back for
backward, through ``torch.autograd.graph.saved_tensors_hooks``.

Who owns what
    The Rust tier (``spillover._native.Tier``, rust/tier) owns every offloaded block: where its
    bytes are (pool, disk, in flight), write-behind, eviction and read-ahead. The transfer layer
    (transfer.py) owns the device<->host copies: which stream copies what, how many bytes of
    copies may be in flight, when a copy's source is released. This module owns the torch
    semantics between them: which saved tensors are offloaded, one storage however many views
    of it are saved, version checks, and rebuilding the exact view on unpack.

What pack and unpack promise
    pack(t) returns either ``t`` itself (kept: small, a parameter or buffer, marked with
    :func:`keep`, an unsupported layout, or the pool is full) or a handle to the bytes of
    ``t``'s *storage*, copied once into a host block however many views of it are saved.
    unpack(handle) returns a tensor with the exact dtype, size, stride and storage offset that
    was saved, on the original device, bitwise equal to it. Unpack may run any number of
    times (``retain_graph=True``), on any thread, after the ``with`` block has ended.

What is freed when
    A tier entry belongs to the handles autograd holds; when autograd frees the last of them
    (after the backward that used it, or when an abandoned graph is collected) the entry is
    freed wherever it is (pool, disk, or a request in flight, which finishes first). A tensor
    returned by unpack on a CPU host views its block, and the block stays where it is while
    that tensor lives (Note [views hold blocks] in rust/tier/mod.rs). The device copies'
    sources are released when the copy is done, when the bytes in flight pass the cap, at every
    unpack and at the end of backward (Note [back-pressure] in transfer.py): nothing the step
    offloaded stays on the device after ``backward()``.

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
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _runtime, _tiers
from .config import Config
from .errors import ConfigError, IntegrityError, PoolExhaustedError
from .stats import OffloadStats
from .transfer import block_tensor, transfers_for

__all__ = ["offload_context", "OffloadContext", "keep", "current_context"]

try:  # torch >= 2.0
    from torch.multiprocessing.reductions import StorageWeakRef as _StorageWeakRef
except ImportError:  # pragma: no cover
    _StorageWeakRef = None  # type: ignore[assignment,misc]

_tls = threading.local()

#: H2D staging distance (CUDA and the simulated device): entries and bytes ahead of unpack.
STAGE_AHEAD_ENTRIES = 4
STAGE_AHEAD_BYTES = 512 << 20


def _active() -> List[OffloadContext]:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def current_context() -> Optional[OffloadContext]:
    """The innermost ``offload_context`` active on this thread, or None."""
    stack = _active()
    return stack[-1] if stack else None


def keep(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor``'s storage to stay where it is in the innermost active context of this
    thread (e.g. a tensor backward needs first). Returns ``tensor``. No-op outside a context."""
    stack = _active()
    if stack:
        stack[-1].keep(tensor)
    return tensor


# ---- module hook: learn parameter and buffer storages of the modules a context runs ----------

_hook_lock = threading.Lock()
_hook_users = 0
_hook_handle: Any = None


@torch._dynamo.disable  # type: ignore[misc]
def _module_pre_hook(module: torch.nn.Module, args: Any) -> None:
    stack = getattr(_tls, "stack", None)
    if stack:
        stack[-1]._note_module(module)


def _hook_acquire() -> None:
    global _hook_users, _hook_handle
    with _hook_lock:
        _hook_users += 1
        if _hook_handle is None:
            _hook_handle = torch.nn.modules.module.register_module_forward_pre_hook(
                _module_pre_hook
            )


def _hook_release() -> None:
    global _hook_users, _hook_handle
    with _hook_lock:
        _hook_users -= 1
        if _hook_users == 0 and _hook_handle is not None:
            _hook_handle.remove()
            _hook_handle = None


def _capturing() -> bool:
    """Under CUDA graph capture nothing may be queried or copied out: pack passes through."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---- what pack returns ------------------------------------------------------------------------


class _Stored:
    """One offloaded storage: its tier entry (a ``Handle``, or a ``Gathered`` of pieces) and the
    device->host copies that fill it."""

    __slots__ = ("entry", "nbytes", "device", "copies", "seq", "views", "staged", "_lock",
                 "_cached", "_cached_uses", "__weakref__")

    def __init__(self, entry: Any, nbytes: int, device: torch.device, copies: List[Any],
                 seq: int):
        self.entry = entry
        self.nbytes = nbytes
        self.device = device
        self.copies = copies
        self.seq = seq  # the tier's pack order (the last piece's, for a gathered storage)
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


class _Packed:
    __slots__ = ("stored", "dtype", "size", "stride", "offset", "version", "tref", "__weakref__")

    def __init__(self, stored: _Stored, t: torch.Tensor):
        self.stored = stored
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = t._version
        self.tref = weakref.ref(t)  # Note [in-place after pack] in transfer.py
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


# ---- the context ------------------------------------------------------------------------------


class OffloadContext:
    """The object ``offload_context`` returns; use it as a context manager.

    ``stats()`` reports what was packed and where it went. The context may be entered once; its
    handles stay valid after exit, so backward can run outside the ``with`` block.
    """

    def __init__(self, tier: Optional[str] = None, **overrides: Any):
        self.config = Config.load(tier=tier, **overrides)
        _runtime.configure_logging(self.config)
        self.tier = self._resolve_tier(self.config.tier)
        self._stats = OffloadStats()
        self._pool: Any = None
        self._tier: Any = None
        self._step: Any = None
        self._hooks: Any = None
        self._entered = False
        self._dedup: Dict[Tuple[str, int, int], Tuple[Any, Any]] = {}
        self._param_ptrs: set = set()
        self._marked_ptrs: set = set()
        self._seen_modules: set = set()
        self._pool_ranges: List[Tuple[int, int]] = []
        self._pool_starts: List[int] = []
        self._transfers: Dict[Any, Any] = {}
        self._transfer_base: Dict[Any, Dict[str, float]] = {}
        self._by_seq: Dict[int, Any] = {}  # tier seq -> weakref(_Stored), for H2D staging
        self._chunk_above = 0
        self._chunk_bytes = 0
        self._in_backward = False
        self._lock = threading.Lock()

    @staticmethod
    def _resolve_tier(tier: str) -> str:
        if tier not in ("host", "nvme", "auto"):
            raise ConfigError(f"tier={tier!r}: expected host, nvme or auto")
        return tier

    @property
    def nvme(self) -> bool:
        """Whether this context spills to swap files (tier nvme, or auto with a swap open)."""
        return self._tier is not None and self._tier.has_swap

    # -- context manager --

    def __enter__(self) -> OffloadContext:
        if self._entered:
            raise RuntimeError("an offload_context can be entered once; make a new one per step")
        self._entered = True
        self._pool = _runtime.host_pool(self.config)
        if torch.cuda.is_available():
            _runtime.register_with_cuda(self._pool)
        self._pool_ranges = sorted(_runtime.pool_ranges())
        self._pool_starts = [a for a, _ in self._pool_ranges]
        self._stats.pool_capacity = self._pool.capacity
        self._tier = self._open_tier()
        self._step = self._tier.begin_step()
        if self.nvme:
            self._chunk_above, self._chunk_bytes = _tiers.chunk_sizes(self._pool.capacity)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _active().append(self)
        _hook_acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        _hook_release()
        stack = _active()
        if stack and stack[-1] is self:
            stack.pop()
        elif self in stack:
            stack.remove(self)
        self._hooks.__exit__(*exc)
        self._dedup.clear()
        for tr in self._transfers.values():
            tr.reap()  # copies done by now release their sources at once

    def _open_tier(self) -> Any:
        if self.tier == "host":
            return _tiers.tier_for(self.config, self._pool, nvme=False)
        try:
            return _tiers.tier_for(self.config, self._pool, nvme=True)
        except Exception as e:
            if self.tier == "nvme":
                raise
            _runtime.warn_once(
                "auto-no-nvme",
                f"spillover: tier='auto' runs host-only: the NVMe tier could not open ({e})",
            )
            self.tier = "host"
            return _tiers.tier_for(self.config, self._pool, nvme=False)

    # -- user API --

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keep ``tensor``'s storage in place when it is saved in this context."""
        self._marked_ptrs.add(self._storage_key(tensor))
        return tensor

    def stats(self) -> OffloadStats:
        """A snapshot of the counters (a copy; later steps do not change it)."""
        s = self._stats
        with s._lock:
            out = OffloadStats(**{k: v for k, v in s.as_dict().items() if hasattr(s, k)
                                  and k not in ("bytes_kept", "bytes_offloaded")})
        if self._step is not None:
            st = self._step.stats()
            out.bytes_offloaded_nvme = st["bytes_written"]
            out.bytes_offloaded_host = st["bytes_put"] - st["bytes_written"]
            out.prefetch_hits = st["prefetch_hits"]
            out.prefetch_misses = st["prefetch_misses"]
            out.host_cache_hits = st["host_cache_hits"]
            out.overflow_reads = st["overflow_reads"]
            out.stall_seconds += st["stall_seconds"]
            ts = self._tier.stats()
            out.pool_in_use = ts["pool_in_use"]
            out.swap_in_use = ts["swap_in_use"]
            out.pool_peak = ts["pool_peak"]
        for dev, tr in self._transfers.items():
            base = self._transfer_base.get(dev, {})
            out.stall_seconds += tr.stall_seconds - base.get("stall_seconds", 0.0)
            out.copy_waits_forced += tr.forced_waits - int(base.get("forced_waits", 0))
            out.bytes_in_flight_peak = max(out.bytes_in_flight_peak, tr.peak_bytes_in_flight)
        return out

    def pack(self, tensor: torch.Tensor) -> Any:
        """Offload ``tensor`` as this context's saved-tensor hook would; returns a handle for
        :meth:`unpack` (or the tensor itself when it is kept). For wrappers that save tensors
        outside autograd's hooks, e.g. selective checkpointing's cached op outputs."""
        return self._pack(tensor)

    def unpack(self, handle: Any) -> torch.Tensor:
        """The tensor :meth:`pack` was given, bitwise, on its original device."""
        return self._unpack(handle)

    def synchronize(self) -> None:
        """Wait for every copy this context's devices have in flight and every write or read
        of the tier (tests, measurements). Raises the first I/O error one of them hit."""
        for tr in self._transfers.values():
            tr.synchronize()
        if self._tier is not None:
            self._tier.wait_idle()

    # -- internals --

    @staticmethod
    def _storage_key(t: torch.Tensor) -> Tuple[str, int, int]:
        return (t.device.type, t.device.index or 0, t.untyped_storage().data_ptr())

    def _note_module(self, module: torch.nn.Module) -> None:
        mid = id(module)
        if mid in self._seen_modules:
            return
        self._seen_modules.add(mid)
        for p in module._parameters.values():
            if p is not None:
                self._param_ptrs.add(self._storage_key(p))
        for b in module._buffers.values():
            if b is not None:
                self._param_ptrs.add(self._storage_key(b))

    def _in_pool(self, addr: int) -> bool:
        i = bisect.bisect_right(self._pool_starts, addr) - 1
        return i >= 0 and addr < self._pool_ranges[i][1]

    def _is_param(self, t: torch.Tensor, key: Tuple[str, int, int]) -> bool:
        if isinstance(t, torch.nn.Parameter):
            return True
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return True
        return key in self._param_ptrs

    def _transfer(self, device: torch.device) -> Any:
        tr = self._transfers.get(device)
        if tr is None:
            tr = transfers_for(device, sim_bandwidth=self.config.sim_link_bandwidth,
                               cap_bytes=self.config.copy_inflight_bytes)
            self._transfers[device] = tr
            self._transfer_base[device] = {"stall_seconds": tr.stall_seconds,
                                           "forced_waits": tr.forced_waits}
        return tr

    @torch._dynamo.disable  # type: ignore[misc]
    def _pack(self, t: torch.Tensor) -> Any:
        stats = self._stats
        if (
            t.layout != torch.strided
            or t.device.type not in ("cpu", "cuda")
            or (type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter))
            or t.is_quantized
        ):
            stats.add(tensors_packed=1, bytes_kept_unsupported=t.numel() * t.element_size())
            return t
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        stats.add(tensors_packed=1, bytes_packed=nbytes)
        if nbytes < self.config.min_offload_bytes or nbytes == 0:
            stats.add(bytes_kept_small=nbytes)
            return t
        if t.device.type == "cuda" and _capturing():
            stats.add(bytes_kept_unsupported=nbytes)
            return t
        key = (t.device.type, t.device.index or 0, storage.data_ptr())
        if self._is_param(t, key):
            stats.add(bytes_kept_parameter=nbytes)
            return t
        if key in self._marked_ptrs:
            stats.add(bytes_kept_marked=nbytes)
            return t
        if t.device.type == "cpu" and self._in_pool(key[2]):
            # Already a view of a pool block (e.g. an unpacked tensor saved again).
            stats.add(bytes_kept_unsupported=nbytes)
            return t
        hit = self._dedup.get(key)
        if hit is not None:
            stored = hit[0]()
            if stored is not None and (hit[1] is None or not hit[1].expired()):
                stats.add(storages_deduplicated=1, bytes_deduplicated=nbytes)
                return _Packed(stored, t)
        tr = self._transfer(t.device)
        tr.reap()
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        if self._chunk_above and nbytes > self._chunk_above:
            stored = self._pack_pieces(tr, src, t, nbytes)
        else:
            stored = self._pack_whole(tr, src, t, nbytes)
        if stored is None:
            stats.add(bytes_kept_pool_full=nbytes)
            return t
        wref = _StorageWeakRef(storage) if _StorageWeakRef is not None else None
        self._dedup[key] = (weakref.ref(stored), wref)
        stats.add(tensors_offloaded=1)
        if not tr.host_is_device:  # only a device's H2D copies are staged ahead
            self._by_seq[stored.seq] = weakref.ref(stored)
        return _Packed(stored, t)

    def _put(self, tr: Any, nbytes: int) -> Tuple[Any, Any]:
        """A staged tier entry of ``nbytes``. When every block is staged or viewed, the copies
        in flight are waited for (their entries become evictable) and the lease tried again;
        PoolExhaustedError when that frees nothing."""
        try:
            return self._step.put(nbytes)
        except PoolExhaustedError:
            if not tr.bytes_in_flight:
                raise
        t0 = time.perf_counter()
        tr.synchronize()
        self._stats.add(stall_seconds=time.perf_counter() - t0)
        return self._step.put(nbytes)

    def _pack_whole(self, tr: Any, src: torch.Tensor, t: torch.Tensor,
                    nbytes: int) -> Optional[_Stored]:
        try:
            handle, view = self._put(tr, nbytes)
        except PoolExhaustedError:
            return None
        copy = tr.to_host(src, block_tensor(view), watch=t, on_landed=handle.seal)
        return _Stored(handle, nbytes, t.device, [copy], handle.seq)

    def _pack_pieces(self, tr: Any, src: torch.Tensor, t: torch.Tensor,
                     nbytes: int) -> Optional[_Stored]:
        """Note [gathered storages] (rust/tier/gather.rs): a storage larger than half the pool
        goes in pieces, each an entry of its own, written out as the pool fills."""
        handles, copies = [], []
        try:
            for off in range(0, nbytes, self._chunk_bytes):
                n = min(self._chunk_bytes, nbytes - off)
                handle, view = self._put(tr, n)
                copies.append(tr.to_host(src[off : off + n], block_tensor(view), watch=t,
                                         on_landed=handle.seal))
                handles.append(handle)
        except PoolExhaustedError:
            # The pieces go as their copies land (a staging view keeps its block until then).
            return None
        self._stats.add(tensors_chunked=1)
        return _Stored(self._step.gather(handles), nbytes, t.device, copies, handles[-1].seq)

    @torch._dynamo.disable  # type: ignore[misc]
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        s = packed.stored
        self._note_backward()
        raw = self._materialize(s, packed)
        packed.check_version()
        out = torch.empty(0, dtype=packed.dtype, device=s.device)
        out.set_(raw.untyped_storage(), packed.offset, packed.size, packed.stride)
        self._stats.add(tensors_unpacked=1, bytes_unpacked=s.nbytes)
        return out

    def _note_backward(self) -> None:
        """At the first unpack of a backward: run :meth:`_end_of_backward` when it ends."""
        node = getattr(torch._C, "_current_autograd_node", None)
        if node is not None and node() is None:
            return  # unpacked outside a backward (e.g. a saved tensor read directly)
        with self._lock:
            if self._in_backward:
                return
            self._in_backward = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        except RuntimeError:  # unpacked outside a backward (e.g. a saved tensor read directly)
            with self._lock:
                self._in_backward = False

    def _end_of_backward(self) -> None:
        with self._lock:
            self._in_backward = False
        for tr in self._transfers.values():
            tr.end_of_backward()

    def _materialize(self, s: _Stored, packed: _Packed) -> torch.Tensor:
        """The storage's bytes as a uint8 tensor on its device."""
        tr = self._transfer(s.device)
        src = s.source()
        tr.release_sources()
        if src is not None:  # Note [source returned]
            self._stats.add(unpacks_from_source=1)
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
            if s.views > 1 and (not tr.host_is_device or len(s.copies) > 1):
                # Note [views share one return]
                s._cached, s._cached_uses = raw, 1
        self._stage_ahead(tr, s)
        return raw

    def _bring_back(self, tr: Any, s: _Stored, packed: _Packed) -> torch.Tensor:
        t0 = time.perf_counter()
        for c in s.copies:  # the tier can give the bytes back only once they have landed
            c.wait()
        self._stats.add(stall_seconds=time.perf_counter() - t0)
        try:
            view = s.entry.get()
        except IntegrityError as e:
            where = "nvme" if self.nvme else "host"
            raise IntegrityError(
                f"a saved tensor of shape {list(packed.size)} and dtype {packed.dtype} read "
                f"back from the {where} tier does not match its checksum ({e})"
            ) from None
        if len(s.copies) == 1 and not self._in_pool(view.address):
            _runtime.warn_once(
                "pool-overflow",
                f"spillover: the {self._pool.capacity >> 20} MiB host pool had no room to read "
                f"back a {s.nbytes >> 20} MiB tensor; used a temporary buffer (slower). Raise "
                "SPILLOVER_HOST_POOL_BYTES to a few times the largest saved tensor.",
            )
        raw, _ = tr.to_device(block_tensor(view))
        return raw

    def _stage_ahead(self, tr: Any, s: _Stored) -> None:
        """Start the H2D copies of the next entries backward is expected to unpack, a bounded
        distance ahead, from blocks already in the pool (the tier reads the rest ahead)."""
        if tr.host_is_device:
            return
        staged, nbytes = 0, 0
        for seq in self._step.expected_after(s.seq, 4 * STAGE_AHEAD_ENTRIES):
            if staged >= STAGE_AHEAD_ENTRIES or nbytes >= STAGE_AHEAD_BYTES:
                break
            ref = self._by_seq.get(seq)
            c = ref() if ref is not None else None
            if c is None or c.device != s.device or len(c.copies) != 1:
                continue
            with c._lock:
                if c.staged is not None or c._cached is not None:
                    continue
                if c.copies[0].source() is not None or not c.copies[0].done():
                    continue
                view = c.entry.try_get()
                if view is None:
                    break  # still on disk or in flight: the tier's read-ahead owns it
                c.staged = tr.to_device(block_tensor(view), wait=False)
            staged += 1
            nbytes += c.nbytes


def offload_context(tier: Optional[str] = None, **overrides: Any) -> OffloadContext:
    """Offload the activations autograd saves inside the ``with`` block.

    Args:
        tier: ``"host"`` (pinned host pool), ``"nvme"`` or ``"auto"``; default SPILLOVER_TIER.
        **overrides: any knob of :class:`spillover.Config` (``host_pool_bytes``,
            ``min_offload_bytes``, ``verify``, ``copy_inflight_bytes``, ...), overriding its
            SPILLOVER_* variable.

    Raises:
        ConfigError: a bad value, or a SPILLOVER_* variable spillover does not know.

    Example::

        with spillover.offload_context(tier="host") as ctx:
            loss = model(batch).loss
        loss.backward()
        print(ctx.stats())
    """
    return OffloadContext(tier=tier, **overrides)
