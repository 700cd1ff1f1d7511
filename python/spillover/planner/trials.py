"""The planner's trial steps: plans a tuning step runs to measure what the model cannot tell,
one step each, whose measured peaks the settling (:meth:`~spillover.planner.tuner.Planner.
_settle`) weighs with the rest (Note [peak feedback] in tuner.py).

Note [a family's own offset]
    The learning step measures one family's offset; the others borrow it until measured. Under
    the NVMe context that family is plain-offload, and its offset is not the checkpoint
    family's: on the estimate of the H200 probe's 1B Llama (seq 4096, bf16, budget = full
    checkpointing's peak) the plain-offload learning step measured 1,849 MiB over its model,
    a checkpoint plan 1,464 MiB, and borrowed, the offset put full recompute 109 MiB over a
    budget that full checkpointing meets: auto ran plain offload, 2.5x full's time. So after a
    plain-offload learning step, when the checkpoint family's least-peak plan (full recompute,
    or close) is modeled faster and the borrowed offset puts it over the budget by at most
    ``EXPLORE``, the first tuning step runs it: its peak gives the family its own offset, and
    the re-plan and the settling (the fastest measured plan within the budget) take it from
    there. A trial over the budget costs one tuning step, as a re-plan that went over does.
    A trial within the budget is not settled on at once, even within ``SLACK`` of it: it is
    the least-peak plan, made for its offset, not for its speed, so the next tuning step
    follows the plan the budget gives with the offset just measured (on that estimate: the
    same full recompute with the tail kept, Note [the tail stays] in search.py) and the
    settling keeps the faster of the two measured within the budget. A trial measured in the
    last tuning step gets one step more for that re-plan: on that estimate the kept trial
    (Note [a kept trial]) ran third, its offsets were measured and never used, and auto
    settled on the trial itself, full recomputation (1.00x full's time, where the re-plan runs
    0.98x).

Note [a tail's trial]
    A plan that keeps the model's tail on the device (Note [the tail stays] in search.py) holds
    it at the start of backward, before the regions' gradients exist; the measured offset is
    the whole step's, and where it is those gradients (the peak at the end of backward) the
    model counts the tail on top of them. On the estimate of the H200 probe's 1B Llama at full
    checkpointing's peak the tail (0.57 GB) exceeds the largest region rebuilt by 19 MB and
    the offset left 15 MB: modeled over, the kept tail was never run, and auto took 1.10x
    full's time. So when the plan settled on fits and tuning steps are left, its twin that
    keeps the tail, when modeled faster and over the budget by at most ``EXPLORE``, runs one
    tuning step; its measured peak alone decides (it does not set the family's offset,
    which shipped plans keep using), and the settling keeps the fastest plan measured within
    the budget.

Note [a kept trial]
    A plan under a device's context ships the region inputs and what the model saves between
    regions, and pays the host's time per offload for each. The kept family (Note [everything
    kept] in search.py) ships nothing, as torch's checkpointing does, but until it has run it
    borrows a shipping family's offset, and its model counts everything it keeps on top of the
    backward's rebuilt region: on the estimate of the H200 probe's 1B Llama at full
    checkpointing's peak the shipping plan measured 2,233 MiB (model 548 MiB, offset 1,719),
    while the kept plan's model (1,332 MiB) plus that offset put it 36 % over a budget that
    torch's full checkpointing meets (2,249 MiB). The shipped bytes are mostly back or freed
    when the step peaks (late in backward, with the parameters' gradients): auto ran the
    shipping plan at 1.02x full's time, its 16 input packs and staging. So when the plan
    measured within the budget ships something and tuning steps are left, the kept family's
    plan for the budget (its least-peak one where the borrowed offset puts every kept plan
    over) runs one tuning step where it is modeled faster and where its worst case
    -- the measured peak plus everything it keeps that the plan shipped -- fits the device's
    free memory (a trial may pass the budget for one step, never the device); its peak gives
    the family its own offset, and the re-plan and the settling take it from there, as after
    Note [a family's own offset].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from .records import RegionRecord, host_is_device
from .search import KEPT, Plan, family, make_plan

#: the note of a plan tried for its family's offset (Note [a family's own offset])
EXPLORING = "exploring the checkpoint family's offset"
#: the note of the learning step's own plan (Note [the learning step is a candidate] in
#: tuner.py)
LEARNED = "what the learning step ran: every region recomputed"
#: the note of the kept family's first plan (Note [everything kept] in search.py)
EXPLORING_KEPT = "exploring the kept family's offset"
#: the note of a plan tried for its kept tail's peak (Note [a tail's trial])
EXPLORING_TAIL = "trying the tail kept on the device"


class Trials:
    """The trial steps of :class:`~spillover.planner.tuner.Planner` (mixed in)."""

    #: Note [a family's own offset]: how far over the budget the borrowed offset may put the
    #: checkpoint family's least-peak plan for it to be tried
    EXPLORE = 0.10

    plan: Optional[Plan]
    planned_records: List[RegionRecord]
    peak_offsets: Dict[str, int]
    outside_bytes: int
    loss_bytes: int
    loss_min_bytes: int
    tail_bytes: int
    measured: List[Tuple[Plan, int]]
    last_seconds: Optional[float]  # the last measured step's, where steps are timed

    if TYPE_CHECKING:  # what the trials use of the Planner they are mixed into

        def machine_of(self, recs: Any) -> Any: ...

        def _budget_for(self, device: str) -> int: ...

        def _apply(self, plan: Plan) -> None: ...

    def _explore_checkpoint(self, recs: List[RegionRecord]) -> None:
        """Note [a family's own offset]: after a plain-offload learning step, try the checkpoint
        family's least-peak plan in the first tuning step when its model says it is faster and
        only the borrowed offset puts it over the budget (by at most ``EXPLORE``)."""
        plan = self.plan
        assert plan is not None
        if family(plan.variant) != "plain-offload" or "checkpoint" in self.peak_offsets:
            return
        budget = self._budget_for(recs[0].device)
        trial = make_plan(recs, self.machine_of(recs), 0, self.outside_bytes,
                          peak_offset=dict(self.peak_offsets), kinds=("checkpoint",),
                          loss_bytes=self.loss_bytes,
                          tail_bytes=self.tail_bytes)  # budget 0: the least peak it has
        if (trial.recompute_seconds + trial.transfer_seconds
                < plan.recompute_seconds + plan.transfer_seconds
                and trial.model_peak + (trial.peak_offset or 0) <= budget * (1 + self.EXPLORE)):
            trial.budget, trial.note = budget, EXPLORING
            self.plan = trial
            self._apply(trial)
        else:
            self._apply(plan)

    def _explore_kept(self, budget: int) -> bool:
        """Note [everything kept] in search.py: when a plan under a device's context measured
        over the budget and the kept family was never run, follow its least-peak plan for one
        tuning step (its offset is not the shipping families': no copies in flight or staged).
        True when it will."""
        recs = self.planned_records
        if "kept" in self.peak_offsets or not recs or recs[0].offload is None \
                or host_is_device(recs[0]):
            return False
        trial = make_plan(recs, self.machine_of(recs), 0, self.outside_bytes,
                          peak_offset=dict(self.peak_offsets), kinds=(KEPT,),
                          loss_bytes=self.loss_bytes, tail_bytes=self.tail_bytes)
        if not trial.keep_all:
            self._apply(self.plan)  # type: ignore[arg-type]
            return False
        trial.budget, trial.note = budget, EXPLORING_KEPT
        self.plan = trial
        return True

    def _try_kept(self, budget: int, peak: int) -> bool:
        """Note [a kept trial]: after a plan that ships measured ``peak`` within the budget,
        follow the kept family's least-peak plan for one tuning step when it is modeled faster
        and its worst case fits the device. True when it will."""
        plan = self.plan
        assert plan is not None
        recs = self.planned_records
        if plan.keep_all or "kept" in self.peak_offsets or not recs \
                or recs[0].offload is None or host_is_device(recs[0]):
            return False
        # the budget's kept plan where its model and the borrowed offset fit, else its
        # least-peak one
        trial = make_plan(recs, self.machine_of(recs), budget, self.outside_bytes,
                          peak_offset=dict(self.peak_offsets), kinds=(KEPT,),
                          loss_bytes=self.loss_bytes, tail_bytes=self.tail_bytes)
        worst = peak + max(0, trial.model_peak - plan.model_peak)
        room = device_room(recs[0].device)
        # Note [a traced step is timed] (tuner.py): where the steps are timed, the trial's
        # step says whether it is faster, not the model
        timed = self.last_seconds is not None
        if (trial.keep_all and (timed or trial.recompute_seconds + trial.transfer_seconds
                                < plan.recompute_seconds + plan.transfer_seconds)
                and (room is None or worst <= room)):
            trial.budget, trial.note = budget, EXPLORING_KEPT
            self.plan = trial
            return True
        self._apply(plan)  # make_plan wrote the trial's decisions into the records
        return False

    def _try_tail(self, budget: int) -> bool:
        """Note [a tail's trial]: follow the plan that keeps the tail for one tuning step when
        it is modeled faster than the plan that fits and over the budget by at most
        ``EXPLORE``. True when it will."""
        plan = self.plan
        assert plan is not None
        recs = self.planned_records
        if plan.keep_tail or not self.tail_bytes or not recs:
            return False
        twin = make_plan(recs, self.machine_of(recs), budget, self.outside_bytes,
                         peak_offset=dict(self.peak_offsets), loss_bytes=self.loss_bytes,
                         loss_min_bytes=self.loss_min_bytes, tail_bytes=self.tail_bytes,
                         keep_tail=True)
        if (twin.keep_tail and twin.recompute_seconds + twin.transfer_seconds
                < plan.recompute_seconds + plan.transfer_seconds
                and twin.model_peak + (twin.peak_offset or 0) <= budget * (1 + self.EXPLORE)):
            twin.budget, twin.note = budget, EXPLORING_TAIL
            self.plan = twin
            return True
        self._apply(plan)  # make_plan wrote the twin's decisions into the records
        return False


def device_room(device: str) -> Optional[int]:
    """Bytes a step may still take on ``device`` (Note [a kept trial]): on CUDA its free memory
    and what torch's allocator holds unused; None where that is not known (a fake or simulated
    device in an estimate, whose trials cannot fail an allocation)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    return None
