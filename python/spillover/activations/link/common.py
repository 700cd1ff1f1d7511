"""What every link shares: a host block as a tensor, the default cap of copies in flight, and
how many references a storage has."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

__all__ = ["MiB", "block_tensor", "default_cap_bytes", "use_count"]

MiB = 1 << 20


def block_tensor(block: Any) -> torch.Tensor:
    """A 1-D uint8 CPU tensor viewing the block's bytes (no copy; keeps the block alive)."""
    return torch.from_numpy(np.asarray(block))


def default_cap_bytes(bandwidth_bytes_per_s: Optional[float] = None) -> int:
    """Note [back-pressure] in rust/link/mod.rs: 20 ms of the link (16 GB/s when unknown), in
    [64 MiB, 2 GiB]."""
    bw = bandwidth_bytes_per_s or 16e9
    return int(min(max(bw * 0.020, 64 * MiB), 2048 * MiB))


def use_count(storage: Any) -> int:
    """References to a storage's StorageImpl (ours included); large when unknown."""
    f = getattr(torch._C, "_storage_Use_Count", None)
    return f(storage._cdata) if f is not None else 1 << 30


