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

Note [parameters by identity]
    Parameters and buffers stay on the device (they are there anyway), recognised by what they
    are, never by an address remembered: the caching allocator hands a freed parameter's
    address to the next activation of that size (a second model on a reused context, a sweep,
    FSDP2 freeing unsharded parameters after each layer), and an address-keyed set kept such
    activations as "parameters" (measured: one context over six fresh models kept 3.25 ->
    5.75 MiB per step). A saved tensor is a parameter when it, or the base it is a view of
    (``w.t()`` saved by linear), is an ``nn.Parameter`` or a leaf that requires grad; or when
    its storage *is* (same StorageImpl, alive) the storage of a parameter or buffer of a module
    this step ran (a global forward pre-hook lists them, per step, holding weak references to
    the storages: a weak reference keeps the StorageImpl's address from being reused, and an
    activation at a freed or resized-away storage's old address has a StorageImpl of its own).

Note [host link]
    On a CPU host (plain CPU tensors, no simulated link) the "device" is the host: pack copies
    the storage into the tier in one call (``Step.put_from``: lease, memcpy with the GIL
    released, seal), and unpack views the block. No worker thread, no events, no copy in
    flight: a copy on the same two cores is compute, not a link to overlap, and the worker
    thread's hand-offs cost more than the copy of a 1 MiB tensor (pack_cost.py: pack + land
    225 + 355 us before; pack 189 us, copy included, after, on a loaded machine). A stored
    storage then has no ``copies``: nothing to wait for, no source held (the version check at
    unpack still raises autograd's in-place error). CUDA and the simulated device keep their
    asynchronous copies (transfer.py).

Note [compiled modules]
    The global module forward pre-hook that lists each step's parameters and buffers is traced
    by Dynamo under ``torch.compile`` and returns at once there (``torch.compiler.is_compiling``),
    so the context adds no graph and no break: a ``torch.compiler.disable``d hook broke the
    graph at every module call (nanoGPT, 2 layers: 1 graph / 0 breaks without the context, 5 / 4
    with it; ``fullgraph=True`` failed naming the private hook). Inside compiled graphs
    parameters are still recognised by identity (AOTAutograd saves the Parameter objects
    themselves); buffers there are not listed, and are offloaded like activations (a copy that
    frees nothing, never a wrong value). pack and unpack run when AOTAutograd saves and
    reloads the graph's tensors, outside the traced graph. Guarded by test_compile.py.

Note [kept by a policy]
    ``spillover.wrap``/``checkpoint`` regions hold some saved tensors themselves, out of
    autograd's hooks: op outputs their policy keeps (policy="auto"'s plan, a callable's "keep",
    ops with side effects), and everything a "plain-keep" region saves. That is device memory
    the step holds all the same, so the regions hand each to :meth:`OffloadContext.kept`
    (recompute/modes.py, recompute/policies.py): counted as saved and kept, "policy" in
    ``report()`` (parameters, buffers and small tensors under their own reasons). A storage a
    policy holds is not offloaded when autograd saves it again in the same forward (the copy
    would free nothing on the device): that counts as a deduplicated view.

Note [one context, many steps]
    One context object serves a whole training run: it is entered once per step (``with ctx:``
    around each forward), any number of times in sequence. Each entry begins a *step*: a step
    of the tier (its entries, pack order, counters and read-ahead forecast, taught by the step
    before it) and a record of the step's counters. Every handle a step packs points at its
    record, so the step's backward may run after its ``with`` block, and also after the context
    was entered again for the next step (gradient accumulation: forward 1, backward 1, forward
    2, backward 2; or forward 1, forward 2, then both backwards). A step's record and tier step
    live as long as its entries; once no entry of a step is alive and a later step has begun,
    its counters are folded into the context's total and the record goes. ``stats()`` is the
    latest step's, ``stats(total=True)`` the sum over every step. Entering a context that is
    already active on the same thread raises (a nested region takes an ``offload_context`` of
    its own); another thread may enter it meanwhile, as a step of its own.

