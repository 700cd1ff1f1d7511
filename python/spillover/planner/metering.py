"""The step's peak, as the tuner measures it (Note [peak feedback] in tuner.py): from the
wrapped model's forward to the first region of its backward, on the device's counters or, on
the simulated device, its live tensor storages (:mod:`spillover._peak`)."""

from __future__ import annotations

import threading
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
    last_peak: Optional[int]

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
        if peak is not None and recs:
            peak += self._pool_charge(recs)
        self.last_peak = peak
        return peak

    @staticmethod
    def _pool_charge(recs: List[RegionRecord]) -> int:
        """On a CPU host the offload context's pool is this same memory, faulted in when the
        context opened (before the step): charged in full, as the budget counts it."""
        info = recs[0].offload
        return int(info["pool_bytes"]) if info and host_is_device(recs[0]) else 0

    def end_of_backward(self) -> None:
        """The step's backward reached its first region: read the step's peak now (before the
        optimizer allocates its state)."""
        if self._metering and self._meter is not None and self._step_peak is None:
            self._step_peak = self._meter.read()


def _device_of_args(args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return str(a.device)
    return "cpu"
