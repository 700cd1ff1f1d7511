"""Selective recompute: ``checkpoint(fn, *args, policy=...)`` and ``wrap(model, policy=...)``.

Built on ``torch.utils.checkpoint`` (non-reentrant) with a ``context_fn`` of two dispatch modes
of our own: during forward :class:`_SaveMode` sees every op of the region and saves the outputs
the policy keeps; during backward :class:`_ReplayMode` re-runs the region, returning the saved
outputs and recomputing everything else. Gradients are bitwise those of the region run plainly:
recomputation replays the same ops on the same inputs (and the same RNG state), and a saved
output comes back with its exact bytes.

Policies
    ``"full"``      save only the region's inputs, recompute everything (plain checkpoint).
    ``"selective"`` :class:`SelectivePolicy`: save outputs whose recompute FLOPs per byte are
                    high (matmuls, linears, fused attention), recompute the rest (elementwise,
                    norms, softmax, attention scores).
    ``"offload"``   recompute nothing: the region runs plainly and everything autograd saves
                    goes to the active ``offload_context`` (or stays, without one).
    ``"auto"``      the planner (:class:`spillover.planner.Planner`): keep, offload or recompute
                    each output from measured costs, under a device-memory budget.
    a callable      ``policy(op, inputs, output) -> "save" | "recompute"``, ``op`` an ATen
                    ``OpOverload``, ``inputs`` its positional arguments.

Note [SAC bypasses saved-tensor hooks]
    torch's own selective checkpointing keeps the op outputs it saves in a cache of plain
    references: in eager mode they never pass through ``saved_tensors_hooks``, so no offload
    hook sees them (torch's CPU-offload policies silently recompute instead). Our modes hand
    each saved output to the innermost active ``offload_context`` (``ctx.pack``) when the policy
    saves it, and take it back (``ctx.unpack``) when the region is recomputed; with no context
    active they keep plain references, as torch does. The region's inputs are saved by
    ``checkpoint`` itself through the outer hooks, so the context already sees those.

Note [never saved]
    Some outputs are always recomputed whatever the policy says: views and other aliases (free
    to recompute; saving one would pin its base), outputs of ops that write an input, and random
    ops — replay restores the RNG state once and must draw in the same order, so skipping a
    cached random op would shift every later draw. Ops with an ordered side effect are always
    saved, not replayed (as torch does). An output that a later op of the region modifies in
    place is dropped from the cache at that moment and recomputed (torch raises instead).
    Guarded by tests/python/test_recompute.py::test_random_and_inplace_ops.

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

torch.compile
    Under ``torch.compile`` a wrapped block (or a ``checkpoint`` call) compiles with torch's own
    selective checkpointing and the same save/recompute decisions (``"full"``, ``"selective"``,
    ``"offload"``, callables); the compiled graph's saved tensors reach ``offload_context``
    through autograd like any other. ``"auto"`` cannot be compiled (it learns and re-plans
    between eager steps) and raises a :class:`RuntimeError` that says to pick a fixed policy.
"""

from __future__ import annotations

import abc
import collections
import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.utils.checkpoint as _tc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from . import planner as _planner
from .context import current_context
from .planner import (
    Explanation,
    Machine,
    OpRecord,
    Planner,
    RegionRecord,
    is_compute_bound,
    op_flops,
    output_tensors,
    storage_bytes,
)

__all__ = [
    "checkpoint",
    "wrap",
    "unwrap",
    "explain",
    "SelectivePolicy",
    "Planner",
    "POLICIES",
]

POLICIES = ("full", "selective", "offload", "auto")

Policy = Union[str, Callable[..., Any], "SelectivePolicy", Planner]

aten = torch.ops.aten

_IGNORED = getattr(_tc, "SAC_IGNORED_OPS", {aten.detach.default, torch.ops.prim.device.default})
_storage_key = getattr(_tc, "_sac_storage_key", lambda func, args: func)
_is_effect = getattr(_tc, "_is_cacheable_effect", lambda op: False)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

_RECOMPUTE = object()


class _Skip:
    """Note [outputs only saved ops read]: in recomputation, an empty tensor shaped like the
    op's output stands in for running it."""

    __slots__ = ("size", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor):
        self.size, self.stride = t.size(), t.stride()
        self.dtype, self.device = t.dtype, t.device

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)
_TC_RESPECTS_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(_tc.checkpoint).parameters

