"""The passes that plan one variant of a step (Note [near ties go to memory] in search.py
chooses among them): :class:`Greedy` frees bytes op by op, cheapest first, by recomputing or
offloading them; :class:`PlainOffload` runs every region plainly with the offload context
taking what autograd saves. Both keep their costs in :class:`~.cost.Costs`."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..activations.link.common import default_cap_bytes
from ..config import format_size
from .cost import Costs, Item, ms, transient_bytes
from .machine import Machine
from .records import RegionRecord

__all__ = ["Greedy", "PlainOffload", "shipped_bytes", "shipped_sets"]

#: Note [regions shipped whole] in search.py: a region's backward runs about twice its
#: forward (its matmuls' gradients with respect to the input and to the weight)
BACKWARD_PER_FORWARD = 2.0


class Greedy(Costs):
    """One planning pass (with or without offloading op outputs); see the package docstring."""

    def run(self) -> Greedy:
        by_rc = sorted(self.items, key=lambda it: (it.rc, it.region, it.op.index))
        # Offload candidates: dearest to recompute first, the last region's after all others.
        by_off = sorted(
            (it for it in self.items if self.use_offload),
            key=lambda it: (it.region == self.last, -it.rc, it.region, it.op.index),
        )
        taken: set = set()
        lo = hi = 0
        if self.staged:
            self._free_staged(by_rc, taken)
        while not self.staged and self.mem > self.budget:
            while lo < len(by_rc) and id(by_rc[lo]) in taken:
                lo += 1
            while hi < len(by_off) and (
                id(by_off[hi]) in taken or not self.can_offload(by_off[hi])
            ):
                hi += 1
            if lo >= len(by_rc):
                break
            cand = by_rc[lo]
            off = by_off[hi] if hi < len(by_off) else None
            off_cost, hidden = self.offload_cost(off) if off is not None else (float("inf"), False)
            if off is None or cand.rc <= off_cost / off.op.bytes:
                taken.add(id(cand))
                self.unkeep(cand)
                self.ops[(cand.region, cand.op.index)] = (
                    "recompute", "", f"cheapest to free ({rate_text(cand)})")
            else:
                taken.add(id(off))
                self.unkeep(off)
                self._take_offload(off, off_cost, "the transfer hides behind compute" if hidden
                                   else "cheaper to move than to recompute")
        for it in self.items:
            if id(it) not in taken:
                self.ops[(it.region, it.op.index)] = ("keep", "", "fits the budget")
        self._save_chain_ends()
        self._label_tiers()
        self._total_recompute()
        return self

    def _free_staged(self, by_rc: List[Item], taken: set) -> None:
        """Note [a kept backward frees as it goes] in search.py: recompute the cheapest output
        whose bytes every binding term holds, until the step's peak fits (no offloading: the
        kept family ships nothing)."""
        assert not self.use_offload
        left = list(by_rc)
        while left and self.over():
            binding = self.binding()
            # where nothing lowers every binding term (the rebuilt regions tie), the cheapest
            # of the rest: a rebuilt region holds less than the model's bound on it
            # (recomputed tensors come back as backward reaches them), a kept one all of it
            cand = next((it for it in left if self.lowers(it, binding)), left[0])
            left.remove(cand)
            taken.add(id(cand))
            self.unkeep(cand)
            self.ops[(cand.region, cand.op.index)] = (
                "recompute", "", f"cheapest to free ({rate_text(cand)})")

    def _take_offload(self, it: Item, cost: float, why: str) -> None:
        """Decide to offload ``it`` (its bytes already left out of ``kept``)."""
        self.link_used += self.transfer_seconds(it.op.bytes)
        self.offloaded += it.op.bytes
        if not self.chunked(it):
            self.region_off[it.region] += it.op.bytes
        self.transfer += cost
        self.region_transfer[it.region] += cost
        self.ops[(it.region, it.op.index)] = ("offload", "", why)

    def _save_chain_ends(self) -> None:
        """Offload a recomputed output when that lets the runtime skip the ops feeding it and
        costs less than rerunning them all (e.g. a softmax output: then the scores matmul,
        scaling and masking before it are not rerun either), within the budget."""
        # Chain ends first: a softmax output spares the matmul, scaling and masking before it.
        for it in sorted(self.items, key=lambda it: (it.region, -it.op.index)):
            k = (it.region, it.op.index)
            if self.ops[k][0] != "recompute" or not self.use_offload or not self.can_offload(it):
                continue
            ops = self.regions[it.region].ops
            before = self._dead(it.region, ops)
            decided = self.ops[k]
            self.ops[k] = ("offload", "", "")
            gained = self._dead(it.region, ops) - before
            self.ops[k] = decided
            saved_s = it.seconds + sum(self.machine.rerun_seconds(o) for o in ops
                                       if o.index in gained)
            cost, _ = self.offload_cost(it)
            if not gained or cost >= saved_s:
                continue
            self.offloaded += it.op.bytes  # what the pool would hold with it
            fits = self.mem <= self.budget
            self.offloaded -= it.op.bytes
            if not fits:
                continue
            self._take_offload(it, cost, f"saving it spares rerunning {len(gained)} ops "
                               f"before it ({ms(saved_s)} > {ms(cost)})")

    def add_plain_tail(self, tail: List[RegionRecord], tail_bytes: int, grad: int = 0,
                       remake: bool = False) -> None:
        """Append regions that run plainly and keep everything (after planning the rest);
        ``grad``: what their backward adds (Note [plain backward]); ``remake``: but what can be
        made again at unpack (Note [a plain tail makes its cheap saves again] in search.py),
        whose ops' time is charged."""
        base = len(self.modes)
        self.tail_regions = list(tail)
        for i, r in enumerate(tail):
            self.modes.append("plain-keep")
            if remake:
                self.remade.add(base + i)
            for o in r.ops:
                if remake and o.needed and o.rederived:
                    self.ops[(base + i, o.index)] = (
                        "recompute", "", "region runs plainly: made again at unpack from what "
                        "its op saved")
                    self.recompute += self.machine.rerun_seconds(o)
                    continue
                self.ops[(base + i, o.index)] = (
                    "keep", "", "region runs plainly: backward needs it first and it fits")
        self.tail_bytes += tail_bytes
        self.tail_grad = grad
        self.budget += tail_bytes

    def place_shipped(self, shipped: Sequence[int], regions: List[RegionRecord],
                      rest: List[int], rederive: bool) -> None:
        """Note [regions shipped whole] in search.py: this pass planned ``rest`` (indices into
        ``regions``, with its plain tail); put the regions ``shipped`` among them, run plainly
        with the context taking what they save, and renumber its decisions as ``regions``.
        Charged: the host's time per tensor they ship, their cheap saves made again
        (``rederive``), and what of their copies back the backward after them cannot hide;
        the forward holds their copies in flight (``floor``), backward their returns
        (``ret_term``), each started at a later region's backward (``returns``)."""
        m = self.machine
        n = len(regions)
        ship = set(shipped)
        self.ops = {(rest[ri], oi): v for (ri, oi), v in self.ops.items()}
        self.remade = {rest[i] for i in self.remade}
        modes = dict(zip(rest, self.modes))
        self.modes = [modes.get(i, "plain-offload") for i in range(n)]
        why = ("region runs plainly: the context takes what autograd saves, its copies within "
               "what the link keeps pace with")
        out: Dict[int, int] = {}
        tensors = 0
        for i in shipped:
            out[i] = regions[i].input_bytes
            tensors += 1 if regions[i].input_bytes else 0
            for o in regions[i].ops:
                if not (o.needed and o.bytes):
                    self.ops[(i, o.index)] = ("recompute", "", "region runs plainly: not held")
                elif rederive and o.rederived:
                    self.ops[(i, o.index)] = ("recompute", "", "made again at unpack from what "
                                              "its op saved")
                    self.recompute += m.rerun_seconds(o)
                else:
                    self.ops[(i, o.index)] = ("offload", "host", why)
                    out[i] += o.bytes
                    tensors += 1
        total = sum(out.values())
        self.transfer += tensors * m.host_seconds_per_offload
        self.link_used += self.transfer_seconds(total)
        self.offloaded += total
        # what each region holds once its forward ran; the copies in flight beside it
        local = {g: li for li, g in enumerate(rest)}
        n_mid = len(rest) - len(self.tail_regions)
        own = [0] * n
        for i in range(n):
            li = local.get(i)
            if li is None:
                continue
            r = regions[i]
            if li < n_mid:  # inputs stay where the context keeps them (kept: ``charge``)
                own[i] = (r.input_bytes if self.charge == "device" else 0) + self.region_kept[li]
            else:
                own[i] = r.input_bytes + r.needed_bytes - (
                    r.rederived_bytes if i in self.remade else 0)
        fwd = [m.forward_seconds(r.ops) for r in regions]
        rate = m.link_bytes_per_s
        backlog = 0.0
        held = 0
        for i in range(n):
            held += own[i]
            backlog = max(0.0, backlog + out.get(i, 0) - rate * fwd[i])
            self.floor = max(self.floor, self.outside_bytes + held + int(backlog))
        # Note [regions shipped whole]: each comes back from the start of the backward of the
        # nearest region after it whose backward (with those between) outlasts the copies
        bwd = [BACKWARD_PER_FORWARD * f for f in fwd]
        for i in shipped:
            need = out[i] / rate
            at, room = i + 1, bwd[i + 1]
            while room < need and at < n - 1:
                at += 1
                room += bwd[at]
            self.transfer += max(0.0, need - room)
            # what else backward reads back first from there: the inputs it ships
            ahead = sum(regions[x].input_bytes for x in range(i + 1, at + 1)
                        if x not in ship and self.charge != "device"
                        and self.modes[x] == "checkpoint")
            self.returns[at] = self.returns.get(at, 0) + out[i] + ahead
            self.ret_term = max(self.ret_term, max(
                self.outside_bytes + sum(own[:x]) + own[x] + out[i]
                + (regions[x].needed_bytes + transient_bytes(regions[x])
                   if self.modes[x] == "checkpoint" else 0)
                for x in range(i + 1, at + 1)))

    def _label_tiers(self) -> None:
        """The NVMe tier writes out the earliest packed first: what was packed last stays in
        the pool, up to its resident share; everything packed before that goes to disk."""
        room = self.resident
        spilled = False
        for ri in range(self.last, -1, -1):
            for o in reversed(self.regions[ri].ops):
                act, _tier, why = self.ops[(ri, o.index)]
                if act != "offload":
                    continue
                if not self.nvme or (not spilled and o.bytes <= room):
                    room -= o.bytes
                    self.ops[(ri, o.index)] = (act, "host", why)
                else:
                    spilled = True
                    self.ops[(ri, o.index)] = (act, "nvme", why)


