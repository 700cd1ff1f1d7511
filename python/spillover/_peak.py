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
  written the meter is unavailable and the planner plans from its model alone.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["PeakMeter", "rss", "high_water", "reset_high_water"]


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
