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

Note [staging distance]
    On a device, each unpack stages the next entries backward is expected to unpack (the
    tier's learned order) onto the H2D stream: up to 4 entries, and no more bytes than
    min(512 MiB, an eighth of the pool) -- the staged copies hold their pool views until they
    ran, and views keep blocks from the tier's read-ahead and eviction, so a bound that ignored
    a 64 MiB pool starved the read-ahead. Staging goes on past an entry that is not in the pool
    (the tier's read-ahead owns it), takes entries whose D2H copy was not seen complete (the
    H2D stream waits for its event, not the host), and the pieces of a storage in pieces.
    It refills in batches, once half the distance has been used: the H2D stream is ordered
    after the compute stream's queued work once per batch (two device calls), not per entry.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from .. import _runtime
from ..config import Config, format_size
from ..errors import IntegrityError
from .link import block_tensor
from .rederive import Remade, making
from .registry import StepRecord, capturing
from .stored import Packed, Stored

__all__ = ["Unpack"]

#: Note [staging distance]: entries and bytes staged ahead of unpack (device links).
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
        _last: Optional[StepRecord]
        _checks: Any

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
        if type(packed) is Remade:  # Note [made again at unpack] in rederive.py
            return self._remake(packed)
        s = packed.stored
        if s.device.type == "cuda" and capturing(s.device):  # Note [graph capture]
            raise RuntimeError(
                f"offload_context: a saved tensor of shape {list(packed.size)} offloaded by an "
                "eager forward is unpacked under CUDA graph capture; its copy back would read a "
                "host block at every replay of the graph. Capture forward and backward "
                "together (pack passes tensors through under capture), or run this backward "
                "eagerly")
        rec = s.record
        rec.keep_rest = False  # backward started (Note [the tail stays], planner/search.py)
        if rec.low_unpacked is None or s.seq < rec.low_unpacked:
            rec.low_unpacked = s.seq
        node = self._note_backward(rec)
        if node is not None:
            self._note_node(rec, node, s)
        raw = self._materialize(s, packed)
        packed.check_version()
        out = torch.empty(0, dtype=packed.dtype, device=s.device)
        out.set_(raw.untyped_storage(), packed.offset, packed.size, packed.stride)
        rec.stats.add(tensors_unpacked=1, bytes_unpacked=s.nbytes)
        return out

    def _remake(self, r: Remade) -> torch.Tensor:
        rec = r.of.record
        rec.keep_rest = False
        self._note_backward(rec)
        made = r.of.held is None
        out = r.get()
        rec.stats.add(tensors_unpacked=1, rederive_runs=int(made))
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
        self._checks.check()  # Note [verify on the device]: one synchronisation per backward
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
            tr.reap(s.record.errors, s.nbytes)
        if src is not None:  # Note [source returned]
            stats.add(unpacks_from_source=1)
            s.entry.note_used()
            if not tr.host_is_device:
                for c in s.copies:
                    tr.returned(c, src)
            return src
        with s._lock:
            if s._cached is not None:  # another view of this storage already brought it back
                raw = s._cached
                s._cached_uses += 1
                if s._cached_uses >= s.views:
                    s._cached, s._cached_uses = None, 0
                if not tr.host_is_device:
                    tr.share(raw, s._cached_stream)
                return raw
            staged, s.staged = s.staged, None
            if staged is not None and staged is not True:
                s.entry.note_used()
                stats.add(unpacks_staged=1)
                raw = tr.use(staged)
            else:
                raw = self._bring_back(tr, s, packed)
            if not tr.host_is_device and s.copies and s.copies[0].packed_sum is not None:
                off = 0  # Note [verify on the device], check 2: piece by piece
                for c in s.copies:
                    self._checks.returned(raw[off : off + c.nbytes], c.packed_sum, c.what)
                    off += c.nbytes
            again = making()  # Note [made again at unpack]: its own node unpacks it next
            if (s.views > 1 or again) and (not tr.host_is_device or s.chunked):
                # Note [views share one return]
                s._cached, s._cached_uses = raw, 0 if again else 1
                s._cached_stream = None if tr.host_is_device else tr.stream()
        self._stage_ahead(tr, s)
        return raw

    def _bring_back(self, tr: Any, s: Stored, packed: Packed) -> torch.Tensor:
        """The bytes from the tier: on a CPU host a view of the block (Note [host link]); on a
        device copied into a new tensor of the using stream now, piece by piece for a storage
        in pieces (Note [pieces come back piece by piece] in link/device.py)."""
        if tr.host_is_device and s.copies:  # (the host link copies when it packs: none)
            for c in s.copies:
                c.wait()
        where = "nvme" if self.nvme else "host"
        # A device copy back is ordered after the D2H copy on the device (its ``after``): an
        # entry not yet seen landing gives its staging view (Note [unpack before the seal] in
        # rust/tier); only the host's own reads need the seal.
        try:
            if tr.host_is_device:
                views = [s.entry.get()]
            elif not s.chunked:
                views = [s.entry.get(staging=True)]
            else:
                views = [h.get(staging=True) for h in reversed(s.entry.parts)][::-1]
        except IntegrityError as e:
            raise IntegrityError(
                f"a saved tensor of shape {list(packed.size)} and dtype {packed.dtype} read "
                f"back from the {where} tier does not match its checksum ({e})"
            ) from None
        view = views[0]
        # A borrowed view is the tensor's own memory, its write not landed: nothing was read.
        if not s.chunked and not view.borrowed and not self._in_pool(view.address):
            _runtime.warn_once(
                "pool-overflow",
                f"spillover: the {format_size(self._pool.capacity)} host pool had no room to "
                f"read back a {format_size(s.nbytes)} tensor; used a temporary buffer (slower). "
                "Raise SPILLOVER_HOST_POOL_BYTES to a few times the largest saved tensor.",
            )
        if tr.host_is_device:
            return block_tensor(view)
        return tr.bring_back(list(zip(views, s.copies)))

    def _stage_ahead(self, tr: Any, s: Stored) -> None:
        """Start the H2D copies of the next entries backward is expected to unpack, a bounded
        distance ahead (Note [staging distance]), from blocks in the pool -- also those whose
        D2H copy has not been seen complete (the H2D stream waits for it) and the pieces of a
        storage in pieces; an entry not in the pool is the tier's read-ahead's, and staging
        goes on past it."""
        rec = s.record
        ref = rec.by_seq.get(s.seq)
        if tr.host_is_device or ref is None or ref() is not s:
            return  # nothing staged on a CPU host; an entry of a pool grown past: not ahead
        ahead_entries, ahead_bytes = self._staging_distance()
        self._stage(tr, rec, s.device, rec.step.expected_after(s.seq, 4 * ahead_entries),
                    ahead_entries, ahead_bytes, refill=True)

    def stage_next(self, nbytes: int) -> int:
        """Start the H2D copies of what backward is expected to unpack next, up to ``nbytes``
        (Note [regions shipped whole] in planner/search.py: a region a plan shipped whole,
        brought back while the backward of the regions after it runs); the entries below the
        lowest this backward unpacked, next first. Returns how many copies it started."""
        rec = self._last  # the latest step: the one whose backward runs
        if rec is None:
            return 0
        low = rec.low_unpacked
        last = max((q for q in list(rec.by_seq) if low is None or q < low), default=None)
        ref = rec.by_seq.get(last) if last is not None else None
        s = ref() if ref is not None else None
        if s is None:
            return 0
        tr = self._transfer(s.device)
        if tr.host_is_device:
            return 0
        seqs = [last] + list(rec.step.expected_after(last, len(rec.by_seq)))
        return self._stage(tr, rec, s.device, seqs, len(seqs), nbytes, refill=False)

    def _stage(self, tr: Any, rec: StepRecord, device: Any, seqs: Any, ahead_entries: int,
               ahead_bytes: int, refill: bool) -> int:
        """Stage the entries ``seqs`` in order, up to ``ahead_entries`` and ``ahead_bytes``
        (those staged already count), in one batch; ``refill``: only once half the distance
        was used (Note [staging distance]). Returns how many it staged now."""
        staged, nbytes = 0, 0
        todo: List[Tuple[Stored, List[Tuple[Any, Any]]]] = []
        for seq in seqs:
            if staged >= ahead_entries or nbytes >= ahead_bytes:
                break
            ref = rec.by_seq.get(seq)
            c = ref() if ref is not None else None
            if c is None or c.device != device:
                continue
            with c._lock:
                if c.staged is not None:  # staged at an earlier unpack: within the distance
                    staged += 1
                    nbytes += c.nbytes
                    continue
                if c._cached is not None or c.source() is not None:
                    continue
                parts = c.entry.parts if c.chunked else [c.entry]
                views = [h.try_get(staging=True) for h in parts]
                if any(v is None for v in views):
                    continue  # on disk or being written: the tier's read-ahead owns it
                c.staged = True  # claimed: filled below
            todo.append((c, list(zip(views, c.copies))))
            staged += 1
            nbytes += c.nbytes
        if not todo or (refill and (staged - len(todo)) * 2 >= ahead_entries):
            # Note [staging distance]: refill only once half the distance is used, in one
            # batch (one ordering of the H2D stream after the compute stream for all of it)
            for c, _ in todo:
                with c._lock:
                    c.staged = None
            return 0
        for (c, _), handed in zip(todo, tr.stage([parts for _, parts in todo])):
            with c._lock:
                c.staged = handed
        return len(todo)

    def _staging_distance(self) -> Tuple[int, int]:
        """Note [staging distance]: entries and bytes staged ahead of unpack -- 4 entries and
        at most min(512 MiB, an eighth of the pool), so that staging never holds the views the
        tier's read-ahead needs."""
        pool = self._pool.capacity if self._pool is not None else STAGE_AHEAD_BYTES
        return STAGE_AHEAD_ENTRIES, max(1, min(STAGE_AHEAD_BYTES, pool // 8))
