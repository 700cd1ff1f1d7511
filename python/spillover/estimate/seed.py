"""The planner starts from a trace: ``wrap(policy="auto")``'s first step follows a plan made and
tuned on fake tensors, instead of a learning step.

Note [seeded plan]
    At the first forward of a model under ``wrap(policy="auto")`` (with gradients on, eager),
    before any of it runs, the step is traced on fake tensors of the model's own shapes
    (Note [fake device] in trace.py): the model's parameters and buffers are swapped for fake
    ones for the length of the trace (``torch.nn.utils.stateless``), its wrap state runs a
    planner of its own, and the offload context in force is stood in for by a simulated one of
    the same tier and pool (Note [simulated offload] in offload.py: tier auto named so, as
    the plan's regions are matched by it, and a default pool growing as the real one does;
    the trace once named tier auto "nvme" and stood a fixed pool of the cap's size in for the
    default one, so under the Quick start's context the first real step matched no region of
    the plan and ran a learning step: on a device, one that ships every saved tensor and grows
    the process's pool for them). That planner learns, plans
    and tunes on fake steps exactly as it would on real ones, each fake step's peak read by the
    tracker (Note [peak feedback] in planner/tuner.py), so the plan handed over has been
    checked against the budget on the fake step before the first real step runs. The model's
    planner then follows it from that first step (``Planner.seed``): no learning step, so the
    learning step's frugal plan and its cost are gone; the first real steps are measured and
    corrected as a learned plan's are. What the trace cannot see (memory outside torch's
    allocator, a CPU host's allocator slack) is what that correction is for. The trace needs
    the step's loss: a model whose output is neither a scalar nor has a ``.loss`` learns as
    before, and ``explain()`` says why. So does a step the trace fails on (a forward that reads
    tensor values): the failure is noted, never raised into the training step.

    The trace calls the model, so the model's other forward hooks run on it: a transformers
    model's loss region (loss/regions.py), whose pre hook ran before wrap's and whose post hook
    disarms it, is armed again for the real call, and its call count is the model's own (the
    first real step computing its loss without the region would hold the logits the plan did
    not count: seen on a tiny Llama, a first step over the budget and a plan tuned on it).

    What it costs: one trace per fake step (a learning one, a planned one, up to three tuning
    ones; the fake peak is exact, so tuning settles fast), ~0.15 ms of host time per op on this
    2-core machine, independent of the tensors' sizes: 0.4-1.5 s for the tiny transformers of
    the tests and the demo's GPT, once per planner: a later change of the input's shapes learns
    as before (a trace per new shape would cost each step of a run whose lengths vary).
    Guarded by tests/python/test_estimate_seed.py.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["seed_planner", "hand_over"]


def _retarget(x: Any, old: str, new: str) -> Any:
    """``x`` (nested tuples) with every device string ``old`` replaced by ``new``."""
    if isinstance(x, str):
        return new if x == old else x
    if isinstance(x, tuple):
        return tuple(_retarget(y, old, new) for y in x)
    return x


def _device_for(device: str, planner: Any) -> Any:
    """The device as the planner's own rates describe it (nothing is measured here: the trace
    runs inside the first step, and its clock only orders the simulated context's copies)."""
    import psutil

    from .devices import Device

    m = planner.machine(device)
    if device == "cpu":
        memory = host = psutil.virtual_memory().available
    else:
        _free, memory = torch.cuda.mem_get_info(torch.device(device))
        host = psutil.virtual_memory().available
    return Device(
        name=device, kind="cpu" if device == "cpu" else "cuda", memory_bytes=int(memory),
        matmul_flops=dict(m.matmul_flops), memory_bytes_per_s=m.elementwise_bytes_per_s,
        link_bytes_per_s=m.link_bytes_per_s, nvme_write_bytes_per_s=m.nvme_write_bytes_per_s,
        nvme_read_bytes_per_s=m.nvme_read_bytes_per_s, host_memory_bytes=int(host),
        host_seconds_per_op=0.0, host_seconds_per_region_op=0.0,
        host_seconds_per_offload=float(getattr(m, "host_seconds_per_offload", 0.0)),
        rounding=1 if device == "cpu" else 512)