class PlainOffload(Greedy):
    """The variant where the regions run plainly and the offload context takes everything
    autograd saves: nothing is recomputed, and backward reloads tensors one by one as it needs
    them (no region is rebuilt at once), so its backward peak is the lowest."""

    def rebuilt_bytes(self) -> int:
        largest = max((o.bytes for r in self.regions for o in r.ops if o.needed), default=0)
        return 2 * largest  # the one in use and the next one read ahead

    def run(self) -> PlainOffload:
        self.modes = ["plain-offload"] * len(self.regions)
        self.clear_kept()
        total = sum(r.needed_bytes for r in self.regions)
        t = self.transfer_seconds(total)
        last = self.regions[self.last].needed_bytes if self.regions else 0
        exposed = max(0.0, t - self.hide_seconds, self.transfer_seconds(last))
        self.offloaded = total
        # Note [host cost in the plan]: every tensor the context takes costs the host its time
        n = sum(1 for r in self.regions for o in r.ops if o.needed and o.bytes)
        self.transfer = (exposed + 2 * total * self.per_byte_cpu
                         + n * self.machine.host_seconds_per_offload)
        self.link_used = t
        why = "region runs plainly: the offload context takes what autograd saves"
        for ri, r in enumerate(self.regions):
            for o in r.ops:
                k = (ri, o.index)
                if o.needed and o.bytes:
                    self.ops[k] = ("offload", "", why)
                else:
                    self.ops[k] = ("recompute", "", "region runs plainly: not held")
        self._label_tiers()
        self.recompute = 0.0
        return self


