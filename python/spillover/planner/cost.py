"""The cost model: what a decision frees and what it costs, from a machine's measured rates.

Note [host cost in the plan]
    On a GPU the host's time per saved tensor is as large as the device's compute per tensor
    (the review of 2026-12-03: ~80-250 us per pack and unpack in Python before the link moved
    to Rust, against 50-150 us of H200 compute), and charging bytes / link alone, the plan
    offloaded tensors whose host cost exceeded what offloading them saved. So the calibration
    measures the host seconds one offloaded tensor costs (pack + unpack through this device's
    link) and one op of a wrapped region costs when it is rerun (the replay's dispatch), and
    the model charges them: an offload pays its host cost, never hidden (the host is the
    critical path when it is the bottleneck); a recomputed op pays its dispatch beside its
    device time. A tensor whose host cost exceeds the time its offload saves is not offloaded.

Pure functions of the records and rates (no torch run): which recomputed ops the runtime skips,
which outputs selective saves (Note [selective pays]), and :class:`Costs`, the memory and time
one planning pass holds and spends under its decisions so far (the search in
:mod:`spillover.planner.search` makes them).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..config import format_size
from .machine import Machine
from .records import OpRecord, RegionRecord

#: (written entries keep their blocks, Note [write early, drop late] in rust/tier/policy.rs;
#: the rest is left to blocks still being copied or written).
HIGH_WATER = 0.75
#: Share of the NVMe tier's pool one region's offloaded outputs may take (they all come back
#: when the region is recomputed).
REGION_POOL_SHARE = 0.5
#: Share of free memory the planner may use when no budget is given.


def skipped_ops(candidates: Dict[int, Sequence[int]], saved: Iterable[int]) -> set:
    """Note [outputs only saved ops read] in recompute/modes.py: of ``candidates`` (op index ->
    indices of the ops that read its output; ops that may be skipped at all), those whose
    every reader is saved or itself skipped. The runtime applies it; the planner predicts it."""
    saved = set(saved)
    dead: set = set()
    for n in sorted(candidates, reverse=True):  # readers come after what they read
        readers = candidates[n]
        if readers and all(c in saved or c in dead for c in readers):
            dead.add(n)
    return dead


#: Why an op is not rerun under Note [outputs only saved ops read] (runtime and explain).
SKIPPED_REASON = "only saved outputs read it: never rerun"


def region_skipped(ops: Sequence[OpRecord], action: Callable[[OpRecord], str]) -> set:
    """The recomputed ops of one region that the runtime will not rerun under the decisions
    ``action(op)`` (Note [outputs only saved ops read] in recompute/modes.py)."""
    act = {o.index: action(o) for o in ops}
    return skipped_ops(
        {o.index: o.readers for o in ops if act[o.index] == "recompute"
         and not o.after_stop and o.forced is None and not o.needed},
        (i for i, a in act.items() if a in ("keep", "offload")),
    )


def worth_saving(rec: RegionRecord, machine: Machine) -> Dict[int, str]:
    """Note [selective pays]: the recomputed outputs of one region run (as recorded) that cost
    more time per byte to rebuild than full recompute of the region does; op index -> why.

    Full recompute frees every byte autograd saved in the region (``needed``) for the time of
    every op before the stop: its rate, bytes per second of recompute, is the bar. A needed
    output that the region recomputed costs its own op plus the recomputed ops only it needs
    (saving it lets the runtime skip them, Note [outputs only saved ops read]); when that unit
    frees fewer bytes per second than the bar, saving it is cheaper than full recompute's trade
    and it is saved. Every unit left recomputed then pays at least full's rate, so the region's
    memory saved per second added is at least full recompute's (a mediant of rates at least
    the bar). Chain ends first: a softmax output spares the scores matmul, scale and mask."""
    ops = [o for o in rec.ops if not o.after_stop]
    total = sum(machine.rerun_seconds(o) for o in ops if o.forced != "view")
    needed = sum(o.bytes for o in ops if o.needed)
    if total <= 0 or needed <= 0:
        return {}
    bar = needed / total
    action = {o.index: o.action for o in rec.ops}
    out: Dict[int, str] = {}
    for o in sorted(ops, key=lambda o: -o.index):
        if not o.needed or o.bytes == 0 or o.forced is not None or action[o.index] != "recompute":
            continue
        before = region_skipped(rec.ops, lambda x: action[x.index])
        action[o.index] = "keep"
        gained = region_skipped(rec.ops, lambda x: action[x.index]) - before
        if not rec.saves_seen:  # torch < 2.8: the runtime skips nothing (RegionRecord)
            gained = set()
        cost = machine.rerun_seconds(o) + sum(machine.rerun_seconds(x) for x in rec.ops
                                           if x.index in gained)
        rate = o.bytes / cost if cost > 0 else float("inf")
        if rate < bar:
            chain = f" and the {len(gained)} ops before it" if gained else ""
            out[o.index] = (f"rebuilding it{chain} frees {format_size(rate)}/s < full "
                            f"recompute's {format_size(bar)}/s: saved")
        else:
            action[o.index] = "recompute"
    return out



class Item:
    __slots__ = ("region", "op", "seconds", "rc")

    def __init__(self, region: int, op: OpRecord, seconds: float):
        self.region = region
        self.op = op
        self.seconds = seconds
        self.rc = seconds / op.bytes


def transient_bytes(rec: RegionRecord) -> int:
    """Note [recompute transients]: the largest output a region's recomputation creates that
    autograd does not keep.

    Recomputation runs the region's ops up to the last saved tensor; an output autograd does
    not save (e.g. the masked scores a softmax reads) lives until its readers ran, on top of
    what is rebuilt. The model of a rebuilt region counts the largest such output once: an
    upper bound for a chain (each dies as the next is made), what a measured step showed
    (a region rebuilt under the NVMe context peaked higher than the same region's tensors
    reloaded one by one by about one score tensor). Decision-independent, so the plans of one
    variant family move together and the measured offset keeps them exact."""
    return max((o.bytes for o in rec.ops if not o.needed and not o.after_stop
                and o.forced != "view"), default=0)


class Costs:
    """What one planning pass holds and costs under its decisions so far (the search,
    :mod:`spillover.planner.search`, makes them).

    Memory is counted as the device sees it. An active context takes the region inputs and
    the rest of the model's saved tensors off the device whatever the plan says: to host memory
    on a GPU (free here), into the pool on a CPU host, where the pool is this same memory — the
    host tier keeps all of it, the NVMe tier up to its capacity (the last packed bytes).
    """

    def __init__(self, regions: List[RegionRecord], machine: Machine, budget: int,
                 outside_bytes: int, ctx: Optional[Dict[str, Any]], device_is_host: bool,
                 use_offload: bool):
        self.regions = regions
        self.machine = machine
        self.budget = budget
        self.bwd = 0  # the largest region rebuilt in backward (peak budgets only)
        self.kind = ""
        self.device_is_host = device_is_host
        self.last = len(regions) - 1
        self.ops: Dict[Tuple[int, int], Tuple[str, str, str]] = {}
        self.modes = ["checkpoint"] * len(regions)
        self.nvme = bool(ctx and ctx["nvme"] and machine.nvme_bytes_per_s)
        self.pool = ctx["pool_bytes"] if ctx else 0
        # What stays in the pool after forward: the NVMe tier writes out past its high-water
        # mark, but blocks being written still count, so on a CPU host (where the pool is
        # device memory) the whole pool is charged.
        self.resident = self.pool if device_is_host or not self.nvme else int(
            self.pool * HIGH_WATER)
        self.outside_bytes = outside_bytes
        self.fixed_in = outside_bytes + sum(r.input_bytes for r in regions)
        # Offloading op outputs frees device memory on a GPU, and on a CPU host only through
        # the NVMe tier.
        self.use_offload = use_offload and ctx is not None and (not device_is_host or self.nvme)
        if ctx is None:
            self.charge = "device"  # inputs and the rest stay: counted in full
        elif not device_is_host:
            self.charge = "none"  # they leave the device
        else:
            self.charge = "resident" if self.nvme else "device"
        # The host tier alone holds what it is given until backward: the plan's offloads share
        # the pool with what the context takes by itself.
        self.host_room = self.pool - self.fixed_in if ctx is not None and not self.nvme else 0
        self.kept = 0
        #: the kept bytes of each region (Note [a kept backward frees as it goes] in search.py)
        self.region_kept = [0] * len(regions)
        #: ... and of those, what autograd saved (what rebuilding the region holds anyway)
        self.region_kept_needed = [0] * len(regions)
        self.items: List[Item] = []
        self.fwd = [0.0] * len(regions)
        for ri, r in enumerate(regions):
            # Note [two clocks in the plan]: a forward hides copies for as long as it runs
            self.fwd[ri] = machine.forward_seconds(r.ops)
            for o in r.ops:
                sec = machine.rerun_seconds(o)
                k = (ri, o.index)
                if o.after_stop:
                    self.ops[k] = ("recompute", "", "after the last saved tensor: never rerun")
                elif o.forced == "effect":
                    self.ops[k] = ("keep", "", "has an ordered side effect: saved")
                    self.kept += o.bytes
                    self.region_kept[ri] += o.bytes
                    self.region_kept_needed[ri] += o.bytes if o.needed else 0
                elif o.forced is not None or o.bytes == 0:
                    self.ops[k] = ("recompute", "", o.forced or "holds no memory")
                else:
                    self.items.append(Item(ri, o, sec))
                    self.kept += o.bytes
                    self.region_kept[ri] += o.bytes
                    self.region_kept_needed[ri] += o.bytes if o.needed else 0
        self.recompute = 0.0
        self.transfer = 0.0
        self.region_transfer = [0.0] * len(regions)
        self.region_off = [0] * len(regions)
        self.offloaded = 0
        self.tail_bytes = 0
        # what backward adds first: the plain tail's gradients (Note [plain backward]) or the
        # loss region's transient (Note [loss transient], loss/chunked.py), whichever is more
        self.tail_grad = 0
        self.link_used = 0.0
        # What the link can hide: the copy out overlaps forward compute, the copy back the
        # (longer) backward; the last region's is never hidden (backward needs it first).
        self.hide_seconds = sum(self.fwd[: self.last])
        self.per_byte_cpu = 1.0 / machine.link_bytes_per_s if device_is_host else 0.0
        #: regions of the plain tail that make their cheap saves again at unpack (Note [a
        #: plain tail makes its cheap saves again] in search.py)
        self.remade: set = set()
        self.keep_tail = False  # Note [the tail stays] in search.py
        self.keep_all = False  # Note [everything kept] in search.py
        #: Note [a kept backward frees as it goes] in search.py: the backward term counts each
        #: region rebuilt with what the regions after it kept already freed (``staged``);
        #: ``pre_held`` is what the plain tail holds with what its backward adds
        self.staged = False
        self.pre_held = 0
        self._rebuilt: Optional[List[int]] = None
        #: ... and, as backward reaches each region (Note [gradients as backward goes] in
        #: search.py), what the model saves after its last region (freed by then) and the
        #: gradients of the plain tail's parameters (made by then); ``start_extra``: how much
        #: more the start of backward's measured offset is than the rebuilt regions' (the
        #: budget is taken down by the latter)
        self.model_tail = 0
        self.tail_grads = 0
        self.start_extra = 0
        #: what to take off a borrowed offset for this model (``borrow_shift``)
        self.offset_shift = 0
        #: ... and what backward adds at its start beside ``tail_grad`` (staged only)
        self.start_grad = 0
        #: Note [regions shipped whole] in search.py: the most the forward holds while their
        #: copies are in flight (0: none shipped; a forward term, which the measured offsets of
        #: the backward's model do not correct), what backward holds while they come back (a
        #: term of the peak), and region index -> bytes its backward's start brings back
        self.floor = 0
        self.ret_term = 0
        self.returns: Dict[int, int] = {}
        #: the plain tail's records (add_plain_tail), for ``floor``
        self.tail_regions: List[RegionRecord] = []

    def unkeep(self, it: Item) -> None:
        """``it`` is no longer kept (recomputed or offloaded)."""
        self.kept -= it.op.bytes
        self.region_kept[it.region] -= it.op.bytes
        if it.op.needed:
            self.region_kept_needed[it.region] -= it.op.bytes

    def clear_kept(self) -> None:
        self.kept = 0
        self.region_kept = [0] * len(self.regions)
        self.region_kept_needed = [0] * len(self.regions)

    def _staged_terms(self) -> List[int]:
        """Per region, what rebuilding it adds over ``mem`` when the regions after it are done
        (Note [a kept backward frees as it goes] in search.py): its rebuilt bytes, less what
        the regions after it kept (freed by their backward) and what it kept of its own saved
        tensors (``mem`` holds them, and they are among what it rebuilds; an output it keeps
        that autograd does not save is held on top)."""
        out = list(self._rebuilt_done())
        after = 0
        for i in range(len(self.regions) - 1, -1, -1):
            out[i] -= after + self.region_kept_needed[i]
            after += self.region_kept[i]
        return out

    def _rebuilt_done(self) -> List[int]:
        """Per region, its rebuilt bytes with what backward has done by then (Note [gradients
        as backward goes] in search.py): the model's tail and the regions after it done, their
        inputs freed, their parameters' gradients made. Decision-independent: once per pass
        (the tail's fields are set before the pass runs)."""
        if self._rebuilt is None:
            done = self.tail_grads - self.model_tail
            out = [0] * len(self.regions)
            for i in range(len(self.regions) - 1, -1, -1):
                r = self.regions[i]
                out[i] = r.needed_bytes + transient_bytes(r) + done
                done += r.grad_bytes - r.input_bytes
            self._rebuilt = out
        return self._rebuilt

    def borrow_shift(self) -> int:
        """Note [gradients as backward goes] in search.py: how far this model of full
        recomputation (nothing kept) lies above the one without the backward's progress, which
        an offset the kept family borrows was measured against (what the step holds after
        forward is common to both: ``over``)."""
        plain = max((r.needed_bytes + transient_bytes(r) for r in self.regions), default=0)
        return (max(self.pre_held, max(self._rebuilt_done(), default=0))
                - max(self.pre_held, plain))

    def bwd_now(self) -> int:
        """The backward term of the peak under the decisions so far."""
        if not self.staged:
            return self.bwd
        return max(self._staged_terms(), default=0)

    def over(self) -> bool:
        """The decisions so far do not fit ``budget``."""
        if not self.staged:
            return self.mem > self.budget
        return self.mem + max(self.pre_held + self.start_extra, self.bwd_now()) > self.budget

    def binding(self) -> List[int]:
        """Staged: the regions whose rebuilt term is the peak (the start of backward, which
        every freed byte lowers, is not named)."""
        terms = self._staged_terms()
        worst = max(terms, default=0)
        if not terms or self.pre_held + self.start_extra > worst:
            return []
        return [i for i, t in enumerate(terms) if t == worst]

    @staticmethod
    def lowers(it: Item, binding: List[int]) -> bool:
        """Freeing ``it`` lowers every binding term: a region rebuilt holds what the regions
        before it kept, and what it kept itself that autograd does not save (the saved ones it
        rebuilds anyway); what the regions after it kept is gone."""
        return all(it.region < i or (it.region == i and not it.op.needed) for i in binding)

    @property
    def mem(self) -> int:
        """Device bytes held after forward under the decisions so far."""
        if self.charge == "device":
            fixed = self.fixed_in
        elif self.charge == "resident":
            fixed = self.resident  # a CPU host: the pool is this memory, faulted in whole
        else:
            fixed = 0
        return fixed + self.kept + self.tail_bytes

    @property
    def peak(self) -> int:
        """The modeled peak: what is held after forward with what backward adds first (the loss
        region's transient or the plain tail's gradients), or, once the plain tail's backward
        freed it, what the rest holds + the largest region rebuilt."""
        return max(self.start_term() + self.start_extra, self.rebuild_term(), self.ret_term)

    def start_term(self) -> int:
        """The modeled peak at the start of backward: what forward holds with what backward adds
        first (the loss region's transient or the plain tail's gradients)."""
        return self.mem + max(self.tail_grad, self.start_grad)

    def rebuild_term(self) -> int:
        """... and once the plain tail's backward freed it: what the rest holds + the largest
        region rebuilt."""
        return self.mem - self.tail_bytes + self.bwd_now()

    def rebuilt_bytes(self) -> int:
        """Bytes a checkpointed region brings back at once in backward: recomputation rebuilds
        (or reloads) everything autograd saved in it before its backward starts, and on the way
        creates outputs autograd does not keep (the scores before a softmax): Note [recompute
        transients]."""
        return max((r.needed_bytes + transient_bytes(r) for r in self.regions), default=0)

    def transfer_seconds(self, nbytes: int) -> float:
        m = self.machine
        if self.nvme:
            # Bytes pass through host memory; what exceeds the resident share also goes to disk.
            t = 0.0 if self.device_is_host else nbytes / m.link_bytes_per_s
            over = max(0, self.offloaded + nbytes - self.resident) - max(
                0, self.offloaded - self.resident)
            return t + over / (m.nvme_bytes_per_s or float("inf"))
        return nbytes / m.link_bytes_per_s

    def tail_seconds(self, nbytes: int) -> float:
        """Note [the tail stays] (search.py): what shipping the model's tail costs the step,
        its copies out and back in full (backward needs it first), and the host's time."""
        m = self.machine
        return 2 * nbytes / m.link_bytes_per_s + 2 * m.host_seconds_per_offload

    def can_offload(self, it: Item) -> bool:
        if not self.use_offload:
            return False
        if self.nvme:
            if self.chunked(it):
                return True  # in pieces through the pool (Note [gathered storages], gather.rs)
            # Recomputing a region brings back all its offloaded outputs (and inputs) at once,
            # and each holds a pool block until the region's backward is done. Past what the
            # pool holds, the NVMe tier reads back through temporary mappings (slower, with a
            # warning): plan within a share of the pool, leaving room to read ahead.
            r = self.regions[it.region]
            need = self.region_off[it.region] + it.op.bytes + r.input_bytes
            return need <= self.pool * REGION_POOL_SHARE
        return self.offloaded + it.op.bytes <= self.host_room

    def chunked(self, it: Item) -> bool:
        """Offloaded in pieces by the NVMe tier: larger than half its pool (Note [gathered
        storages] in rust/tier/gather.rs)."""
        return self.nvme and it.op.bytes > self.pool // 2

    def offload_cost(self, it: Item) -> Tuple[float, bool]:
        t = self.transfer_seconds(it.op.bytes)
        hidden = it.region != self.last and self.link_used + t <= self.hide_seconds
        # On a CPU host the copies cost compute: one into the pool, and for a chunked storage
        # a second one on unpack (for the pieces still in the pool; those on disk are read
        # straight into the tensor, Note [gathered storages] in rust/tier/gather.rs: an upper
        # bound).
        copies = 2 if self.chunked(it) else 1
        # Note [host cost in the plan]: the host's time per offloaded tensor is never hidden
        host = self.machine.host_seconds_per_offload
        return (0.0 if hidden else t) + copies * it.op.bytes * self.per_byte_cpu + host, hidden


    def _dead(self, ri: int, ops: List[OpRecord]) -> set:
        """Recomputed ops that only saved ops read: the runtime skips them in recomputation."""
        if not self.regions[ri].saves_seen:  # torch < 2.8: the runtime skips nothing
            return set()
        return region_skipped(ops, lambda o: self.ops[(ri, o.index)][0])


    def _total_recompute(self) -> None:
        t = 0.0
        for ri, r in enumerate(self.regions):
            if self.modes[ri] != "checkpoint":
                continue
            t += self.machine.wrapped_seconds(r.ops)  # Note [two clocks in the plan]
            dead = self._dead(ri, r.ops)
            rerun = [o for o in r.ops if not o.after_stop and o.index not in dead
                     and self.ops[(ri, o.index)][0] == "recompute"]
            # Note [a replay's host time is the region's] in machine.py
            t += self.machine.replay_seconds(r.ops, rerun)
        self.recompute = t



def ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"

