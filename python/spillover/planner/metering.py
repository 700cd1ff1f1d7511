"""The step's peak, as the tuner measures it (Note [peak feedback] in tuner.py): from the
wrapped model's forward to the first region of its backward, on the device's counters or, on a
CPU, its live tensor storages or its RSS (:mod:`spillover._peak`).

Note [a CPU step's peak is its storages']
    On a CPU the budget is the step's live tensor storages plus the offload context's pool (this
    host's RAM: the way the benches and tests measure a step here, the whole step's allocator
    events plus ``stats().pool_capacity``). A CPU host's tuning steps were read by the kernel's
    RSS high-water mark, which reads low in a process that has run steps before: the heap a step
    frees stays resident, and the next step reuses it uncounted. Under the Quick start's loop
    (GPT 4x256, seq 512, vocab 8192, budget 150 MiB) it read a step of 279 MiB as 160, and auto
    kept that plan, 1.86x its budget. So where there is no context, or the context ships nothing
    (it keeps in place what it would take: Note [a CPU host ships nothing] in records.py), a CPU
    host's step is metered as the simulated device's always was, by its live storages
    (``StorageMeter``: the CPU allocator's events under torch's profiler, the tuning steps
    only). Where the context ships, RSS stays the meter: the tier's own buffers (a read that
    finds no room in the pool takes a one-off mapping) are host memory outside torch's
    allocator, which only RSS sees, and how many are live at once follows the step's timing,
    which the profiler changes (under the NVMe tier with a 16 MiB pool, GPT 4x256, seq 512: 1.07
    to 1.10x the budget in the profiled steps, 1.00x in the same plan's unprofiled ones). Either
    way the pool charged is the one the step's context holds at the end of its backward
    (``pool_mapped``), not the records' (a seeded plan's records carry the trace's pool). Where
    a profiler already runs the storage meter is unavailable and the planner plans from its
    model alone. Without a context, on RSS, auto (GPT 4x128, seq 256, batch 4) peaked at 1.11 to
    1.58x budgets of 0.7 to 0.95x no checkpointing's peak; on its storages, within them
    (tests/python/test_rederive.py).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import torch

from .records import RegionRecord, host_is_device


class Metering:
    """The peak readings of :class:`~spillover.planner.tuner.Planner` (mixed in)."""

    _lock: threading.Lock
    _pos: int
    _meter: Optional[Any]
    _metering: bool
    _step_peak: Optional[int]
    _step_ctx: Optional[weakref.ref[Any]]  # the metered step's context
    _step_pool: Optional[int]  # the pool it held at the end of backward
    last_peak: Optional[int]
    last_seconds: Optional[float]
    _reads: Dict[str, Optional[int]]
    last_marks: Dict[str, int]

    if TYPE_CHECKING:  # what the readings use of the Planner they are mixed into

        def _start_peak(self, device: str, ctx: Any) -> None: ...

    def start_peak(self, args: Sequence[Any], kwargs: Dict[str, Any], ctx: Any) -> None:
        """A wrapped model's forward starts (Note [planner step boundaries]): measure the
        step's peak from here, over what was live before it -- as the budget means it, and as
        torch's counters read around a step -- not from its first region, after the embedding
        ran. Tensor arguments name the device; a forward without any waits for its first
        region."""
        if not any(isinstance(a, torch.Tensor) for a in [*args, *kwargs.values()]):
            return
        with self._lock:
            if self._pos == 0:
                self._start_peak(_device_of_args(args, kwargs), ctx)

    def _finish_peak(self, recs: List[RegionRecord]) -> Optional[int]:
        """The peak of the step that ran (None when it was not measured)."""
        if not self._metering or self._meter is None:
            return None
        peak = self._step_peak if self._step_peak is not None else self._meter.read()
        self._step_peak = None
        # Note [gradients as backward goes] in search.py: the step's peak up to each mark, read
        # then, or counted up to it by a meter that marks
        marked = getattr(self._meter, "marked", {}) if peak is not None else {}
        reads = {k: v if v is not None else marked.get(k) for k, v in self._reads.items()}
        self._reads = {}
        # Note [a traced step is timed] in tuner.py: a meter that times its step (the trace's)
        self.last_seconds = getattr(self._meter, "seconds", None) if peak is not None else None
        if self._step_pool is None:
            self._read_pool()
        charge = self._pool_charge(recs, self._step_pool) if peak is not None and recs else 0
        if peak is not None:
            peak += charge
        self._step_ctx = self._step_pool = None
        self.last_peak = peak
        self.last_marks = {k: min(v + charge, peak) for k, v in reads.items()
                           if v is not None and peak is not None}
        return peak

    @staticmethod
    def _pool_charge(recs: List[RegionRecord], held: Optional[int]) -> int:
        """On a CPU host the offload context's pool is this same memory: charged in full, as
        the budget counts it -- the pool the step's context held (``held``), else the one its
        records name (Note [a CPU step's peak is its storages'])."""
        info = recs[0].offload
        if not info or not host_is_device(recs[0]):
            return 0
        return held if held is not None else int(info["pool_bytes"])

    def _watch_pool(self, ctx: Any) -> None:
        """Remember the metered step's context, without keeping it (and its pool) alive."""
        self._step_pool = None
        try:
            self._step_ctx = weakref.ref(ctx) if ctx is not None else None
        except TypeError:
            self._step_ctx = None

    def _read_pool(self) -> None:
        ctx = self._step_ctx() if self._step_ctx is not None else None
        mapped = getattr(ctx, "pool_mapped", None)
        if mapped is not None:
            self._step_pool = int(mapped)

    def mark_peak(self, name: str) -> None:
        """Read the step's peak so far as ``name`` (Note [gradients as backward goes] in
        search.py; a meter that cannot read in backward marks the moment and counts up to it
        when read)."""
        if self._metering and self._meter is not None and self._step_peak is None:
            mark = getattr(self._meter, "mark", None)
            if mark is not None:
                self._reads[name] = mark(name)

    def end_of_backward(self) -> None:
        """The step's backward reached its first region: read the step's peak now (before the
        optimizer allocates its state), and the pool its context holds."""
        if self._metering and self._meter is not None and self._step_peak is None:
            self._step_peak = self._meter.read()
            self._read_pool()


def _device_of_args(args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return str(a.device)
    return "cpu"