def rate_text(it: Item) -> str:
    return f"{it.seconds * 1e3:.2f} ms for {format_size(it.op.bytes)}"


def shipped_bytes(r: RegionRecord, rederive: bool) -> int:
    """What the context takes of a region run plainly under it: its input and what autograd
    saves, less what it makes again at unpack (Note [made again at unpack])."""
    return r.input_bytes + r.needed_bytes - (r.rederived_bytes if rederive else 0)


def shipped_sets(regions: List[RegionRecord], machine: Machine,
                 ctx: Optional[Dict[str, Any]], device_is_host: bool, rederive: bool,
                 checkpoint: bool) -> List[Tuple[int, ...]]:
    """Note [regions shipped whole] in search.py: no region, then for each count the earliest
    regions whose copies out the link keeps pace with (what is still in flight at each
    region's end within the context's cap), within its pool; on a device's host tier, or tier
    auto's RAM."""
    out: List[Tuple[int, ...]] = [()]
    if (ctx is None or device_is_host or not checkpoint or len(regions) < 2
            or (ctx.get("nvme") and ctx.get("tier") != "auto")):
        return out
    cap = ctx.get("inflight_bytes")
    cap = int(cap if cap is not None else default_cap_bytes(None))
    pool = int(ctx.get("pool_bytes") or 0)
    rate = machine.link_bytes_per_s
    fwd = [machine.forward_seconds(r.ops) for r in regions]
    ship = [shipped_bytes(r, rederive) for r in regions]
    for count in range(1, len(regions)):
        chosen: List[int] = []
        backlog = 0.0
        for i in range(len(regions) - 1):  # the last: backward needs it first
            take = len(chosen) < count and ship[i] > 0 and \
                backlog + ship[i] - rate * fwd[i] <= cap
            if take:
                chosen.append(i)
            backlog = max(0.0, backlog + (ship[i] if take else 0) - rate * fwd[i])
        if len(chosen) < count or sum(ship[i] for i in chosen) > pool:
            break
        out.append(tuple(chosen))
    return out
