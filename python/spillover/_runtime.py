"""Process-wide resources shared by every context: host pools, logging, one-time warnings.

A pool is expensive to make (it maps and pre-faults its arenas) and cheap to share (leases are
thread-safe), so each distinct capacity is made once per process and purpose and reused: one
for activations (every ``offload_context``), one for the optimizer (every ``OffloadAdamW``).
A size the user gave is cached for the process; the default activation pools are leased and
leave with their last context (Note [growing pool] in _growth.py).

Note [node budget]
    Pools are pre-faulted, so their size is RAM taken at once, and eight ranks on one node take
    it eight times. A pool is sized and checked against the node, once, when it is made:
    - the node's memory is the host's, or its memory cgroup's limit when lower (the lowest
      limit on the path from the process's cgroup to the root, v1 or v2); this rank's *share*
      is that divided by the local world size (``LOCAL_WORLD_SIZE``, set by torchrun);
    - by default each of the two pools (activations: ``SPILLOVER_HOST_POOL_BYTES``; the
      optimizer's state and staging: ``SPILLOVER_OPTIM_POOL_BYTES``) is at most a quarter of the
      share, at most 8 GiB, and at most half of the memory available now; never below 64 MiB.
      The activations' starts at 64 MiB and grows to what the steps hold (Note [growing pool] in
      _growth.py); the optimizer's is smaller when its parameters need less (``OffloadAdamW``
      knows at construction how much state and staging its trainable parameters can lease):
      a small model does not pre-fault gigabytes;
    - a size given by the user that is larger than the share (less what this process already
      holds in pools) or than the memory available now raises ``ConfigError`` before anything
      is mapped, naming the size, the share, what is available and the variable to change:
      pre-faulting it would only end in the kernel's OOM killer, which may pick another rank;
    - a size that fits but leaves less than an eighth of the share (at least 1 GiB) available
      to the rest of the process warns once.
    The two pools are separate so that neither can starve the other: an optimizer's state
    filling its pool falls back to heap memory with a warning; activations that do not fit
    theirs stay on the device (guardrail: Note [guardrails] in activations/guardrails.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import psutil

from . import _native
from .config import Config, format_size
from .errors import ConfigError

log = logging.getLogger("spillover")

_lock = threading.Lock()
_pools: Dict[Tuple[str, int], _native.Pool] = {}
_defaults: Dict[str, int] = {}  # purpose -> its default size, computed once
_warned: set = set()
_cuda_registered: set = set()

#: Default pool: a quarter of RAM, at most this much.
DEFAULT_POOL_CAP = 8 << 30
MIN_POOL = 64 << 20


def configure_logging(cfg: Config) -> None:
    log.setLevel(cfg.log)


def warn_once(key: str, message: str, category: type = RuntimeWarning) -> None:
    """Issue ``message`` the first time ``key`` is seen in this process, once: as a warning of
    ``category`` (attributed to the caller's caller, as ``stacklevel=3``), or, when the warnings
    filters ignore it (``-W ignore``, ``warnings.simplefilter("ignore")``), on the ``spillover``
    logger at WARNING instead, so that silencing Python's warnings does not silence spillover's
    guardrails (``SPILLOVER_LOG=error`` does). Never both: one situation, one line."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    if _ignored(message, category, stacklevel=3):
        log.warning(message)
    else:
        warnings.warn(message, category, stacklevel=3)


def _ignored(message: str, category: type, stacklevel: int) -> bool:
    """Whether ``warnings.warn(message, category, stacklevel)`` called by our caller would be
    dropped by an "ignore" filter: the first filter that matches decides, as in
    ``warnings.warn_explicit`` (message, category, the frame's module and line)."""
    try:
        frame = sys._getframe(stacklevel)
        module, lineno = frame.f_globals.get("__name__", "<string>"), frame.f_lineno
    except ValueError:  # a shallower stack: warnings attributes it to "sys"
        module, lineno = "sys", 0
    for action, msg, cat, mod, ln in warnings.filters:
        if ((msg is None or msg.match(message)) and issubclass(category, cat)
                and (mod is None or mod.match(module)) and (ln == 0 or ln == lineno)):
            return action == "ignore"
    return getattr(warnings, "defaultaction", "default") == "ignore"


#: Note [node budget]: a process should keep at least this share of its room after its pools.
LOW_ROOM_SHARE = 8
LOW_ROOM_MIN = 1 << 30
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge page-rounded number


@dataclasses.dataclass(frozen=True)
class NodeMemory:
    """What this process may use of its node's memory: Note [node budget]."""

    host_total: int
    host_available: int
    cgroup_limit: Optional[int]  # None: no limit on this process's memory cgroup
    cgroup_usage: int
    local_world: int  # processes of this job on this node (LOCAL_WORLD_SIZE)
    in_pools: int  # bytes this process already holds in spillover's pools

    @property
    def total(self) -> int:
        """The node memory this job may use: the host's, or its cgroup's limit when lower."""
        if self.cgroup_limit is None:
            return self.host_total
        return min(self.host_total, self.cgroup_limit)

    @property
    def room(self) -> int:
        """Bytes that can be allocated now: the host's available memory, or the cgroup's room
        when lower."""
        room = self.host_available
        if self.cgroup_limit is not None:
            room = min(room, max(0, self.cgroup_limit - self.cgroup_usage))
        return room

    @property
    def share(self) -> int:
        """This rank's share of the node: ``total / local_world``."""
        return self.total // max(1, self.local_world)

    def describe(self) -> str:
        where = ("the host's" if self.cgroup_limit is None or self.cgroup_limit >= self.host_total
                 else "this cgroup's")
        ranks = (f" / {self.local_world} local ranks (LOCAL_WORLD_SIZE)"
                 if self.local_world > 1 else "")
        return (f"this rank's share is {format_size(self.share)} ({format_size(self.total)} of "
                f"{where} memory{ranks}), {format_size(self.room)} is available now")


def local_world_size(environ: Optional[Mapping[str, str]] = None) -> int:
    """Processes of this job on this node: torchrun's LOCAL_WORLD_SIZE (Open MPI's
    OMPI_COMM_WORLD_LOCAL_SIZE), else 1."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        v = env.get(name, "").strip()
        if v.isdigit() and int(v) > 0:
            return int(v)
    return 1


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            v = f.read().strip()
    except OSError:
        return None
    if v == "max":
        return _UNLIMITED
    try:
        return int(v)
    except ValueError:
        return None


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup",
                  root: str = "/sys/fs/cgroup") -> Tuple[Optional[int], int]:
    """(limit, usage) of this process's memory cgroup: the lowest limit on the path from its
    cgroup up to the root (v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/
    ``memory.usage_in_bytes``), None when nothing limits it."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, 0
    candidates = []  # (directory of the cgroup, limit file, usage file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            candidates.append((root, path, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            candidates.append((os.path.join(root, "memory"), path, "memory.limit_in_bytes",
                               "memory.usage_in_bytes"))
    best: Tuple[Optional[int], int] = (None, 0)
    for base, path, limit_name, usage_name in candidates:
        rel = path.strip("/")
        levels = [rel]
        while rel:
            rel = os.path.dirname(rel)
            levels.append(rel)
        for level in levels:  # a container sees its own cgroup as the root: try every level
            d = os.path.join(base, level) if level else base
            limit = _read_int(os.path.join(d, limit_name))
            if limit is None or limit >= _UNLIMITED:
                continue
            usage = _read_int(os.path.join(d, usage_name)) or 0
            if best[0] is None or limit - usage < best[0] - best[1]:
                best = (limit, usage)
    return best


