"""What every part of the process shares below the pools: logging, one-time warnings, and the
node's memory with the sizes pools may take (Note [node budget]). The pools themselves have
one owner, ``_pools.POOLS`` (Note [the pool lives for the process] in _pools.py).

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
from typing import Callable, Dict, Mapping, Optional, Tuple

import psutil

from .config import Config, format_size
from .errors import ConfigError

log = logging.getLogger("spillover")

_lock = threading.Lock()
_defaults: Dict[str, int] = {}  # purpose -> its default size, computed once
_warned: set = set()

#: Bytes this process holds in pools (set by _pools.POOLS, the pools' owner, which sits above
#: this module).
def _no_pools() -> int:
    return 0


held_in_pools: Callable[[], int] = _no_pools

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
    return NodeMemory(vm.total, vm.available, limit, usage, local_world_size(), held_in_pools())


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


def _after_fork_in_child() -> None:
    """Note [fork] (rust/io/mod.rs): a forked child computes its defaults again."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at fork time
    _defaults.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
