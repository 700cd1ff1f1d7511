"""Region policies: what a recompute region saves, and how it runs.

Every policy is a :class:`RegionPolicy` (base.py); the region runner and ``wrap`` only call
its methods. Here: the fixed policies, selective and user callables; ``"auto"`` is auto.py's.
:func:`resolve_policy` turns what users pass (a name, a callable, a :class:`Planner`) into one.

Note [torch.compile]
    Under ``torch.compile`` a wrapped block (or a ``checkpoint`` call) compiles with torch's own
    selective checkpointing and the same save/recompute decisions (``"full"``, ``"selective"``,
    ``"offload"``, callables); the compiled graph's saved tensors reach ``offload_context``
    through autograd like any other. ``"auto"`` cannot be compiled (it learns and re-plans
    between eager steps) and raises a :class:`RuntimeError` that says to pick a fixed policy.
"""

from __future__ import annotations

import abc
import inspect
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple, Union

import torch.utils.checkpoint as _tc

from .. import planner as _planner
from ..activations import current_context
from ..planner import (
    Machine,
    OpRecord,
    Planner,
    RegionRecord,
    is_compute_bound,
    op_flops,
    output_tensors,
    storage_bytes,
)
from . import follow as _follow
from .auto import _Auto
from .base import RegionPolicy, _sac
from .modes import Decider, _Run
from .ops import device_of, forced, input_bytes, key_of

if TYPE_CHECKING:
    from .blocks import _WrapState

POLICIES = ("full", "selective", "offload", "auto")

_TC_RESPECTS_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(_tc.checkpoint).parameters


# ---- fixed policies ------------------------------------------------------------------------------


