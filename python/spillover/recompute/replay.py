"""The replay: what a region's recomputation hands back in backward (the cache entries the
forward's :class:`~spillover.recompute.modes._SaveMode` left) and :class:`_ReplayMode`, which
answers from them.

Note [a kept output goes with its use]
    A kept op output is the replay's to hand back once: from then on the recomputed graph
    holds it, as it holds what the replay reran, and autograd frees it when the node that
    reads it has run. The replay used to keep its own reference until the region's backward
    ended, for a second backward (``retain_graph=True``), so a kept output lived on while the
    rest of the region's backward made its gradients: on the CPU GPT 4x256 (seq 512, batch 4,
    explicit attention) a callable keeping every softmax, addmm and bmm output peaked at
    253.0 MiB, 232.5 MiB once the replay gives them up (selective: 134.8 and 132.8, with the
    stand-ins below). So the first replay gives up each kept entry it answers (``CONSUMED``),
    as torch's own selective checkpointing does. torch then refuses a second backward; here
    a later replay of a region that gave entries up runs every op again (kept, consumed or
    skipped alike, Note [outputs only saved ops read] in modes.py) from the region's inputs
    and RNG state: full recomputation, bitwise the same. Entries it does not give up:
    offloaded ones (the context's, in host memory) and outputs of ops with side effects
    (never rerun).

Note [stand-ins share one buffer]
    A skipped op's stand-in (Note [outputs only saved ops read] in modes.py) is read by no op
    that runs: its readers are answered from the cache, or skipped too. Each used to be a
    fresh ``empty_strided``, and a chain of them (the scores matmul, scaling and masking
    under a kept softmax) held as much as rerunning the chain does: on the simulated H200
    (GPT 4x128, seq 256, explicit attention) a plan keeping every output autograd saves in
    the last block made 9.5 MiB of stand-ins in its replay, three alive at once, and the
    step peaked at 23.9 MiB, 20.6 MiB with one buffer. So a replay makes them as views (one
    ``as_strided``, the one op ``empty_strided`` was) of one buffer per device and dtype, as
    large as its largest stand-in, with the stand-in's shape and strides (what the views and
    checks that do run see); the buffer is dropped when the replay ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .ops import _INFO, IGNORED, INDUCTOR_CODE, detach, op_info, storage_key

if TYPE_CHECKING:
    from .modes import _Run

#: A cache entry: the op runs again in recomputation.
RECOMPUTE = object()
#: A cache entry the first replay handed back and gave up (Note [a kept output goes with its
#: use]): a later replay runs the op again.
CONSUMED = object()


_MISMATCH = (
    "The region ran different ops during recomputation than in its forward (Note [replay "
    "matching] in spillover/recompute/modes.py): it must not depend on state that changes "
    "between forward and backward."
)


class _Skip:
    """Note [outputs only saved ops read]: in recomputation, an empty tensor shaped like the
    op's output stands in for running it."""

    __slots__ = ("size", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor):
        self.size, self.stride = t.size(), t.stride()
        self.dtype, self.device = t.dtype, t.device

    def make(self, scratch: Dict[Any, torch.Tensor]) -> torch.Tensor:
        """The stand-in: a view of the replay's one buffer for this device and dtype
        (``scratch``, Note [stand-ins share one buffer])."""
        span = 1 + sum((n - 1) * st for n, st in zip(self.size, self.stride)) \
            if all(self.size) else 0
        key = (self.device, self.dtype)
        buf = scratch.get(key)
        if buf is None or buf.numel() < span:
            buf = scratch[key] = torch.empty(max(span, 1), dtype=self.dtype,
                                             device=self.device)
        return buf.as_strided(self.size, self.stride)


