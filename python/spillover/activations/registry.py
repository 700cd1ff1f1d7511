"""Which context is active on this thread, the global module hook that lists each step's
parameters and buffers, and the record of one step (its tier step, counters, dedup tables).

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
    Autocast's casts of parameters (a bf16 copy of each fp32 weight, made from the weight at
    every forward) are kept as parameters too: offloading them spent the link on weight bytes
    every step; kept, they cost the step what half the fp32 weights take.

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

Note [one hook for the run]
    Dynamo guards a compiled frame on the keys of torch's global hook dicts. A hook registered
    when a step began and removed when it ended had a new key every step, so every step
    recompiled, and at step 9 Dynamo hit its recompile limit and ran the model uncompiled
    (``fullgraph=True``: training stopped). So the hook is registered once per process, when
    the first context is made, and stays; outside a step it returns at once (one thread-local
    read per module call). torch's warning about global hooks and ``torch.compile(module)``
    (the hook fires once more, for the wrapper, which owns no parameters) is filtered.
    Guarded by test_compile_run.py (12 compiled steps: one graph, no recompile).

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
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

from ..stats import OffloadStats

if TYPE_CHECKING:
    from .context import OffloadContext

__all__ = ["Active", "StepRecord", "active_record", "capturing", "current_context", "is_param",
           "keep", "note_module", "stack", "storage_key"]

try:  # torch >= 2.0
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover
    StorageWeakRef = None  # type: ignore[assignment,misc]

_tls = threading.local()


class Active(NamedTuple):
    """A step active on this thread: its context, its record, its saved-tensor hooks."""

    ctx: OffloadContext
    rec: StepRecord
    hooks: Any


def stack() -> List[Active]:
    """The steps active on this thread, innermost last."""
    st = getattr(_tls, "stack", None)
    if st is None:
        st = _tls.stack = []
    return st


def current_context() -> Optional[OffloadContext]:
    """The innermost ``offload_context`` active on this thread, or None."""
    st = stack()
    return st[-1].ctx if st else None


def active_record(ctx: OffloadContext) -> Optional[StepRecord]:
    """``ctx``'s step active on this thread, or None."""
    st = getattr(_tls, "stack", None)
    if not st:
        return None
    top = st[-1]  # the innermost: every pack asks (issue 40, item 5)
    if top.ctx is ctx:
        return top.rec
    for a in reversed(st):
        if a.ctx is ctx:
            return a.rec
    return None


def keep(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor``'s storage to stay where it is in the innermost active context of this
    thread (e.g. a tensor backward needs first). Returns ``tensor``. No-op outside a context."""
    st = stack()
    if st:
        st[-1].ctx.keep(tensor)
    return tensor


def storage_key(t: torch.Tensor) -> Tuple[str, int, int]:
    """(device type, index, storage address): how a step's tables name a storage."""
    return (t.device.type, t.device.index or 0, t.untyped_storage().data_ptr())


def capturing(device: Optional[torch.device] = None) -> bool:
    """Whether the current stream of ``device`` (default: the current CUDA device) is being
    captured into a CUDA graph: nothing may be queried or copied out then (Note [graph
    capture] in context.py)."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return False
    if device is None or device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device.index):
        return torch.cuda.is_current_stream_capturing()


# ---- module hook: learn parameter and buffer storages of the modules a context runs ----------

_hook_lock = threading.Lock()
_hook_handle: Any = None
#: torch's UserWarning at each call of a ``torch.compile(module)`` wrapper while a global module
#: hook exists (torch/_dynamo/eval_frame.py, ``OptimizedModule.__call__``).
_COMPILE_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


def _module_pre_hook(module: torch.nn.Module, args: Any) -> None:
    # Note [compiled modules]: under torch.compile this hook is traced and does nothing, so it
    # never breaks the graph (a `torch.compiler.disable`d hook broke it at every module: 2
    # layers of nanoGPT went from 1 graph to 5 graphs and 4 breaks under the context).
    if torch.compiler.is_compiling():
        return
    st = getattr(_tls, "stack", None)
    if st:
        note_module(st[-1].rec, module)


def note_module(rec: StepRecord, module: torch.nn.Module) -> None:
    """Note [parameters by identity]: the storages of a module's own parameters and buffers,
    the first time the step runs it."""
    if StorageWeakRef is None:
        return
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
        rec.params[storage._cdata] = StorageWeakRef(storage)
        rec.param_numels.add(t.numel())


def is_param(rec: StepRecord, t: torch.Tensor, storage: Any) -> bool:
    """Note [parameters by identity]."""
    base = t._base
    if base is None:
        base = t
    if base.is_leaf and (base.requires_grad or isinstance(base, torch.nn.Parameter)):
        return True  # (a Parameter is a leaf: activations skip the slow isinstance)
    ref = rec.params.get(storage._cdata)
    if ref is not None and not ref.expired():
        return True
    # Note [survivors of a pack]: grad_fn makes the node's Python object, which lives as long
    # as the node: asked only of tensors a parameter's size
    return base.numel() in rec.param_numels and _cast_of_param(base)


def _cast_of_param(t: torch.Tensor) -> bool:
    """Note [parameters by identity]: autocast's cast of a parameter (a ``_to_copy`` whose input
    is the parameter itself): remade from the weight every step, parameter-sized, and offloading
    it spent the link twice per step on bytes the weights already are."""
    fn = t.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    nxt = fn.next_functions
    if len(nxt) != 1 or nxt[0][0] is None:
        return False
    var = getattr(nxt[0][0], "variable", None)  # an AccumulateGrad's leaf
    return isinstance(var, torch.nn.Parameter)


def install_module_hook() -> None:
    """Register the global module pre-hook, once per process; it stays (Note [one hook for the
    run]). Called when a context is made and at each step, so that a model compiled afterwards
    is traced with the hook already there."""
    global _hook_handle
    if _hook_handle is None:
        with _hook_lock:
            if _hook_handle is None:
                _hook_handle = torch.nn.modules.module.register_module_forward_pre_hook(
                    _module_pre_hook
                )
    # torch warns at every call of a torch.compile(module) wrapper while any global module hook
    # exists, because the hook fires once more for the wrapper: ours then notes a module that
    # owns no parameters, which changes nothing. Checked each time: a `catch_warnings` block
    # around the first context (pytest has one per test) takes the filter away when it exits.
    if not any(f[0] == "ignore" and getattr(f[1], "pattern", None) == _COMPILE_WARNING
               for f in warnings.filters):
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING, category=UserWarning)


class LiveRefs:
    """The live objects of weak references added to it: iterated and counted as a
    ``WeakSet`` is, but an ``add`` appends a reference the caller made already (a pack makes
    one for its dedup table), without the set's own weak reference and callback (issue 40,
    item 5: a saved tensor's pack is host time on the step's path). Its references are those
    of one step's packs, kept until the step goes (a list only appended to: a pack on another
    thread is never lost to a pruning)."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: List[Any] = []

    def add(self, ref: Any) -> None:
        self._refs.append(ref)

    def _live(self) -> List[Any]:
        return [o for o in (r() for r in list(self._refs)) if o is not None]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())


