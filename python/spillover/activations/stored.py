"""What pack returns: one offloaded storage (:class:`Stored`: its tier entry and the copies
that fill it), and one saved view of it (:class:`Packed`: dtype, size, stride, offset, version).

Note [source returned]
    An unpack whose entry's device→host copy still holds its source (the last tensors of a
    forward, unpacked first by backward) returns that source: the bytes are on the device
    already, and copying them back would spend the link on bytes that never left.

Note [storage identity]
    Views are deduplicated by (device, storage address), but an address can be reused once the
    storage is freed. A dedup entry therefore also holds a *weak* reference to the storage and
    matches only while that storage is alive (a freed storage cannot have more views saved).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch

from .. import _native

__all__ = ["Packed", "Stored"]

# held here: the torch module may be cleared at exit before the last Stored goes
_EXPIRED = torch.UntypedStorage._expired
_FREE_WEAK = torch.UntypedStorage._free_weak_ref


class Stored:
    """One offloaded storage: its tier entry (a ``Handle``, or a ``Gathered`` of pieces) and the
    device->host copies that fill it."""

    __slots__ = ("record", "entry", "nbytes", "device", "copies", "seq", "views", "staged",
                 "chunked", "src_weak", "src_version", "_cached", "_cached_uses", "_cached_stream",
                 "__weakref__")

    def __init__(self, record: Any, entry: Any, nbytes: int, device: torch.device,
                 copies: Sequence[Any], seq: int):
        self.record = record  # its step (Note [one context, many steps]): lives as long as it
        self.entry = entry
        self.nbytes = nbytes
        self.device = device
        self.copies = copies  # none on a CPU host (Note [host link])
        self.seq = seq  # the tier's pack order (the last piece's, for a gathered storage)
        self.chunked = isinstance(entry, _native.Gathered)
        self.views = 0
        #: Note [storage identity]: a weak reference to the source storage (torch's own, an
        #: int: Note [survivors of a pack] in hooks.py) and its version when packed, for the
        #: step's dedup table; 0: none
        self.src_weak = 0
        self.src_version = 0
        self.staged: Any = None  # (device tensor, event) staged ahead of its unpack
        self._cached: Optional[torch.Tensor] = None  # device bytes shared by several views
        self._cached_uses = 0
        self._cached_stream: Any = None  # the stream it was brought back on

    def source_alive(self) -> bool:
        return bool(self.src_weak) and not _EXPIRED(self.src_weak)

    def __del__(self) -> None:
        if self.src_weak:
            _FREE_WEAK(self.src_weak)

    @property
    def _lock(self) -> Any:
        """Its step's lock (Note [survivors of a pack] in hooks.py): guards the shared return
        and the staging claim."""
        return self.record.lock

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
        self.size = tuple(t.size())  # a tuple of ints leaves the GC (Note [survivors of a pack])
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = t._version
        self.tref = weakref.ref(t)  # Note [in-place after pack] in link/device.py
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
