"""The peak memory of one training step on its device, as a user measures it.

The planner's budget (SPILLOVER_DEVICE_BUDGET_BYTES) is the peak of the whole step, forward
and backward: what it models (bytes held after forward, the largest region rebuilt in
backward) misses what it cannot see (gradients being computed, copies in flight, tensors under
the minimum offload size, pieces being assembled). So while it tunes a plan the planner
measures the step's real peak and corrects its model by the difference (Note [peak feedback]
in planner/tuner.py).

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the step's
  start, over ``memory_allocated`` then. This resets torch's peak counters during the steps
  the planner tunes (its first few); a user reading them over the whole run should read them
  after those steps.
- CPU: the kernel's RSS high-water mark (VmHWM, reset by writing "5" to
  /proc/self/clear_refs, Linux >= 4.0) over RSS at the step's start. Where that file cannot be
  written the meter is unavailable and the planner plans from its model alone. It reads low
  in a process that ran steps before (freed heap stays resident and is reused uncounted)
  unless glibc's mmap threshold is pinned low.
- The simulated device (CPU tensors under a context with ``sim_link_bandwidth``), and a CPU
  host whose context ships nothing (Note [a CPU step's peak is its storages'] in
  planner/metering.py): the live
  tensor storages, the CPU allocator's events under torch's profiler (:class:`StorageMeter`),
  as ``benches/python/sim_h200.py`` measures the device's memory there; RSS would count the
  host pool the link copies into (Note [the simulated device is a device] in
  planner/records.py). Where a profiler is already running the meter is unavailable.

Note [a stale profiler]
    A storage meter's profiler runs from a metered step's start until the step is read outside
    backward, which is at the next step's start. A planner whose last metered step has no step
    after it (a run ending in its tuning steps, a test, a loop that evaluates without the
    wrapped model's training forward) left torch's profiler running in the process, recording
    every later op and allocation. So a meter that starts, ``allocator_events`` and
    ``spillover.empty_cache()`` first stop every other meter's profiler (:func:`stop_stale`).
    A profiler still running when the interpreter exits crashed it (a segmentation fault after
    torch's "Requested callback is not found", the exit status 139: the whole test suite's,
    once CPU runs without a context were metered this way), so one more stop runs at exit. The
    meters were held weakly: a planner dropped with its meter running (a test's model) left a
    profiler no one could stop, recording every later test's allocations (one allocator-
    dependent test failed under it) until the exit crashed. Now the running meters are held,
    and a planner's meter is stopped when the planner goes (:func:`release`).
"""

from __future__ import annotations

import atexit
import os
import warnings
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

__all__ = ["PeakMeter", "StorageMeter", "stop_stale", "rss", "high_water", "reset_high_water",
           "memory_events", "peak_of"]


def rss() -> int:
    """This process's resident set size, bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water() -> int:
    """The kernel's RSS high-water mark of this process (VmHWM), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise OSError("no VmHWM in /proc/self/status")


def reset_high_water() -> None:
    """Start a new high-water mark at the current RSS (Linux >= 4.0: "5" to clear_refs);
    OSError where /proc/self/clear_refs cannot be written."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PeakMeter:
    """``start()`` at a step's start, ``read()`` at the end of its backward: the step's peak
    over what was allocated at its start, or None where it cannot be measured."""

    def __init__(self, device: str):
        self.device = device
        self.base: Optional[int] = None
        self.available = True

    def start(self) -> bool:
        self.base = None
        if not self.available:
            return False
        try:
            if self.device.startswith("cuda"):
                dev = torch.device(self.device)
                torch.cuda.reset_peak_memory_stats(dev)
                self.base = torch.cuda.memory_allocated(dev)
            else:
                reset_high_water()
                self.base = rss()
        except (OSError, RuntimeError):
            self.available = False  # e.g. a read-only /proc: plan from the model alone
            return False
        return True

    def read(self) -> Optional[int]:
        if self.base is None:
            return None
        try:
            if self.device.startswith("cuda"):
                peak = torch.cuda.max_memory_allocated(torch.device(self.device))
            else:
                peak = high_water()
        except (OSError, RuntimeError):
            return None
        return max(0, peak - self.base)

    def mark(self, name: str) -> Optional[int]:
        """The peak so far (Note [gradients as backward goes] in planner/search.py)."""
        return self.read()


def memory_events(prof: Any) -> List[Tuple[int, int]]:
    """The CPU allocator's events a stopped ``torch.profiler.profile(profile_memory=True)``
    recorded: (wall-clock ns, bytes: + for an allocation, - for a free), in time order."""
    return sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]")


def peak_of(events: Iterable[Tuple[int, int]]) -> int:
    """The most the events' running sum reached (0 when it never rose)."""
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


