"""Each mode's step, run on fake tensors, and its figures: device peak, host memory, NVMe
traffic, step time.

Note [modes as run]
    Each mode is the step spillover would run, on a fake copy of the model (Note [fake device]
    in trace.py), through the same code: ``none`` is the model as given; ``full`` and
    ``selective`` are ``spillover.wrap(policy=...)`` (which also gives a causal LM or the
    built-in GPT its chunked loss region, ``chunked_loss=``); ``host`` and ``nvme`` are
    ``wrap(policy="offload")`` under the simulated context of that tier (Note [simulated
    offload] in offload.py); ``auto`` is ``wrap(policy="auto")`` under the simulated context of
    the tier ``offload_context(tier="auto")`` picks (NVMe where the device has a drive). The
    planner of ``auto`` learns, plans and tunes on fake steps, its peaks measured by the
    tracker (Note [peak feedback] in planner/tuner.py), and the step reported is the one its
    settled plan runs. ``selective`` and ``nvme`` are reported at their second step: a region
    learns what pays to save on its first call (Note [selective pays]), and the NVMe tier
    learns the order backward unpacks in, which decides what it keeps in its pool (Note
    [written from the tensor] in rust/tier/direct.rs). Each mode's optimizer state exists
    before its step (a steady-state step), and the step ends with ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``.

Note [step time]
    Each op costs its FLOPs at the device's matmul rate (compute-bound ops) plus the bytes it
    reads and writes at its memory rate (on this machine's CPU: its time measured, Note [op
    times on a CPU] in optime.py), and the host's dispatch of it (``Device.host_seconds``: per
    op of the forward, of backward, and more per op of a wrapped block, whose dispatch mode
    sees every op of its forward and its replay). On a CPU the two add up (the same cores); on
    a GPU they run apart (Note [two clocks]). The simulated context adds each offload's host
    cost, its copies on a CPU host, and every stall on the link or the drive (offload.py). The
    step time is the clock at the end of the step, host and device synchronized. What is not
    modeled: collectives across ranks, kernels' launch gaps on the device, the allocator.

Note [two clocks]
    On a GPU the host queues work and the device runs it: the host's clock advances by each
    op's dispatch, the device's starts the op once the host queued it and the device finished
    the one before (``max(device, host) + device time``). A forward whose Python dispatch is
    slower than its kernels is host-bound; a backward that autograd's engine queues quickly is
    device-bound; a recompute region's replay is hidden behind the backward kernels queued
    before it. Copies follow the device's clock, an offload's host cost the host's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import _runtime
from ..recompute import ops as _ops
from ..recompute import replay as _replay
from .devices import Device
from .fakes import fake_copy, fake_inputs, storage_keys
from .offload import OffloadFigures, SimContext
from .optime import OpTimer
from .trace import OpCost, Trace, Tracker, run_step

__all__ = ["MODES", "ModeEstimate", "Runner", "OPTIMIZERS", "SHARDINGS"]

#: The modes an estimate covers (Note [modes as run]).
MODES = ("none", "full", "selective", "host", "nvme", "auto")
#: What ``optimizer=`` accepts.
OPTIMIZERS = ("adamw", "adamw-fused", "offload-host", "offload-nvme", "none")
#: What ``sharding=`` accepts: replicated (DDP), the optimizer state sharded (ZeRO-1/2, as
#: ``OffloadAdamW`` does under torch.distributed), or parameters, gradients and state
#: (FSDP2 / ZeRO-3).
SHARDINGS = ("none", "zero", "fsdp")
SECONDS_PER_DAY = 86400.0
#: Note [op times on a CPU]: one per process, shared by every estimate
_TIMER = OpTimer()


@dataclasses.dataclass
class ModeEstimate:
    """One mode's figures (bytes and seconds per step, per rank)."""

    mode: str
    device_peak_bytes: int
    host_bytes: int
    nvme_bytes_per_step: int
    step_seconds: float
    nvme_write_bytes_per_step: int = 0
    nvme_read_bytes_per_step: int = 0
    drive_writes_per_day: Optional[float] = None
    fits: bool = True
    peak_phase: str = ""
    flops: float = 0.0
    recompute_flops: float = 0.0
    compute_seconds: float = 0.0
    stall_seconds: float = 0.0
    pool_bytes: int = 0
    note: str = ""
    #: (seconds into the step, device bytes), one point per op
    timeline: List[Tuple[float, int]] = dataclasses.field(default_factory=list, repr=False)
    #: seconds at which forward and backward end
    marks: Dict[str, float] = dataclasses.field(default_factory=dict, repr=False)
    plan: Any = dataclasses.field(default=None, repr=False)
    #: ``auto``: the planner that planned and tuned on the fake steps (fit reads its records)
    planner: Any = dataclasses.field(default=None, repr=False)
    trace: Optional[Trace] = dataclasses.field(default=None, repr=False)


