"""Selective recompute: ``checkpoint(fn, *args, policy=...)`` and ``wrap(model, policy=...)``.

Built on ``torch.utils.checkpoint`` (non-reentrant) with a ``context_fn`` of two dispatch modes
of our own (modes.py): the forward saves the outputs the policy keeps, the backward re-runs the
region and returns them. Gradients are bitwise those of the region run plainly.

Policies (policies.py; each a :class:`RegionPolicy`)
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

Where the notes live
    modes.py      Note [SAC bypasses saved-tensor hooks], [after the last save],
                  [outputs only saved ops read], [replay matching]
    ops.py        Note [never saved]
    policies.py   Note [torch.compile]
    region.py     ``checkpoint``; blocks.py ``wrap`` / ``unwrap``; report.py ``explain``
"""

from __future__ import annotations

from ..planner import Planner
from .blocks import _CountingHooks, _find_blocks, _WrappedBlock, _WrapState, unwrap, wrap
from .modes import _ReplayMode, _Run, _Saved, _SaveMode, _Skip
from .ops import forced as _forced
from .policies import (
    FULL,
    OFFLOAD,
    POLICIES,
    Policy,
    RegionPolicy,
    SelectivePolicy,
    _CallablePolicy,
    _StaticPolicy,
    resolve_policy,
)
from .region import _checkpoint, checkpoint
from .report import explain

__all__ = [
    "checkpoint",
    "wrap",
    "unwrap",
    "explain",
    "SelectivePolicy",
    "RegionPolicy",
    "Planner",
    "POLICIES",
    "Policy",
]

# Private names kept importable from here (tests reach into them).
_PRIVATE = (_CallablePolicy, _CountingHooks, _ReplayMode, _Run, _SaveMode, _Saved, _Skip,
            _StaticPolicy, _WrapState, _WrappedBlock, _checkpoint, _find_blocks, _forced, FULL,
            OFFLOAD, resolve_policy)