#: Note [a stale profiler]: the storage meters whose profiler runs now (held: a meter whose
#: owner is gone still has its profiler stopped)
_RUNNING: Set[StorageMeter] = set()


def release(meter: Any) -> None:
    """Note [a stale profiler]: ``meter``'s owner is gone; stop its profiler now, outside
    backward (inside, the next :func:`stop_stale` or the interpreter's exit does)."""
    if getattr(meter, "_prof", None) is not None \
            and torch._C._current_autograd_node() is None:
        meter._stop()


def stop_stale(keep: Optional[StorageMeter] = None) -> None:
    """Note [a stale profiler]: stop the profiler of every storage meter whose step was never
    read to its end (a planner whose last metered step had no step after it), outside
    backward, before another profiler starts."""
    if torch._C._current_autograd_node() is not None:
        return
    for m in list(_RUNNING):
        if m is not keep:
            m._stop()


@atexit.register
def _stop_at_exit() -> None:
    """Note [a stale profiler]: no meter's profiler outlives the interpreter."""
    for m in list(_RUNNING):
        m._stop()


#: the profile's marks of a step's end (:meth:`StorageMeter.read` in backward) and of
#: :meth:`StorageMeter.mark` (that prefix and its name)
END_MARK = "spillover.end_of_step"
MARK_PREFIX = "spillover.mark."


class StorageMeter:
    """:class:`PeakMeter`'s protocol for the simulated device: the most the live CPU tensor
    storages grew between ``start()`` and ``read()``, from the allocator's events under torch's
    profiler (run only while the planner measures: it slows the step it watches).

    A ``read()`` inside backward (the planner's at backward's first region) marks the step's
    end and returns None; the next ``read()`` outside backward stops the profiler and counts the
    events up to that mark. Stopping it inside backward would not hold: autograd's engine puts
    back, as backward ends, the thread-local state it found, the profiler's included, and the
    next ``start()`` would find one "already enabled on this thread"."""

    device = "storages"

    def __init__(self) -> None:
        self.available = True
        self._prof: Optional[Any] = None
        self._ended = False  # the step's end is marked in the profile (``END_MARK``)
        #: Note [gradients as backward goes] in planner/search.py: the moments ``mark``ed in
        #: the step (in the profile), and at ``read`` the most the storages grew up to each
        self._marks: Set[str] = set()
        self.marked: Dict[str, int] = {}

    def start(self) -> bool:
        self._stop()
        stop_stale(self)
        if not self.available:
            return False
        from torch.profiler import ProfilerActivity, profile

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                prof.start()
        except RuntimeError:  # another profiler runs: plan from the model alone
            self.available = False
            return False
        self._prof, self._ended, self._marks, self.marked = prof, False, set(), {}
        _RUNNING.add(self)
        return True

    def _stop(self) -> Optional[int]:
        prof, self._prof = self._prof, None
        _RUNNING.discard(self)
        if prof is None:
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prof.stop()
            events = memory_events(prof)
        except RuntimeError:
            return None
        # the marks are events of the profile, on its clock, which time.time_ns() is not: a
        # 16 MiB allocation was stamped 2.8 ms before a time.time_ns() read right after it, so
        # a mark read from it would count what backward allocates for ~3 ms more
        marks: Dict[str, int] = {}
        if self._marks or self._ended:
            for e in prof.profiler.kineto_results.events():
                if e.name().startswith("spillover.") and e.name() not in marks:
                    marks[e.name()] = e.start_ns()
        for name in self._marks:
            at = marks.get(MARK_PREFIX + name)
            if at is not None:
                self.marked[name] = peak_of(e for e in events if e[0] <= at)
        end = marks.get(END_MARK)
        return peak_of(e for e in events if end is None or e[0] <= end)

    def mark(self, name: str) -> None:
        """Mark the moment in the profile (the peak up to it is counted when it stops, in
        ``marked[name]``)."""
        if self._prof is not None and name not in self._marks:
            self._marks.add(name)
            with torch.profiler.record_function(MARK_PREFIX + name):
                pass

    def read(self) -> Optional[int]:
        if self._prof is None:
            return None
        if torch._C._current_autograd_node() is not None:  # in backward: mark, stop later
            if not self._ended:
                self._ended = True
                with torch.profiler.record_function(END_MARK):
                    pass
            return None
        return self._stop()
