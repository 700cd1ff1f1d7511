"""Counters of one ``offload_context``: what was packed, where it went, what stayed and why."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict

from .config import format_size

__all__ = ["OffloadStats"]


@dataclasses.dataclass
class OffloadStats:
    """Counters of one context. Byte counts are storage bytes (a storage saved through several
    views is counted once, under ``bytes_deduplicated`` for the repeats)."""

    tensors_packed: int = 0
    bytes_packed: int = 0
    tensors_offloaded: int = 0
    #: NVMe tier: storages larger than half the pool, offloaded in pieces.
    tensors_chunked: int = 0
    #: Bytes offloaded and never written to disk, and bytes written to disk (NVMe tier: written
    #: early, such an entry may still be read back from the pool, Note [write early, drop late]
    #: in rust/tier/policy.rs).
    bytes_offloaded_host: int = 0
    bytes_offloaded_nvme: int = 0
    storages_deduplicated: int = 0
    bytes_deduplicated: int = 0
    bytes_kept_small: int = 0
    bytes_kept_parameter: int = 0
    bytes_kept_marked: int = 0
    bytes_kept_pool_full: int = 0
    bytes_kept_unsupported: int = 0
    tensors_unpacked: int = 0
    bytes_unpacked: int = 0
    #: NVMe tier: unpacks of entries that had gone to disk and were back in host memory in
    #: time (hits) or not (misses); unpacks served by entries that never left the host pool.
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    host_cache_hits: int = 0
    #: Reads back that found no room in the pool and used a temporary buffer.
    overflow_reads: int = 0
    #: Seconds pack or unpack waited for a copy, write or read that was not finished yet (on
    #: CUDA the compute stream's waits on copies, measured with events).
    stall_seconds: float = 0.0
    #: Unpacks served by the tensor itself, its device->host copy not done yet (Note [source
    #: returned] in context.py): no bytes came back over the link.
    unpacks_from_source: int = 0
    #: Packs that made the compute stream wait for an older copy because the bytes of copies in
    #: flight passed SPILLOVER_COPY_INFLIGHT_BYTES (Note [back-pressure] in transfer.py).
    copy_waits_forced: int = 0
    #: Most bytes of device->host copies in flight at once (this device's transfers).
    bytes_in_flight_peak: int = 0
    #: The host pool: its peak use (all steps of the process), its use when stats() was read.
    pool_peak: int = 0
    pool_in_use: int = 0
    pool_capacity: int = 0
    #: Swap space held by entries (all steps of the process) when stats() was read.
    swap_in_use: int = 0

    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )

    def add(self, **deltas: Any) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    @property
    def bytes_kept(self) -> int:
        return (
            self.bytes_kept_small
            + self.bytes_kept_parameter
            + self.bytes_kept_marked
            + self.bytes_kept_pool_full
            + self.bytes_kept_unsupported
        )

    @property
    def bytes_offloaded(self) -> int:
        return self.bytes_offloaded_host + self.bytes_offloaded_nvme

    @property
    def prefetch_hit_rate(self) -> float:
        n = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / n if n else float("nan")

    def as_dict(self) -> Dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_lock"}
        d["bytes_kept"] = self.bytes_kept
        d["bytes_offloaded"] = self.bytes_offloaded
        return d

    def __str__(self) -> str:
        return (
            f"packed {self.tensors_packed} tensors ({format_size(self.bytes_packed)}): "
            f"offloaded {format_size(self.bytes_offloaded_host)} to host, "
            f"{format_size(self.bytes_offloaded_nvme)} to NVMe; kept "
            f"{format_size(self.bytes_kept)}; deduplicated {self.storages_deduplicated}; "
            f"pool peak {format_size(self.pool_peak)}"
        )