Note [guardrails]
    Offload that silently does nothing is the failure users cannot see, so four situations warn,
    each once per process and once only (``_runtime.warn_once``: a RuntimeWarning, or, when the
    warnings filters ignore it, the ``spillover`` logger at WARNING -- never both, the one style
    of this package) and each naming the knob to change; every step also lists those it tripped
    in ``report()``.
    - *Pool full*: at the end of a forward, saved tensors stayed on the device because the host
      pool had no room (the bytes are ``bytes_kept_pool_full``).
    - *Others in the pool*: the same, while other users held a large share of the pool when the
      step began (at least 1 MiB and 1/16 of it): code that leases blocks of the process's
      activation pool (``spillover._runtime.host_pool``). ``OffloadAdamW`` never does: its
      state has a pool of its own (Note [node budget] in _runtime.py). "Others" are the pool's
      bytes in use minus the bytes in the pool of every activation tier over it. When the kept
      bytes exceed what the others held, the pool-full warning fires too.
    - *Compiled region*: an autograd node that is a compiled graph's backward (its name contains
      "Compiled", as AOTAutograd's ``CompiledFunctionBackward`` does) unpacks two or more
      offloaded storages that together are at least half of what its step offloaded. A compiled
      graph's backward unpacks every tensor it saved before it computes anything, so they are
      all back on the device at once and offload cannot lower the peak; eager nodes each unpack
      their own few tensors as backward reaches them.
    - *Slower than calibration*: once a step is over (at the end of its backward, or at its
      exit when backward ran inside the ``with``), the seconds it stalled on copies and I/O
      exceed ``stats.SLOW_FACTOR`` (3) times what its bytes take at the calibrated bandwidths
      (``stats.predicted_seconds``), and ``stats.SLOW_MIN_STALL_S`` (0.1 s). The bandwidths are
      the cached calibration (``spillover.calibrate.load``; never measured here, and the check
      is skipped without one); a simulated link (``sim_link_bandwidth``) is its own calibration.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _native, _runtime, suspend
from ._growth import Pools
from .config import Config
from .errors import ConfigError, IntegrityError, PoolExhaustedError
from .guardrails import Guardrails
from .stats import OffloadStats, format_report
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


def _module_pre_hook(module: torch.nn.Module, args: Any) -> None:
    # Note [compiled modules]: under torch.compile this hook is traced and does nothing, so it
    # never breaks the graph (a `torch.compiler.disable`d hook broke it at every module: 2
    # layers of nanoGPT went from 1 graph to 5 graphs and 4 breaks under the context).
    if torch.compiler.is_compiling():
        return
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



class _StepRecord:
    """One step of a context (Note [one context, many steps]): its tier step and counters,
    what its forward deduplicated and marked, and what its guardrails found."""

    __slots__ = ("index", "tier", "step", "steps", "stats", "stored", "by_seq", "dedup", "marked",
                 "kept", "params", "modules", "active", "tr_base", "tr_end", "devices", "others",
                 "node", "compiled", "checked", "findings", "errors", "__weakref__")

    def __init__(self, index: int, tier: Any, others: int, tr_base: Dict[Any, Tuple]):
        self.index = index
        self.begin(tier)
        self.stats = OffloadStats(steps=1)
        self.stored: Any = weakref.WeakSet()  # live _Stored of this step
        self.by_seq: Dict[int, Any] = {}  # tier seq -> weakref(_Stored), for H2D staging
        self.dedup: Dict[Tuple[str, int, int], Tuple[Any, Any]] = {}
        self.marked: set = set()
        self.kept: Dict[Tuple[str, int, int], Any] = {}  # Note [kept by a policy]: weak refs
        #: Note [parameters by identity]: storage (StorageImpl address) -> its weak reference,
        #: of the parameters and buffers of the modules this step ran; id(module) -> weakref.
        self.params: Dict[int, Any] = {}
        self.modules: Dict[int, Any] = {}
        self.active = True
        self.tr_base = tr_base  # per device: (stall seconds, forced waits) when it began
        self.tr_end: Optional[Dict[Any, Tuple]] = None  # ... when the next step began
        self.devices: set = set()
        self.others = others  # pool bytes other users held when it began
        self.node: Optional[List[Any]] = None  # [node key, storages, bytes] of the last unpack
        self.compiled: Optional[Tuple[int, int, str]] = None  # most a compiled node unpacked
        self.checked: set = set()
        self.findings: List[Tuple[str, str]] = []  # (guardrail, message)
        #: errors of this step's copies nobody waited for (Note [errors go to their owner])
        self.errors: List[BaseException] = []

    def begin(self, tier: Any) -> None:
        """Go on in a new tier step over ``tier`` (the first, or a grown pool's: Note [growing
        pool] in _growth.py); the earlier tier steps stay in ``steps`` for the counters."""
        self.tier, self.step = tier, tier.begin_step()
        self.steps = getattr(self, "steps", []) + [self.step]
        self.by_seq = {}  # seqs of different tiers' steps are unrelated

    def tier_stats(self) -> Dict[str, Any]:
        """The counters of the step's tier steps, added."""
        out: Dict[str, Any] = {}
        for step in self.steps:
            for k, v in step.stats().items():
                out[k] = out.get(k, 0) + v
        return out


