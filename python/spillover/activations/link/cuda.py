"""torch.cuda streams and events from Python: the primitives of the optimizer's staged copies
(optim/copies.py). The activations' copies are issued from Rust (rust/link/cuda.py's driver
calls, Note [stream ordering] in rust/link/mod.rs)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .common import default_cap_bytes

__all__ = ["CudaDevice"]


class CudaDevice:
    """torch.cuda streams and events (Note [stream ordering])."""

    host_is_device = False
    has_callbacks = False

    def __init__(self, device: Any, bandwidth_bytes_per_s: Optional[float] = None):
        self.device = torch.device(device)
        self.default_cap = default_cap_bytes(bandwidth_bytes_per_s)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Any) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def query(self, ev: Any) -> bool:
        return ev.query()

    def synchronize(self, ev: Any) -> None:
        ev.synchronize()

    def wait(self, stream: Any, ev: Any) -> None:
        stream.wait_event(ev)

    def order_after(self, stream: Any, other: Any) -> None:
        """``stream``'s later work runs after what ``other`` has queued so far."""
        stream.wait_stream(other)

    def timed_wait(self, stream: Any, ev: Any) -> Any:
        """``wait``, bracketed by timing events on ``stream``; resolved by :meth:`elapsed`."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        stream.wait_event(ev)
        end.record(stream)
        return start, end

    def elapsed(self, token: Any) -> Optional[float]:
        start, end = token
        return start.elapsed_time(end) / 1e3 if end.query() else None

    def empty(self, nbytes: int, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def is_pinned(self, host: torch.Tensor) -> bool:
        """Whether ``host`` is page-locked (a registered pool, torch's pinned memory)."""
        return host.is_pinned()

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory from torch's caching host allocator, which keeps a block
        from reuse until the copies reading it have run."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def record_stream(self, storage: Any, stream: Any) -> None:
        torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage).record_stream(stream)

    def track(self, t: torch.Tensor) -> None:
        pass

    def poll(self) -> None:
        pass

