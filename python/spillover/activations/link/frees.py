"""Device tensors the link hands out for backward: made in the allocator pool of the stream that
uses them, so that they go back to it in stream order by themselves.

Note [backward's tensors in the compute pool]
    ``to_device`` makes its output on the stream that will use it (the current stream: the one
    autograd runs the node on), not on the H2D stream.
    - The block is one that stream's pool gives: work of that stream the device has not run yet
      (the host runs ahead) may still use it. So the H2D stream is first ordered after that
      stream's queued work (``order_after``), then copies, and the using stream waits for the
      copy's event before its first use. Neither is a host wait.
    - Once autograd lets go of the tensor, the allocator gives its block back to that stream's
      pool at once, and only later work of that stream can reuse it: the free is in stream
      order by the allocator's own rule, with no event, list or cap of ours, however far the
      host runs ahead. Backward's tensors share the pool forward's activations left, so
      ``max_memory_reserved`` is not forward's peak plus backward's set in the H2D stream's
      pool, as it was when outputs were made on the H2D stream (and freed behind events).
    - A tensor staged ahead (``wait=False``) and dropped before any use: its stream never waited
      for the copy, and its block could go to that stream's next allocation while the copy
      still writes it. That stream is made to wait for the copy's event before we let go
      (``collect``, at each H2D copy; ``release_all`` at the end of backward for those still
      referenced elsewhere).
    - A tensor used on another stream than the one it was made on (``use`` from a side stream):
      ``record_stream`` of that stream, as CUDA's allocator asks of every cross-stream use.
    What it costs: a copy starts once the using stream reaches the unpack (it may not write the
    block before), so a tensor not staged ahead -- backward's first, or one whose bytes were not
    yet in the pool when staging ran -- has its whole copy exposed, where a copy on the H2D
    stream's own pool could run under the compute queued before it. Staging ahead is what
    hides the copies; the memory is no longer bought with a second pool.
    The simulated device counts reserved bytes per stream pool and its compute stream lags the
    host (test_link_sim.py); its compute runs on the host as it is enqueued, so ``order_after``
    has nothing to wait for there: what it models is memory, not the H2D copy's later start.
"""

from __future__ import annotations

import threading
from typing import Any, List

from .common import use_count

__all__ = ["StagedAhead"]


class StagedAhead:
    """Note [backward's tensors in the compute pool]: the tensors staged ahead that no stream
    has used yet, each with the stream whose pool made it and its copy's event."""

    def __init__(self, dev: Any):
        self.dev = dev
        self._lock = threading.Lock()
        self._staged: List[list] = []  # [storage, stream it was made on, copy's event]

    @property
    def held(self) -> int:
        """Staged storages no stream has used yet."""
        with self._lock:
            return len(self._staged)

    def stage(self, storage: Any, stream: Any, event: Any) -> None:
        """``storage``, made on ``stream``'s pool, is written by the copy ``event`` ends."""
        with self._lock:
            self._staged.append([storage, stream, event])

    def used_on(self, storage: Any, stream: Any) -> None:
        """A staged storage is used on ``stream`` from now on (which then waits for its copy)."""
        with self._lock:
            for i, s in enumerate(self._staged):
                if s[0]._cdata == storage._cdata:
                    made_on = self._staged.pop(i)[1]
                    break
            else:
                return
        if stream != made_on:
            self.dev.record_stream(storage, stream)

    def collect(self) -> None:
        """Staged storages nobody else references go, after the stream that made them is made
        to wait for their copy. Never a host wait."""
        with self._lock:
            if not self._staged:
                return
            free, kept = [], []
            for s in self._staged:  # one use count each: the scan is per H2D copy
                (free if use_count(s[0]) <= 1 else kept).append(s)
            if not free:
                return
            self._staged = kept
        self._order(free)

    def release_all(self) -> None:
        """End of backward: every staged storage's stream waits for its copy; those still
        referenced elsewhere may then go whenever they are dropped."""
        with self._lock:
            staged, self._staged = self._staged, []
        self._order(staged)

    def _order(self, staged: List[list]) -> None:
        for _, stream, event in staged:  # a stream wait each: a few staged at most
            self.dev.wait(stream, event)
        staged.clear()  # the storages go now
