"""``offload_context``: saved activations leave device memory during forward and come back for
backward, through ``torch.autograd.graph.saved_tensors_hooks``.

What pack and unpack promise
    pack(t) returns either ``t`` itself (kept: small, a parameter or buffer, marked with
    :func:`keep`, an unsupported layout, or the pool is full) or a handle to the bytes of
    ``t``'s *storage*, copied once into a host block however many views of it are saved.
    unpack(handle) returns a tensor with the exact dtype, size, stride and storage offset that
    was saved, on the original device, bitwise equal to it. Unpack may run any number of
    times (``retain_graph=True``), on any thread, after the ``with`` block has ended.

What is freed when
    A host block belongs to the handles that refer to it; when autograd frees the last of them
    (after the backward that used it, or when an abandoned graph is collected), the block goes
    back to the pool. A block also stays while a tensor returned by unpack still views it.

Note [chunked storages]
    On the NVMe tier a storage larger than half the pool is offloaded in pieces of at most an
    eighth of the pool, each an entry of the store of its own (written out, read back and
    prefetched like any other), so that one tensor larger than the whole pool still leaves the
    device. Unpack assembles the pieces into a fresh tensor; on CPU the pieces on disk are
    read straight into it (Note [chunked read-ahead] in store.py), those still in the pool
    copied (a copy the whole-block path does not make on CPU, where an unpacked tensor is a
    view of its block). The host tier keeps a
    storage larger than half the pool where it is: every piece would have to stay in the pool
    at once.

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

from . import _runtime
from .config import Config
from .errors import ConfigError, IntegrityError, PoolExhaustedError
from .stats import OffloadStats
from .transfer import backend_for, block_tensor

__all__ = ["offload_context", "OffloadContext", "keep", "current_context"]

try:  # torch >= 2.0
    from torch.multiprocessing.reductions import StorageWeakRef as _StorageWeakRef
except ImportError:  # pragma: no cover
    _StorageWeakRef = None  # type: ignore[assignment,misc]

_tls = threading.local()

#: H2D staging distance on CUDA: this many entries, at most this many bytes, ahead of unpack.
STAGE_AHEAD_ENTRIES = 2
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


# ---- what pack returns ------------------------------------------------------------------------


class _Entry:
    """One offloaded storage: its host block and the copy that fills it."""

    __slots__ = (
        "block",
        "nbytes",
        "device",
        "copy",
        "checksum",
        "handles",
        "_dev",
        "_dev_uses",
        "_dev_event",
        "seq",
        "_lock",
        "spill",
        "store",
        "verify",
        "chunk",
        "__weakref__",
    )

    def __init__(self, block: Any, nbytes: int, device: torch.device, copy: Any, verify: bool):
        self.block = block
        self.nbytes = nbytes
        self.device = device
        self.copy = copy
        self.checksum: Optional[int] = None
        self.handles = 0
        self._dev: Optional[torch.Tensor] = None
        self._dev_uses = 0
        self._dev_event: Any = None
        self.seq = -1
        self._lock = threading.Lock()
        self.spill: Any = None  # store.Spilled, on the NVMe tier
        self.store: Any = None
        self.verify = verify
        self.chunk: Any = None  # weakref of the _Chunked this entry is a piece of

    def __del__(self) -> None:
        if self.store is not None:
            self.store.release(self)


class _Packed:
    __slots__ = ("entry", "dtype", "size", "stride", "offset", "version", "tref", "__weakref__")

    def __init__(self, entry: _Entry, t: torch.Tensor):
        self.entry = entry
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = t._version
        self.tref = weakref.ref(t)  # Note [in-place after pack] in transfer.py
        entry.handles += 1

    def check_version(self) -> None:
        t = self.tref()
        if self.entry.copy.modified or (t is not None and t._version != self.version):
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a saved tensor of shape {list(self.size)} and dtype "
                f"{self.dtype} was changed after autograd saved it (spillover offloaded it; "
                "without spillover autograd raises the same error). Use an out-of-place op, or "
                "clone the tensor before modifying it."
            )


class _PartsCopy:
    """The pack copies of a chunked storage, seen as one (``modified`` when any part was)."""

    __slots__ = ("parts",)

    def __init__(self, parts: List[_Entry]):
        self.parts = parts

    @property
    def modified(self) -> bool:
        return any(p.copy.modified for p in self.parts)


class _Chunked:
    """One storage larger than half the NVMe tier's pool, offloaded as consecutive pieces
    (Note [chunked storages])."""

    __slots__ = ("parts", "nbytes", "device", "handles", "ahead", "__weakref__")

    def __init__(self, parts: List[_Entry], nbytes: int, device: torch.device):
        self.parts = parts
        self.nbytes = nbytes
        self.device = device
        self.handles = 0
        #: Note [chunked read-ahead] in store.py: the store.DirectRead under way, False where
        #: the pieces cannot take that path, None before it starts.
        self.ahead: Any = None
        for p in parts:
            p.chunk = weakref.ref(self)

    @property
    def copy(self) -> _PartsCopy:
        return _PartsCopy(self.parts)


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
        self._hooks: Any = None
        self._entered = False
        self._thread: Optional[int] = None
        self._dedup: Dict[Tuple[str, int, int], Tuple[Any, Any]] = {}
        self._param_ptrs: set = set()
        self._marked_ptrs: set = set()
        self._seen_modules: set = set()
        self._pool_ranges: List[Tuple[int, int]] = []
        self._pool_starts: List[int] = []
        self._backends: Dict[Any, Any] = {}
        self._store: Any = None
        self._by_seq: Dict[int, Any] = {}  # pack order -> weakref(entry), for H2D staging
        self._next_seq = 0

    @staticmethod
    def _resolve_tier(tier: str) -> str:
        if tier not in ("host", "nvme", "auto"):
            raise ConfigError(f"tier={tier!r}: expected host, nvme or auto")
        return tier

    # -- context manager --

    def __enter__(self) -> OffloadContext:
        if self._entered:
            raise RuntimeError("an offload_context can be entered once; make a new one per step")
        self._entered = True
        self._thread = threading.get_ident()
        self._pool = _runtime.host_pool(self.config)
        if torch.cuda.is_available():
            _runtime.register_with_cuda(self._pool)
        self._pool_ranges = sorted(_runtime.pool_ranges())
        self._pool_starts = [a for a, _ in self._pool_ranges]
        self._stats.pool_capacity = self._pool.capacity
        if self.tier in ("nvme", "auto"):
            self._store = self._open_store()
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
        for b in self._backends.values():
            b.reap()  # Note [source lifetime]: sources of copies done by now go at once
        self._update_pool_peak()

    def _open_store(self) -> Any:
        from . import store

        try:
            return store.StepStore(store.tier_for(self.config, self._pool), self._stats)
        except Exception as e:
            if self.tier == "nvme":
                raise
            _runtime.warn_once(
                "auto-no-nvme",
                f"spillover: tier='auto' runs host-only: the NVMe tier could not open ({e})",
            )
            self.tier = "host"
            return None

    # -- user API --

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keep ``tensor``'s storage in place when it is saved in this context."""
        self._marked_ptrs.add(self._storage_key(tensor))
        return tensor

    def stats(self) -> OffloadStats:
        """A snapshot of the counters (a copy; later steps do not change it)."""
        self._update_pool_peak()
        s = self._stats
        with s._lock:
            return OffloadStats(**{k: v for k, v in s.as_dict().items() if hasattr(s, k)
                                   and k not in ("bytes_kept", "bytes_offloaded")})

    def pack(self, tensor: torch.Tensor) -> Any:
        """Offload ``tensor`` as this context's saved-tensor hook would; returns a handle for
        :meth:`unpack` (or the tensor itself when it is kept). For wrappers that save tensors
        outside autograd's hooks, e.g. selective checkpointing's cached op outputs."""
        return self._pack(tensor)

    def unpack(self, handle: Any) -> torch.Tensor:
        """The tensor :meth:`pack` was given, bitwise, on its original device."""
        return self._unpack(handle)

    def synchronize(self) -> None:
        """Wait for every copy this process has in flight (for tests and measurements)."""
        for dev in list(self._backends):
            backend_for(dev).synchronize()

    # -- internals --

    def _update_pool_peak(self) -> None:
        if self._pool is not None:
            peak = self._pool.stats()["peak"]
            with self._stats._lock:
                self._stats.pool_peak = max(self._stats.pool_peak, peak)

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
            entry = hit[0]()
            if entry is not None and (hit[1] is None or not hit[1].expired()):
                stats.add(storages_deduplicated=1, bytes_deduplicated=nbytes)
                return _Packed(entry, t)
        if self._store is not None and nbytes > self._store.tier.chunk_above:
            return self._pack_chunked(t, storage, nbytes, key)
        try:
            block = self._store.lease(nbytes) if self._store else self._pool.lease(nbytes)
        except PoolExhaustedError:
            stats.add(bytes_kept_pool_full=nbytes)
            return t
        backend = self._backend(t.device)
        backend.reap()
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        entry = self._new_entry(backend, src, block, t)
        wref = _StorageWeakRef(storage) if _StorageWeakRef is not None else None
        self._dedup[key] = (weakref.ref(entry), wref)
        stats.add(tensors_offloaded=1, bytes_offloaded_host=nbytes)
        packed = _Packed(entry, t)
        if self._store is not None:
            entry.store = self._store
            self._store.add(entry)  # may start writing older entries out
        return packed

    def _new_entry(self, backend: Any, src: torch.Tensor, block: Any, t: torch.Tensor) -> _Entry:
        """Start copying ``src`` (bytes of ``t``'s storage) into ``block``; the entry for it."""
        copy = backend.to_host(src, block, watch=t)
        entry = _Entry(block, src.numel(), t.device, copy, self.config.verify)
        entry.seq = self._next_seq
        self._next_seq += 1
        if t.device.type == "cuda":
            self._by_seq[entry.seq] = weakref.ref(entry)
        if self.config.verify:
            copy.wait()
            entry.checksum = block.checksum()
        return entry

    def _pack_chunked(self, t: torch.Tensor, storage: Any, nbytes: int,
                      key: Tuple[str, int, int]) -> Any:
        """Note [chunked storages]: each piece is an entry of its own in the NVMe store."""
        stats = self._stats
        store = self._store
        backend = self._backend(t.device)
        backend.reap()
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        step = store.tier.chunk_bytes
        parts: List[_Entry] = []
        try:
            for off in range(0, nbytes, step):
                n = min(step, nbytes - off)
                block = store.lease(n)
                e = self._new_entry(backend, src[off : off + n], block, t)
                stats.add(bytes_offloaded_host=n)  # before the store may write it out
                e.store = store
                store.add(e)
                parts.append(e)
        except PoolExhaustedError:
            for e in parts:  # undo their counts; the pieces go back as they die
                if e.spill is not None and e.spill.went_to_disk:
                    stats.add(bytes_offloaded_nvme=-e.nbytes)
                else:
                    stats.add(bytes_offloaded_host=-e.nbytes)
            stats.add(bytes_kept_pool_full=nbytes)
            return t
        c = _Chunked(parts, nbytes, t.device)
        wref = _StorageWeakRef(storage) if _StorageWeakRef is not None else None
        self._dedup[key] = (weakref.ref(c), wref)
        stats.add(tensors_offloaded=1, tensors_chunked=1)
        return _Packed(c, t)

    def _backend(self, device: torch.device) -> Any:
        b = self._backends.get(device)
        if b is None:
            b = self._backends[device] = backend_for(device)
        return b

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        e = packed.entry
        if isinstance(e, _Chunked):
            raw = self._materialize_chunked(e, packed)
        else:
            raw = self._materialize(e, packed)
        packed.check_version()
        out = torch.empty(0, dtype=packed.dtype, device=e.device)
        out.set_(raw.untyped_storage(), packed.offset, packed.size, packed.stride)
        self._stats.add(tensors_unpacked=1, bytes_unpacked=e.nbytes)
        return out

    def _materialize_chunked(self, c: _Chunked, packed: _Packed) -> torch.Tensor:
        """The pieces' bytes, assembled into one fresh uint8 tensor on the device. Last piece
        first: on a first step the store expects reverse pack order and reads ahead so. On CPU
        the pieces on disk are read straight into that tensor (Note [chunked read-ahead] in
        store.py)."""
        direct = self._store.read_direct(c) if c.device.type == "cpu" else None
        if direct is not None:
            out = block_tensor(direct)
        else:
            out = torch.empty(c.nbytes, dtype=torch.uint8, device=c.device)
        offs = []
        off = 0
        for part in c.parts:
            offs.append(off)
            off += part.nbytes
        try:
            for i in range(len(c.parts) - 1, -1, -1):
                part, off = c.parts[i], offs[i]
                if direct is not None and direct.reads[i] is not None:
                    self._store.finish_direct(direct, i, part)
                    if self.config.verify:
                        self._check(part, direct.blocks[i], packed, "nvme")
                    continue
                raw = self._materialize(part, packed)
                out[off : off + part.nbytes].copy_(raw)
                del raw  # the piece's block is evictable again (Note [clean entries])
        finally:
            if direct is not None:
                self._store.direct_done(c)
        return out

    def _materialize(self, e: _Entry, packed: _Packed) -> torch.Tensor:
        """The entry's bytes as a uint8 tensor on its device."""
        with e._lock:
            if e._dev is not None:
                raw = e._dev
                if e._dev_event is not None:  # staged ahead: Note [stream ordering]
                    torch.cuda.current_stream(e.device).wait_event(e._dev_event)
                e._dev_uses += 1
                if e._dev_uses >= e.handles:  # every view has had its copy: stop caching
                    e._dev, e._dev_uses, e._dev_event = None, 0, None
                cached = True
            else:
                cached = False
        if cached:
            self._stage_ahead(e)
            return raw
        with e._lock:
            backend = self._backend(e.device)
            t0 = time.perf_counter()
            tier = "host"
            if e.spill is not None:
                tier = "nvme" if e.spill.went_to_disk else "host"
                block = self._store.fetch(e)  # stalls are counted by the store
            else:
                block = e.block
            if self.config.verify:
                e.copy.wait()
                self._check(e, block, packed, tier)
            raw, _ = backend.to_device(block, e.device, e.copy)
            if e.spill is None:
                self._stats.add(stall_seconds=time.perf_counter() - t0)
            if e.device.type != "cpu" and e.handles > 1:
                e._dev, e._dev_uses, e._dev_event = raw, 1, None
        if e.device.type == "cuda":
            self._stage_ahead(e)
        return raw

    @staticmethod
    def _check(e: _Entry, block: Any, packed: _Packed, tier: str) -> None:
        """SPILLOVER_VERIFY: the bytes read back are the bytes packed."""
        found = block.checksum()
        if found != e.checksum:
            raise IntegrityError(
                f"a saved tensor of shape {list(packed.size)} and dtype {packed.dtype} "
                f"read back from the {tier} tier does not match its checksum (crc32c "
                f"{e.checksum:#010x} at pack, {found:#010x} at unpack)"
            )

    def _stage_ahead(self, e: _Entry) -> None:
        """Start the H2D copies of the next entries backward will ask for (reverse pack
        order, or the NVMe tier's learned order), a bounded distance ahead, so unpack finds
        them on the device (Note [stream ordering] in transfer.py)."""
        if self._store is not None and e.spill is not None:
            nxt = self._store._expected_after(e.spill.seq)
            cands = (self._store.by_seq.get(s) for s in nxt)
        else:
            cands = (self._by_seq.get(s) for s in range(e.seq - 1, -1, -1))
        staged, nbytes = 0, 0
        backend = self._backend(e.device)
        for ref in cands:
            if staged >= STAGE_AHEAD_ENTRIES or nbytes >= STAGE_AHEAD_BYTES:
                break
            c = ref() if ref is not None else None
            if c is None or c.device.type != "cuda":
                continue
            with c._lock:
                if c._dev is None:
                    if c.spill is not None and c.spill.state != "host":
                        break  # still on disk or in flight: the store's prefetch owns it
                    raw, ev = backend.to_device(c.block, c.device, c.copy, wait=False)
                    c._dev, c._dev_uses, c._dev_event = raw, 0, ev
            staged += 1
            nbytes += c.nbytes


def offload_context(tier: Optional[str] = None, **overrides: Any) -> OffloadContext:
    """Offload the activations autograd saves inside the ``with`` block.

    Args:
        tier: ``"host"`` (pinned host pool), ``"nvme"`` or ``"auto"``; default SPILLOVER_TIER.
        **overrides: any knob of :class:`spillover.Config` (``host_pool_bytes``,
            ``min_offload_bytes``, ``verify``, ...), overriding its SPILLOVER_* variable.

    Raises:
        ConfigError: a bad value, or a SPILLOVER_* variable spillover does not know.

    Example::

        with spillover.offload_context(tier="host") as ctx:
            loss = model(batch).loss
        loss.backward()
        print(ctx.stats())
    """
    return OffloadContext(tier=tier, **overrides)
