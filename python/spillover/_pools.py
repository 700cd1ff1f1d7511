"""The process's host pools: one owner (:data:`POOLS`) for every pinned pool spillover maps, their
CUDA registration and the counters of both, as torch's caching allocator owns its segments.
Contexts and optimizers lease from it; nothing else maps, registers or drops a pool.

Note [the pool lives for the process]
    A pool is pre-faulted and, on CUDA, page-locked (``cudaHostRegister``): mapping and
    registering ~8 GiB took ~4.5 s on the H200 (3.47 s mapping and pre-faulting, 1.08 s
    registering and unregistering, all under mid-step growth). When the default activation
    pool left with its context, the Quick start's loop (a new ``offload_context`` every step)
    paid that every step: 4.86 s for a step of ~0.4 s, 45x no checkpointing's. So a default
    pool whose last lease is given back is *kept* (idle, still registered), and the next
    context starts on the largest pool kept -- the size the steps grew it to. A smaller one,
    grown past, goes (it would never be leased again). What is kept goes:
    - at :func:`spillover.empty_cache` (before a phase that needs the host memory back: an
      evaluation loop that loads another model, a long run on the CPU side), as
      ``torch.cuda.empty_cache`` gives back the caching allocator's idle segments;
    - under memory pressure: when a step begins and the node's available memory is below what
      Note [node budget] wants left to the rest of the process, idle pools go first;
    - at exit (unregistered from CUDA first).
    A pool of a size the user gave is cached for the process as before.

Note [registered, never unmapped]
    Pinned pages stay pinned until ``cudaHostUnregister``, whoever unmaps them: a pool dropped
    while registered left its range registered, and the next mapping at those addresses made
    torch's next CUDA call fail with "resource already mapped" (cudaErrorAlreadyMapped), sticky
    for the process (the H200's probe: 7 of 9 checks failed after its ``pool`` check dropped a
    registered pool). So registering a pool hands it to the owner, which holds it until it
    unregisters it: a registered pool cannot be unmapped on any path (drop, gc, growth, exit).
    Every CUDA call here checks its result and clears CUDA's last error before raising or
    warning, so no error of spillover's is left for the user's next torch op.

Note [simulated registration]
    On the simulated device (a context with ``sim_link_bandwidth``) a pool is registered with
    the simulator: it costs the host what the H200 measured (4 GiB in 0.26 s: ~16 GB/s) and is
    counted like a CUDA registration, so the CPU's tests see what a step that registers costs.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _native, _runtime
from .config import Config, format_size
from .errors import SpilloverError

__all__ = ["POOLS", "HostPools", "empty_cache", "host_pool", "lease_pool", "return_pool",
           "settle", "register_with_cuda", "pool_ranges"]

#: Largest arena of the pools made here (None: the crate's 1 GiB). Tests make it small to reach
#: storages larger than one arena at small sizes (Note [gathered storages] in rust/tier/gather.rs).
ARENA_BYTES: Optional[int] = None

#: Note [simulated registration]: bytes per second a simulated registration costs the host.
SIM_REGISTER_BANDWIDTH = 16e9

#: Note [the pool lives for the process]: the least time between two checks of memory pressure.
PRESSURE_CHECK_SECONDS = 1.0


class HostPools:
    """The owner of the process's host pools (Notes [the pool lives for the process],
    [registered, never unmapped]). Thread-safe; :data:`POOLS` is the process's one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # sized pools and registrations
        self._lease_lock = threading.Lock()  # never held across a call that can block on another
        self.sized: Dict[Tuple[str, int], Any] = {}  # (purpose, capacity) -> pool, for ever
        self.leased: Dict[int, List[Any]] = {}  # capacity -> [pool, leases held]
        self.idle: List[Any] = []  # default activation pools no lease holds, kept
        self._returned: List[Any] = []  # leases given back, not counted out yet (atomic append)
        self._draining: List[Any] = []  # leaving, registered with CUDA, blocks still out
        #: key -> the pool, while registered (held: Note [registered, never unmapped])
        self.registered: Dict[Tuple, Any] = {}
        self.refused: set = set()
        self.sim_registered: Dict[int, Any] = {}  # id -> pool (Note [simulated registration])
        self._gone_listeners: List[Callable[[Any], None]] = []
        self._last_pressure_check = 0.0
        #: what this process did so far (ctx.stats() shows the differences over a step)
        self.maps = 0
        self.mapped_bytes = 0
        self.registrations = 0
        self.unregistrations = 0
        self.released = 0

    # -- who else must know ---------------------------------------------------------------

    def on_pool_gone(self, fn: Callable[[Any], None]) -> None:
        """``fn(pool)`` runs when a leased pool leaves the process (the tiers over it go)."""
        self._gone_listeners.append(fn)

    def counters(self) -> Dict[str, int]:
        return {"pool_maps": self.maps, "pool_mapped_bytes": self.mapped_bytes,
                "pool_registrations": self.registrations,
                "pool_unregistrations": self.unregistrations, "pools_released": self.released}

    def held_bytes(self) -> int:
        """Capacity of every pool this process holds mapped (Note [node budget])."""
        with self._lock:
            total = sum(p.capacity for p in self.sized.values())
        return total + sum(p.capacity for p in self._mapped_leasable())

    def _mapped_leasable(self) -> List[Any]:
        return [e[0] for e in list(self.leased.values())] + list(self.idle) + list(self._draining)

    def _map(self, capacity: int) -> Any:
        pool = _native.Pool(capacity, arena_bytes=ARENA_BYTES)
        self.maps += 1
        self.mapped_bytes += capacity
        return pool

    # -- pools of a size the user gave, and the optimizer's -------------------------------

    def host_pool(self, cfg: Config, purpose: str = "activations",
                  need: Optional[int] = None) -> Any:
        """The process's pool for ``purpose`` (made on first use): ``"activations"`` (every
        ``offload_context`` with ``cfg.host_pool_bytes``) or ``"optim"`` (every
        ``OffloadAdamW``; ``cfg.optim_pool_bytes``). The two never share a pool, so one cannot
        starve the other. Without a size from the user: the default of Note [node budget], or
        less when the caller knows it ``need``s less (``sized_for``)."""
        size = cfg.optim_pool_bytes if purpose == "optim" else cfg.host_pool_bytes
        explicit = size is not None
        if size is None:
            default = _runtime.default_size(purpose)
            size = default if need is None else min(default, _runtime.sized_for(need))
        with self._lock:
            known = (purpose, size) in self.sized
        if not known:
            mem = _runtime.node_memory()
            _runtime.check_pool_size(size, purpose, mem, explicit=explicit)
            _runtime.log.info("%s pool of %s: %s", purpose, format_size(size), mem.describe())
        with self._lock:
            pool = self.sized.get((purpose, size))
            if pool is None:
                _runtime.log.info("mapping a %s host pool for %s", format_size(size), purpose)
                pool = self._map(size)
                self.sized[(purpose, size)] = pool
                lock_warning = pool.lock_warning
            else:
                lock_warning = None
        if lock_warning:
            _runtime.warn_once("pool-lock", lock_warning)
        return pool

    # -- the growing default activation pools (Note [growing pool] in _growth.py) ----------

    def lease(self, capacity: int) -> Any:
        """A lease of the default activation pool of ``capacity``: shared by every context that
        leases it, an idle one of that capacity taken again, else mapped (refused or warned
        about by Note [node budget])."""
        self._settle(blocking=True)
        with self._lease_lock:
            pool = self._take(capacity)
            if pool is not None:
                return pool
        mem = _runtime.node_memory()
        _runtime.check_pool_size(capacity, "activations", mem)
        _runtime.log.info("mapping a %s activation pool (growing default): %s",
                          format_size(capacity), mem.describe())
        pool = self._map(capacity)  # outside the lock: mapping is slow
        with self._lease_lock:
            entry = self.leased.setdefault(capacity, [pool, 0])
            entry[1] += 1
        if entry[0] is pool and pool.lock_warning:
            _runtime.warn_once("pool-lock", pool.lock_warning)
        return entry[0]

    def lease_first(self, first: int) -> Any:
        """The pool a new context starts on (Note [the pool lives for the process]): the
        largest default pool the process holds (leased by another context, or idle), else a
        new one of ``first``."""
        self._settle(blocking=True)
        with self._lease_lock:
            sizes = [c for c in self.leased] + [p.capacity for p in self.idle]
            if sizes:
                pool = self._take(max(sizes))
                if pool is not None:
                    return pool
        return self.lease(first)

    def largest_idle(self, above: int) -> Optional[int]:
        """The capacity of the largest idle pool above ``above``, if any (a growth takes it
        instead of mapping one)."""
        with self._lease_lock:
            caps = [p.capacity for p in self.idle if p.capacity > above]
        return max(caps) if caps else None

    def _take(self, capacity: int) -> Optional[Any]:
        """Under the lease lock: a lease of the pool of ``capacity`` already held."""
        entry = self.leased.get(capacity)
        if entry is not None:
            entry[1] += 1
            return entry[0]
        for i, p in enumerate(self.idle):
            if p.capacity == capacity:
                del self.idle[i]
                self.leased[capacity] = [p, 1]
                return p
        return None

    def give_back(self, pool: Any) -> None:
        """Give back one lease of ``pool`` (a context collected, or grown past it). Safe in a
        finalizer, which gc may run on any thread at any allocation: it never blocks, and what
        it cannot settle at once (another thread holds the lock) is settled at the next
        lease."""
        self._returned.append(pool)
        self._settle(blocking=False)

    def settle(self) -> None:
        """Settle what returns could not settle at once, and give idle pools back under memory
        pressure; contexts call it as each step begins. Never waits."""
        self._settle(blocking=False)
        if self.idle and time.monotonic() - self._last_pressure_check >= PRESSURE_CHECK_SECONDS:
            self._last_pressure_check = time.monotonic()
            mem = _runtime.node_memory()
            if mem.room < max(_runtime.LOW_ROOM_MIN, mem.share // _runtime.LOW_ROOM_SHARE):
                n = self.release_idle()
                if n:
                    _runtime.log.info("gave back %s of idle activation pools: memory is low "
                                      "(%s)", format_size(n), mem.describe())

    def _settle(self, blocking: bool) -> None:
        """Count out the leases given back: a pool with none left is kept idle while it is the
        largest the process holds, else it leaves (Note [the pool lives for the process]);
        leaving, it is unregistered from CUDA first, once no block of it is leased."""
        if not self._lease_lock.acquire(blocking=blocking):
            return
        gone: List[Any] = []
        try:
            while self._returned:
                pool = self._returned.pop()
                for capacity, entry in list(self.leased.items()):
                    if entry[0] is pool:
                        entry[1] -= 1
                        if entry[1] <= 0:
                            del self.leased[capacity]
                            self.idle.append(pool)
                        break
            if self.idle:  # the largest held stays; an idle one below it was grown past
                top = max([c for c in self.leased] + [p.capacity for p in self.idle])
                keep = [p for p in self.idle if p.capacity == top][:1]
                gone += [p for p in self.idle if p not in keep]
                self.idle[:] = keep
            self._leave(gone)
        finally:
            self._lease_lock.release()
        self._forget(gone)

    def _leave(self, gone: List[Any]) -> None:
        """Under the lease lock: ``gone`` leave the cache; the registered ones drain first."""
        self._draining.extend(gone)
        self._draining[:] = [p for p in self._draining if not self._unregister_if_idle(p)]

    def _forget(self, gone: List[Any]) -> None:
        for pool in gone:
            self.released += 1
            for fn in self._gone_listeners:
                fn(pool)
            _runtime.log.info("released a %s activation pool", format_size(pool.capacity))

    def release_idle(self) -> int:
        """Every idle default pool leaves the process (unregistered first); returns the bytes
        given back. Pools leased by a live context stay."""
        self._settle(blocking=True)
        with self._lease_lock:
            gone, self.idle[:] = list(self.idle), []
            self._leave(gone)
        self._forget(gone)
        with self._lock:  # registered pools nobody else holds (a raw Pool a user registered)
            held = [*self.sized.values(), *self._mapped_leasable()]
            orphans = [p for p in [*self.registered.values(), *self.sim_registered.values()]
                       if sys.getrefcount(p) <= 4 and not any(p is q for q in held)]
        for pool in orphans:
            if self._unregister_if_idle(pool):
                gone.append(pool)
        del orphans
        return sum(p.capacity for p in gone)

    # -- CUDA registration (Note [registered, never unmapped]) -----------------------------

    def register(self, pool: Any, sim: bool = False) -> bool:
        """Page-lock ``pool``'s arenas for CUDA once (``cudaHostRegister``, portable to every
        device), or with the simulated device when ``sim`` (Note [simulated registration]).
        True once every arena is registered. A refusal unregisters what it did, clears CUDA's
        last error, warns once and returns False (copies from the pool are then synchronous);
        a refused pool is not tried again. The owner holds a registered pool until it
        unregisters it."""
        if sim:
            with self._lock:
                if id(pool) in self.sim_registered:
                    return True
                self.sim_registered[id(pool)] = pool
            time.sleep(pool.capacity / SIM_REGISTER_BANDWIDTH)
            self.registrations += 1
            return True
        import torch

        if not torch.cuda.is_available():
            return False
        arenas = list(pool.arenas())
        key = (id(pool), tuple(arenas))  # the arenas too: an id can be reused once a pool goes
        cudart = torch.cuda.cudart()  # initialises CUDA, outside the lock
        host_register_portable = 1  # cudaHostRegisterPortable: pinned for every device
        failure = None
        with self._lock:
            if key in self.registered:
                return True
            if key in self.refused:
                return False
            done: List[int] = []
            with torch.cuda.device(torch.cuda.current_device()):
                for addr, length in arenas:
                    code = _code(cudart.cudaHostRegister(addr, length, host_register_portable))
                    if code != 0:
                        for a in done:
                            _code(cudart.cudaHostUnregister(a))
                        cleared = clear_last_error(cudart)
                        failure = (length, code, cleared)
                        self.refused.add(key)
                        break
                    done.append(addr)
                else:
                    self.registered[key] = pool
                    self.registrations += 1
        if failure is None:
            return True
        length, code, cleared = failure
        _runtime.warn_once(
            "cuda-register",
            f"spillover: cudaHostRegister of a {format_size(length)} host arena failed "
            f"(cudaError {code}); the pool is not registered and device copies from it will be "
            "synchronous. Lower SPILLOVER_HOST_POOL_BYTES, or check that nothing else "
            "registered this memory."
            + ("" if cleared else " CUDA's last error could not be cleared (no "
               "cudaGetLastError found): the next CUDA call may report it."),
        )
        return False

    def _unregister_if_idle(self, pool: Any) -> bool:
        """Unregister ``pool`` (CUDA or simulated) once none of its blocks is leased; True once
        it is not registered (also: never was). Raises SpilloverError when CUDA refuses."""
        key = (id(pool), tuple(pool.arenas()))
        self.refused.discard(key)  # a later pool may get this id and these arenas
        sim = self.sim_registered.get(id(pool)) is pool
        if key not in self.registered and not sim:
            return True
        if pool.stats()["in_use"]:
            return False
        if sim:
            self.sim_registered.pop(id(pool), None)
            time.sleep(pool.capacity / SIM_REGISTER_BANDWIDTH / 2)
            self.unregistrations += 1
            return True
        import torch

        if not torch.cuda.is_available():  # registered through a stand-in (tests): nothing
            self.registered.pop(key, None)  # is pinned in a process without CUDA
            return True
        cudart = torch.cuda.cudart()
        for addr, length in key[1]:
            code = _code(cudart.cudaHostUnregister(addr))
            if code != 0:
                clear_last_error(cudart)
                raise SpilloverError(
                    f"spillover: cudaHostUnregister of a {format_size(length)} host arena at "
                    f"{addr:#x} failed (cudaError {code}); the pool stays mapped (never "
                    "unmapped while registered). Report this with `python -m spillover doctor`.")
        self.registered.pop(key, None)
        self.unregistrations += 1
        return True

    def pool_ranges(self) -> List[Tuple[int, int]]:
        """Address ranges of every pool arena (to recognise tensors that already live in one)."""
        with self._lock:
            pools = list(self.sized.values())
        pools += self._mapped_leasable()
        return [(a, a + n) for p in pools for (a, n) in p.arenas()]

    def at_exit(self) -> None:
        """Unregister every pool before the interpreter unmaps it (Note [registered, never
        unmapped]); what is still in use stays registered (the process is ending)."""
        self._settle(blocking=False)
        with self._lock:
            pools = list(self.registered.values())
        for p in pools:
            with contextlib.suppress(Exception):  # at exit: CUDA may be gone already
                self._unregister_if_idle(p)

    def after_fork_in_child(self) -> None:
        """Note [fork] (rust/io/mod.rs): a forked child starts with no pools of its own; what
        it inherited stays with the parent."""
        self.__init__()  # type: ignore[misc]


def _code(err: object) -> int:
    return int(getattr(err, "value", err))


def clear_last_error(cudart: Any) -> bool:
    """cudaGetLastError in the runtime torch uses: torch's binding when it has one, else ctypes
    on the libcudart this process loaded (never a second copy of the runtime)."""
    fn = getattr(cudart, "cudaGetLastError", None)
    if fn is not None:
        fn()
        return True
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        libs = set()
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.cudaGetLastError()
            return True
        except (OSError, AttributeError):
            continue
    try:  # a runtime linked statically into torch and exported
        ctypes.CDLL(None).cudaGetLastError()
        return True
    except (OSError, AttributeError):
        return False


#: The process's one owner of host pools.
POOLS = HostPools()
_runtime.held_in_pools = POOLS.held_bytes
atexit.register(POOLS.at_exit)
os.register_at_fork(after_in_child=POOLS.after_fork_in_child)


def host_pool(cfg: Config, purpose: str = "activations", need: Optional[int] = None) -> Any:
    """:meth:`HostPools.host_pool` of the process's owner."""
    return POOLS.host_pool(cfg, purpose, need)


def lease_pool(capacity: int) -> Any:
    return POOLS.lease(capacity)


def return_pool(pool: Any) -> None:
    POOLS.give_back(pool)


def settle() -> None:
    POOLS.settle()


def register_with_cuda(pool: Any) -> bool:
    """:meth:`HostPools.register` for CUDA: the owner holds ``pool`` until it unregisters it."""
    return POOLS.register(pool)


def pool_ranges() -> List[Tuple[int, int]]:
    return POOLS.pool_ranges()


def empty_cache() -> int:
    """Give back the host memory of the activation pools no context uses (Note [the pool lives
    for the process]): unregistered from CUDA, unmapped. Returns the bytes given back. Call it
    before a phase that needs the host memory (loading another model, a long CPU-side job);
    the next ``offload_context`` maps and registers its pool again (seconds for GiBs). A
    planner's peak meter left running by a step that had no step after it stops too (Note [a
    stale profiler] in _peak.py)."""
    from ._peak import stop_stale

    stop_stale()
    return POOLS.release_idle()

