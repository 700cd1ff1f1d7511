"""The host link: plain CPU tensors, where the "device" is the host (Note [host link] in
activations/hooks.py). Its copies into the tier are one call into Rust (``Step.put_from``); as
a primitive device for :class:`~.policy.Transfers` (tests, the optimizer) it copies on a worker
thread."""

from __future__ import annotations

from .common import MiB
from .sim import SimDevice

__all__ = ["CpuDevice"]


class CpuDevice(SimDevice):
    """Plain CPU: copies on a worker thread (``copy_`` releases the GIL), done when it is; the
    host block is the "device" tensor (``to_device`` is zero-copy)."""

    host_is_device = True

    def __init__(self) -> None:
        super().__init__(None)
        self.default_cap, self._probe = 256 * MiB, False

