"""The online tuner: :class:`Planner`, the ``"auto"`` policy. It learns a step, plans it, and
corrects the plan by the peaks the first planned steps reach (Note [peak feedback]); the
trial steps it runs for what its model cannot tell are in :mod:`.trials`.

Note [peak feedback]
    The budget is the step's peak (forward and backward), not what it holds after forward. The
    model adds to what a plan holds after forward the largest region rebuilt in backward
    (recomputation brings back everything autograd saved in a region before its backward
    starts, Note [recompute transients] in cost.py; a region run plainly under the context
    reloads tensors one by one), but it cannot see gradients being computed, copies in flight,
    tensors under the minimum offload size or pieces being assembled. So the learning step has
    its peak measured (:mod:`spillover._peak`) and the difference from its model becomes the
    offset of its variant family (:func:`~spillover.planner.search.family`), and the offset
    of the families not measured yet. The first planned steps (``TUNING_STEPS``) are measured
    too: a plan over the budget, or more than ``SLACK`` under it, re-plans with the offset it
    showed; a plan moves up (holds more) only where its model plus a measured offset predicts
    it fits. After them the fastest measured plan within the budget is kept (else the one with
    the least peak). With the same calibration and the same measured peaks the plans are the
    same.

Note [learning frugally]
    The budget holds from the first step: the learning step runs the most frugal variant the
    offload context allows, and the plans after it only move up from there. Without a context,
    or under one that keeps what it takes in memory the budget counts, that is every region
    recomputed in full. Under the NVMe tier it is every region run plainly with the context
    taking what autograd saves (the "plain-offload" variant): backward reloads tensors one by
    one instead of rebuilding a region at once, so it peaks lower than full recomputation
    under the same context (measured on the CPU GPT, 6x512, seq 512, 64 MiB pool: 209 vs
    253 MiB) and recomputes nothing. Not where the context's takings are kept in place (Note
    [a CPU host ships nothing] in records.py). Either way the ops of each region are recorded as it
    runs (bytes, FLOPs, what autograd saves), which is all the search needs.

Note [the learning step is a candidate]
    A learning step that recomputed every region and fit the budget is a measured plan like
    the tuning steps': its plan (the checkpoint family's least-peak one, tail shipped) joins
    them, and the settling keeps it when nothing faster measured within the budget. Before,
    only plans followed after it were candidates: on the simulated H200 (GPT 4x256, seq 512,
    budget torch's full checkpointing's peak, 72 MiB) the learning step measured 71 MiB, the
    three tuning steps' plans, each made within the budget by its model and offsets, measured
    94, 120 and 140 MiB (link-bound copies and staging the model does not see), and auto
    settled on the least of those, 30 % over a budget a step had already met.

Note [a traced step is timed]
    The settling keeps the fastest measured plan within the budget by the plans' modeled
    seconds, and the kept trial (Note [a kept trial] in trials.py) runs only where the kept
    plan is modeled faster. On a trace (``spillover.estimate``, the seeded plan) the meter
    also times each step it reads, on the same clocks the estimate reports, and those
    seconds decide instead: the settling takes the fastest step, and the kept trial runs where
    its worst case fits whatever the model says. The model counts an offload hidden while the
    forward's total compute covers the link's total time; the trace sees the copy cap's
    back-pressure and copies back arriving late. On the estimate of the H200 probe's 1B Llama
    at full checkpointing's peak, with the device's host time per offload set to 0, auto had
    settled on a plan shipping 112 MiB of norm and rotary outputs per layer, modeled with no
    exposed transfer and traced at 18.8 ms of stalls a step: 1.13x full's time. A device's
    meter times nothing, and a real run goes on as before.

Note [planner step boundaries]
    ``wrap`` starts a step at each forward of the wrapped model. A standalone
    ``checkpoint(..., policy=planner)`` starts one when a region runs after a backward has
    reached a region of the current step (seen by a hook on the region's output).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import psutil
import torch

from ..config import Config, format_size
from .machine import Machine, measured_scale
from .metering import Metering, _device_of_args
from .records import (
    RegionRecord,
    _ctx_signature,
    _sim_link,
    input_signature,
    keeps_on_host,
    output_tensors,
    sim_of,
)
from .search import KEPT_START, KINDS, Plan, RegionPlan, family, learning_peak, make_plan
from .trials import EXPLORING, EXPLORING_KEPT, EXPLORING_TAIL, LEARNED, Trials

__all__ = ["Planner", "Phase", "EXPLORING", "EXPLORING_KEPT", "EXPLORING_TAIL", "LEARNED"]

#: Share of free memory the planner may use when no budget is given.
DEFAULT_BUDGET_SHARE = 0.5


class Phase(enum.Enum):
    """Where a :class:`Planner` stands (Note [peak feedback])."""

    #: no plan: the next step records every region, run the most frugal way it knows (Note
    #: [learning frugally]) and measured
    LEARNING = "learning"
    #: planned: the next steps are measured and may re-plan (``tuning_left`` of them)
    TUNING = "tuning"
    #: the plan is final: followed without measuring
    SETTLED = "settled"


class Planner(Trials, Metering):
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
        seed_from_trace: under ``wrap``, plan the first step from a trace of it on fake tensors
            instead of a learning step (Note [seeded plan] in spillover/estimate/seed.py).
    """

    #: planned steps whose measured peak may still re-plan (Note [peak feedback])
    TUNING_STEPS = 3
    #: a measured peak within this share under the budget is close enough: no re-plan
    SLACK = 0.05

    def __init__(self, budget_bytes: Optional[int | str] = None, machine: Optional[Machine] = None,
                 measure_peak: bool = True, seed_from_trace: bool = True):
        cfg = Config.load()
        if budget_bytes is not None:
            cfg = cfg.replace(device_budget_bytes=budget_bytes)
        self.budget_bytes: Optional[int] = cfg.device_budget_bytes
        self._machine = machine
        self._lock = threading.Lock()
        self.plan: Optional[Plan] = None
        self.phase = Phase.LEARNING
        self.explicit_steps = False  # set by wrap: it calls begin_step() itself
        self.steps = 0
        self.replans = 0
        #: steps run as learning steps (Note [learning frugally]); 0 where a seeded plan was
        #: followed from the first step (Note [seeded plan] in spillover/estimate/seed.py)
        self.learning_steps = 0
        self._records: List[RegionRecord] = []  # this step's
        self.last_records: List[RegionRecord] = []  # the last finished step's
        self.planned_records: List[RegionRecord] = []  # the records the plan was made from
        self._ordinals: Dict[Any, int] = {}
        self._pos = 0
        self._dirty = False
        self._all_learned = True
        self._backward_seen = False
        self.outside_bytes = 0
        # what the loss region adds when backward starts (Note [loss transient], loss/chunked.py)
        self.loss_bytes = 0
        # ... and with the smallest chunk a budget may shrink it to (Note [loss chunk under a
        # budget], loss/chunked.py)
        self.loss_min_bytes = 0
        # what the model saves after its last region (Note [the tail stays] in search.py)
        self.tail_bytes = 0
        # Note [peak feedback]
        self.measure_peak = measure_peak
        self._meter: Optional[Any] = None
        self._step_peak: Optional[int] = None  # this step's, read at the end of its backward
        self._step_ctx: Optional[weakref.ref[Any]] = None  # Note [a CPU step's peak is ...]
        self._step_pool: Optional[int] = None
        self._metering = False
        #: measured peak - modeled peak per variant family ("learning": the learning step's)
        self.peak_offsets: Dict[str, int] = {}
        self.tuning_left = 0  # measured steps left in Phase.TUNING
        self.measured: List[Tuple[Plan, int]] = []  # (plan, its measured peak), while tuning
        #: id(plan) -> the seconds its step took, where the meter times steps (Note [a traced
        #: step is timed])
        self.measured_seconds: Dict[int, float] = {}
        self.last_peak: Optional[int] = None
        self.last_seconds: Optional[float] = None
        #: Note [gradients as backward goes] (search.py): a kept plan's step read at the end of
        #: its regions' forward ("regions") and at the start of backward ("start"), and those
        #: readings of the last step metered
        self._reads: Dict[str, Optional[int]] = {}
        self.last_marks: Dict[str, int] = {}
        #: Note [seeded plan] (spillover/estimate/seed.py): whether the first step traces the
        #: step on fake tensors and follows the plan made there; what that gave (or why not)
        self.seed_from_trace = seed_from_trace
        self.seeded: Optional[Dict[str, Any]] = None
        self.seed_note = ""
        self.first_peaks: List[int] = []  # the measured peaks of the steps after a seed
        #: Note [measured compute] (machine.py): the learning step's measured / modeled compute
        self.compute_scale = 1.0

    def __reduce__(self) -> Any:
        # Pickled with a wrapped model (Note [pickling a wrapped model] in recompute/blocks.py):
        # the settings travel; what it learned and planned is this machine's and is learned
        # again in the loaded model's first step.
        return (_planner_from, (self.budget_bytes, self._machine, self.measure_peak,
                                self.explicit_steps, self.seed_from_trace))

    # -- steps --

    def machine(self, device: str) -> Machine:
        if self._machine is not None:
            return self._machine
        from . import machine_for  # the package's cache (tests replace it)

        return machine_for(device)

    def machine_of(self, recs: Sequence[RegionRecord]) -> Machine:
        """The machine the step of ``recs`` ran on: the simulated device's where its context
        has one (Note [the simulated device is a device] in records.py), its compute scaled
        by what the learning step measured (Note [measured compute] in machine.py)."""
        m = self.machine(recs[0].device).simulated(sim_of(recs[0]))
        if self.compute_scale != 1.0:
            m = dataclasses.replace(m, compute_scale=self.compute_scale)
        return m

    @property
    def learning(self) -> bool:
        """True while the next step learns (no plan to follow)."""
        return self.phase is Phase.LEARNING

    @property
    def tuned(self) -> bool:
        """True once the plan is final: planned, and no longer corrected by measured peaks."""
        return self.plan is not None and self.phase is Phase.SETTLED

    def learns_plainly(self, ctx: Any, kept_here: bool) -> bool:
        """Note [learning frugally]: whether a learning run of a region under ``ctx`` runs
        plainly, the context taking what autograd saves, instead of recomputed in full: under
        the NVMe tier, unless the context keeps in place what it would take (``kept_here``:
        Note [a CPU host ships nothing] in records.py)."""
        return ctx is not None and bool(ctx.nvme) and not kept_here

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
                self.learning_steps += 1
                # Note [learning frugally]: how the learning step ran is its variant family
                kind = ("plain-offload" if all(r.mode == "plain-offload" for r in recs)
                        else "checkpoint")
                self.peak_offsets = {}
                # Note [measured compute] (machine.py): not with a machine given (its figures
                # are the ones to plan with)
                self.compute_scale = (measured_scale(self.machine(recs[0].device), recs)
                                      if self._machine is None else 1.0)
                if peak is not None:
                    off = peak - learning_peak(recs, self.machine_of(recs),
                                               self.outside_bytes, kind, self.loss_bytes)
                    self.peak_offsets[family(kind)] = off
                    self.peak_offsets["learning"] = off  # for the families not measured yet
                ran = self._learned_plan(recs, kind, peak)
                self._make_plan(recs)
                if kind == "plain-offload" and self.peak_offsets:
                    self._explore_checkpoint(recs)
                self.tuning_left = self.TUNING_STEPS if self.peak_offsets else 0
                self.phase = Phase.TUNING if self.tuning_left else Phase.SETTLED
                self.measured = [ran] if ran is not None else []
                self.measured_seconds = {}
                if self.measured and self.last_seconds is not None:
                    self.measured_seconds[id(self.measured[0][0])] = self.last_seconds
            elif ran and self._dirty:  # part of the step followed a plan that no longer fits
                self.phase = Phase.LEARNING
                self.plan = None
            elif ran and self.plan is not None and peak is not None \
                    and self.phase is Phase.TUNING:
                if self.seeded is not None:
                    self.first_peaks.append(peak)
                self._tune(peak)
            self._all_learned = True
            self._records = []
            self._ordinals = {}
            self._pos = 0
            self._dirty = False
            self._backward_seen = False
            self.steps += 1
            self._metering = False

    def _learned_plan(self, recs: List[RegionRecord], kind: str, peak: Optional[int]
                      ) -> Optional[Tuple[Plan, int]]:
        """Note [the learning step is a candidate]: the plan of what the learning step ran
        (every region recomputed, the tail shipped), with its measured peak, when it fit."""
        if kind != "checkpoint" or peak is None:
            return None
        budget = self._budget_for(recs[0].device)
        if peak > budget:
            return None
        plan = make_plan(recs, self.machine_of(recs), 0, self.outside_bytes,
                         peak_offset=dict(self.peak_offsets), kinds=("checkpoint",),
                         loss_bytes=self.loss_bytes, tail_bytes=self.tail_bytes,
                         keep_tail=False)  # budget 0: every region recomputed, as it ran
        if family(plan.variant) != "checkpoint":  # the offsets say running plainly peaks less
            return None
        plan.budget, plan.note, plan.fits = budget, LEARNED, True
        return plan, peak

    def _tune(self, peak: int) -> None:
        """Note [peak feedback]: correct the model by the peak the planned step reached."""
        plan = self.plan
        assert plan is not None
        self.measured.append((plan, peak))
        if self.last_seconds is not None:
            self.measured_seconds[id(plan)] = self.last_seconds
        self.tuning_left -= 1
        budget = self._budget_for(self.planned_records[0].device)
        if plan.note == EXPLORING_TAIL:  # Note [a tail's trial] (trials.py): its peak decides
            self._settle(budget)
            return
        self._measured_offsets(plan, peak)
        if plan.note in (EXPLORING, EXPLORING_KEPT) and self.tuning_left <= 0:
            # Note [a family's own offset] (trials.py): the offset a trial measured is for the
            # re-plan, which gets the step it needs
            self.tuning_left = 1
        if peak > budget and self.tuning_left > 0 and self._explore_kept(budget):
            return
        # Note [a family's own offset] (trials.py): a trial that fits is re-planned all the same
        close = (budget * (1 - self.SLACK) <= peak <= budget
                 and plan.note not in (EXPLORING, EXPLORING_KEPT))
        if close or self.tuning_left <= 0:
            if peak <= budget and self.tuning_left > 0 and (
                    self._try_kept(budget, peak) or self._try_tail(budget)):
                return
            self._settle(budget)
            return
        old = [(r.mode, r.actions) for r in plan.regions]
        self._make_plan(self.planned_records)
        if [(r.mode, r.actions) for r in self.plan.regions] == old and peak > budget:  # type: ignore[union-attr]
            # Over budget and the correction changes nothing: try a family not measured yet
            # (its offset may differ from the learning step's: e.g. regions reloading their
            # tensors one by one peak lower than the model of a rebuilt region says), but only
            # where its model + offset predicts a lower peak than this one measured.
            for fam, kinds in (("checkpoint", KINDS[:2]), ("plain-offload", KINDS[2:])):
                if fam not in self.peak_offsets:
                    self._make_plan(self.planned_records, kinds)
                    new = self.plan
                    assert new is not None
                    if [(r.mode, r.actions) for r in new.regions] != old \
                            and new.model_peak + (new.peak_offset or 0) < peak:
                        return
            self.plan = plan
            self._apply(plan)
            self._settle(budget)
        elif [(r.mode, r.actions) for r in self.plan.regions] == old:  # type: ignore[union-attr]
            self._settle(budget)  # the correction changes nothing

    def _measured_offsets(self, plan: Plan, peak: int) -> None:
        """The offset of ``plan``'s family: measured peak - modeled. A kept plan's two terms
        apart where the start of backward was read (Note [gradients as backward goes] in
        search.py): the start's from that reading, where it passed the regions' forward; the
        rebuilt regions' from the step's peak, which bounds it from above only where the start
        was the peak (the least bound kept)."""
        fam = family(plan.variant)
        start = self.last_marks.get("start")
        if plan.terms is None or start is None:
            self.peak_offsets[fam] = peak - plan.model_peak
            return
        start_model, rebuilt_model = plan.terms
        if start > self.last_marks.get("regions", start):
            # the start of backward peaked over the regions' forward (their transients are not
            # the start's: they are saved where a region runs plainly)
            self.peak_offsets[KEPT_START] = start - start_model
        off = peak - rebuilt_model
        if peak <= start and fam in self.peak_offsets:
            off = min(off, self.peak_offsets[fam])
        self.peak_offsets[fam] = off

    def _settle(self, budget: int) -> None:
        """Tuning over: keep the fastest measured plan within the budget, else the one whose
        measured peak was least."""
        self.tuning_left = 0
        self.phase = Phase.SETTLED
        if not self.measured:
            return
        fits = [(p, m) for p, m in self.measured if m <= budget]
        timed = self.measured_seconds
        if fits and all(id(p) in timed for p, _ in fits):  # Note [a traced step is timed]
            best = min(fits, key=lambda pm: (timed[id(pm[0])], pm[1]))
        elif fits:
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

    def seed(self, plan: Plan, records: List[RegionRecord], peak_offsets: Dict[str, int],
             outside_bytes: int = 0, loss_bytes: int = 0, loss_min_bytes: int = 0,
             tail_bytes: int = 0, predicted_peak: Optional[int] = None, **about: Any) -> None:
        """Follow ``plan``, made from ``records`` (one step, in call order) with the measured
        ``peak_offsets`` of Note [peak feedback], from the next step on, without a learning
        step: the entry point of a plan made from a trace of the step on fake tensors
        (Note [seeded plan] in spillover/estimate/seed.py). The next ``TUNING_STEPS`` steps are
        measured and corrected as a learned plan's are; ``predicted_peak`` (the trace's peak
        of the step, over its start) is shown by ``explain()`` beside the measured one."""
        with self._lock:
            self.plan = plan
            self.planned_records = records
            self.last_records = records
            self.peak_offsets = dict(peak_offsets)
            self.outside_bytes = outside_bytes
            self.loss_bytes = loss_bytes
            self.loss_min_bytes = loss_min_bytes
            self.tail_bytes = tail_bytes
            self.measured = []
            self.measured_seconds = {}
            self.tuning_left = self.TUNING_STEPS if self.measure_peak else 0
            self.phase = Phase.TUNING if self.tuning_left else Phase.SETTLED
            self.seeded = {"predicted_peak": predicted_peak, "variant": plan.variant, **about}

    def use_plan(self, plan: Plan) -> None:
        """Follow ``plan`` from the next step on, without learning or measuring (e.g. a plan
        tuned in another process on the same model, shapes and offload context: its regions
        are matched by call order, input shapes and context as a learned plan's are)."""
        with self._lock:
            self.plan = plan
            self.phase = Phase.SETTLED
            self.tuning_left = 0
            self.measure_peak = False

    def _start_peak(self, device: str, ctx: Any) -> None:
        """Measure this step's peak if it learns or tunes the plan (on the simulated device,
        and on a CPU host with no context or one that ships nothing, its live tensor storages:
        Notes [the
        simulated device is a device] in records.py, [a CPU step's peak is its storages'] in
        metering.py). A meter given to the planner (the estimate's trace) is kept."""
        if not self.measure_peak or self._metering or self.phase is Phase.SETTLED:
            return
        from .. import _peak
        from .._peak import PeakMeter, StorageMeter

        storages = device == "cpu" and (ctx is None or _sim_link(ctx) is not None
                                        or keeps_on_host(ctx, device))
        what = "storages" if storages else device
        if self._meter is None or (isinstance(self._meter, (PeakMeter, StorageMeter))
                                   and self._meter.device != what):
            self._meter = StorageMeter() if what == "storages" else PeakMeter(device)
            if what == "storages":  # Note [a stale profiler] in _peak.py
                weakref.finalize(self, _peak.release, self._meter)
        self._step_peak = None
        self._reads = {}
        self._watch_pool(ctx)
        self._metering = self._meter.start()

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
        self.plan = make_plan(recs, self.machine_of(recs), self._budget_for(device),
                              self.outside_bytes, peak_offset=offsets, kinds=kinds,
                              loss_bytes=self.loss_bytes, loss_min_bytes=self.loss_min_bytes,
                              tail_bytes=self.tail_bytes)
        self.planned_records = recs
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
                self._start_peak(_device_of_args(args, kwargs), ctx)
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

    def watch_start_of_backward(self, out: Any) -> None:
        """The last region a kept plan rebuilds returned ``out``: while the step is metered,
        read its peak now and when backward reaches it, past the plain tail (Note [gradients as
        backward goes] in search.py)."""
        if self._metering:
            self.mark_peak("regions")
            _on_grad_of(output_tensors(out), lambda: self.mark_peak("start"))

    def add_record(self, rec: RegionRecord) -> None:
        with self._lock:
            self._records.append(rec)

    def mark_stale(self) -> None:
        """The op sequence of a planned region differed from the learned one."""
        with self._lock:
            self._dirty = True


def _on_grad_of(args: Sequence[Any], fn: Callable[[], None]) -> None:
    """Call ``fn`` once backward has computed the gradient of the first tensor of ``args``
    that requires one (of the first region's input: the regions' backward is over; of the
    last region's output: the model's tail is done, no region rebuilt yet)."""
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
                  explicit_steps: bool, seed_from_trace: bool = True) -> Planner:
    planner = Planner(budget_bytes, machine, measure_peak, seed_from_trace)
    planner.explicit_steps = explicit_steps
    return planner

