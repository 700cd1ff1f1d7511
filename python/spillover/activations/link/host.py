"""The host link: plain CPU tensors, where the "device" is the host (Note [host link] in
activations/hooks.py). Pack copies the bytes into the tier in one call into Rust
(``Step.put_from``) and unpack views the block: no copy in flight, nothing held, nothing to
wait for. This object answers the link's questions for that case."""

from __future__ import annotations

from typing import Any, List, Optional

__all__ = ["HostLink"]


class HostLink:
    """The link of plain CPU tensors: nothing in flight, ever."""

    host_is_device = True
    sim_bandwidth = None
    bytes_in_flight = 0
    bytes_held = 0
    forced_waits = 0
    stall_seconds = 0.0

    def reap(self, errors: Optional[List[BaseException]] = None) -> None:
        pass

    def synchronize(self, errors: Optional[List[BaseException]] = None) -> None:
        pass

    def release_sources(self) -> None:
        pass

    def end_of_backward(self) -> None:
        pass

    def counters(self) -> Any:
        return {}