class StepRecord:
    """One step of a context (Note [one context, many steps]): its tier step and counters,
    what its forward deduplicated and marked, and what its guardrails found."""

    __slots__ = ("index", "tier", "step", "steps", "stats", "stored", "by_seq", "dedup", "marked",
                 "kept", "params", "param_numels", "modules", "active", "tr_base", "tr_end",
                 "devices", "others", "node", "compiled", "checked", "findings", "errors",
                 "pool_full", "packs", "pools_base", "pools_end", "keep_rest", "lock", "rederived",
                 "low_unpacked",
                 "__weakref__")

    def __init__(self, index: int, tier: Any, others: int, tr_base: Dict[Any, Tuple]):
        self.index = index
        self.begin(tier)
        self.stats = OffloadStats(steps=1)
        self.stored = LiveRefs()  # live Stored of this step
        self.by_seq: Dict[int, Any] = {}  # tier seq -> weakref(_Stored), for H2D staging
        #: the lowest seq unpacked so far (None: none), where ``stage_next`` looks below
        self.low_unpacked: Optional[int] = None
        self.dedup: Dict[Tuple[str, int, int], Any] = {}  # -> weakref(Stored)
        #: -> Rederived, while it lives: Note [made again at unpack] in rederive.py
        self.rederived: Any = weakref.WeakValueDictionary()
        self.marked: set = set()
        self.kept: Dict[Tuple[str, int, int], Any] = {}  # Note [kept by a policy]: weak refs
        #: Note [parameters by identity]: storage (StorageImpl address) -> its weak reference,
        #: of the parameters and buffers of the modules this step ran; id(module) -> weakref.
        self.params: Dict[int, Any] = {}
        self.param_numels: set = set()  # their element counts (a cast of one has the same)
        self.modules: Dict[int, Any] = {}
        #: Note [survivors of a pack]: guards each Stored's shared return and staging
        self.lock = threading.Lock()
        self.active = True
        self.tr_base = tr_base  # per device: (stall seconds, forced waits) when it began
        self.tr_end: Optional[Dict[Any, Tuple]] = None  # ... when the next step began
        self.devices: set = set()
        self.others = others  # pool bytes other users held when it began
        #: the process's pool counters (_pools.POOLS) when it began, and when the next began
        self.pools_base: Dict[str, int] = {}
        self.pools_end: Optional[Dict[str, int]] = None
        self.node: Optional[List[Any]] = None  # [node key, storages, bytes] of the last unpack
        self.compiled: Optional[Tuple[int, int, str]] = None  # most a compiled node unpacked
        self.checked: set = set()
        self.findings: List[Tuple[str, str]] = []  # (guardrail, message)
        #: errors of this step's copies nobody waited for (Note [errors go to their owner])
        self.errors: List[BaseException] = []
        self.pool_full = False  # a pool without swap found full after waiting (hooks._full)
        self.packs = 0  # bytes offloaded since the pool's fill was last looked at
        #: keep what is saved from now until backward (Note [the tail stays], planner/search.py)
        self.keep_rest = False

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