class _TraceMeter:
    """The planner's peak meter (``spillover._peak.PeakMeter``'s protocol) on the tracker: the
    step's peak of live storages over what was live at its start."""

    def __init__(self, tracker: Tracker, device: str, workspace: int = 0):
        self.tracker = tracker
        self.device = device
        self.base: Optional[int] = None
        self.available = True
        # cuBLAS's workspace, which the estimate adds to every step's peak (its first matmul
        # allocates it): counted here too, or a plan the planner saw fit is reported over
        self.workspace = workspace

    #: Note [a traced step is timed] in planner/tuner.py: the seconds of the step it read
    #: (the later of the device's and the host's clocks, from its start to the read)
    seconds: Optional[float] = None

    def start(self) -> bool:
        self.tracker.reset_peak()
        self.base = self.tracker.live
        self._t0 = self._now()
        self.seconds = None
        return True

    def _now(self) -> float:
        return max(self.tracker.clock, self.tracker.host_clock)

    def read(self) -> Optional[int]:
        if self.base is None:
            return None
        if self.seconds is None:
            self.seconds = self._now() - self._t0
        return max(0, self.tracker.peak - self.base) + self.workspace

    def mark(self, name: str) -> Optional[int]:
        """The peak so far (Note [gradients as backward goes] in planner/search.py)."""
        if self.base is None:
            return None
        return max(0, self.tracker.peak - self.base) + self.workspace


@contextlib.contextmanager
def _device_named(name: Optional[str]) -> Iterator[None]:
    """Regions' records name the target device (Note [fake device] in trace.py)."""
    prev = getattr(_ops.DEVICE_OVERRIDE, "name", None)
    _ops.DEVICE_OVERRIDE.name = name
    try:
        yield
    finally:
        _ops.DEVICE_OVERRIDE.name = prev


@contextlib.contextmanager
def _answered_by(tracker: Tracker) -> Iterator[None]:
    """Note [a replay's host time is the region's] (planner/machine.py): the replays of the
    step charge ``tracker`` the dispatch of the calls they answer without running them. A
    process-wide hook, not a thread's: autograd may run a replay on a thread of its own."""
    prev = _replay.ANSWERED
    _replay.ANSWERED = tracker.answered
    try:
        yield
    finally:
        _replay.ANSWERED = prev


