"""Saved tensors made again at unpack from what their own op saved (``offload_context``'s
``rederive``), instead of crossing the link twice.

Note [made again at unpack]
    Some saved tensors are the output of a cheap elementwise op whose inputs autograd holds
    anyway, because that op's own backward saved them: ``silu(gate)`` (SiLU saves ``gate``),
    ``silu(gate) * up`` (the product saves both factors when both need gradients), GELU, and
    an RMSNorm's products (``x * rsqrt(var)`` and ``weight * x``). A Llama block in bf16 saves
    four such tensors (the MLP's activation and product, the two norms' outputs): on the GPU
    probe's 1B Llama (seq 4096) 120 of the 440 MiB each layer saves, which the host tier sent
    down the link and back (link-bound there: 8.7 GB each way a step at 54 GB/s). Made again
    from the saved inputs at unpack, by the same kernel on the same bytes, they are bitwise
    what was saved, for one elementwise kernel and its dispatch instead of two copies and the
    host's time for an offload. ``spillover.estimate(device="h200")`` of that model: the host
    mode ships 6.65 GB instead of 8.68 and its step drops from 0.317 to 0.251 s, at the same
    peak.

    What pack checks, from the tensor and its autograd node only (no saved tensor unpacked):
    the node is one of ``_OPS``; the tensor is its output or a view of it (a linear layer
    saves a 2-D view of its input), never written in place (``_version`` 0); and every input
    of the op needs a gradient (one that needs none has no next function, and a product does
    not save the other factor then). Then pack copies nothing and returns a :class:`Remade`
    (the saved view) of a :class:`Rederived` (the storage: the node, and a weak reference to
    the tensor, whose version unpack checks, raising autograd's error as a shipped tensor's
    unpack does). Unpack calls the op on the node's saved inputs (``node._saved_self``:
    autograd unpacks them through the same hooks and checks their versions). A device's tier
    holds an input it brought back for this for the input's own node, whose backward comes
    after this one's, so its bytes cross the link once. The saves of one storage share its
    :class:`Rederived`, which holds the output from its first unpack until each save was
    unpacked once (the projections reading one norm's output make it once), then lets it go:
    a second backward (``retain_graph=True``) makes it again.

    Only tensors the context would ship are made again: kept ones (small, parameters, marked,
    kept by a policy or the planner) stay as they are, except in the regions ``policy="auto"``
    runs plainly with their cheap saves made again (``OffloadContext.remade_or_kept``, or
    :func:`pack` without a context: Note [a plain tail makes its cheap saves again] in
    planner/search.py). A tensor smaller than ``REDERIVE_MIN_BYTES`` is not worth an autograd
    node's Python object per pack (Note [survivors of a pack] in hooks.py).
    ``rederive=False`` (``SPILLOVER_REDERIVE=0``) ships them all.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..config import rederive_enabled

__all__ = ["FUNCS", "REDERIVE_MIN_BYTES", "Rederived", "Remade", "pack", "recipe", "remade",
           "unpack"]

#: Note [made again at unpack]: smaller saved tensors are shipped (or kept) as before
REDERIVE_MIN_BYTES = 1 << 20

_aten = torch.ops.aten


def _gelu(node: Any) -> torch.Tensor:
    return _aten.gelu.default(node._saved_self, approximate=node._saved_approximate)


_MAKING = threading.local()


def making() -> bool:
    """Whether this thread is making a tensor again: an unpack now reads a saved input that
    the input's own node unpacks again soon (its backward comes after this one's), so a tier
    that brought its bytes over the link holds them for that unpack instead of copying them
    twice (Note [made again at unpack])."""
    return getattr(_MAKING, "depth", 0) > 0


#: autograd node class name -> how its output is made again from what the node saved
_OPS: Dict[str, Callable[[Any], torch.Tensor]] = {
    "SiluBackward0": lambda node: _aten.silu.default(node._saved_self),
    "MulBackward0": lambda node: _aten.mul.Tensor(node._saved_self, node._saved_other),
    "GeluBackward0": _gelu,
}

#: the ops of ``_OPS``, as a region's record sees them (Note [made again at unpack]: a region
#: run plainly need not hold their saved outputs, where every input needs a gradient)
FUNCS = frozenset({_aten.silu.default, _aten.mul.Tensor, _aten.gelu.default})

#: node type -> its entry of ``_OPS`` (None: not one of them), filled as types are seen
_BY_TYPE: Dict[type, Optional[Callable[[Any], torch.Tensor]]] = {}


def recipe(t: torch.Tensor) -> Optional[Tuple[Any, Callable[[Any], torch.Tensor],
                                                torch.Tensor]]:
    """Note [made again at unpack]: ``(node, make, base)`` when ``t``'s storage (``base``:
    ``t``, or the tensor ``t`` views) can be made again from what its autograd node saved,
    else None."""
    base = t._base
    if base is None:
        base = t
    elif base._base is not None:  # pragma: no cover -- torch keeps the root base
        return None
    node = base.grad_fn
    if node is None or t._version:
        return None
    cls = type(node)
    make = _BY_TYPE.get(cls, False)
    if make is False:
        make = _BY_TYPE[cls] = _OPS.get(cls.__name__)
    if make is None:
        return None
    # every input needs a gradient, so the node saved every one (an input that needs none has
    # no next function, and a product saves a factor only for the other's gradient)
    if not all(fn is not None for fn, _ in node.next_functions):
        return None
    return node, make, base


class Rederived:
    """One storage made again at unpack: its node, what to call, what the output must look
    like, and the output while saves of it wait for their unpack."""

    __slots__ = ("node", "make", "record", "nbytes", "size", "stride", "dtype", "saves",
                 "pending", "held", "base", "version", "__weakref__")

    def __init__(self, node: Any, make: Callable[[Any], torch.Tensor], base: torch.Tensor,
                 record: Any, nbytes: int):
        self.node, self.make, self.record, self.nbytes = node, make, record, nbytes
        self.size, self.stride, self.dtype = tuple(base.size()), base.stride(), base.dtype
        #: the tensor it was (every view of it keeps it alive) and its version at pack: one
        #: written in place since raises autograd's error, as a shipped one does
        self.base, self.version = weakref.ref(base), base._version
        self.saves = 0  # packs that returned a view of it
        self.pending = 0  # of those, not unpacked yet in this backward
        self.held: Optional[torch.Tensor] = None

    def get(self) -> torch.Tensor:
        """The storage's tensor, made again (or the one made for an earlier save still
        waiting)."""
        out = self.held
        was = self.base()
        if was is not None and was._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a saved tensor of shape {list(self.size)} and dtype "
                f"{self.dtype} was changed after autograd saved it (spillover was to make it "
                "again at unpack; without spillover autograd raises the same error). Use an "
                "out-of-place op, or clone the tensor before modifying it.")
        if out is None:
            _MAKING.depth = getattr(_MAKING, "depth", 0) + 1
            try:
                with torch.no_grad():
                    out = self.make(self.node)
            finally:
                _MAKING.depth -= 1
            if (tuple(out.size()) != self.size or out.stride() != self.stride
                    or out.dtype != self.dtype):
                raise RuntimeError(
                    f"offload_context: a saved tensor made again at unpack (Note [made again "
                    f"at unpack], {type(self.node).__name__}) came back as "
                    f"{out.dtype} {list(out.size())} strides {out.stride()}, not the saved "
                    f"{self.dtype} {list(self.size)} strides {self.stride}. Turn it off with "
                    "offload_context(rederive=False) or SPILLOVER_REDERIVE=0, and report it.")
            self.pending = self.saves
        self.pending -= 1
        self.held = out if self.pending > 0 else None
        return out


class Remade:
    """What pack returns: the saved tensor's view of a :class:`Rederived` storage."""

    __slots__ = ("of", "size", "stride", "offset")

    def __init__(self, of: Rederived, t: torch.Tensor):
        of.saves += 1
        self.of = of
        self.size, self.stride, self.offset = tuple(t.size()), t.stride(), t.storage_offset()

    def get(self) -> torch.Tensor:
        base = self.of.get()
        if self.offset == 0 and self.size == self.of.size and self.stride == self.of.stride:
            return base
        return base.as_strided(self.size, self.stride, self.offset)


