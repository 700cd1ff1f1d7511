"""What the GPU bench measures with: the device's memory counters (or the CPU stand-in), a
digest of gradients computed where they are, and the JSON and number formats of its results.
Shared by bench.py's activation modes and optim_mode.py."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

GiB = 1 << 30


class Memory:
    """Peak memory counters, reset per phase: CUDA's allocator (max_memory_allocated and
    max_memory_reserved), or on the CPU a stand-in for both, the process's peak resident set
    (VmHWM, which writing 5 to /proc/self/clear_refs resets); None where neither exists."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.kind: Optional[str] = "cuda" if cuda else None
        if not cuda and self._clear_refs() and self._status("VmHWM") is not None:
            self.kind = "rss"
            # Tensors of 1 MiB and more mmapped, so a free gives their pages back and the
            # resident set follows the live tensors (glibc keeps freed heap memory).
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _status(key: str) -> Optional[int]:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.kind:
            self._clear_refs()

    def now(self) -> Optional[int]:
        if self.cuda:
            return torch.cuda.memory_allocated()
        return self._status("VmRSS") if self.kind else None

    def peaks(self) -> Tuple[Optional[int], Optional[int]]:
        """(allocated, reserved) peaks since the last reset."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        hwm = self._status("VmHWM") if self.kind else None
        return hwm, hwm


def above(peak: Optional[int], base: Optional[int]) -> Optional[int]:
    return peak - base if peak is not None and base is not None else None


def fingerprint(tensors: List[torch.Tensor]) -> str:
    """A digest of the tensors' bits, computed where they are (a 1B-parameter model's gradients
    are 2 GB: no copy to the host). Equal tensors give equal digests; a differing bit changes
    the plain or the position-weighted integer sum of its tensor."""
    parts = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        ints = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                          8: torch.int64}[flat.element_size()]).to(torch.int64)
        w = torch.arange(1, ints.numel() + 1, device=ints.device, dtype=torch.int64) % 1000003
        parts.append(torch.stack([ints.sum(), (ints * w).sum()]))
    return hashlib.sha256(torch.stack(parts).cpu().numpy().tobytes()).hexdigest()[:16]


def write_json(path: str, res: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=2)
    os.replace(tmp, path)  # a reader never sees half a file


def fmt_gib(x: Optional[int]) -> str:
    return "–" if x is None else f"{x / GiB:.2f}"
