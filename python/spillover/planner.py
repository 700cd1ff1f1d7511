"""The planner: keep, offload (host or NVMe) or recompute, per saved tensor, under a budget.

It works on what one training step of a wrapped model saves, learned from a step that runs every
region fully recomputed (the safe choice when nothing is known yet) while recording, per op of
each region: the bytes of its output, its recompute FLOPs (from the op and its shapes), whether
autograd saves it, and where recomputation stops. Costs come from this machine's measured
throughput and bandwidths (:mod:`spillover.calibrate`). Then, under the device-memory budget
(``budget_bytes=`` or SPILLOVER_DEVICE_BUDGET_BYTES; by default a share of free memory):

1. If what no checkpointing holds fits, every region runs plainly and keeps everything.
2. Otherwise every region is checkpointed and, starting from "save every op output", bytes are
   freed in order of least cost per byte: recompute an output (its op's estimated time), or
   hand it to the offload tier (free while the link can hide the transfer behind compute, then
   its transfer time). Earlier regions are freed first at equal cost, and the last region's
   tensors are never counted as hidden: backward needs them first.
3. Regions, last first, go back to running plainly while the budget still holds.

On a CPU-only machine the "device" is host memory: offloading to the host pool frees nothing,
so only NVMe (through a write-back pool whose resident part still counts) and recompute do.

The plan is reused while each region's call order, input shapes and the offload context stay
the same. A step that differs runs its remaining regions as learning runs; if it differed from
its first region on, the next step is planned from it, otherwise the next step learns again.

Note [peak feedback]
    The budget is the step's peak (forward and backward), not what it holds after forward. The
    model adds to what a plan holds after forward the largest region rebuilt in backward
    (recomputation brings back everything autograd saved in a region before its backward
    starts; a region run plainly under the context reloads tensors one by one), but it cannot
    see gradients being computed, copies in flight, tensors under the minimum offload size or
    pieces being assembled. So the learning step (every region recomputed in full) has its
    peak measured (:mod:`spillover._peak`) and the difference from its model becomes an offset
    added to every variant's modeled peak. The first planned steps (``TUNING_STEPS``) are
    measured too: a plan over the budget, or more than ``SLACK`` under it, re-plans with the
    offset it showed; after them the fastest measured plan within the budget is kept (else the
    one with the least peak). With the same calibration and the same measured peaks the plans
    are the same.

Note [planner step boundaries]
    ``wrap`` starts a step at each forward of the wrapped model. A standalone
    ``checkpoint(..., policy=planner)`` starts one when a region runs after a backward has
    reached a region of the current step (seen by a hook on the region's output).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import psutil
import torch

from .config import Config, format_size

__all__ = [
    "Planner",
    "Machine",
    "OpRecord",
    "RegionRecord",
    "Explanation",
    "op_flops",
    "output_tensors",
    "storage_bytes",
    "HIGH_WATER",
]

#: The share of the NVMe tier's pool the planner counts on finding resident after forward
#: (written entries keep their blocks, Note [write early, drop late] in rust/tier/policy.rs;
#: the rest is left to blocks still being copied or written).
HIGH_WATER = 0.75
#: Share of the NVMe tier's pool one region's offloaded outputs may take (they all come back
#: when the region is recomputed).
REGION_POOL_SHARE = 0.5
#: Share of free memory the planner may use when no budget is given.
DEFAULT_BUDGET_SHARE = 0.5

try:  # torch >= 2.1
    from torch.utils.flop_counter import flop_registry as _FLOP_REGISTRY
except ImportError:  # pragma: no cover
    _FLOP_REGISTRY = {}


# ---- what an op costs -----------------------------------------------------------------------


def output_tensors(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what keeping them pins)."""
    seen = set()
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        try:
            st = t.untyped_storage()
            key = (t.device, st.data_ptr())
        except (RuntimeError, NotImplementedError):  # fake (compile) or storage-less subclasses
            total += t.numel() * t.element_size()
            continue
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _shape_sig(x: Any) -> Any:
    """What a flop formula reads of an argument: tensors by shape and dtype, the rest by value."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_shape_sig(y) for y in x)
    return x


#: op_flops of formula ops by (op, argument shapes): torch's formulas cost tens of
#: microseconds per call, and a region's forward asks once per op per step.
_FLOPS_MEMO: Dict[Any, int] = {}
_FLOPS_MEMO_MAX = 4096


def op_flops(func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> int:
    """Recompute FLOPs of one op: torch's flop formulas for matmuls, convolutions and fused
    attention; one per output element for everything else (memory-bound ops)."""
    formula = _FLOP_REGISTRY.get(getattr(func, "overloadpacket", None))
    if formula is not None:
        try:
            key: Any = (func, _shape_sig(tuple(args)), _shape_sig(tuple(sorted(kwargs.items()))),
                        _shape_sig(out))
            hit = _FLOPS_MEMO.get(key)
        except TypeError:  # an unhashable argument: no memo
            key, hit = None, None
        if hit is not None:
            return hit
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception:  # an overload the formula does not know
            flops = None
        if flops is not None:
            if key is not None:
                if len(_FLOPS_MEMO) >= _FLOPS_MEMO_MAX:
                    _FLOPS_MEMO.clear()
                _FLOPS_MEMO[key] = flops
            return flops
    return sum(t.numel() for t in output_tensors(out))


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
    total = sum(machine.op_seconds(o) for o in ops if o.forced != "view")
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
        cost = machine.op_seconds(o) + sum(machine.op_seconds(x) for x in rec.ops
                                           if x.index in gained)
        rate = o.bytes / cost if cost > 0 else float("inf")
        if rate < bar:
            chain = f" and the {len(gained)} ops before it" if gained else ""
            out[o.index] = (f"rebuilding it{chain} frees {format_size(rate)}/s < full "
                            f"recompute's {format_size(bar)}/s: saved")
        else:
            action[o.index] = "recompute"
    return out


def is_compute_bound(func: Any) -> bool:
    return getattr(func, "overloadpacket", None) in _FLOP_REGISTRY


# ---- the machine ----------------------------------------------------------------------------


@dataclasses.dataclass
class Machine:
    """Measured rates of one device and its host (see :mod:`spillover.calibrate`)."""

    matmul_flops: Dict[str, float]
    elementwise_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    nvme_write_bytes_per_s: Optional[float] = None
    nvme_read_bytes_per_s: Optional[float] = None

    @classmethod
    def from_calibration(cls, data: Dict[str, Any], device: str) -> Machine:
        devs = data["devices"]
        d = devs.get(device) or devs.get(device.split(":")[0]) or next(iter(devs.values()))
        return cls(
            matmul_flops=dict(d["matmul_flops"]),
            elementwise_bytes_per_s=d["elementwise_bytes_per_s"],
            d2h_bytes_per_s=d["d2h_bytes_per_s"],
            h2d_bytes_per_s=d["h2d_bytes_per_s"],
            nvme_write_bytes_per_s=data.get("nvme_write_bytes_per_s"),
            nvme_read_bytes_per_s=data.get("nvme_read_bytes_per_s"),
        )

    def flops_per_s(self, dtype: str) -> float:
        f = self.matmul_flops
        return f.get(dtype) or f.get("float32") or max(f.values())

    def op_seconds(self, op: OpRecord) -> float:
        """Estimated time to run the op again: its FLOPs at matmul speed if it is compute-bound,
        plus its bytes in and out at elementwise speed (fresh outputs included)."""
        t = op.moved_bytes / self.elementwise_bytes_per_s
        if op.compute_bound:
            t += op.flops / self.flops_per_s(op.dtype)
        return t

    @property
    def link_bytes_per_s(self) -> float:
        return min(self.d2h_bytes_per_s, self.h2d_bytes_per_s)

    @property
    def nvme_bytes_per_s(self) -> Optional[float]:
        if not self.nvme_write_bytes_per_s or not self.nvme_read_bytes_per_s:
            return None
        return min(self.nvme_write_bytes_per_s, self.nvme_read_bytes_per_s)


_machines: Dict[str, Machine] = {}
_machines_lock = threading.Lock()


def machine_for(device: str) -> Machine:
    """This process's :class:`Machine` for ``device``: calibrated on first use, then cached on
    disk (``python -m spillover bench`` does the same ahead of time)."""
    with _machines_lock:
        m = _machines.get(device)
        if m is None:
            from . import calibrate

            # First use is often inside a training step (a selective region's first call): the
            # measurements' random tensors must not move torch's RNG, or every dropout mask
            # drawn after them differs from the plain run's.
            dev = torch.device(device)
            with torch.random.fork_rng(
                devices=[] if dev.type == "cpu" else [_device_index(dev)],
                device_type="cuda" if dev.type == "cpu" else dev.type,
            ):
                cal = calibrate.calibrate(device=device)
            m = _machines[device] = Machine.from_calibration(cal, device)
        return m


def _device_index(dev: torch.device) -> int:
    if dev.index is not None:
        return dev.index
    module = getattr(torch, dev.type, None)
    return int(module.current_device()) if module is not None else 0


# ---- what one step recorded ------------------------------------------------------------------


@dataclasses.dataclass
class OpRecord:
    """One op call inside a region, as its forward ran."""

    index: int
    name: str
    shape: Tuple[int, ...]
    dtype: str
    bytes: int  # storage bytes its outputs pin if saved (0 for views)
    flops: int
    moved_bytes: int  # inputs + outputs, for the memory-bound part of its cost
    compute_bound: bool
    #: why the op is never saved ("view", "mutates an input", "random") or always saved
    #: ("effect"); None when the policy or planner decides.
    forced: Optional[str] = None
    needed: bool = False  # autograd saved (a view of) its output
    #: never rerun: recomputation stops before it, or only saved ops read its output
    after_stop: bool = False
    #: ops of the region that read its output, views seen through (for Note [outputs only
    #: saved ops read] in recompute/modes.py)
    readers: Tuple[int, ...] = ()
    action: str = "recompute"  # keep | offload | recompute
    tier: str = ""  # host | nvme, for offloaded outputs (the planner's estimate)
    reason: str = ""

    @property
    def flops_per_byte(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


@dataclasses.dataclass
class RegionRecord:
    """One region invocation of one step."""

    key: Any
    name: str
    signature: Any
    device: str
    mode: str  # checkpoint | plain | plain-keep | plain-offload
    input_bytes: int = 0
    ops: List[OpRecord] = dataclasses.field(default_factory=list)
    needed_bytes: int = 0  # op outputs autograd saved: what running it plainly holds
    stop: int = 0  # ops at or after this index are never recomputed
    offload: Optional[Dict[str, Any]] = None  # the offload context seen: tier, pool bytes

    @property
    def held_bytes(self) -> int:
        """Bytes this run holds after forward (saved outputs, kept or offloaded, + inputs)."""
        if self.mode != "checkpoint":
            return self.input_bytes + self.needed_bytes
        return self.input_bytes + sum(o.bytes for o in self.ops if o.action == "keep")


# ---- the plan --------------------------------------------------------------------------------


@dataclasses.dataclass
class RegionPlan:
    signature: Any
    mode: str  # checkpoint | plain-keep | plain-offload
    actions: Dict[int, Tuple[str, str, str]]  # index -> (op name, action, tier)


@dataclasses.dataclass
class Plan:
    regions: List[RegionPlan]
    budget: Optional[int]
    plain_bytes: int  # what no checkpointing holds
    full_bytes: int  # what full recompute holds (inputs + the rest of the model)
    planned_bytes: int
    recompute_seconds: float
    transfer_seconds: float  # exposed (not hidden) transfer time
    fits: bool
    note: str = ""
    #: the modeled peak of the step (held after forward + the largest region rebuilt in
    #: backward), before the measured correction (Note [peak feedback])
    model_peak: int = 0
    #: measured peak - modeled peak, from the steps measured so far (None: not measured)
    peak_offset: Optional[int] = None
    variant: str = ""


def _ctx_signature(ctx: Any) -> Optional[Tuple[Any, ...]]:
    if ctx is None:
        return None
    cap = ctx.pool_limit  # not what is mapped now: a default pool grows (_growth.py)
    return (ctx.tier, cap, ctx.nvme)


def ctx_offload_info(ctx: Any) -> Optional[Dict[str, Any]]:
    if ctx is None:
        return None
    return {
        "tier": ctx.tier,
        "pool_bytes": ctx.pool_limit,
        "nvme": ctx.nvme,
    }


def input_signature(args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    sig: List[Any] = []
    for a in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), str(a.dtype), str(a.device), a.requires_grad))
        elif isinstance(a, (list, tuple)):
            sig.append(input_signature(a, {}))
    return tuple(sig)


class _Item:
    __slots__ = ("region", "op", "seconds", "rc")

    def __init__(self, region: int, op: OpRecord, seconds: float):
        self.region = region
        self.op = op
        self.seconds = seconds
        self.rc = seconds / op.bytes


#: The variants make_plan tries for the regions not run plainly at the end.
KINDS = ("checkpoint", "checkpoint+offload", "plain-offload")


def family(kind: str) -> str:
    """Variants whose backward peaks the same offset corrects: regions rebuilt at once in
    backward ("checkpoint"), reloaded one by one ("plain-offload"), or all plain."""
    if kind.startswith("plain-offload"):
        return "plain-offload"
    return "plain" if kind == "plain" else "checkpoint"


def make_plan(
    regions: List[RegionRecord],
    machine: Machine,
    budget: Optional[int],
    outside_bytes: int = 0,
    peak_offset: Optional[int | Dict[str, int]] = None,
    kinds: Sequence[str] = KINDS,
) -> Plan:
    """Decide every op output of ``regions`` (one step, in call order) under ``budget``.

    With ``peak_offset`` None the budget bounds what the step holds after forward (the model
    alone). With a number, the budget bounds the step's peak: what it holds after forward, plus
    the largest region rebuilt in backward, plus ``peak_offset`` (the measured peak minus that
    model, Note [peak feedback]); a dict gives one per variant family (:func:`family`), with
    "learning" for the families not measured yet.

    Mutates the records (``mode``, ``action``, ``tier``, ``reason``) so that they explain
    themselves, and returns the :class:`Plan` the next steps follow. ``kinds`` are the variants
    tried for the regions not run plainly at the end: op by op without offloading
    ("checkpoint"), with it ("checkpoint+offload"), or all run plainly with the offload context
    taking what they save ("plain-offload").
    """
    plain = outside_bytes + sum(r.input_bytes + r.needed_bytes for r in regions)
    full = outside_bytes + sum(r.input_bytes for r in regions)
    peak = peak_offset is not None

    def off(kind: str) -> int:
        if isinstance(peak_offset, dict):
            return peak_offset.get(family(kind), peak_offset.get("learning", 0))
        return peak_offset or 0

    if not regions or budget is None or plain + off("plain") <= budget:
        for r in regions:
            r.mode = "plain-keep"
            for o in r.ops:
                o.action, o.tier = "keep", ""
                o.reason = "everything fits the budget"
        return Plan(
            [RegionPlan(r.signature, "plain-keep", {}) for r in regions],
            budget, plain, full, plain, 0.0, 0.0, True, model_peak=plain,
            peak_offset=off("plain") if peak else None, variant="plain",
        )
    ctx = regions[0].offload
    device_is_host = regions[0].device == "cpu"
    # The last k regions run plainly (they are needed first in backward and cost nothing to
    # rebuild); the others are planned op by op in what remains of the budget, with and
    # without offloading op outputs, or all run plainly with the context taking what they save.
    variants: List[_Greedy] = []
    n = len(regions)
    for k in range(n):
        plain_tail = sum(r.input_bytes + r.needed_bytes for r in regions[n - k:])
        if k and plain_tail + off("checkpoint") > budget:
            break
        head = regions[: n - k]
        tried = [("checkpoint", False)] if "checkpoint" in kinds else []
        if ctx is not None:
            tried += [(kd, True) for kd in ("checkpoint+offload", "plain-offload") if kd in kinds]
        for kind, use_offload in tried:
            cls = _PlainOffload if kind == "plain-offload" else _Greedy
            g = cls(head, machine, 0, outside_bytes, ctx, device_is_host, use_offload)
            if kind == "plain-offload" and not g.use_offload:
                continue  # the context frees nothing here (a CPU host's host tier)
            g.bwd = g.rebuilt_bytes() if peak else 0
            # The plain tail's backward comes first and frees it before the others rebuild.
            g.budget = budget - off(kind) - (max(plain_tail, g.bwd) if peak else plain_tail)
            g.run()
            g.add_plain_tail(regions[n - k:], plain_tail)
            g.kind = kind + (f", last {k} plain" if k else "")
            variants.append(g)
    if not variants:  # none of ``kinds`` can run here (e.g. plain-offload on a host tier)
        return make_plan(regions, machine, budget, outside_bytes, peak_offset)
    fitting = [v for v in variants if v.peak + off(v.kind) <= budget]
    best = (min(fitting, key=lambda v: (v.recompute + v.transfer, v.peak)) if fitting
            else min(variants, key=lambda v: v.peak + off(v.kind)))
    for ri, r in enumerate(regions):
        r.mode = best.modes[ri]
        for o in r.ops:
            o.action, o.tier, o.reason = best.ops[(ri, o.index)]
    note = ""
    if not fitting:
        what = "peak" if peak else "least this plan can hold"
        note = (
            f"the budget ({format_size(budget)}) is below the {what} this plan reaches "
            f"({format_size(best.peak + off(best.kind))}): everything that can be freed is"
        )
    plans = [
        RegionPlan(r.signature, r.mode, {o.index: (o.name, o.action, o.tier) for o in r.ops})
        for r in regions
    ]
    return Plan(plans, budget, plain, full, best.mem, best.recompute, best.transfer,
                bool(fitting), note, model_peak=best.peak,
                peak_offset=off(best.kind) if peak else None,
                variant=best.kind)


def learning_peak(regions: List[RegionRecord], machine: Machine, outside_bytes: int = 0) -> int:
    """The modeled peak of a learning step (every region recomputed in full, Note [peak
    feedback]), counted as the plans' are: inputs and the rest of the model held (where the
    context puts them), + the largest region rebuilt."""
    if not regions:
        return outside_bytes
    g = _Greedy(regions, machine, 0, outside_bytes, regions[0].offload,
                regions[0].device == "cpu", False)
    g.kept = 0
    g.bwd = g.rebuilt_bytes()
    return g.peak


class _Greedy:
    """One planning pass (with or without offloading op outputs); see the module docstring.

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
        self.items: List[_Item] = []
        self.fwd = [0.0] * len(regions)
        for ri, r in enumerate(regions):
            for o in r.ops:
                sec = machine.op_seconds(o)
                self.fwd[ri] += sec
                k = (ri, o.index)
                if o.after_stop:
                    self.ops[k] = ("recompute", "", "after the last saved tensor: never rerun")
                elif o.forced == "effect":
                    self.ops[k] = ("keep", "", "has an ordered side effect: saved")
                    self.kept += o.bytes
                elif o.forced is not None or o.bytes == 0:
                    self.ops[k] = ("recompute", "", o.forced or "holds no memory")
                else:
                    self.items.append(_Item(ri, o, sec))
                    self.kept += o.bytes
        self.recompute = 0.0
        self.transfer = 0.0
        self.region_transfer = [0.0] * len(regions)
        self.region_off = [0] * len(regions)
        self.offloaded = 0
        self.tail_bytes = 0
        self.link_used = 0.0
        # What the link can hide: the copy out overlaps forward compute, the copy back the
        # (longer) backward; the last region's is never hidden (backward needs it first).
        self.hide_seconds = sum(self.fwd[: self.last])
        self.per_byte_cpu = 1.0 / machine.link_bytes_per_s if device_is_host else 0.0

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
        """The modeled peak: what is held after forward, or, once the plain tail's backward
        freed it, what the rest holds + the largest region rebuilt."""
        return max(self.mem, self.mem - self.tail_bytes + self.bwd)

    def rebuilt_bytes(self) -> int:
        """Bytes a checkpointed region brings back at once in backward: recomputation rebuilds
        (or reloads) everything autograd saved in it before its backward starts."""
        return max((r.needed_bytes for r in self.regions), default=0)

    def transfer_seconds(self, nbytes: int) -> float:
        m = self.machine
        if self.nvme:
            # Bytes pass through host memory; what exceeds the resident share also goes to disk.
            t = 0.0 if self.device_is_host else nbytes / m.link_bytes_per_s
            over = max(0, self.offloaded + nbytes - self.resident) - max(
                0, self.offloaded - self.resident)
            return t + over / (m.nvme_bytes_per_s or float("inf"))
        return nbytes / m.link_bytes_per_s

    def can_offload(self, it: _Item) -> bool:
        if not self.use_offload:
            return False
        if self.nvme:
            if self.chunked(it):
                return True  # it streams through the pool in pieces (Note [chunked storages])
            # Recomputing a region brings back all its offloaded outputs (and inputs) at once,
            # and each holds a pool block until the region's backward is done. Past what the
            # pool holds, the NVMe tier reads back through temporary mappings (slower, with a
            # warning): plan within a share of the pool, leaving room to read ahead.
            r = self.regions[it.region]
            need = self.region_off[it.region] + it.op.bytes + r.input_bytes
            return need <= self.pool * REGION_POOL_SHARE
        return self.offloaded + it.op.bytes <= self.host_room

    def chunked(self, it: _Item) -> bool:
        """Offloaded in pieces by the NVMe tier: larger than half its pool (Note [chunked
        storages] in context.py)."""
        return self.nvme and it.op.bytes > self.pool // 2

    def offload_cost(self, it: _Item) -> Tuple[float, bool]:
        t = self.transfer_seconds(it.op.bytes)
        hidden = it.region != self.last and self.link_used + t <= self.hide_seconds
        # On a CPU host the copies cost compute: one into the pool, and for a chunked storage
        # a second one on unpack (for the pieces still in the pool; those on disk are read
        # straight into the tensor, Note [gathered storages] in rust/tier/gather.rs: an upper
        # bound).
        copies = 2 if self.chunked(it) else 1
        return (0.0 if hidden else t) + copies * it.op.bytes * self.per_byte_cpu, hidden

    def run(self) -> _Greedy:
        by_rc = sorted(self.items, key=lambda it: (it.rc, it.region, it.op.index))
        # Offload candidates: dearest to recompute first, the last region's after all others.
        by_off = sorted(
            (it for it in self.items if self.use_offload),
            key=lambda it: (it.region == self.last, -it.rc, it.region, it.op.index),
        )
        taken: set = set()
        lo = hi = 0
        while self.mem > self.budget:
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
                self.kept -= cand.op.bytes
                self.ops[(cand.region, cand.op.index)] = (
                    "recompute", "", f"cheapest to free ({_rate_text(cand)})")
            else:
                taken.add(id(off))
                self.kept -= off.op.bytes
                self._take_offload(off, off_cost, "the transfer hides behind compute" if hidden
                                   else "cheaper to move than to recompute")
        for it in self.items:
            if id(it) not in taken:
                self.ops[(it.region, it.op.index)] = ("keep", "", "fits the budget")
        self._save_chain_ends()
        self._label_tiers()
        self._total_recompute()
        return self

    def _take_offload(self, it: _Item, cost: float, why: str) -> None:
        """Decide to offload ``it`` (its bytes already left out of ``kept``)."""
        self.link_used += self.transfer_seconds(it.op.bytes)
        self.offloaded += it.op.bytes
        if not self.chunked(it):
            self.region_off[it.region] += it.op.bytes
        self.transfer += cost
        self.region_transfer[it.region] += cost
        self.ops[(it.region, it.op.index)] = ("offload", "", why)

    def _dead(self, ri: int, ops: List[OpRecord]) -> set:
        """Recomputed ops that only saved ops read: the runtime skips them in recomputation."""
        return region_skipped(ops, lambda o: self.ops[(ri, o.index)][0])

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
            saved_s = it.seconds + sum(self.machine.op_seconds(o) for o in ops
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
                               f"before it ({_ms(saved_s)} > {_ms(cost)})")

    def add_plain_tail(self, tail: List[RegionRecord], tail_bytes: int) -> None:
        """Append regions that run plainly and keep everything (after planning the rest)."""
        base = len(self.modes)
        for i, r in enumerate(tail):
            self.modes.append("plain-keep")
            for o in r.ops:
                self.ops[(base + i, o.index)] = (
                    "keep", "", "region runs plainly: backward needs it first and it fits")
        self.tail_bytes += tail_bytes
        self.budget += tail_bytes

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

    def _total_recompute(self) -> None:
        t = 0.0
        for ri, r in enumerate(self.regions):
            if self.modes[ri] != "checkpoint":
                continue
            dead = self._dead(ri, r.ops)
            for o in r.ops:
                if (not o.after_stop and o.index not in dead
                        and self.ops[(ri, o.index)][0] == "recompute"):
                    t += self.machine.op_seconds(o)
        self.recompute = t


