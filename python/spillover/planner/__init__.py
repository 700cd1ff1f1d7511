"""The planner: keep, offload (host or NVMe) or recompute, per saved tensor, under a budget.

It works on what one training step of a wrapped model saves, learned from a step that runs every
region fully recomputed (the safe choice when nothing is known yet) while recording, per op of
each region: the bytes of its output, its recompute FLOPs (from the op and its shapes), whether
autograd saves it, and where recomputation stops. Costs come from this machine's measured
throughput and bandwidths (:mod:`spillover.calibrate`). Then, under the device-memory budget
(``budget_bytes=`` or SPILLOVER_DEVICE_BUDGET_BYTES; by default a share of free memory):

1. If what no checkpointing holds fits, every region runs plainly and keeps everything.
2. Otherwise every region is checkpointed and, starting from "save every op output", bytes are
   freed in order of least cost per byte: recompute an output (its op's estimated time), or
   hand it to the offload tier (free while the link can hide the transfer behind compute, then
   its transfer time). Earlier regions are freed first at equal cost, and the last region's
   tensors are never counted as hidden: backward needs them first.
3. Regions, last first, go back to running plainly while the budget still holds.

On a CPU-only machine the "device" is host memory: offloading to the host pool frees nothing,
so only NVMe (through a write-back pool whose resident part still counts) and recompute do.

The plan is reused while each region's call order, input shapes and the offload context stay
the same. A step that differs runs its remaining regions as learning runs; if it differed from
its first region on, the next step is planned from it, otherwise the next step learns again.
The budget is the step's peak: Note [peak feedback] in :mod:`.tuner`.

The package, one concern a module: :mod:`.machine` (measured rates), :mod:`.records` (what a
step recorded), :mod:`.cost` (what a decision frees and costs), :mod:`.variants` (the passes that
plan one variant), :mod:`.search` (the plan, a pure function, choosing among the variants),
:mod:`.tuner` (the online :class:`Planner`: learning, measured peaks, Note [peak feedback]) and
:mod:`.explain`.
"""

from __future__ import annotations

import threading
from typing import Dict

import torch

from .cost import (
    HIGH_WATER,
    REGION_POOL_SHARE,
    SKIPPED_REASON,
    Costs,
    region_skipped,
    skipped_ops,
    transient_bytes,
    worth_saving,
)
from .explain import Explanation, explain_records
from .machine import Machine, _device_index
from .records import (
    OpRecord,
    RegionRecord,
    ctx_offload_info,
    input_signature,
    is_compute_bound,
    keeps_on_host,
    op_flops,
    output_tensors,
    region_offload_info,
    storage_bytes,
)
from .search import (
    FIXED_MODES,
    KINDS,
    Plan,
    RegionPlan,
    family,
    fixed_modes,
    learning_peak,
    make_plan,
)
from .tuner import DEFAULT_BUDGET_SHARE, Phase, Planner, default_budget_text

__all__ = [
    "Planner",
    "Phase",
    "Machine",
    "OpRecord",
    "RegionRecord",
    "Explanation",
    "Plan",
    "RegionPlan",
    "Costs",
    "make_plan",
    "fixed_modes",
    "FIXED_MODES",
    "transient_bytes",
    "learning_peak",
    "family",
    "KINDS",
    "explain_records",
    "worth_saving",
    "skipped_ops",
    "region_skipped",
    "SKIPPED_REASON",
    "op_flops",
    "output_tensors",
    "storage_bytes",
    "is_compute_bound",
    "input_signature",
    "ctx_offload_info",
    "keeps_on_host",
    "region_offload_info",
    "machine_for",
    "default_budget_text",
    "HIGH_WATER",
    "REGION_POOL_SHARE",
    "DEFAULT_BUDGET_SHARE",
]

# The process's calibrated machines live here, on the package, so that ``spillover.planner.
# _machines`` is the cache machine_for reads (tests replace or fill it).
_machines: Dict[str, Machine] = {}
_machines_lock = threading.Lock()


def machine_for(device: str) -> Machine:
    """This process's :class:`Machine` for ``device``: calibrated on first use, then cached on
    disk (``python -m spillover bench`` does the same ahead of time)."""
    with _machines_lock:
        m = _machines.get(device)
        if m is None:
            from .. import calibrate

            # First use is often inside a training step (a selective region's first call): the
            # measurements' random tensors must not move torch's RNG, or every dropout mask
            # drawn after them differs from the plain run's.
            dev = torch.device(device)
            with torch.random.fork_rng(
                devices=[] if dev.type == "cpu" else [_device_index(dev)],
                device_type="cuda" if dev.type == "cpu" else dev.type,
            ):
                cal = calibrate.calibrate(device=device)
            m = _machines[device] = Machine.from_calibration(cal, device)
        return m

