"""What the region runner needs to know about one ATen op call and its tensors.

Note [never saved]
    Some outputs are always recomputed whatever the policy says: views and other aliases (free
    to recompute; saving one would pin its base), outputs of ops that write an input, and random
    ops — replay restores the RNG state once and must draw in the same order, so skipping a
    cached random op would shift every later draw — and allocations (``empty``, ``empty_like``,
    ...): their bytes are garbage until a later op writes them in place (dropout's mask is
    ``empty_like`` then ``bernoulli_``), so saving one offloads garbage and races the write.
    Ops with an ordered side effect are always saved, not replayed (as torch does). An output
    that a later op of the region modifies in place is dropped from the cache at that moment
    and recomputed (torch raises instead; see ``_SaveMode._invalidate`` in modes.py).
    Guarded by tests/python/test_recompute.py::test_random_and_inplace_ops and
    tests/python/test_verify_device.py::test_a_region_writing_what_it_saved_is_no_false_positive.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint as _tc

from ..planner import is_compute_bound, storage_bytes

aten = torch.ops.aten

IGNORED = getattr(_tc, "SAC_IGNORED_OPS", {aten.detach.default, torch.ops.prim.device.default})
#: Note [replay matching]: the key an op's outputs are matched by. It is the op itself except
#: for inductor_compiled_code (one key per compiled region), so the runner calls this only for
#: that op.
storage_key = getattr(_tc, "_sac_storage_key", lambda func, args: func)
try:
    from torch._higher_order_ops.wrap import inductor_compiled_code as INDUCTOR_CODE
except ImportError:  # older torch: every key is the op
    INDUCTOR_CODE = object()
_is_effect = getattr(_tc, "_is_cacheable_effect", lambda op: False)

_forced_cache: Dict[Any, Optional[str]] = {}
#: Ops whose output is uninitialized memory (Note [never saved]).
ALLOCATIONS = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided",
                         "aten::new_empty", "aten::new_empty_strided", "aten::empty_permuted"})


def forced(func: Any) -> Optional[str]:
    """Note [never saved]: why this op's output is never (or always) saved, else None:
    "view", "mutates an input", "random", "allocates only" (never) or "effect" (always)."""
    try:
        return _forced_cache[func]
    except KeyError:
        pass
    why: Optional[str] = None
    schema = getattr(func, "_schema", None)
    try:
        effect = _is_effect(func)
    except Exception:
        effect = False
    if effect:
        why = "effect"
    elif schema is not None:
        if schema.is_mutable:  # in-place and out= ops (their returns alias the written input)
            why = "mutates an input"
        elif getattr(func, "is_view", False) or any(
            r.alias_info is not None for r in schema.returns
        ):
            why = "view"
        elif torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            why = "random"
        elif schema.name in ALLOCATIONS:
            why = "allocates only"
    _forced_cache[func] = why
    return why


class OpInfo:
    """What the region runner needs of one op that its schema already says, worked out on the
    op's first call: the forward then pays a dict lookup per op for it, not a schema walk."""

    __slots__ = ("forced", "name", "compute_bound", "plain", "nested", "kw", "generic",
                 "dropout", "written")

    def __init__(self, func: Any):
        self.forced = forced(func)  # Note [never saved]
        self.name = str(func)
        self.compute_bound = is_compute_bound(func)
        schema = getattr(func, "_schema", None)
        #: argument positions typed Tensor or Tensor? (read as they are), and those that may
        #: hold several tensors (Tensor[], Tensor?[]); kw: keyword-only names of either kind;
        #: generic: a type the schema cannot vouch for, so every argument is looked at.
        self.plain: Tuple[int, ...] = ()
        self.nested: Tuple[int, ...] = ()
        self.kw: Tuple[str, ...] = ()
        self.generic = schema is None
        self.dropout: Optional[Tuple[int, str, Any]] = None
        self.written: Tuple[Tuple[int, str], ...] = ()
        if schema is None:
            return
        plain, nested, kw, written = [], [], [], []
        for i, a in enumerate(schema.arguments):
            t = str(a.type)
            if "Tensor" in t:
                kw.append(a.name)
                (plain if t in ("Tensor", "Optional[Tensor]") else nested).append(i)
            elif "Any" in t or "PyObject" in t:
                self.generic = True
            if a.name == "dropout_p" and self.dropout is None:
                self.dropout = (i, a.name, a.default_value)
            if a.alias_info is not None and a.alias_info.is_write:
                written.append((i, a.name))
        self.plain, self.nested, self.kw = tuple(plain), tuple(nested), tuple(kw)
        self.written = tuple(written)

    def no_dropout(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """A fused-attention call with ``dropout_p == 0`` draws no random numbers."""
        if self.dropout is None:
            return False
        i, name, default = self.dropout
        v = args[i] if i < len(args) else kwargs.get(name, default)
        return v == 0

    def tensors(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
        """The op's tensor arguments, as :func:`tensor_args` finds them."""
        if self.generic:
            return tensor_args(args, kwargs)
        out = []
        n = len(args)
        for i in self.plain:
            if i < n:
                a = args[i]
                if isinstance(a, torch.Tensor):
                    out.append(a)
        for i in self.nested:
            if i < n:
                a = args[i]
                if isinstance(a, torch.Tensor):
                    out.append(a)
                elif isinstance(a, (list, tuple)):
                    out.extend(x for x in a if isinstance(x, torch.Tensor))
        if kwargs:
            for name in self.kw:
                a = kwargs.get(name)
                if isinstance(a, torch.Tensor):
                    out.append(a)
                elif isinstance(a, (list, tuple)):
                    out.extend(x for x in a if isinstance(x, torch.Tensor))
        return out

    def moved_in(self, args: Tuple[Any, ...]) -> int:
        """Bytes of the tensors passed positionally as whole arguments (cost model input)."""
        total = 0
        for i in (self.plain if not self.generic else range(len(args))):
            if i < len(args):
                a = args[i]
                if isinstance(a, torch.Tensor):
                    total += a.numel() * a.element_size()
        return total

    def written_tensors(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Any]:
        written = tuple(args[i] if i < len(args) else kwargs.get(name)
                        for i, name in self.written)
        return tensor_args(written, {})


_INFO: Dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = OpInfo(func)
    return info


def tensor_args(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


# Note [storage names]
#     A storage is named by its StorageImpl (``untyped_storage()._cdata``), not by its data
#     pointer: both are equal for a tensor and its views and unique among live storages, but
#     every fake tensor's data pointer is 0 (``spillover.estimate`` runs the regions on fake
#     tensors, and would see every output as a view of every input). Like an address, the
#     name may be reused once its storage is freed (the save mode keeps the latest producer).
#     Guarded by tests/python/test_estimate.py::test_regions_record_on_fake_tensors.


def skey(t: torch.Tensor) -> Tuple[Any, int]:
    """Which storage ``t`` views (equal for a tensor and its views; Note [storage
    names])."""
    return (t.device, t.untyped_storage()._cdata)


def producer_of(producer: Dict[Tuple[Any, int], int], t: torch.Tensor) -> Optional[int]:
    """The op that produced ``t``'s storage, or None (also for a tensor without a storage
    torch lets us see, e.g. a functional or sparse one)."""
    try:
        return producer.get(skey(t))
    except (RuntimeError, NotImplementedError):
        return None


def detach(x: Any) -> Any:
    """An alias of ``x`` without autograd history that shares its version counter, from inside
    a dispatch mode (below autograd): torch's ``_detach_helper`` (2.13+), or what it does.
    A plain ``detach()`` there skips ADInplaceOrView, which carries the version counter over:
    the alias would start at version 0, and an in-place write to the region's output after
    forward would go unseen (torch 2.8 and 2.11 did so until 2026-12-06)."""
    if not isinstance(x, torch.Tensor):
        return x
    if _DETACH_HELPER is not None:
        return _DETACH_HELPER(x)
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


_DETACH_HELPER = getattr(_tc, "_detach_helper", None)


# ---- a region's arguments ------------------------------------------------------------------------


def input_bytes(args: Tuple[Any, ...]) -> int:
    ts = [a for a in args if isinstance(a, torch.Tensor) and not (a.is_leaf and a.requires_grad)]
    return storage_bytes(ts)


def new_grad_bytes(fn: Callable[..., Any]) -> int:
    """Note [gradients as backward goes] in planner/search.py: the bytes of the gradients the
    backward of a region running ``fn`` (a module's bound forward) makes for its parameters:
    those that require grad and have none yet (with gradient accumulation they exist before
    the step); a sharded one's local shard. 0 where ``fn`` is not a module's."""
    module = getattr(fn, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        return 0
    total = 0
    for p in module.parameters():
        if p.requires_grad and p.grad is None:
            local = getattr(p, "_local_tensor", p)
            total += local.numel() * local.element_size()
    return total


#: The device regions name in their records while ``spillover.estimate`` traces a GPU's step on
#: fake CPU tensors (Note [fake device] in spillover/estimate/fakes.py); None: the tensors'.
DEVICE_OVERRIDE = threading.local()


def device_of(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    """The device a region runs on, as its record names it."""
    override = getattr(DEVICE_OVERRIDE, "name", None)
    if override is not None:
        return override
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            d = a.device
            return f"cuda:{d.index if d.index is not None else torch.cuda.current_device()}" \
                if d.type == "cuda" else d.type
    return "cpu"


def key_of(fn: Callable[..., Any]) -> Any:
    """A region's identity across steps, for a standalone ``checkpoint(fn, ...)``."""
    target = getattr(fn, "__self__", None)
    if target is not None:
        return ("method", id(target), getattr(fn, "__name__", ""))
    if isinstance(fn, functools.partial):
        return ("partial", key_of(fn.func), tuple(id(a) for a in fn.args))
    return ("fn", id(fn))