def seed_planner(model: nn.Module, state: Any, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Optional[str]:
    """Note [seeded plan]: trace ``model(*args, **kwargs)``'s step on fake tensors, plan and
    tune ``state``'s planner there, and hand it the plan. Returns None when seeded, else why
    not (the planner then learns as before); never raises into the training step."""
    try:
        return _seed(model, state, args, kwargs)
    except Exception as e:  # Note [seeded plan]
        return f"the trace failed ({type(e).__name__}: {e})"


def _seed(model: nn.Module, state: Any, args: Tuple[Any, ...],
          kwargs: Dict[str, Any]) -> Optional[str]:
    from torch.nn.utils.stateless import _reparametrize_module

    from ..activations import current_context
    from ..planner import Planner
    from ..planner.records import _sim_link, keeps_on_host, region_offload_info
    from ..recompute.ops import device_of
    from ..recompute.policies import _Auto
    from .fakes import fake_inputs, fake_like, storage_keys
    from .modes import _device_named, _TraceMeter, roofline_seconds
    from .offload import SimContext
    from .trace import Tracker, run_step

    t0 = time.perf_counter()
    planner = state.policy.planner
    device = device_of(args, kwargs)
    ctx = current_context()
    if device == "cpu" and ctx is not None and _sim_link(ctx):
        # the trace's devices are the estimate's: it would plan a CPU host here
        return ("the offload context is on the simulated device (sim_link_bandwidth), which "
                "the trace does not model: the first step learns (Note [the simulated device "
                "is a device] in planner/records.py)")
    dev = _device_for(device, planner)
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: Dict[str, torch.Tensor] = {}
    made: Dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in made:
            made[id(p)] = nn.Parameter(fake_like(p, fm), requires_grad=p.requires_grad)
        fakes[name] = made[id(p)]
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in made:
            made[id(b)] = fake_like(b, fm)
        fakes[name] = made[id(b)]
    fargs = fake_inputs(tuple(args), fm)
    fkw = fake_inputs(dict(kwargs), fm)
    tracker = Tracker(rounding=dev.rounding, seconds=lambda op: roofline_seconds(dev, op))
    tmp = Planner(budget_bytes=planner._budget_for(device), machine=planner.machine(device),
                  seed_from_trace=False)
    tmp.explicit_steps = planner.explicit_steps
    tmp._meter = _TraceMeter(tracker, "cpu")
    sim = None
    if ctx is not None:
        # the context's tier (as named, and as resolved) and pool, so that the plan's regions
        # match the real step's (their signature names the tier; tier auto's default pool
        # keeps in RAM while it grows: Note [RAM before the drive] in _growth.py); its first
        # step has no learned order (Note [seeded plan]): every fake step is planned as that one
        sim = SimContext(ctx.tier, dev, tracker, ctx.config.host_pool_bytes,
                         ctx.pool_limit, storage_keys(list(made.values())),
                         ctx.config.min_offload_bytes,
                         learns_order=getattr(ctx, "steps", 0) > 1,
                         resolved="nvme" if ctx.nvme else "host",
                         rederive=ctx.config.rederive)
        tracker.on_op = sim.poll
    # a CPU host's pool is the step's memory: charged as the records charge it (the cap, or
    # the pool mapped where the context keeps in place what it would take: Note [a CPU host
    # ships nothing] in planner/records.py)
    info = region_offload_info(ctx, keeps_on_host(ctx, device))
    pool_charge = int(info["pool_bytes"]) if info is not None else 0
    saved = (state.policy, state.records, state.step_records, state.loss_scope)
    region = state.loss_region
    calls = getattr(region, "calls", None)  # the trace's calls are not the model's
    state.policy = _Auto(tmp)
    state.records, state.step_records, state.loss_scope = [], [], None
    base = list(made.values())
    target = None if device == "cpu" else device
    peak = None
    try:
        with _reparametrize_module(model, fakes, tie_weights=True), _device_named(target):
            for _ in range(tmp.TUNING_STEPS + 3):
                if tmp.tuned:
                    break
                trace = run_step(model, fargs, fkw, fm, tracker, loss_fn=None, optimizer=None,
                                 around=sim.step if sim is not None else None, base=base)
                if sim is not None:
                    sim.end_step()
                peak = trace.peak - trace.base + (pool_charge if device == "cpu" else 0)
            tmp.begin_step()  # close the last fake step (its peak feeds the tuning)
    except ValueError as e:
        if "loss" not in str(e):
            raise
        return f"no loss to trace ({e})"
    finally:
        state.policy, state.records, state.step_records, state.loss_scope = saved
        if calls is not None:
            region.calls = calls
    if tmp.plan is None:
        return "the trace made no plan"
    hand_over(tmp, planner, device, peak, seconds=time.perf_counter() - t0)
    return None


def hand_over(tmp: Any, planner: Any, device: str, predicted_peak: Optional[int],
              **about: Any) -> None:
    """``tmp``'s plan, tuned on fake steps, to ``planner`` (``Planner.seed``), its records and
    regions named for ``device`` (fake tensors are the CPU's)."""
    plan, records = tmp.plan, tmp.planned_records
    for r in records:
        r.device = device
        r.signature = _retarget(r.signature, "cpu", device)
    for rp in plan.regions:
        rp.signature = _retarget(rp.signature, "cpu", device)
    planner.seed(plan, records, tmp.peak_offsets, outside_bytes=tmp.outside_bytes,
                 loss_bytes=tmp.loss_bytes, loss_min_bytes=tmp.loss_min_bytes,
                 tail_bytes=tmp.tail_bytes, predicted_peak=predicted_peak,
                 fake_steps=tmp.steps, **about)