class _Full(RegionPolicy):
    """Save only the region's inputs, recompute everything (plain checkpoint)."""

    def run(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
            key: Any, name: str, state: Optional[_WrapState]) -> Any:
        if state is not None:
            state.add_record(RegionRecord(key, name, None, device_of(args, kwargs), "full",
                                          input_bytes=input_bytes(args)))
        return _tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def compiled(self, fn: Callable[..., Any], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Any:
        return _tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    def __repr__(self) -> str:
        return "'full'"


class _Offload(RegionPolicy):
    """Recompute nothing: the region runs plainly, and what autograd saves goes to the active
    ``offload_context`` (or stays, without one)."""

    def run(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
            key: Any, name: str, state: Optional[_WrapState]) -> Any:
        if state is not None:
            state.add_record(RegionRecord(key, name, None, device_of(args, kwargs), "plain",
                                          input_bytes=input_bytes(args)))
        return fn(*args, **kwargs)

    def compiled(self, fn: Callable[..., Any], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Any:
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return "'offload'"


def _contexts_of(policy: _StaticPolicy) -> Callable[[], Tuple[Any, Any]]:
    # Note [context_fn under Dynamo]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Dynamo turns the checkpoint's context_fn into a constant of the graph it compiles and
    # calls it again when AOT traces the region. torch 2.8 to 2.1x keep a bound method's
    # function but not its object ("torch_contexts() missing 1 required positional argument:
    # 'self'"); the newest keeps both. A plain function made outside the compiled region,
    # with the policy in its closure, is a constant on every torch: made when the policy is.
    def torch_contexts() -> Tuple[Any, Any]:
        return _tc.create_selective_checkpoint_contexts(policy.torch_policy)

    return torch_contexts


class _StaticPolicy(RegionPolicy):
    """A fixed save/recompute rule per op output (the base of "selective" and user callables):
    saved outputs go to the active ``offload_context``, or are kept without one."""

    @abc.abstractmethod
    def decide(self, op: Any, args: Any, kwargs: Dict[str, Any], out: Any) -> str:
        """ "save" or "recompute" for one op output."""

    def run(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
            key: Any, name: str, state: Optional[_WrapState]) -> Any:
        ctx = current_context()
        record = RegionRecord(key, name, None, device_of(args, kwargs), "checkpoint",
                              input_bytes=input_bytes(args))
        return self._follow(fn, args, kwargs, self._slot(state, key, fn), self._decider(ctx),
                            ctx, record, state.add_record if state is not None else None)

    def _slot(self, state: Optional[_WrapState], key: Any, fn: Callable[..., Any]) -> Any:
        """(the wrapped model's state or 0, the region's key): one policy object may serve
        several models, whose blocks share names."""
        key = key if key is not None else key_of(fn)
        if state is not None and not hasattr(state, "_selective_key"):
            state._selective_key = id(state)  # type: ignore[union-attr]
            weakref.finalize(state, self._forget, id(state))
        return (state._selective_key if state is not None else 0, key)  # type: ignore[union-attr]

    def _forget(self, owner: int) -> None:
        templates = self.__dict__.get("_templates", {})
        for slot in [k for k in templates if k[0] == owner]:
            del templates[slot]

    def _follow(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
                slot: Any, decider: Decider, ctx: Any, record: RegionRecord,
                add: Optional[Callable[[RegionRecord], None]]) -> Any:
        """Run the region recorded, its record kept for the runs after it, or following the
        record of its last recorded run (Note [a forward that follows its record] in
        follow.py); ``add`` receives the record either way (``explain`` shows it)."""
        templates = self.__dict__.setdefault("_templates", {})  # (unpickled from before it)
        tpl = templates.get(slot)
        if tpl is None:

            def keep(rec: RegionRecord) -> None:
                templates[slot] = _follow.Template(rec)
                if add is not None:
                    add(rec)
            return _sac(fn, args, kwargs, _Run(decider, ctx, record, keep).contexts)

        def end(followed: bool) -> None:
            if not followed:
                templates.pop(slot, None)  # the next run records
            if add is not None:
                add(tpl.record)  # type: ignore[union-attr]
        return _sac(fn, args, kwargs,
                    _follow.following_contexts(_Run(decider, ctx, record, None), tpl, None, end))

    def _decider(self, ctx: Any) -> Decider:
        saved = "offload" if ctx is not None else "keep"
        decide = self.decide

        def decider(n: int, func: Any, args: Any, kwargs: Any, out: Any) -> str:
            return saved if decide(func, args, kwargs, out) == "save" else "recompute"

        return decider

    def compiled(self, fn: Callable[..., Any], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Any:
        # If Dynamo falls back to eager here, torch's SAC must still hand what it saves to the
        # offload hooks (Note [SAC bypasses saved-tensor hooks]): opt in where torch can.
        extra = {"respect_saved_tensors_hooks": True} if _TC_RESPECTS_HOOKS else {}
        return _tc.checkpoint(fn, *args, use_reentrant=False, context_fn=self.torch_contexts,
                              **extra, **kwargs)

    # torch_contexts: torch's selective-checkpoint contexts for this policy, the context_fn
    # of torch.utils.checkpoint under torch.compile; an attribute of each policy, made with
    # it (Note [context_fn under Dynamo]); copies and pickles make their own.
    torch_contexts: Callable[[], Tuple[Any, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> _StaticPolicy:
        self = super().__new__(cls)
        self.torch_contexts = _contexts_of(self)
        return self

    def __getstate__(self) -> Dict[str, Any]:
        # Note [pickling a wrapped model] in blocks.py: the records its regions follow are
        # keyed by ids of this process; the loaded model's record again
        return {k: v for k, v in self.__dict__.items() if k not in ("torch_contexts", "_templates")}

    def torch_policy(self, sac_ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if forced(func) in ("view", "mutates an input", "random", "allocates only"):
            return _tc.CheckpointPolicy.PREFER_RECOMPUTE
        out = getattr(sac_ctx, "op_output", None)
        if self.decide(func, args, kwargs, out) == "save":
            return _tc.CheckpointPolicy.MUST_SAVE
        return _tc.CheckpointPolicy.PREFER_RECOMPUTE


class SelectivePolicy(_StaticPolicy):
    """Save an op's output when recomputing it costs at least ``min_flops_per_byte`` FLOPs per
    byte it would hold; recompute it otherwise — then, from a region's second call on, also
    save the outputs whose rebuilding pays less than full recompute does (Note [selective
    pays] in planner/cost.py), priced with this machine's calibration.

    With the default (256): linears and matmuls with a contraction of at least 512 in fp32 or
    256 in bf16 and fused attention outputs are saved; elementwise ops, norms, GELU/SiLU,
    residual adds and dropout are recomputed. Materialised attention scores (``2 * head_dim /
    element size`` FLOPs per byte) start recomputed, as Megatron's selective recompute does;
    where this machine rebuilds the softmax and the chain before it more slowly per byte than
    it rebuilds a whole block (memory-bound ops slow next to matmuls, as on a CPU), the softmax
    output is saved instead and its chain is never rerun. Under ``torch.compile`` the FLOP rule
    alone decides.

    Args:
        min_flops_per_byte: the FLOP rule's bar.
        refine: apply Note [selective pays] (False: the FLOP rule alone, deterministic without
            a calibration).
        machine: the rates to price ops with (default: this machine's calibration, measured
            on first use and cached).
    """

    def __init__(self, min_flops_per_byte: float = 256.0, refine: bool = True,
                 machine: Optional[Machine] = None):
        self.min_flops_per_byte = float(min_flops_per_byte)
        self.refine = refine
        self.machine = machine
        # (wrapped model's state or 0, region key) -> {op index: (op name, why it is saved)},
        # learned from the region's first call
        self._saved: Dict[Any, Dict[int, Tuple[str, str]]] = {}

    def __call__(self, op: Any, inputs: Any, output: Any) -> str:
        return self.decide(op, inputs, {}, output)

    def __getstate__(self) -> Dict[str, Any]:
        # Pickled with a wrapped model (Note [pickling a wrapped model] in blocks.py): what it
        # learned is keyed by ids of this process and priced with this machine's rates; the
        # loaded model's blocks learn again on their first call.
        return {**super().__getstate__(), "_saved": {}}

    def decide(self, op: Any, args: Any, kwargs: Dict[str, Any], out: Any) -> str:
        if not is_compute_bound(op):
            return "recompute"
        nbytes = storage_bytes(output_tensors(out))
        if nbytes == 0:
            return "recompute"
        flops = op_flops(op, args, kwargs, out)
        return "save" if flops / nbytes >= self.min_flops_per_byte else "recompute"

    def run(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
            key: Any, name: str, state: Optional[_WrapState]) -> Any:
        if not self.refine:
            return super().run(fn, args, kwargs, key, name, state)
        ctx = current_context()
        key = key if key is not None else key_of(fn)
        record = RegionRecord(key, name, None, device_of(args, kwargs), "checkpoint",
                              input_bytes=input_bytes(args))
        slot = self._slot(state, key, fn)
        learned = self._saved.get(slot)
        add = state.add_record if state is not None else None
        if learned is None:
            decider = self._decider(ctx)

            def sink(rec: RegionRecord) -> None:
                self._learn(slot, rec)
                if add is not None:
                    add(rec)
            return _sac(fn, args, kwargs, _Run(decider, ctx, record, sink).contexts)
        # the first refined run is recorded, the runs after it follow it
        return self._follow(fn, args, kwargs, slot, self._refined(ctx, learned), ctx, record,
                            add)

    def _forget(self, owner: int) -> None:
        super()._forget(owner)
        for slot in [k for k in self._saved if k[0] == owner]:
            del self._saved[slot]

    def _learn(self, key: Any, rec: RegionRecord) -> None:
        machine = self.machine or _planner.machine_for(rec.device)
        why = _planner.worth_saving(rec, machine)
        names = {o.index: o.name for o in rec.ops}
        self._saved[key] = {i: (names[i], w) for i, w in why.items()}

    def _refined(self, ctx: Any, learned: Dict[int, Tuple[str, str]]) -> Decider:
        saved = "offload" if ctx is not None else "keep"
        decide = self.decide

        def decider(n: int, func: Any, args: Any, kwargs: Any, out: Any) -> str:
            hit = learned.get(n)
            if hit is not None and hit[0] == str(func):
                return saved
            return saved if decide(func, args, kwargs, out) == "save" else "recompute"

        return decider

    def reason(self, op: OpRecord) -> str:
        for learned in self._saved.values():
            hit = learned.get(op.index)
            if hit is not None and hit[0] == op.name and op.action in ("keep", "offload"):
                return hit[1]
        if not op.compute_bound:
            return "memory-bound op: cheap to recompute"
        sign = ">=" if op.action in ("keep", "offload") else "<"
        return f"{op.flops_per_byte:.0f} FLOP/B {sign} {self.min_flops_per_byte:g}"

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


# ---- names to policies ---------------------------------------------------------------------------

FULL = _Full()
OFFLOAD = _Offload()
_SELECTIVE = SelectivePolicy()

Policy = Union[str, Callable[..., Any], RegionPolicy, Planner]


def resolve_policy(policy: Policy, budget_bytes: Optional[Any] = None) -> RegionPolicy:
    """A policy name or object → the :class:`RegionPolicy` the region runner uses."""
    if isinstance(policy, str):
        name = policy.strip().lower()
        if name == "full":
            return FULL
        if name == "offload":
            return OFFLOAD
        if name == "selective":
            return _SELECTIVE
        if name == "auto":
            return _Auto(Planner(budget_bytes=budget_bytes))
        raise ValueError(f"policy={policy!r}: expected one of {', '.join(POLICIES)} or a callable")
    if isinstance(policy, RegionPolicy):
        return policy
    if isinstance(policy, Planner):
        return _Auto(policy)
    if callable(policy):
        return _CallablePolicy(policy)
    raise TypeError(f"policy={policy!r}: expected one of {', '.join(POLICIES)} or a callable")
