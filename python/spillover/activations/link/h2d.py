"""The host -> device side of the link's policy: bring a host block to the device after the
copy that filled it (Note [stream ordering] in policy.py), into the allocator pool of the stream
that uses it, and stage it ahead (Note [backward's tensors in the compute pool] in frees.py). A
base of :class:`~.policy.Transfers`, which owns the state it reads.

Note [pageable sources]
    CUDA copies from pageable host memory synchronously for the host: the driver stages the
    bytes through buffers of its own and may first wait for the stream. The tier's pool is
    registered (page-locked), but a storage read back into a one-off mapping (no room in the
    pool, or a storage gathered from pieces: rust/tier/room.rs, gather.rs) is not, and the H2D
    stream is ordered after the using stream's queued work (Note [backward's tensors in the
    compute pool] in frees.py): the host would wait for the device to catch up. Such a source
    is first copied on the host into page-locked memory of the device's (torch's caching host
    allocator on CUDA), which the copy then reads asynchronously; the one-off mapping can go at
    once. That allocator keeps its blocks (sizes rounded up to a power of two) for reuse: the
    price is page-locked host memory as large as the most such bytes in flight at once, held
    for the process. The simulated device makes a pageable copy block the host for the copy's
    time."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Deque, Optional, Tuple

import torch

from .frees import StagedAhead

if TYPE_CHECKING:
    from .policy import Copy

__all__ = ["ToDevice"]


class ToDevice:
    """``to_device`` and ``use`` of :class:`~.policy.Transfers`."""

    if TYPE_CHECKING:  # what the policy gives this side
        dev: Any
        host_is_device: bool
        staged: Optional[StagedAhead]
        _lock: threading.Lock
        _h2d: Any
        _h2d_fifo: Deque[Tuple[Any, torch.Tensor]]
        _stall: float
        _pageable: int

        def _wait_compute(self, stream: Any, ev: Any) -> None: ...

    @property
    def device_tensors_held(self) -> int:
        """Device storages staged ahead that no stream has used yet: the only ones the policy
        keeps (Note [backward's tensors in the compute pool])."""
        return self.staged.held if self.staged is not None else 0

    @property
    def pageable_staged(self) -> int:
        """Sources copied into pinned memory first (Note [pageable sources])."""
        return self._pageable

    def to_device(self, host: torch.Tensor, *, after: Optional[Copy] = None,
                  wait: bool = True) -> Tuple[torch.Tensor, Any]:
        """Bring ``host`` (1-D uint8 on the CPU) to the device, after the copy ``after`` that
        filled it; returns (device tensor, event). ``wait=False`` stages it ahead: pass the pair
        to :meth:`use` before using the tensor. Plain CPU returns ``host`` itself."""
        if host.dtype != torch.uint8 or host.dim() != 1 or host.device.type != "cpu":
            raise ValueError("to_device: host must be a 1-D uint8 CPU tensor")
        dev = self.dev
        if self.host_is_device:
            if after is not None:
                self._host_wait(after)
            return host, None
        staged = self.staged
        assert staged is not None  # a device with a link has an H2D stream
        staged.collect()
        if not dev.is_pinned(host):  # Note [pageable sources]
            if after is not None:  # the bytes are read here, on the host: once they landed
                self._host_wait(after)
                after = None
            pinned = dev.pinned_empty(host.numel())
            pinned.copy_(host)
            host = pinned
            with self._lock:
                self._pageable += 1
        compute = dev.current_stream()  # the stream that uses it: its pool makes it
        out = dev.empty(host.numel(), compute)
        dev.order_after(self._h2d, compute)  # queued work of `compute` may still use the block
        if after is not None:
            if after.done():
                after.wait()  # raises what the copy raised
            else:
                dev.wait(self._h2d, after.event)  # Note [stream ordering]
        dev.copy(out, host, self._h2d)
        ev = dev.record(self._h2d)
        with self._lock:
            self._h2d_fifo.append((ev, host))  # the block must outlive the copy
        if wait:
            self._wait_compute(compute, ev)
        else:
            staged.stage(out.untyped_storage(), compute, ev)
        dev.poll()
        return out, ev

    def _host_wait(self, c: Copy) -> None:
        """The host waits for the copy ``c`` (raises what it raised); counted as a stall."""
        dt = c.wait()
        with self._lock:
            self._stall += dt

    def use(self, staged: Tuple[torch.Tensor, Any]) -> torch.Tensor:
        """The tensor of a ``to_device(..., wait=False)`` pair, the current stream ordered
        after its copy (Note [backward's tensors in the compute pool])."""
        t, ev = staged
        if ev is not None:
            compute = self.dev.current_stream()
            assert self.staged is not None  # only a device with a link stages
            self.staged.used_on(t.untyped_storage(), compute)
            self._wait_compute(compute, ev)
        return t
