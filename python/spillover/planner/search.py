"""The search: the plan for one step's records under a budget (a pure function of records,
rates, budget and measured offsets; no torch run). See the package docstring for the order in
which it frees bytes.

Note [near ties go to memory]
    Among the variants that fit, the fastest by the model wins, unless, on a CPU host, one that
    peaks lower is modeled within ``TIME_SLACK`` of the step's compute of it: then the lowest
    peak among those wins (on a GPU the fastest alone: nothing measured there says
    otherwise). The model's seconds are a few percent off on a CPU host, and in the direction
    that matters here: holding more is not free there (every large tensor is a fresh page-faulted
    mapping under glibc's default), while copies into the pool's pre-faulted blocks and NVMe
    writes overlap compute. Measured on the CPU GPT (6x512, seq 1024, batch 4, vocab 8192,
    sdpa, budget = torch's full checkpointing's peak, 448 MiB): the plan modeled fastest
    (checkpoint+offload, last block plain: 442 MiB, 0.13 s modeled) ran 4.66 s a step, the
    plain-offload variant (246 MiB, 0.27 s modeled, a 0.14 s difference on a 4.3 s step) is
    what the fixed NVMe mode runs, 4.37 s: auto was beaten on both. A lower peak is also room
    the rest of the step (the optimizer, a longer sequence next) can use.

Note [plain tails are not near ties]
    The exception: when the lower peak is the plain-offload variant, its variants that run the
    last regions plainly (and fit) are not near ties but the same step with less work. Their
    tails hold what forward already made, in the mappings it already faulted (no tensor is
    rebuilt in backward, none is allocated anew), and each region left plain is one region's
    saves not copied into the pool, not written, not read back and not copied out again. So
    among the plain-offload variants that fit, the fastest by the model wins. Measured on the
    CPU GPT (6x512, seq 1024, batch 4, vocab 8192, sdpa, budget = torch's full
    checkpointing's peak, 448 MiB, auto under a 32 MiB NVMe pool), against the fixed NVMe mode
    (64 MiB pool) of the same run: plain-offload (217 MiB) ran at 1.17x its time, the variant
    with the last two blocks plain (357 MiB) at 0.97x and 1.00x in two runs.

Note [plain backward]
    A region run plainly holds what autograd saved until its backward, and that backward
    computes gradients beside it. Measured on the CPU GPT (4x256, seq 512, explicit attention,
    32 MiB NVMe pool), a plan whose last block ran plainly peaked 17 MB (about one score
    tensor's gradient) above a model that counted only what the block holds, and the tuning
    steps swung between it and the plan without it. The largest output a plainly run region
    saves stands for the gradients being computed.

Note [the tail stays]
    On a device, an active offload context takes everything autograd saves, also what the
    model saves after its last region (the final norm, the head, the loss: ``tail_bytes``, part
    of ``outside_bytes``). Those tensors are packed last and backward needs them first, so their
    copies cannot hide: out after forward, back at once, each way at the link's rate. On the
    probe's 1B Llama (seq 4096, bf16) that is the loss's 0.5 GB of fp32 log-probabilities:
    about 10 ms of a 127 ms step that torch's full checkpointing, which keeps them, never
    pays. So each variant is also tried with the tail kept on the device (the context told
    at the last region's end, ``OffloadContext.keep_rest``): its bytes are held like a plain
    tail's, which backward frees first, and the shipped variants are charged the round trip.

Note [everything kept]
    Under a device's context a checkpoint plan still ships the region inputs and whatever the
    model saves between regions, and shipping holds memory of its own: the sources of copies
    in flight or landed up to the link's cap, the copies staged back ahead of backward. At a
    budget near torch's full checkpointing's peak those can be all the room there is: on the
    simulated H200 (GPT 4x128, seq 256) full recomputation under the Quick start's context
    peaked 6 % over torch's, so nothing auto could plan fit. So the checkpoint variants are
    also tried with nothing shipped (``KEPT``, costed as without a context: inputs and the rest
    held, no copies, no host time per offload): the plan's first region tells the context to
    keep everything from there to backward (``OffloadContext.keep_rest``), which makes the
    step torch's checkpointing plus the ops the budget lets it keep. Its own offset family
    ("kept"), as its backward holds no staged copies. The shipping variants are charged the
    host's time per offload for each region input they pack, which the kept one saves: where
    both measured within the budget at one modeled recompute time (the learning step's full
    recomputation and the kept one, on the test model under a calibration made under load),
    the settling kept the shipping one, whose peak then moved 7 % over with its copies'
    timing.

Note [a plain tail makes its cheap saves again]
    A region run plainly holds everything autograd saves in it, also what a cheap op made from
    tensors autograd holds anyway (Note [made again at unpack] in activations/rederive.py: a
    Llama block's SiLU output and product, its norms' outputs; ``OpRecord.rederived``). The
    regions run plainly at the end are also tried with those made again at unpack (", made
    again"): their bytes are not held, and each such op costs its recomputation. On the H200
    probe's 1B Llama that is 120 of the 440 MiB a layer holds, for four elementwise kernels,
    where checkpointing a layer frees 424 MiB for a replay of all its ops: on its estimate at
    0.7x no checkpointing's peak auto runs 10-11 layers plainly instead of 8, at 1.13-1.16x
    none's time instead of 1.24x. A region's record marks such ops (``OpRecord.rederived``:
    SiLU, GELU, a product whose inputs all need gradients, of at least ``REDERIVE_MIN_BYTES``),
    and the context decides at pack, from the autograd node. Only where the context makes them
    again (``rederive``, on by default), or with no context (``SPILLOVER_REDERIVE``).

Note [regions shipped whole]
    On a device a region can also run plainly with the offload context taking everything it
    saves ("plain-offload"): nothing rebuilt in backward, nothing held on the device, its
    cheap saves made again at unpack (Note [made again at unpack]), for the host's time per
    tensor and the link's bytes. All regions at once is link-bound (the probe's 1B Llama: 8.7
    GB each way at 54 GB/s against a 33 ms forward), and so is a run of them: the device
    holds the sources of copies in flight up to the link's cap (``copy_inflight_bytes``, 320
    MB by default) and then waits for them (Note [back-pressure] in rust/link/mod.rs). On the
    H200 estimate at 0.7x none's peak, its first 4 layers shipped whole (1.3 GB made in 8 ms)
    stalled the forward 15 ms, and their copies back, staged 4 entries ahead of each unpack,
    stalled the backward: the step ran 1.148x none, no faster than recomputing them.
    So the checkpoint variants are also tried with sets of regions shipped whole, chosen by
    the link's pace: for each count, the earliest regions such that what is still in flight
    at each region's end (each region drains the link for its forward's seconds) stays
    within the cap -- on the 1B Llama every fourth layer, up to 4. Their copies back start at
    the backward of a later region (``Plan.returns``: the nearest whose backward, with those
    between, outlasts the copies; a region's backward counted as ``BACKWARD_PER_FORWARD``
    times its forward), which stages them ahead (``OffloadContext.stage_next``), so they wait
    on the device no longer than the model says. The rest is planned as before around them,
    the plain tail made of the regions left. Charged: the host's time per shipped tensor, the
    remade ops, what the copies back cannot hide; held: the copies in flight beside what the
    forward holds (``Costs.floor``, checked against the budget without the backward's
    offset), and the returns beside what backward holds from where they start
    (``Costs.ret_term``). Only where the bytes stay in RAM: a device's host tier, or tier
    auto's growing pool (Note [RAM before the drive] in _growth.py). On the H200 estimate at
    0.7x none's peak: 'checkpoint, shipped whole: 0 4 8 12, last 11 plain, made again, tail
    kept', 1.11x none's time within the budget, where the best plan without it ran 1.13-1.16x.
    At full checkpointing's peak none fits: the gradients of every weight are alive at the
    end of backward, where the returns would land.

Note [a kept backward frees as it goes]
    The other families' model holds everything a plan keeps until the largest region is
    rebuilt. A kept plan's bytes do not wait that long: backward runs the regions last to
    first, and each region's backward frees what it kept (Note [a kept output goes with its
    use] in recompute/replay.py), so when region i is rebuilt it holds what the regions
    before it kept, its own rebuilt bytes (its kept saved outputs among them) and what it
    kept that autograd does not save; and backward's start holds everything kept with what
    backward adds first (the tail's gradient, counted as large as the tail). On the
    simulated H200 (GPT 4x256, seq 512, budget 0.7x none's peak) the old model let the kept
    family keep 3 ops a block where selective's decisions (the matmul outputs of the 4
    blocks) measured 133 MiB within a 146 MiB budget. So the kept variant plans against the
    peak of those terms (``Costs.staged``), freeing first the cheapest output whose bytes
    every binding term holds. Where the rebuilt terms tie and nothing lowers them all (the
    least-peak plan), it frees the cheapest of the rest all the same: a region rebuilt holds
    less than the model's bound on it (recomputed tensors come back as backward reaches
    them), one that kept its saved outputs all of them -- on the simulated H200 (GPT 4x128,
    seq 256) at torch's full checkpointing's peak, the last block keeping what autograd
    saves peaked 2.4 MiB (13 %) over the same block recomputed, both modeled alike. The
    learning step's offset, which the family borrows until its own is measured, was measured
    on full recomputation, where the two models agree.

Note [gradients as backward goes]
    A kept plan's backward peaks in two places: at its start, where the model's tail and loss
    run their backward beside everything forward kept, and while it rebuilds its regions,
    last to first. When region i is rebuilt the regions after it are done: their inputs and
    the model's tail freed, their parameters' gradients made (``RegionRecord.grad_bytes``:
    those of parameters that require one and have none at its forward -- none under gradient
    accumulation). The rebuilt regions' terms count them (``Costs._staged_terms``), so the
    first region rebuilt, beside every weight's gradient, is where the model puts the peak.
    One measured offset cannot correct both terms: on the estimate of the H200 probe's 1B
    Llama at full checkpointing's peak (2,249 MiB over the step's start), full recomputation
    peaked there, at its first region rebuilt; its start of backward (1,884 MiB, the loss's
    whole-vocabulary fp32 backward) was modeled 1,464, its last rebuild 1,380. The one
    offset (785 MiB) charged the start with what the gradients add at the end, nothing could
    be kept, and auto ran full recomputation (1.00x full's time). So the tuner also reads a
    kept plan's step at the start of backward, when the gradient of the output of the last
    region it rebuilds is made -- past the plain tail's backward, which the start's term
    models (``Plan.last_rebuilt``, ``Planner.watch_start_of_backward``; the meters' ``mark``;
    read at the last region instead, the simulated H200's SDPA GPT at 0.7x none's peak
    charged a 3-block plain tail's backward, 61 MB, to the rebuilt regions' offset and
    settled at 0.79x its budget, 0.90x full's time against 0.86x) -- and the family has two
    offsets: the start's (``KEPT_START``) from that reading, the rebuilt regions' from the
    step's peak -- an upper bound only where the start was the peak, and the least such bound
    is kept. The reading is the peak so far, forward's included (a device's counter cannot be
    reset under the user's own reading of it), so it counts for the start only where it
    passed the peak read as the last region's forward ended: on the simulated H200 (GPT
    4x256, explicit attention, full checkpointing's peak) the last block's forward, its
    scores and probabilities alive, was that peak, 16 MiB over the start's model, and taken
    for the start's offset it ruled out running the last block plainly, which saves those
    tensors rather than adding them (auto 1.00x full's time, 0.94x before). On the H200
    estimate the start passed it (the loss's backward): offsets of 419 and 249 MiB, and auto
    runs the last layer plainly with its cheap saves made again, within the budget, at 0.98x
    full's time.
    What bounds it there (``benches/python/estimate_h200.py --headroom``): the start of
    backward leaves 365 MiB under full's peak, and the replay is host-bound (Note [a replay's
    host time is the region's] in machine.py: 2.7 ms of dispatch a layer against 1.15 ms of
    kernels), so keeping outputs inside a checkpointed layer spares nothing; a layer run
    plainly spares 3.5 ms for 377 MiB, and issue 40's 0.95x would need two. An offset the
    family borrows before its own is measured was measured against the model without the
    backward's progress: it is moved by the two models' difference on full recomputation
    (``Costs.borrow_shift``), so the first kept plan is costed as before. The plain tails
    tried are bounded by the least offset they can be charged, the kept family's own where
    measured: bounded by the shipping checkpoint family's (1,719 MiB), the same model with
    its loss by ``spillover.loss.chunked_cross_entropy`` (start of backward 0.58 GiB, not
    1.84) was never tried past one plain layer (0.97x full's time); now four, 0.89x.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..config import format_size, rederive_enabled
from .cost import Costs
from .machine import Machine
from .records import RegionRecord, host_is_device
from .variants import Greedy, PlainOffload
from .variants import shipped_sets as _shipped_sets

# ---- the plan --------------------------------------------------------------------------------


@dataclasses.dataclass
class RegionPlan:
    signature: Any
    mode: str  # checkpoint | plain-keep | plain-offload
    actions: Dict[int, Tuple[str, str, str]]  # index -> (op name, action, tier)
    #: the recorded run it was planned from (its ops' names, readers and forced reasons):
    #: Note [a forward that follows its record] in recompute/follow.py
    record: Optional[RegionRecord] = dataclasses.field(default=None, compare=False, repr=False)
    #: Note [a plain tail makes its cheap saves again]: a "plain-keep" region whose saves that
    #: can be made again at unpack are not held
    remake: bool = False

    @functools.cached_property
    def recomputes_all(self) -> bool:
        """A checkpointed region that saves none of its op outputs: torch's full checkpointing
        (Note [a replay with nothing to answer] in recompute/modes.py)."""
        return self.mode == "checkpoint" and all(
            a[1] == "recompute" for a in self.actions.values())


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
    #: the cap on the loss region's chunk (Note [loss chunk under a budget] in
    #: loss/chunked.py): None when the speed rule's chunk fits
    loss_cap: Optional[int] = None
    #: Note [the tail stays]: the offload context keeps on the device what the model saves
    #: after its last region
    keep_tail: bool = False
    #: Note [everything kept]: ... and everything it saves from its first region on
    keep_all: bool = False
    #: Note [regions shipped whole]: region index -> bytes its backward's start brings back
    #: (the saves of a region shipped whole before it)
    returns: Dict[int, int] = dataclasses.field(default_factory=dict)
    #: Note [gradients as backward goes]: a kept plan's modeled peaks at the start of backward
    #: and over its rebuilt regions (before their offsets), which the tuner measures apart
    terms: Optional[Tuple[int, int]] = None

    @functools.cached_property
    def last_rebuilt(self) -> Optional[RegionPlan]:
        """The last region backward rebuilds: its output's gradient ends the plain tail's
        backward, the start of backward's term (Note [gradients as backward goes])."""
        return next((rp for rp in reversed(self.regions) if rp.mode == "checkpoint"), None)