def remade(table: Any, key: Any, t: torch.Tensor, record: Any,
           nbytes: int) -> Tuple[Optional[Remade], bool]:
    """Note [made again at unpack]: the handle of ``t`` (None where it is not made again) and
    whether it is its storage's first save; ``table`` (a ``WeakValueDictionary``: storage key
    -> :class:`Rederived`) shares one storage's handle among its saves."""
    found = recipe(t)
    if found is None:
        return None, False
    node, make, base = found
    h = table.get(key)
    if h is not None and h.node is node:
        return Remade(h, t), False
    h = table[key] = Rederived(node, make, base, record, nbytes)
    return Remade(h, t), True


# ---- without a context: Note [a plain tail makes its cheap saves again] (planner/search.py) ----

_TABLE = threading.local()


def pack(t: torch.Tensor) -> Any:
    """A saved-tensor pack hook for a region ``policy="auto"`` runs plainly with no offload
    context: the tensor itself, or the handle that makes it again at unpack (with
    ``SPILLOVER_REDERIVE=0``, always the tensor)."""
    if not rederive_enabled():
        return t
    try:
        st = t.untyped_storage()
        key, nbytes = (t.device, st._cdata), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return t
    if nbytes < REDERIVE_MIN_BYTES:
        return t
    made, _ = remade(_table(), key, t, None, nbytes)  # one storage's saves share its handle
    return t if made is None else made


def unpack(x: Any) -> Any:
    return x.get() if type(x) is Remade else x


def _table() -> Any:
    table = getattr(_TABLE, "table", None)
    if table is None:
        table = _TABLE.table = weakref.WeakValueDictionary()
    return table