_MISMATCH = (
    "The region ran different ops during recomputation than in its forward (Note [replay "
    "matching] in spillover/recompute.py): it must not depend on state that changes between "
    "forward and backward."
)


# ---- policies ------------------------------------------------------------------------------------


class _StaticPolicy(abc.ABC):
    """A fixed save/recompute rule (the base of "selective" and user callables)."""

    @abc.abstractmethod
    def decide(self, op: Any, args: Any, kwargs: Dict[str, Any], out: Any) -> str:
        """ "save" or "recompute" for one op output."""

    # Under torch.compile (see "torch.compile" above): torch's SAC with the same decisions.
    # Dynamo needs context_fn to be a function, a partial or a method of an object made outside
    # the compiled region: this bound method of a policy made by wrap() or at import is one.
    def torch_contexts(self) -> Tuple[Any, Any]:
        return _tc.create_selective_checkpoint_contexts(self.torch_policy)

    def torch_policy(self, sac_ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if _forced(func) in ("view", "mutates an input", "random"):
            return _tc.CheckpointPolicy.PREFER_RECOMPUTE
        out = getattr(sac_ctx, "op_output", None)
        if self.decide(func, args, kwargs, out) == "save":
            return _tc.CheckpointPolicy.MUST_SAVE
        return _tc.CheckpointPolicy.PREFER_RECOMPUTE


class SelectivePolicy(_StaticPolicy):
    """Save an op's output when recomputing it costs at least ``min_flops_per_byte`` FLOPs per
    byte it would hold; recompute it otherwise.

    With the default (256): linears and matmuls with a contraction of at least 512 in fp32 or
    256 in bf16 and fused attention outputs are saved; elementwise ops, norms, softmax (about
    one FLOP per element) and materialised attention scores (``2 * head_dim / element size``
    FLOPs per byte: 32 for head_dim 64 in fp32, 128 for head_dim 128 in bf16) are recomputed —
    Megatron's selective recompute.
    """

    def __init__(self, min_flops_per_byte: float = 256.0):
        self.min_flops_per_byte = float(min_flops_per_byte)

    def __call__(self, op: Any, inputs: Any, output: Any) -> str:
        return self.decide(op, inputs, {}, output)

    def decide(self, op: Any, args: Any, kwargs: Dict[str, Any], out: Any) -> str:
        if not is_compute_bound(op):
            return "recompute"
        nbytes = storage_bytes(output_tensors(out))
        if nbytes == 0:
            return "recompute"
        flops = op_flops(op, args, kwargs, out)
        return "save" if flops / nbytes >= self.min_flops_per_byte else "recompute"

    def __repr__(self) -> str:
        return f"SelectivePolicy(min_flops_per_byte={self.min_flops_per_byte:g})"


class _CallablePolicy(_StaticPolicy):
    """A user's ``policy(op, inputs, output) -> "save" | "recompute"``."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def decide(self, op: Any, args: Any, kwargs: Dict[str, Any], out: Any) -> str:
        return _normalise(self.fn(op, args, out), self.fn, op)

    def __repr__(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


class _Full:
    def __repr__(self) -> str:
        return "'full'"


class _Offload:
    def __repr__(self) -> str:
        return "'offload'"


FULL = _Full()
OFFLOAD = _Offload()
_SELECTIVE = SelectivePolicy()


def resolve_policy(policy: Policy, budget_bytes: Optional[Any] = None) -> Any:
    """A policy name or object → the object the region runner uses."""
    if isinstance(policy, str):
        name = policy.strip().lower()
        if name == "full":
            return FULL
        if name == "offload":
            return OFFLOAD
        if name == "selective":
            return _SELECTIVE
        if name == "auto":
            return Planner(budget_bytes=budget_bytes)
        raise ValueError(f"policy={policy!r}: expected one of {', '.join(POLICIES)} or a callable")
    if isinstance(policy, (_Full, _Offload, _StaticPolicy, Planner)):
        return policy
    if callable(policy):
        return _CallablePolicy(policy)
    raise TypeError(f"policy={policy!r}: expected one of {', '.join(POLICIES)} or a callable")


def _policy_name(policy: Any) -> str:
    if isinstance(policy, Planner):
        return "'auto'"
    return repr(policy)


def _normalise(decision: Any, policy: Any, op: Any) -> str:
    if isinstance(decision, _tc.CheckpointPolicy):
        return "save" if decision in (
            _tc.CheckpointPolicy.MUST_SAVE, _tc.CheckpointPolicy.PREFER_SAVE
        ) else "recompute"
    if decision is True or decision == "save":
        return "save"
    if decision is False or decision == "recompute":
        return "recompute"
    raise ValueError(
        f"policy {policy!r} returned {decision!r} for {op}: expected 'save' or 'recompute'"
    )


# ---- op classification ---------------------------------------------------------------------------

_forced_cache: Dict[Any, Optional[str]] = {}


def _forced(func: Any) -> Optional[str]:
    """Note [never saved]: why this op's output is never (or always) saved, else None."""
    try:
        return _forced_cache[func]
    except KeyError:
        pass
    why: Optional[str] = None
    schema = getattr(func, "_schema", None)
    try:
        effect = _is_effect(func)
    except Exception:
        effect = False
    if effect:
        why = "effect"
    elif schema is not None:
        if schema.is_mutable:  # in-place and out= ops (their returns alias the written input)
            why = "mutates an input"
        elif getattr(func, "is_view", False) or any(
            r.alias_info is not None for r in schema.returns
        ):
            why = "view"
        elif torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            why = "random"
    _forced_cache[func] = why
    return why


def _written_tensors(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Any]:
    written = tuple(
        args[i] if i < len(args) else kwargs.get(a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    return _tensor_args(written, {})


def _no_dropout(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            v = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            return v == 0
    return False


def _tensor_args(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _aliases_input(args: Tuple[Any, ...], out: Any) -> bool:
    outs = output_tensors(out)
    if not outs:
        return False
    ins = {_skey(a) for a in _tensor_args(args, {})}
    return any(_skey(t) in ins for t in outs)


def _skey(t: torch.Tensor) -> Tuple[Any, int]:
    return (t.device, t.untyped_storage().data_ptr())


def _producer(producer: Dict[Tuple[Any, int], int], t: torch.Tensor) -> Optional[int]:
    """The op that produced ``t``'s storage, or None (also for a tensor without a storage
    torch lets us see, e.g. a functional or sparse one)."""
    try:
        return producer.get(_skey(t))
    except (RuntimeError, NotImplementedError):
        return None


def _detach(x: Any) -> Any:
    helper = getattr(_tc, "_detach_helper", None)
    if helper is not None:
        return helper(x)
    return x.detach() if isinstance(x, torch.Tensor) else x


# ---- what a saved output becomes -----------------------------------------------------------------


class _Saved:
    """One saved op output: a plain (detached) reference, or an offload handle."""

    __slots__ = ("value", "ctx", "version")

    def __init__(self, x: Any, ctx: Any):
        self.ctx = ctx
        self.version: Optional[int] = None
        if isinstance(x, torch.Tensor):
            x = _detach(x)
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
            return _detach(v)  # a fresh alias: autograd sets its history on it
        if self.ctx is not None and self.version is not None:
            return self.ctx.unpack(v)
        return v


# ---- one region invocation -----------------------------------------------------------------------


class _Run:
    """One call of one region: what it decides, what it saved, what it recorded."""

    def __init__(
        self,
        decide: Callable[[int, Any, Tuple[Any, ...], Dict[str, Any], Any], str],
        ctx: Any,
        record: RegionRecord,
        sink: Optional[Callable[[RegionRecord], None]],
    ):
        self.decide = decide
        self.ctx = ctx
        self.record = record
        self.sink = sink
        self.storage: Dict[Any, Dict[int, Any]] = collections.defaultdict(dict)

    def contexts(self) -> Tuple[TorchDispatchMode, TorchDispatchMode]:
        return _SaveMode(self), _ReplayMode(self.storage)


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
        self.storage = run.storage
        self.counter: Dict[Any, int] = collections.defaultdict(int)
        self.n = 0
        self.last_save = 0
        # Storage -> the op that produced it, most recent first: an address can be reused once
        # its storage is freed, and a save or an in-place write refers to the live one.
        self.producer: Dict[Tuple[Any, int], int] = {}
        self.needed_ops: set = set()  # ops whose output (or a view of it) autograd saved
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
        top = _top_hooks(False) if _top_hooks is not None else None
        if top is not None:
            inner_pack, inner_unpack = top
            target = self._target = _HookTarget(self)

            def pack(x: torch.Tensor) -> Any:
                mode = target.mode
                if mode is not None:
                    mode.last_save = mode.n
                    p = _producer(mode.producer, x)
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
        if func in _IGNORED:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        key = _storage_key(func, args)
        idx = self.counter[key]
        self.counter[key] += 1
        n = self.n
        self.n += 1
        forced = _forced(func)
        if forced == "random" and _no_dropout(func, args, kwargs):
            forced = None  # fused attention with dropout_p=0 draws nothing
        if forced is None and _aliases_input(args, out):
            forced = "view"  # e.g. _unsafe_view: no alias annotation, same storage
        if forced == "mutates an input":
            self._invalidate(_written_tensors(func, args, kwargs))
        for a in _tensor_args(args, kwargs):
            p = _producer(self.producer, a)
            if p is not None:
                self.consumers[p].add(n)
        rec = self._record(n, func, args, kwargs, out, forced)
        if forced == "view":
            self.view_ops.add(n)
        if forced in ("view", "mutates an input", "random"):
            action = "recompute"
        elif forced == "effect":
            action = "keep"
        else:
            action = self.run.decide(n, func, args, kwargs, out)
        rec.action = action
        if action == "recompute":
            self.storage[key][idx] = _RECOMPUTE
            if forced is None and isinstance(out, torch.Tensor) and out.device.type != "meta":
                self.skippable[n] = (key, idx, rec, _Skip(out))
            return out
        ctx = self.run.ctx if action == "offload" else None
        self.storage[key][idx] = tree_map(lambda x: _Saved(x, ctx), out)
        self.cached.setdefault(n, []).append((key, idx, rec))
        return out

    def _record(self, n: int, func: Any, args: Any, kwargs: Any, out: Any,
                forced: Optional[str]) -> OpRecord:
        outs = output_tensors(out)
        first = outs[0] if outs else None
        nbytes = 0 if forced == "view" else storage_bytes(outs)
        if forced != "view" and forced != "mutates an input":
            for t in outs:
                if t.device.type != "meta":
                    self.producer[_skey(t)] = n
        compute = is_compute_bound(func)
        flops = op_flops(func, args, kwargs, out) if forced != "view" else 0
        moved = 0 if forced == "view" else nbytes + sum(
            a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)
        )
        rec = OpRecord(
            index=n,
            name=str(func),
            shape=tuple(first.shape) if first is not None else (),
            dtype=str(first.dtype).replace("torch.", "") if first is not None else "",
            bytes=nbytes,
            flops=flops,
            moved_bytes=moved,
            compute_bound=compute,
            forced=forced,
        )
        self.run.record.ops.append(rec)
        return rec

    def _invalidate(self, written: List[torch.Tensor]) -> None:
        """Note [never saved]: a cached output modified in place is recomputed instead."""
        for t in written:
            p = self.producer.get(_skey(t))
            for key, idx, rec in self.cached.pop(p, ()) if p is not None else ():
                entry = self.storage[key].get(idx)
                if entry is not None and entry is not _RECOMPUTE:
                    self.storage[key][idx] = _RECOMPUTE
                    rec.action = "recompute"
                    rec.reason = "modified in place later in the region"

    def _skip_dead(self, stop: int) -> None:
        """Note [outputs only saved ops read]: a recomputed op whose output autograd does not
        save, and which only saved ops (or other such ops) read, is not rerun."""
        saved = [n for n, entries in self.cached.items()
                 if any(self.storage[key].get(idx) is not _RECOMPUTE for key, idx, _ in entries)]
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
        # Note [after the last save]: drop what recomputation never asks for.
        for entries in self.cached.values():
            for key, idx, op in entries:
                if op.index >= stop and self.storage[key].get(idx) is not _RECOMPUTE:
                    self.storage[key][idx] = _RECOMPUTE
        self._skip_dead(stop)
        needed = 0
        for op in rec.ops:
            op.readers = tuple(sorted(self.consumers.get(op.index, set()) - self.view_ops))
            if op.index >= stop:
                op.after_stop = True
                op.action = "recompute"
            if op.index in self.needed_ops:
                op.needed = True
                needed += op.bytes
        rec.needed_bytes = needed
        self.cached.clear()
        self.producer.clear()
        self.consumers.clear()
        self.skippable.clear()
        if self.run.sink is not None:
            self.run.sink(rec)


class _ReplayMode(TorchDispatchMode):
    """Recompute: saved outputs come back (unpacked if offloaded), every other op runs again."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, storage: Dict[Any, Dict[int, Any]]):
        super().__init__()
        self.storage = storage
        self.counter: Dict[Any, int] = collections.defaultdict(int)

    def __enter__(self) -> _ReplayMode:
        self.counter.clear()  # each recomputation (retain_graph=True: several) starts over
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        key = _storage_key(func, args)
        idx = self.counter[key]
        self.counter[key] += 1
        entry = self.storage.get(key, {}).get(idx)
        if entry is None:
            raise RuntimeError(
                f"spillover.checkpoint: {func} (call {idx + 1}) ran during recomputation but "
                f"not in the forward. {_MISMATCH}"
            )
        if entry is _RECOMPUTE:
            return func(*args, **kwargs)
        if isinstance(entry, _Skip):
            return entry.make()
        return tree_map(lambda s: s.get() if isinstance(s, _Saved) else s, entry)


# ---- running a region ----------------------------------------------------------------------------


def _input_bytes(args: Tuple[Any, ...]) -> int:
    ts = [a for a in args if isinstance(a, torch.Tensor) and not (a.is_leaf and a.requires_grad)]
    return storage_bytes(ts)


def _device_of(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            d = a.device
            return f"cuda:{d.index if d.index is not None else torch.cuda.current_device()}" \
                if d.type == "cuda" else d.type
    return "cpu"


def _key_of(fn: Callable[..., Any]) -> Any:
    target = getattr(fn, "__self__", None)
    if target is not None:
        return ("method", id(target), getattr(fn, "__name__", ""))
    if isinstance(fn, functools.partial):
        return ("partial", _key_of(fn.func), tuple(id(a) for a in fn.args))
    return ("fn", id(fn))


def _note_backward_on(out: Any, planner: Planner) -> None:
    for t in output_tensors(out) if not isinstance(out, dict) else list(out.values()):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(lambda grads: planner.note_backward())
            return


def _identity(x: Any) -> Any:
    return x


def _compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling and is_compiling())


def _compiled_checkpoint(fn: Callable[..., Any], args: Tuple[Any, ...],
                         kwargs: Dict[str, Any], pol: Any) -> Any:
    """Under torch.compile: torch's selective checkpointing with the same decisions."""
    if isinstance(pol, Planner):
        raise RuntimeError(
            "spillover: policy='auto' cannot run under torch.compile: the planner learns from "
            "eager steps and re-plans when shapes change. Compile with a fixed policy instead "
            "(spillover.wrap(model, policy='selective' | 'full' | 'offload' | callable)), or "
            "leave the wrapped blocks out of the compiled region."
        )
    if pol is OFFLOAD:
        return fn(*args, **kwargs)
    if pol is FULL:
        return _tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    # If Dynamo falls back to eager here, torch's SAC must still hand what it saves to the
    # offload hooks (Note [SAC bypasses saved-tensor hooks]): opt in where torch can.
    extra = {"respect_saved_tensors_hooks": True} if _TC_RESPECTS_HOOKS else {}
    return _tc.checkpoint(fn, *args, use_reentrant=False, context_fn=pol.torch_contexts,
                          **extra, **kwargs)


def _checkpoint(
    fn: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    pol: Any,
    key: Any = None,
    name: str = "",
    state: Optional[_WrapState] = None,
) -> Any:
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if _compiling():
        return _compiled_checkpoint(fn, args, kwargs, pol)
    ctx = current_context()
    device = _device_of(args, kwargs)
    if pol is OFFLOAD or pol is FULL:
        if state is not None:
            state.add_record(RegionRecord(key, name, None, device,
                                          "plain" if pol is OFFLOAD else "full",
                                          input_bytes=_input_bytes(args)))
        if pol is OFFLOAD:
            return fn(*args, **kwargs)
        return _tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    if isinstance(pol, Planner):
        key = key if key is not None else _key_of(fn)
        sig, rplan = pol.region_plan(key, args, kwargs, ctx)
        if state is not None and state.counting is not None:
            state.counting.exclude(args)
        record = RegionRecord(key, name or str(key), sig, device, "checkpoint",
                              input_bytes=_input_bytes(args),
                              offload=_planner.ctx_offload_info(ctx))
        if rplan is not None and rplan.mode == "plain-keep":
            if ctx is not None:  # keep everything: the context must not see these tensors
                with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
            if not pol.explicit_steps:
                _note_backward_on(out, pol)
            return out
        decide = _planned_decider(pol, rplan) if rplan is not None else _learning_decider
        run = _Run(decide, ctx, record, pol.add_record)
    else:
        record = RegionRecord(key, name, None, device, "checkpoint",
                              input_bytes=_input_bytes(args))
        decide = _static_decider(pol, ctx)
        run = _Run(decide, ctx, record, state.add_record if state is not None else None)
    out = _tc.checkpoint(fn, *args, use_reentrant=False, context_fn=run.contexts, **kwargs)
    if isinstance(pol, Planner) and not pol.explicit_steps:
        _note_backward_on(out, pol)
    return out


def _learning_decider(n: int, func: Any, args: Any, kwargs: Any, out: Any) -> str:
    return "recompute"


def _planned_decider(planner: Planner, rplan: Any) -> Callable[..., str]:
    actions = rplan.actions

    def decide(n: int, func: Any, args: Any, kwargs: Any, out: Any) -> str:
        act = actions.get(n)
        if act is None or act[0] != str(func):
            planner.mark_stale()
            return "recompute"
        return act[1]

    return decide


def _static_decider(pol: _StaticPolicy, ctx: Any) -> Callable[..., str]:
    saved = "offload" if ctx is not None else "keep"

    def decide(n: int, func: Any, args: Any, kwargs: Any, out: Any) -> str:
        return saved if pol.decide(func, args, kwargs, out) == "save" else "recompute"

    return decide


def checkpoint(fn: Callable[..., Any], *args: Any, policy: Policy = "selective",
               **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as one recompute region.

    What the region saves for backward follows ``policy`` (see the module docstring). Saved
    outputs go to the innermost active ``offload_context`` when there is one. Gradients are
    bitwise those of ``fn`` run plainly. A region may be backwarded several times
    (``retain_graph=True``); it must run the same ops in recompute as in its forward.

    ``policy`` may also be a :class:`Planner` shared by several calls; ``"auto"`` uses one
    planner per call site of this process.
    """
    if isinstance(policy, str) and policy.strip().lower() == "auto":
        pol: Any = _default_planner()
    else:
        pol = resolve_policy(policy)
    return _checkpoint(fn, args, kwargs, pol)


_DEFAULT_PLANNER: Optional[Planner] = None


def _default_planner() -> Planner:
    global _DEFAULT_PLANNER
    if _DEFAULT_PLANNER is None:
        _DEFAULT_PLANNER = Planner()
    return _DEFAULT_PLANNER


# ---- wrap ----------------------------------------------------------------------------------------


class _CountingHooks:
    """During a planner's learning step, counts the bytes the model saves outside its regions
    (passing every tensor on to whatever hooks were active, e.g. an offload_context)."""

    def __init__(self, model: nn.Module):
        top = _top_hooks(False) if _top_hooks is not None else None
        self.inner = top
        self.params = {_skey(p) for p in model.parameters()} | {
            _skey(b) for b in model.buffers()
        }
        self.excluded: set = set()
        self.seen: set = set()
        self.bytes = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def exclude(self, args: Tuple[Any, ...]) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self.excluded.add(_skey(a))

    def pack(self, t: torch.Tensor) -> Any:
        try:
            k = _skey(t)
        except (RuntimeError, NotImplementedError):
            k = None
        if k is not None and k not in self.params and k not in self.excluded \
                and k not in self.seen and not (t.is_leaf and t.requires_grad):
            self.seen.add(k)
            self.bytes += t.untyped_storage().nbytes()
        return self.inner[0](t) if self.inner is not None else t

    def unpack(self, h: Any) -> torch.Tensor:
        return self.inner[1](h) if self.inner is not None else h


class _WrapState:
    """What ``wrap`` attaches to a model: the policy, its blocks, the last step's records."""

    def __init__(self, model: nn.Module, policy: Any, blocks: List[Tuple[str, nn.Module]]):
        self.policy = policy
        self.blocks = blocks
        self.records: List[RegionRecord] = []
        self.step_records: List[RegionRecord] = []
        self.counting: Optional[_CountingHooks] = None
        self.handles: List[Any] = []
        self.model_ref = model

    def add_record(self, rec: RegionRecord) -> None:
        self.step_records.append(rec)

    def pre_forward(self, model: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or _compiling():
            return
        if self.step_records:
            self.records = self.step_records
        self.step_records = []
        pol = self.policy
        if isinstance(pol, Planner):
            pol.begin_step()
            if pol.learning:
                self.counting = _CountingHooks(model)
                self.counting.hooks.__enter__()

    def post_forward(self, model: nn.Module, args: Any, out: Any) -> None:
        if self.counting is not None:
            c, self.counting = self.counting, None
            c.hooks.__exit__(None, None, None)
            if isinstance(self.policy, Planner):
                self.policy.outside_bytes = c.bytes

    def last_records(self) -> List[RegionRecord]:
        return self.step_records or self.records


class _WrappedBlock:
    """Mixin put in front of a wrapped block's class: its forward runs as a recompute region."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state, name = self.__dict__["_spillover_block"]
        inner = super().forward  # type: ignore[misc]
        return _checkpoint(inner, args, kwargs, state.policy, key=name, name=name, state=state)


_wrapped_classes: Dict[type, type] = {}


def _wrapped_class(cls: type) -> type:
    if issubclass(cls, _WrappedBlock):
        return cls
    new = _wrapped_classes.get(cls)
    if new is None:
        new = _wrapped_classes[cls] = type(f"Spillover{cls.__name__}", (_WrappedBlock, cls), {})
    return new


def _find_blocks(model: nn.Module,
                 check_fn: Optional[Callable[[nn.Module], bool]]) -> List[Tuple[str, nn.Module]]:
    if check_fn is not None:
        picked: List[Tuple[str, nn.Module]] = []
        for name, m in model.named_modules():
            if m is model or any(name.startswith(p + ".") for p, _ in picked):
                continue
            if check_fn(m):
                picked.append((name, m))
        return picked
    best: Optional[Tuple[str, nn.ModuleList]] = None
    best_size = (0, 0)
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            size = (len(m), sum(p.numel() for p in m.parameters()))
            if size > best_size:
                best, best_size = (name, m), size
    if best is None:
        return []
    prefix = best[0] + "." if best[0] else ""
    return [(f"{prefix}{i}", child) for i, child in enumerate(best[1])]


def wrap(
    model: nn.Module,
    policy: Policy = "selective",
    check_fn: Optional[Callable[[nn.Module], bool]] = None,
    *,
    budget_bytes: Optional[Union[int, str]] = None,
) -> nn.Module:
    """Make each repeated block of ``model`` a recompute region, in place; returns ``model``.

    Blocks are the children of the model's largest ``nn.ModuleList`` (GPT-style ``blocks``,
    HuggingFace ``model.layers``), or the outermost modules for which ``check_fn(module)`` is
    true. Each block's class is swapped for a subclass whose ``forward`` runs the original one
    under :func:`checkpoint`; parameters, buffers, hooks and ``state_dict`` keys do not change.

    Args:
        policy: see the module docstring; ``"auto"`` makes a :class:`Planner` for this model.
        check_fn: picks the blocks instead of the largest ``ModuleList``.
        budget_bytes: device-memory budget of ``"auto"`` (default
            SPILLOVER_DEVICE_BUDGET_BYTES, else half of free memory).

    Raises:
        ValueError: no blocks found, or the model is already wrapped.

    HuggingFace models: training with ``use_cache=True`` would update the KV cache again
    during recomputation; as HF's own gradient checkpointing does, ``wrap`` turns
    ``config.use_cache`` off (with a warning).
    """
    if "_spillover_state" in model.__dict__:
        raise ValueError("this model is already wrapped; call spillover.unwrap(model) first")
    if isinstance(policy, str) and policy.strip().lower() == "auto":
        pol: Any = Planner(budget_bytes=budget_bytes)
    else:
        if budget_bytes is not None:
            raise ValueError("budget_bytes= is for policy='auto'")
        pol = resolve_policy(policy)
    blocks = _find_blocks(model, check_fn)
    if not blocks:
        raise ValueError(
            "spillover.wrap found no blocks: the model has no non-empty nn.ModuleList; pass "
            "check_fn=lambda m: isinstance(m, YourBlock) to choose them"
        )
    state = _WrapState(model, pol, blocks)
    if isinstance(pol, Planner) and type(model).forward is not nn.Module.forward:
        pol.explicit_steps = True  # the model's forward hooks mark steps (containers have none)
    for name, blk in blocks:
        blk.__class__ = _wrapped_class(type(blk))
        blk.__dict__["_spillover_block"] = (state, name)
    state.handles = [
        model.register_forward_pre_hook(state.pre_forward),
        model.register_forward_hook(state.post_forward, always_call=True),
    ]
    model.__dict__["_spillover_state"] = state
    cfg = getattr(model, "config", None)
    if getattr(cfg, "use_cache", False) is True:
        import warnings

        warnings.warn(
            "spillover.wrap: setting config.use_cache=False (recomputed blocks would update the "
            "KV cache twice), as HuggingFace gradient checkpointing does",
            stacklevel=2,
        )
        cfg.use_cache = False
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap` in place; returns ``model``."""
    state: Optional[_WrapState] = model.__dict__.pop("_spillover_state", None)
    if state is None:
        return model
    for h in state.handles:
        h.remove()
    for _name, blk in state.blocks:
        blk.__dict__.pop("_spillover_block", None)
        cls = type(blk)
        if issubclass(cls, _WrappedBlock):
            blk.__class__ = cls.__mro__[2]  # (Spillover<cls>, _WrappedBlock, cls, ...)
    return model


def explain(target: Any, machine: Optional[Machine] = None) -> Explanation:
    """What the last step of a wrapped model (or a :class:`Planner`) decided, per op kind, with
    bytes and estimated costs. ``print(spillover.explain(model))`` shows a table.

    Costs use this machine's calibration (measured on first use) unless ``machine`` is given.
    """
    if isinstance(target, Planner):
        planner: Optional[Planner] = target
        state = None
    else:
        state = target.__dict__.get("_spillover_state") if isinstance(target, nn.Module) else None
        if state is None:
            raise ValueError("spillover.explain: pass a model returned by spillover.wrap "
                             "or a spillover.Planner")
        planner = state.policy if isinstance(state.policy, Planner) else None
    if planner is not None:
        recs = planner.planned_records if planner.plan is not None else planner.last_records
        if not recs:
            recs = planner._records
        device = recs[0].device if recs else "cpu"
        m = machine or (planner.machine(device) if recs else None)
        policy = "auto" + ("" if planner.plan is not None else " (learning: no plan yet)")
        return _planner.explain_records(recs, policy, m, planner.plan, planner.outside_bytes)
    assert state is not None
    recs = state.last_records()
    for r in recs:
        for o in r.ops:
            if not o.reason and not o.forced and not o.after_stop:
                o.reason = _static_reason(state.policy, o)
    device = recs[0].device if recs else "cpu"
    m = machine or (_planner.machine_for(device) if recs else None)
    return _planner.explain_records(recs, _policy_name(state.policy), m)


def _static_reason(policy: Any, o: OpRecord) -> str:
    saved = o.action in ("keep", "offload")
    if isinstance(policy, SelectivePolicy):
        if not o.compute_bound:
            return "memory-bound op: cheap to recompute"
        sign = ">=" if saved else "<"
        return f"{o.flops_per_byte:.0f} FLOP/B {sign} {policy.min_flops_per_byte:g}"
    return f"the policy returned {'save' if saved else 'recompute'}"