# Note [an explicit size is taken]
#     MemAvailable is what the kernel could hand out now. On a microVM whose memory is ballooned
#     or grows as it is touched (the GPU hosts spillover runs on), it starts far below the
#     machine's memory, and refusing a pool the user sized above it refused a pool the machine
#     could hold (the GPU bench's ~10 GiB pool). A size the user gave is refused only past this
#     rank's share of the node (host total or cgroup limit, over local ranks); above what is
#     available now it warns. The default pool, which nobody asked for, still stays under half
#     of what is available, re-read at every growth (_growth.py).


def node_memory() -> NodeMemory:
    vm = psutil.virtual_memory()
    limit, usage = cgroup_memory()
    with _lock:
        in_pools = sum(p.capacity for p in _pools.values())
    in_pools += sum(p.capacity for p in _leased_pools())
    return NodeMemory(vm.total, vm.available, limit, usage, local_world_size(), in_pools)


def default_pool_bytes(mem: Optional[NodeMemory] = None) -> int:
    """Note [node budget]: a quarter of this rank's share of the node (at most 8 GiB), and no
    more than half of what is available now."""
    mem = mem or node_memory()
    size = min(mem.share // 4, DEFAULT_POOL_CAP, mem.room // 2)
    return max(MIN_POOL, size // (1 << 20) * (1 << 20))


_VARIABLES = {"activations": ("SPILLOVER_HOST_POOL_BYTES", "host_pool_bytes"),
              "optim": ("SPILLOVER_OPTIM_POOL_BYTES", "optim_pool_bytes")}


def check_pool_size(capacity: int, purpose: str, mem: NodeMemory,
                    explicit: bool = False) -> None:
    """Note [node budget]: refuse a pool this rank cannot hold, warn when it leaves too little.
    A size the user gave (``explicit``) is refused only past this rank's share of the node:
    past what is available now it is a warning, since a VM's available memory starts low and
    grows as it is used (Note [an explicit size is taken])."""
    env, kw = _VARIABLES[purpose]
    what = "activation" if purpose == "activations" else "optimizer"
    held = (f"; this process already holds {format_size(mem.in_pools)} in spillover's other "
            "pools" if mem.in_pools else "")
    fits = mem.share - mem.in_pools if explicit else min(mem.share - mem.in_pools, mem.room)
    if explicit and fits >= capacity > mem.room:
        warn_once(
            "pool-above-available",
            f"spillover: the {format_size(capacity)} {what} pool you asked for ({env}, {kw}=) is "
            f"more than the memory available now ({mem.describe()}); taking it, as a VM's "
            "available memory grows as it is used. If the process is killed for memory, lower "
            "it.")
    if capacity > fits:
        advice = (f"set {env} ({kw}=) to at most {format_size(max(0, fits))}"
                  if fits >= MIN_POOL else "free memory, or run fewer ranks on this node")
        raise ConfigError(
            f"spillover: a {format_size(capacity)} {what} pool does not fit: "
            f"{mem.describe()}{held}. Pre-faulting it would run into the kernel's OOM "
            f"killer (which may end another process); {advice}"
            f" (unset, it defaults to {format_size(default_pool_bytes(mem))})."
        )
    left = mem.room - capacity
    if left < max(LOW_ROOM_MIN, mem.share // LOW_ROOM_SHARE):
        warn_once(
            "pool-low-room",
            f"spillover: the {format_size(capacity)} {what} pool leaves {format_size(left)} "
            f"of memory for everything else in this process ({mem.describe()}); if the "
            f"process is killed for memory, lower {env} ({kw}=).",
        )


def sized_for(need: int) -> int:
    """A pool for `need` bytes of leases: with 1/16 and 4 MiB to spare for the pool's 4 KiB
    granules, rounded up to a power of two (so optimizers of similar sizes share one), at least
    64 MiB."""
    want = need + need // 16 + (4 << 20)
    return max(MIN_POOL, 1 << (want - 1).bit_length())


def default_size(purpose: str) -> int:
    """The default of Note [node budget] for ``purpose``'s pool: computed once per process (what
    is available moves, the default does not), then reused."""
    with _lock:
        default = _defaults.get(purpose)
    if default is None:
        mem = node_memory()
        with _lock:
            default = _defaults.setdefault(purpose, default_pool_bytes(mem))
    return default


#: Largest arena of the pools made here (None: the crate's 1 GiB). Tests make it small to reach
#: storages larger than one arena at small sizes (Note [gathered storages] in rust/tier/gather.rs).
ARENA_BYTES: Optional[int] = None


def host_pool(cfg: Config, purpose: str = "activations",
              need: Optional[int] = None) -> _native.Pool:
    """The process's pool for ``purpose`` (made on first use): ``"activations"`` (every
    ``offload_context``; ``cfg.host_pool_bytes``) or ``"optim"`` (every ``OffloadAdamW``;
    ``cfg.optim_pool_bytes``). The two never share a pool, so one cannot starve the other.
    Without a size from the user: the default of Note [node budget] (computed once per
    purpose, then reused), or less when the caller knows it `need`s less (``sized_for``)."""
    size = cfg.optim_pool_bytes if purpose == "optim" else cfg.host_pool_bytes
    explicit = size is not None
    if size is None:
        default = default_size(purpose)
        size = default if need is None else min(default, sized_for(need))
    with _lock:
        known = (purpose, size) in _pools
    if not known:
        mem = node_memory()
        check_pool_size(size, purpose, mem, explicit=explicit)
        log.info("%s pool of %s: %s", purpose, format_size(size), mem.describe())
    capacity = size
    with _lock:
        pool = _pools.get((purpose, capacity))
        if pool is None:
            log.info("mapping a %s host pool for %s", format_size(capacity), purpose)
            pool = _native.Pool(capacity, arena_bytes=ARENA_BYTES)
            _pools[(purpose, capacity)] = pool
            lock_warning = pool.lock_warning
        else:
            lock_warning = None
    if lock_warning:
        warn_once("pool-lock", lock_warning)
    return pool


def pool_ranges() -> List[Tuple[int, int]]:
    """Address ranges of every pool arena (to recognise tensors that already live in one)."""
    with _lock:
        pools = list(_pools.values())
    pools += _leased_pools()
    return [(a, a + n) for p in pools for (a, n) in p.arenas()]


# ---- leased pools: the growing default activation pools (Note [growing pool] in _growth.py) --

_lease_lock = threading.Lock()  # never held across a call that can block on another lock
_leased: Dict[int, List[Any]] = {}  # capacity -> [pool, leases held]
_returned: List[Any] = []  # leases given back and not counted out yet (list.append is atomic)
_draining: List[Any] = []  # no lease left, registered with CUDA, blocks still out


def _leased_pools() -> List[Any]:
    """Every leased pool still mapped by this process's cache (leased, or draining)."""
    return [e[0] for e in list(_leased.values())] + list(_draining)


def lease_pool(capacity: int) -> _native.Pool:
    """A lease of the process's growing default activation pool of ``capacity``: shared by every
    context that leases this capacity, mapped at the first lease (refused or warned about by
    Note [node budget]), and dropped from this process when the last lease is given back
    (:func:`return_pool`), so that its memory goes back once its blocks do."""
    _settle(blocking=True)
    with _lease_lock:
        entry = _leased.get(capacity)
        if entry is not None:
            entry[1] += 1
            return entry[0]
    mem = node_memory()
    check_pool_size(capacity, "activations", mem)
    log.info("mapping a %s activation pool (growing default): %s", format_size(capacity),
             mem.describe())
    pool = _native.Pool(capacity, arena_bytes=ARENA_BYTES)  # outside the lock: mapping is slow
    with _lease_lock:
        entry = _leased.setdefault(capacity, [pool, 0])
        entry[1] += 1
    if entry[0] is pool and pool.lock_warning:
        warn_once("pool-lock", pool.lock_warning)
    return entry[0]


def return_pool(pool: Any) -> None:
    """Give back one lease of ``pool`` (a context collected, or grown past it). Safe in a
    finalizer, which gc may run on any thread at any allocation: it never blocks, and what it
    cannot settle at once (another thread holds the lock) is settled at the next lease."""
    _returned.append(pool)
    _settle(blocking=False)


def settle() -> None:
    """Settle what returns could not settle at once (a contended lock; a CUDA-registered pool
    whose blocks were still out), without waiting; contexts call it as each step begins."""
    _settle(blocking=False)


def _settle(blocking: bool) -> None:
    """Count out the leases given back: a pool with none left leaves the cache (and the tiers
    cached over it go, Note [growing pool]); one registered with CUDA is unregistered first,
    once no block of it is leased (the device may still be copying into a leased block)."""
    if not _lease_lock.acquire(blocking=blocking):
        return
    gone = []
    try:
        while _returned:
            pool = _returned.pop()
            for capacity, entry in list(_leased.items()):
                if entry[0] is pool:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del _leased[capacity]
                        gone.append(pool)
                    break
        _draining.extend(gone)
        _draining[:] = [p for p in _draining if not _unregister_if_idle(p)]
    finally:
        _lease_lock.release()
    if gone:
        from . import _tiers  # imports this module

        for pool in gone:
            _tiers.forget_pool(pool)
            log.info("released a %s activation pool", format_size(pool.capacity))


def register_with_cuda(pool: _native.Pool) -> bool:
    """Page-lock the pool's arenas for CUDA (``cudaHostRegister``, portable to every device)
    once, so copies from and to them are truly asynchronous. True once every arena is
    registered.

    On a refusal it unregisters the arenas it did register, clears CUDA's last error (otherwise
    the next kernel launch would raise it), warns once and returns False: copies from the pool
    are then synchronous. A refused pool is not tried again. A pool counts as registered only
    once every arena is; registration runs under ``_lock``, so two threads cannot register one
    arena twice."""
    import ctypes

    import torch

    if not torch.cuda.is_available():
        return False
    arenas = list(pool.arenas())
    key = (id(pool), tuple(arenas))  # the arenas too: an id can be reused once a pool is gone
    refused = ("refused", key)
    cudart = torch.cuda.cudart()  # initialises CUDA, outside the lock
    host_register_portable = 1  # cudaHostRegisterPortable: pinned for every device's context

    def code_of(err: object) -> int:
        return int(getattr(err, "value", err))

    def clear_last_error() -> bool:
        """cudaGetLastError in the runtime torch uses: torch's binding when it has one, else
        ctypes on the libcudart this process loaded (never a second copy of the runtime)."""
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

    failure = None
    with _lock:
        if key in _cuda_registered:
            return True
        if refused in _cuda_registered:
            return False
        done: List[int] = []
        with torch.cuda.device(torch.cuda.current_device()):
            for addr, length in arenas:
                code = code_of(cudart.cudaHostRegister(addr, length, host_register_portable))
                if code != 0:
                    for a in done:
                        cudart.cudaHostUnregister(a)
                    cleared = clear_last_error()
                    failure = (length, code, cleared)
                    _cuda_registered.add(refused)
                    break
                done.append(addr)
            else:
                _cuda_registered.add(key)
    if failure is None:
        return True
    length, code, cleared = failure
    warn_once(
        "cuda-register",
        f"spillover: cudaHostRegister of a {format_size(length)} host arena failed "
        f"(cudaError {code}); the pool is not registered and device copies from it will be "
        "synchronous. Check RLIMIT_MEMLOCK (`ulimit -l`) and lower SPILLOVER_HOST_POOL_BYTES."
        + ("" if cleared else " CUDA's last error could not be cleared (no cudaGetLastError "
           "found): the next CUDA call may report it."),
    )
    return False


def _unregister_if_idle(pool: Any) -> bool:
    """Unregister ``pool``'s arenas from CUDA (``cudaHostUnregister``) once none of its blocks
    is leased; True once it is not registered (also: never was). Pinned pages stay pinned until
    unregistered, whoever unmaps them, so a pool leaving the process must pass here first."""
    key = (id(pool), tuple(pool.arenas()))
    _cuda_registered.discard(("refused", key))  # a later pool may get this id and these arenas
    if key not in _cuda_registered:  # set operations are atomic: no lock (see return_pool)
        return True
    if pool.stats()["in_use"]:
        return False
    import torch

    cudart = torch.cuda.cudart()
    for addr, _length in key[1]:
        cudart.cudaHostUnregister(addr)
    _cuda_registered.discard(key)
    return True


def _after_fork_in_child() -> None:
    """Note [fork] (rust/io/mod.rs): a forked child starts with no pools or tiers of its own;
    what it inherited stays with the parent (the Rust engine refuses to be driven from the
    child and is leaked there, never joined)."""
    global _lock, _lease_lock
    _lock = threading.Lock()  # another thread may have held it at fork time
    _pools.clear()
    _defaults.clear()
    _cuda_registered.clear()
    _lease_lock = threading.Lock()
    _leased.clear()
    _returned.clear()
    _draining.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
