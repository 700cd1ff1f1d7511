"""The guardrails of ``offload_context`` (Note [guardrails]): the checks that say
when offload did nothing -- the pool full, others in the pool, a compiled region unpacking
everything at once, a step slower than calibration. A mixin of :class:`OffloadContext`, which
calls them as a step exits and as its backward ends; the arithmetic of the slow-step check is in
stats.py.

Note [guardrails]
    Offload that silently does nothing is the failure users cannot see, so four situations warn,
    each once per process and once only (``_runtime.warn_once``: a RuntimeWarning, or, when the
    warnings filters ignore it, the ``spillover`` logger at WARNING -- never both, the one style
    of this package) and each naming the knob to change; every step also lists those it tripped
    in ``report()``.
    - *Pool full*: at the end of a forward, saved tensors stayed on the device because the host
      pool had no room (the bytes are ``bytes_kept_pool_full``).
    - *Others in the pool*: the same, while other users held a large share of the pool when the
      step began (at least 1 MiB and 1/16 of it): code that leases blocks of the process's
      activation pool (``spillover._pools.host_pool``). ``OffloadAdamW`` never does: its
      state has a pool of its own (Note [node budget] in _runtime.py). "Others" are the pool's
      bytes in use minus the bytes in the pool of every activation tier over it. When the kept
      bytes exceed what the others held, the pool-full warning fires too.
    - *Compiled region*: an autograd node that is a compiled graph's backward (its name contains
      "Compiled", as AOTAutograd's ``CompiledFunctionBackward`` does) unpacks two or more
      offloaded storages that together are at least half of what its step offloaded. A compiled
      graph's backward unpacks every tensor it saved before it computes anything, so they are
      all back on the device at once and offload cannot lower the peak; eager nodes each unpack
      their own few tensors as backward reaches them.
    - *Slower than calibration*: once a step is over (at the end of its backward, or at its
      exit when backward ran inside the ``with``), the seconds it stalled on copies and I/O
      exceed ``stats.SLOW_FACTOR`` (3) times what its bytes take at the calibrated bandwidths
      (``stats.predicted_seconds``), and ``stats.SLOW_MIN_STALL_S`` (0.1 s). The bandwidths are
      the cached calibration (``spillover.calibrate.load``; never measured here, and the check
      is skipped without one); a simulated link (``sim_link_bandwidth``) is its own calibration.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from .. import _runtime, _tiers
from ..config import Config, format_size
from ..stats import SLOW_FACTOR, OffloadStats, predicted_seconds, slower_than_predicted

if TYPE_CHECKING:
    from .registry import StepRecord
    from .stored import Stored

#: Note [guardrails]: "others" in the pool count from this many bytes and this share of it.
OTHERS_MIN_BYTES = 1 << 20
OTHERS_MIN_SHARE = 1 / 16
#: Note [guardrails]: a compiled node unpacking at least this share of its step's bytes.
COMPILED_SHARE = 0.5


class Guardrails:
    """The guardrail checks of :class:`~.context.OffloadContext` (Note [guardrails])."""

    if TYPE_CHECKING:  # what they read of the context
        config: Config
        _lock: threading.Lock
        _transfers: Dict[Any, Any]
        _calibration: Any

        @property
        def _pool(self) -> Any: ...

        @property
        def nvme(self) -> bool: ...

        def _step_stats(self, rec: StepRecord) -> OffloadStats: ...

    def _pool_others(self) -> int:
        """Bytes of the pool in use by others than this process's activation tiers."""
        in_use = self._pool.stats()["in_use"]
        ours = sum(t.stats()["bytes_in_pool"] for t in _tiers_over(self._pool))
        return max(0, in_use - ours)

    def _found(self, rec: StepRecord, key: str, message: str) -> None:
        rec.findings.append((key, message))
        _runtime.warn_once(key, message)

    def _check_pool(self, rec: StepRecord) -> None:
        kept = rec.stats.bytes_kept_pool_full
        if not kept or "pool" in rec.checked:
            return
        rec.checked.add("pool")
        cap = self._pool.capacity
        others = rec.others
        if others < max(OTHERS_MIN_BYTES, cap * OTHERS_MIN_SHARE):
            others = 0
        else:
            self._found(rec, "guard-pool-others", (
                f"spillover: {format_size(others)} of the {format_size(cap)} host pool was held "
                f"by others when step {rec.index} began, and {format_size(kept)} of saved "
                "activations then found no room and stayed on the device. Something other than "
                "spillover's activation tier leases blocks of the activation pool: release "
                f"them before the step, or raise SPILLOVER_HOST_POOL_BYTES (host_pool_bytes=) to "
                f"at least {format_size(cap + kept)}."
            ))
        if kept > others:
            hint = ("; on the NVMe tier the pool must also hold the copies in flight and the "
                    "largest saved tensor" if self.nvme else
                    ", or use tier='nvme' so that what does not fit spills to disk")
            self._found(rec, "guard-pool-full", (
                f"spillover: the {format_size(cap)} host pool was full: {format_size(kept)} of "
                f"saved activations stayed on the device in step {rec.index} (offload did not "
                "lower their memory). Raise SPILLOVER_HOST_POOL_BYTES (host_pool_bytes=) to "
                f"about {format_size(cap + kept)}{hint}."
            ))

    def _note_node(self, rec: StepRecord, node: Any, s: Stored) -> None:
        """Count what a compiled graph's backward node unpacks (Note [guardrails])."""
        try:
            name = node.name()
        except Exception:
            return
        if "Compiled" not in name:
            return
        try:
            key: Any = (name, node._sequence_nr())
        except Exception:
            key = (name, id(node))
        with self._lock:
            if rec.node is None or rec.node[0] != key:
                rec.node = [key, set(), 0]
            if id(s) in rec.node[1]:
                return
            rec.node[1].add(id(s))
            rec.node[2] += s.nbytes
            seen = (rec.node[2], len(rec.node[1]), name)
            if rec.compiled is None or seen > rec.compiled:
                rec.compiled = seen

    def _check_compiled(self, rec: StepRecord) -> None:
        if rec.compiled is None or "compiled" in rec.checked:
            return
        nbytes, n, name = rec.compiled
        put = rec.tier_stats()["bytes_put"]
        if n < 2 or not put or nbytes < COMPILED_SHARE * put:
            return
        rec.checked.add("compiled")
        self._found(rec, "guard-compiled", (
            f"spillover: a compiled region's backward ({name}) unpacked {n} offloaded tensors "
            f"({format_size(nbytes)}, {100 * nbytes // put}% of what step {rec.index} "
            "offloaded) at once, before computing anything: they are all back on the device "
            "together, so offload cannot lower the peak. Compile per block (torch.compile each "
            "transformer block, e.g. after spillover.wrap(model)) instead of the whole model, or "
            "run offload_context around an uncompiled model."
        ))

    def _check_speed(self, rec: StepRecord) -> None:
        if rec.active or "speed" in rec.checked or not rec.stats.tensors_unpacked:
            return  # checked once, when the step is over: forward done, backward run
        rec.checked.add("speed")
        rates = self._rates(rec)
        if rates is None:
            return
        s = self._step_stats(rec)
        predicted = predicted_seconds(s, rates)
        if not slower_than_predicted(s, predicted):
            return
        assert predicted is not None
        self._found(rec, "guard-slow", (
            f"spillover: step {rec.index} waited {s.stall_seconds:.2f} s for copies and I/O, "
            f"over {SLOW_FACTOR:.0f}x the {predicted:.3f} s its bytes take at this machine's "
            f"calibrated bandwidths ({format_size(s.bytes_offloaded)} offloaded, "
            f"{format_size(s.bytes_offloaded_nvme)} of it to disk): the link or the disk runs "
            "far below its calibration (another process using it, another drive than "
            "calibrated, throttling). Re-calibrate with `python -m spillover bench --force`, "
            "point SPILLOVER_NVME_PATH at a local NVMe drive, or raise "
            "SPILLOVER_PREFETCH_BYTES so reads start earlier."
        ))

    def _rates(self, rec: StepRecord) -> Optional[Dict[str, Optional[float]]]:
        """The bandwidths a step's devices were calibrated at (the slowest of them), or None
        when there is no calibration to compare with."""
        if self._calibration is None:
            try:
                from .. import calibrate

                self._calibration = calibrate.load(self.config) or False
            except Exception:
                self._calibration = False
        cal = self._calibration or {}
        rates: Dict[str, Optional[float]] = {
            "nvme_write": cal.get("nvme_write_bytes_per_s"),
            "nvme_read": cal.get("nvme_read_bytes_per_s"),
        }
        slowest_d2h = slowest_h2d = float("inf")
        for dev in list(rec.devices):
            tr = self._transfers.get(dev)
            if tr is None:
                continue
            bw = tr.sim_bandwidth
            if bw:  # a simulated link: its bandwidth is its calibration
                d2h = h2d = bw
            else:
                if not cal:
                    return None
                d = cal.get("devices", {}).get(_device_key(dev)) or {}
                d2h, h2d = d.get("d2h_bytes_per_s"), d.get("h2d_bytes_per_s")
                if not d2h or not h2d:
                    return None
            if tr.host_is_device:
                h2d = float("inf")  # unpack views the block: nothing comes back
            slowest_d2h, slowest_h2d = min(slowest_d2h, d2h), min(slowest_h2d, h2d)
        rates["d2h"], rates["h2d"] = slowest_d2h, slowest_h2d
        return rates


def _tiers_over(pool: Any) -> List[Any]:
    """The process's activation tiers over ``pool`` (Note [guardrails]: what is not theirs in
    the pool is someone else's)."""
    with _tiers._lock:
        return [t for key, t in _tiers._tiers.items() if key[0] == id(pool)]


def _device_key(device: torch.device) -> str:
    """A device's key in the calibration file (``spillover.calibrate``)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return device.type
