"""Process-wide swap engines and activation tiers (the Rust ``Swap`` and ``Tier``).

One swap engine (its threads and its private files) per process and swap configuration,
shared by every activation tier and every ``OffloadAdamW`` that asks for it; one activation
tier per pool and configuration, shared by every ``offload_context`` so that what one step
learned about backward's order serves the next (Note [expected order] in rust/tier/policy.rs).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from typing import Any, Dict, List, Optional, Tuple

from . import _native, _pools, _runtime
from .config import Config
from .errors import ConfigError

_lock = threading.Lock()
_swaps: Dict[Tuple, Any] = {}
_tiers: Dict[Tuple, Any] = {}
_tmpdirs: List[str] = []


def _default_dir() -> str:
    d = tempfile.mkdtemp(prefix="spillover-swap-")
    os.chmod(d, 0o700)
    _tmpdirs.append(d)
    return d


@atexit.register
def _cleanup() -> None:
    for d in _tmpdirs:
        shutil.rmtree(d, ignore_errors=True)


def check_dirs(dirs: Tuple[str, ...], cfg: Optional[Config] = None) -> None:
    """Refuse a swap directory that cannot work, naming how it was given (``nvme_path=`` or
    SPILLOVER_NVME_PATH). Called when a context or an optimizer is made, before any step."""
    given = "SPILLOVER_NVME_PATH=" if cfg is not None and cfg.sources.get("nvme_path") == "env" \
        else "nvme_path="
    fix = "pass nvme_path=DIR (or set SPILLOVER_NVME_PATH=DIR)"
    for d in dirs:
        where = f"{given}{d!r}"
        if not os.path.exists(d):
            raise ConfigError(f"{where} does not exist: create it, or {fix} with a directory "
                              "on a local NVMe drive")
        if not os.path.isdir(d):
            raise ConfigError(f"{where} is not a directory: {fix}")
        real = os.path.realpath(d)
        if real.split(os.sep)[1:2] in (["proc"], ["sys"], ["dev"]) and not real.startswith(
            "/dev/shm"
        ):
            raise ConfigError(
                f"{where} is under /{real.split(os.sep)[1]}, a kernel file system: {fix} "
                "with a directory on a local drive"
            )
        st = os.stat(real)
        if st.st_mode & 0o002 and not st.st_mode & 0o1000:
            raise ConfigError(
                f"{where} is world-writable without the sticky bit, so other users could "
                "replace what is in it: use a private directory (chmod 700) or one with the "
                "sticky bit (chmod +t)"
            )
        if not os.access(d, os.W_OK | os.X_OK):
            raise ConfigError(
                f"{where} is not writable by this user: fix its permissions, or {fix}"
            )


def _swap_key(cfg: Config) -> Tuple:
    return (cfg.nvme_path, cfg.io_engine, cfg.io_queue_depth, cfg.io_block_bytes,
            cfg.allow_buffered_io)


def swap_for(cfg: Config, pool: Any, own: bool = False) -> Any:
    """The process's swap engine for ``cfg``'s directories and I/O shape (opened on first use,
    with ``pool``'s arenas registered for io_uring; blocks of other pools use plain I/O).
    ``own``: one for ``pool`` alone, which goes with it (:func:`forget_pool`): an engine holds
    the pool it registered, so a shared one would keep a leased pool mapped for ever."""
    key = ((("pool", id(pool)),) if own else ()) + _swap_key(cfg)
    with _lock:
        s = _swaps.get(key)
        if s is None:
            dirs = cfg.nvme_path or (_default_dir(),)
            check_dirs(dirs, cfg)
            _runtime.log.info("opening swap files in %s", ", ".join(dirs))
            s = _native.Swap(
                pool,
                list(dirs),
                engine=cfg.io_engine,
                queue_depth=cfg.io_queue_depth,
                block_bytes=cfg.io_block_bytes,
                allow_buffered=cfg.allow_buffered_io,
            )
            _swaps[key] = s
    if s.warning:
        _runtime.warn_once("swap:" + s.warning, s.warning)
    return s


def tier_for(cfg: Config, pool: Any, nvme: bool, own_swap: bool = False,
             dirty_bytes: Optional[int] = None) -> Any:
    """The process's activation tier over ``pool``: spilling to the swap engine when ``nvme``
    (``own_swap``: see :func:`swap_for`), host-only otherwise. ``dirty_bytes``: write behind
    past this many unwritten bytes (None: the tier's default, a quarter of the pool; Note [RAM
    before the drive] in _growth.py). Raises what opening the swap raises (ConfigError,
    SwapIOError)."""
    key = (id(pool), nvme, _swap_key(cfg) if nvme else None, cfg.prefetch_bytes, cfg.verify,
           cfg.write_hold_bytes, dirty_bytes if nvme else None)
    with _lock:
        t = _tiers.get(key)
    if t is not None:
        return t
    swap = swap_for(cfg, pool, own=own_swap) if nvme else None
    t = _native.Tier(pool, swap, dirty_bytes=dirty_bytes if nvme else None,
                     prefetch_bytes=cfg.prefetch_bytes, verify=cfg.verify,
                     write_hold_bytes=cfg.write_hold_bytes)
    with _lock:
        return _tiers.setdefault(key, t)


def forget_pool(pool: Any) -> None:
    """Drop the tiers over ``pool`` and a swap engine of its own (a leased pool leaving the
    process, Note [growing pool] in _growth.py): each holds the pool, and an id can be reused
    by a later pool. Plain dict operations, atomic under the GIL, and no lock: this runs when
    gc collects a context, possibly while this thread holds ``_lock``."""
    for cache, first in ((_tiers, id(pool)), (_swaps, ("pool", id(pool)))):
        for key in [k for k in list(cache) if k[0] == first]:
            cache.pop(key, None)


_pools.POOLS.on_pool_gone(forget_pool)


def chunk_sizes(capacity: int) -> Tuple[int, int]:
    """Note [gathered storages] (rust/tier/gather.rs): storages larger than the first number
    go in pieces of the second (half and an eighth of the pool)."""
    return capacity // 2, max(4096, (capacity // 8) // 4096 * 4096)


def opened_swap(cfg: Config) -> Optional[Any]:
    """The swap engine already open for ``cfg``, if any (for tests and diagnostics)."""
    with _lock:
        return _swaps.get(_swap_key(cfg))


def _after_fork_in_child() -> None:
    """Note [fork] (rust/io/mod.rs): a forked child opens its own swap files if it offloads."""
    global _lock
    _lock = threading.Lock()
    _swaps.clear()
    _tiers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
