"""A region's forward that follows a record of an earlier run of it, recording nothing.

Note [a forward that follows its record]
    :class:`~spillover.recompute.modes._SaveMode` records every op of a region (an
    ``OpRecord``: shape, bytes, FLOPs, bytes moved) and who reads each output, for the planner
    to learn from, for ``explain()``, and for Note [outputs only saved ops read]. Once a region
    has run, the runs that follow need none of it anew: auto's planned steps follow a plan made
    from such a record (``RegionPlan.record``), and selective's steady state makes the decisions
    its first refined run made (that run's record). On an HF Llama layer on this CPU
    (2026-12-06) the recording was 18 us of the 28 us a region's op cost over torch's full
    checkpointing (a pass-through dispatch mode costs 10 us), in a forward whose every op the
    host dispatches -- what a GPU's forward waits on.

    :class:`_FollowingSaveMode` takes the ops' names, readers and forced reasons from the
    record and keeps, per op, only what the replay needs to be right: the call counter, the
    decision, the save, which op made each storage (for in-place writes and for the saves
    autograd makes), and an empty stand-in for an op the replay may skip. A recorded op becomes
    a stand-in only if, in this run, autograd saved no view of its output (the pack hook sees
    each save) and every reader the record names is saved in this run or itself a stand-in: the
    recording mode's rule, on this run's saves.

    The record is trusted only while this run's ops are the recorded ones, name by name, and
    (selective's) while the decisions are the recorded ones. At the first op that differs the
    rest of the run goes through the recording mode's dispatch with nothing skipped (recomputing
    more is always right), and the owner is told: auto learns again, selective records its next
    run. A decision that differs (another context, other shapes) only makes the next run record.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_map

from ..planner import RegionRecord, output_tensors
from ..planner.cost import skipped_ops
from .modes import MODIFIED_REASON, RECOMPUTE, _ReplayMode, _Run, _Saved, _SaveMode, _Skip
from .ops import _INFO, IGNORED, INDUCTOR_CODE, op_info, storage_key

__all__ = ["Template", "following_contexts"]


class Template:
    """What a following run reads from a record, computed once per record."""

    __slots__ = ("record", "names", "views", "readers", "expected")

    def __init__(self, record: RegionRecord):
        self.record = record
        ops = record.ops
        self.names: List[str] = [o.name for o in ops]
        self.views = [o.forced == "view" for o in ops]
        # ops the replay may skip (not forced: views, random, in place), and who reads each
        self.readers: Dict[int, Tuple[int, ...]] = {
            o.index: o.readers for o in ops if o.forced is None}
        # the decision each op was given, where the record still shows it: before the stop
        # (after it everything reads "recompute"), "saved" where a later in-place write turned
        # a save into a recompute (keep or offload: the record no longer says which)
        stop = record.stop or len(ops)
        self.expected: List[Optional[str]] = [
            None if o.index >= stop else "saved" if o.reason == MODIFIED_REASON else o.action
            for o in ops]


class _FollowingSaveMode(_SaveMode):
    """Forward of a region that follows a record: Note [a forward that follows its record]."""

    def __init__(self, run: _Run, template: Template,
                 actions: Optional[Dict[int, Tuple[str, str, str]]],
                 on_end: Callable[[bool], None]):
        super().__init__(run)
        self.template = template
        self.actions = actions  # a plan's decisions by op index; None: the run's decider
        self.on_end = on_end
        self.diverged = False  # an op other than the recorded one ran
        self.changed = False  # a decision other than the recorded one was made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if self.diverged:
            return super().__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        if func in IGNORED:
            return func(*args, **kwargs)
        info = _INFO.get(func) or op_info(func)
        n = self.n
        tpl = self.template
        if n >= len(tpl.names) or tpl.names[n] != info.name:
            self.diverged = True
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **kwargs)
        key = func if func is not INDUCTOR_CODE else storage_key(func, args)
        counter = self.counter
        idx = counter.get(key, 0)
        counter[key] = idx + 1
        self.n = n + 1
        why = info.forced
        if why == "random" and info.no_dropout(args, kwargs):
            why = None
        if why == "mutates an input":
            self._invalidate(info.written_tensors(args, kwargs))
        elif why is None and tpl.views[n]:
            why = "view"  # recorded as one: its output is an input's storage
        if why != "view" and why != "mutates an input":
            producer = self.producer
            for t in (out,) if isinstance(out, torch.Tensor) else output_tensors(out):
                try:
                    producer[(t.device, t.untyped_storage()._cdata)] = n
                except (RuntimeError, NotImplementedError):
                    continue
        if why == "view":
            action = "recompute"
        elif why is None:
            if self.actions is not None:
                action = self.actions[n][1]  # its name is the recorded one (checked above)
            else:
                action = self.decide(n, func, args, kwargs, out)
                want = tpl.expected[n]
                if want is not None and want != action and (
                        want != "saved" or action == "recompute"):
                    self.changed = True
        elif why == "effect":
            action = "keep"
        else:
            action = "recompute"
        if action == "recompute":
            self.storage[key][idx] = RECOMPUTE
            if (why is None and n in tpl.readers and isinstance(out, torch.Tensor)
                    and out.device.type != "meta"):
                self.skippable[n] = (key, idx, None, _Skip(out))  # type: ignore[assignment]
            return out
        ctx = self.run.ctx if action == "offload" else None
        self.storage[key][idx] = (_Saved(out, ctx) if isinstance(out, torch.Tensor)
                                  else tree_map(lambda x: _Saved(x, ctx), out))
        self.cached.setdefault(n, []).append((key, idx, None))  # type: ignore[arg-type]
        return out

    def _finish(self) -> None:
        stop = self.last_save if self.last_save >= 0 else self.n
        self._drop_after(stop)
        if self.last_save >= 0 and not self.diverged:
            storage = self.storage
            saved = [n for n, entries in self.cached.items()
                     if any(storage[key].get(idx) is not RECOMPUTE for key, idx, _ in entries)]
            readers, needed = self.template.readers, self.needed_ops
            for n in skipped_ops({n: readers[n] for n in self.skippable
                                  if n < stop and n not in needed}, saved):
                key, idx, _, skip = self.skippable[n]
                storage[key][idx] = skip
        self._close()
        self.on_end(not (self.diverged or self.changed))


def following_contexts(run: _Run, template: Template,
                       actions: Optional[Dict[int, Tuple[str, str, str]]],
                       on_end: Callable[[bool], None]) -> Callable[[], Any]:
    """The ``context_fn`` of a region run that follows ``template`` (Note [a forward that
    follows its record]), deciding by ``actions`` (a plan's) or else by ``run``'s decider;
    ``on_end(followed)`` when its forward ends, False where an op or a decision differed."""

    def contexts() -> Any:
        return _FollowingSaveMode(run, template, actions, on_end), _ReplayMode(run.storage, run)

    return contexts
