"""The region runner: two dispatch modes under ``torch.utils.checkpoint`` (non-reentrant).

During forward :class:`_SaveMode` sees every op of the region and saves the outputs the
policy keeps; during backward :class:`_ReplayMode` re-runs the region, returning the saved
outputs and recomputing everything else. Gradients are bitwise those of the region run plainly:
recomputation replays the same ops on the same inputs (and the same RNG state), and a saved
output comes back with its exact bytes.

Note [SAC bypasses saved-tensor hooks]
    torch's own selective checkpointing keeps the op outputs it saves in a cache of plain
    references: in eager mode they never pass through ``saved_tensors_hooks``, so no offload
    hook sees them (torch's CPU-offload policies silently recompute instead). Our modes hand
    each saved output to the innermost active ``offload_context`` (``ctx.pack``) when the policy
    saves it, and take it back (``ctx.unpack``) when the region is recomputed; with no context
    active they keep plain references, as torch does. The region's inputs are saved by
    ``checkpoint`` itself through the outer hooks, so the context already sees those.

Note [after the last save]
    Non-reentrant checkpoint stops recomputing once the last tensor autograd saved in the
    region has been rebuilt. To know where that is, :class:`_SaveMode` sits between autograd
    and checkpoint's own saved-tensor hook for the region's forward and notes each save; outputs
    of ops after the last one are never asked for, so they are dropped when the forward ends
    (torch keeps them). The same notes say which outputs autograd saves: what the region would
    hold if run plainly, which the planner needs.

Note [outputs only saved ops read]
    When the op that reads an output is saved, recomputation need not rebuild that output —
    unless autograd saved it too. E.g. with the softmax output saved, the scores matmul,
    scaling and masking before it are dead weight: torch reruns them, we do not. The forward
    notes which ops read each op's output (views see through to their base); an op that is
    not random, not a view, not in place, not saved by autograd, and whose every reader is
    saved or itself skipped, gets an empty tensor of its output's shape in recomputation
    instead of running. Its bytes are never read: its readers return their saved outputs.

Note [replay matching]
    Saved outputs are matched by (op, n-th call of that op in the region), as torch matches
    them. A region must therefore run the same ops in recompute as in forward — the usual
    checkpoint contract; a mismatch raises instead of returning a wrong tensor.

Note [a replay with nothing to answer]
    A run whose every op is recomputed (a learning run, a region of a plan that recomputes it
    all, a static policy that saved nothing in it) has nothing for the replay's mode to hand
    back: the mode is not pushed, and the replay dispatches as torch's full checkpointing does
    (pass-through, a dispatch mode costs about 10 us of Python per op: 2026-12-06, an HF
    LlamaDecoderLayer's 73 ops on this CPU at 6 us per op plainly and 16 us under a mode).
    What the mode's matching would catch, torch's own check of the recomputed tensors'
    metadata catches (``CheckpointError``).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .. import planner as _planner
from ..activations import rederive as _rederive
from ..planner import OpRecord, RegionRecord, op_flops, output_tensors
from .ops import (
    _INFO,
    IGNORED,
    INDUCTOR_CODE,
    OpInfo,
    op_info,
    producer_of,
    skey,
    storage_key,
)
from .replay import _MISMATCH, RECOMPUTE, _ReplayMode, _Saved, _Skip  # noqa: F401

top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

_DTYPE_NAMES: Dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


#: Why a saved output is recomputed after all: an op of its region wrote it in place.
MODIFIED_REASON = "modified in place later in the region"

#: decide(n, func, args, kwargs, out) -> "keep" | "offload" | "recompute", for op n of a region.
Decider = Callable[[int, Any, Tuple[Any, ...], Dict[str, Any], Any], str]


def _written_after_pack(entry: Any) -> None:
    """A cached entry whose storage a later op of the region writes in place: its copies, if it
    was offloaded, may read the written bytes (Note [in-place after pack] in link/device.py).
    They are marked modified: no longer a link fault for the verify mode, and an unpack of the
    same storage elsewhere raises the error autograd raises for a saved tensor modified."""
    for saved in tree_leaves(entry, is_leaf=lambda x: isinstance(x, _Saved)):
        v = saved.value if isinstance(saved, _Saved) else None
        stored = getattr(v, "stored", None)
        for c in getattr(stored, "copies", ()) or ():
            c.modified = True


class _Run:
    """One call of one region: what it decides, what it saved, what it recorded.

    ``contexts`` is the ``context_fn`` handed to ``torch.utils.checkpoint``; ``sink`` receives
    the region's :class:`RegionRecord` when its forward ends.
    """

    def __init__(
        self,
        decide: Decider,
        ctx: Any,
        record: RegionRecord,
        sink: Optional[Callable[[RegionRecord], None]],
    ):
        self.decide = decide
        self.ctx = ctx
        self.record = record
        self.sink = sink
        self.storage: Dict[Any, Dict[int, Any]] = collections.defaultdict(dict)
        #: Note [a replay with nothing to answer]: set when the forward ends
        self.recomputes_all = False

    def contexts(self) -> Tuple[TorchDispatchMode, TorchDispatchMode]:
        return _SaveMode(self), _ReplayMode(self.storage, self)


class _HookTarget:
    """What the delegating pack hook reaches; cleared when the forward ends (the autograd graph
    keeps pack hooks alive, and must not keep the region's bookkeeping with them)."""

    __slots__ = ("mode",)

    def __init__(self, mode: _SaveMode):
        self.mode: Optional[_SaveMode] = mode


class _SaveMode(TorchDispatchMode):
    """Forward: run each op, decide, save (Note [SAC bypasses saved-tensor hooks])."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run
        self.decide = run.decide
        self.storage = run.storage
        self.counter: Dict[Any, int] = {}
        self.n = 0
        self.last_save = 0
        # Storage -> the op that produced it, most recent first: an address can be reused once
        # its storage is freed, and a save or an in-place write refers to the live one.
        self.producer: Dict[Tuple[Any, int], int] = {}
        self.needed_ops: set = set()  # ops whose output (or a view of it) autograd saved
        #: ... of those, ops whose saved output can be made again at unpack (Note [made again
        #: at unpack] in activations/rederive.py)
        self.rederived_ops: set = set()
        # Note [outputs only saved ops read]: which ops read each op's output (through views
        # too: a view has its base's storage), and the recomputed ops that could be skipped.
        self.consumers: Dict[int, set] = collections.defaultdict(set)
        self.view_ops: set = set()
        self.skippable: Dict[int, Tuple[Any, int, OpRecord, _Skip]] = {}
        self.cached: Dict[int, List[Tuple[Any, int, OpRecord]]] = {}  # op index -> entries
        self._hooks: Any = None
        self._target: Optional[_HookTarget] = None

    # Note [after the last save]: a pack hook between autograd and checkpoint's.
    def __enter__(self) -> _SaveMode:
        top = top_hooks(False) if top_hooks is not None else None
        if top is not None:
            inner_pack, inner_unpack = top
            target = self._target = _HookTarget(self)

            def pack(x: torch.Tensor) -> Any:
                mode = target.mode
                if mode is not None:
                    mode.last_save = mode.n
                    p = producer_of(mode.producer, x)
                    if p is not None:
                        mode.needed_ops.add(p)
                return inner_pack(x)

            # Nested checkpoints look through checkpoint-internal hooks for the user's.
            pack._checkpoint_internal = True  # type: ignore[attr-defined]
            pack._user_hooks = getattr(inner_pack, "_user_hooks", None)  # type: ignore[attr-defined]
            self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack)
            self._hooks.__enter__()
        else:
            self.last_save = -1  # unknown: never prune
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            pack = self._hooks.pack_hook
            if hasattr(pack, "_user_hooks"):
                del pack._user_hooks
            self._hooks = None
        if self._target is not None:
            self._target.mode = None
        self._finish()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in IGNORED:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        info = _INFO.get(func) or op_info(func)
        key = func if func is not INDUCTOR_CODE else storage_key(func, args)
        counter = self.counter
        idx = counter.get(key, 0)
        counter[key] = idx + 1
        n = self.n
        self.n = n + 1
        why = info.forced
        if why == "random" and info.no_dropout(args, kwargs):
            why = None  # fused attention with dropout_p=0 draws nothing
        if why == "mutates an input":
            self._invalidate(info.written_tensors(args, kwargs))
        # One storage key (ops.skey, inlined: Note [storage names] in ops.py) per input
        # tensor, reused for the alias check and the readers.
        producer = self.producer
        ins = []
        for a in info.tensors(args, kwargs):
            try:
                k = (a.device, a.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):  # no storage torch lets us see
                continue
            ins.append(k)
            p = producer.get(k)
            if p is not None:
                self.consumers[p].add(n)
        outs = (out,) if isinstance(out, torch.Tensor) else output_tensors(out)
        nbytes = 0
        if why != "view":
            # Storage bytes the outputs pin (as planner.storage_bytes counts them), and who
            # produced each storage (Note [outputs only saved ops read]).
            seen = []
            for t in outs:
                if t.device.type == "meta":
                    continue
                try:
                    st = t.untyped_storage()
                    k = (t.device, st._cdata)
                except (RuntimeError, NotImplementedError):
                    nbytes += t.numel() * t.element_size()
                    continue
                if why is None and k in ins:
                    why = "view"  # e.g. _unsafe_view: no alias annotation, same storage
                    break
                if k not in seen:
                    seen.append(k)
                    nbytes += st.nbytes()
            if why == "view":
                nbytes = 0
            elif why != "mutates an input":
                for k in seen:
                    producer[k] = n
        rec = self._record(n, func, info, args, kwargs, out, outs, why, nbytes)
        if (func in _rederive.FUNCS and nbytes >= _rederive.REDERIVE_MIN_BYTES
                and all(a.requires_grad for a in info.tensors(args, kwargs))):
            self.rederived_ops.add(n)  # Note [made again at unpack], if autograd saves it
        if why == "view":
            self.view_ops.add(n)
            action = "recompute"
        elif why is None:
            action = self.decide(n, func, args, kwargs, out)
        elif why == "effect":
            action = "keep"
        else:  # "mutates an input", "random", "allocates only"
            action = "recompute"
        rec.action = action
        if action == "recompute":
            self.storage[key][idx] = RECOMPUTE
            if why is None and isinstance(out, torch.Tensor) and out.device.type != "meta":
                self.skippable[n] = (key, idx, rec, _Skip(out))
            return out
        ctx = self.run.ctx if action == "offload" else None
        self.storage[key][idx] = (_Saved(out, ctx) if isinstance(out, torch.Tensor)
                                  else tree_map(lambda x: _Saved(x, ctx), out))
        self.cached.setdefault(n, []).append((key, idx, rec))
        return out

    def _record(self, n: int, func: Any, info: OpInfo, args: Any, kwargs: Any, out: Any,
                outs: Sequence[torch.Tensor], why: Optional[str], nbytes: int) -> OpRecord:
        first = outs[0] if outs else None
        if why == "view":
            flops = moved = 0
        else:
            if info.compute_bound:
                flops = op_flops(func, args, kwargs, out)
            else:  # what op_flops counts for an op without a formula
                flops = sum(t.numel() for t in outs)
            moved = nbytes + info.moved_in(args)
        rec = OpRecord(
            index=n,
            name=info.name,
            shape=tuple(first.shape) if first is not None else (),
            dtype=_dtype_name(first.dtype) if first is not None else "",
            bytes=nbytes,
            flops=flops,
            moved_bytes=moved,
            compute_bound=info.compute_bound,
            forced=why,
        )
        self.run.record.ops.append(rec)
        return rec

    def _invalidate(self, written: List[torch.Tensor]) -> None:
        """Note [never saved]: a cached output modified in place is recomputed instead."""
        for t in written:
            p = self.producer.get(skey(t))
            for key, idx, rec in self.cached.pop(p, ()) if p is not None else ():
                entry = self.storage[key].get(idx)
                if entry is not None and entry is not RECOMPUTE:
                    _written_after_pack(entry)
                    self.storage[key][idx] = RECOMPUTE
                    if rec is not None:  # None: a following run's (recompute/follow.py)
                        rec.action = "recompute"
                        rec.reason = MODIFIED_REASON

    def _skip_dead(self, stop: int) -> None:
        """Note [outputs only saved ops read]: a recomputed op whose output autograd does not
        save, and which only saved ops (or other such ops) read, is not rerun."""
        saved = [n for n, entries in self.cached.items()
                 if any(self.storage[key].get(idx) is not RECOMPUTE for key, idx, _ in entries)]
        dead = _planner.skipped_ops(
            {n: tuple(self.consumers.get(n, set()) - self.view_ops) for n in self.skippable
             if n < stop and n not in self.needed_ops},
            saved,
        )
        for n in dead:
            key, idx, op, skip = self.skippable[n]
            self.storage[key][idx] = skip
            op.after_stop = True
            op.reason = _planner.SKIPPED_REASON

    def _finish(self) -> None:
        rec = self.run.record
        stop = self.last_save if self.last_save >= 0 else self.n
        rec.stop = stop
        rec.saves_seen = self.last_save >= 0
        self._drop_after(stop)
        if rec.saves_seen:
            # Only where autograd's saves were seen (needed_ops): without the pack hook
            # (torch < 2.8 has no _top_saved_tensors_default_hooks) an op autograd saves
            # would look unread and come back as an empty tensor (2026-12-06: nan gradients
            # on torch 2.5/2.6 under selective policies that save matmuls).
            self._skip_dead(stop)
        needed = 0
        consumers, views = self.consumers, self.view_ops
        for op in rec.ops:
            readers = consumers.get(op.index)
            if readers:
                op.readers = tuple(sorted(readers - views if views else readers))
            if op.index >= stop:
                op.after_stop = True
                op.action = "recompute"
            if op.index in self.needed_ops:
                op.needed = True
                op.rederived = op.index in self.rederived_ops
                needed += op.bytes
        rec.needed_bytes = needed
        self._close()
        if self.run.sink is not None:
            self.run.sink(rec)

    def _drop_after(self, stop: int) -> None:
        """Note [after the last save]: what recomputation never asks for is not kept."""
        for n, entries in self.cached.items():
            if n >= stop:
                for key, idx, _ in entries:
                    self.storage[key][idx] = RECOMPUTE

    def _close(self) -> None:
        """The end of every forward, recorded or following (recompute/follow.py): the kept
        outputs told to the context, whether the replay has anything to answer, the
        bookkeeping dropped."""
        storage, ctx = self.storage, self.run.ctx
        if ctx is not None:  # Note [kept by a policy] in activations/hooks.py
            for entries in self.cached.values():
                for key, idx, _ in entries:
                    entry = storage[key].get(idx)
                    for s in (entry,) if type(entry) is _Saved else tree_leaves(entry):
                        if type(s) is _Saved and s.ctx is None and s.version is not None:
                            ctx.kept(s.value)
        # Note [a replay with nothing to answer]
        self.run.recomputes_all = all(
            e is RECOMPUTE for entries in storage.values() for e in entries.values())
        self.cached.clear()
        self.producer.clear()
        self.consumers.clear()
        self.skippable.clear()
