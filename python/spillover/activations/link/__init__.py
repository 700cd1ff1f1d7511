"""The link: device <-> host copies for the activation tier and the optimizer, one policy
(:class:`Transfers`, policy.py, its host -> device side in h2d.py) over the primitives of each
device kind -- CUDA (cuda.py), a simulated GPU for CPU tests (sim.py), and plain CPU, where the
host is the device (host.py). :func:`transfers_for` gives the process's policy for a device."""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional

import torch

from .common import block_tensor, default_cap_bytes
from .cuda import CudaDevice
from .host import CpuDevice
from .policy import Copy, Transfers
from .sim import SimDevice

__all__ = ["Copy", "CpuDevice", "CudaDevice", "SimDevice", "Transfers", "block_tensor",
           "default_cap_bytes", "transfers_for"]

_cache: Dict[Any, Transfers] = {}
_cache_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _cache_lock
    _cache_lock = threading.Lock()  # worker threads do not survive fork; keys carry the pid


os.register_at_fork(after_in_child=_after_fork_in_child)


def transfers_for(device: Any, *, sim_bandwidth: Optional[float] = None,
                  cap_bytes: Optional[int] = None,
                  link_bandwidth: Optional[float] = None, sim_lag: float = 0.0) -> Transfers:
    """The process's :class:`Transfers` for ``device``: CUDA for a CUDA device (default cap
    from ``link_bandwidth``, 16 GB/s when None); for CPU tensors a :class:`SimDevice` of
    ``sim_bandwidth`` bytes/s whose compute stream runs ``sim_lag`` seconds behind the host
    when given, else plain CPU. ``cap_bytes`` overrides the cap."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sim = sim_bandwidth if device.type == "cpu" and sim_bandwidth else None
    lag = float(sim_lag) if sim else 0.0
    key = (device.type, device.index, sim, lag, cap_bytes, link_bandwidth, os.getpid())
    with _cache_lock:
        tr = _cache.get(key)
        if tr is None:
            if device.type == "cuda":
                dev: Any = CudaDevice(device, link_bandwidth)
            elif device.type == "cpu":
                dev = SimDevice(sim, compute_lag_s=lag) if sim else CpuDevice()
            else:
                raise ValueError(f"spillover: no transfers for device {device}")
            tr = _cache[key] = Transfers(dev, cap_bytes)
        return tr

