"""The ``"auto"`` region policy: a :class:`~spillover.planner.Planner` decides, region by
region and op by op, what is kept, offloaded or recomputed."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint as _tc
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from .. import planner as _planner
from ..activations import current_context
from ..activations import rederive as _rederive
from ..config import format_size
from ..planner import Explanation, Machine, Planner, RegionRecord, output_tensors
from . import follow as _follow
from .base import RegionPolicy, _sac
from .modes import Decider, _Run, top_hooks
from .ops import device_of, input_bytes, key_of, new_grad_bytes

if TYPE_CHECKING:
    from .blocks import _WrapState


class _Auto(RegionPolicy):
    """``"auto"``: a :class:`Planner` decides keep, offload or recompute per op output from the
    costs it measured in learning steps (run the most frugal way the offload context allows:
    Note [learning frugally] in planner/tuner.py)."""

    def __init__(self, planner: Planner):
        self.planner = planner

    def run(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
            key: Any, name: str, state: Optional[_WrapState]) -> Any:
        pol = self.planner
        ctx = current_context()
        device = device_of(args, kwargs)
        key = key if key is not None else key_of(fn)
        sig, rplan = pol.region_plan(key, args, kwargs, ctx)
        kept_here = _planner.keeps_on_host(ctx, device)  # Note [a CPU host ships nothing]
        if state is not None and state.counting is not None:
            state.counting.exclude(args)
        plan = pol.plan
        if ctx is not None and (kept_here or (rplan is not None and plan is not None
                                              and plan.keep_all and rplan is plan.regions[0])):
            # Notes [everything kept] in planner/search.py, [a CPU host ships nothing] in
            # planner/records.py
            ctx.keep_rest()
        if rplan is not None and rplan.mode == "plain-keep" and rplan.remake:
            # Note [a plain tail makes its cheap saves again] in planner/search.py: kept, but
            # what can be made again at unpack
            hooks = ((ctx.remade_or_kept, ctx.unpack) if ctx is not None
                     else (_rederive.pack, _rederive.unpack))
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                out = fn(*args, **kwargs)
        elif rplan is not None and rplan.mode == "plain-keep":
            if ctx is not None:  # keep everything: the context counts them, offloads none
                with torch.autograd.graph.saved_tensors_hooks(ctx.kept, _identity):
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
        elif rplan is not None and rplan.mode == "plain-offload":
            out = fn(*args, **kwargs)  # the context takes what autograd saves, reloads on use
        elif rplan is not None and rplan.recomputes_all:
            # Note [a replay with nothing to answer] in modes.py: torch's full checkpointing,
            # without a dispatch mode in the forward or the replay. A planned region leaves no
            # record (the plan's records stand for it), as the plain ones do; its input
            # signature was matched above, and a change of its ops cannot make it save wrong.
            out = _tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)
        elif (rplan is None and pol.learns_plainly(ctx, kept_here)
              and _context_hooks(state) is not None):
            # Note [learning frugally] in planner/tuner.py: run plainly, the context's hooks
            # taking what autograd saves, while the save mode records every op.
            record = RegionRecord(key, name or str(key), sig, device, "plain-offload",
                                  input_bytes=input_bytes(args), grad_bytes=new_grad_bytes(fn),
                                  offload=_planner.region_offload_info(ctx, kept_here))
            pack, unpack = _context_hooks(state)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
                    _Run(_learning, ctx, record, pol.add_record).contexts()[0]:
                out = fn(*args, **kwargs)
            _time_forward(record, args, t0)
        else:
            # the records the planner keeps (a learning run, a plan made elsewhere) count the
            # gradients their backward makes; one that follows its plan is not kept
            recorded = rplan is None or rplan.record is None or not rplan.record.ops
            record = RegionRecord(key, name or str(key), sig, device, "checkpoint",
                                  input_bytes=input_bytes(args),
                                  grad_bytes=new_grad_bytes(fn) if recorded else 0,
                                  offload=_planner.region_offload_info(ctx, kept_here))
            if rplan is None:
                t0 = time.perf_counter()
                out = _sac(fn, args, kwargs, _Run(_learning, ctx, record, pol.add_record).contexts)
                _time_forward(record, args, t0)
            elif recorded:  # a plan made elsewhere
                out = _sac(fn, args, kwargs,
                           _Run(_planned(pol, rplan), ctx, record, pol.add_record).contexts)
            else:  # Note [a forward that follows its record] in follow.py
                tpl = rplan.__dict__.get("_template")
                if tpl is None:
                    tpl = rplan.__dict__["_template"] = _follow.Template(rplan.record)
                run = _Run(_planned(pol, rplan), ctx, record, None)
                out = _sac(fn, args, kwargs, _follow.following_contexts(
                    run, tpl, rplan.actions, lambda ok: ok or pol.mark_stale()))
        if state is not None and state.counting is not None:
            state.counting.tail = 0  # what is saved from here on is the tail, so far
        if (ctx is not None and rplan is not None and plan is not None and plan.keep_tail
                and rplan is plan.regions[-1]):
            ctx.keep_rest()  # Note [the tail stays] in planner/search.py
        if rplan is not None and plan is not None and plan.terms is not None \
                and rplan is plan.last_rebuilt:
            pol.watch_start_of_backward(out)  # Note [gradients as backward goes]
        if ctx is not None and rplan is not None and plan is not None and plan.returns:
            back = next((nb for at, nb in plan.returns.items()
                         if at < len(plan.regions) and plan.regions[at] is rplan), 0)
            if back:  # Note [regions shipped whole] in planner/search.py
                _on_backward(out, lambda: ctx.stage_next(back))
        if not pol.explicit_steps:
            _note_backward_on(out, pol)
        return out

    def compiled(self, fn: Callable[..., Any], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Any:
        raise RuntimeError(
            "spillover: policy='auto' cannot run under torch.compile: the planner learns from "
            "eager steps and re-plans when shapes change. Compile with a fixed policy instead "
            "(spillover.wrap(model, policy='selective' | 'full' | 'offload' | callable)), or "
            "leave the wrapped blocks out of the compiled region."
        )

    def explain(self, records: List[RegionRecord], machine: Optional[Machine]) -> Explanation:
        planner = self.planner
        recs = planner.planned_records if planner.plan is not None else planner.last_records
        if not recs:
            recs = planner._records
        # the machine the plan was made with: the simulated device's link, the measured
        # compute (Note [measured compute] in planner/machine.py)
        m = machine or (planner.machine_of(recs) if recs else None)
        policy = "auto" + ("" if planner.plan is not None else " (learning: no plan yet)")
        ex = _planner.explain_records(recs, policy, m, planner.plan, planner.outside_bytes,
                                      planner.loss_bytes)
        if planner.plan is not None:
            ex.summary["phase"] = planner.phase.value + (
                f", last measured peak {format_size(planner.last_peak)}"
                if planner.last_peak is not None else "")
        seeded = planner.seeded
        if seeded is not None:  # Note [seeded plan] in spillover/estimate/seed.py
            pred = seeded.get("predicted_peak")
            ex.summary["seeded"] = (
                f"planned from a trace on fake tensors ({seeded.get('fake_steps', 0)} fake "
                f"steps, {seeded.get('seconds', 0.0):.1f} s): {seeded['variant']}, predicted "
                f"peak {format_size(pred) if pred is not None else '-'}; measured "
                + (", ".join(format_size(p) for p in planner.first_peaks) or "not yet"))
        elif planner.seed_note:
            ex.summary["seeded"] = f"no: {planner.seed_note}; learned instead"
        return ex

    def seed(self, model: nn.Module, state: Any, args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> bool:
        """A wrapped model's first forward: plan it from a trace on fake tensors (Note [seeded
        plan] in spillover/estimate/seed.py), once; on failure the planner learns as before.
        Returns whether a trace ran (it called the model)."""
        pol = self.planner
        if not pol.seed_from_trace or not pol.learning or pol.seed_note or pol.seeded:
            return False
        from ..estimate.seed import seed_planner

        pol.seed_note = seed_planner(model, state, args, kwargs) or ""
        return True

    def attach(self, model: nn.Module) -> None:
        if type(model).forward is not nn.Module.forward:
            # the model's forward hooks mark steps (containers have none)
            self.planner.explicit_steps = True

    def begin_step(self, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None
                   ) -> bool:
        self.planner.begin_step()
        self.planner.start_peak(args, kwargs or {}, current_context())
        return self.planner.learning

    def end_step(self, outside_bytes: int, loss_bytes: int = 0, loss_min_bytes: int = 0,
                 tail_bytes: int = 0) -> None:
        self.planner.outside_bytes = outside_bytes
        self.planner.tail_bytes = tail_bytes
        self.planner.loss_bytes = loss_bytes
        self.planner.loss_min_bytes = loss_min_bytes

    def loss_cap(self) -> Optional[int]:
        plan = self.planner.plan
        return plan.loss_cap if plan is not None and not self.planner.learning else None

    def __repr__(self) -> str:
        return "'auto'"


def _learning(n: int, func: Any, args: Any, kwargs: Any, out: Any) -> str:
    return "recompute"


def _context_hooks(state: Optional[_WrapState]) -> Any:
    """The saved-tensor hooks under the learning step's counting hooks (the offload context's),
    so that what a region learned plainly saves is not counted as outside the regions; with
    no wrap state, the innermost active ones. Their pack runs with the dispatch modes off: the
    ops it runs to stage a tensor (an empty block, a set_) are the context's, not the region's,
    and the save mode must not record them."""
    if state is not None and state.counting is not None:
        hooks = state.counting.inner
    else:
        hooks = top_hooks(False) if top_hooks is not None else None
    if hooks is None:
        return None
    inner_pack, unpack = hooks

    def pack(x: torch.Tensor) -> Any:
        with _disable_current_modes():
            return inner_pack(x)

    return pack, unpack


def _planned(planner: Planner, rplan: Any) -> Decider:
    actions = rplan.actions

    def decide(n: int, func: Any, args: Any, kwargs: Any, out: Any) -> str:
        act = actions.get(n)
        if act is None or act[0] != str(func):
            planner.mark_stale()
            return "recompute"
        return act[1]

    return decide


def _note_backward_on(out: Any, planner: Planner) -> None:
    _on_backward(out, planner.note_backward)


def _on_backward(out: Any, fn: Callable[[], Any]) -> None:
    """Run ``fn`` when backward reaches the region that returned ``out`` (what it returns is
    not a gradient: the hook returns None)."""

    def hook(grads: Any) -> None:
        fn()

    for t in output_tensors(out) if not isinstance(out, dict) else list(out.values()):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(hook)
            return


def _identity(x: Any) -> Any:
    return x


def _time_forward(record: RegionRecord, args: Tuple[Any, ...], t0: float) -> None:
    """Note [measured compute] in planner/machine.py: a learning run's forward seconds, where
    they are its compute's (real tensors on a CPU host; the record is handed to the planner
    when the forward ends, and read when the step ends)."""
    if record.device != "cpu":
        return
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None and type(first) is torch.Tensor:  # not a fake tensor of an estimate
        record.forward_seconds = time.perf_counter() - t0
