"""The NVMe drive and the pool behind it, as the simulated offload context (:mod:`.offload`)
models them: on a CPU host, storages written from their own memory or copied into the pool
(Note [written from the tensor] in rust/tier/direct.rs), write-behind, the write hold and
dropping clean entries; reads on either host. Note [simulated offload] in offload.py says what
is modeled; :class:`~.offload.SimContext` is the one class that mixes this in.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, List

import torch

from .devices import Device
from .trace import Tracker

if TYPE_CHECKING:
    from .offload import _Entry

__all__ = ["DriveModel"]


class DriveModel:
    """The pool's and the drive's bookkeeping of :class:`~.offload.SimContext` (its attributes
    are set by that class's ``__init__``)."""

    device: Device
    tracker: Tracker
    capacity: int
    figures: Any
    _piece: int
    _sizes: List[int]
    _learned: List[int]
    _after: List[int]
    _pool: collections.OrderedDict[Any, list]
    _dirty: collections.deque[Any]
    _dirty_bytes: int
    _writing: collections.deque[Any]
    _writing_bytes: int
    _held_direct: collections.deque[Any]
    _largest_written: int
    _in_use: int
    _disk_free: float

    def _pack_direct(self, e: _Entry, t: torch.Tensor, nbytes: int) -> None:
        """Each piece is copied into the pool while it has room to spare, or when backward
        needs it first (dropping clean entries); else written from the tensor, which is held
        until its last such write lands (the first piece waiting for the hold)."""
        dev = self.device
        if e.chunked:
            piece = max(4096, (self.capacity // 8) // 4096 * 4096)
            pieces = [min(piece, nbytes - o) for o in range(0, nbytes, piece)]
        else:
            pieces = [nbytes]
        done = 0.0
        for i, n in enumerate(pieces):
            k = self._piece
            self._piece += 1
            self._sizes.append(n)
            blk = _blocks(n)
            if self._pool_room() >= blk or (self._needed_first(k, n) and self._drop_clean(blk)):
                self.tracker.clock += n / dev.link_bytes_per_s  # the copy, on these cores
                self._pool[(e.seq, i)] = [blk, None]
                self._dirty.append((e.seq, i))
                self._dirty_bytes += blk
                self._write_behind()
                continue
            if i == 0:
                self._hold(n)
            done = self._write(n)
            self._writing_bytes += n
            self._largest_written = max(self._largest_written, n)
            self._writing.append((done, n))
        e.in_pool = all((e.seq, i) in self._pool for i in range(len(pieces)))
        e.pieces = len(pieces)
        if done:
            e.source = t
            e.write_done = done
            self._held_direct.append(e)

    def _pool_room(self) -> int:
        """Free bytes of the pool: leased without dropping anything or waiting."""
        return self.capacity - self._in_use - sum(b for b, _ in self._pool.values())

    def _needed_first(self, k: int, n: int) -> bool:
        """The learned order says backward unpacks piece ``k`` within the pool less the
        read-ahead window (rust/tier/policy.rs, ``needed_within``)."""
        learned = self._learned
        if k >= len(learned) or learned[k] != n:
            return False
        window = min(self.capacity // 4, 256 << 20)
        return self._after[k] + n <= self.capacity - window

    def _drop_clean(self, blk: int) -> bool:
        """Make room by dropping written (clean) pool entries, earliest packed first."""
        now = self.tracker.clock
        for key in list(self._pool):
            if self._pool_room() >= blk:
                break
            b, done = self._pool[key]
            if done is not None and done <= now:
                del self._pool[key]
        return self._pool_room() >= blk

    def _write(self, n: int) -> float:
        dev = self.device
        start = max(self._disk_free, self.tracker.clock)
        self._disk_free = start + n / (dev.nvme_write_bytes_per_s or float("inf"))
        self.figures.bytes_written += n
        return self._disk_free

    def _write_behind(self) -> None:
        """Once a quarter of the pool is dirty, the earliest packed dirty entries are written
        (Note [write early, drop late] in rust/tier/policy.rs)."""
        while self._dirty and self._dirty_bytes > self.capacity // 4:
            key = self._dirty.popleft()
            entry = self._pool.get(key)
            if entry is None:
                continue
            self._dirty_bytes -= entry[0]
            entry[1] = self._write(entry[0])

    def _hold(self, n: int) -> None:
        """Wait, oldest write first, while more than the pool plus the largest storage written
        so far would be in flight (the write hold)."""
        self._poll_writes(self.tracker.clock)
        limit = self.capacity + max(self._largest_written, n)
        while self._writing and self._writing_bytes + n > limit:
            wait = max(0.0, self._writing[0][0] - self.tracker.clock)
            self.tracker.clock += wait
            self.figures.stall_seconds += wait
            self._poll_writes(self.tracker.clock)

    def _poll_writes(self, now: float) -> None:
        while self._writing and self._writing[0][0] <= now:
            _, n = self._writing.popleft()
            self._writing_bytes -= n
        while self._held_direct and self._held_direct[0].write_done <= now:
            self._held_direct.popleft().source = None

    def _read(self, e: _Entry) -> None:
        dev = self.device
        if e.read_done is None:
            start = max(self._disk_free, self.tracker.clock)
            self._disk_free = start + e.nbytes / dev.nvme_read_bytes_per_s
            e.read_done = self._disk_free
            self.figures.bytes_read += e.nbytes
        wait = max(0.0, e.read_done - self.tracker.clock)
        self.tracker.clock += wait
        self.figures.stall_seconds += wait
        e.on_disk = False


def _blocks(nbytes: int) -> int:
    """Pool bytes an entry leases (4 KiB granules)."""
    return (nbytes + 4095) // 4096 * 4096
