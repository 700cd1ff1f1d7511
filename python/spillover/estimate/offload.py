"""A stand-in for ``offload_context`` on fake tensors: what the context does to device memory,
host memory, the NVMe drive and the clock, without a pool, a link or a file.

:class:`SimContext` answers what the regions and the planner ask of a context (``tier``,
``nvme``, ``pool_limit``, ``pack``, ``unpack``, ``kept``, ``keep``) and installs saved-tensor
hooks as the real one does, so that ``wrap``'s policies and the planner run under it unchanged.

Note [simulated offload]
    What each tier does to the device's memory, as activations/ implements it:

    - Every context keeps a saved tensor where it is when its storage is under
      ``min_offload_bytes``, a parameter or buffer (or a view of one), or a storage a policy
      holds; a storage saved through several views is offloaded once (Note [views share one
      return] in activations/unpack.py).
    - On a GPU (``Device.kind == "cuda"``) a packed tensor's source stays on the device while
      the sources held fit ``copy_inflight_bytes``, newest first (Note [the newest sources
      stay] in activations/link/device.py); an older one is dropped as newer copies come, and
      when its copy has not landed yet the compute stream waits for it (Note [back-pressure]
      in rust/link: the device's clock stalls). An unpack returns a source still held; else a
      new device tensor, made when the entry is staged ahead: each unpack stages up to 4
      entries and min(512 MiB, pool / 8) bytes of those backward needs next (Note [staging
      distance]). The host tier keeps a tensor on the device when its pool is full (a default
      pool grows first, to its cap, Note [growing pool] in _growth.py).
    - The link (GPU) moves ``link_bytes_per_s`` each way, one queue per direction, in issue
      order: a copy out starts once its tensor is made (the device's clock) and the copies
      before it ran; a copy back once its copy out landed, the host asked for it (an unpack
      or the staging ahead, the host's clock) and the copies back before it ran; the unpack
      that needs it waits on the device for it. An offload's host cost is the host's (Note
      [two clocks] in modes.py).
    - On a CPU host (the pool is the device's memory, counted in full by the caller) the host
      tier copies a storage into the pool (its source goes as soon as nothing else holds it)
      and unpack returns a view of the block (no new memory); a storage larger than half the
      pool stays. The NVMe tier writes a storage out from its own memory (Note [written from
      the tensor] in rust/tier/direct.rs): the storage stays alive until its write lands,
      writes land in order at the drive's write rate, and a pack waits (the clock stalls) while
      more than the pool plus the largest storage written so far is being written. An entry is
      read back into the pool (a view: no new memory), a storage larger than half the pool
      into one buffer of its own, which is device memory.
    - NVMe traffic: on a CPU host every entry is written; an entry packed after the last
      quarter of the pool filled stays in the pool and is never read back. On a GPU the tier
      writes what passes a quarter of the pool and reads back what passes its resident three
      quarters (Note [write early, drop late] in rust/tier/policy.rs).
    The clock is the tracker's (op seconds from the time model); transfers queue on the link
    and on the drive and a stall adds its wait to the clock.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from typing import Any, Dict, Iterator, Optional

import torch

from .. import _runtime
from ..activations import registry
from ..activations.rederive import REDERIVE_MIN_BYTES, Remade, making, remade
from ..planner.cost import HIGH_WATER
from .devices import Device
from .drive import DriveModel, _blocks
from .trace import Tracker

__all__ = ["SimContext", "OffloadFigures"]

#: Note [staging distance] in activations/unpack.py
STAGE_ENTRIES = 4
STAGE_BYTES = 512 << 20


@dataclasses.dataclass
class OffloadFigures:
    """What the simulated context counted over one step."""

    bytes_offloaded: int = 0
    tensors_offloaded: int = 0
    bytes_kept: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    pool_capacity: int = 0
    pool_peak: int = 0
    link_bytes: int = 0  # device <-> host, both ways (GPU)
    bytes_rederived: int = 0  # Note [made again at unpack] in activations/rederive.py
    stall_seconds: float = 0.0


class _Entry:
    __slots__ = ("seq", "nbytes", "source", "staged", "views", "chunked", "on_disk",
                 "in_pool", "write_done", "read_done", "unpacked", "cached", "pieces",
                 "copied", "back", "held", "__weakref__")

    def __init__(self, seq: int, nbytes: int, chunked: bool):
        self.seq = seq
        self.nbytes = nbytes
        self.source: Optional[torch.Tensor] = None
        self.staged: Optional[torch.Tensor] = None
        self.cached: Any = None  # weakref to the storage-shaped tensor views share
        #: brought back for a tensor made again, held for its own node's unpack (Note [made
        #: again at unpack] in activations/rederive.py)
        self.held: Optional[torch.Tensor] = None
        self.views = 0
        self.chunked = chunked
        self.on_disk = False
        self.in_pool = True
        self.write_done = 0.0
        self.read_done: Optional[float] = None
        self.unpacked = 0
        self.pieces = 1
        self.copied = 0.0  # GPU: when its copy out lands
        self.back: Optional[float] = None  # GPU: when its copy back (staged) lands


class _StepRecord:
    """What the process's module hook and ``is_param`` read of a step (activations/registry.py,
    Note [parameters by identity])."""

    def __init__(self) -> None:
        self.modules: Dict[int, Any] = {}
        self.params: Dict[int, Any] = {}
        self.param_numels: set = set()  # Note [survivors of a pack] in activations/hooks.py


class _Handle:
    __slots__ = ("entry", "size", "stride", "offset", "dtype", "numel_base", "__weakref__")

    def __init__(self, entry: _Entry, t: torch.Tensor):
        self.entry = entry
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.dtype = t.dtype
        self.numel_base = t.untyped_storage().nbytes() // max(1, t.element_size())


class SimContext(DriveModel):
    """Note [simulated offload]. ``pool_bytes``: the pool's size (None: the default pool,
    starting at 64 MiB and growing to ``pool_cap``). ``tier="auto"``: the NVMe tier where the
    device has a drive, which spills only once a growing pool is at its cap (Note [RAM before
    the drive] in _growth.py)."""

    def __init__(self, tier: str, device: Device, tracker: Tracker, pool_bytes: Optional[int],
                 pool_cap: int, params: set, min_offload_bytes: int = 1 << 20,
                 learns_order: bool = True, resolved: Optional[str] = None,
                 rederive: bool = True):
        if tier not in ("host", "nvme", "auto"):
            raise ValueError(f"tier={tier!r}: expected host, nvme or auto")
        drive = bool(device.nvme_write_bytes_per_s)
        #: the tier asked for, as ``OffloadContext.tier`` names it (a plan seeded under this
        #: context must match the real one's signature: Note [seeded plan] in seed.py)
        self.tier = tier
        #: what tier auto became (``resolved``: a real context's, whose swap opened or not)
        self._resolved = resolved or (tier if tier != "auto" else ("nvme" if drive else "host"))
        #: whether the pool spills to the drive (auto over a growing pool: once at its cap)
        self.spilling = tier != "auto" or pool_bytes is not None
        self.device = device
        self.tracker = tracker
        self.host_is_device = device.kind == "cpu"
        self.fixed = pool_bytes is not None
        self.cap = int(pool_bytes) if pool_bytes is not None else int(pool_cap)
        self.capacity = int(pool_bytes) if pool_bytes is not None else min(
            _runtime.MIN_POOL, self.cap)
        self.params = params
        self.min_offload_bytes = min_offload_bytes
        #: Note [made again at unpack] in activations/rederive.py: as the context's option
        self.rederive = rederive
        self._rederived: Any = weakref.WeakValueDictionary()  # storage key -> Rederived
        #: False: every step is the tier's first (no learned order), as a new context's is
        self.learns_order = learns_order
        self.figures = OffloadFigures()
        self._hooks: Any = None
        # seq -> entry, while a handle of it lives (the graph holds the handles)
        self._entries: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._dedup: Dict[int, Any] = {}  # storage key -> (weakref storage, entry)
        self._held: collections.deque[_Entry] = collections.deque()  # GPU sources, oldest left
        self._held_bytes = 0
        self._writing: collections.deque[Any] = collections.deque()  # (done, bytes)
        self._writing_bytes = 0
        self._held_direct: collections.deque[_Entry] = collections.deque()
        # the NVMe tier's pool on a CPU host: (entry, piece) -> [blocks, write done or None]
        self._pool: collections.OrderedDict[Any, list] = collections.OrderedDict()
        self._dirty: collections.deque[Any] = collections.deque()
        self._dirty_bytes = 0
        self._piece = 0
        self._sizes: list = []  # this step's pieces in pack order
        self._learned: list = []  # the last step's (the tier's learned order)
        self._after: list = []
        self._largest_written = 0
        self._seq = 0
        self._in_use = 0  # pool bytes of the entries packed as the host tier packs
        self._hosted: set = set()  # their seqs (tier auto below its cap), while they live
        self._link_free = 0.0  # the copies out (device to host)
        self._h2d_free = 0.0  # the copies back
        self._disk_free = 0.0
        self._kept_keys: set = set()
        self._keep_rest = False  # Note [the tail stays] in planner/search.py
        self._rec = _StepRecord()

    # -- what the regions and the planner read --

    @property
    def nvme(self) -> bool:
        return self._resolved == "nvme" and bool(self.device.nvme_write_bytes_per_s)

    @property
    def pool_limit(self) -> int:
        return self.cap

    @property
    def pool_mapped(self) -> int:
        """As ``OffloadContext.pool_mapped``."""
        return int(self.capacity)

    @property
    def grows_in_ram(self) -> bool:
        """As ``OffloadContext.grows_in_ram``: a default pool, packing to RAM."""
        return not self.fixed and not self._drive

    @property
    def _drive(self) -> bool:
        """Entries packed now go through the drive's model (Note [RAM before the drive])."""
        return self.nvme and self.spilling

    def _no_room(self, blocks: int) -> bool:
        """The host tier's pool has no room for ``blocks`` even grown: True when the tensor
        stays; tier auto starts spilling instead."""
        if self._grow(blocks):
            return False
        if self.nvme and not self.spilling:
            self.spilling = True
            return False
        return True

    # -- steps --

    @contextlib.contextmanager
    def step(self) -> Iterator[SimContext]:
        """One forward under the context (backward may follow outside it, as with the real
        one); pushed where ``current_context()`` finds it."""
        self._dedup = {}
        self._kept_keys = set()
        self._keep_rest = False
        if self._sizes and self.learns_order:
            self._learned, self._sizes = self._sizes, []
            after, acc = [], 0
            for n in reversed(self._learned):
                after.append(acc)
                acc += n
            self._after = after[::-1]
        elif not self.learns_order:
            self._sizes = []
        self._piece = 0
        # what the process's module hook fills in (Note [parameters by identity])
        self._rec = _StepRecord()
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        stack = registry.stack()
        stack.append(registry.Active(self, self._rec, hooks))  # type: ignore[arg-type]
        try:
            yield self
        finally:
            stack.pop()
            hooks.__exit__(None, None, None)
            self._dedup = {}

    def poll(self) -> None:
        """Between two ops: writes that landed by now release their sources."""
        if self._writing and self._writing[0][0] <= self.tracker.clock:
            self._poll_writes(self.tracker.clock)

    def copies_landed(self) -> float:
        """When every copy over the link queued so far lands (GPU; 0 on a CPU host)."""
        return 0.0 if self.host_is_device else max(self._link_free, self._h2d_free)

    def end_step(self) -> None:
        """After backward: what is still held goes (Note [the newest sources stay]: every one
        at the end of backward)."""
        for e in self._held:
            e.source = None
        self._held.clear()
        self._held_bytes = 0
        self._poll_writes(float("inf"))

    # -- the public hooks --

    def pack(self, t: torch.Tensor) -> Any:
        return self._pack(t)

    def unpack(self, h: Any) -> torch.Tensor:
        return self._unpack(h)

    def kept(self, t: torch.Tensor) -> torch.Tensor:
        self._kept_keys.add(_key(t))
        return t

    def remade_or_kept(self, t: torch.Tensor) -> Any:
        """``OffloadContext.remade_or_kept``."""
        if (self.rederive and isinstance(t, torch.Tensor) and t.layout == torch.strided
                and t.untyped_storage().nbytes() >= REDERIVE_MIN_BYTES):
            made = self._remade(t, t.untyped_storage()._cdata, t.untyped_storage().nbytes())
            if made is not None:
                return made
        return self.kept(t)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        self._kept_keys.add(_key(t))
        return t

    @property
    def copy_inflight_bytes(self) -> int:
        """The sources in flight the device holds before it waits (Note [simulated
        offload])."""
        return int(self.device.copy_inflight_bytes)

    def keep_rest(self, on: bool = True) -> None:
        """``OffloadContext.keep_rest``: what is saved from now until backward stays."""
        self._keep_rest = on

    # -- pack --

    def _pack(self, t: torch.Tensor) -> Any:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return t
        st = t.untyped_storage()
        k = st._cdata
        nbytes = st.nbytes()
        if (nbytes < self.min_offload_bytes or nbytes == 0 or k in self.params
                or k in self._kept_keys or registry.is_param(self._rec, t, st)):
            return t
        hit = self._dedup.get(k)
        if hit is not None and hit[0]() is not None:
            entry = hit[1]
            entry.views += 1
            return _Handle(entry, t)
        if self._keep_rest:
            self._kept_keys.add(k)
            return t
        if self.rederive and nbytes >= REDERIVE_MIN_BYTES:
            made = self._remade(t, k, nbytes)  # Note [made again at unpack]: no copy
            if made is not None:
                return made
        entry = self._new_entry(t, nbytes)
        if entry is None:
            self.figures.bytes_kept += nbytes
            return t
        self._dedup[k] = (weakref.ref(st), entry)
        entry.views = 1
        return _Handle(entry, t)

    def _remade(self, t: torch.Tensor, k: int, nbytes: int) -> Optional[Remade]:
        made, first = remade(self._rederived, k, t, None, nbytes)
        if first:
            self.figures.bytes_rederived += nbytes
        return made

    def _new_entry(self, t: torch.Tensor, nbytes: int) -> Optional[_Entry]:
        now = self.tracker.clock
        blocks = _blocks(nbytes)
        if not self._drive:
            if self.host_is_device and nbytes > self.capacity // 2 and self._no_room(blocks):
                return None  # Limits: a storage larger than half the host pool stays
            if not self._drive and self._in_use + blocks > self.capacity and self._no_room(
                    blocks):
                return None
        chunked = self._drive and nbytes > self.capacity // 2
        self._seq += 1
        e = _Entry(self._seq, nbytes, chunked)
        if not self._drive:
            self._hosted.add(e.seq)
        self._entries[e.seq] = weakref.ref(e)
        weakref.finalize(e, self._gone, e.seq, nbytes)  # its handles gone with the graph
        fig = self.figures
        fig.bytes_offloaded += nbytes
        fig.tensors_offloaded += 1
        dev = self.device
        if self.host_is_device:
            self.tracker.clock += dev.host_seconds_per_offload
        else:  # Note [two clocks]: the host's
            self.tracker.host_clock += dev.host_seconds_per_offload
        if self.host_is_device:
            if self._drive:
                self._pack_direct(e, t, nbytes)
            else:  # copied into the pool now
                self.tracker.clock += nbytes / dev.link_bytes_per_s
                self._in_use += blocks
        else:
            # the copy over the link; its source stays while the held ones fit the cap
            self._link_free = max(self._link_free, now) + nbytes / dev.link_bytes_per_s
            e.copied = self._link_free
            fig.link_bytes += nbytes
            e.source = t
            self._held.append(e)
            self._held_bytes += nbytes
            while self._held_bytes > dev.copy_inflight_bytes and len(self._held) > 1:
                old = self._held.popleft()
                self._held_bytes -= old.nbytes
                old.source = None
                # Note [back-pressure] in rust/link: the compute stream waits for its copy
                wait = max(0.0, old.copied - self.tracker.clock)
                self.tracker.clock += wait
                fig.stall_seconds += wait
            self._in_use += blocks
        fig.pool_peak = max(fig.pool_peak, min(self._in_use, self.capacity))
        return e

    def _grow(self, blocks: int) -> bool:
        """Note [growing pool] in _growth.py: a default pool doubles, or to what its entries
        and this one need, up to its cap; a pool of the user's size does not grow."""
        if self.fixed:
            return False
        need = self._in_use + blocks
        new = min(self.cap, max(2 * self.capacity, _runtime.sized_for(need)))
        if new < need or new <= self.capacity:
            return False
        self.capacity = new
        return True

    def _gone(self, seq: int, nbytes: int) -> None:
        self._entries.pop(seq, None)
        if self.host_is_device and self.nvme and seq not in self._hosted:
            for key in [k for k in self._pool if k[0] == seq]:
                del self._pool[key]
        else:
            self._in_use -= _blocks(nbytes)
        self._hosted.discard(seq)

    # -- unpack --

    def _unpack(self, h: Any) -> torch.Tensor:
        if type(h) is Remade:
            self._keep_rest = False
            return h.get()
        if not isinstance(h, _Handle):
            return h
        self._keep_rest = False  # backward started
        e = h.entry
        e.unpacked += 1
        if e.held is not None:  # brought back for a tensor made again: once more, no copy
            base, e.held = e.held, None
        else:
            base = self._bring_back(e, h)
            if making():
                e.held = base
        self._stage_ahead(e)
        if e.unpacked >= e.views:  # views share one return (Note [views share one return])
            e.cached = None
            if not self.host_is_device and e.source is not None:
                self._drop_held(e)
        return base.as_strided(h.size, h.stride, h.offset)

    def _bring_back(self, e: _Entry, h: _Handle) -> torch.Tensor:
        if e.cached is not None:
            t = e.cached()
            if t is not None:
                return t
        if e.source is not None:  # still on the device (held, or being written from)
            t = e.source
        elif e.staged is not None:
            t, e.staged = e.staged, None
            if e.back is not None:  # the device waits for its copy back
                wait = max(0.0, e.back - self.tracker.clock)
                self.tracker.clock += wait
                self.figures.stall_seconds += wait
                e.back = None
        else:
            t = self._arrive(e, h)
        e.cached = weakref.ref(t)
        return _as_dtype(t, h)

    def _arrive(self, e: _Entry, h: _Handle) -> torch.Tensor:
        """Bytes brought back: a new device tensor (GPU; a CPU storage in pieces), or a view
        of a pool block (CPU), after the read and copy they wait for."""
        fig = self.figures
        if self.host_is_device and e.seq not in self._hosted:
            if self.nvme:
                missing = sum(1 for i in range(e.pieces) if (e.seq, i) not in self._pool)
                if missing and e.source is None:
                    self._read(e)
            if self.nvme and e.chunked:
                return torch.empty(h.numel_base, dtype=h.dtype)
        if self.host_is_device:
            with self.tracker.uncounted():
                return torch.empty(h.numel_base, dtype=h.dtype)
        if self.nvme and e.on_disk:
            self._read(e)
        done = e.back if e.back is not None else self._copy_back(e)
        e.back = None
        wait = max(0.0, done - self.tracker.clock)  # the device waits for the copy back
        self.tracker.clock += wait
        fig.stall_seconds += wait
        return torch.empty(h.numel_base, dtype=h.dtype)

    def _copy_back(self, e: _Entry) -> float:
        """GPU: queue ``e``'s copy back now (the host's clock); when it lands (Note
        [simulated offload])."""
        dev = self.device
        self.figures.link_bytes += e.nbytes
        start = max(self._h2d_free, e.copied, self.tracker.host_clock)
        if self.nvme and e.read_done is not None:
            start = max(start, e.read_done)
        self._h2d_free = start + e.nbytes / dev.link_bytes_per_s
        return self._h2d_free

    def _stage_ahead(self, current: _Entry) -> None:
        """GPU: the next entries backward needs (descending pack order), staged onto the
        device now; NVMe: their reads issued (the tier's read-ahead)."""
        left = min(STAGE_BYTES, self.capacity // 8)
        n = 0
        for seq in reversed(self._entries):
            if seq >= current.seq:
                continue
            e = self._entries[seq]()
            if e is None or e.unpacked:
                continue
            if n >= STAGE_ENTRIES or e.nbytes > left:
                break
            n += 1
            left -= e.nbytes
            if self.nvme and e.on_disk and e.read_done is None:
                dev = self.device
                start = max(self._disk_free, self.tracker.clock)
                self._disk_free = start + e.nbytes / dev.nvme_read_bytes_per_s
                e.read_done = self._disk_free
                self.figures.bytes_read += e.nbytes
            if not self.host_is_device and e.source is None and e.staged is None:
                e.staged = torch.empty(e.nbytes, dtype=torch.uint8)
                e.back = self._copy_back(e)

    def stage_next(self, nbytes: int) -> int:
        """``OffloadContext.stage_next``: the entries backward needs next (descending pack
        order), staged onto the device now, up to ``nbytes`` (Note [regions shipped whole] in
        planner/search.py); how many copies it started."""
        if self.host_is_device:
            return 0
        left, started = nbytes, 0
        for seq in reversed(self._entries):
            e = self._entries[seq]()
            if e is None or e.unpacked:
                continue
            if e.nbytes > left:
                break
            left -= e.nbytes
            if e.source is None and e.staged is None:
                e.staged = torch.empty(e.nbytes, dtype=torch.uint8)
                e.back = self._copy_back(e)
                started += 1
        return started

    def _drop_held(self, e: _Entry) -> None:
        try:
            self._held.remove(e)
            self._held_bytes -= e.nbytes
        except ValueError:
            pass
        e.source = None

    def finish(self) -> OffloadFigures:
        """The step's figures, NVMe traffic settled (Note [simulated offload])."""
        fig = self.figures
        fig.pool_capacity = self.capacity
        if self._drive and not self.host_is_device:
            # written past a quarter of the pool; read back past its resident share
            fig.bytes_written = max(0, fig.bytes_offloaded - self.capacity // 4)
            fig.bytes_read = max(0, fig.bytes_offloaded - int(self.capacity * HIGH_WATER))
        return fig


def _key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def _as_dtype(t: torch.Tensor, h: _Handle) -> torch.Tensor:
    if t.dtype == h.dtype:
        return t
    flat = t.reshape(-1) if t.dim() != 1 else t
    return flat.view(h.dtype)

