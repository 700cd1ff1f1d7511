"""Counters of an ``offload_context``, per step and in total: what was packed, where it went,
what stayed and why; the text of ``ctx.report()``; and the arithmetic of the guardrails that
say when offload is not working (Note [guardrails] in activations/guardrails.py)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, List, Optional

from .config import format_size

__all__ = ["OffloadStats", "format_report", "predicted_seconds"]

#: Gauges read from the pool and tier when stats() is read (a total takes the latest) and
#: peaks (a total takes the largest); every other field is a counter (a total adds them).
_LATEST = ("pool_in_use", "pool_capacity", "swap_in_use")
_PEAKS = ("pool_peak", "bytes_in_flight_peak")


@dataclasses.dataclass
class OffloadStats:
    """Counters of one step of a context (``ctx.stats()``), or of all its steps
    (``ctx.stats(total=True)``, the sum: ``steps`` says how many). Byte counts are storage bytes
    (a storage saved through several views is counted once, under ``bytes_deduplicated`` for
    the repeats)."""

    #: Steps these counters cover (1 for one step's stats).
    steps: int = 0
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
    #: Bytes that stayed where they were, by reason: below SPILLOVER_MIN_OFFLOAD_BYTES; a
    #: parameter or buffer; marked with ``spillover.keep``; held by a recompute policy
    #: (Note [kept by a policy] in activations/hooks.py); no room in the host pool; a layout, device
    #: or tensor subclass spillover does not offload (or CUDA graph capture).
    bytes_kept_small: int = 0
    bytes_kept_parameter: int = 0
    bytes_kept_marked: int = 0
    bytes_kept_policy: int = 0
    bytes_kept_pool_full: int = 0
    bytes_kept_unsupported: int = 0
    #: Saved tensors not offloaded but made again at unpack from what their own op saved
    #: (Note [made again at unpack] in activations/rederive.py), and how many times backward
    #: made one.
    tensors_rederived: int = 0
    bytes_rederived: int = 0
    rederive_runs: int = 0
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
    #: Unpacks served by a copy back started ahead of them (Note [staging distance] in
    #: activations/unpack.py; a plan's regions shipped whole, Note [regions shipped whole]
    #: in planner/search.py).
    unpacks_staged: int = 0
    #: Packs that made the compute stream wait for an older copy because the bytes of copies in
    #: flight passed SPILLOVER_COPY_INFLIGHT_BYTES (Note [back-pressure] in
    #: rust/link/mod.rs).
    copy_waits_forced: int = 0
    #: Most bytes of device->host copies in flight at once after one of the step's packs.
    bytes_in_flight_peak: int = 0
    #: The host pool: its peak use (all steps of the process), its use when stats() was read.
    pool_peak: int = 0
    pool_in_use: int = 0
    pool_capacity: int = 0
    #: Swap space held by entries (all steps of the process) when stats() was read.
    swap_in_use: int = 0
    #: Host pools mapped (and pre-faulted) and registered with the device (CUDA, or the
    #: simulated device) by the process during the step -- its forward and backward, until the
    #: next step began (Note [the pool lives for the process] in _pools.py): 0 once the pool
    #: the steps need is kept.
    pool_maps: int = 0
    pool_registrations: int = 0

    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )

    def add(self, **deltas: Any) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def count_offload(self, nbytes: int, in_flight: Optional[int] = None) -> None:
        """One tensor packed and offloaded (with the bytes now in flight, on a device): the
        pack's ``add`` and ``raise_to`` in one, without their keyword dicts (a saved tensor's
        pack is host time on the step's path: issue 40, item 5)."""
        with self._lock:
            self.tensors_packed += 1
            self.bytes_packed += nbytes
            self.tensors_offloaded += 1
            if in_flight is not None and in_flight > self.bytes_in_flight_peak:
                self.bytes_in_flight_peak = in_flight

    def raise_to(self, **values: Any) -> None:
        """Each named field becomes the larger of its value and the one given."""
        with self._lock:
            for k, v in values.items():
                if v > getattr(self, k):
                    setattr(self, k, v)

    def copy(self) -> OffloadStats:
        with self._lock:
            return OffloadStats(**self._fields())

    def _fields(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "_lock"}

    def __add__(self, other: OffloadStats) -> OffloadStats:
        """Counters added, peaks the larger, gauges (pool and swap in use) ``other``'s: the
        total of two steps, the later one on the right."""
        if not isinstance(other, OffloadStats):
            return NotImplemented
        a, b = self.copy()._fields(), other.copy()._fields()
        out = {}
        for k, v in a.items():
            if k in _LATEST:
                out[k] = b[k]
            elif k in _PEAKS:
                out[k] = max(v, b[k])
            else:
                out[k] = v + b[k]
        return OffloadStats(**out)

    @property
    def bytes_kept(self) -> int:
        return (
            self.bytes_kept_small
            + self.bytes_kept_parameter
            + self.bytes_kept_marked
            + self.bytes_kept_policy
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
        d = self._fields()
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


# ---- guardrail arithmetic (Note [guardrails] in activations/guardrails.py) -------------------

#: A step is "slower than calibration" when it stalled more than this many times the seconds
#: its bytes take at the calibrated bandwidths ...
SLOW_FACTOR = 3.0
#: ... and at least this long (below it, timer noise and one-off latencies dominate).
SLOW_MIN_STALL_S = 0.1


def predicted_seconds(s: OffloadStats, rates: Dict[str, Optional[float]]) -> Optional[float]:
    """Seconds the bytes ``s`` moved take at ``rates`` (bytes/s: ``d2h``, ``h2d``,
    ``nvme_write``, ``nvme_read``), if every link were busy with nothing else; None when a rate
    the step needs is unknown. Over-counts on purpose (every unpack as a copy back, every
    byte written as read back once), so the guardrail errs towards silence."""
    need = {"d2h": s.bytes_offloaded, "h2d": s.bytes_unpacked,
            "nvme_write": s.bytes_offloaded_nvme, "nvme_read": s.bytes_offloaded_nvme}
    total = 0.0
    for k, nbytes in need.items():
        if not nbytes:
            continue
        rate = rates.get(k)
        if not rate or rate <= 0:
            return None
        total += nbytes / rate
    return total


def slower_than_predicted(s: OffloadStats, predicted: Optional[float]) -> bool:
    """Whether ``s`` stalled over SLOW_FACTOR times ``predicted`` seconds (and at least
    SLOW_MIN_STALL_S); False when nothing was predicted or nothing moved."""
    return (predicted is not None and predicted > 0 and s.stall_seconds >= SLOW_MIN_STALL_S
            and s.stall_seconds > SLOW_FACTOR * predicted)


# ---- ctx.report() -----------------------------------------------------------------------------


def _share(n: int, whole: int) -> str:
    return f"{100.0 * n / whole:.0f}%" if whole else "-"


def _shares(parts: List[int]) -> List[str]:
    """Whole percentages of ``parts`` that add up to exactly 100 (largest remainders)."""
    whole = sum(parts)
    if not whole:
        return ["-"] * len(parts)
    exact = [100.0 * p / whole for p in parts]
    out = [int(e) for e in exact]
    for i in sorted(range(len(parts)), key=lambda i: out[i] - exact[i])[:100 - sum(out)]:
        out[i] += 1
    return [f"{v}%" for v in out]


def format_report(s: OffloadStats, *, title: str, min_offload_bytes: int,
                  findings: List[str], pool_limit: int = 0) -> str:
    """The text of ``ctx.report()``: where the step's device memory went (kept, and why;
    offloaded, per tier), what waiting it cost, how read-ahead did, and the guardrails the step
    tripped (``findings``). ``pool_limit``: what a default pool may grow to (Note [growing
    pool] in _growth.py)."""
    kept = s.bytes_kept
    # the three shares add up to the whole: what a saved view's storage counts for is in
    # bytes_packed once per view saved (offloaded once, kept once, then deduplicated)
    whole = s.bytes_offloaded + kept + s.bytes_deduplicated + s.bytes_rederived
    off_pc, kept_pc, dedup_pc, re_pc = _shares(
        [s.bytes_offloaded, kept, s.bytes_deduplicated, s.bytes_rederived])
    lines = [
        title,
        f"  saved for backward: {s.tensors_packed} tensors, {format_size(whole)} of storage "
        "counted once per tensor saved",
        f"  offloaded: {format_size(s.bytes_offloaded)} ({off_pc}) "
        f"in {s.tensors_offloaded} storages -- host {format_size(s.bytes_offloaded_host)}, "
        f"nvme {format_size(s.bytes_offloaded_nvme)}"
        + (f"; {s.tensors_chunked} in pieces" if s.tensors_chunked else ""),
    ]
    if s.tensors_rederived:
        lines.append(
            f"  made again at unpack: {format_size(s.bytes_rederived)} ({re_pc}) in "
            f"{s.tensors_rederived} storages, {s.rederive_runs} made in backward "
            "(cheap ops whose inputs autograd holds anyway; rederive=False ships them)")
    lines.append(f"  kept on the device: {format_size(kept)} ({kept_pc}), by reason:")
    reasons = [
        ("small", s.bytes_kept_small,
         f"under min_offload_bytes ({format_size(min_offload_bytes)}, "
         "SPILLOVER_MIN_OFFLOAD_BYTES)"),
        ("parameter", s.bytes_kept_parameter, "parameters and buffers (never offloaded)"),
        ("marked", s.bytes_kept_marked, "marked with spillover.keep()"),
        ("policy", s.bytes_kept_policy,
         "held by a recompute policy (spillover.wrap/checkpoint: planned or selective keep)"),
        ("pool full", s.bytes_kept_pool_full,
         "no room in the host pool (SPILLOVER_HOST_POOL_BYTES)"),
        ("unsupported", s.bytes_kept_unsupported,
         "layout/device/subclass not offloaded, CUDA graph capture, already pooled"),
    ]
    for name, n, why in reasons:
        lines.append(f"    {name:<12}{format_size(n):>12}  {why}")
    lines.append(
        f"  views of storages saved already: {format_size(s.bytes_deduplicated)} "
        f"({dedup_pc}) in {s.storages_deduplicated} tensors, "
        "held once (no device memory of their own)")
    lines.append(
        f"  stalls: {s.stall_seconds * 1e3:.1f} ms waiting for copies and I/O"
        f" ({s.copy_waits_forced} forced by the in-flight cap; copies in flight peaked at "
        f"{format_size(s.bytes_in_flight_peak)})"
    )
    reads = s.prefetch_hits + s.prefetch_misses
    lines.append(
        f"  unpacked: {s.tensors_unpacked} ({format_size(s.bytes_unpacked)}); "
        f"{s.unpacks_from_source} served by the tensor still on the device, "
        f"{s.unpacks_staged} by a copy back started ahead, "
        f"{s.host_cache_hits} from the pool"
        + (f", {s.prefetch_hits} prefetch hits / {s.prefetch_misses} misses from disk "
           f"({_share(s.prefetch_hits, reads)})" if reads else "")
        + (f", {s.overflow_reads} read through a temporary buffer (pool full)"
           if s.overflow_reads else "")
    )
    lines.append(
        f"  host pool: {format_size(s.pool_in_use)} in use of {format_size(s.pool_capacity)}"
        + (f" (grows up to {format_size(pool_limit)} as steps need)"
           if pool_limit > s.pool_capacity else "")
        + f", peak {format_size(s.pool_peak)}; swap in use {format_size(s.swap_in_use)}"
    )
    if findings:
        lines.append("  warnings:")
        lines.extend(f"    - {f}" for f in findings)
    return "\n".join(lines)
