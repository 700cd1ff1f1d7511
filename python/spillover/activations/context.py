"""``offload_context``: saved activations leave device memory during forward and come back for
backward, through ``torch.autograd.graph.saved_tensors_hooks``. This module owns the context
object -- its steps, their counters and reports, the pools they use --; the hooks are in
hooks.py, which steps are active and what each step records in registry.py, the device copies
in link/, the guardrails in guardrails.py.

Note [graph capture]
    Under CUDA graph capture nothing may be queried, synchronized, mapped or registered, and a
    copy into host memory would bake that memory's address into the graph. So pack passes
    tensors through (kept on the device, counted as unsupported), entering and leaving a step
    queries no event, a context never makes, grows or lets go of a pool during a capture, and:
    - a context whose first step would run under capture raises, saying to enter it once
      eagerly first (its pool is made and registered then);
    - an unpack under capture of a tensor offloaded by an eager forward raises: bringing it
      back would capture a copy from a host block the graph would read at every replay.
    ``capturing`` asks the tensor's device, not only the current one.

Who owns what
    The Rust tier (``spillover._native.Tier``, rust/tier) owns every offloaded block: where its
    bytes are (pool, disk, in flight), write-behind, eviction and read-ahead. The link of each
    device kind (activations/link) owns the torch objects a device copy needs: which stream
    copies what, how many bytes of copies may be in flight, when a copy's source is released.
    The hooks (hooks.py) own the torch semantics between them: which saved tensors are
    offloaded, one storage however many views of it are saved, version checks, and rebuilding
    the exact view on unpack. This module owns the steps they run in.

What is freed when
    A tier entry belongs to the handles autograd holds; when autograd frees the last of them
    (after the backward that used it, or when an abandoned graph is collected) the entry is
    freed wherever it is (pool, disk, or a request in flight, which finishes first). A tensor
    returned by unpack on a CPU host views its block, and the block stays where it is while
    that tensor lives (Note [views hold blocks] in rust/tier/mod.rs). The device copies'
    sources are released when the copy is done, when the bytes in flight pass the cap, at every
    unpack and at the end of backward (Note [sources held] in rust/link/mod.rs): nothing the step
    offloaded stays on the device after ``backward()``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _pools, _runtime, _tiers, suspend
from .._growth import Pools
from ..config import Config
from ..errors import ConfigError
from ..stats import OffloadStats, format_report
from . import registry
from .guardrails import Guardrails
from .hooks import Hooks
from .registry import StepRecord
from .verify import DeviceChecks

__all__ = ["offload_context", "OffloadContext", "keep", "current_context"]

current_context = registry.current_context
keep = registry.keep


class OffloadContext(Hooks, Guardrails):
    """The object ``offload_context`` returns; use it as a context manager, once per step.

    One object may be entered any number of times in sequence, one step each (Note [one
    context, many steps]); entering it while it is active on the same thread raises
    RuntimeError. Its handles stay valid after exit, so backward can run outside the ``with``
    block, also after the next step has begun. ``stats()`` reports the latest step,
    ``stats(total=True)`` every step; ``report()`` says in words where the step's memory went.
    """

    def __init__(self, tier: Optional[str] = None, **overrides: Any):
        self.config = Config.load(tier=tier, **overrides)
        _runtime.configure_logging(self.config)
        registry.install_module_hook()  # Note [one hook for the run] in registry.py
        self.tier = self._resolve_tier(self.config.tier)
        if self.tier != "host" and self.config.nvme_path:
            _tiers.check_dirs(self.config.nvme_path, self.config)  # now, not at the first step
        self._pools = Pools(self.config, self.tier)  # Note [growing pool] in _growth.py
        # Its leases go back when the context does (it holds nothing of the context).
        weakref.finalize(self, self._pools.close).atexit = False
        self._grow_lock = threading.Lock()
        self._records: List[StepRecord] = []  # steps not folded into the total yet
        self._last: Optional[StepRecord] = None
        self._folded = OffloadStats()
        self._folded_findings: Dict[str, List[Any]] = {}  # guardrail -> [first message, steps]
        self._steps = 0
        self._pending_marks: set = set()  # keep() outside any step: for the next one
        self._pool_ranges: List[Tuple[int, int]] = []
        self._pool_starts: List[int] = []
        self._transfers: Dict[Any, Any] = {}
        self._transfer_base: Dict[Any, Tuple[float, int]] = {}
        self._chunk_above = 0
        self._chunk_bytes = 0
        self._in_backward = False
        self._bwd_records: Dict[int, StepRecord] = {}  # records unpacked in this backward
        self._calibration: Any = None  # loaded once: dict, or False when there is none
        self._checks = DeviceChecks()  # Note [verify on the device]
        self._lock = threading.Lock()

    @staticmethod
    def _resolve_tier(tier: str) -> str:
        if tier not in ("host", "nvme", "auto"):
            raise ConfigError(f"tier={tier!r}: expected host, nvme or auto")
        return tier

    @property
    def _pool(self) -> Any:
        """The current host pool (None before the first step)."""
        return self._pools.pool

    @property
    def _tier(self) -> Any:
        """The current activation tier (``spillover._native.Tier``) over it."""
        return self._pools.tier

    @property
    def nvme(self) -> bool:
        """Whether this context spills to swap files (tier nvme, or auto with a swap open)."""
        return self._tier is not None and self._tier.has_swap

    @property
    def pool_mapped(self) -> int:
        """The capacity of the host pool this context has mapped now (0 before its first
        step)."""
        pool = self._pool
        return int(pool.capacity) if pool is not None else 0

    @property
    def grows_in_ram(self) -> bool:
        """Whether what this context takes now stays in host RAM, in a default pool that grows
        for it (no size given): the host tier, or tier auto while its pool can still grow
        (Note [RAM before the drive] in _growth.py). Before its first step: what that step
        will do."""
        if not self._pools.growable:
            return False
        tier = self._tier
        if tier is None:
            return self.tier in ("host", "auto")
        return not tier.has_swap or bool(tier.defers_writes)

    @property
    def _step(self) -> Any:
        """The latest step's tier step (``spillover._native.Step``), or None (tests)."""
        rec = self._last
        return rec.step if rec is not None else None

    @property
    def steps(self) -> int:
        """How many times this context has been entered."""
        return self._steps

    # -- context manager --

    def __enter__(self) -> OffloadContext:
        running = registry.active_record(self)
        if running is not None:
            raise RuntimeError(
                f"this offload_context is already active on this thread (step {running.index}"
                " has not exited its `with` block): exit it before entering it again -- one "
                "`with ctx:` per step -- or use a second offload_context(...) for a nested "
                "region"
            )
        captured = registry.capturing()
        pools_base = _pools.POOLS.counters()  # what this step maps and registers, from here
        with self._grow_lock:  # Note [growing pool] in _growth.py
            if self._pool is None:
                if captured:  # Note [graph capture]
                    raise RuntimeError(
                        "offload_context: the first step of a context cannot run under CUDA "
                        "graph capture: it maps its host pool and registers it with CUDA, which "
                        "a capture forbids. Enter the context once eagerly (one step outside "
                        "the capture, e.g. the warm-up steps CUDA graphs need anyway), then "
                        "capture")
                self._open()
            elif not captured:  # under capture no pool is made or let go (Note [graph capture])
                with self._lock:
                    busy = [r.tier for r in self._records if r.active]  # other threads' steps
                self._pools.retire(busy)
                if self._pools.grow_between_steps():
                    self._grown()
        self._pool_ranges = sorted(_pools.pool_ranges())  # pools made since count too
        self._pool_starts = [a for a, _ in self._pool_ranges]
        others = self._pool_others()
        with self._lock:
            now = {} if captured else self._transfer_now()  # no event queried
            if self._last is not None and self._last.tr_end is None:
                self._last.tr_end = now
                self._last.pools_end = pools_base
            self._fold(keep_last=False)  # a new latest step begins
            self._steps += 1
            index = self._steps
        rec = StepRecord(index, self._tier, others, now)
        rec.pools_base = pools_base
        rec.stats.pool_capacity = self._pool.capacity
        with self._lock:
            rec.marked, self._pending_marks = self._pending_marks, set()
            self._records.append(rec)
            self._last = rec
        registry.install_module_hook()  # again: a `catch_warnings` may have taken its filter
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        registry.stack().append(registry.Active(self, rec, hooks))
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = registry.stack()
        i = max(i for i, a in enumerate(stack) if a.ctx is self)
        _, rec, hooks = stack.pop(i)
        if not suspend._forget(hooks):  # Note [no offload] in suspend.py
            hooks.__exit__(*exc)
        rec.active = False
        self._pools.note_forward_end(prepare=not registry.capturing(),
                                     offloaded=sum(st.nbytes for st in list(rec.stored)))
        rec.dedup.clear()
        rec.rederived.clear()
        rec.marked.clear()
        rec.kept.clear()
        if registry.capturing():
            return  # under CUDA graph capture no event may be queried (pack passed through)
        if exc[0] is None:
            self._check_pool(rec)
            self._check_compiled(rec)
            self._check_speed(rec)  # when its backward ran inside the `with`
        for tr in list(self._transfers.values()):
            if not tr.host_is_device:
                tr.flush()  # Note [grouped copies] in rust/link: the last group goes now
            tr.reap(rec.errors)  # copies done by now release their sources at once

    def _open(self) -> None:
        self._pools.open()
        self._grown()

    def _grown(self) -> None:
        """A pool became current (Note [growing pool] in _growth.py)."""
        self.tier = self._pools.tier_name  # "auto" resolved
        self._chunk_above, self._chunk_bytes = self._pools.chunk_sizes()
        self._pool_ranges = sorted(_pools.pool_ranges())
        self._pool_starts = [a for a, _ in self._pool_ranges]

    # -- user API --

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keep ``tensor``'s storage in place when it is saved in this context's current step
        (the one active on this thread; outside one, the next step)."""
        key = registry.storage_key(tensor)
        rec = registry.active_record(self)
        with self._lock:
            (rec.marked if rec is not None else self._pending_marks).add(key)
        return tensor

    def stats(self, total: bool = False) -> OffloadStats:
        """A snapshot of the counters (a copy; later steps do not change it): of the latest
        step (its forward and, once it has run, its backward), or with ``total=True`` the sum
        over every step this context ran (``steps`` says how many). The pool and swap gauges
        are read now."""
        with self._lock:
            if total:
                self._fold()
                out, recs = self._folded.copy(), list(self._records)
            else:
                out, recs = OffloadStats(), [self._last] if self._last is not None else []
        for rec in recs:
            out = out + self._step_stats(rec)
        # Every pool this context still holds: one per generation (Note [growing pool]).
        for ts in [t.stats() for t in self._pools.tiers()]:
            out.pool_in_use += ts["pool_in_use"]
            out.swap_in_use += ts["swap_in_use"]
            out.pool_peak = max(out.pool_peak, ts["pool_peak"])
        if self._pool is not None:
            out.pool_capacity = self._pool.capacity
        return out

    def report(self, total: bool = False) -> str:
        """In words, for the latest step (or every step, ``total=True``): where its device
        memory went -- bytes kept and why (small, parameter, marked, pool full, unsupported),
        bytes offloaded per tier --, the seconds it stalled, how read-ahead did, and the
        guardrails it tripped (Note [guardrails])."""
        s = self.stats(total=total)
        with self._lock:
            if total:  # each guardrail once, with the steps that tripped it
                found = {k: list(v) for k, v in self._folded_findings.items()}
                for rec in self._records:
                    for key, message in rec.findings:
                        found.setdefault(key, [message, 0])[1] += 1
                findings = [f"{m} (in {n} step{'' if n == 1 else 's'})"
                            for m, n in found.values()]
            else:
                findings = [m for _, m in self._last.findings] if self._last else []
        if total:
            title = (f"spillover: {s.steps} step{'' if s.steps == 1 else 's'} on the "
                     f"{self._tier_words()}")
        elif self._last is None:
            title = "spillover: no step yet (enter the context around a forward)"
        else:
            title = f"spillover: step {self._last.index} on the {self._tier_words()}"
        return format_report(s, title=title, min_offload_bytes=self.config.min_offload_bytes,
                             findings=findings,
                             pool_limit=self._pools.limit() if self._pool is not None else 0)

    def _tier_words(self) -> str:
        """The tier in a report's title; for ``tier="auto"``, what it chose."""
        if self.config.tier != "auto":
            return f"{self.tier} tier"
        if self._pool is None:
            return "auto tier (not chosen yet)"
        if self.nvme:
            return "auto tier (chose nvme: the host pool, spilling to swap files)"
        return "auto tier (chose host: the NVMe tier could not open)"

    def pack(self, tensor: torch.Tensor) -> Any:
        """Offload ``tensor`` as this context's saved-tensor hook would; returns a handle for
        :meth:`unpack` (or the tensor itself when it is kept). For wrappers that save tensors
        outside autograd's hooks, e.g. selective checkpointing's cached op outputs. Counted in
        the step active on this thread, else the latest step."""
        return self._pack(tensor)

    def kept(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor`` as saved for backward and kept on the device by a recompute policy
        (Note [kept by a policy]), without offloading it; returns it. For wrappers that hold
        saved tensors themselves. Counted in the step active on this thread, else the latest."""
        return self._pack(tensor, offload=False)

    def remade_or_kept(self, tensor: torch.Tensor) -> Any:
        """As :meth:`kept`, except for a tensor this context would make again at unpack (Note
        [made again at unpack] in rederive.py): its handle for :meth:`unpack`, holding nothing.
        The pack hook of a region ``policy="auto"`` runs plainly with its cheap saves made
        again (Note [a plain tail makes its cheap saves again] in planner/search.py)."""
        return self._pack(tensor, offload=False, remake=True)

    def keep_rest(self, on: bool = True) -> None:
        """Keep on the device, counted as kept by a policy, every tensor saved from now until
        this step's backward starts (or until ``keep_rest(False)``): what a model saves after
        its last region, which backward needs first (Note [the tail stays] in
        planner/search.py). No-op when no step of this context is active on this thread."""
        rec = registry.active_record(self)
        if rec is not None:
            rec.keep_rest = on

    @property
    def pool_limit(self) -> int:
        """The most the host pool may hold: the size given (``host_pool_bytes=``), else what
        the default pool may grow to (Note [growing pool] in _growth.py). What a planner may
        count on; ``stats().pool_capacity`` is what is mapped now."""
        return self._pools.limit()

    def unpack(self, handle: Any) -> torch.Tensor:
        """The tensor :meth:`pack` was given, bitwise, on its original device."""
        return self._unpack(handle)

    def synchronize(self) -> None:
        """Wait for every copy this context's devices have in flight and every write or read
        of the tier (tests, measurements). Raises the first I/O error one of them hit."""
        for tr in list(self._transfers.values()):
            tr.synchronize()  # waits for every copy; raises errors no step owns
        self._checks.check()
        with self._lock:  # then the first of this context's steps' (Note [errors go to ...])
            error = next((rec.errors.pop(0) for rec in self._records if rec.errors), None)
        if error is not None:
            raise error
        for tier in self._pools.tiers():
            tier.wait_idle()

    # -- steps --

    def _current(self) -> StepRecord:
        rec = registry.active_record(self)
        if rec is not None:
            return rec
        rec = self._last
        if rec is None:
            raise RuntimeError("offload_context: pack before the context was ever entered; "
                               "enter it (`with ctx:`) around the forward first")
        return rec

    def _transfer_now(self) -> Dict[Any, Tuple[float, int]]:
        return {dev: (tr.stall_seconds, tr.forced_waits) for dev, tr in self._transfers.items()}

    def _fold(self, keep_last: bool = True) -> None:
        """Under ``_lock``: fold into the total the steps that are over -- exited, no entry
        alive, and (``keep_last``) not the latest (Note [one context, many steps])."""
        keep = []
        for rec in self._records:
            if rec.active or (keep_last and rec is self._last) or len(rec.stored):
                keep.append(rec)
            else:
                self._folded = self._folded + self._step_stats(rec)
                for key, message in rec.findings:
                    self._folded_findings.setdefault(key, [message, 0])[1] += 1
        self._records = keep

    def _step_stats(self, rec: StepRecord) -> OffloadStats:
        out = rec.stats.copy()
        end = rec.pools_end or _pools.POOLS.counters()
        out.pool_maps = end["pool_maps"] - rec.pools_base.get("pool_maps", 0)
        out.pool_registrations = (end["pool_registrations"]
                                  - rec.pools_base.get("pool_registrations", 0))
        st = rec.tier_stats()
        out.bytes_offloaded_nvme = st["bytes_written"]
        out.bytes_offloaded_host = st["bytes_put"] - st["bytes_written"]
        out.prefetch_hits = st["prefetch_hits"]
        out.prefetch_misses = st["prefetch_misses"]
        out.host_cache_hits = st["host_cache_hits"]
        out.overflow_reads = st["overflow_reads"]
        out.stall_seconds += st["stall_seconds"]
        for dev, tr in list(self._transfers.items()):
            if rec.tr_end is not None:
                end = rec.tr_end.get(dev)
                if end is None:
                    continue  # first used after this step ended
            else:
                end = (tr.stall_seconds, tr.forced_waits)
            base = rec.tr_base.get(dev) or self._transfer_base[dev]
            out.stall_seconds += end[0] - base[0]
            out.copy_waits_forced += end[1] - base[1]
        return out


def offload_context(tier: Optional[str] = None, **overrides: Any) -> OffloadContext:
    """Offload the activations autograd saves inside the ``with`` block.

    Args:
        tier: ``"host"`` (pinned host pool), ``"nvme"`` or ``"auto"``; default SPILLOVER_TIER.
        **overrides: any knob of :class:`spillover.Config` (``host_pool_bytes``,
            ``min_offload_bytes``, ``verify``, ``copy_inflight_bytes``, ...), overriding its
            SPILLOVER_* variable.

    The object is reusable: make it once and enter it around each step's forward (Note [one
    context, many steps]); ``stats()`` and ``report()`` describe the latest step,
    ``stats(total=True)`` and ``report(total=True)`` every step so far.

    Raises:
        ConfigError: a bad value, or a SPILLOVER_* variable spillover does not know.

    Example::

        ctx = spillover.offload_context(tier="host")
        for batch in loader:
            with ctx:
                loss = model(batch).loss
            loss.backward()            # outside the `with`: fine
        print(ctx.stats(), ctx.report(), sep="\n")
    """
    return OffloadContext(tier=tier, **overrides)