class Runner:
    """Runs the modes of one model and input on fake tensors (Note [modes as run])."""

    def __init__(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 device: Device, *, loss_fn: Optional[Callable[[Any], Any]] = None,
                 optimizer: str = "adamw", world_size: int = 1, sharding: str = "none",
                 budget: Optional[int] = None, host_pool_bytes: Optional[int] = None,
                 min_offload_bytes: int = 1 << 20, chunked_loss: bool = True,
                 dtype: Optional[torch.dtype] = None, rederive: bool = True):
        self.model = model
        self.device = device
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.world = world_size
        self.sharding = sharding
        self.budget = budget
        self.host_pool_bytes = host_pool_bytes
        self.min_offload_bytes = min_offload_bytes
        self.rederive = rederive
        self.chunked_loss = chunked_loss
        self.dtype = dtype
        self.fm = FakeTensorMode(allow_non_fake_inputs=True)
        self.args = fake_inputs(tuple(args), self.fm)
        self.kwargs = fake_inputs(dict(kwargs), self.fm)
        self.pool_cap = (host_pool_bytes if host_pool_bytes is not None
                         else _default_pool_cap(device))
        self.start_bytes = 0  # live at the step's start (set by the first run)

    # -- time --

    def device_seconds(self, op: OpCost) -> float:
        """Note [step time]: the op's time on the device, without the host's dispatch."""
        d = self.device
        if op.measured is not None:
            return op.measured
        dev = op.moved / d.memory_bytes_per_s
        if op.compute_bound:
            dev += op.flops / d.flops_per_s(op.dtype)
        return dev

    def host_seconds(self, op: OpCost) -> float:
        """Note [step time]: the host's dispatch of the op."""
        return self.device.host_seconds(op.phase)

    def op_seconds(self, op: OpCost) -> float:
        """Note [step time]: the op's time alone (a GPU: the longer of host and device)."""
        dev, host = self.device_seconds(op), self.host_seconds(op)
        return dev + host if self.device.kind == "cpu" else max(dev, host)

    def retime(self, est: ModeEstimate) -> float:
        """``est``'s step time again, each op's time as the timer has it now (after
        ``OpTimer.refresh``); what the simulated context added (offload costs, stalls) kept."""
        trace = est.trace
        assert trace is not None
        other = trace.extra["seconds"] - trace.extra["op_seconds"]
        total = 0.0
        for o in trace.ops:
            if o.key is not None:
                o.measured = _TIMER.seconds(o.key)
            total += self.op_seconds(o)
        return total + other + (est.step_seconds - trace.extra["seconds"])

    # -- modes --

    def run(self, mode: str) -> ModeEstimate:
        from ..planner import Planner
        from ..recompute import SelectivePolicy, wrap

        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        dev = self.device
        model = fake_copy(self.model, self.fm, self.dtype)
        gpu = dev.kind != "cpu"
        tracker = Tracker(rounding=dev.rounding,
                          seconds=self.device_seconds if gpu else self.op_seconds,
                          host_seconds=self.host_seconds if gpu else None,
                          timer=_TIMER if dev.kind == "cpu" and dev.name == "cpu" else None)
        planner = None
        if mode in ("full", "host", "nvme"):
            wrap(model, policy="full" if mode == "full" else "offload",
                 chunked_loss=self.chunked_loss)
        elif mode == "selective":
            wrap(model, policy=SelectivePolicy(machine=dev.machine()),
                 chunked_loss=self.chunked_loss)
        elif mode == "auto":
            planner = Planner(budget_bytes=max(1, self.budget_for()), machine=dev.machine(),
                              seed_from_trace=False)  # it is the trace
            planner._meter = _TraceMeter(tracker, "cpu", dev.workspace_bytes)
            wrap(model, policy=planner, chunked_loss=self.chunked_loss)
        opt = self._optimizer(model)
        params = list(model.parameters())
        base = params + list(model.buffers()) + _leaves(self.args) + _leaves(self.kwargs)
        base += [v for s in (opt.state.values() if opt is not None else ())
                 for v in s.values() if isinstance(v, torch.Tensor)]
        ctx = None
        if mode in ("host", "nvme", "auto"):
            tier = mode  # auto: Note [RAM before the drive] in _growth.py
            ctx = SimContext(tier, dev, tracker, self.host_pool_bytes, self.pool_cap,
                             storage_keys(params + list(model.buffers())),
                             self.min_offload_bytes, rederive=self.rederive)
            tracker.on_op = ctx.poll
            tracker.on_sync = ctx.copies_landed
        steps = 2 if mode in ("selective", "nvme") else 1  # Note [modes as run]: 1st learns
        if planner is not None:
            steps = planner.TUNING_STEPS + 3  # learning, tuning, then the settled step
        trace: Optional[Trace] = None
        name = None if dev.kind == "cpu" else "cuda:0"
        with _device_named(name), _answered_by(tracker):
            for i in range(steps):
                if planner is not None and i and planner.tuned and trace is not None \
                        and trace.extra.get("settled"):
                    break
                if ctx is not None:
                    ctx.figures = OffloadFigures()
                trace = run_step(model, self.args, self.kwargs, self.fm, tracker,
                                 loss_fn=self.loss_fn, optimizer=opt,
                                 around=ctx.step if ctx is not None else None,
                                 record_saved=mode == "none", base=base)
                if ctx is not None:
                    ctx.end_step()
                if planner is not None:
                    trace.extra["settled"] = planner.tuned
        assert trace is not None
        figures = ctx.finish() if ctx is not None else None
        if figures is not None:
            trace.extra["offloaded"] = figures.bytes_offloaded
        est = self._figures(mode, trace, figures, opt)
        if planner is not None:
            est.plan = planner.plan
            est.planner = planner
            est.note = (f"plan {planner.plan.variant}" if planner.plan is not None
                        else "no plan")
            over = est.device_peak_bytes - trace.base - self.budget_for()
            if over > 0:
                est.note += f", {over / 2**20:.0f} MiB over its budget"
        if mode == "none":
            self.start_bytes = trace.base
        return est

    def budget_for(self) -> int:
        """``auto``'s budget: the peak over the step's start (the planner's meaning); by
        default what the device has left once the step's start is counted."""
        if self.budget is not None:
            return self.budget
        start = self.start_bytes or self._start_bytes()
        return int(self.device.memory_bytes - start - self.device.workspace_bytes)

    def _start_bytes(self) -> int:
        model = fake_copy(self.model, self.fm, self.dtype)
        opt = self._optimizer(model)
        ts = list(model.parameters()) + list(model.buffers()) + _leaves(self.args) + _leaves(
            self.kwargs)
        ts += [v for s in (opt.state.values() if opt is not None else ())
               for v in s.values() if isinstance(v, torch.Tensor)]
        seen, total = set(), 0
        for t in ts:
            st = t.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
        return total

    def _optimizer(self, model: nn.Module) -> Any:
        """The device optimizer, its state made (a steady-state step): torch's AdamW (foreach
        on a GPU, as torch picks there; fused when asked), or None (``OffloadAdamW`` keeps its
        state off the device; ``"none"``: no optimizer step)."""
        if self.optimizer not in ("adamw", "adamw-fused"):
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return None
        kw: Dict[str, Any] = {}
        if self.optimizer == "adamw-fused":
            kw["fused"] = True
        elif self.device.kind == "cuda":
            kw["foreach"] = True
        with self.fm:
            opt = torch.optim.AdamW(params, **kw)
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return opt

    # -- figures --

    def _figures(self, mode: str, trace: Trace, fig: Optional[OffloadFigures],
                 opt: Any) -> ModeEstimate:
        dev = self.device
        series = list(trace.live)
        times = trace.extra["times"]
        pool = fig.pool_capacity if fig is not None else 0
        param_bytes = trace.param_bytes
        shard = self.world if self.sharding != "none" else 1
        series = self._shard(trace, series)
        on_device = pool if dev.kind == "cpu" else 0  # Note [simulated offload]: CPU pool
        extra = on_device + dev.workspace_bytes
        base = trace.base - self._shard_saving(trace, 0)
        peak_i = max(range(len(series)), key=series.__getitem__) if series else -1
        peak = max(series + [base]) + extra
        state_host, state_nvme = self._optimizer_bytes(trace, shard)
        staging = trace.grad_bytes // shard if self.optimizer.startswith("offload") \
            and dev.kind == "cuda" else 0
        host = pool + state_host + staging
        nvme_w = (fig.bytes_written if fig is not None else 0) + state_nvme
        nvme_r = (fig.bytes_read if fig is not None else 0) + state_nvme
        seconds = trace.extra["seconds"]
        if self.optimizer.startswith("offload"):
            seconds += self._offload_step_seconds(param_bytes, state_host + state_nvme)
        flops = sum(o.flops for o in trace.ops if o.compute_bound)
        rflops = sum(o.flops for o in trace.ops if o.compute_bound and o.phase == "recompute")
        dwpd = None
        if dev.nvme_drive_bytes and nvme_w and seconds > 0:
            dwpd = nvme_w * SECONDS_PER_DAY / seconds / dev.nvme_drive_bytes
        fits = peak <= dev.memory_bytes and host <= dev.host_memory_bytes
        marks = {}
        for k in ("forward", "backward"):
            i = trace.marks.get(k, 0)
            marks[k] = times[i - 1] if 0 < i <= len(times) else 0.0
        return ModeEstimate(
            mode=mode, device_peak_bytes=int(peak), host_bytes=int(host),
            nvme_bytes_per_step=int(nvme_w + nvme_r), step_seconds=seconds,
            nvme_write_bytes_per_step=int(nvme_w), nvme_read_bytes_per_step=int(nvme_r),
            drive_writes_per_day=dwpd, fits=fits,
            peak_phase=trace.phase_of(peak_i) if peak_i >= 0 else "start", flops=flops,
            recompute_flops=rflops,
            compute_seconds=sum(self.op_seconds(o) for o in trace.ops),
            stall_seconds=fig.stall_seconds if fig is not None else 0.0, pool_bytes=pool,
            timeline=[(t, v + extra) for t, v in zip(times, series)], marks=marks,
            trace=trace)

    def _optimizer_bytes(self, trace: Trace, shard: int) -> Tuple[int, int]:
        """``OffloadAdamW``'s state (fp32 exp_avg and exp_avg_sq, and an fp32 master copy of
        parameters that are not fp32 on the host): in its pool (host tier; a power of two, at
        least 64 MiB) or on the drive (read and written once per step)."""
        if not self.optimizer.startswith("offload"):
            return 0, 0
        n = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        fp32_host = self.device.kind == "cpu" and all(
            (self.dtype or p.dtype) == torch.float32 for p in self.model.parameters())
        state = n * (8 if fp32_host else 12) // (self.world if self.sharding != "none" else 1)
        if self.optimizer == "offload-host":
            return _runtime.sized_for(state), 0
        return 0, state

    def _offload_step_seconds(self, param_bytes: int, state_bytes: int) -> float:
        """The CPU update of ``OffloadAdamW`` after backward: its state read and written at the
        host's memory rate (the bench's 41.5 GB/s of traffic on 100M parameters is that rate),
        or at the drive's for the NVMe tier, and the parameters copied back over the link."""
        d = self.device
        host_rate = d.memory_bytes_per_s if d.kind == "cpu" else 20e9
        t = 2 * state_bytes / host_rate
        if self.optimizer == "offload-nvme" and d.nvme_read_bytes_per_s:
            t = max(t, state_bytes / d.nvme_read_bytes_per_s
                    + state_bytes / (d.nvme_write_bytes_per_s or math.inf))
        if d.kind == "cuda":
            t += param_bytes / d.link_bytes_per_s
        return t

    def _shard_saving(self, trace: Trace, i: int) -> int:
        """Bytes a rank does not hold at op ``i`` under ``sharding`` (1 - 1/world of the
        sharded parameters, gradients and state), less the parameters FSDP gathers."""
        w = self.world
        if self.sharding == "none" or w <= 1:
            return 0
        keep = 1.0 - 1.0 / w
        saving = trace.state_bytes * keep
        if self.sharding == "fsdp":
            grads = sum(b for born, b in trace.extra["grad_born"] if born <= i)
            saving += (trace.param_bytes + grads) * keep
            saving -= 2 * self._largest_block_params() * keep  # gathered: this block and next
        return int(saving)

    def _shard(self, trace: Trace, series: List[int]) -> List[int]:
        if self.sharding == "none" or self.world <= 1:
            return series
        return [v - self._shard_saving(trace, i) for i, v in enumerate(series)]

    def _largest_block_params(self) -> int:
        from ..recompute.blocks import _find_blocks

        try:
            blocks = _find_blocks(self.model, None)
        except Exception:
            return 0
        return max((sum(p.numel() * p.element_size() for p in b.parameters())
                    for _, b in blocks), default=0)


def roofline_seconds(device: Device, op: OpCost) -> float:
    """Note [step time] without measured op times: FLOPs at the matmul rate, bytes at the
    memory rate, and the host's dispatch."""
    dev = op.moved / device.memory_bytes_per_s
    if op.compute_bound:
        dev += op.flops / device.flops_per_s(op.dtype)
    host = device.host_seconds(op.phase)
    return dev + host if device.kind == "cpu" else max(dev, host)


def _leaves(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _leaves(v)]
    return []


def _default_pool_cap(device: Device) -> int:
    """What a default pool may grow to (Note [node budget] in _runtime.py): on this machine its
    own default; elsewhere a quarter of the host's memory per device, at most 8 GiB."""
    if device.kind == "cpu":
        return _runtime.default_pool_bytes()
    return max(_runtime.MIN_POOL, min(8 << 30, device.host_memory_bytes // 4))
