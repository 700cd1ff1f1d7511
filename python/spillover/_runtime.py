"""Process-wide resources shared by every context: host pools, logging, one-time warnings.

A pool is expensive to make (it maps and pre-faults its arenas) and cheap to share (leases are
thread-safe), so each distinct capacity is made once per process and reused by every
``offload_context`` and optimizer that asks for it.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Dict, List, Tuple

import psutil

from . import _native
from .config import Config, format_size

log = logging.getLogger("spillover")

_lock = threading.Lock()
_pools: Dict[Tuple[str, int], _native.Pool] = {}
_warned: set = set()
_cuda_registered: set = set()

#: Default pool: a quarter of RAM, at most this much.
DEFAULT_POOL_CAP = 8 << 30
MIN_POOL = 64 << 20


def configure_logging(cfg: Config) -> None:
    log.setLevel(cfg.log)


def warn_once(key: str, message: str, category: type = RuntimeWarning) -> None:
    """Issue ``message`` as a warning the first time ``key`` is seen in this process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, category, stacklevel=3)
    log.warning(message)


def default_pool_bytes() -> int:
    total = psutil.virtual_memory().total
    return max(MIN_POOL, min(total // 4, DEFAULT_POOL_CAP))


def host_pool(cfg: Config, purpose: str = "activations") -> _native.Pool:
    """The process's pool for ``purpose`` (made on first use): ``"activations"`` (every
    ``offload_context``; ``cfg.host_pool_bytes``) or ``"optim"`` (every ``OffloadAdamW``;
    ``cfg.optim_pool_bytes``). The two never share a pool, so one cannot starve the other."""
    size = cfg.optim_pool_bytes if purpose == "optim" else cfg.host_pool_bytes
    capacity = size or default_pool_bytes()
    with _lock:
        pool = _pools.get((purpose, capacity))
        if pool is None:
            log.info("mapping a %s host pool for %s", format_size(capacity), purpose)
            pool = _native.Pool(capacity)
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
    return [(a, a + n) for p in pools for (a, n) in p.arenas()]


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


def _after_fork_in_child() -> None:
    """Note [fork] (rust/io/mod.rs): a forked child starts with no pools or tiers of its own;
    what it inherited stays with the parent (the Rust engine refuses to be driven from the
    child and is leaked there, never joined)."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at fork time
    _pools.clear()
    _cuda_registered.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