class _Saved:
    """One saved op output: a plain (detached) reference, or an offload handle."""

    __slots__ = ("value", "ctx", "version")

    def __init__(self, x: Any, ctx: Any):
        self.ctx = ctx
        self.version: Optional[int] = None
        if isinstance(x, torch.Tensor):
            x = detach(x)
            self.version = x._version
            if ctx is not None:
                x = ctx.pack(x)  # a handle, or x itself when the context keeps it
        self.value = x

    def get(self) -> Any:
        v = self.value
        if isinstance(v, torch.Tensor):
            if v._version != self.version:
                raise RuntimeError(
                    "spillover.checkpoint: a tensor the region saved has been modified in place "
                    "after the region's forward; recomputation would see the modified bytes. "
                    "Clone it before modifying it, or use an out-of-place op."
                )
            return detach(v)  # a fresh alias: autograd sets its history on it
        if self.ctx is not None and self.version is not None:
            return self.ctx.unpack(v)
        return v


#: Note [a replay's host time is the region's] (planner/machine.py): when set, called with each
#: op a replay answers without running it (a kept or offloaded output), whose dispatch the
#: host pays all the same; the estimate's tracker charges it (estimate/trace.py). None in a
#: training run.
ANSWERED: Optional[Callable[[Any], None]] = None


class _ReplayMode(TorchDispatchMode):
    """Recompute: saved outputs come back (unpacked if offloaded), every other op runs again."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, storage: Dict[Any, Dict[int, Any]], run: Optional[_Run] = None):
        super().__init__()
        self.storage = storage
        self.run = run
        self.counter: Dict[Any, int] = {}
        self._pushed: List[bool] = []
        #: Note [a kept output goes with its use]: replays begun, and whether this one reruns
        #: everything (a later one, after the first gave entries up)
        self.replays = 0
        self.gave_up = False
        self.rerun_all = False
        #: Note [stand-ins share one buffer]: per device, during a replay
        self.scratch: Dict[Any, torch.Tensor] = {}

    def __enter__(self) -> _ReplayMode:
        self.counter.clear()  # each recomputation (retain_graph=True: several) starts over
        self.replays += 1
        self.rerun_all = self.gave_up
        # Note [a replay with nothing to answer] in modes.py
        push = self.run is None or not self.run.recomputes_all
        self._pushed.append(push)
        return super().__enter__() if push else self

    def __exit__(self, *exc: Any) -> None:
        self.scratch.clear()  # (the stand-ins still alive keep their storage)
        if self._pushed.pop():
            super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in IGNORED:
            return func(*args, **kwargs)
        key = func if func is not INDUCTOR_CODE else storage_key(func, args)
        idx = self.counter.get(key, 0)
        self.counter[key] = idx + 1
        entries = self.storage.get(key)
        entry = entries.get(idx) if entries is not None else None
        if entry is None:
            raise RuntimeError(
                f"spillover.checkpoint: {func} (call {idx + 1}) ran during recomputation but "
                f"not in the forward. {_MISMATCH}"
            )
        if entry is RECOMPUTE or entry is CONSUMED or (self.rerun_all and _rerunnable(func)):
            return func(*args, **kwargs)
        if isinstance(entry, _Skip):
            return entry.make(self.scratch)
        if ANSWERED is not None:
            ANSWERED(func)
        if type(entry) is _Saved:
            out = entry.get()
        else:
            out = tree_map(lambda s: s.get() if isinstance(s, _Saved) else s, entry)
        if self.replays == 1 and _held(entry) and _rerunnable(func):
            entries[idx] = CONSUMED  # Note [a kept output goes with its use]
            self.gave_up = True
        return out


def _held(entry: Any) -> bool:
    """An entry of plain references only (kept on the device, nothing offloaded)."""
    if type(entry) is _Saved:
        return entry.ctx is None
    return all(s.ctx is None for s in tree_leaves(entry, is_leaf=lambda x: isinstance(x, _Saved))
               if isinstance(s, _Saved))


def _rerunnable(func: Any) -> bool:
    """Not an op with side effects (Note [a kept output goes with its use])."""
    info = _INFO.get(func) or op_info(func)
    return info.forced != "effect"