#: Note [near ties go to memory]: modeled seconds within this share of the step's modeled
#: compute count as a tie, which the lower peak wins.
TIME_SLACK = 0.05

#: The variants make_plan tries for the regions not run plainly at the end.
KINDS = ("checkpoint", "checkpoint+offload", "plain-offload")


#: Note [everything kept]: the checkpoint variant under a device's context that keeps on the
#: device all the context would take (region inputs, the tail), as torch's checkpointing does
KEPT = "checkpoint, all kept"

#: Note [gradients as backward goes]: the key of the kept family's offset at the start of
#: backward in the offsets (its rebuilt regions' is under "kept")
KEPT_START = "kept, start of backward"


def family(kind: str) -> str:
    """Variants whose backward peaks the same offset corrects: regions rebuilt at once in
    backward ("checkpoint"), the same with nothing shipped ("kept": no copies in flight or
    staged), reloaded one by one ("plain-offload"), or all plain."""
    if kind.startswith("plain-offload"):
        return "plain-offload"
    if kind.startswith(KEPT):
        return "kept"
    return "plain" if kind == "plain" else "checkpoint"


def make_plan(
    regions: List[RegionRecord],
    machine: Machine,
    budget: Optional[int],
    outside_bytes: int = 0,
    peak_offset: Optional[int | Dict[str, int]] = None,
    kinds: Sequence[str] = KINDS,
    loss_bytes: int = 0,
    loss_min_bytes: int = 0,
    tail_bytes: int = 0,
    keep_tail: Optional[bool] = None,
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
    taking what they save ("plain-offload"). ``loss_bytes``: what the loss region adds when
    backward starts (Note [loss transient] in spillover/loss/chunked.py), counted in peak budgets;
    ``loss_min_bytes`` (when smaller) what it adds with the smallest chunk: a plan that does
    not fit with the first is made with the second, its slack given back to the chunk
    (``Plan.loss_cap``, Note [loss chunk under a budget] there). ``tail_bytes``: what the model
    saves after its last region (Note [the tail stays]); ``keep_tail`` True or False tries only
    the variants that keep it or ship it (None: both).
    """
    if (peak_offset is not None and budget is not None
            and 0 < loss_min_bytes < loss_bytes):
        return _fit_loss(regions, machine, budget, outside_bytes, peak_offset, kinds,
                         loss_bytes, loss_min_bytes, tail_bytes, keep_tail)
    plain = outside_bytes + sum(r.input_bytes + r.needed_bytes for r in regions)
    full = outside_bytes + sum(r.input_bytes for r in regions)
    peak = peak_offset is not None

    def off(kind: str) -> int:
        if isinstance(peak_offset, dict):
            return peak_offset.get(family(kind), peak_offset.get("learning", 0))
        return peak_offset or 0

    def borrowed(kind: str) -> bool:
        """``kind``'s family has no offset of its own: it borrows the learning step's."""
        return isinstance(peak_offset, dict) and family(kind) not in peak_offset

    def start_offset() -> Optional[int]:
        """Note [gradients as backward goes]: the kept family's offset at the start of
        backward, where measured apart from its rebuilt regions'."""
        if isinstance(peak_offset, dict) and "kept" in peak_offset:
            return peak_offset.get(KEPT_START)
        return None

    # On a CPU host the context's pool is this same memory, faulted in whole: a step run plainly
    # under it peaks with the pool on top (the variants below count it as they charge it).
    host_pool = (int(regions[0].offload["pool_bytes"]) if peak and regions
                 and regions[0].offload and host_is_device(regions[0]) else 0)

    def grad_of(tail: List[RegionRecord]) -> int:
        """What the backward of regions run plainly adds (Note [plain backward]), or the loss
        region's transient before it, whichever is more."""
        if not peak:
            return 0
        return max(loss_bytes, max((o.bytes for r in tail for o in r.ops if o.needed),
                                   default=0))

    def all_plain(fits: bool, note: str = "") -> Plan:
        for r in regions:
            r.mode = "plain-keep"
            for o in r.ops:
                o.action, o.tier = "keep", ""
                o.reason = "everything fits the budget" if fits else "the least peak there is"
        return Plan(
            [RegionPlan(r.signature, "plain-keep", {}) for r in regions],
            budget, plain, full, plain, 0.0, 0.0, fits, note,
            model_peak=plain + host_pool + grad_of(regions),
            peak_offset=off("plain") if peak else None, variant="plain",
            # Note [the tail stays]: everything fits, the tail too (it counts in ``plain``)
            keep_tail=(fits and bool(tail_bytes) and keep_tail is not False and bool(regions)
                       and regions[0].offload is not None and not host_is_device(regions[0])),
        )

    if not regions or budget is None \
            or plain + host_pool + grad_of(regions) + off("plain") <= budget:
        return all_plain(True)
    ctx = regions[0].offload
    device_is_host = host_is_device(regions[0])
    # The last k regions run plainly (they are needed first in backward and cost nothing to
    # rebuild); the others are planned op by op in what remains of the budget, with and
    # without offloading op outputs, or all run plainly with the context taking what they save.
    variants: List[Greedy] = []
    n = len(regions)
    # Note [the tail stays]: on a device under a context, with the tail shipped and kept
    tails: Tuple[bool, ...] = (False,)
    if tail_bytes and ctx is not None and not device_is_host:
        tails = (False, True) if keep_tail is None else (keep_tail,)
    # Note [a plain tail makes its cheap saves again]: each tail also with them made again
    rederive = ctx.get("rederive", True) if ctx is not None else rederive_enabled()
    remakes = (False, True) if (any(r.rederived_bytes for r in regions)
                                and rederive) else (False,)
    # Note [regions shipped whole]: each set of regions the link can take whole, beside none
    for shipped in _shipped_sets(regions, machine, ctx, device_is_host, rederive,
                                 "checkpoint" in kinds):
        rest = [i for i in range(n) if i not in shipped]
        _vary(variants, regions, rest, shipped, machine, kinds, ctx, device_is_host, tails,
              remakes, rederive, budget, outside_bytes, tail_bytes, peak, off, grad_of,
              borrowed, start_offset)
    if not variants:  # none of ``kinds`` can run here (e.g. plain-offload on a host tier)
        return make_plan(regions, machine, budget, outside_bytes, peak_offset,
                         loss_bytes=loss_bytes, tail_bytes=tail_bytes, keep_tail=keep_tail)
    def at_peak(v: Greedy) -> int:
        return max(v.peak + off(v.kind) - v.offset_shift, v.floor)

    fitting = [v for v in variants if at_peak(v) <= budget]
    if fitting:  # Note [near ties go to memory]: on a CPU host
        fastest = min(v.recompute + v.transfer for v in fitting)
        slack = TIME_SLACK * 3 * sum(machine.op_seconds(o) for r in regions
                                     for o in r.ops) if device_is_host else 0.0
        near = [v for v in fitting if v.recompute + v.transfer <= fastest + slack]
        best = min(near, key=lambda v: (at_peak(v), v.recompute + v.transfer))
        if family(best.kind) == "plain-offload":  # Note [plain tails are not near ties]
            best = min((v for v in fitting if family(v.kind) == "plain-offload"),
                       key=lambda v: (v.recompute + v.transfer, at_peak(v)))
    else:
        best = min(variants, key=at_peak)
    least = plain + host_pool + grad_of(regions) + off("plain")
    if not fitting and least < at_peak(best):
        # Nothing fits, and the measured offsets say running plainly peaks least.
        return all_plain(False, f"the budget ({format_size(budget)}) is below the least peak "
                         f"there is ({format_size(least)})")
    for ri, r in enumerate(regions):
        r.mode = best.modes[ri]
        for o in r.ops:
            o.action, o.tier, o.reason = best.ops[(ri, o.index)]
    note = ""
    if not fitting:
        what = "peak" if peak else "least this plan can hold"
        note = (
            f"the budget ({format_size(budget)}) is below the {what} this plan reaches "
            f"({format_size(at_peak(best))}): everything that can be freed is"
        )
        if ctx is not None and device_is_host:
            note += (f"; the offload context's {format_size(ctx['pool_bytes'])} pool is this "
                     "host's memory and counts in full: a smaller pool leaves the step more")
    plans = [
        RegionPlan(r.signature, r.mode, {o.index: (o.name, o.action, o.tier) for o in r.ops},
                   record=r, remake=ri in best.remade)
        for ri, r in enumerate(regions)
    ]
    return Plan(plans, budget, plain, full, best.mem, best.recompute, best.transfer,
                bool(fitting), note, model_peak=best.peak,
                peak_offset=off(best.kind) - best.offset_shift if peak else None,
                variant=best.kind, keep_tail=best.keep_tail, keep_all=best.keep_all,
                returns=dict(best.returns),
                terms=((best.start_term(), best.rebuild_term()) if best.staged else None))


def _vary(variants: List[Greedy], regions: List[RegionRecord], rest: List[int],
          shipped: Tuple[int, ...], machine: Machine, kinds: Sequence[str],
          ctx: Optional[Dict[str, Any]], device_is_host: bool, tails: Tuple[bool, ...],
          remakes: Tuple[bool, ...], rederive: bool, budget: int, outside_bytes: int,
          tail_bytes: int, peak: bool, off: Any, grad_of: Any, borrowed: Any,
          start_offset: Any) -> None:
    """The variants of :func:`make_plan` over the regions ``rest`` (indices, in call order),
    the regions ``shipped`` run plainly under the context (Note [regions shipped whole]): the
    last k of ``rest`` run plainly (each k, with and without their cheap saves made again),
    the others planned by each kind."""
    m = len(rest)
    ks = range(m + 1) if shipped else range(m)  # (without shipped regions: all plain fits)
    for k, remake in ((j, rm) for j in ks for rm in (remakes if j else (False,))):
        tail = [regions[i] for i in rest[m - k:]]
        plain_tail = sum(r.input_bytes + r.needed_bytes - (r.rederived_bytes if remake else 0)
                         for r in tail)
        # a plain tail over the budget with the least offset it can be charged: the kept
        # family's own where measured (Note [gradients as backward goes]: the start's)
        over = bool(k) and plain_tail + off("checkpoint") > budget
        kept_off = min(off(KEPT), start_offset() or off(KEPT)) if not borrowed(KEPT) else None
        over_kept = over if kept_off is None else bool(k) and plain_tail + kept_off > budget
        if over and over_kept:
            continue
        tail_name = (f", last {k} plain" + (", made again" if remake else "")) if k else ""
        head = [regions[i] for i in rest[: m - k]]
        tail_grad = grad_of(tail)
        tried = [("checkpoint", False)] if "checkpoint" in kinds and not over else []
        if ctx is not None and not shipped:
            tried += [(kd, True) for kd in ("checkpoint+offload", "plain-offload")
                      if kd in kinds and not over]
            if not device_is_host and ("checkpoint" in kinds or KEPT in kinds) \
                    and not over_kept:
                tried.append((KEPT, False))  # Note [everything kept]
        for (kind, use_offload), keep in ((t, kp) for t in tried for kp in tails):
            if kind == KEPT and keep != tails[-1]:
                continue  # one variant: its tail stays whatever ``keep`` says
            cls = PlainOffload if kind == "plain-offload" else Greedy
            # the kept variant is costed as without a context: inputs and the rest counted
            g = cls(head, machine, 0, outside_bytes, None if kind == KEPT else ctx,
                    device_is_host, use_offload)
            if kind == "plain-offload" and not g.use_offload:
                continue  # the context frees nothing here (a CPU host's host tier)
            g.bwd = g.rebuilt_bytes() if peak else 0
            # (the kept variant's tail is in ``outside_bytes``, counted as held)
            held = plain_tail + (tail_bytes if keep and kind != KEPT else 0)
            # The plain tail's backward comes first and frees it before the others rebuild.
            g.budget = budget - off(kind) - (max(held + tail_grad, g.bwd) if peak else held)
            if kind == KEPT and peak:  # Note [a kept backward frees as it goes]
                g.staged, g.start_grad = True, tail_bytes
                g.pre_held = held + max(tail_grad, tail_bytes)
                # Note [gradients as backward goes]
                g.model_tail, g.tail_grads = tail_bytes, sum(r.grad_bytes for r in tail)
                start_off = start_offset()
                if start_off is None:  # borrowed, or one offset for both terms
                    if borrowed(kind):
                        g.offset_shift = g.borrow_shift()
                    start_off = off(kind) - g.offset_shift
                g.start_extra = start_off - (off(kind) - g.offset_shift)
                g.budget = budget - off(kind) + g.offset_shift
            g.run()
            g.add_plain_tail(tail, held, tail_grad, remake=remake)
            if kind == KEPT:
                g.keep_tail = g.keep_all = True
                g.kind = kind + tail_name
                variants.append(g)
                continue
            g.kind = kind
            if shipped:
                g.place_shipped(shipped, regions, rest, rederive)
                g.kind += ", shipped whole: " + " ".join(map(str, shipped))
            if tails != (False,) and not keep:
                g.transfer += g.tail_seconds(tail_bytes)
            if ctx is not None and not device_is_host:
                # Note [everything kept]: the context packs each region's input, at the host's
                # time per offload (the kept variant does not)
                g.transfer += machine.host_seconds_per_offload * sum(
                    1 for r in head if r.input_bytes)
            g.keep_tail = keep
            g.kind += tail_name + (", tail kept" if keep else "")
            variants.append(g)


def _fit_loss(regions: List[RegionRecord], machine: Machine, budget: int, outside_bytes: int,
              peak_offset: int | Dict[str, int], kinds: Sequence[str], loss_bytes: int,
              loss_min_bytes: int, tail_bytes: int, keep_tail: Optional[bool]) -> Plan:
    """Note [loss chunk under a budget] (loss/chunked.py): the plan with the speed rule's chunk
    when it fits; else the plan with the smallest chunk, whose slack goes back to the chunk."""
    plan = make_plan(regions, machine, budget, outside_bytes, peak_offset, kinds, loss_bytes,
                     tail_bytes=tail_bytes, keep_tail=keep_tail)
    if plan.fits:
        return plan
    small = make_plan(regions, machine, budget, outside_bytes, peak_offset, kinds,
                      loss_min_bytes, tail_bytes=tail_bytes, keep_tail=keep_tail)
    slack = budget - small.model_peak - (small.peak_offset or 0) if small.fits else 0
    small.loss_cap = min(loss_bytes, loss_min_bytes + slack)
    # the chunk's growth counted in full (it adds at most that to the peak)
    small.model_peak += small.loss_cap - loss_min_bytes
    return small


#: The fixed modes the planner can choose among (what ``wrap(policy=...)`` runs without it):
#: every region run plainly ("none"), recomputed in full ("full"), or run plainly under the
#: NVMe or host tier ("offload", where the context frees memory).
FIXED_MODES = ("none", "full", "offload")


def fixed_modes(regions: List[RegionRecord], machine: Machine, outside_bytes: int = 0,
                peak_offset: Optional[Dict[str, int]] = None,
                loss_bytes: int = 0) -> Dict[str, Tuple[int, float]]:
    """The modeled (peak + offset, seconds per step) of each fixed mode that can run here, for
    the records of one step, counted as :func:`make_plan` counts its variants: a plan it makes
    should not be beaten on both by one of them. Pure: the records are not changed."""
    import copy

    offsets = dict(peak_offset or {})
    offsets.setdefault("learning", 0)
    out: Dict[str, Tuple[int, float]] = {}
    for mode, kinds, budget in (("none", KINDS, None), ("full", ("checkpoint",), 0),
                                ("offload", ("plain-offload",), 0)):
        recs = copy.deepcopy(regions)
        if mode == "offload":
            ctx, host = recs[0].offload if recs else None, bool(recs) and host_is_device(recs[0])
            if not PlainOffload(recs, machine, 0, outside_bytes, ctx, host, True).use_offload:
                continue  # no context, or one that frees nothing here
        if mode == "none":
            plan = make_plan(recs, machine, 1 << 62, outside_bytes, offsets,
                             loss_bytes=loss_bytes)
        else:
            plan = make_plan(recs, machine, budget, outside_bytes, offsets, kinds=kinds,
                             loss_bytes=loss_bytes)
        out[mode] = (plan.model_peak + (plan.peak_offset or 0),
                     plan.recompute_seconds + plan.transfer_seconds)
    return out


def learning_peak(regions: List[RegionRecord], machine: Machine, outside_bytes: int = 0,
                  kind: str = "checkpoint", loss_bytes: int = 0) -> int:
    """The modeled peak of a learning step, counted as the plans' are (Note [peak feedback]):
    inputs and the rest of the model held (where the context puts them), + the largest region
    rebuilt (``kind`` "checkpoint": every region recomputed in full) or the largest tensors
    reloaded one by one ("plain-offload": every region run plainly under the NVMe context,
    Note [learning frugally])."""
    if not regions:
        return outside_bytes
    ctx, host = regions[0].offload, host_is_device(regions[0])
    if kind == "plain-offload":
        g: Costs = PlainOffload(regions, machine, 0, outside_bytes, ctx, host, True).run()
    else:
        g = Costs(regions, machine, 0, outside_bytes, ctx, host, False)
        g.clear_kept()
    g.bwd = g.rebuilt_bytes()
    g.tail_grad = loss_bytes  # no plain tail: what backward adds first is the loss's
    return g.peak
