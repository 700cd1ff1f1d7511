"""One training step run on fake tensors, and what it allocates, saves and computes.

:func:`.fakes.fake_copy` makes a copy of a model whose parameters and buffers are fake tensors (no
memory, no data) on the traced device; :func:`run_step` runs forward, the loss, backward and the
optimizer step on it under a :class:`Tracker`, which follows every storage the step allocates
and when it is freed. The result, a :class:`Trace`, is what :mod:`spillover.estimate.modes`
turns into each mode's figures.

Note [live storages]
    The device peak is the most bytes of tensor storages alive at once, as
    ``torch.cuda.max_memory_allocated`` counts them (each allocation rounded up to the caching
    allocator's 512-byte blocks; on a CPU, the bytes the allocator was asked for). A storage is
    counted once, however many views of it exist, from the op that made it until the last
    reference to it goes: the tracker holds a weak reference to each storage object (torch keeps
    one Python object per live storage), whose callback fires when the storage is freed. What
    an op allocates and frees inside its own kernel (a matmul's packing buffer, the CPU flash
    attention's scratch) is not seen: the measured peak of those kernels is what the accuracy
    table compares against (benches/python/estimate_accuracy.py).

Note [fake device] and Note [HF masks on fake tensors]: :mod:`.fakes`, with the fake
models and inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..planner.records import is_compute_bound, op_flops
from ..recompute.ops import forced
from .fakes import hf_eager_masks, pick_loss, storage_keys

__all__ = ["Tracker", "Trace", "OpCost", "SavedTensor", "run_step"]


_IGNORED = {torch.ops.aten.detach.default, torch.ops.prim.device.default}


@dataclasses.dataclass
class OpCost:
    """One dispatched op of the traced step."""

    name: str
    phase: str  # forward | region (a wrapped block's forward) | backward | recompute | optimizer
    flops: int
    moved: int  # bytes read and written
    compute_bound: bool
    dtype: str
    #: seconds measured on this machine's CPU (Note [op times on a CPU] in optime.py), and
    #: the signature they were measured under
    measured: Optional[float] = None
    key: Any = None


@dataclasses.dataclass
class SavedTensor:
    """One storage autograd saved in the plain step (views of it counted once)."""

    bytes: int
    dtype: str
    shape: Tuple[int, ...]
    module: str  # the module whose forward saved it ("" outside every module)
    op: str  # the op whose autograd node saved it (the last op dispatched)
    kind: str  # activation | parameter | input


@dataclasses.dataclass
class Trace:
    """What one traced step allocated and computed (Note [live storages])."""

    ops: List[OpCost]
    live: List[int]  # live bytes after each op
    marks: Dict[str, int]  # phase -> index of the first op after it ends
    peak: int
    peak_op: int
    base: int  # live bytes when the step started
    saved: List[SavedTensor]
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    state_bytes: int  # optimizer state on the device
    grad_bytes: int  # gradients alive when backward ended
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def phase_of(self, i: int) -> str:
        if not 0 <= i < len(self.ops):
            return "start"
        return "forward" if self.ops[i].phase == "region" else self.ops[i].phase


class Tracker(TorchDispatchMode):
    """Follows every storage the ops under it produce (Note [live storages]), and each op's
    FLOPs and bytes; ``clock`` advances by ``seconds(op)`` per op (the simulated offload context
    reads it)."""

    def __init__(self, rounding: int = 1, seconds: Optional[Callable[[OpCost], float]] = None,
                 timer: Any = None, host_seconds: Optional[Callable[[OpCost], float]] = None):
        super().__init__()
        self.rounding = max(1, rounding)
        self.seconds = seconds
        #: Note [two clocks]: with ``host_seconds`` (a GPU) the host issues ops ahead of the
        #: device; ``clock`` is the device's, ``host_clock`` the host's
        self.host_seconds = host_seconds
        self.timer = timer  # an OpTimer: op times measured on this CPU
        self.clock = 0.0
        self.host_clock = 0.0
        self.live = 0
        self.peak = 0
        self.peak_op = -1
        self.ops: List[OpCost] = []
        self.series: List[int] = []
        self.times: List[float] = []  # the clock after each op
        self.marks: Dict[str, int] = {}
        self.phase = "forward"
        self._sizes: Dict[int, int] = {}
        self._refs: Dict[int, Any] = {}
        self.born: Dict[int, int] = {}  # storage -> index of the op that made it
        self._exempt: set = set()
        self.on_op: Optional[Callable[[], None]] = None  # the simulated context's poll
        #: when the simulated context's copies in flight land (a synchronize waits for them)
        self.on_sync: Optional[Callable[[], float]] = None
        self._uncounted = 0

    # -- storages --

    def size_of(self, nbytes: int) -> int:
        r = self.rounding
        return (nbytes + r - 1) // r * r if r > 1 else nbytes

    def add(self, t: torch.Tensor, count: bool = True) -> None:
        """Follow ``t``'s storage from now on (once); ``count=False``: alive but not device
        memory (a view of the simulated host pool)."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        k = st._cdata
        if k in self._sizes:
            return
        nb = self.size_of(st.nbytes()) if count else 0
        self._sizes[k] = nb
        self._refs[k] = weakref.ref(st, functools.partial(self._freed, k))
        self.born[k] = len(self.ops)
        if nb:
            self.live += nb
            if self.live > self.peak:
                self.peak = self.live
                self.peak_op = len(self.ops)

    def _freed(self, k: int, _ref: Any) -> None:
        self._refs.pop(k, None)
        self.born.pop(k, None)
        self.live -= self._sizes.pop(k, 0)

    def knows(self, t: torch.Tensor) -> bool:
        try:
            return t.untyped_storage()._cdata in self._sizes
        except (RuntimeError, NotImplementedError):
            return False

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Ops under it are not recorded and what they make is not device memory (the
        simulated context's views of its host pool on a CPU host)."""
        self._uncounted += 1
        try:
            yield
        finally:
            self._uncounted -= 1

    def sync(self) -> None:
        """The host waits for the device and its copies (a synchronize, a step's end)."""
        copies = self.on_sync() if self.on_sync is not None else 0.0
        self.clock = self.host_clock = max(self.clock, self.host_clock, copies)

    def reset_peak(self) -> None:
        self.peak, self.peak_op = self.live, len(self.ops)

    def mark(self, name: str) -> None:
        """``name`` ends here (forward, backward, optimizer)."""
        self.marks[name] = len(self.ops)

    # -- ops --

    def answered(self, func: Any) -> None:
        """A replay handed back ``func``'s kept or offloaded output without running it: on two
        clocks the host still dispatches the call (Note [a replay's host time is the region's]
        in planner/machine.py); the device runs nothing. One clock (a CPU): not charged, as
        the CPU's planner does not charge it either."""
        if self.host_seconds is None or self.seconds is None:
            return
        op = OpCost(func.__name__, "recompute", 0, 0, False, "")
        self.ops.append(op)
        self.series.append(self.live)
        self.host_clock += self.host_seconds(op)  # the device's clock: nothing to run
        if self.on_op is not None:
            self.on_op()
        self.times.append(self.clock)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _IGNORED:
            return out
        outs = _tensors(out)
        if self._uncounted:
            for t in outs:
                self.add(t, count=False)
            return out
        for t in outs:
            self.add(t)
        scratch = _scratch(func, args)
        if scratch and self.live + scratch > self.peak:
            self.peak = self.live + scratch
            self.peak_op = len(self.ops)
        phase = self.phase
        if phase == "backward" and torch.is_grad_enabled():
            phase = "recompute"  # checkpoint reruns a region with grad enabled in backward
        elif phase == "forward" and _in_region():
            phase = "region"  # a wrapped block's forward, under its dispatch mode
        bound = is_compute_bound(func)
        first = outs[0] if outs else None
        if forced(func) == "view":  # an alias: no bytes move, nothing is computed
            flops = moved = 0
        else:
            flops = op_flops(func, args, kwargs, out) if bound else sum(t.numel() for t in outs)
            moved = sum(_nbytes(t) for t in _tensors(args)) + sum(_nbytes(t) for t in outs)
            if kwargs:
                moved += sum(_nbytes(t) for t in _tensors(tuple(kwargs.values())))
        op = OpCost(func.__name__, phase, flops, moved, bound,
                    str(first.dtype).replace("torch.", "") if first is not None else "")
        if self.timer is not None and moved:
            op.key = self.timer.key(func, args, kwargs)
            op.measured = self.timer.seconds(op.key)
        self.ops.append(op)
        self.series.append(self.live + scratch)
        if self.seconds is not None:
            if self.host_seconds is not None:  # Note [two clocks]
                self.host_clock += self.host_seconds(op)
                self.clock = max(self.clock, self.host_clock) + self.seconds(op)
            else:
                self.clock += self.seconds(op)
        if self.on_op is not None:
            self.on_op()
        self.times.append(self.clock)
        return out


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _in_region() -> bool:
    """A checkpointed region's forward runs under checkpoint's saved-tensor hooks (and a
    selective one's dispatch mode, recompute/modes.py), the innermost; a region run plainly
    under none."""
    top = _top_hooks(False) if _top_hooks is not None else None
    return top is not None and bool(getattr(top[0], "_checkpoint_internal", False))


def _scratch(func: Any, args: Tuple[Any, ...]) -> int:
    """Note [kernel scratch]: bytes ``func`` holds inside its kernel, beyond its outputs."""
    if getattr(func, "__name__", "") != "_linear_cross_entropy_batch_chunked.default":
        return 0
    x, w = args[0], args[1]
    rows = min(int(args[8]), int(x.shape[0])) if x.dim() == 2 else int(args[8])
    return rows * (int(w.shape[0]) * 4 + int(x.shape[-1]) * x.element_size())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    out: List[torch.Tensor] = []
    if isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                out.append(y)
            elif isinstance(y, (list, tuple)):
                out.extend(_tensors(y))
    return out


# ---- one step -----------------------------------------------------------------------------


class _SavedRecorder:
    """The outermost saved-tensor hooks of the plain step: what autograd saves, one entry per
    storage (Note [live storages]), with the module and op that saved it."""

    def __init__(self, tracker: Tracker, params: set, inputs: set, modules: List[str]):
        self.tracker = tracker
        self.params = params
        self.inputs = inputs
        self.modules = modules
        self.saved: List[SavedTensor] = []
        self._seen: set = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            k = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return t
        if k not in self._seen:
            self._seen.add(k)
            kind = ("parameter" if k in self.params or (t.is_leaf and t.requires_grad)
                    else "input" if k in self.inputs else "activation")
            ops = self.tracker.ops
            self.saved.append(SavedTensor(
                self.tracker.size_of(t.untyped_storage().nbytes()),
                str(t.dtype).replace("torch.", ""), tuple(t.shape),
                self.modules[-1] if self.modules else "", ops[-1].name if ops else "", kind))
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


@contextlib.contextmanager
def _module_names(model: nn.Module, names: List[str]) -> Iterator[None]:
    """Keep ``names[-1]`` the qualified name of the module whose forward runs."""
    handles = []
    for name, m in model.named_modules():
        def pre(_m: Any, _a: Any, name: str = name) -> None:
            names.append(name)

        def post(_m: Any, _a: Any, _o: Any) -> None:
            if names:
                names.pop()

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def run_step(model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], mode: FakeTensorMode,
             tracker: Tracker, *, loss_fn: Optional[Callable[[Any], Any]] = None,
             optimizer: Any = None, around: Optional[Callable[[], Any]] = None,
             record_saved: bool = False, base: Sequence[torch.Tensor] = ()) -> Trace:
    """Run one training step of ``model`` (a :func:`fake_copy`) on fake ``args``/``kwargs``
    under ``tracker``: forward inside ``around()`` (a context manager, e.g. the simulated
    offload context), the loss (:func:`pick_loss`), backward, then ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)`` when given. ``base``: tensors alive when the step starts
    (parameters, buffers, inputs, optimizer state), counted from the start. With
    ``record_saved`` the storages autograd saves are recorded (outermost hooks: in recompute
    regions only their inputs are seen)."""
    params = [p for p in model.parameters()]
    for t in base:
        tracker.add(t)
    start_ops = len(tracker.ops)
    tracker.sync()
    start_clock = tracker.clock
    tracker.reset_peak()
    start_live = tracker.live
    names: List[str] = []
    inputs = storage_keys(_tensors(list(args)) + _tensors(list(kwargs.values())))
    recorder = _SavedRecorder(tracker, storage_keys(params) | storage_keys(list(model.buffers())),
                              inputs, names)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mode)
        stack.enter_context(tracker)
        stack.enter_context(hf_eager_masks(inputs))
        if record_saved:
            stack.enter_context(_module_names(model, names))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(recorder.pack,
                                                                         recorder.unpack))
        tracker.phase = "forward"
        with (around() if around is not None else contextlib.nullcontext()):
            out = model(*args, **kwargs)
            loss = pick_loss(out, loss_fn)
        del out
        tracker.sync()  # forward's end as the probe times it (Note [two clocks] in modes.py)
        tracker.mark("forward")
        tracker.phase = "backward"
        loss.backward()
        del loss
        tracker.mark("backward")
        grads = sum(tracker.size_of(p.grad.untyped_storage().nbytes()) for p in params
                    if p.grad is not None)
        grad_born = sorted((tracker.born.get(p.grad.untyped_storage()._cdata, start_ops)
                            - start_ops, tracker.size_of(p.grad.untyped_storage().nbytes()))
                           for p in params if p.grad is not None)
        tracker.phase = "optimizer"
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            for p in params:
                p.grad = None
        tracker.mark("optimizer")
    tracker.sync()
    ops = tracker.ops[start_ops:]
    marks = {k: v - start_ops for k, v in tracker.marks.items()}
    return Trace(
        ops=ops, live=tracker.series[start_ops:], marks=marks, peak=tracker.peak,
        peak_op=tracker.peak_op - start_ops, base=start_live, saved=recorder.saved,
        param_bytes=_bytes_of(params, tracker), buffer_bytes=_bytes_of(model.buffers(), tracker),
        input_bytes=_bytes_of(_tensors(list(args)) + _tensors(list(kwargs.values())), tracker),
        state_bytes=_bytes_of(_state_tensors(optimizer), tracker), grad_bytes=grads,
        extra={"grad_born": grad_born, "seconds": tracker.clock - start_clock,
               "op_seconds": sum(tracker.seconds(o) for o in ops) if tracker.seconds else 0.0,
               "times": [t - start_clock for t in tracker.times[start_ops:]]})


def _bytes_of(tensors: Any, tracker: Tracker) -> int:
    seen = set()
    total = 0
    for t in tensors:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += tracker.size_of(st.nbytes())
    return total


def _state_tensors(optimizer: Any) -> List[torch.Tensor]:
    if optimizer is None:
        return []
    out = []
    for st in optimizer.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out
