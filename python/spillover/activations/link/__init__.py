"""The link: device <-> host copies for the activation tier. For a device with a link (CUDA,
or the simulated device for CPU tensors in tests and benchmarks) the copies are issued from
Rust (``spillover._native.Link``, rust/link: Notes [stream ordering], [sources held], [device
calls] there) behind :class:`DeviceLink` (device.py); for plain CPU tensors the host is the
device (:class:`HostLink`, host.py). :func:`link_for` gives the process's link for a device.

The optimizer's staged copies use the device primitives of cuda.py (CUDA streams and events
from torch) and sim.py (their CPU stand-in) until they move to the Rust link too.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional

import torch

from .common import block_tensor, default_cap_bytes
from .device import DeviceLink, LinkCopy, SimMemory
from .host import HostLink

__all__ = ["DeviceLink", "HostLink", "LinkCopy", "SimMemory", "block_tensor",
           "default_cap_bytes", "link_for"]

_cache: Dict[Any, Any] = {}
_cache_lock = threading.Lock()
_host = HostLink()


def _after_fork_in_child() -> None:
    global _cache_lock
    _cache_lock = threading.Lock()  # keys carry the pid: a child makes links of its own


os.register_at_fork(after_in_child=_after_fork_in_child)


def link_for(device: Any, *, sim_bandwidth: Optional[float] = None,
             cap_bytes: Optional[int] = None, link_bandwidth: Optional[float] = None,
             sim_lag: float = 0.0, sim_call_cost: float = 0.0) -> Any:
    """The process's link for ``device``: a :class:`DeviceLink` over CUDA for a CUDA device
    (default cap from ``link_bandwidth``, 16 GB/s when None); for CPU tensors a
    :class:`DeviceLink` over the simulated device of ``sim_bandwidth`` bytes/s (its compute
    stream ``sim_lag`` seconds behind the host, ``sim_call_cost`` host seconds per device
    call) when given, else the :class:`HostLink`. ``cap_bytes`` overrides the cap."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and not sim_bandwidth:
        return _host
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"spillover: no link for device {device}")
    sim = (float(sim_bandwidth), float(sim_lag), float(sim_call_cost)) \
        if device.type == "cpu" else None
    key = (device.type, device.index, sim, cap_bytes, link_bandwidth, os.getpid())
    with _cache_lock:
        link = _cache.get(key)
        if link is None:
            if sim is not None:
                link = DeviceLink(device, cap_bytes=cap_bytes, sim_bandwidth=sim[0],
                                  sim_lag=sim[1], sim_call_cost=sim[2])
            else:
                link = DeviceLink(device, cap_bytes=cap_bytes, link_bandwidth=link_bandwidth)
            _cache[key] = link
        return link
