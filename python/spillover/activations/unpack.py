"""The unpack hook of ``offload_context``: bring a saved storage's bytes back (the source still
on the device, another view's return, a copy staged ahead, or the tier), rebuild the exact view
that was saved, stage the next ones ahead, and run the guardrails once backward ends.

Note [views share one return]
    When several views of one storage were saved, the first unpack's bytes serve the others
    until each has had them: on a device, so the bytes cross the link once; on a CPU host for a
    storage in pieces, so its pieces are read and gathered once (an unpack of a whole entry
    there is a view of its block, free to repeat). Measured on the GPT benchmark's 128 MiB
    attention probabilities, each saved through two views: 1.3 s of backward's 1.45 s of
    waiting was the second gathering of each.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Dict

import torch

from .. import _runtime
from ..config import Config, format_size
from ..errors import IntegrityError
from .link import block_tensor
from .registry import StepRecord
from .stored import Packed, Stored

__all__ = ["Unpack"]

#: H2D staging distance (CUDA and the simulated device): entries and bytes ahead of unpack.
STAGE_AHEAD_ENTRIES = 4
STAGE_AHEAD_BYTES = 512 << 20


class Unpack:
    """The unpack side of :class:`~.hooks.Hooks` (a mixin of the context)."""

    if TYPE_CHECKING:  # what unpack reads of the context
        config: Config
        _lock: threading.Lock
        _transfers: Dict[Any, Any]
        _in_backward: bool
        _bwd_records: Dict[int, StepRecord]

        @property
        def _pool(self) -> Any: ...

        @property
        def nvme(self) -> bool: ...

        def _check_pool(self, rec: StepRecord) -> None: ...

        def _check_compiled(self, rec: StepRecord) -> None: ...

        def _check_speed(self, rec: StepRecord) -> None: ...

        def _note_node(self, rec: StepRecord, node: Any, s: Stored) -> None: ...

        def _transfer(self, device: torch.device) -> Any: ...

        def _in_pool(self, addr: int) -> bool: ...

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
        if s.copies:  # the tier can give the bytes back only once they have landed
            t0 = time.perf_counter()
            for c in s.copies:
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
        # A borrowed view is the tensor's own memory, its write not landed: nothing was read.
        if not s.chunked and not view.borrowed and not self._in_pool(view.address):
            _runtime.warn_once(
                "pool-overflow",
                f"spillover: the {format_size(self._pool.capacity)} host pool had no room to "
                f"read back a {format_size(s.nbytes)} tensor; used a temporary buffer (slower). "
                "Raise SPILLOVER_HOST_POOL_BYTES to a few times the largest saved tensor.",
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