class OffloadContext(Guardrails):
    """The object ``offload_context`` returns; use it as a context manager, once per step.

    One object may be entered any number of times in sequence, one step each (Note [one
    context, many steps]); entering it while it is active on the same thread raises
    RuntimeError. Its handles stay valid after exit, so backward can run outside the ``with``
    block, also after the next step has begun. ``stats()`` reports the latest step,
    ``stats(total=True)`` every step; ``report()`` says in words where the step's memory went.
    """

    def __init__(self, tier: Optional[str] = None, **overrides: Any):
        self.config = Config.load(tier=tier, **overrides)
        _runtime.configure_logging(self.config)
        self.tier = self._resolve_tier(self.config.tier)
        self._pools = Pools(self.config, self.tier)  # Note [growing pool] in _growth.py
        # Its leases go back when the context does (it holds nothing of the context).
        weakref.finalize(self, self._pools.close).atexit = False
        self._grow_lock = threading.Lock()
        self._local = threading.local()  # .stack: [(record, hooks)] active on this thread
        self._records: List[_StepRecord] = []  # steps not folded into the total yet
        self._last: Optional[_StepRecord] = None
        self._folded = OffloadStats()
        self._folded_findings: Dict[str, List[Any]] = {}  # guardrail -> [first message, steps]
        self._steps = 0
        self._pending_marks: set = set()  # keep() outside any step: for the next one
        self._pool_ranges: List[Tuple[int, int]] = []
        self._pool_starts: List[int] = []
        self._transfers: Dict[Any, Any] = {}
        self._transfer_base: Dict[Any, Tuple[float, int]] = {}
        self._chunk_above = 0
        self._chunk_bytes = 0
        self._in_backward = False
        self._bwd_records: Dict[int, _StepRecord] = {}  # records unpacked in this backward
        self._calibration: Any = None  # loaded once: dict, or False when there is none
        self._lock = threading.Lock()

    @staticmethod
    def _resolve_tier(tier: str) -> str:
        if tier not in ("host", "nvme", "auto"):
            raise ConfigError(f"tier={tier!r}: expected host, nvme or auto")
        return tier

    @property
    def _pool(self) -> Any:
        """The current host pool (None before the first step)."""
        return self._pools.pool

    @property
    def _tier(self) -> Any:
        """The current activation tier (``spillover._native.Tier``) over it."""
        return self._pools.tier

    @property
    def nvme(self) -> bool:
        """Whether this context spills to swap files (tier nvme, or auto with a swap open)."""
        return self._tier is not None and self._tier.has_swap

    @property
    def _step(self) -> Any:
        """The latest step's tier step (``spillover._native.Step``), or None (tests)."""
        rec = self._last
        return rec.step if rec is not None else None

    @property
    def steps(self) -> int:
        """How many times this context has been entered."""
        return self._steps

    # -- context manager --

    def _thread_stack(self) -> List[Tuple[_StepRecord, Any]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __enter__(self) -> OffloadContext:
        stack = self._thread_stack()
        if stack:
            raise RuntimeError(
                f"this offload_context is already active on this thread (step {stack[-1][0].index}"
                " has not exited its `with` block): exit it before entering it again -- one "
                "`with ctx:` per step -- or use a second offload_context(...) for a nested "
                "region"
            )
        with self._grow_lock:  # Note [growing pool] in _growth.py
            if self._pool is None:
                self._open()
            else:
                with self._lock:
                    busy = [r.tier for r in self._records if r.active]  # other threads' steps
                self._pools.retire(busy)
                if self._pools.grow_between_steps():
                    self._grown()
        self._pool_ranges = sorted(_runtime.pool_ranges())  # pools made since count too
        self._pool_starts = [a for a, _ in self._pool_ranges]
        others = self._pool_others()
        with self._lock:
            now = self._transfer_now()
            if self._last is not None and self._last.tr_end is None:
                self._last.tr_end = now
            self._fold(keep_last=False)  # a new latest step begins
            self._steps += 1
            index = self._steps
        rec = _StepRecord(index, self._tier, others, now)
        rec.stats.pool_capacity = self._pool.capacity
        with self._lock:
            rec.marked, self._pending_marks = self._pending_marks, set()
            self._records.append(rec)
            self._last = rec
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        stack.append((rec, hooks))
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
        rec, hooks = self._thread_stack().pop()
        if not suspend._forget(hooks):  # Note [no offload] in suspend.py
            hooks.__exit__(*exc)
        rec.active = False
        self._pools.note_forward_end()
        rec.dedup.clear()
        rec.marked.clear()
        rec.kept.clear()
        if exc[0] is None:
            self._check_pool(rec)
            self._check_compiled(rec)
            self._check_speed(rec)  # when its backward ran inside the `with`
        for tr in list(self._transfers.values()):
            tr.reap(rec.errors)  # copies done by now release their sources at once

    def _open(self) -> None:
        self._pools.open()
        self._grown()

    def _grown(self) -> None:
        """A pool became current (Note [growing pool] in _growth.py)."""
        self.tier = self._pools.tier_name  # "auto" resolved
        self._chunk_above, self._chunk_bytes = self._pools.chunk_sizes()
        self._pool_ranges = sorted(_runtime.pool_ranges())
        self._pool_starts = [a for a, _ in self._pool_ranges]

    # -- user API --

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keep ``tensor``'s storage in place when it is saved in this context's current step
        (the one active on this thread; outside one, the next step)."""
        key = self._storage_key(tensor)
        stack = self._thread_stack()
        with self._lock:
            (stack[-1][0].marked if stack else self._pending_marks).add(key)
        return tensor

    def stats(self, total: bool = False) -> OffloadStats:
        """A snapshot of the counters (a copy; later steps do not change it): of the latest
        step (its forward and, once it has run, its backward), or with ``total=True`` the sum
        over every step this context ran (``steps`` says how many). The pool and swap gauges
        are read now."""
        with self._lock:
            if total:
                self._fold()
                out, recs = self._folded.copy(), list(self._records)
            else:
                out, recs = OffloadStats(), [self._last] if self._last is not None else []
        for rec in recs:
            out = out + self._step_stats(rec)
        # Every pool this context still holds: one per generation (Note [growing pool]).
        for ts in [t.stats() for t in self._pools.tiers()]:
            out.pool_in_use += ts["pool_in_use"]
            out.swap_in_use += ts["swap_in_use"]
            out.pool_peak = max(out.pool_peak, ts["pool_peak"])
        if self._pool is not None:
            out.pool_capacity = self._pool.capacity
        return out

    def report(self, total: bool = False) -> str:
        """In words, for the latest step (or every step, ``total=True``): where its device
        memory went -- bytes kept and why (small, parameter, marked, pool full, unsupported),
        bytes offloaded per tier --, the seconds it stalled, how read-ahead did, and the
        guardrails it tripped (Note [guardrails])."""
        s = self.stats(total=total)
        with self._lock:
            if total:  # each guardrail once, with the steps that tripped it
                found = {k: list(v) for k, v in self._folded_findings.items()}
                for rec in self._records:
                    for key, message in rec.findings:
                        found.setdefault(key, [message, 0])[1] += 1
                findings = [f"{m} (in {n} step{'' if n == 1 else 's'})"
                            for m, n in found.values()]
            else:
                findings = [m for _, m in self._last.findings] if self._last else []
        if total:
            title = (f"spillover: {s.steps} step{'' if s.steps == 1 else 's'} on the "
                     f"{self.tier} tier")
        elif self._last is None:
            title = "spillover: no step yet (enter the context around a forward)"
        else:
            title = f"spillover: step {self._last.index} on the {self.tier} tier"
        return format_report(s, title=title, min_offload_bytes=self.config.min_offload_bytes,
                             findings=findings,
                             pool_limit=self._pools.limit() if self._pool is not None else 0)

    def pack(self, tensor: torch.Tensor) -> Any:
        """Offload ``tensor`` as this context's saved-tensor hook would; returns a handle for
        :meth:`unpack` (or the tensor itself when it is kept). For wrappers that save tensors
        outside autograd's hooks, e.g. selective checkpointing's cached op outputs. Counted in
        the step active on this thread, else the latest step."""
        return self._pack(tensor)

    def kept(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor`` as saved for backward and kept on the device by a recompute policy
        (Note [kept by a policy]), without offloading it; returns it. For wrappers that hold
        saved tensors themselves. Counted in the step active on this thread, else the latest."""
        return self._pack(tensor, offload=False)

    @property
    def pool_limit(self) -> int:
        """The most the host pool may hold: the size given (``host_pool_bytes=``), else what
        the default pool may grow to (Note [growing pool] in _growth.py). What a planner may
        count on; ``stats().pool_capacity`` is what is mapped now."""
        return self._pools.limit()

    def unpack(self, handle: Any) -> torch.Tensor:
        """The tensor :meth:`pack` was given, bitwise, on its original device."""
        return self._unpack(handle)

    def synchronize(self) -> None:
        """Wait for every copy this context's devices have in flight and every write or read
        of the tier (tests, measurements). Raises the first I/O error one of them hit."""
        for tr in list(self._transfers.values()):
            tr.synchronize()  # waits for every copy; raises errors no step owns
        with self._lock:  # then the first of this context's steps' (Note [errors go to ...])
            error = next((rec.errors.pop(0) for rec in self._records if rec.errors), None)
        if error is not None:
            raise error
        for tier in self._pools.tiers():
            tier.wait_idle()

    # -- steps --

    def _current(self) -> _StepRecord:
        stack = getattr(self._local, "stack", None)
        if stack:
            return stack[-1][0]
        rec = self._last
        if rec is None:
            raise RuntimeError("offload_context: pack before the context was ever entered; "
                               "enter it (`with ctx:`) around the forward first")
        return rec

    def _transfer_now(self) -> Dict[Any, Tuple[float, int]]:
        return {dev: (tr.stall_seconds, tr.forced_waits) for dev, tr in self._transfers.items()}

    def _fold(self, keep_last: bool = True) -> None:
        """Under ``_lock``: fold into the total the steps that are over -- exited, no entry
        alive, and (``keep_last``) not the latest (Note [one context, many steps])."""
        keep = []
        for rec in self._records:
            if rec.active or (keep_last and rec is self._last) or len(rec.stored):
                keep.append(rec)
            else:
                self._folded = self._folded + self._step_stats(rec)
                for key, message in rec.findings:
                    self._folded_findings.setdefault(key, [message, 0])[1] += 1
        self._records = keep

    def _step_stats(self, rec: _StepRecord) -> OffloadStats:
        out = rec.stats.copy()
        st = rec.tier_stats()
        out.bytes_offloaded_nvme = st["bytes_written"]
        out.bytes_offloaded_host = st["bytes_put"] - st["bytes_written"]
        out.prefetch_hits = st["prefetch_hits"]
        out.prefetch_misses = st["prefetch_misses"]
        out.host_cache_hits = st["host_cache_hits"]
        out.overflow_reads = st["overflow_reads"]
        out.stall_seconds += st["stall_seconds"]
        for dev, tr in list(self._transfers.items()):
            if rec.tr_end is not None:
                end = rec.tr_end.get(dev)
                if end is None:
                    continue  # first used after this step ended
            else:
                end = (tr.stall_seconds, tr.forced_waits)
            base = rec.tr_base.get(dev) or self._transfer_base[dev]
            out.stall_seconds += end[0] - base[0]
            out.copy_waits_forced += end[1] - base[1]
        return out

    # -- internals --

    @staticmethod
    def _storage_key(t: torch.Tensor) -> Tuple[str, int, int]:
        return (t.device.type, t.device.index or 0, t.untyped_storage().data_ptr())

    def _note_module(self, module: torch.nn.Module) -> None:
        """Note [parameters by identity]: the storages of a module's own parameters and buffers,
        the first time the step on this thread runs it."""
        stack = getattr(self._local, "stack", None)
        if not stack or _StorageWeakRef is None:
            return
        rec = stack[-1][0]
        seen = rec.modules.get(id(module))
        if seen is not None and seen() is module:
            return
        rec.modules[id(module)] = weakref.ref(module)
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is None:
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # e.g. a sharded DTensor between steps
                continue
            rec.params[storage._cdata] = _StorageWeakRef(storage)

    def _in_pool(self, addr: int) -> bool:
        i = bisect.bisect_right(self._pool_starts, addr) - 1
        return i >= 0 and addr < self._pool_ranges[i][1]

    @staticmethod
    def _is_param(rec: _StepRecord, t: torch.Tensor, storage: Any) -> bool:
        """Note [parameters by identity]."""
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return True
        ref = rec.params.get(storage._cdata)
        return ref is not None and not ref.expired()

    def _transfer(self, device: torch.device) -> Any:
        tr = self._transfers.get(device)
        if tr is None:
            tr = transfers_for(device, sim_bandwidth=self.config.sim_link_bandwidth,
                               cap_bytes=self.config.copy_inflight_bytes)
            with self._lock:
                self._transfer_base[device] = (tr.stall_seconds, tr.forced_waits)
                self._transfers[device] = tr
        return tr

    @torch._dynamo.disable  # type: ignore[misc]
    def _pack(self, t: torch.Tensor, offload: bool = True) -> Any:
        rec = self._current()
        stats = rec.stats
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
        if self._is_param(rec, t, storage):
            stats.add(bytes_kept_parameter=nbytes)
            return t
        if key in rec.marked:
            stats.add(bytes_kept_marked=nbytes)
            return t
        held = rec.kept.get(key)  # Note [kept by a policy]
        if held is not None and held.cdata == storage._cdata and not held.expired():
            stats.add(storages_deduplicated=1, bytes_deduplicated=nbytes)
            return t
        if not offload:
            stats.add(bytes_kept_policy=nbytes)
            if _StorageWeakRef is not None:
                rec.kept[key] = _StorageWeakRef(storage)
            return t
        if t.device.type == "cpu" and self._in_pool(key[2]):
            # Already a view of a pool block (e.g. an unpacked tensor saved again).
            stats.add(bytes_kept_unsupported=nbytes)
            return t
        hit = rec.dedup.get(key)
        if hit is not None:
            stored = hit[0]()
            if stored is not None and (hit[1] is None or not hit[1].expired()):
                stats.add(storages_deduplicated=1, bytes_deduplicated=nbytes)
                return _Packed(stored, t)
        tr = self._transfer(t.device)
        if not tr.host_is_device:  # the host link starts no copies (Note [host link])
            tr.reap(rec.errors)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        if self._chunk_above and nbytes > self._chunk_above:
            stored = self._pack_pieces(rec, tr, src, t, nbytes)
        else:
            stored = self._pack_whole(rec, tr, src, t, nbytes)
        if stored is None:
            stats.add(bytes_kept_pool_full=nbytes)
            return t
        if not tr.host_is_device:
            stats.raise_to(bytes_in_flight_peak=tr.bytes_in_flight)
        wref = _StorageWeakRef(storage) if _StorageWeakRef is not None else None
        rec.dedup[key] = (weakref.ref(stored), wref)
        rec.stored.add(stored)
        rec.devices.add(t.device)
        stats.add(tensors_offloaded=1)
        if not tr.host_is_device:  # only a device's H2D copies are staged ahead
            rec.by_seq[stored.seq] = weakref.ref(stored)
        return _Packed(stored, t)

    def _put(self, rec: _StepRecord, tr: Any, nbytes: int, grow: bool = True
             ) -> Tuple[Any, Any]:
        """A staged tier entry of ``nbytes``. When every block is staged or viewed, the copies
        in flight are waited for (their entries become evictable) and the lease tried again;
        then (``grow``) a default pool grows (Note [growing pool] in _growth.py);
        PoolExhaustedError when none of that makes room."""
        try:
            return rec.step.put(nbytes)
        except PoolExhaustedError:
            if not tr.bytes_in_flight and not (grow and self._grow(rec, nbytes)):
                raise
        if tr.bytes_in_flight:
            t0 = time.perf_counter()
            tr.synchronize(rec.errors)
            rec.stats.add(stall_seconds=time.perf_counter() - t0)
            try:
                return rec.step.put(nbytes)
            except PoolExhaustedError:
                if not (grow and self._grow(rec, nbytes)):
                    raise
        return rec.step.put(nbytes)

    def _grow(self, rec: _StepRecord, nbytes: int) -> bool:
        """Mid-step growth: ``rec`` goes on over a larger pool (another thread's step may have
        grown it already). False when the pool cannot grow."""
        with self._grow_lock:
            if rec.tier is self._tier and not self._pools.grow_mid_step(nbytes):
                return False
            self._grown()
        rec.begin(self._tier)
        rec.stats.pool_capacity = self._pool.capacity
        return True

    def _put_from(self, rec: _StepRecord, src: torch.Tensor, offset: int, nbytes: int,
                  grow: bool = True) -> Any:
        """Note [host link]: a sealed tier entry holding ``nbytes`` of ``src`` from ``offset``,
        in one call into the tier. A full pool grows (``grow``, Note [growing pool]) or raises
        PoolExhaustedError."""
        try:
            return rec.step.put_from(src, src.data_ptr() + offset, nbytes)
        except PoolExhaustedError:
            if not (grow and self._grow(rec, nbytes)):
                raise
        return rec.step.put_from(src, src.data_ptr() + offset, nbytes)

    def _pack_whole(self, rec: _StepRecord, tr: Any, src: torch.Tensor, t: torch.Tensor,
                    nbytes: int) -> Optional[_Stored]:
        if tr.host_is_device:  # Note [host link]
            try:
                handle = self._put_from(rec, src, 0, nbytes)
            except PoolExhaustedError:
                return None
            return _Stored(rec, handle, nbytes, t.device, [], handle.seq)
        try:
            handle, view = self._put(rec, tr, nbytes)
        except PoolExhaustedError:
            return None
        copy = tr.to_host(src, block_tensor(view), watch=t, on_landed=handle.seal,
                          errors=rec.errors)
        return _Stored(rec, handle, nbytes, t.device, [copy], handle.seq)

    def _pack_pieces(self, rec: _StepRecord, tr: Any, src: torch.Tensor, t: torch.Tensor,
                     nbytes: int) -> Optional[_Stored]:
        """Note [gathered storages] (rust/tier/gather.rs): a storage larger than half the pool
        goes in pieces, each an entry of its own, written out as the pool fills."""
        handles, copies = [], []
        try:
            for off in range(0, nbytes, self._chunk_bytes):
                n = min(self._chunk_bytes, nbytes - off)
                if tr.host_is_device:  # Note [host link]
                    handles.append(self._put_from(rec, src, off, n, grow=False))
                    continue
                handle, view = self._put(rec, tr, n, grow=False)  # one tier step for all
                copies.append(tr.to_host(src[off : off + n], block_tensor(view), watch=t,
                                         on_landed=handle.seal, errors=rec.errors))
                handles.append(handle)
        except PoolExhaustedError:
            # The pieces go as their copies land (a staging view keeps its block until then).
            return None
        rec.stats.add(tensors_chunked=1)
        return _Stored(rec, rec.step.gather(handles), nbytes, t.device, copies, handles[-1].seq)

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

    def _note_backward(self, rec: _StepRecord) -> Any:
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

    def _materialize(self, s: _Stored, packed: _Packed) -> torch.Tensor:
        """The storage's bytes as a uint8 tensor on its device."""
        tr = self._transfer(s.device)
        stats = s.record.stats
        src = s.source()
        if not tr.host_is_device:  # the host link holds no sources (Note [host link])
            tr.release_sources()
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

    def _bring_back(self, tr: Any, s: _Stored, packed: _Packed) -> torch.Tensor:
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

    def _stage_ahead(self, tr: Any, s: _Stored) -> None:
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

    The object is reusable: make it once and enter it around each step's forward (Note [one
    context, many steps]); ``stats()`` and ``report()`` describe the latest step,
    ``stats(total=True)`` and ``report(total=True)`` every step so far.

    Raises:
        ConfigError: a bad value, or a SPILLOVER_* variable spillover does not know.

    Example::

        ctx = spillover.offload_context(tier="host")
        for batch in loader:
            with ctx:
                loss = model(batch).loss
            loss.backward()            # outside the `with`: fine
        print(ctx.stats(), ctx.report(), sep="\n")
    """
    return OffloadContext(tier=tier, **overrides)