class _PlainOffload(_Greedy):
    """The variant where the regions run plainly and the offload context takes everything
    autograd saves: nothing is recomputed, and backward reloads tensors one by one as it needs
    them (no region is rebuilt at once), so its backward peak is the lowest."""

    def rebuilt_bytes(self) -> int:
        largest = max((o.bytes for r in self.regions for o in r.ops if o.needed), default=0)
        return 2 * largest  # the one in use and the next one read ahead

    def run(self) -> _PlainOffload:
        self.modes = ["plain-offload"] * len(self.regions)
        self.kept = 0
        total = sum(r.needed_bytes for r in self.regions)
        t = self.transfer_seconds(total)
        last = self.regions[self.last].needed_bytes if self.regions else 0
        exposed = max(0.0, t - self.hide_seconds, self.transfer_seconds(last))
        self.offloaded = total
        self.transfer = exposed + 2 * total * self.per_byte_cpu
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


def _rate_text(it: _Item) -> str:
    return f"{it.seconds * 1e3:.2f} ms for {format_size(it.op.bytes)}"


# ---- the planner ------------------------------------------------------------------------------


class Planner:
    """The ``"auto"`` policy: one per wrapped model (``wrap(model, policy="auto")``), or shared
    by standalone ``checkpoint(fn, ..., policy=planner)`` calls.

    Args:
        budget_bytes: the peak memory the step may reach on its device, forward and backward
            (activations, gradients and everything else the step allocates); default
            SPILLOVER_DEVICE_BUDGET_BYTES, else half of the device's free memory when planning.
        machine: rates to plan with (default: this machine's calibration, measured on first use
            and cached on disk).
        measure_peak: measure the peak of the learning step and of the first planned steps and
            correct the plan by it (Note [peak feedback]); with False the budget bounds what
            the step holds after forward, as modeled, and nothing is measured.
    """

    #: planned steps whose measured peak may still re-plan (Note [peak feedback])
    TUNING_STEPS = 3
    #: a measured peak within this share under the budget is close enough: no re-plan
    SLACK = 0.05

    def __init__(self, budget_bytes: Optional[int | str] = None, machine: Optional[Machine] = None,
                 measure_peak: bool = True):
        cfg = Config.load()
        if budget_bytes is not None:
            cfg = cfg.replace(device_budget_bytes=budget_bytes)
        self.budget_bytes: Optional[int] = cfg.device_budget_bytes
        self._machine = machine
        self._lock = threading.Lock()
        self.plan: Optional[Plan] = None
        self.learning = True
        self.explicit_steps = False  # set by wrap: it calls begin_step() itself
        self.steps = 0
        self.replans = 0
        self._records: List[RegionRecord] = []  # this step's
        self.last_records: List[RegionRecord] = []  # the last finished step's
        self.planned_records: List[RegionRecord] = []  # the records the plan was made from
        self._ordinals: Dict[Any, int] = {}
        self._pos = 0
        self._dirty = False
        self._all_learned = True
        self._backward_seen = False
        self.outside_bytes = 0
        # Note [peak feedback]
        self.measure_peak = measure_peak
        self._meter: Optional[Any] = None
        self._step_peak: Optional[int] = None  # this step's, read at the end of its backward
        self._metering = False
        #: measured peak - modeled peak per variant family ("learning": the learning step's)
        self.peak_offsets: Dict[str, int] = {}
        self.tuning_left = 0
        self.measured: List[Tuple[Plan, int]] = []  # (plan, its measured peak), while tuning
        self.last_peak: Optional[int] = None

    def __reduce__(self) -> Any:
        # Pickled with a wrapped model (Note [pickling a wrapped model] in recompute/blocks.py):
        # the settings travel; what it learned and planned is this machine's and is learned
        # again in the loaded model's first step.
        return (_planner_from, (self.budget_bytes, self._machine, self.measure_peak,
                                self.explicit_steps))

    # -- steps --

    def machine(self, device: str) -> Machine:
        return self._machine or machine_for(device)

    @property
    def tuned(self) -> bool:
        """True once the plan is final: planned, and no longer corrected by measured peaks."""
        return self.plan is not None and not self.learning and self.tuning_left == 0

    def begin_step(self) -> None:
        """Close the step that ran (plan from it if it was a learning step, correct the plan by
        its measured peak while tuning) and open one."""
        with self._lock:
            recs = self._records
            ran = self._pos > 0  # regions ran (planned plain regions leave no record)
            learned = bool(recs) and self._all_learned
            peak = self._finish_peak(recs if learned else self.planned_records)
            if recs:
                self.last_records = recs
            if learned:  # every region of the step recorded a learning run
                self.peak_offsets = {}
                if peak is not None:
                    self.peak_offsets["learning"] = peak - learning_peak(
                        recs, self.machine(recs[0].device), self.outside_bytes)
                self._make_plan(recs)
                self.tuning_left = self.TUNING_STEPS if self.peak_offsets else 0
                self.measured = []
            elif ran and self._dirty:  # part of the step followed a plan that no longer fits
                self.learning = True
                self.plan = None
            elif ran and self.plan is not None and peak is not None and self.tuning_left > 0:
                self._tune(peak)
            self._all_learned = True
            self._records = []
            self._ordinals = {}
            self._pos = 0
            self._dirty = False
            self._backward_seen = False
            self.steps += 1
            self._metering = False

    def _finish_peak(self, recs: List[RegionRecord]) -> Optional[int]:
        """The peak of the step that ran (None when it was not measured)."""
        if not self._metering or self._meter is None:
            return None
        peak = self._step_peak if self._step_peak is not None else self._meter.read()
        self._step_peak = None
        if peak is not None and recs:
            peak += self._pool_charge(recs)
        self.last_peak = peak
        return peak

    @staticmethod
    def _pool_charge(recs: List[RegionRecord]) -> int:
        """On a CPU host the offload context's pool is this same memory, faulted in when the
        context opened (before the step): charged in full, as the budget counts it."""
        info = recs[0].offload
        return int(info["pool_bytes"]) if info and recs[0].device == "cpu" else 0

    def _tune(self, peak: int) -> None:
        """Note [peak feedback]: correct the model by the peak the planned step reached."""
        plan = self.plan
        assert plan is not None
        self.measured.append((plan, peak))
        self.tuning_left -= 1
        budget = self._budget_for(self.planned_records[0].device)
        self.peak_offsets[family(plan.variant)] = peak - plan.model_peak
        if budget * (1 - self.SLACK) <= peak <= budget or self.tuning_left <= 0:
            self.tuning_left = 0
            self._settle(budget)
            return
        old = [(r.mode, r.actions) for r in plan.regions]
        self._make_plan(self.planned_records)
        if [(r.mode, r.actions) for r in self.plan.regions] == old and peak > budget:  # type: ignore[union-attr]
            # Over budget and the correction changes nothing: try a family not measured yet
            # (its offset may differ from the learning step's: e.g. regions reloading their
            # tensors one by one peak lower than the model of a rebuilt region says).
            for fam, kinds in (("checkpoint", KINDS[:2]), ("plain-offload", KINDS[2:])):
                if fam not in self.peak_offsets:
                    self._make_plan(self.planned_records, kinds)
                    if [(r.mode, r.actions) for r in self.plan.regions] != old:  # type: ignore[union-attr]
                        return
            self.tuning_left = 0
            self._settle(budget)
        elif [(r.mode, r.actions) for r in self.plan.regions] == old:  # type: ignore[union-attr]
            self.tuning_left = 0  # settled: the correction changes nothing
            self._settle(budget)

    def _settle(self, budget: int) -> None:
        """Tuning over: keep the fastest measured plan within the budget, else the one whose
        measured peak was least."""
        if not self.measured:
            return
        fits = [(p, m) for p, m in self.measured if m <= budget]
        if fits:
            best = min(fits, key=lambda pm: (pm[0].recompute_seconds + pm[0].transfer_seconds,
                                             pm[1]))
        else:
            best = min(self.measured, key=lambda pm: pm[1])
        if best[0] is not self.plan:
            self.plan = best[0]
            self._apply(self.plan)

    def _apply(self, plan: Plan) -> None:
        """Write a plan's decisions back into the records it was made from (for explain)."""
        for r, rp in zip(self.planned_records, plan.regions):
            r.mode = rp.mode
            for o in r.ops:
                a = rp.actions.get(o.index)
                if a is not None:
                    o.action, o.tier = a[1], a[2]

    def use_plan(self, plan: Plan) -> None:
        """Follow ``plan`` from the next step on, without learning or measuring (e.g. a plan
        tuned in another process on the same model, shapes and offload context: its regions
        are matched by call order, input shapes and context as a learned plan's are)."""
        with self._lock:
            self.plan = plan
            self.learning = False
            self.tuning_left = 0
            self.measure_peak = False

    def _start_peak(self, device: str) -> None:
        """Measure this step's peak if it learns or tunes the plan."""
        if not self.measure_peak or self._metering or not (self.learning or self.tuning_left):
            return
        if self._meter is None or self._meter.device != device:
            from ._peak import PeakMeter

            self._meter = PeakMeter(device)
        self._step_peak = None
        self._metering = self._meter.start()

    def end_of_backward(self) -> None:
        """The step's backward reached its first region: read the step's peak now (before the
        optimizer allocates its state)."""
        if self._metering and self._meter is not None and self._step_peak is None:
            self._step_peak = self._meter.read()

    def _budget_for(self, device: str) -> int:
        if self.budget_bytes is not None:
            return self.budget_bytes
        if device.startswith("cuda") and torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info(torch.device(device))
            return int(free * DEFAULT_BUDGET_SHARE)
        return int(psutil.virtual_memory().available * DEFAULT_BUDGET_SHARE)

    @property
    def peak_offset(self) -> Optional[int]:
        """The offset the current plan was made with (None: no measured peak)."""
        return self.plan.peak_offset if self.plan is not None and self.peak_offsets else None

    def _make_plan(self, recs: List[RegionRecord], kinds: Sequence[str] = KINDS) -> None:
        device = recs[0].device
        offsets: Optional[Dict[str, int]] = dict(self.peak_offsets)
        if not offsets:
            # nothing measured: the modeled peak alone, or (measure_peak=False) held bytes
            offsets = {"learning": 0} if self.measure_peak else None
        self.plan = make_plan(recs, self.machine(device), self._budget_for(device),
                              self.outside_bytes, peak_offset=offsets, kinds=kinds)
        self.planned_records = recs
        self.learning = False
        self.replans += 1

    # -- regions (called by spillover.recompute) --

    def note_backward(self) -> None:
        self._backward_seen = True

    def region_plan(self, key: Any, args: Sequence[Any], kwargs: Dict[str, Any], ctx: Any
                    ) -> Tuple[Any, Optional[RegionPlan]]:
        """(signature, plan for this region or None to learn). Starts a step when needed."""
        if not self.explicit_steps and self._backward_seen:
            self.begin_step()
        with self._lock:
            n = self._ordinals.get(key, 0)
            self._ordinals[key] = n + 1
            sig = (key, n, input_signature(args, kwargs), _ctx_signature(ctx))
            pos = self._pos
            self._pos += 1
            if pos == 0:
                self._start_peak(_device_of_args(args, kwargs))
                if self._metering:
                    _on_grad_of(args, self.end_of_backward)
            if self.learning or self.plan is None or self._dirty:
                return sig, None
            plans = self.plan.regions
            if pos < len(plans) and plans[pos].signature == sig:
                self._all_learned = False
                return sig, plans[pos]
            self._dirty = True  # shapes, order or context changed: learn again next step
            return sig, None

    def add_record(self, rec: RegionRecord) -> None:
        with self._lock:
            self._records.append(rec)

    def mark_stale(self) -> None:
        """The op sequence of a planned region differed from the learned one."""
        with self._lock:
            self._dirty = True


