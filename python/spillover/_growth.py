"""The host pools and activation tiers of one ``offload_context``: a pool of the user's size, or
a default pool that grows to what the steps use (Note [growing pool]).

Note [growing pool]
    A pool is pre-faulted (and pinned for CUDA), so its capacity is RAM taken at once. The old
    default -- a quarter of this rank's share of the node, Note [node budget] in _runtime.py --
    took 5.9 GiB at the first step of a model whose step used 24 MiB, and kept it. So without a
    size from the user (``host_pool_bytes=`` / SPILLOVER_HOST_POOL_BYTES unset) a context
    starts on a FIRST_POOL pool and grows, never past that default (the cap) nor past what the
    node has room for now:
    - *mid-step*, when a lease finds no room even after the copies in flight landed (on the
      host tier the tensor would otherwise stay on the device; on the NVMe tier nothing in the
      pool can be written out -- a CPU storage is written from its own memory then, Note
      [written from the tensor] in rust/tier/direct.rs, and the pool does not grow for it): a
      pool of at least twice the capacity, and ``sized_for`` what the context's live entries
      hold plus the tensor. The step goes on in a new tier step over
      the new pool (its record keeps every tier step, for its counters); entries already made
      stay where they are. A storage going in pieces never grows midway: its pieces must share
      one tier step (Note [gathered storages] in rust/tier/gather.rs).
    - *between steps*, at entry, to ``sized_for`` the most the context's live entries held at
      the end of a forward (with gradient accumulation, several steps' entries at once) when
      that is more than the pool: the next step fits, and with doubling alone a step would
      have ended on a pool of a fraction of it.
    A pool a context grew past (a *generation*) is kept while any entry lives in its tier or any
    block of it is leased, and given back at the next entry after that. Pools are leased from
    the process's owner (``_pools.POOLS``): shared by every context on the same capacity, and
    when the last lease is returned -- at a growth, or when gc collects the context (a
    finalizer: the context holds no pool itself once it is gone) -- the largest is kept idle
    for the next context, which starts on it (Note [the pool lives for the process] in
    _pools.py); a smaller one leaves the process, and with it the tiers cached over it and its
    swap engine (one per leased pool, ``_tiers.swap_for(own=True)``: an engine holds the pool
    it registered). A pool registered with CUDA is unregistered before it goes, once none of
    its blocks is leased. A size given by the user is a size taken: that pool is the process's
    cached one of that capacity, for ever, as before. The planner plans against
    ``ctx.pool_limit`` (the cap; the size given), as it planned against the old default: what
    is mapped now is not what the pool can hold by the time it matters. (On a CPU host whose
    context keeps in place what it would take, the pool does not grow, and the planner charges
    the pool mapped: Note [a CPU host ships nothing] in planner/records.py.) Measured (2-layer MLP,
    12 MiB offloaded, 24 GiB host): RSS +6066 MiB after the first step of the old default,
    kept; about +104 MiB with the growing pool (given back by ``spillover.empty_cache()``).

Note [RAM before the drive]
    ``tier="auto"`` opens the NVMe tier, whose write-behind (Note [write early, drop late] in
    rust/tier/policy.rs) writes every byte past a quarter of the pool: so a step that a pool of
    RAM held whole still wrote most of itself to the drive (the H200 estimate of the 1B Llama,
    default pool: 1.1 GiB a step through a 64 MiB pool, on a host with 256 GiB of RAM). So while
    a growing pool of tier auto is below its cap (the default of Note [node budget], or the
    node's room now), its tier writes nothing behind: unwritten bytes may fill the pool
    (``dirty_bytes`` = its capacity), and a put that finds the pool full does not write the
    oldest out either: it fails, and the pool grows (Note [writes wait for growth] in
    rust/tier/room.rs); only when it cannot grow (its cap, no room on the node, a storage in
    pieces, which one tier step must hold) does the tier write. Before, the first steps of a
    process, on pools smaller than the step, wrote what passed their pool (GPT 2x256, seq 512:
    the first step on a 16 MiB first pool wrote to the drive; now nothing from the first step
    on). A pool at its cap writes behind as
    the NVMe tier does. ``tier="nvme"`` and a pool of the user's size keep the default: the
    drive was asked for. ``spillover.estimate`` models the same (Note [simulated offload] in
    estimate/offload.py).

Note [growth off the critical path]
    Mapping, pre-faulting and registering a pool with CUDA takes seconds for GiBs, and growing
    inside a pack put that in the middle of a forward, at whatever step first needed the room
    (variable sequence lengths: any step). So once the current pool is three quarters full
    (seen at the end of a forward, and after every eighth of the pool offloaded), the next
    generation -- twice the pool, or what the context's live entries need, capped as above --
    is mapped, pre-faulted and registered on a background thread, and becomes current at the
    next growth (mid-step, or at the next entry); a growth that comes before it is done waits
    for it (it is further along than a mapping started then), and one it could not make (no
    room, an error) goes the old way.
    Under CUDA graph capture nothing is prepared or made current.
    A size asked for while a smaller one is being made (the forward's end asks for what its
    live entries need; a prepare at three quarters full, earlier in the forward, asked for
    twice the pool) is made next, by the same thread: the smaller one goes back. Before, the
    forward's request was dropped, and the Quick start's second step ran on a pool made for
    the first one's middle (GPT 4x256, seq 512: 256 MiB for a 260 MiB step, 136 MiB written
    to the drive; now the second step runs on 512 MiB and writes nothing).
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional, Tuple

import torch

from . import _pools, _runtime, _tiers
from .config import Config, format_size
from .errors import ConfigError, SpilloverError

#: Note [growing pool]: the first default pool (never above the cap).
FIRST_POOL = _runtime.MIN_POOL


class Generation:
    """One pool of a context and the activation tier over it; ``leased``: a growing default
    pool, given back with :meth:`Pools.close` or when retired."""

    __slots__ = ("pool", "tier", "leased")

    def __init__(self, pool: Any, tier: Any, leased: bool):
        self.pool, self.tier, self.leased = pool, tier, leased

    def idle(self) -> bool:
        """No entry of any step lives in its tier and no block of its pool is leased."""
        return not self.tier.stats()["entries"] and not self.pool.stats()["in_use"]


class Pools:
    """The pools and tiers one context uses, the current one last (Note [growing pool]).
    Holds nothing of the context, so that ``close`` can run as its finalizer."""

    def __init__(self, config: Config, tier: str):
        self.config = config
        self.tier_name = tier  # "host", "nvme", "auto"; "auto" resolves at the first open
        self.growable = config.host_pool_bytes is None
        self.gens: List[Generation] = []
        self.need = 0  # the most live entries held at the end of a forward since the last growth
        self.closed = False
        # Note [growth off the critical path]: the next generation, being made (a thread) or
        # made (a pool, or the error that stopped it)
        self._next_thread: Optional[threading.Thread] = None
        self._next: Any = None
        self._next_lock = threading.Lock()
        self._want = 0  # a larger size asked for while the thread makes one
        self.prepared = 0  # generations made ahead, for the stats and the tests

    @property
    def pool(self) -> Any:
        return self.gens[-1].pool if self.gens else None

    @property
    def tier(self) -> Any:
        return self.gens[-1].tier if self.gens else None

    def open(self) -> None:
        """The first generation: the user's pool, or a FIRST_POOL lease."""
        if self.growable:
            self._add(_pools.POOLS.lease_first(FIRST_POOL), leased=True)
        else:
            self._add(_pools.host_pool(self.config), leased=False)

    def _add(self, pool: Any, leased: bool, registered: bool = False) -> None:
        try:
            if not registered:
                self._register(pool)
            tier = self._open_tier(pool, leased)
        except BaseException:
            if leased:
                _pools.return_pool(pool)
            raise
        self.gens.append(Generation(pool, tier, leased))

    def _register(self, pool: Any) -> None:
        """With CUDA (and with the simulated device of a context that has one: Note [simulated
        registration] in _pools.py), once per pool for the process."""
        if torch.cuda.is_available():
            _pools.POOLS.register(pool)
        if self.config.sim_link_bandwidth is not None:
            _pools.POOLS.register(pool, sim=True)

    def _open_tier(self, pool: Any, leased: bool) -> Any:
        if self.tier_name == "host":
            return _tiers.tier_for(self.config, pool, nvme=False)
        try:
            dirty = self._dirty_bytes(pool, leased)
            tier = _tiers.tier_for(self.config, pool, nvme=True, own_swap=leased,
                                   dirty_bytes=dirty)
            if dirty is not None and tier.has_swap:
                tier.defer_writes(True)  # Note [writes wait for growth] in rust/tier/room.rs
            return tier
        except Exception as e:
            if self.tier_name == "nvme":
                raise
            _runtime.warn_once(
                "auto-no-nvme",
                f"spillover: tier='auto' runs host-only: the NVMe tier could not open ({e})",
            )
            self.tier_name = "host"
            return _tiers.tier_for(self.config, pool, nvme=False)

    def _dirty_bytes(self, pool: Any, leased: bool) -> Optional[int]:
        """Note [RAM before the drive]: ``tier="auto"`` over a growing pool that can still
        grow writes nothing behind (unwritten bytes up to the whole pool); else the tier's
        default."""
        if self.tier_name != "auto" or not leased:
            return None
        cap = min(self.limit(), pool.capacity + self._room())
        return pool.capacity if pool.capacity < cap else None

    # -- growth --

    def held(self) -> int:
        """Bytes of the entries alive in this context's tiers (in the pool or on disk)."""
        total = 0
        for g in self.gens:
            st = g.tier.stats()
            total += st["bytes_in_pool"] + st["bytes_on_disk_only"]
        return total

    def note_forward_end(self, prepare: bool = True, offloaded: int = 0) -> None:
        """A forward ended; ``offloaded``: the bytes its step offloaded, all alive still (the
        tiers' counts miss the entries being written to the drive)."""
        if self.growable and self.gens:
            held = max(self.held(), offloaded)
            self.need = max(self.need, held)
            if prepare and self.need > self.pool.capacity:
                # a growth at the next entry, to what the forwards held: made from now on
                self.maybe_prepare(held, size=_runtime.sized_for(self.need))
            elif prepare:
                self.maybe_prepare(held)

    def maybe_prepare(self, held: Optional[int] = None, size: Optional[int] = None) -> None:
        """Note [growth off the critical path]: past three quarters of the pool, start making
        the next generation (``size``, else what a growth mid-step would take) on a background
        thread, once at a time."""
        if not self.growable or not self.gens or self.closed:
            return
        if self._next_thread is not None:
            if size:  # made after the one being made (Note [growth off the critical path])
                with self._next_lock:
                    self._want = max(self._want, min(size, self._room()))
            return
        cap = self.pool.capacity
        with self._next_lock:
            nxt = self._next
            if nxt is not None and not isinstance(nxt, BaseException) and (
                    size is None or nxt.capacity == min(size, self._room())):
                return  # made already, waiting for its growth
            self._next = None
        if nxt is not None and not isinstance(nxt, BaseException):
            _pools.return_pool(nxt)  # not the size the next growth wants
        held = self.held() if held is None else held
        if held * 4 < cap * 3:
            return
        size = min(size or max(2 * cap, _runtime.sized_for(held)), self._room())
        if size <= cap:
            return
        t = threading.Thread(target=self._make_next, args=(size,), daemon=True,
                             name="spillover-pool-growth")
        self._next_thread = t
        t.start()

    def _make_next(self, size: int) -> None:
        made: Any
        while True:
            try:
                made = _pools.lease_pool(size)
                self._register(made)
            except BaseException as e:  # noqa: BLE001 -- kept, and the growth goes the old way
                made = e
            with self._next_lock:
                want, self._want = self._want, 0
                ok = not isinstance(made, BaseException)
                if ok and not self.closed and want > made.capacity:
                    _pools.return_pool(made)  # a larger one was asked for meanwhile
                    size = want
                    continue
                if self.closed and ok:
                    _pools.return_pool(made)  # the context went meanwhile
                else:
                    self._next = made
                self._next_thread = None
                return

    def _take_next(self, need: int) -> bool:
        """The generation made ahead becomes current when it holds ``need`` (one being made is
        waited for: it is further along than a growth started now would be)."""
        t = self._next_thread
        if t is not None and t is not threading.current_thread():
            t.join()
        with self._next_lock:
            nxt = self._next
            if nxt is None:
                return False
            self._next = None
        if isinstance(nxt, BaseException):
            _runtime.log.info("activation pool not grown ahead: %s", nxt)
            return False
        if nxt.capacity < need or nxt.capacity <= self.pool.capacity:
            _pools.return_pool(nxt)
            return False
        self._add(nxt, leased=True, registered=True)
        self.prepared += 1
        _runtime.log.info("activation pool grown to %s (made ahead)", format_size(nxt.capacity))
        return True

    def grow_mid_step(self, nbytes: int) -> bool:
        """A lease of ``nbytes`` found no room: a larger pool becomes current (the one made
        ahead when it is ready). False when the pool cannot grow (an explicit size, at the cap,
        no room on the node)."""
        cur = self.pool.capacity
        need = self.held() + nbytes
        if self._take_next(need):
            return True
        return self._grow(max(2 * cur, _runtime.sized_for(need)))

    def grow_between_steps(self) -> bool:
        """At entry: a pool for what the last forwards held, when that is more than the pool
        (the one made ahead when it is ready and large enough)."""
        need, self.need = self.need, 0
        if need and need > self.pool.capacity and self._take_next(need):
            return True
        return bool(need) and self._grow(_runtime.sized_for(need))

    def _grow(self, want: int) -> bool:
        if not self.growable or not self.gens:
            return False
        size = min(want, self._room())
        if size <= self.pool.capacity:
            return False
        try:
            pool = _pools.lease_pool(size)
        except (ConfigError, SpilloverError) as e:  # the node's room moved, or mapping failed
            _runtime.log.info("activation pool not grown to %s: %s", format_size(size), e)
            return False  # what finds no room stays put: the pool-full guardrail says so
        self._add(pool, leased=True)
        _runtime.log.info("activation pool grown to %s", format_size(size))
        return True

    def _room(self) -> int:
        """The largest capacity a growth may take: the default of Note [node budget], and what
        fits now beside this process's other pools (whole MiB)."""
        mem = _runtime.node_memory()  # read again at every growth (Note [an explicit size is
        # taken] in _runtime.py): a VM's available memory grows as it is used
        room = min(_runtime.default_pool_bytes(mem), mem.share - mem.in_pools, mem.room // 2)
        return room // (1 << 20) * (1 << 20)

    # -- retiring --

    def retire(self, busy: List[Any]) -> None:
        """Give back the leases of older generations that nothing uses any more: no entry, no
        block, and not the tier of a step still active (``busy``: on another thread, which
        has not needed room since the growth); and settle what earlier returns left."""
        keep = []
        for g in self.gens[:-1]:
            if g.leased and g.idle() and not any(t is g.tier for t in busy):
                _pools.return_pool(g.pool)
            else:
                keep.append(g)
        self.gens[:-1] = keep
        _pools.settle()

    def close(self) -> None:
        """Every lease given back (the context is gone: no step of it can use them), the one
        made ahead too (or by its thread, once done). Never blocks: a finalizer runs it."""
        if self.closed:
            return
        self.closed = True
        gens, self.gens = self.gens, []
        for g in gens:
            if g.leased:
                _pools.return_pool(g.pool)
        with self._next_lock:  # a thread still making one gives it back itself
            nxt, self._next = self._next, None
        if nxt is not None and not isinstance(nxt, BaseException):
            _pools.return_pool(nxt)

    def limit(self) -> int:
        """The user's size, or the most a growing pool may reach (the default's cap)."""
        if not self.growable:
            return int(self.config.host_pool_bytes or 0)
        return _runtime.default_size("activations")

    def tiers(self) -> List[Any]:
        return [g.tier for g in self.gens]

    def chunk_sizes(self) -> Tuple[int, int]:
        """Note [gathered storages]: the piece sizes of the current pool: on the NVMe tier from
        its capacity; on the host tier, storages larger than its largest arena (a block lives in
        one arena: whole, such a storage could never be leased, however large the pool) go in
        pieces of a quarter arena; (0, 0) -- never in pieces -- when the pool is one arena."""
        tier = self.tier
        if tier is None:
            return 0, 0
        if tier.has_swap:
            return _tiers.chunk_sizes(self.pool.capacity)
        arenas = [n for _, n in self.pool.arenas()]
        if len(arenas) < 2:
            return 0, 0
        arena = max(arenas)
        return arena, max(4096, (arena // 4) // 4096 * 4096)