def _device_of_args(args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return str(a.device)
    return "cpu"


def _on_grad_of(args: Sequence[Any], fn: Callable[[], None]) -> None:
    """Call ``fn`` once backward has computed the gradient of the first region's input: the
    regions' backward is over."""
    t = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
    if t is None:
        return
    handle: List[Any] = []

    def hook(grad: torch.Tensor) -> None:
        if handle:
            handle.pop().remove()  # once: a leaf input would keep it for later steps
        fn()

    handle.append(t.register_hook(hook))


def default_budget_text(planner: Planner) -> str:
    if planner.budget_bytes is not None:
        return format_size(planner.budget_bytes)
    return f"{int(DEFAULT_BUDGET_SHARE * 100)}% of free memory"


def _planner_from(budget_bytes: Optional[int], machine: Optional[Machine], measure_peak: bool,
                  explicit_steps: bool) -> Planner:
    planner = Planner(budget_bytes, machine, measure_peak)
    planner.explicit_steps = explicit_steps
    return planner


# ---- explain ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Explanation:
    """What the last step decided, per op kind. ``rows`` are dicts; ``str()`` is a table."""

    policy: str
    rows: List[Dict[str, Any]]
    summary: Dict[str, Any]

    def __str__(self) -> str:
        s = self.summary
        if not s.get("regions") and not self.rows:
            # explain() right after wrap(): an empty table would read as "nothing is saved"
            return (f"spillover: policy {self.policy}; no step recorded yet. explain() shows "
                    "what the last training step decided: run one (a forward with gradients "
                    "enabled), then call spillover.explain again.")
        out = [f"spillover: policy {self.policy}; {s.get('regions', 0)} regions"]
        for k, v in s.items():
            if k != "regions" and v not in (None, ""):
                out.append(f"  {k}: {v}")
        head = ("op", "output", "n", "decision", "each", "total", "FLOP/B", "recompute",
                "transfer", "why")
        table = [head] + [
            (
                r["op"], r["output"], str(r["count"]), r["decision"], format_size(r["bytes"]),
                format_size(r["total_bytes"]), f"{r['flops_per_byte']:.0f}",
                _ms(r["recompute_s"]), _ms(r["transfer_s"]), r["why"],
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
        for row in table:
            cells = [c.ljust(w) if i in (0, 1, 3) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(row[:-1], widths))]
            out.append("  ".join(cells) + "  " + row[-1])
        return "\n".join(out)


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def explain_records(
    records: List[RegionRecord],
    policy: str,
    machine: Optional[Machine],
    plan: Optional[Plan] = None,
    outside_bytes: int = 0,
) -> Explanation:
    """Group a step's op records by (op, output shape, decision), with bytes and costs."""
    groups: Dict[Tuple[str, Tuple[int, ...], str, str], Dict[str, Any]] = {}
    for ri, r in enumerate(records):
        # A plan's records carry its decisions, not what the runtime then skips.
        dead = region_skipped(r.ops, lambda o: o.action) if r.mode == "checkpoint" else set()
        for o in r.ops:
            if o.bytes == 0 and o.forced == "view":
                continue  # views hold nothing and cost nothing
            if r.mode == "plain-keep":
                decision = "keep" if o.needed else "not held"
            elif r.mode == "plain-offload":
                decision = (f"offload-{o.tier or 'host'}" if o.needed and o.bytes
                            else "not held")
            elif o.after_stop or o.index in dead:
                decision = "not rerun"
            elif o.action == "offload" and o.tier:
                decision = f"offload-{o.tier}"
            else:
                decision = o.action
            if decision == "not held":
                why = "runs plainly; autograd does not save it"
            elif r.mode == "plain-offload":
                why = "runs plainly: the offload context takes what autograd saves"
            elif o.index in dead:
                why = SKIPPED_REASON
            else:
                why = o.reason or (
                    "after the last saved tensor: never rerun" if o.after_stop else o.forced or "")
            k = (o.name, o.shape, decision, why)
            g = groups.get(k)
            if g is None:
                sec = machine.op_seconds(o) if machine and decision == "recompute" else None
                link = None
                if machine and decision.startswith("offload"):
                    bw = machine.link_bytes_per_s
                    if o.tier == "nvme" and machine.nvme_bytes_per_s:
                        bw = machine.nvme_bytes_per_s
                    link = o.bytes / bw
                g = groups[k] = {
                    "op": o.name, "output": _shape_text(o.shape, o.dtype), "count": 0,
                    "decision": decision, "bytes": o.bytes, "total_bytes": 0,
                    "flops": o.flops, "flops_per_byte": o.flops_per_byte,
                    "recompute_s": sec, "transfer_s": link, "needed": o.needed, "why": why,
                    "first_index": (ri, o.index),
                }
            g["count"] += 1
            g["total_bytes"] += o.bytes
    rows = sorted(groups.values(), key=lambda g: g["first_index"])
    for g in rows:
        del g["first_index"]
    summary: Dict[str, Any] = {"regions": len(records)}
    if plan is not None:
        summary.update({
            "budget": format_size(plan.budget) if plan.budget is not None else "none",
            "no checkpointing holds": format_size(plan.plain_bytes),
            "full recompute holds": format_size(plan.full_bytes),
            "this plan holds": format_size(plan.planned_bytes)
            + ("" if plan.fits else " (over budget)"),
            "est. recompute per step": _ms(plan.recompute_seconds),
            "est. exposed transfer per step": _ms(plan.transfer_seconds),
            "note": plan.note,
        })
    else:
        modes = collections.Counter(r.mode for r in records)
        if modes.get("full"):
            summary["full"] = f"{modes['full']} regions save only their inputs, recompute all"
        if modes.get("plain"):
            summary["offload"] = (f"{modes['plain']} regions recompute nothing; what they save "
                                  "goes to the offload context (or stays)")
        held = outside_bytes + sum(r.held_bytes for r in records)
        summary["held after forward (regions)"] = format_size(held)
        if machine is not None:
            rc = sum(
                machine.op_seconds(o) for r in records if r.mode == "checkpoint"
                for o in r.ops if o.action == "recompute" and not o.after_stop
            )
            summary["est. recompute per step"] = _ms(rc)
    return Explanation(policy, rows, summary)


def _shape_text(shape: Tuple[int, ...], dtype: str) -> str:
    return f"{list(shape)} {dtype}" if shape else dtype
